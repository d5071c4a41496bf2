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
- hf: any Hugging Face tokenizer.json (hf_tokenizer.py), named `hf:NAME` (fetched from the hub), by the file or by
  its folder; the file travels beside meta.json and in run folders, and the description holds its sha256.
- a trained byte-level BPE (`train_bpe`, `nanogpt tokenizer train`): stored in TOKENIZERS_DIR/NAME as
  `ranks.tiktoken` (tiktoken's own text format: base64 token, rank) and `tokenizer.json` (pattern, special
  tokens); named by NAME or by the path of that folder, encoded by a tiktoken `Encoding` built from those files.
  Its description carries the whole vocabulary, so a checkpoint alone can decode.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.hf_tokenizer import byte_to_unicode  # GPT-2's byte alphabet, which Hugging Face files spell in

BUILTIN = ("gpt2", "char", "byte")
ASSETS_DIR = Path(__file__).parent / "assets" / "gpt2"
# the sha256 of OpenAI's files, as in tiktoken_ext/openai_public.py; tiktoken's loader checks them
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"

TOKENIZERS_DIR = Path("tokenizers")  # trained tokenizers, one folder per NAME, beside data/
RANKS_FILE = "ranks.tiktoken"  # base64 of each token's bytes and its rank (= id), one per line, as tiktoken writes
CONFIG_FILE = "tokenizer.json"  # the pattern, the special tokens and how it was trained
EOT = "<|endoftext|>"
# pre-tokenization: the text is cut into pieces by this regex and BPE merges only inside a piece. Spelled as the
# Hugging Face tokenizers and llama.cpp spell them, so an export splits exactly as tiktoken does here.
PATTERNS = {
    "gpt2": r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
    # cl100k_base's (GPT-4 and GPT-3.5); also Llama 3's
    "gpt4": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+""",
    # o200k_base's (GPT-4o): case-aware words, contractions attached
    "gpt4o": r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
    r"""|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
    r"""|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
    # nanochat's: GPT-4's with numbers in groups of two (better for small vocabularies)
    "nanochat": r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]"""
    r"""|\s+(?!\S)|\s+""",
}


