"""Perplexity: exact sliding-window scoring, agreement with the trainer, bits per byte, bad input."""

import json
import math

import numpy as np
import pytest
import torch
from torch.nn import functional as F
from typer.testing import CliRunner

from nanogpt_cli.cli import app
from nanogpt_cli.config import GPTConfig
from nanogpt_cli.data import prepare
from nanogpt_cli.inference.evaluate import perplexity_of_files, perplexity_of_split, score_tokens
from nanogpt_cli.interop.loading import load_model
from nanogpt_cli.model import GPT
from nanogpt_cli.tokenizer import build_tokenizer

runner = CliRunner()


@pytest.mark.parametrize("stride", [16, 5, 1])
def test_every_token_is_scored_once_with_its_window_context(stride):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_embd=32)).eval()
    tokens = torch.randint(0, 40, (53,))
    nll, n = score_tokens(model, tokens.numpy(), stride=stride, batch_size=3)
    assert n == 52
    # independently: target t is scored by the first window k (starting at k*stride) that reaches it,
    # and sees the tokens from that window's start up to t - 1
    expected = 0.0
    with torch.no_grad():
        for t in range(1, 53):
            k = max(0, math.ceil((t - 16) / stride))
            logits, _ = model(tokens[None, k * stride : t])
            expected += F.cross_entropy(logits[0, -1:], tokens[t : t + 1], reduction="sum").item()
    assert nll == pytest.approx(expected, rel=1e-5)


def test_split_perplexity_is_exp_of_the_mean_nll_and_agrees_with_the_trainer(trained_run, char_data):
    data_dir, name = char_data
    model, meta = load_model(trained_run, last=True)
    tok = build_tokenizer("char", [json.loads((data_dir / name / "meta.json").read_text())["tokenizer"]["chars"]])
    bs = model.config.block_size
    result = perplexity_of_split(model, tok, data_dir, name, "val", stride=bs)
    assert result.perplexity == pytest.approx(math.exp(result.loss))
    assert result.tokens == json.loads((data_dir / name / "meta.json").read_text())["val_tokens"] - 1
    trainer_val = [json.loads(x) for x in (trained_run / "metrics.jsonl").read_text().splitlines()][-1]["val_loss"]
    assert result.loss == pytest.approx(trainer_val, abs=0.1)
    # a half-window stride gives every token more context: the loss can only go down (here, clearly not up)
    assert perplexity_of_split(model, tok, data_dir, name, "val", stride=bs // 2).loss < result.loss + 0.01


def test_bits_per_byte_of_a_byte_model_is_its_loss_over_ln2(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=32)).eval()
    text = tmp_path / "t.txt"
    text.write_text("héllo wörld, ünïcode bytes 🙂 " * 5, encoding="utf-8")
    result = perplexity_of_files(model, build_tokenizer("byte"), [text], stride=8)
    assert result.bits_per_byte == pytest.approx(result.loss / math.log(2))
    assert result.bytes == result.tokens == len(text.read_bytes()) - 1


def test_eval_cli_json_and_table(trained_run, char_data, tmp_path):
    data_dir, name = char_data
    out = runner.invoke(
        app,
        ["eval", "perplexity", "--checkpoint", str(trained_run), "--data", name, "--data-dir", str(data_dir), "--json"],
    )
    assert out.exit_code == 0, out.output
    result = json.loads(out.output)
    assert {"loss", "perplexity", "bits_per_byte", "tokens"} <= set(result)
    table = runner.invoke(
        app, ["eval", "perplexity", "--checkpoint", str(trained_run), "--data", name, "--data-dir", str(data_dir)]
    )
    assert table.exit_code == 0 and "bits per byte" in table.output


@pytest.mark.parametrize(
    "make_args,message",
    [
        (
            lambda run, d, tmp: ["--checkpoint", str(tmp / "nope"), "--data", "play", "--data-dir", str(d)],
            "does not exist",
        ),
        (lambda run, d, tmp: ["--checkpoint", str(run)], "give either --data NAME"),
        (
            lambda run, d, tmp: ["--checkpoint", str(run), "--input", str(tmp / "greek.txt")],
            "no token for 'γ' 'λ' 'ο' 'ς' 'ό'",
        ),
        (
            lambda run, d, tmp: ["--checkpoint", str(run), "--data", "play", "--data-dir", str(d), "--stride", "999"],
            "--stride must be between 1 and the context length",
        ),
        (
            lambda run, d, tmp: ["--checkpoint", str(run), "--data", "other", "--data-dir", str(d)],
            "prepared with another tokenizer",
        ),
    ],
)
def test_bad_eval_input_is_one_sentence(trained_run, char_data, tmp_path, make_args, message):
    data_dir, _ = char_data
    (tmp_path / "greek.txt").write_text("the λόγος", encoding="utf-8")
    if not (data_dir / "other").exists():
        src = tmp_path / "other.txt"
        src.write_text("xyz" * 300)
        prepare(str(src), "other", tokenizer="byte", data_dir=data_dir)
    out = runner.invoke(app, ["eval", "perplexity", *make_args(trained_run, data_dir, tmp_path)])
    assert out.exit_code == 1
    assert message in out.output and "Traceback" not in out.output


def test_bits_per_byte_leaves_end_of_text_separators_out(tmp_path):
    from nanogpt_cli.inference.evaluate import text_bytes

    tok = build_tokenizer("gpt2")
    ids = tok.encode("héllo") + [tok.eot_id] + tok.encode(" world")
    assert text_bytes(tok, ids) == len("héllo world".encode())
    assert text_bytes(tok, np.array(ids), chunk=2) == len("héllo world".encode())


@pytest.mark.parametrize("stride", ["0", "-3"])
def test_an_out_of_range_stride_is_refused_not_replaced(trained_run, char_data, stride):
    data_dir, name = char_data
    args = ["eval", "perplexity", "--checkpoint", str(trained_run), "--data", name, "--data-dir", str(data_dir)]
    out = runner.invoke(app, [*args, "--stride", stride])
    assert out.exit_code == 1
    assert "--stride must be between 1 and the context length" in out.output and f"got {stride}" in out.output
