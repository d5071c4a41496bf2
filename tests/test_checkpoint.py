"""Checkpoint files: weights and optimizer round trips, tied weights, atomic writes, invalid files."""

import json

import pytest
import torch

from nanogpt_cli import checkpoint as ckpt
from nanogpt_cli.config import GPTConfig
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.model import GPT


def tiny(**kw):
    return GPT(GPTConfig(**{**dict(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32), **kw}))


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
