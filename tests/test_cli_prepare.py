"""`nanogpt prepare` through CliRunner: the summary, --help, and one clear error line for every bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from nanogpt_cli.cli import app
from nanogpt_cli.data import open_split, shards, sources, tokenizing
from nanogpt_cli.tokenizer import tokenizer_from_description

runner = CliRunner()


def prepare(*args: str):
    return runner.invoke(app, ["prepare", *args])


def assert_fails(result, message: str) -> None:
    """Exit code 1, `error: <message ...>` and nothing else: no traceback, no usage text."""
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)  # not an escaped error
    lines = [ln for ln in result.output.strip().splitlines() if ": done in " not in ln]  # stage lines (stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert message in lines[0], result.output


def test_prepare_prints_a_summary(text_file, data_dir):
    result = prepare(str(text_file), "--name", "play", "--tokenizer", "char", "--data-dir", str(data_dir))
    assert result.exit_code == 0, result.output
    for row in (
        "documents",
        "characters",
        "train tokens",
        "val tokens",
        "vocabulary size",
        "bytes on disk",
        "throughput",
    ):
        assert row in result.output
    meta = json.loads((data_dir / "play" / "meta.json").read_text())
    assert f"{meta['train_tokens']:,}" in result.output


def test_help_has_a_purpose_and_an_example():
    result = runner.invoke(app, ["prepare", "--help"])
    assert result.exit_code == 0
    assert "Tokenize text into" in result.output and "Example: nanogpt prepare" in result.output
    for flag in ("--resume", "--num-proc", "--shard-tokens", "--max-tokens", "--val-tokens"):
        assert flag in result.output


def test_an_interrupted_prepare_says_how_to_resume_and_resumes(monkeypatch, tmp_path, data_dir):
    source = tmp_path / "docs.jsonl"
    texts = [f"document number {i} " * 20 for i in range(40)]
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    four = f"4 documents, {sum(map(len, texts[:4])) + 3 * 2:,} tokens, 1 complete shard"  # bytes and "\n\n"s
    monkeypatch.setattr(tokenizing, "BATCH_DOCS", 4)
    args = [str(source), "--name", "docs", "--data-dir", str(data_dir), "--tokenizer", "byte", "--shard-tokens", "900"]
    checkpoint = shards.SplitStream.checkpoint

    def checkpoint_then_ctrl_c(self):
        checkpoint(self)
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(shards.SplitStream, "checkpoint", checkpoint_then_ctrl_c)
        result = prepare(*args)
    assert result.exit_code == 130
    partial = data_dir / ".docs.partial"
    assert result.output.strip() == f"interrupted; {partial} keeps {four}; rerun with --resume to continue"
    assert_fails(
        prepare(*args),
        f"{partial} holds an interrupted prepare of 'docs' ({four}); add --resume to "
        "continue it, or delete that folder to start over",
    )
    result = prepare(*args, "--resume")
    assert result.exit_code == 0, result.output
    assert "after 4 documents" in result.output and not partial.exists()


@pytest.fixture
def bad_inputs(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    binary = tmp_path / "image.txt"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text('{"body": "a", "title": "b"}\n{"body": "c", "title": "d"}\n')
    (tmp_path / "cp1252.txt").write_bytes(b"text\x81")  # a byte that cp1252 leaves undefined
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("hi")
    return tmp_path


@pytest.mark.parametrize(
    "args, message",
    [
        (["missing.txt"], "missing.txt does not exist; SOURCE is a text file"),
        (["empty.txt"], "empty.txt is empty"),
        (["image.txt"], "image.txt is not UTF-8 text"),
        (
            ["latin1.txt"],
            "latin1.txt is not UTF-8 text (invalid byte near offset 3); pass its encoding with --encoding "
            "(e.g. --encoding cp1252), or use --tokenizer byte",
        ),
        (["latin1.txt", "--encoding", "klingon"], "unknown --encoding 'klingon'; give a Python text encoding"),
        (["latin1.txt", "--encoding", "base64"], "unknown --encoding 'base64'; give a Python text encoding"),
        (
            ["cp1252.txt", "--encoding", "cp1252"],
            "cp1252.txt is not cp1252 text (invalid byte near offset 4); pass its "
            "encoding with --encoding, or use --tokenizer byte",
        ),
        (["tiny.txt", "--tokenizer", "wordpiece"], "unknown tokenizer 'wordpiece'; choose one of gpt2, char, byte"),
        (["rows.jsonl"], "has no column 'text'; its columns are body, title (choose one with --text-column)"),
        (["tiny.txt", "--val-fraction", "0"], "--val-fraction must be between 0 and 1 (exclusive), got 0.0"),
        (["tiny.txt", "--val-fraction", "1.5"], "--val-fraction must be between 0 and 1 (exclusive), got 1.5"),
        (
            ["tiny.txt", "--name", "a/b"],
            "--name must be a plain folder name (no path separators, no leading '.'), got 'a/b'",
        ),
        (["tiny.txt", "--tokenizer", "char"], "tiny.txt is too small to split: 2 tokens give 2 train and 0 validation"),
        (["hf:"], "hf: is not a hub dataset name; write hf:OWNER/NAME"),
        (["tiny.txt", "--num-proc", "0"], "--num-proc must be a positive integer, got 0"),
        (["tiny.txt", "--shard-tokens", "0"], "--shard-tokens must be a positive integer, got 0"),
        (["tiny.txt", "--max-tokens", "-5"], "--max-tokens must be a positive integer, got -5"),
        (["tiny.txt", "--max-tokens", "10", "--val-tokens", "20"], "--val-tokens (20) must be below --max-tokens (10)"),
        (
            ["tiny.txt", "--tokenizer", "char", "--val-tokens", "5"],
            "tiny.txt is too small to split: 2 tokens give 0 train and 2 validation tokens",
        ),
    ],
)
def test_bad_input_is_one_clear_line_and_writes_nothing(args, message, bad_inputs, monkeypatch):
    monkeypatch.chdir(bad_inputs)
    if "--name" not in args:
        args = [*args, "--name", "x"]
    assert_fails(prepare(*args, "--data-dir", "out"), message)
    assert not (bad_inputs / "out").exists()


def test_binary_file_with_nul_bytes(tmp_path, data_dir):
    path = tmp_path / "zeros.txt"
    path.write_bytes(b"text\x00\x00\x00more")
    assert_fails(prepare(str(path), "--name", "x", "--data-dir", str(data_dir)), "looks binary (it contains NUL")
    assert not data_dir.exists()


def test_tiktoken_encoding_offline(text_file, data_dir, no_network):
    assert_fails(
        prepare(str(text_file), "--name", "x", "--tokenizer", "o200k_base", "--data-dir", str(data_dir)),
        "could not load the o200k_base tokenizer",
    )


def test_shakespeare_offline(monkeypatch, tmp_path, data_dir):
    monkeypatch.setattr(sources, "SHAKESPEARE_URL", "http://127.0.0.1:9/input.txt")  # a closed port: like offline
    monkeypatch.setenv("NANOGPT_CACHE", str(tmp_path / "cache"))
    assert_fails(
        prepare("shakespeare", "--name", "shk", "--data-dir", str(data_dir)),
        "pass a local copy instead, e.g. nanogpt prepare examples/tinyshakespeare.txt",
    )


@pytest.mark.slow
def test_hub_dataset_offline(tmp_path):
    # the hub's offline switch is read when huggingface_hub is imported, so this runs in a fresh process
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "nanogpt_cli",
            "prepare",
            "hf:nobody/nothing",
            "--name",
            "x",
            "--data-dir",
            str(tmp_path / "data"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("error: could not reach the Hugging Face hub to load hf:nobody/nothing (offline?)")
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "data").exists()


@pytest.mark.slow
def test_hub_dataset_unreachable_fails_fast_without_the_offline_switch(tmp_path):
    # no HF_HUB_OFFLINE: every request goes to a closed local port; prepare asks the hub once, then goes offline
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "NO_PROXY", "no_proxy")}
    env.update(
        HF_HOME=str(tmp_path / "hf"),
        HTTPS_PROXY="http://127.0.0.1:9",
        HTTP_PROXY="http://127.0.0.1:9",
        https_proxy="http://127.0.0.1:9",
        http_proxy="http://127.0.0.1:9",
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "nanogpt_cli",
            "prepare",
            "hf:nobody/nothing",
            "--name",
            "x",
            "--data-dir",
            str(tmp_path / "data"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith(
        "error: could not reach the Hugging Face hub to load hf:nobody/nothing (it did not "
        "answer within 3 s, so only the local cache was searched)"
    )
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_preparing_an_existing_name_says_it_replaced_it(text_file, data_dir):
    args = (str(text_file), "--name", "play", "--tokenizer", "char", "--data-dir", str(data_dir))
    assert "replaced" not in prepare(*args).output
    again = prepare(*args)
    assert again.exit_code == 0 and f"replaced the dataset that was in {data_dir / 'play'}" in again.output


def test_encoding_reads_text_that_is_not_utf8(tmp_path, data_dir):
    text = "caf\xe9 cr\xe8me \u20ac2, \u201cquoted\u201d \u2014 na\xefve\n" * 20
    path = tmp_path / "windows.txt"
    path.write_bytes(text.encode("cp1252"))
    args = [str(path), "--name", "w", "--tokenizer", "char", "--data-dir", str(data_dir)]
    assert_fails(
        prepare(*args),
        "windows.txt is not UTF-8 text (invalid byte near offset 3); pass its encoding with "
        "--encoding (e.g. --encoding cp1252)",
    )
    result = prepare(*args, "--encoding", "cp1252")
    assert result.exit_code == 0, result.output
    meta = json.loads((data_dir / "w" / "meta.json").read_text())
    tok = tokenizer_from_description(meta["tokenizer"])
    ids = [t for split in ("train", "val") for shard in open_split(data_dir, "w", split) for t in shard.tolist()]
    assert tok.decode(ids) == text and meta["encoding"] == "cp1252"


@pytest.mark.slow
def test_the_stage_line_counts_what_every_worker_wrote(monkeypatch, tmp_path, data_dir):
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(64)))
    monkeypatch.setattr(tokenizing, "BATCH_DOCS", 8)  # 8 batches, up to 4 of them in flight with 2 workers
    add = shards.SplitStream.add

    def slow_add(*args):  # the writing lags the reading by more than the progress interval
        time.sleep(0.15)
        return add(*args)

    monkeypatch.setattr(shards.SplitStream, "add", slow_add)
    result = prepare(
        str(source), "--name", "docs", "--tokenizer", "byte", "--num-proc", "2", "--data-dir", str(data_dir)
    )
    assert result.exit_code == 0, result.output
    meta = json.loads((data_dir / "docs" / "meta.json").read_text())
    stage = [line for line in result.output.splitlines() if line.startswith("tokenizing: done in ")]
    assert len(stage) == 1 and stage[0].endswith(
        f" s, 64 documents, {meta['train_tokens'] + meta['val_tokens']:,} tokens"
    ), result.output
