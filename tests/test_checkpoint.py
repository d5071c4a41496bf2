"""Checkpoint files: weights and optimizer round trips, tied weights, atomic writes, invalid files."""

import json
import os

import pytest
import torch

from nanogpt_cli import checkpoint as ckpt
from nanogpt_cli.config import GPTConfig
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.model import GPT
from nanogpt_cli.train import plan_run, train
from conftest import tiny_config, tiny_plan


def tiny(**kw):
    return GPT(tiny_config(**kw))


@pytest.mark.parametrize("tie", [True, False])
def test_save_load_gives_identical_logits_and_keeps_ties(tmp_path, tie):
    torch.manual_seed(0)
    model = tiny(tie_embeddings=tie, pos_encoding="learned", bias=True)
    path = tmp_path / "m.safetensors"
    ckpt.save_model(path, model, {"step": 7, "tokenizer": {"name": "byte", "vocab_size": 256}})
    loaded, meta = ckpt.load_model(path)
    assert meta["step"] == 7 and meta["tokenizer"]["name"] == "byte" and meta["format"] == "nanogpt"
    assert loaded.config == model.config
    x = torch.randint(0, 50, (2, 16))
    assert torch.equal(loaded(x)[0], model(x)[0])
    assert (loaded.lm_head.weight is loaded.transformer.wte.weight) == tie


def test_optimizer_state_round_trips(tmp_path):
    torch.manual_seed(0)
    model = tiny()
    opt = torch.optim.AdamW(model.optimizer_groups(0.1), lr=1e-3)
    model(torch.randint(0, 50, (2, 8)), torch.randint(0, 50, (2, 8)))[1].backward()
    opt.step()
    ckpt.save_optimizer(tmp_path / "o.safetensors", opt, step=3)
    other = torch.optim.AdamW(model.optimizer_groups(0.5), lr=9.0)
    assert ckpt.load_optimizer(tmp_path / "o.safetensors", other) == 3
    a, b = opt.state_dict(), other.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for i, state in a["state"].items():
        for key, value in state.items():
            assert torch.equal(value, b["state"][i][key]), key


def test_a_failed_write_keeps_the_previous_file(tmp_path):
    path = tmp_path / "f.json"
    ckpt.write_json(path, {"v": 1})

    def broken(tmp):
        tmp.write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        ckpt.atomic_write(path, broken)
    assert json.loads(path.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_rng_state_round_trips():
    state = torch.get_rng_state()
    assert torch.equal(ckpt.decode_rng(ckpt.encode_rng(state)), state)


def test_run_folders_resolve_to_best_then_last(tmp_path):
    model = tiny()
    ckpt.save_model(tmp_path / "model.safetensors", model, {"step": 2})
    assert ckpt.resolve_weights(tmp_path) == tmp_path / "model.safetensors"
    ckpt.save_model(tmp_path / "best.safetensors", model, {"step": 1})
    assert ckpt.resolve_weights(tmp_path) == tmp_path / "best.safetensors"
    assert ckpt.resolve_weights(tmp_path, last=True) == tmp_path / "model.safetensors"
    with pytest.raises(NanoGPTError, match="does not exist; runs in"):
        ckpt.resolve_weights(tmp_path.parent / "nope")


def metrics(run_dir):
    """The evaluation lines of metrics.jsonl (train-step lines have kind "train")."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if m.get("kind", "eval") == "eval"]


def test_a_save_cut_short_between_its_renames_resumes_from_the_previous_one(char_data, tmp_path):
    data_dir, name = char_data
    whole = tmp_path / "whole"
    train(tiny_plan(data_dir, name, whole, max_iters=6, eval_interval=2))
    run = tmp_path / "run"
    train(tiny_plan(data_dir, name, run, max_iters=6, eval_interval=2, stop_at=2))
    # a crash after the step-4 weights and optimizer were renamed into place, before trainer.json was
    for fname in ("model.safetensors", "optimizer.safetensors"):
        os.link(run / fname, run / f".{fname}.prev")
    train(tiny_plan(data_dir, name, tmp_path / "ahead", max_iters=6, eval_interval=2, stop_at=4))
    for fname in ("model.safetensors", "optimizer.safetensors"):
        os.replace(tmp_path / "ahead" / fname, run / fname)
    result = train(plan_run({}, out=run, resume=True))
    assert result.step == 6
    assert metrics(run) == [dict(m, elapsed_s=p["elapsed_s"]) for m, p in zip(metrics(whole), metrics(run))]
    (run / "trainer.json").write_text(json.dumps(dict(json.loads((run / "trainer.json").read_text()), step=3)))
    with pytest.raises(NanoGPTError, match="model.safetensors is from step 6, not the trainer's step 3"):
        train(plan_run({}, out=run, resume=True))
