"""What a command loads: the source parsed once into its type (interop/source.py), the load options declared once
(config.LoadSpec) and generated on every command that loads, threads set in one place, and the API calls those
commands render."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from nanogpt_cli import api
from nanogpt_cli.cli import app, eval, export, generate, inspect, serve
from nanogpt_cli.cli.common import load_options
from nanogpt_cli.config import LoadSpec, load_setting
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.interop.source import GGUFFile, HFFolder, HFHub, LoRARun, RunFolder, WeightsFile, parse_source
from nanogpt_cli.lora import LoRAConfig, add_lora, weights_hash
from nanogpt_cli.model import GPT
from nanogpt_cli.runs import checkpoint as ckpt
from nanogpt_cli.tokenizer import build_tokenizer
from conftest import tiny_config

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()
TOKENIZER = build_tokenizer("char", ["abcdefghij ."])

# every command that loads a model, by its words, and its function (whose `leaves` are the fields it does not take)
LOAD_COMMANDS = {
    "sample": generate.sample,
    "chat": generate.chat,
    "serve": serve.serve,
    "export": export.export,
    "eval perplexity": eval.perplexity,
    "eval tasks": eval.tasks_command,
    "inspect attention": inspect.inspect_attention,
    "inspect heads": inspect.inspect_heads,
    "inspect positions": inspect.inspect_positions,
}


def save_weights(path: Path, seed: int = 0, **meta) -> GPT:
    """A tiny random GPT of our own, saved at path with a char tokenizer."""
    torch.manual_seed(seed)
    model = GPT(tiny_config(vocab_size=TOKENIZER.vocab_size))
    path.parent.mkdir(parents=True, exist_ok=True)
    ckpt.save_model(path, model, {"tokenizer": TOKENIZER.describe(), **meta})
    return model


def save_lora(path: Path, base_path: Path, base: GPT) -> GPT:
    """LoRA adapters (non-zero, so they change the logits) over the weights saved at base_path."""
    model = GPT(base.config)
    model.load_state_dict(base.state_dict())
    cfg = LoRAConfig(r=2, targets=("attn",))
    add_lora(model, cfg)
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if name.endswith("lora_B"):
            p.data.normal_(0, 0.2)
    base_meta = {"source": str(base_path), "sha256": weights_hash(base)}
    ckpt.save_model(path, model, {"tokenizer": TOKENIZER.describe(), "lora": cfg.to_dict(), "base": base_meta})
    return model


def test_each_kind_of_source_is_parsed_once_into_its_type(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a bare name is a run in ./checkpoints
    run = Path("checkpoints/shk")
    save_weights(run / "best.safetensors", step=1)
    base = save_weights(run / "model.safetensors", step=2)
    best, last = parse_source("shk"), parse_source("shk", last=True)
    assert isinstance(best, RunFolder) and best.folder == run and best.weights == run / "best.safetensors"
    assert last.weights == run / "model.safetensors" and last.meta["step"] == 2
    assert best.given == "shk" and best.location == str(run)
    file = parse_source(run / "model.safetensors")
    assert type(file) is WeightsFile and file.meta["step"] == 2
    save_lora(Path("lora.safetensors"), run / "model.safetensors", base)
    lora = parse_source("lora.safetensors")
    assert isinstance(lora, LoRARun) and lora.base.weights == run / "model.safetensors"
    assert lora.base_sha256 == weights_hash(base)
    assert parse_source("hf:gpt2") == HFHub("hf:gpt2", "gpt2")
    Path("m.gguf").write_bytes(b"GGUF" + bytes(60))  # told by its magic: the GGUF reader says what else is wrong
    assert parse_source("m.gguf") == GGUFFile("m.gguf", Path("m.gguf"))
    folder = Path("checkpoints/exported")  # a Hugging Face folder under checkpoints/ is named like a run
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert parse_source("exported") == HFFolder("exported", folder)
    assert parse_source(best) is best  # parsed once: a parsed source passes through


def test_what_names_no_model_is_one_sentence(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("notes.txt").write_text("not a model")
    Path("empty").mkdir()
    kinds = "a source is a run folder or a run's name, a .safetensors file, a .gguf file, a Hugging Face folder"
    cases = {
        "notes.txt": f"notes.txt is not a model: {kinds} or hf:NAME",
        "empty": f"no checkpoint in empty: it holds nothing; {kinds} or hf:NAME",
        "nowhere": "checkpoint nowhere does not exist",
        "hf:": "hf: needs a model name, such as hf:gpt2",
    }
    for given, sentence in cases.items():
        with pytest.raises(NanoGPTError) as e:
            parse_source(given)
        assert str(e.value).startswith(sentence), str(e.value)
        out = runner.invoke(app, ["sample", "--checkpoint", given])
        assert out.exit_code == 1 and sentence in " ".join(out.output.split()) and "Traceback" not in out.output


def test_a_lora_run_loads_merged_on_its_base_and_a_changed_base_is_refused(tmp_path):
    base = save_weights(tmp_path / "base.safetensors")
    adapted = save_lora(tmp_path / "lora.safetensors", tmp_path / "base.safetensors", base)
    idx = torch.tensor([[1, 2, 3, 4]])
    model = api.load(tmp_path / "lora.safetensors", device="cpu", dtype="float32")
    torch.testing.assert_close(model.module(idx)[0], adapted.eval()(idx)[0])
    save_weights(tmp_path / "base.safetensors", seed=5)  # other weights where the base was
    with pytest.raises(NanoGPTError, match="holds LoRA adapters for other base weights"):
        api.load(tmp_path / "lora.safetensors", device="cpu")


def test_every_load_option_is_one_option_on_every_command_that_loads_but_those_it_leaves():
    names = {f.name: f"--{f.metadata['option'] or f.name.replace('_', '-')}" for f in dataclasses.fields(LoadSpec)}
    for words, command in LOAD_COMMANDS.items():
        assert set(command.leaves) <= set(names) - {"source"} and all(command.leaves.values()), words
        out = runner.invoke(app, [*words.split(), "--help"], terminal_width=200).output
        shown = re.findall(r"^\s+(--[a-z0-9-]+)", out.split("Options:")[1], re.M)
        for field, option in names.items():
            if field == "source":  # the command's argument, or sample's and eval perplexity's --checkpoint
                usage = out.splitlines()[0]
                assert ("{source}" in usage) != (shown.count("--checkpoint") == 1), words
            else:
                assert shown.count(option) == (0 if field in command.leaves else 1), (words, option)


def test_a_field_added_to_loadspec_is_an_option_of_every_load_command(monkeypatch):
    """A new load option is one declaration: the field, and it reaches the command in its spec."""

    @dataclasses.dataclass(frozen=True)
    class WithDraft(LoadSpec):
        draft: str | None = load_setting(None, "A smaller model that proposes tokens.")

    monkeypatch.setattr("nanogpt_cli.cli.common.LoadSpec", WithDraft)
    got = []

    @load_options(source="--checkpoint")
    def command(prompt: str = "", *, spec: LoadSpec):
        got.append((prompt, spec))

    one = typer.Typer()
    one.command()(command)
    one.command("other")(lambda: None)  # two commands: the app takes the name
    out = runner.invoke(one, ["command", "--checkpoint", "x", "--draft", "small", "--threads", "2", "--last"])
    assert out.exit_code == 0, out.output
    assert got == [("", WithDraft("x", last=True, threads=2, draft="small"))]
    runner.invoke(one, ["command", "--checkpoint", "x"])
    assert got[1][1].threads == "auto" and got[1][1].draft is None  # a command unset: threads chosen from the load


def test_threads_are_set_once_by_the_loader_from_the_spec(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    run = tmp_path / "tiny"
    save_weights(run / "model.safetensors")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        api.load(run, device="cpu")  # the library's default keeps them
        assert torch.get_num_threads() == 3
        api.load(LoadSpec(str(run), device="cpu", threads=1))
        assert torch.get_num_threads() == 1
        out = runner.invoke(app, ["sample", "--checkpoint", str(run), "--max-new-tokens", "2", "--threads", "2"])
        assert out.exit_code == 0 and torch.get_num_threads() == 2
        with pytest.raises(NanoGPTError, match="--threads must be at least 1, got 0"):
            LoadSpec("x", threads=0)
    finally:
        torch.set_num_threads(before)
    package = ROOT / "nanogpt_cli"
    calls = {str(p.relative_to(package)): p.read_text().count("set_threads(") for p in package.rglob("*.py")}
    assert calls["interop/loading.py"] == 1  # the one place a loaded model's threads are set, from its spec
    assert not [path for path, n in calls.items() if n and path.startswith("cli/") and path != "cli/train.py"]


@pytest.mark.slow  # the export imports transformers
def test_the_api_does_what_info_export_and_inspect_print(tmp_path):
    run = tmp_path / "tiny"
    save_weights(run / "model.safetensors", step=3)
    described = api.info(run)
    assert described.path == str(run) and described.kind == "run" and described.params > 0
    with pytest.raises(NanoGPTError, match="does not exist"):
        api.info(tmp_path / "nothing")
    result = api.export(LoadSpec(str(run), last=True), tmp_path / "hf", "hf")
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert result.format == "hf" and exported["architectures"] == [result.architecture]
    model = api.load(run, device="cpu", dtype="float32")
    assert model.spec == LoadSpec(str(run), device="cpu", dtype="float32")  # what loads another model alike
    maps = model.attention("abc")
    config = model.module.config
    assert maps.to_dict()["ids"] == TOKENIZER.encode("abc") and len(maps.to_dict()["attention"]) == config.n_layer
    assert len(model.heads(seed=1).to_dict()["heads"]) == config.n_layer * config.n_head
    assert model.positions().summary and model.name.startswith("tiny")


@pytest.mark.slow  # a process that serves
def test_serve_from_python_answers_until_sigterm(tmp_path):
    """api.serve blocks while it serves and returns on SIGTERM; on_ready gets the URL."""
    pytest.importorskip("fastapi")
    run = tmp_path / "tiny"
    save_weights(run / "model.safetensors")
    code = (
        "import sys\nfrom nanogpt_cli import api\n"
        "spec = api.LoadSpec(sys.argv[1], device='cpu', dtype='float32', threads=1)\n"
        "api.serve(api.ServeOptions(spec, port=0), on_ready=lambda s: print(s.url, flush=True))\n"
        "print('stopped', flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", code, str(run)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as response:
            assert json.loads(response.read())["data"][0]["id"] == "tiny"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0 and proc.stdout.read().strip() == "stopped"
    finally:
        proc.kill()
