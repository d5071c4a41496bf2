"""DPO: the loss and its gradient against the paper's formula, LoRA's adapters-off reference, the full fine-tune's
stored reference, a short run that raises preference accuracy, exact resume and the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch

from nanogpt_cli import device
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.lora import LoRAConfig, add_lora
from nanogpt_cli.model import GPT
from nanogpt_cli.training.dpo import DPO, dpo_loss
from nanogpt_cli.training.events import NoDisplay
from nanogpt_cli.training.finetune import plan_finetune
from nanogpt_cli.training.policy import adapters_off
from nanogpt_cli.training.request import RunRequest
from nanogpt_cli.training.trainer import Trainer
from conftest import tiny_config, tiny_plan


def paper_dpo(pc, pr, rc, rr, beta):
    """Rafailov et al. (2023), eq. 7, one pair at a time: -log sigma(beta log(pi_w/ref_w) - beta log(pi_l/ref_l))."""
    losses = []
    for i in range(len(pc)):
        z = beta * (pc[i] - rc[i]) - beta * (pr[i] - rr[i])
        losses.append(-torch.log(1 / (1 + torch.exp(-z))))
    return sum(losses) / len(losses)


def test_dpo_loss_and_gradient_equal_the_papers_formula():
    g = torch.Generator().manual_seed(0)
    pc, pr = torch.randn(5, generator=g, requires_grad=True), torch.randn(5, generator=g, requires_grad=True)
    rc, rr = torch.randn(5, generator=g), torch.randn(5, generator=g)
    loss, chosen, rejected = dpo_loss(pc, pr, rc, rr, beta=0.3)
    (ours_c, ours_r) = torch.autograd.grad(loss, (pc, pr))
    pc2, pr2 = pc.detach().clone().requires_grad_(), pr.detach().clone().requires_grad_()
    ref = paper_dpo(pc2, pr2, rc, rr, 0.3)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(ours_c, pc2.grad)
    torch.testing.assert_close(ours_r, pr2.grad)
    # the gradient's closed form: -beta sigma(-z) / B for chosen (the paper's eq. 8)
    z = 0.3 * ((pc - rc) - (pr - rr)).detach()
    torch.testing.assert_close(ours_c, -0.3 * torch.sigmoid(-z) / 5)
    torch.testing.assert_close(chosen, 0.3 * (pc - rc).detach())
    torch.testing.assert_close(rejected, 0.3 * (pr - rr).detach())


def test_ipo_loss_is_the_squared_distance_to_one_over_two_beta():
    pc, pr, rc, rr = (torch.tensor([v]) for v in (-1.0, -2.0, -1.5, -1.5))
    loss, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="ipo")
    assert loss.item() == pytest.approx((1.0 - 1 / (2 * 0.5)) ** 2)
    with pytest.raises(NanoGPTError, match="--loss-type"):
        dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="hinge")


def test_adapters_off_reference_equals_the_base_exactly():
    torch.manual_seed(0)
    base = GPT(tiny_config())
    x = torch.randint(0, 61, (2, 12))
    want, _ = base(x)
    model = GPT(tiny_config())
    model.load_state_dict(base.state_dict())
    add_lora(model, LoRAConfig(r=4, targets=("attn.c_attn", "mlp.c_fc")))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()  # trained adapters: the outputs differ from the base's
    on, _ = model(x)
    assert not torch.equal(on, want)
    with adapters_off(model):
        off, _ = model(x)
    assert torch.equal(off, want)
    again, _ = model(x)
    assert torch.equal(again, on)  # switched back on


def pairs_file(path, n=48):
    """Pairs of right (chosen) and wrong (rejected) answers to 'a+b', in TRL's conversational shape."""
    rows = []
    for i in range(n):
        a, b = i % 4, (i // 4) % 3
        prompt = [{"role": "user", "content": f"{a}+{b}"}]
        rows.append(
            {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": str(a + b)}],
                "rejected": [{"role": "assistant", "content": str(a + b + 1)}],
            }
        )
    path.write_text("\n".join(map(json.dumps, rows)) + "\n")
    return path


@pytest.fixture(scope="module")
def dpo_data(tmp_path_factory):
    from nanogpt_cli.data.chat import prepare_chat
    from nanogpt_cli.data.preference import prepare_rows

    root = tmp_path_factory.mktemp("dpo")
    prepare_rows(str(pairs_file(root / "pairs.jsonl")), "pairs", kind="preference", tokenizer="byte",
                 data_dir=str(root / "data"), val_fraction=0.25)  # fmt: skip
    chats = root / "chats.jsonl"
    rows = [{"prompt": "1+1", "completion": "2"}, {"prompt": "2+2", "completion": "4"}]
    chats.write_text("\n".join(map(json.dumps, rows)) + "\n")
    prepare_chat(str(chats), "chats", data_dir=str(root / "data"), tokenizer="byte")
    base = root / "base"
    Trainer(tiny_plan(root / "data", "chats", base, max_iters=2, eval_interval=2, eval_iters=1, block_size=32)).fit()
    return root


def dpo_job(root, out, lora=None, resume=False, **flags):
    values = dict(data="pairs", data_dir=str(root / "data"), dtype="float32", device="cpu", max_iters=8)
    values.update(eval_interval=4, batch_size=8, warmup_iters=0, learning_rate=3e-3, log_interval=1, **flags)
    init = None if resume else str(root / "base")
    return plan_finetune(RunRequest(values, out=out, init_from=init, resume=resume), lora=lora)


@pytest.mark.parametrize("lora", [None, LoRAConfig(r=4)], ids=["full", "lora"])
def test_dpo_raises_preference_accuracy(dpo_data, tmp_path, lora):
    records = []
    run = DPO(dpo_job(dpo_data, tmp_path / "run", lora=lora, max_iters=12), {"beta": 0.5}, records.append)
    result = run.fit()
    evals = [r for r in records if r["kind"] == "eval"]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert evals[0]["val_loss"] == pytest.approx(math.log(2), abs=1e-5)  # policy = reference at the start
    assert result.val_accuracy >= evals[0]["val_accuracy"]
    train = [r for r in records if r["kind"] == "train"]
    assert {"loss", "reward_chosen", "reward_rejected", "margin"} <= set(train[0])
    assert train[-1]["margin"] > 0
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["finetune"]["objective"] == "dpo" and config["finetune"]["settings"]["beta"] == 0.5
    if lora is None:  # the reference's log-probabilities were kept beside the dataset
        assert list((dpo_data / "data" / "pairs").glob("reference-*.json"))


def test_dpo_resume_continues_exactly(dpo_data, tmp_path):
    whole = []
    DPO(dpo_job(dpo_data, tmp_path / "a"), None, whole.append).fit()
    part = []
    DPO(dpo_job(dpo_data, tmp_path / "b", stop_at=4), None, part.append).fit()
    DPO(dpo_job(dpo_data, tmp_path / "b", resume=True), None, part.append).fit()
    losses = [r["loss"] for r in whole if r["kind"] == "train"]
    assert [r["loss"] for r in part if r["kind"] == "train"] == losses
    with pytest.raises(NanoGPTError, match="--beta"):
        DPO(dpo_job(dpo_data, tmp_path / "b", resume=True, max_iters=10), {"beta": 0.9})


def test_a_dpo_resume_keeps_the_thread_count_it_saved_over_an_automatic_choice(dpo_data, tmp_path):
    before = torch.get_num_threads()
    DPO(dpo_job(dpo_data, tmp_path / "run", stop_at=4), None).fit()
    saved = json.loads((tmp_path / "run" / "trainer.json").read_text())["threads"]
    assert saved == before
    hints = []

    class Hints(NoDisplay):
        def on_hint(self, text):
            hints.append(text)

    try:  # the load chose another count this time, as set_threads(None) does on a busy machine
        torch.set_num_threads(saved + 1)
        device._chosen = device.ThreadChoice(saved + 1, saved + 1, None, None, "auto")
        DPO(dpo_job(dpo_data, tmp_path / "run", resume=True), None, display=Hints()).fit()
        assert torch.get_num_threads() == saved and hints and f"threads: {saved}, as this run last" in hints[0]
    finally:
        torch.set_num_threads(before)
        device._chosen = None


def test_a_signal_stops_dpo_after_its_step_with_a_save_and_the_resume_continues_exactly(dpo_data, tmp_path):
    import os
    import signal

    from nanogpt_cli.training.events import NoDisplay

    class SigtermAtStep3(NoDisplay):  # a real SIGTERM to this process, as the run logs step 3
        def on_step(self, event):
            if event.step == 3:
                os.kill(os.getpid(), signal.SIGTERM)

    whole = []
    DPO(dpo_job(dpo_data, tmp_path / "a"), None, whole.append).fit()
    part = []
    stopped = DPO(dpo_job(dpo_data, tmp_path / "b"), None, part.append, SigtermAtStep3()).fit()
    assert stopped.stopped == "SIGTERM" and stopped.step == 3
    assert json.loads((tmp_path / "b" / "trainer.json").read_text())["step"] == 3  # saved between evaluations
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are put back
    DPO(dpo_job(dpo_data, tmp_path / "b", resume=True), None, part.append).fit()
    losses = [r["loss"] for r in whole if r["kind"] == "train"]
    assert [r["loss"] for r in part if r["kind"] == "train"] == losses


def test_dpo_refuses_a_chat_dataset(dpo_data, tmp_path):
    job = plan_finetune(
        RunRequest(
            dict(data="chats", data_dir=str(dpo_data / "data"), dtype="float32", device="cpu"),
            out=tmp_path / "x",
            init_from=str(dpo_data / "base"),
        )
    )
    with pytest.raises(NanoGPTError, match="--format preference"):
        DPO(job)


def test_dpo_refuses_seq_len_it_scores_each_pair_whole(dpo_data, tmp_path):
    with pytest.raises(NanoGPTError, match=r"^--seq-len has no effect with --method dpo, .*; drop it$"):
        dpo_job(dpo_data, tmp_path / "x", seq_len=16)


def load_file_tensors(path):
    from safetensors.torch import load_file

    return load_file(str(path)).items()


def test_cli_prepare_preference_and_finetune_dpo(dpo_data, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from nanogpt_cli.cli.app import app

    monkeypatch.chdir(tmp_path)
    src = pairs_file(tmp_path / "pairs.jsonl", n=8)
    src.write_text(src.read_text() + "not json\n")
    runner = CliRunner()
    r = runner.invoke(app, ["prepare", str(src), "--name", "p", "--format", "preference", "--tokenizer", "byte"])
    assert r.exit_code == 0, r.output
    assert "skipped line 9: not valid JSON" in r.output and "8 pairs" in r.output
    args = ["finetune", "--method", "dpo", "--init-from", str(dpo_data / "base"), "--data", "p", "--lora"]
    args += ["--max-iters", "2", "--batch-size", "2", "--dtype", "float32", "--beta", "0.2", "--rpo-alpha", "0.5"]
    args += ["--out", "run"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    # train's display: start lines (LoRA's trainable parameters among them), progress, evaluations, a table
    lines = r.output.splitlines()
    lora = next(line for line in lines if line.startswith("fine-tune: DPO, LoRA r 8, alpha 16 on attn.c_attn; "))
    trainable = sum(p.numel() for n, p in load_file_tensors(tmp_path / "run" / "model.safetensors") if "lora_" in n)
    assert f"{trainable:,} trainable params" in lora
    assert "batch: 2 preference pairs per step; sigmoid loss, beta 0.2, rpo alpha 0.5" in r.output
    assert any(line.startswith("step 2/2 | loss ") for line in lines)
    assert any(line.startswith("step 2: val loss ") and "val accuracy" in line for line in lines)
    assert "dpo run run" in r.output and "val preference accuracy" in r.output and "ms/iter" in r.output
    assert json.loads((tmp_path / "run" / "config.json").read_text())["finetune"]["settings"]["rpo_alpha"] == 0.5
    # the report card: DPO's own figures, not a language model's bits per byte
    report = (tmp_path / "run" / "report.md").read_text()
    assert "report: run/report.md" in r.output and report.startswith("# Report: run\n\nfinished at step 2.")
    assert "## Scores (val: step 2)" in report and "| val preference accuracy | " in report
    assert "| train reward margin (chosen - rejected) | " in report and "bits per byte" not in report
    r = runner.invoke(app, [*args[:-2], "--out", "run2", "--group-size", "4"])
    assert r.exit_code == 1 and "--group-size has no effect with --method dpo" in r.output
    r = runner.invoke(app, [*args[:-2], "--out", "run3", "--gradient-accumulation-steps", "4"])
    assert r.exit_code == 1 and "drop --gradient-accumulation-steps 4" in r.output
    r = runner.invoke(app, [*args[:-2], "--out", "run4", "--compile"])
    assert r.exit_code == 1 and "drop --compile" in r.output
    r = runner.invoke(app, ["finetune", "--method", "ppo", "--init-from", str(dpo_data / "base"), "--data", "p"])
    assert r.exit_code == 1 and "--method" in r.output


def test_a_dpo_run_ended_by_the_clock_saves_and_has_a_report_that_compares(dpo_data, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from nanogpt_cli.cli.app import app

    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    args = ["finetune", "--method", "dpo", "--init-from", str(dpo_data / "base"), "--data", "pairs", "--data-dir"]
    args += [str(dpo_data / "data"), "--lora", "--batch-size", "2", "--dtype", "float32", "--no-plot"]
    r = runner.invoke(app, [*args, "--max-iters", "2", "--out", "done"])
    assert r.exit_code == 0, r.output
    clock = ["--max-iters", "2000", "--max-time", "2", "--eval-interval", "5", "--out", "clock"]  # 2000: a minute
    r = runner.invoke(app, [*args, *clock])
    assert r.exit_code == 0, r.output
    step = json.loads((tmp_path / "clock" / "trainer.json").read_text())["step"]  # saved at the clock's end
    assert 2 < step < 2000 and f"ended at step {step:,}: --max-time 2 s was spent" in r.output
    report = (tmp_path / "clock" / "report.md").read_text()
    assert f"ended by the clock (--max-time 2 s spent) at step {step:,}." in report and "## Samples" in report
    r = runner.invoke(app, ["report", "done", "clock"])
    assert r.exit_code == 0, r.output
    row = next(line for line in r.output.splitlines() if "val preference accuracy" in line)
    assert row.count("0.") + row.count("1.0") >= 2, row  # a value for each run


def test_dpo_starts_from_a_hugging_face_folder(dpo_data, tmp_path):
    from test_export import save_random_gpt2

    from nanogpt_cli.data import load_meta

    save_random_gpt2(tmp_path / "gpt2", load_meta(dpo_data / "data", "pairs")["tokenizer"])
    values = dict(data="pairs", data_dir=str(dpo_data / "data"), dtype="float32", device="cpu", max_iters=4)
    values.update(eval_interval=4, batch_size=4, warmup_iters=0, learning_rate=3e-3)
    job = plan_finetune(
        RunRequest(values, out=tmp_path / "run", init_from=str(tmp_path / "gpt2")), lora=LoRAConfig(r=4)
    )
    records = []
    result = DPO(job, None, records.append).fit()
    assert result.step == 4 and records[0]["val_loss"] == pytest.approx(math.log(2), abs=1e-5)
    record = json.loads((tmp_path / "run" / "config.json").read_text())["finetune"]
    assert record["weights"]["base"]["sha256"]  # a LoRA run records its base as any LoRA run does


def test_dpo_from_a_long_context_converted_base_plans_no_seq_len_and_resumes(dpo_data, tmp_path):
    """The 1,024-token default of a converted model is for windowed data; DPO scores each pair whole."""
    from nanogpt_cli.config import GPTConfig
    from nanogpt_cli.data import load_meta
    from nanogpt_cli.runs.checkpoint import save_model

    meta = load_meta(dpo_data / "data", "pairs")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=meta["vocab_size"], block_size=2048, n_layer=1, n_head=2, n_embd=16))
    base = tmp_path / "base.safetensors"
    save_model(base, model, {"tokenizer": meta["tokenizer"], "hf_family": "llama"})
    values = dict(data="pairs", data_dir=str(dpo_data / "data"), dtype="float32", device="cpu", max_iters=2)
    values.update(eval_interval=1, eval_iters=1, batch_size=4, warmup_iters=0)
    job = plan_finetune(RunRequest({**values, "stop_at": 1}, out=tmp_path / "run", init_from=str(base)))
    assert job.plan.train.seq_len is None and not [n for n in job.plan.notes if "--seq-len" in n]
    DPO(job).fit()
    config = tmp_path / "run" / "config.json"
    saved = json.loads(config.read_text())
    saved["train"]["seq_len"] = 1024  # as an earlier planner saved it: not the user's, so not refused
    config.write_text(json.dumps(saved))
    assert DPO(plan_finetune(RunRequest(values, out=tmp_path / "run", resume=True))).fit().step == 2
