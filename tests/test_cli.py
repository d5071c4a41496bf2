"""The whole tool end to end through its CLI: prepare -> train -> resume -> sample -> eval, and the help texts."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from nanogpt_cli.cli import app
from conftest import make_text

runner = CliRunner()


def ok(*args, input=None):
    result = runner.invoke(app, list(args), input=input)
    assert result.exit_code == 0, result.output
    return result.output


def test_prepare_train_resume_sample_eval_end_to_end(tmp_path):
    text = tmp_path / "play.txt"
    text.write_text(make_text(lines=500, seed=3), encoding="utf-8")
    data, run = str(tmp_path / "data"), str(tmp_path / "run")
    out = ok("prepare", str(text), "--name", "play", "--tokenizer", "char", "--data-dir", data)
    assert "train tokens" in out
    out = ok("train", "--data", "play", "--data-dir", data, "--preset", "tiny", "--max-iters", "40",
             "--eval-interval", "20", "--out", run, "--stop-at", "20", "--dtype", "float32")
    assert "--resume" in out and "step     20" in out
    out = ok("train", "--out", run, "--resume")
    assert "resuming at step 20" in out
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if m["kind"] == "eval"] == [0, 20, 40]
    assert [m["step"] for m in lines if m["kind"] == "train"] == [10, 20, 30, 40]  # every --log-interval
    out = ok("sample", "--checkpoint", run, "--prompt", "THE KING:", "--max-new-tokens", "30", "--seed", "3")
    assert out.startswith("THE KING:") and len(out) > len("THE KING:") + 20
    result = json.loads(ok("eval", "perplexity", "--checkpoint", run, "--data", "play", "--data-dir", data, "--json"))
    assert 1.0 < result["perplexity"] < 40 and result["tokens"] > 1000


@pytest.mark.parametrize("command", [[], ["prepare"], ["train"], ["sample"], ["eval"], ["eval", "perplexity"]])
def test_every_help_has_a_purpose_and_an_example(command):
    out = ok(*command, "--help")
    assert "Example: nanogpt" in out
    assert "Usage:" in out


def test_python_dash_m_runs_the_same_app():
    out = subprocess.run([sys.executable, "-m", "nanogpt_cli", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("nanogpt ")


def test_train_has_an_option_for_every_config_field():
    # the options are the overrides (cli.train passes every option named like a field): one list, not three
    import dataclasses
    import inspect

    from nanogpt_cli import cli
    from nanogpt_cli.config import GPTConfig, TrainConfig

    options = set(inspect.signature(cli.train).parameters)
    fields = {f.name for cls in (GPTConfig, TrainConfig) for f in dataclasses.fields(cls)}
    assert fields - options == set()
