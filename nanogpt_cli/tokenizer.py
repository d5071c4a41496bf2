"""Tokenizers behind one small interface: gpt2 (offline BPE), char, byte, and other tiktoken encodings.

    tok = build_tokenizer("char", ["hello world"]); tok.decode(tok.encode("hello"))  # 'hello'

A tokenizer is rebuilt from the small dict that `describe()` returns; `meta.json` and checkpoints store that
dict, so sampling and evaluation always use the vocabulary the data was prepared with.

Kinds:
- gpt2: tiktoken's GPT-2 BPE (50,257 tokens, `<|endoftext|>` = 50256), built from the files shipped in
  `nanogpt_cli/assets/gpt2/`, so it never needs the network.
- char: one token per character of the training text, sorted by code point; no end-of-text token.
- byte: the 256 byte values of the UTF-8 encoding; lossless for any input; no end-of-text token.
- any other tiktoken encoding (cl100k_base, o200k_base, ...): through `tiktoken.get_encoding`, which downloads
  its file once and caches it (TIKTOKEN_CACHE_DIR).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nanogpt_cli.errors import NanoGPTError

BUILTIN = ("gpt2", "char", "byte")
ASSETS_DIR = Path(__file__).parent / "assets" / "gpt2"
# the sha256 of OpenAI's files, as in tiktoken_ext/openai_public.py; tiktoken's loader checks them
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"


class Tokenizer:
    """The interface: text <-> token ids. Subclasses set `name` and `eot_id` and implement the methods."""

    name: str = ""
    eot_id: int | None = None  # the end-of-text token that separates documents, if the tokenizer has one

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text; special-token strings such as '<|endoftext|>' are encoded as text."""
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Raw bytes, so a streaming sampler can decode UTF-8 incrementally across token boundaries."""
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def describe(self) -> dict[str, Any]:
        """A small JSON-able dict; `tokenizer_from_description` rebuilds the same tokenizer from it."""
        return {"name": self.name, "vocab_size": self.vocab_size}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


class TiktokenTokenizer(Tokenizer):
    """A tiktoken `Encoding`: gpt2 from the packaged files, or any other encoding tiktoken knows."""

    def __init__(self, encoding):
        self.enc = encoding
        self.name = encoding.name
        # not every encoding has <|endoftext|> (o200k_harmony names it differently); ask, do not assume
        self.eot_id = encoding.encode_single_token("<|endoftext|>") if "<|endoftext|>" in encoding.special_tokens_set \
            else None

    @property
    def vocab_size(self) -> int:
        return self.enc.n_vocab

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        texts = list(texts)
        if num_threads <= 1 or len(texts) <= 1:
            return [self.enc.encode_ordinary(t) for t in texts]
        # tiktoken releases the GIL while it encodes, so threads run in parallel. One task per thread, not
        # tiktoken's encode_ordinary_batch (one task per text), whose overhead dwarfs short documents.
        from concurrent.futures import ThreadPoolExecutor

        step = -(-len(texts) // num_threads)
        groups = [texts[i:i + step] for i in range(0, len(texts), step)]
        with ThreadPoolExecutor(num_threads) as pool:
            return [ids for group in pool.map(lambda g: [self.enc.encode_ordinary(t) for t in g], groups)
                    for ids in group]

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return self.enc.decode_bytes(list(ids))


class CharTokenizer(Tokenizer):
    """One token per character; the vocabulary is the sorted set of characters of the training text."""

    name = "char"

    def __init__(self, chars: str):
        if not chars:
            raise NanoGPTError("a char tokenizer needs at least one character of text")
        self.chars = "".join(sorted(set(chars)))
        # encode looks code points up in this sorted array: vectorised, 1M characters in milliseconds
        self._codepoints = _codepoints(self.chars)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        points = _codepoints(text)
        ids = np.searchsorted(self._codepoints, points)
        known = self._codepoints[np.minimum(ids, len(self._codepoints) - 1)] == points
        if not known.all():
            missing = [chr(c) for c in np.unique(points[~known])]
            shown = " ".join(repr(c) for c in missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10
                                                               else "")
            raise NanoGPTError(f"the char tokenizer has no token for {shown}: its vocabulary holds only the "
                               f"{self.vocab_size:,} characters of the text it was prepared from")
        return ids

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return self.decode(ids).encode("utf-8")

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "vocab_size": self.vocab_size, "chars": self.chars}


class ByteTokenizer(Tokenizer):
    """The 256 byte values. Lossless for any input, text or not."""

    name = "byte"

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        # surrogateescape turns the lone surrogates of a text read with errors="surrogateescape" back into the
        # original bytes, so non-UTF-8 input survives a round trip
        return list(text.encode("utf-8", errors="surrogateescape"))

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return bytes(list(ids))


def _codepoints(text: str) -> np.ndarray:
    # UTF-32 is one 4-byte unit per character, so this is the array of code points
    return np.frombuffer(text.encode("utf-32-le"), dtype="<u4")


@functools.cache
def _gpt2_encoding():
    import tiktoken
    import tiktoken.load
    from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

    try:
        # tiktoken's own loader reads local paths too and checks the sha256, so this is exactly its gpt2
        ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=str(ASSETS_DIR / "vocab.bpe"),
            encoder_json_file=str(ASSETS_DIR / "encoder.json"),
            vocab_bpe_hash=GPT2_VOCAB_BPE_SHA256,
            encoder_json_hash=GPT2_ENCODER_JSON_SHA256,
        )
    except (OSError, ValueError, AssertionError) as e:
        raise NanoGPTError(f"the GPT-2 tokenizer files in {ASSETS_DIR} are missing or damaged ({e}); "
                           "reinstall nanogpt-cli") from None
    # the same arguments as tiktoken_ext.openai_public.gpt2()
    return tiktoken.Encoding(name="gpt2", explicit_n_vocab=50257, pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: 50256})


def available_tokenizers() -> list[str]:
    """gpt2, char, byte and every encoding name tiktoken knows."""
    import tiktoken

    return list(BUILTIN) + [n for n in tiktoken.list_encoding_names() if n not in BUILTIN]


def check_tokenizer_name(name: str) -> None:
    """Raise NanoGPTError listing the valid names when `name` is not one; costs no download."""
    valid = available_tokenizers()
    if name not in valid:
        raise NanoGPTError(f"unknown tokenizer {name!r}; choose one of {', '.join(valid)}")


def build_tokenizer(name: str, texts: Iterable[str] | None = None) -> Tokenizer:
    """The tokenizer called `name`. Only `char` reads `texts`: its vocabulary is their characters."""
    check_tokenizer_name(name)
    if name == "gpt2":
        return TiktokenTokenizer(_gpt2_encoding())
    if name == "byte":
        return ByteTokenizer()
    if name == "char":
        if texts is None:
            raise ValueError("build_tokenizer('char') needs the texts whose characters form the vocabulary")
        chars: set[str] = set()
        for text in texts:
            chars.update(text)
        return CharTokenizer("".join(chars))
    import tiktoken

    try:
        return TiktokenTokenizer(tiktoken.get_encoding(name))
    except Exception as e:  # requests' ConnectionError, an HTTP error, a blocked cache dir: all mean "not here"
        raise NanoGPTError(f"could not load the {name} tokenizer: tiktoken downloads it on first use and that "
                           f"failed ({type(e).__name__}); connect once to cache it, or use --tokenizer gpt2, char "
                           f"or byte, which work offline") from None


def tokenizer_from_description(desc: dict[str, Any]) -> Tokenizer:
    """Rebuild the tokenizer that `Tokenizer.describe()` described, and check its vocabulary size."""
    if not isinstance(desc, dict) or not isinstance(desc.get("name"), str):
        raise NanoGPTError(f"not a tokenizer description: {desc!r}")
    name = desc["name"]
    if name == "char":
        if not isinstance(desc.get("chars"), str):
            raise NanoGPTError("the char tokenizer description has no 'chars'")
        tok: Tokenizer = CharTokenizer(desc["chars"])
    else:
        tok = build_tokenizer(name)
    expected = desc.get("vocab_size")
    if expected is not None and expected != tok.vocab_size:
        raise NanoGPTError(f"the {name} tokenizer has {tok.vocab_size:,} tokens here but {expected:,} where the "
                           "data was prepared; prepare the data again with this version")
    return tok



def describe_difference(a: dict[str, Any], b: dict[str, Any], a_name: str, b_name: str) -> str:
    """How two tokenizer descriptions differ, in words ("" when they are the same): the names, or for two char
    tokenizers their vocabularies ("the vocabulary: 69 characters in the dataset vs 65 in the checkpoint, ...")."""
    if a == b:
        return ""
    if a.get("name") != b.get("name"):
        return f"{a.get('name')} in {a_name} vs {b.get('name')} in {b_name}"
    if a.get("name") == "char":
        ca, cb = set(a.get("chars", "")), set(b.get("chars", ""))
        text = f"the char vocabulary: {len(ca)} characters in {a_name} vs {len(cb)} in {b_name}"
        for only, name in ((ca - cb, a_name), (cb - ca, b_name)):
            if only:
                shown = " ".join(repr(c) for c in sorted(only)[:8]) + (" ..." if len(only) > 8 else "")
                text += f"; only in {name}: {shown}"
        return text
    return f"the vocabulary: {a.get('vocab_size')} tokens in {a_name} vs {b.get('vocab_size')} in {b_name}"
