"""Tokenizers: round trips, parity with tiktoken's own GPT-2, offline loading, descriptions, errors."""

from __future__ import annotations

import json

import pytest

from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.tokenizer import (
    ByteTokenizer,
    CharTokenizer,
    _gpt2_encoding,
    build_tokenizer,
    tokenizer_from_description,
)

UNICODE = "Héllo, wörld! 日本語のテキスト 🙂👍🏽 — “quotes”\n\ttabs  and  spaces\r\n"


@pytest.mark.parametrize("name", ["gpt2", "char", "byte"])
def test_round_trip(name, sample_text):
    text = sample_text + UNICODE
    tok = build_tokenizer(name, [text])
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode_bytes(ids) == text.encode("utf-8")
    assert tok.encode_batch([text, "", text[:50]], num_threads=2) == [ids, [], tok.encode(text[:50])]


@pytest.mark.parametrize("name", ["gpt2", "byte"])
def test_decode_bytes_one_token_at_a_time(name):
    # a streaming sampler decodes token by token; characters split across tokens must reassemble
    tok = build_tokenizer(name)
    ids = tok.encode(UNICODE)
    assert b"".join(tok.decode_bytes([i]) for i in ids) == UNICODE.encode("utf-8")


def test_gpt2_matches_tiktoken(sample_text, tiktoken_gpt2):
    tok = build_tokenizer("gpt2")
    for text in (sample_text, UNICODE, "<|endoftext|> is plain text here", "   leading\n\n\nand trailing   "):
        assert tok.encode(text) == tiktoken_gpt2.encode_ordinary(text)
    assert (tok.vocab_size, tok.eot_id) == (tiktoken_gpt2.n_vocab, tiktoken_gpt2.eot_token) == (50257, 50256)


def test_gpt2_builds_offline(no_network):
    # an empty tiktoken cache and no network: only the packaged files can make this work
    _gpt2_encoding.cache_clear()
    tok = build_tokenizer("gpt2")
    assert tok.decode(tok.encode("offline")) == "offline"


def test_other_tiktoken_encoding_offline_is_one_sentence(no_network):
    with pytest.raises(NanoGPTError, match=r"could not load the cl100k_base tokenizer.*--tokenizer gpt2") as e:
        build_tokenizer("cl100k_base")
    assert "\n" not in str(e.value)


def test_unknown_tokenizer_lists_the_valid_ones():
    with pytest.raises(NanoGPTError, match=r"unknown tokenizer 'bpe'; choose one of gpt2, char, byte, .*cl100k_base"):
        build_tokenizer("bpe")


def test_char_vocabulary_is_the_sorted_characters():
    tok = build_tokenizer("char", ["hello", "world"])
    assert tok.chars == "dehlorw"
    assert tok.vocab_size == 7 and tok.eot_id is None
    assert tok.encode("hold") == [2, 4, 3, 0]


def test_char_unknown_characters_are_named():
    tok = CharTokenizer("abc")
    with pytest.raises(NanoGPTError, match=r"no token for 'x' 'z'"):
        tok.encode("abxcz")


def test_byte_is_lossless_for_bytes_that_are_not_utf8():
    raw = b"\xff\xfe ok \x80\x00 \xc3\xa9"
    tok = ByteTokenizer()
    ids = tok.encode(raw.decode("utf-8", errors="surrogateescape"))
    assert ids == list(raw)
    assert tok.decode_bytes(ids) == raw


@pytest.mark.parametrize("name", ["gpt2", "char", "byte"])
def test_description_rebuilds_the_same_tokenizer(name, sample_text):
    tok = build_tokenizer(name, [sample_text])
    desc = json.loads(json.dumps(tok.describe()))  # it must survive meta.json
    again = tokenizer_from_description(desc)
    assert (again.name, again.vocab_size, again.eot_id) == (tok.name, tok.vocab_size, tok.eot_id)
    assert again.encode(sample_text) == tok.encode(sample_text)


def test_description_with_another_vocabulary_size_is_refused():
    with pytest.raises(NanoGPTError, match="50,257 tokens here but 50,304"):
        tokenizer_from_description({"name": "gpt2", "vocab_size": 50304})


# --- trained byte-level BPE ---------------------------------------------------------------------------------


