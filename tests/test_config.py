"""Configs: presets, TOML files, type and value errors named by their flags."""

import pytest

from nanogpt_cli.config import PRESETS, GPTConfig, build_configs, load_toml, preset_values, split_values
from nanogpt_cli.errors import NanoGPTError


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds(name):
    model_cfg, train_cfg = build_configs({**preset_values(name), "vocab_size": 65})
    assert model_cfg.vocab_size == 65 and train_cfg.max_iters > 0


def test_named_presets_have_their_shapes():
    m, _ = split_values(preset_values("shakespeare-char"))
    assert (m["n_layer"], m["n_head"], m["n_embd"], m["block_size"]) == (6, 6, 384, 256)
    m, _ = split_values(preset_values("gpt2-124m"))
    assert (m["n_layer"], m["n_embd"], m["pos_encoding"]) == (12, 768, "learned")
    with pytest.raises(NanoGPTError, match="unknown preset 'nope'; these exist: tiny"):
        preset_values("nope")


def test_toml_accepts_flat_keys_tables_and_dashes(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('preset = "tiny"\nmax-iters = 10\n[model]\nn_embd = 64\n[train]\nlearning_rate = 3e-4\n')
    assert load_toml(path) == {"preset": "tiny", "max_iters": 10, "n_embd": 64, "learning_rate": 3e-4}


@pytest.mark.parametrize(
    "text,message",
    [
        ("max_iters = [1", "is not valid TOML"),
        ("n_layers = 2", "unknown key(s) in"),
    ],
)
def test_bad_toml_is_one_sentence(tmp_path, text, message):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(NanoGPTError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_toml(path)
    with pytest.raises(NanoGPTError, match="does not exist"):
        load_toml(tmp_path / "missing.toml")


@pytest.mark.parametrize(
    "values,message",
    [
        ({"learning_rate": "fast"}, "--learning-rate must be a number, got 'fast'"),
        ({"n_layer": 2.5}, "--n-layer must be a whole number, got 2.5"),
        ({"compile": 1}, "--compile must be true or false"),
        ({"lr_schedule": "linear"}, "--lr-schedule must be one of cosine, constant, wsd"),
        ({"batch_size": 0}, "--batch-size must be a positive integer"),
        ({"muon_ns_steps": 0}, "--muon-ns-steps must be a positive integer"),
        ({"n_embd": 30, "n_head": 4}, "--n-embd (30) must be divisible by --n-head (4)"),
    ],
)
def test_bad_values_name_their_flag(values, message):
    with pytest.raises(NanoGPTError) as e:
        build_configs(values)
    assert message in str(e.value)


def test_derived_values_are_properties():
    cfg = GPTConfig(n_embd=384, n_head=6)
    assert cfg.head_size == 64 and cfg.hidden_size == 4 * 384


def test_the_example_run_toml_is_valid():
    from pathlib import Path

    from nanogpt_cli.config import build_configs, load_toml, preset_values

    values = load_toml(Path(__file__).resolve().parent.parent / "examples" / "run.toml")
    preset, _ = values.pop("preset"), values.pop("out")
    model, train = build_configs({**preset_values(preset), **values})
    assert (model.n_layer, train.data, train.max_iters) == (4, "shakespeare-char", 2000)


def test_every_config_field_declares_how_a_resume_treats_it():
    import dataclasses

    from nanogpt_cli.config import Needs, Resume, TrainConfig

    for cls in (GPTConfig, TrainConfig):
        for f in dataclasses.fields(cls):
            rule = f.metadata.get("resume")
            assert isinstance(rule, Resume), f"{cls.__name__}.{f.name} declares no resume rule"
            if cls is GPTConfig:  # the architecture: plan.py refuses a change to any of them in one sentence
                assert rule is Resume.FIXED, f.name
            elif rule is Resume.FIXED:  # a training field's refusal is its own sentence
                assert "{given}" in f.metadata["refusal"] and "{saved" in f.metadata["refusal"], f.name
            elif rule is Resume.CHANGES_IF_SET:  # where the run was trained without one: refused, or set aside
                assert f.default is None and "{given}" in f.metadata["refusal"], f.name
                assert "{preset}" in f.metadata["aside"], f.name
            needs = f.metadata.get("needs")
            assert needs is None or (isinstance(needs, Needs) and cls is TrainConfig), f.name
    rules = {f.name: f.metadata["resume"] for f in dataclasses.fields(TrainConfig)}
    assert rules["learning_rate"] is Resume.CHANGES and rules["embedding_lr"] is Resume.CHANGES_IF_SET
    assert (rules["data"], rules["optimizer"]) == (Resume.FIXED, Resume.FIXED)
    assert (rules["data_dir"], rules["stop_at"]) == (Resume.LOCAL, Resume.INVOCATION)


def test_a_fields_needs_decide_whether_its_value_takes_effect():
    from nanogpt_cli.config import TrainConfig, in_use

    untied, tied = GPTConfig(tie_embeddings=False), GPTConfig()
    assert in_use(TrainConfig(embedding_lr=0.05), "embedding_lr", untied)
    assert not in_use(TrainConfig(embedding_lr=0.05), "embedding_lr", tied)  # the head's rate: --learning-rate
    assert not in_use(TrainConfig(), "embedding_lr", untied)  # not set
    assert in_use(TrainConfig(max_time=5.0), "max_time", tied)  # no needs declared
