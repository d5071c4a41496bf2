"""Grammar constraints: a JSON schema, a regex or a GBNF/Lark grammar turned into a per-row token mask, through
llguidance (the `serve` extra).

    grammar = compile_grammar("json_schema", {"type": "object", ...})   # NanoGPTError naming what is wrong
    constraint = Constraint(tokenizer, grammar)
    engine.add(prompt, params, 100, constraint=constraint)            # the row only takes tokens it allows

A tokenizer's vocabulary is compiled for llguidance once (vocabulary(), cached per tokenizer object: under a second
for GPT-2's 50,257 tokens); each constraint is then a matcher over it that gives the tokens allowed next
(allowed) and takes the token that was picked (accept). JSON is compact (no whitespace between tokens): a
model cannot pad it with spaces until it runs out of tokens.
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any

import numpy as np
import torch

from nanogpt_cli.errors import NanoGPTError, require
from nanogpt_cli.tokenizer import TiktokenTokenizer, Tokenizer

__all__ = ["FORMATS", "Constraint", "compile_grammar", "vocabulary"]

FORMATS = ("json_schema", "regex", "gbnf", "lark")  # what compile_grammar takes
COMPACT = {"whitespace_flexible": False}  # llguidance's option for JSON without free whitespace

_vocabularies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class _Vocabulary:
    """A tokenizer's tokens as llguidance's TokenizerWrapper reads them. Tokenizers without an end-of-text token
    (char, byte) get one past their vocabulary, which the model never picks: their rows end when the grammar
    can go no further."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        size = tokenizer.vocab_size
        self.tokens = [tokenizer.decode_bytes([i]) for i in range(size)] + [b"\xff[eos]"]  # \xff: a special token
        self.eos_token_id, self.bos_token_id, self.special_token_ids = size, None, [size]

    def __call__(self, data: bytes) -> list[int]:
        try:
            return self.tokenizer.encode(data.decode("utf-8", errors="replace"))
        except NanoGPTError:  # a char vocabulary lacks the character: llguidance then splits the text itself
            return []


def vocabulary(tokenizer: Tokenizer):
    """llguidance's compiled form of the tokenizer's vocabulary, made once per tokenizer and cached."""
    with _lock:
        cached = _vocabularies.get(tokenizer)
        if cached is not None:
            return cached
        llg = require("llguidance", "serve", "structured output")
        if not _adds_eos(tokenizer):
            from llguidance.tiktoken import lltokenizer_from_encoding

            compiled = lltokenizer_from_encoding(tokenizer.enc, n_vocab=tokenizer.vocab_size)
        else:
            wrapper = _Vocabulary(tokenizer)
            compiled = llg.LLTokenizer(llg.TokenizerWrapper(wrapper), n_vocab=len(wrapper.tokens))
        _vocabularies[tokenizer] = compiled
        return compiled


def _adds_eos(tokenizer: Tokenizer) -> bool:
    """Whether llguidance gets an end-of-text token past the vocabulary (_Vocabulary) rather than tiktoken's."""
    return not (isinstance(tokenizer, TiktokenTokenizer) and tokenizer.eot_id is not None)


def compile_grammar(kind: str, value: Any, tokenizer: Tokenizer | None = None) -> str:
    """A grammar in llguidance's form from a JSON schema (a dict), a regex, or a GBNF or Lark grammar (text);
    NanoGPTError with the library's own sentence when it is not valid."""
    llg = require("llguidance", "serve", "structured output")
    try:
        if kind == "json_schema":
            if not isinstance(value, dict):
                raise NanoGPTError("a JSON schema must be a JSON object")
            grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(value), defaults=COMPACT)
        elif kind in ("gbnf", "lark", "regex"):
            if not isinstance(value, str) or not value.strip():
                raise NanoGPTError(f"a {kind} grammar must be a non-empty string")
            grammar = llg.grammar_from(kind, value)
        else:
            raise NanoGPTError(f"unknown grammar kind {kind!r}; choose one of {', '.join(FORMATS)}")
    except ValueError as e:  # GBNF that does not convert, or JSON that is not a schema
        raise NanoGPTError(str(e).splitlines()[0]) from None
    problem = llg.LLMatcher.validate_grammar(grammar, vocabulary(tokenizer) if tokenizer is not None else None)
    if problem:
        raise NanoGPTError(problem.splitlines()[0])
    return grammar


class Constraint:
    """One row's grammar as it goes: the tokens allowed next, and the tokens taken so far."""

    def __init__(self, tokenizer: Tokenizer, grammar: str):
        llg = require("llguidance", "serve", "structured output")
        self.vocab_size = tokenizer.vocab_size
        self.matcher = llg.LLMatcher(vocabulary(tokenizer), grammar, log_level=0)
        if self.matcher.is_error():
            raise NanoGPTError(self.matcher.get_error().splitlines()[0])
        # the mask's words: 32 tokens each, the tokenizer's and the end-of-text one added for char and byte
        self.words = torch.empty((vocabulary(tokenizer).vocab_size + 31) // 32, dtype=torch.int32)
        self.added_eos = _adds_eos(tokenizer)
        self._next: torch.Tensor | None = None  # a mask done computed, for the next allowed()
        if not self.allowed(keep=True).any():
            raise NanoGPTError("it cannot begin with any token of the model's vocabulary")

    def copy(self) -> Constraint:
        """An independent constraint at the same point (a request's other choices)."""
        new = object.__new__(Constraint)
        new.vocab_size, new.matcher = self.vocab_size, self.matcher.deep_copy()
        new.words = torch.empty_like(self.words)
        new.added_eos, new._next = self.added_eos, self._next
        return new

    @property
    def done(self) -> bool:
        """The grammar is complete and nothing can follow: the row ends. Without an end-of-text token of its own
        (char, byte), also when the text is complete and the only way on is the added one."""
        if self.matcher.is_stopped():
            return True
        return self.added_eos and self.matcher.is_accepting() and not self.allowed(keep=True).any()

    def allowed(self, keep: bool = False) -> torch.Tensor:
        """(vocab_size,) bool: the tokens that keep the text inside the grammar (keep: the next call returns
        this one again, computed once)."""
        if self._next is not None:
            out, self._next = self._next, (self._next if keep else None)
            return out
        # llguidance writes 32 tokens per int32 word, token 32 * j + i at bit i of word j: little-endian bit
        # order over the bytes, which numpy unpacks ~5x faster than torch's shifts (17 against 97 us for GPT-2)
        self.matcher.unsafe_compute_mask_ptr(self.words.data_ptr(), self.words.numel() * 4)
        bits = np.unpackbits(self.words.numpy().view(np.uint8), bitorder="little")[: self.vocab_size]
        out = torch.from_numpy(bits).view(torch.bool)
        self._next = out if keep else None
        return out

    def accept(self, token: int) -> None:
        """Take the token the row picked (one that allowed() allowed)."""
        if not self.matcher.consume_token(token):
            raise NanoGPTError(f"the grammar refused token {token}: {self.matcher.get_error()}")
