"""A converted model fine-tuned on a CPU: rows and evaluation batches chosen for a laptop, said in one note, and
every value the user gives kept; an evaluation that takes a while reports its progress."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from test_families import CHATML_MARKED, CHATS, random_model  # noqa: E402

from nanogpt_cli.config import GPTConfig  # noqa: E402
from nanogpt_cli.lora import LoRAConfig  # noqa: E402
from nanogpt_cli.training import plan as planning  # noqa: E402
from nanogpt_cli.training.finetune import plan_finetune  # noqa: E402
from nanogpt_cli.training.request import RunRequest  # noqa: E402

pytestmark = pytest.mark.slow  # transformers builds the random model

SMOLLM2_135M = GPTConfig(  # the real model's shape: its weights are never built here
    vocab_size=49152, block_size=8192, n_layer=30, n_head=9, n_kv_head=3, n_embd=576, mlp="swiglu", mlp_hidden=1536
)


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """A SmolLM2-shaped random model with a context of 2,048 tokens, and chats prepared with its tokenizer."""
    from nanogpt_cli.data.chat import prepare_chat

    root = tmp_path_factory.mktemp("smol")
    random_model("smollm2", root / "hf", max_position_embeddings=2048)
    src, template = root / "chats.jsonl", root / "chatml.jinja"
    src.write_text("\n".join(json.dumps({"messages": CHATS[i % 2]}) for i in range(40)) + "\n", encoding="utf-8")
    template.write_text(CHATML_MARKED, encoding="utf-8")
    prepare_chat(
        str(src), "chats", data_dir=str(root / "data"), tokenizer=str(root / "hf"), chat_template=str(template)
    )
    return root


def plan(smol, tmp_path, **flags):
    values = dict(data="chats", data_dir=str(smol / "data"), dtype="float32", device="cpu", **flags)
    return plan_finetune(
        RunRequest(values, out=tmp_path / "run", init_from=str(smol / "hf")), lora=LoRAConfig(r=2)
    ).plan


def cpu_notes(p) -> list[str]:
    return [n for n in p.notes if "defaults on a CPU" in n]


def test_the_weights_counted_from_the_config_are_the_models_matmul_weights(smol):
    from nanogpt_cli.interop.loading import load_model

    model = load_model(str(smol / "hf"))[0]
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert planning.matmul_weights(model.config) == linear
    assert round(planning.matmul_weights(SMOLLM2_135M) / 1e6, 1) == 134.5


def test_rows_follow_the_models_size(smol):
    """About 1,024 tokens of a 135M model an update: SmolLM2-135M gets one row of 1,024, a model 4.6 times smaller
    four (rounded down), a model eight times larger still one; never above the default."""
    assert planning.cpu_rows(SMOLLM2_135M, 1024, 12) == 1
    smaller = GPTConfig(**{**SMOLLM2_135M.to_dict(), "n_layer": 7, "vocab_size": 8192})
    assert round(planning.matmul_weights(SMOLLM2_135M) / planning.matmul_weights(smaller), 2) == 4.56
    assert planning.cpu_rows(smaller, 1024, 12) == 4 and planning.cpu_rows(smaller, 256, 12) == 12
    assert planning.cpu_rows(GPTConfig(**{**SMOLLM2_135M.to_dict(), "n_layer": 300}), 1024, 12) == 1


def test_a_converted_model_on_a_cpu_gets_laptop_defaults_said_in_one_note(smol, tmp_path, monkeypatch):
    """The tiny model counted as twice the reference model's work per token: 1,024 tokens an update make one
    row of its --seq-len 1024 (half a row rounds up to one); evaluations of 2 batches a split; one note."""
    weights = planning.matmul_weights(plan(smol, tmp_path, eval_iters=1, batch_size=1).model)
    monkeypatch.setattr(planning, "CPU_REFERENCE_WEIGHTS", weights // 2)
    p = plan(smol, tmp_path)
    assert (p.train.batch_size, p.seq_len, p.train.eval_iters) == (1, 1024, 2)
    assert cpu_notes(p) == [
        "--batch-size 1, --eval-iters 2: a converted model's defaults on a CPU, updates of 1 row of 1,024 tokens "
        "and evaluations of 2 such batches a split (give --batch-size or --eval-iters to choose)"
    ]
    monkeypatch.setattr(planning, "CPU_REFERENCE_WEIGHTS", weights * 2)  # now it is half the reference: 2 rows
    p = plan(smol, tmp_path, seq_len=512)  # of the --seq-len given: 4 rows
    assert (p.train.batch_size, p.seq_len, p.train.eval_iters) == (4, 512, 2)


def test_every_value_the_user_gives_stays_theirs(smol, tmp_path, monkeypatch):
    weights = planning.matmul_weights(plan(smol, tmp_path, eval_iters=1, batch_size=1).model)
    monkeypatch.setattr(planning, "CPU_REFERENCE_WEIGHTS", weights // 2)
    given = plan(smol, tmp_path, batch_size=12, eval_iters=20)  # the defaults elsewhere, given: kept
    assert (given.train.batch_size, given.train.eval_iters) == (12, 20) and not cpu_notes(given)
    one = plan(smol, tmp_path, batch_size=3)  # the other is still chosen, and only it is said
    assert (one.train.batch_size, one.train.eval_iters) == (3, 2)
    assert cpu_notes(one)[0].startswith("--eval-iters 2: ") and "(give --eval-iters to choose)" in cpu_notes(one)[0]
    preset = plan(smol, tmp_path, preset="tiny")  # a preset's values are the user's choice too
    assert (preset.train.batch_size, preset.train.eval_iters) == (8, 4) and not cpu_notes(preset)


def test_the_chosen_defaults_train_and_evaluate_on_batches_of_their_size(smol, tmp_path, monkeypatch):
    from nanogpt_cli.training.finetune import plan_finetune
    from nanogpt_cli.training.request import RunRequest
    from nanogpt_cli.training.trainer import Trainer

    weights = planning.matmul_weights(plan(smol, tmp_path, eval_iters=1, batch_size=1).model)
    monkeypatch.setattr(planning, "CPU_REFERENCE_WEIGHTS", weights * 2)
    values = dict(data="chats", data_dir=str(smol / "data"), dtype="float32", device="cpu", seq_len=64)
    values.update(max_iters=1, warmup_iters=0)
    job = plan_finetune(RunRequest(values, out=tmp_path / "run", init_from=str(smol / "hf")), lora=LoRAConfig(r=2))
    assert (job.plan.train.batch_size, job.plan.train.eval_iters) == (12, 2)  # 2,048 tokens: the default's 12 at most
    trainer = Trainer(job.plan, trainable=job.trainable)
    trainer.fit()
    assert [x.shape for x, _ in trainer.parts.eval_sets["val"]] == [(12, 64)] * 2
