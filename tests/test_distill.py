"""Distillation: the loss against a reference computation (top-k with its rest bucket, and the full vocabulary),
a teacher read live and from prepare --teacher's shards giving the same loss, exact resume (with on-policy rows),
the on-policy rows themselves, a teacher with another tokenizer, and the commands end to end."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from nanogpt_cli import api
from nanogpt_cli.data.batches import Batches
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.interop.loading import load_model
from nanogpt_cli.training.distill import (
    DistillLoss,
    DistillSettings,
    label_dataset,
    mixed_loss,
    plan_distill,
    teacher_targets,
)
from nanogpt_cli.training.request import RunRequest
from nanogpt_cli.training.trainer import Trainer
from conftest import tiny_plan


@pytest.fixture(scope="module")
def teacher_run(char_data, tmp_path_factory):
    """A tiny char model trained a few steps: a teacher that shares char_data's tokenizer."""
    data_dir, name = char_data
    run = tmp_path_factory.mktemp("teacher") / "teacher"
    Trainer(tiny_plan(data_dir, name, run, max_iters=8, eval_interval=8, eval_iters=1, learning_rate=3e-2)).fit()
    return run


@pytest.fixture(scope="module")
def labeled(char_data, teacher_run, tmp_path_factory):
    """char_data's text prepared again and labeled by the teacher (top-5 at temperature 0.5, chunks of 16):
    (data_dir, name)."""
    from nanogpt_cli.data import load_meta, prepare

    data_dir, name = char_data
    root = tmp_path_factory.mktemp("labeled") / "data"
    source = tmp_path_factory.getbasetemp() / "play-again.txt"
    chars = load_meta(data_dir, name)["tokenizer"]["chars"]
    from conftest import make_text

    source.write_text(make_text(lines=600, seed=1), encoding="utf-8")
    prepare(str(source), "taught", tokenizer="char", data_dir=root)
    assert load_meta(root, "taught")["tokenizer"]["chars"] == chars  # the teacher's tokenizer
    label_dataset(root, "taught", str(teacher_run), top_k=5, temperature=0.5, context=16)
    return root, "taught"


def reference_loss(student, teacher, targets, k, T, alpha):
    """The loss written out in float64, position by position: KL over the top-k and one rest bucket (k = 0: every
    token), times T^2, mixed with the cross-entropy."""
    s, t = student.double(), teacher.double()
    kls, ces = [], []
    for b in range(s.size(0)):
        for i in range(s.size(1)):
            q, p = torch.softmax(s[b, i] / T, -1), torch.softmax(t[b, i] / T, -1)
            if k:
                top = sorted(range(len(p)), key=lambda j: -float(p[j]))[:k]
                rest = [j for j in range(len(p)) if j not in top]
                p = torch.stack([p[j] for j in top] + [p[rest].sum()])
                q = torch.stack([q[j] for j in top] + [q[rest].sum()])
            kls.append(sum(float(pj) * math.log(float(pj) / float(qj)) for pj, qj in zip(p, q) if pj > 0))
            ces.append(-math.log(float(torch.softmax(s[b, i], -1)[targets[b, i]])))
    return alpha * T * T * sum(kls) / len(kls) + (1 - alpha) * sum(ces) / len(ces)


def dense_loss(student, teacher, targets, k, T, alpha):
    """The same loss through autograd, on the whole vocabulary at once (its gradient is the reference)."""
    logq, p = (student / T).log_softmax(-1), (teacher / T).softmax(-1)
    if k:
        top = p.topk(k, -1).indices
        off = torch.ones_like(p, dtype=torch.bool).scatter(-1, top, False)
        p = torch.cat([p.gather(-1, top), (p * off).sum(-1, keepdim=True)], -1)
        logq = torch.cat([logq.gather(-1, top), logq.masked_fill(~off, -math.inf).logsumexp(-1, keepdim=True)], -1)
    kl = (p * (p.log() - logq)).sum(-1).mean()
    ce = torch.nn.functional.cross_entropy(student.reshape(-1, student.size(-1)), targets.reshape(-1))
    return alpha * T * T * kl + (1 - alpha) * ce


