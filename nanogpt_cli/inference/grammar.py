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
import math
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

# A number a schema leaves unbounded is held to 16 digits before the point, as llama.cpp's schema converter holds
# it: an integer to [-1e16, 1e16] (llguidance reads bounds as doubles, in which 1e16 - 1 is 1e16), a number to
# (-1e16, 1e16), with at most 10 digits after the point (a multipleOf, which llguidance reads as a decimal step;
# 1e-10 is the finest it takes); otherwise a weak model can write digits until max_tokens runs out
INTEGER_DIGITS, FRACTION_DIGITS = 16, 10
_INTEGER_BOUNDS = {"minimum": -(10**INTEGER_DIGITS), "maximum": 10**INTEGER_DIGITS}
_NUMBER_BOUNDS = {"exclusiveMinimum": -(10**INTEGER_DIGITS), "exclusiveMaximum": 10**INTEGER_DIGITS}

# llguidance's budgets. The lexer's fuel bounds the regex derivatives it builds: its default, 1,000,000, let
# `(a{1000}){1000}` compute its first mask for 170 s on a busy 2-core machine (17 s at 300,000, 2 s at 100,000);
# 100,000 is too little for a schema of 200 properties with bounded numbers. Sizes are llguidance's own defaults.
LEXER_FUEL = 300_000
MAX_GRAMMAR_SIZE = 500_000  # symbols in the grammar's rules
MAX_LEXER_STATES = 250_000  # states the lexer may build (~1-2 kB each)

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
            grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(bounded(value)), defaults=COMPACT)
        elif kind in ("gbnf", "lark", "regex"):
            if not isinstance(value, str) or not value.strip():
                raise NanoGPTError(f"a {kind} grammar must be a non-empty string")
            grammar = llg.grammar_from(kind, value)
        else:
            raise NanoGPTError(f"unknown grammar kind {kind!r}; choose one of {', '.join(FORMATS)}")
    except ValueError as e:  # GBNF that does not convert, or JSON that is not a schema
        raise NanoGPTError(str(e).splitlines()[0]) from None
    vocab = vocabulary(tokenizer) if tokenizer is not None else None
    problem = llg.LLMatcher.validate_grammar(grammar, vocab, limits=limits())
    if problem:
        raise NanoGPTError(problem.splitlines()[0])
    return grammar


def limits():
    """llguidance's budgets for one grammar (LEXER_FUEL, MAX_GRAMMAR_SIZE, MAX_LEXER_STATES)."""
    llg = require("llguidance", "serve", "structured output")
    return llg.LLParserLimits(
        initial_lexer_fuel=LEXER_FUEL,
        max_grammar_size=MAX_GRAMMAR_SIZE,
        max_lexer_states=MAX_LEXER_STATES,
        verbose_errors=False,  # a one-line error: no parser state or grammar dump in a reply
    )


_NOT_SCHEMAS = ("enum", "const", "default", "examples", "required")  # values, not schemas: left as they are
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")  # name -> schema


def bounded(schema: Any, closed: bool = False, _open: bool = False) -> Any:
    """A copy of a JSON schema whose integers and numbers without bounds get llama.cpp's (INTEGER_DIGITS and
    FRACTION_DIGITS; a side left open beyond a bound the schema gives is held that far past it, so a bound of
    1e17 stays satisfiable); closed: every object without `additionalProperties` is taken as `false` (OpenAI's
    strict function calling asks for it on every object), except an object composed of parts (allOf, anyOf,
    oneOf beside its own properties) and those parts, each of which names only some of its keys. Text that
    validates against the result validates against the schema."""
    if isinstance(schema, list):
        return [bounded(item, closed, _open) for item in schema]
    if not isinstance(schema, dict):
        return schema
    composed = _kind(schema) == "object" and any(k in schema for k in _COMPOSERS)  # its keys are in several parts
    out = {}
    for key, value in schema.items():
        if key in _NOT_SCHEMAS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: bounded(v, closed) for name, v in value.items()}
        else:
            out[key] = bounded(value, closed, composed and key in _COMPOSERS)
    kind = _kind(out)
    if kind in ("integer", "number"):
        for key, value in (_INTEGER_BOUNDS if kind == "integer" else _NUMBER_BOUNDS).items():
            side = key[-6:]  # "inimum" or "aximum": a side the schema bounds, either way, is left as it is
            if "m" + side not in out and "exclusiveM" + side not in out:
                other = [out.get(k) for k in ("m" + _OTHER[side], "exclusiveM" + _OTHER[side])]
                other = [v for v in other if isinstance(v, (int, float)) and not isinstance(v, bool)]
                far = (max(other) if value > 0 else min(other)) if other else 0
                if other and (far >= value if value > 0 else far <= value):
                    value = 2 * far  # never on the wrong side of the bound given: twice as far instead
                    if not math.isfinite(value):
                        continue  # a bound near the largest double: that side is left as the schema leaves it
                out[key] = value
        if kind == "number" and "multipleOf" not in out:
            out["multipleOf"] = float(f"1e-{FRACTION_DIGITS}")
    if closed and not _open and not composed and kind == "object" and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


_COMPOSERS = ("allOf", "anyOf", "oneOf")
_OTHER = {"inimum": "aximum", "aximum": "inimum"}


def _kind(schema: dict) -> str | None:
    """A schema node's one type ("object" also for a node with properties and no type), or None."""
    t = schema.get("type")
    if isinstance(t, str):
        return t
    return "object" if t is None and isinstance(schema.get("properties"), dict) else None


class Constraint:
    """One row's grammar as it goes: the tokens allowed next, and the tokens taken so far."""

    def __init__(self, tokenizer: Tokenizer, grammar: str):
        llg = require("llguidance", "serve", "structured output")
        self.vocab_size = tokenizer.vocab_size
        self.matcher = llg.LLMatcher(vocabulary(tokenizer), grammar, log_level=0, limits=limits())
        if self.matcher.is_error():
            raise NanoGPTError(self.matcher.get_error().splitlines()[0])
        # the mask's words: 32 tokens each, the tokenizer's and the end-of-text one added for char and byte
        self.words = torch.empty((vocabulary(tokenizer).vocab_size + 31) // 32, dtype=torch.int32)
        self.added_eos = _adds_eos(tokenizer)
        self._next: torch.Tensor | None = None  # a mask done computed, for the next allowed()
        first = self.allowed(keep=True)  # the first mask: the costly part of a compile, made here, off the engine
        if not first.any():
            raise NanoGPTError("it cannot begin with any token of the model's vocabulary")
        if self.matcher.is_error():
            raise NanoGPTError(self.matcher.get_error().splitlines()[0])

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
        if self.matcher.is_error():  # a limit hit (an empty mask that cannot go on is for the caller to tell)
            error = self.matcher.get_error().splitlines()[0]
            if out.any() or not error.startswith("NoExtension"):
                raise NanoGPTError(error)
        self._next = out if keep else None
        return out

    def accept(self, token: int) -> None:
        """Take the token the row picked (one that allowed() allowed)."""
        if not self.matcher.consume_token(token):
            raise NanoGPTError(f"it stopped at token {token}: {self.matcher.get_error().splitlines()[0]}")
