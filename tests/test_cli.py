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
    out = ok(
        "train",
        "--data",
        "play",
        "--data-dir",
        data,
        "--preset",
        "tiny",
        "--max-iters",
        "40",
        "--eval-interval",
        "20",
        "--out",
        run,
        "--stop-at",
        "20",
        "--dtype",
        "float32",
    )
    assert "--resume" in out and "step 20: train loss" in out
    evals = {line.split(":")[0].split()[-1]: line for line in out.splitlines() if "val loss" in line}
    assert "checkpoint saved" not in evals["0"] and "checkpoint saved" in evals["20"]  # none at step 0
    out = ok("train", "--out", run, "--resume")
    assert "resuming at step 20" in out
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if m["kind"] == "eval"] == [0, 20, 40]
    assert [m["step"] for m in lines if m["kind"] == "train"] == [10, 20, 30, 40]  # every --log-interval
    out = ok("sample", "--checkpoint", run, "--prompt", "THE KING:", "--max-new-tokens", "30", "--seed", "3")
    assert out.startswith("THE KING:") and len(out) > len("THE KING:") + 20
    result = json.loads(ok("eval", "perplexity", "--checkpoint", run, "--data", "play", "--data-dir", data, "--json"))
    assert 1.0 < result["perplexity"] < 40 and result["tokens"] > 1000


@pytest.mark.parametrize(
    "command", [[], ["prepare"], ["train"], ["sample"], ["eval"], ["eval", "perplexity"], ["eval", "tasks"]]
)
def test_every_help_has_a_purpose_and_an_example(command):
    out = ok(*command, "--help")
    assert "Example: nanogpt" in out
    assert "Usage:" in out


@pytest.mark.slow
def test_python_dash_m_runs_the_same_app():
    out = subprocess.run([sys.executable, "-m", "nanogpt_cli", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("nanogpt ")


def test_train_options_are_the_config_fields_with_their_declared_help_and_choices():
    # each field's help, choices and default are declared once, beside the field; the options are made from them
    import dataclasses

    from nanogpt_cli.config import GPTConfig, TrainConfig, flag

    out = "".join(CliRunner().invoke(app, ["train", "--help"]).output.split())  # help wraps after spaces or hyphens
    for cls in (GPTConfig, TrainConfig):
        for f in dataclasses.fields(cls):
            assert f"--{flag(f.name)}" in out and "".join(f.metadata["help"].split()) in out, f.name
    assert "--lr-schedule<cosine|constant|wsd>Learningrateschedule" in out and "[default:cosine]" in out
    assert "--qk-norm/--no-qk-normRMSNormonqueriesandkeys.[default:no-qk-norm]" in out
    result = CliRunner().invoke(app, ["train", "--lr-schedule", "linear"])
    assert result.exit_code != 0 and "'linear' is not one of 'cosine', 'constant', 'wsd'" in result.output


# --- usage errors, help width, files named by flags (issue 12) ---


def run_main(*args, **kw):
    """The console script as users run it (click's standalone mode is off there)."""
    return subprocess.run([sys.executable, "-m", "nanogpt_cli", *map(str, args)], capture_output=True, text=True, **kw)


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,message",
    [
        (["train", "--no-such-flag"], "error: no such option: --no-such-flag"),
        (["train", "--max-iters", "ten"], "error: invalid value for '--max-iters'"),
        (["sample"], "error: missing option '--checkpoint'; see"),
        (["prepare"], "error: missing argument 'source'; see"),
        (["nonsense"], "error: no such command 'nonsense'"),
    ],
)
def test_usage_errors_are_one_line_and_exit_1(args, message):
    out = run_main(*args)
    assert out.returncode == 1
    assert out.stderr.startswith(message) and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "╭" not in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_help_fits_80_columns_with_whole_flag_names_and_no_bool_placeholder():
    import os

    for command in ([], ["prepare"], ["train"], ["sample"], ["eval", "perplexity"], ["eval", "tasks"]):
        out = run_main(*command, "--help", env={**os.environ, "COLUMNS": "80"})
        assert out.returncode == 0
        lines = out.stdout.splitlines()
        assert max(map(len, lines)) <= 80 and "…" not in out.stdout and "<bool>" not in out.stdout
    train_help = run_main("train", "--help", env={**os.environ, "COLUMNS": "80"}).stdout
    assert "--gradient-accumulation-steps" in train_help and "[default: 2000]" in " ".join(train_help.split())


@pytest.mark.parametrize(
    "setup,args,message",
    [
        ("latin1", ["sample", "--checkpoint", "{run}", "--prompt-file", "{file}"], "--prompt-file {file} is not UTF-8"),
        ("binary", ["sample", "--checkpoint", "{run}", "--prompt-file", "{file}"], "--prompt-file {file} is a binary"),
        ("folder", ["sample", "--checkpoint", "{run}", "--prompt-file", "{tmp}"], "--prompt-file {tmp} is a folder"),
        ("folder", ["eval", "perplexity", "--checkpoint", "{run}", "--input", "{tmp}"], "--input {tmp} is a folder"),
        ("latin1", ["eval", "perplexity", "--checkpoint", "{run}", "--input", "{file}"], "--input {file} is not UTF-8"),
        ("latin1", ["train", "--config", "{file}"], "--config {file} is not UTF-8"),
        ("latin1", ["train", "--data", "x", "--out", "{file}/run"], "cannot create --out {file}/run: {file} is a file"),
        ("latin1", ["prepare", "{file}", "--name", "x", "--data-dir", "{file}/d"], "cannot create --data-dir {file}/d"),
    ],
)
def test_paths_the_os_rejects_are_one_sentence(trained_run, tmp_path, setup, args, message):
    file = tmp_path / "f.txt"
    file.write_bytes({"latin1": "café ROMEO".encode("latin-1"), "binary": b"\x00\x01\x02"}.get(setup, b"x"))
    fill = dict(run=trained_run, file=file, tmp=tmp_path)
    out = runner.invoke(app, [a.format(**fill) for a in args])
    assert out.exit_code == 1 and message.format(**fill) in out.output, out.output
    assert "Traceback" not in out.output and len(out.output.strip().splitlines()) == 1


def test_an_unknown_toml_key_suggests_the_closest(tmp_path):
    from nanogpt_cli.config import load_toml
    from nanogpt_cli.errors import NanoGPTError

    toml = tmp_path / "run.toml"
    toml.write_text("learning_rte = 1e-3\n[model]\nn_layers = 2\n")
    with pytest.raises(
        NanoGPTError,
        match=r"learning_rte \(did you mean learning_rate\?\), "
        r"n_layers \(did you mean n_layer\?\)",
    ):
        load_toml(toml)


def test_an_error_keeps_its_brackets():
    # rich would read "[hf]" in 'pip install -e ".[hf]"' as a style and drop it
    result = runner.invoke(app, ["train", "--tracker", "x[hf]"])
    assert result.exit_code == 1
    assert "got 'x[hf]'" in result.output


def test_a_missing_extra_names_its_install_command():
    from nanogpt_cli.errors import NanoGPTError, require

    with pytest.raises(
        NanoGPTError,
        match=r"^plotting to a file needs the no_such_module package: "
        r'pip install -e "\.\[plot\]"$',
    ):
        require("no_such_module.sub", "plot", "plotting to a file")
    assert require("json", "plot").dumps([1]) == "[1]"