@pytest.mark.parametrize("k", [3, 0])
def test_the_loss_and_its_gradient_are_the_reference_computation(k):
    torch.manual_seed(0)
    V = 11
    student, teacher = torch.randn(2, 5, V) * 2, torch.randn(2, 5, V) * 2
    targets = torch.randint(0, V, (2, 5))
    ids, probs = teacher_targets(teacher, k, 2.0, V)
    z = student.clone().requires_grad_()
    got = mixed_loss(z, targets, ids, probs, 2.0, 0.7, V)
    got.backward()
    assert got.item() == pytest.approx(reference_loss(student, teacher, targets, k, 2.0, 0.7), rel=1e-5)
    z64 = student.double().requires_grad_()
    dense_loss(z64, teacher.double(), targets, k, 2.0, 0.7).backward()
    assert torch.allclose(z.grad.double(), z64.grad, rtol=1e-4, atol=1e-7)
    # a student equal to its teacher is at KL 0 whatever k: only the cross-entropy is left
    ids, probs = teacher_targets(student, k, 2.0, V)
    ce = torch.nn.functional.cross_entropy(student.reshape(-1, V), targets.reshape(-1))
    assert mixed_loss(student, targets, ids, probs, 2.0, 0.7, V).item() == pytest.approx(0.3 * ce.item(), abs=1e-5)


def test_a_teacher_from_shards_gives_the_live_loss(labeled, teacher_run):
    data_dir, name = labeled
    batches = Batches(data_dir, name, 16, 3, torch.device("cpu"), seed=0, teacher=True)
    shard = batches.teacher.shard(0)
    n = len(batches.splits["train"])
    assert shard[0].shape == (n, 5) and shard[0].dtype == np.uint16 and shard[1].dtype == np.float16
    assert shard[0].nbytes + shard[1].nbytes == n * 5 * 4  # 20 bytes per token: 5 ids and 5 probabilities
    starts = [(0, 0), (0, 16), (0, 48)]  # windows at the teacher's chunks, which it read with the same context
    x, taught = batches.load("train", starts)
    teacher, _ = load_model(teacher_run)
    student, _ = load_model(teacher_run)
    student.train()
    vocab = teacher.config.vocab_size
    stored = DistillLoss(5, 0.5, 0.5, 0.0, vocab, None, shards=True)(student, x, taught)
    live = DistillLoss(5, 0.5, 0.5, 0.0, vocab, teacher, shards=False)(student, x, taught.targets)
    assert stored.item() == pytest.approx(live.item(), rel=2e-3)  # the probabilities are stored as float16
    assert stored.item() != pytest.approx(
        DistillLoss(5, 0.5, 0.5, 0.0, vocab, None, shards=True)(
            student, x, taught._replace(probs=taught.probs.flip(-1))
        ).item(),
        rel=2e-3,
    )


def distill_values(data_dir, name, **flags):
    values = dict(preset="tiny", data=name, data_dir=str(data_dir), dtype="float32", device="cpu", max_iters=6)
    values.update(eval_interval=3, eval_iters=1, batch_size=4, log_interval=1, block_size=16)
    return {**values, **flags}