def test_training_is_deterministic_and_round_trips_any_text(sample_text):
    from nanogpt_cli.tokenizer import EOT, train_bpe

    first, second = (train_bpe([sample_text], 300, "play", "gpt4") for _ in range(2))
    assert first.ranks == second.ranks and first.vocab_size == 300  # 256 bytes, 43 merges, end of text
    assert first.ranks[:256] == [bytes([b]) for b in range(256)] and first.special_tokens == {EOT: 299}
    edge_cases = ("🙂👍🏽 emoji joined by ZWJ: 👩‍👩‍👧", "\x00\x7f control and \ufeff BOM", "\U0010ffff last code point")
    for text in (UNICODE, *edge_cases, sample_text[:200]):
        ids = first.encode(text)
        assert first.decode(ids) == text and b"".join(first.decode_bytes([i]) for i in ids) == text.encode()
    assert len(first.encode("the king")) < len("the king")  # it learnt the text's words
    assert first.encode_special(f"a{EOT}b") == [*first.encode("a"), 299, *first.encode("b")]
    assert first.encode(EOT) != [299]  # plain encoding never makes a special token out of text


def test_a_trained_tokenizer_rebuilds_from_its_folder_and_its_description(sample_text, tmp_path):
    from nanogpt_cli.tokenizer import BPETokenizer, train_bpe

    tok = train_bpe([sample_text], 320, "play", "gpt2", ("<|endoftext|>", "<|pad|>"))
    tok.save(tmp_path)
    assert (tmp_path / "ranks.tiktoken").read_text().splitlines()[65] == "QQ== 65"  # tiktoken's own format
    again = BPETokenizer.load(tmp_path)
    rebuilt = tokenizer_from_description(json.loads(json.dumps(tok.describe())))
    for other in (again, rebuilt, build_tokenizer(str(tmp_path))):
        assert other.ranks == tok.ranks and other.special_tokens == tok.special_tokens == {
            "<|endoftext|>": 318,
            "<|pad|>": 319,
        }
        assert other.encode(sample_text) == tok.encode(sample_text) and other.eot_id == 318


@pytest.mark.parametrize(
    "args, message",
    [
        (["--vocab-size", "256"], "--vocab-size 256 is too small: .* needs at least 257"),
        (["--pattern", "gpt5"], "unknown --pattern 'gpt5'; choose one of gpt2, gpt4, gpt4o, nanochat"),
        (["--vocab-size", "300", "--source", "empty.txt"], "empty.txt is empty"),
        (["--vocab-size", "300", "--source", "blank.jsonl"], "blank.jsonl has no text"),
    ],
)
def test_bad_training_input_is_one_sentence_and_writes_nothing(args, message, text_file, tmp_path, monkeypatch):
    import re

    from typer.testing import CliRunner

    from nanogpt_cli.cli import app

    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n')
    source = args[args.index("--source") + 1] if "--source" in args else str(text_file)
    args = [a for i, a in enumerate(args) if "--source" not in args[max(i - 1, 0) : i + 1]]
    result = CliRunner().invoke(app, ["tokenizer", "train", source, "--name", "t", *args])
    assert result.exit_code == 1 and result.output.count("\n") == 1
    assert re.search(message, result.output), result.output
    assert not (tmp_path / "tokenizers").exists()


def test_train_prepare_train_and_sample_from_the_checkpoint_alone(text_file, tmp_path, monkeypatch):
    """The README's three lines, then the tokenizer folder goes away: the checkpoint alone samples and
    evaluates, since it carries the whole vocabulary."""
    import shutil

    from typer.testing import CliRunner

    from nanogpt_cli.cli import app

    monkeypatch.chdir(tmp_path)
    runner = CliRunner()

    def run(*args):
        result = runner.invoke(app, list(args))
        assert result.exit_code == 0, result.output
        return result.output

    trained = run("tokenizer", "train", str(text_file), "--vocab-size", "320", "--name", "play320")
    assert "320 (256 bytes, 63 merges, 1 special)" in trained
    assert "play320" in run("tokenizer", "info", "play320")
    encoded = run("tokenizer", "encode", "play320", "the king<|endoftext|>")
    assert encoded.splitlines()[0].split()[-1] == "319"  # the special token is one id
    prepared = run("prepare", str(text_file), "--name", "play", "--tokenizer", "play320")
    assert "play320" in prepared and "320" in prepared
    run(
        "train",
        "--preset",
        "tiny",
        "--data",
        "play",
        "--out",
        "run",
        "--max-iters",
        "10",
        "--eval-interval",
        "10",
        "--device",
        "cpu",
        "--dtype",
        "float32",
    )
    shutil.rmtree(tmp_path / "tokenizers")
    text = run(
        "sample",
        "--checkpoint",
        "run",
        "--prompt",
        "The king",
        "--max-new-tokens",
        "12",
        "--temperature",
        "0",
        "--device",
        "cpu",
    )
    assert text.startswith("The king") and len(text) > len("The king") + 5
    ppl = json.loads(run("eval", "perplexity", "--checkpoint", "run", "--data", "play", "--json").splitlines()[-1])
    assert 0 < ppl["bits_per_byte"] < 9
