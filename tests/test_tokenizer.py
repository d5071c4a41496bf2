"""Tokenizers: round trips, parity with tiktoken's own GPT-2, offline loading, descriptions, errors."""

from __future__ import annotations

import json

import pytest

from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.tokenizer import (ByteTokenizer, CharTokenizer, _gpt2_encoding, build_tokenizer,
                                   tokenizer_from_description)

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