def test_resume_is_exact_with_on_policy_rows(char_data, teacher_run, tmp_path):
    data_dir, name = char_data
    settings = DistillSettings(teacher=str(teacher_run), top_k=4, on_policy_fraction=0.5)
    for out, flags in (("once", {}), ("twice", {"stop_at": 3})):  # the API's door: Training.run holds the loss
        api.plan_finetuning(
            distill_values(data_dir, name, **flags), method="distill", distill=settings, out=tmp_path / out
        ).run()
    resumed = api.plan_finetuning(distill_values(data_dir, name), method="distill", out=tmp_path / "twice", resume=True)
    assert resumed.loss.on_policy == 0.5 and resumed.loss.top_k == 4
    resumed.run()
    a, b = (load_file(str(tmp_path / r / "model.safetensors")) for r in ("once", "twice"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(NanoGPTError, match=r"--distill-top-k \(saved 4, given 8\)"):
        api.plan_finetuning(
            distill_values(data_dir, name), method="distill", distill={"top_k": 8}, out=tmp_path / "twice", resume=True
        )
    with pytest.raises(NanoGPTError, match=r"^--distill-alpha, --on-policy-fraction go with --method distill$"):
        api.plan_finetuning(
            distill_values(data_dir, name), distill={"alpha": 0.3, "on_policy_fraction": 0.1}, out=tmp_path / "twice"
        )
    # train would continue it on the data's cross-entropy alone, without its teacher: refused, naming the command
    said = f"resume it with `nanogpt finetune --method distill --out {tmp_path / 'twice'} --resume`"
    with pytest.raises(NanoGPTError, match=re.escape(said)):
        api.plan_training(out=tmp_path / "twice", resume=True, max_iters=8)


def test_on_policy_rows_are_the_students_and_train_on_the_kl_only(teacher_run):
    student, _ = load_model(teacher_run)
    teacher, _ = load_model(teacher_run)
    loss = DistillLoss(4, 1.0, 0.5, 1.0, teacher.config.vocab_size, teacher, shards=False)
    torch.manual_seed(0)
    x = torch.randint(0, teacher.config.vocab_size, (3, 12))
    y = torch.roll(x, -1, 1)
    rows = torch.tensor([True, False, True])
    x2, y2, kl_mask = loss.student_rows(student, x, y, rows)
    assert torch.equal(x2[1], x[1]) and torch.equal(y2[1], y[1])  # an off-policy row stays the data's
    assert torch.equal(x2[rows, :7], x[rows, :7]) and not torch.equal(x2[rows], x[rows])  # half kept, the rest sampled
    assert (y2[rows] == -1).all() and kl_mask[rows, 6:].all() and not kl_mask[rows, :6].any()
    assert torch.isfinite(loss(student.train(), x, y))


def test_a_teacher_with_another_tokenizer_is_one_sentence(char_data, tmp_path):
    from nanogpt_cli.data import prepare
    from conftest import make_text

    data_dir, name = char_data
    (tmp_path / "t.txt").write_text(make_text(lines=100), encoding="utf-8")
    prepare(str(tmp_path / "t.txt"), "bytes", tokenizer="byte", data_dir=tmp_path / "data")
    other = tmp_path / "other"
    Trainer(tiny_plan(tmp_path / "data", "bytes", other, max_iters=1, eval_interval=1, eval_iters=1)).fit()
    with pytest.raises(
        NanoGPTError, match=r"must share a tokenizer, and they do not \(char in dataset .play. vs byte in the teacher"
    ):
        plan_distill(
            RunRequest(distill_values(data_dir, name), out=tmp_path / "s"), DistillSettings(teacher=str(other))
        )
    with pytest.raises(NanoGPTError, match="must share a tokenizer"):
        label_dataset(data_dir, name, str(other), top_k=2)


def test_the_commands_label_then_distill_from_the_shards(tmp_path, teacher_run, char_data):
    from typer.testing import CliRunner

    from nanogpt_cli.cli.app import app
    from nanogpt_cli.data import load_meta
    from conftest import make_text

    (tmp_path / "t.txt").write_text(make_text(lines=600, seed=1), encoding="utf-8")
    data = str(tmp_path / "data")
    runner = CliRunner()
    prep = ["prepare", str(tmp_path / "t.txt"), "--name", "d", "--tokenizer", "char", "--data-dir", data]
    done = runner.invoke(app, [*prep, "--teacher", str(teacher_run), "--distill-top-k", "3", "--teacher-context", "8"])
    assert done.exit_code == 0, done.output
    assert re.search(r"top-3 at temperature 1: 12 bytes per token", done.output)
    assert load_meta(tmp_path / "data", "d")["teacher"]["top_k"] == 3
    out = str(tmp_path / "student")
    args = ["finetune", "--method", "distill", "--data", "d", "--data-dir", data, "--preset", "tiny", "--out", out]
    args += ["--max-iters", "4", "--eval-interval", "2", "--eval-iters", "1", "--device", "cpu", "--no-plot"]
    ran = runner.invoke(app, [*args, "--block-size", "16", "--distill-alpha", "0.9"])
    assert ran.exit_code == 0, ran.output
    assert f"fine-tune: distilled from {teacher_run} (its labels, top-3, alpha 0.9), full" in ran.output
    assert (tmp_path / "student" / "report.md").is_file()
    refused = runner.invoke(app, [*args, "--block-size", "16", "--distill-top-k", "5", "--force"])
    assert refused.exit_code == 1 and "holds its teacher's labels at --distill-top-k 3" in refused.output
    wrong = runner.invoke(app, ["finetune", "--teacher", str(teacher_run), "--data", "d", "--data-dir", data])
    assert wrong.exit_code == 1 and "--teacher go with --method distill" in wrong.output


def test_a_student_from_a_run_with_lora_trains_its_adapters_only(char_data, teacher_run, tmp_path):
    from nanogpt_cli.lora import LoRAConfig

    data_dir, name = char_data
    values = distill_values(data_dir, name, max_iters=2, eval_interval=2)
    del values["preset"], values["block_size"]  # the architecture is the run's
    job = plan_distill(
        RunRequest(values, out=tmp_path / "s", init_from=str(teacher_run)),
        DistillSettings(teacher=str(teacher_run), top_k=0), lora=LoRAConfig(r=2),
    )  # fmt: skip
    result = Trainer(job.plan, loss=job.loss, trainable=job.trainable).fit()
    assert result.step == 2 and math.isfinite(result.val_loss)
    saved = load_file(str(tmp_path / "s" / "model.safetensors"))
    assert saved and all("lora_" in k for k in saved)  # a LoRA run saves its adapters
    assert job.plan.finetune["method"] == "lora" and job.plan.finetune["distill"]["top_k"] == 0