class Tokenizer:
    """The interface: text <-> token ids. Subclasses set `name` and `eot_id` and implement the methods."""

    name: str = ""
    eot_id: int | None = None  # the end-of-text token that separates documents, if the tokenizer has one
    bos_id: int | None = None  # the token every text starts with, when the model expects one (Llama's <s>)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The tokens that end a sample: end-of-text, and for a Hugging Face tokenizer its model's end-of-turn."""
        return () if self.eot_id is None else (self.eot_id,)

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

    def save_files(self, folder: Path) -> None:
        """Write the files the description needs beside it (a Hugging Face tokenizer.json; none for other kinds)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


class TiktokenTokenizer(Tokenizer):
    """A tiktoken `Encoding`: gpt2 from the packaged files, or any other encoding tiktoken knows."""

    def __init__(self, encoding):
        self.enc = encoding
        self.name = encoding.name
        # not every encoding has <|endoftext|> (o200k_harmony names it differently); ask, do not assume
        self.eot_id = (
            encoding.encode_single_token("<|endoftext|>") if "<|endoftext|>" in encoding.special_tokens_set else None
        )

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
        groups = [texts[i : i + step] for i in range(0, len(texts), step)]
        with ThreadPoolExecutor(num_threads) as pool:
            return [
                ids for group in pool.map(lambda g: [self.enc.encode_ordinary(t) for t in g], groups) for ids in group
            ]

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
            shown = " ".join(repr(c) for c in missing[:10]) + (
                f" and {len(missing) - 10} more" if len(missing) > 10 else ""
            )
            raise NanoGPTError(
                f"the char tokenizer has no token for {shown}: its vocabulary holds only the "
                f"{self.vocab_size:,} characters of the text it was prepared from"
            )
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


class BPETokenizer(TiktokenTokenizer):
    """A byte-level BPE trained here: ranks (token bytes, id = rank), a split pattern and special tokens after
    the ranks. Encoded by tiktoken, like gpt2."""

    kind = "bpe"

    def __init__(
        self,
        name: str,
        ranks: list[bytes],
        pattern: str,
        special_tokens: dict[str, int],
        pattern_name: str | None = None,
    ):
        import tiktoken

        self.ranks, self.pattern, self.pattern_name = ranks, pattern, pattern_name
        self.special_tokens = dict(special_tokens)
        try:
            encoding = tiktoken.Encoding(
                name=name,
                pat_str=pattern,
                mergeable_ranks={t: i for i, t in enumerate(ranks)},
                special_tokens=self.special_tokens,
            )
        except ValueError as e:  # a pattern the regex engine rejects, or ids that collide
            raise NanoGPTError(f"the {name} tokenizer is not valid: {e}") from None
        super().__init__(encoding)

    def encode_special(self, text: str) -> list[int]:
        """Like encode, but the special-token strings in `text` become their single ids."""
        return self.enc.encode(text, allowed_special="all")

    def describe(self) -> dict[str, Any]:
        import base64

        return {
            "name": self.name,
            "kind": self.kind,
            "vocab_size": self.vocab_size,
            "pattern": self.pattern,
            "pattern_name": self.pattern_name,
            "special_tokens": self.special_tokens,
            "ranks": [base64.b64encode(t).decode("ascii") for t in self.ranks],
        }

    @classmethod
    def from_description(cls, desc: dict[str, Any]) -> BPETokenizer:
        import base64

        try:
            ranks = [base64.b64decode(t, validate=True) for t in desc["ranks"]]
            return cls(desc["name"], ranks, desc["pattern"], desc["special_tokens"], desc.get("pattern_name"))
        except (KeyError, TypeError, ValueError) as e:
            raise NanoGPTError(
                f"the description of the trained tokenizer {desc.get('name')!r} is damaged ({type(e).__name__}: {e})"
            ) from None

    def save(self, folder: Path, trained: dict[str, Any] | None = None) -> None:
        """Write ranks.tiktoken and tokenizer.json into `folder` (which must exist)."""
        import base64

        lines = "".join(f"{base64.b64encode(t).decode('ascii')} {i}\n" for i, t in enumerate(self.ranks))
        (folder / RANKS_FILE).write_text(lines, encoding="ascii")
        config = {
            "format": "nanogpt-bpe",
            "version": 1,
            "name": self.name,
            "pattern_name": self.pattern_name,
            "pattern": self.pattern,
            "special_tokens": self.special_tokens,
            "vocab_size": self.vocab_size,
            **({"trained": trained} if trained else {}),
        }
        (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, folder: Path) -> BPETokenizer:
        """The tokenizer saved in `folder`; a damaged or foreign folder is one sentence."""
        import base64

        try:
            config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
            if config.get("format") != "nanogpt-bpe":
                raise ValueError(f"{CONFIG_FILE} is not a nanogpt tokenizer")
            ranks = []
            for i, line in enumerate((folder / RANKS_FILE).read_text(encoding="ascii").splitlines()):
                token, rank = line.split()
                if int(rank) != i:
                    raise ValueError(f"line {i + 1} of {RANKS_FILE} has rank {rank}, not {i}")
                ranks.append(base64.b64decode(token, validate=True))
            return cls(config["name"], ranks, config["pattern"], config["special_tokens"], config.get("pattern_name"))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise NanoGPTError(
                f"{folder} does not hold a readable trained tokenizer ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''})"
            ) from None


def check_bpe_settings(vocab_size: int, pattern: str, special_tokens: Sequence[str]) -> None:
    """One sentence for settings `train_bpe` cannot train with, before any text is read."""
    if pattern not in PATTERNS:
        raise NanoGPTError(f"unknown --pattern {pattern!r}; choose one of {', '.join(PATTERNS)}")
    if len(set(special_tokens)) != len(special_tokens) or not all(special_tokens):
        raise NanoGPTError(f"the special tokens must be distinct and not empty, got {list(special_tokens)}")
    smallest = 256 + len(special_tokens)
    if vocab_size < smallest:
        raise NanoGPTError(
            f"--vocab-size {vocab_size:,} is too small: a byte-level BPE holds the 256 byte values "
            f"and {len(special_tokens)} special token(s), so it needs at least {smallest:,}"
        )


def train_bpe(
    texts: Iterable[str], vocab_size: int, name: str, pattern: str = "gpt4", special_tokens: Sequence[str] = (EOT,)
) -> BPETokenizer:
    """A byte-level BPE of `vocab_size` tokens (fewer when the text runs out of pairs to merge) learnt from
    `texts` by Hugging Face tokenizers' trainer: ids 0..255 are the bytes, then the merged tokens in the order
    they were learnt, then the special tokens."""
    from nanogpt_cli.errors import require

    check_bpe_settings(vocab_size, pattern, special_tokens)
    tk = require("tokenizers", "hf", what="training a tokenizer")
    bpe = tk.Tokenizer(tk.models.BPE())
    bpe.pre_tokenizer = tk.pre_tokenizers.Sequence(
        [
            tk.pre_tokenizers.Split(tk.Regex(PATTERNS[pattern]), behavior="isolated"),
            tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size - len(special_tokens),
        show_progress=False,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    # the trainer numbers tokens as it creates them: the 256 one-character tokens of the byte alphabet first,
    # then each merged token when its first merge is learnt, which is the rank order tiktoken needs
    byte_of = {ch: b for b, ch in enumerate(byte_to_unicode())}
    merged = sorted((i, t) for t, i in bpe.get_vocab().items() if len(t) > 1)
    ranks = [bytes([b]) for b in range(256)] + [bytes(byte_of[ch] for ch in t) for _, t in merged]
    specials = {token: len(ranks) + i for i, token in enumerate(special_tokens)}
    return BPETokenizer(name, ranks, PATTERNS[pattern], specials, pattern)


def tokenizer_folder(spec: str, tokenizers_dir: Path = TOKENIZERS_DIR) -> Path | None:
    """The folder of the trained tokenizer that `spec` names: a NAME in `tokenizers_dir`, or a folder path; None
    when it names none (gpt2, char, byte and tiktoken's names are never looked up as folders)."""
    if spec in BUILTIN or not spec:
        return None
    for folder in (Path(tokenizers_dir) / spec, Path(spec).expanduser()):
        if (folder / CONFIG_FILE).is_file() and (folder / RANKS_FILE).is_file():
            return folder
    return None


def merges_from_ranks(ranks: list[bytes]) -> list[tuple[bytes, bytes]]:
    """The BPE merges that make a merge-list tokenizer (Hugging Face, llama.cpp) encode as tiktoken does with
    these ranks. tiktoken merges the adjacent pair whose concatenation has the lowest rank, so every split of a
    token into two tokens is a merge, ranked by the token it makes (then by its parts)."""
    rank = {t: i for i, t in enumerate(ranks)}
    merges = []
    for token, r in rank.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in rank and right in rank:
                merges.append((r, rank[left], rank[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def spell_bytes(token: bytes) -> str:
    """A token's bytes in GPT-2's byte alphabet (b' the' -> 'Ġthe')."""
    alphabet = byte_to_unicode()
    return "".join(alphabet[b] for b in token)


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
        raise NanoGPTError(
            f"the GPT-2 tokenizer files in {ASSETS_DIR} are missing or damaged ({e}); reinstall nanogpt-cli"
        ) from None
    # the same arguments as tiktoken_ext.openai_public.gpt2()
    return tiktoken.Encoding(
        name="gpt2",
        explicit_n_vocab=50257,
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={ENDOFTEXT: 50256},
    )


def available_tokenizers() -> list[str]:
    """gpt2, char, byte and every encoding name tiktoken knows."""
    import tiktoken

    return list(BUILTIN) + [n for n in tiktoken.list_encoding_names() if n not in BUILTIN]


def check_tokenizer_name(name: str, tokenizers_dir: Path = TOKENIZERS_DIR) -> None:
    """Raise NanoGPTError listing the valid names when `name` is not one; costs no download. A trained
    tokenizer is named by its NAME in `tokenizers_dir` or by the path of its folder."""
    from nanogpt_cli.hf_tokenizer import is_hf_spec

    valid = available_tokenizers()
    if name not in valid and tokenizer_folder(name, tokenizers_dir) is None and not is_hf_spec(name):
        raise NanoGPTError(
            f"unknown tokenizer {name!r}; choose one of {', '.join(valid)}, a tokenizer trained "
            f"with `nanogpt tokenizer train` (its NAME in {tokenizers_dir}/, or its folder), hf:NAME, or a "
            "Hugging Face tokenizer.json (or its folder)"
        )


def trained_or_named(name: str, tokenizers_dir: Path = TOKENIZERS_DIR) -> str:
    """A tokenizer as prepare takes it: a trained tokenizer's NAME becomes its folder; other names stay."""
    folder = tokenizer_folder(name, tokenizers_dir) if name not in available_tokenizers() else None
    return str(folder) if folder is not None else name


def build_tokenizer(name: str, texts: Iterable[str] | None = None, tokenizers_dir: Path = TOKENIZERS_DIR) -> Tokenizer:
    """The tokenizer called `name`. Only `char` reads `texts`: its vocabulary is their characters."""
    from nanogpt_cli.hf_tokenizer import is_hf_spec, read_hf_tokenizer

    check_tokenizer_name(name, tokenizers_dir)
    folder = tokenizer_folder(name, tokenizers_dir) if name not in available_tokenizers() else None
    if folder is not None:
        return BPETokenizer.load(folder)
    if name not in BUILTIN and is_hf_spec(name):
        return read_hf_tokenizer(name)
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
        raise NanoGPTError(
            f"could not load the {name} tokenizer: tiktoken downloads it on first use and that "
            f"failed ({type(e).__name__}); connect once to cache it, or use --tokenizer gpt2, char "
            f"or byte, which work offline"
        ) from None


def tokenizer_from_description(desc: dict[str, Any], folder: Path | None = None, text: str | None = None) -> Tokenizer:
    """Rebuild the tokenizer that `Tokenizer.describe()` described, and check its vocabulary size. A Hugging Face
    tokenizer is read from the tokenizer.json in `folder` (where the data, run or export keeps it) or its `text`."""
    if not isinstance(desc, dict) or not isinstance(desc.get("name"), str):
        raise NanoGPTError(f"not a tokenizer description: {desc!r}")
    name = desc["name"]
    if desc.get("kind") == "hf":
        from nanogpt_cli.hf_tokenizer import HFTokenizer

        tok: Tokenizer = HFTokenizer.load(desc, folder, text)
    elif desc.get("kind") == BPETokenizer.kind:  # a trained BPE carries its whole vocabulary
        tok = BPETokenizer.from_description(desc)
    elif name == "char":
        if not isinstance(desc.get("chars"), str):
            raise NanoGPTError("the char tokenizer description has no 'chars'")
        tok = CharTokenizer(desc["chars"])
    else:
        tok = build_tokenizer(name)
    expected = desc.get("vocab_size")
    if expected is not None and expected != tok.vocab_size:
        raise NanoGPTError(
            f"the {name} tokenizer has {tok.vocab_size:,} tokens here but {expected:,} where the "
            "data was prepared; prepare the data again with this version"
        )
    return tok


def same_tokenizer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two descriptions are one tokenizer. Two Hugging Face tokenizers are when their file and settings
    are, whatever they were named by (hf:NAME, a folder, an export of it)."""
    if a.get("kind") == "hf" and b.get("kind") == "hf":
        return {k: v for k, v in a.items() if k != "name"} == {k: v for k, v in b.items() if k != "name"}
    return a == b


def describe_difference(a: dict[str, Any], b: dict[str, Any], a_name: str, b_name: str) -> str:
    """How two tokenizer descriptions differ, in words ("" when they are the same): the names, or for two char
    tokenizers their vocabularies ("the vocabulary: 69 characters in the dataset vs 65 in the checkpoint, ...")."""
    if same_tokenizer(a, b):
        return ""
    if a.get("kind") == "hf" and b.get("kind") == "hf" and a.get("sha256") != b.get("sha256"):
        return f"another tokenizer.json in {a_name} ({a.get('name')}) than in {b_name} ({b.get('name')})"
    if a.get("kind") == "hf" and b.get("kind") == "hf":
        return f"the same tokenizer.json with other BOS/EOS settings in {a_name} and {b_name}"
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
    if a.get("vocab_size") == b.get("vocab_size"):
        return f"the vocabulary: the same size ({a.get('vocab_size')} tokens), other tokens in {a_name} and {b_name}"
    return f"the vocabulary: {a.get('vocab_size')} tokens in {a_name} vs {b.get('vocab_size')} in {b_name}"
