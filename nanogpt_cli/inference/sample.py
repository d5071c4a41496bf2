"""Text generation from a checkpoint: the model and its tokenizer come from the checkpoint alone.

    sampler = Sampler.load("checkpoints/shk")
    for piece in sampler.stream("ROMEO:", SampleSettings(max_new_tokens=100)): print(piece, end="")
    results = sampler.generate_many(["ROMEO:", "JULIET:"], SampleSettings())   # one batch on the engine

A thin layer over engine.Engine: prompts to token ids, tokens to text (streamed at character boundaries,
held back where it may begin a stop text), end-of-text and stop texts.

Each step's next-token logits go through, in this order: the repetition penalty (on the raw logits),
temperature, top-k, top-p, then min-p; temperature 0 takes the most likely token (greedy).
"""

from __future__ import annotations

import codecs
import dataclasses
import math
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.inference.engine import Engine, SamplingParams
from nanogpt_cli.interop.loading import InferenceModel, load_for_inference
from nanogpt_cli.tokenizer import Tokenizer

if TYPE_CHECKING:
    from nanogpt_cli.inference.speculative import Draft


@dataclass
class SampleSettings:
    max_new_tokens: int = 256  # tokens to generate per sample
    temperature: float = 0.8  # 0: greedy; below 1 sharper, above 1 flatter
    top_k: int | None = 200  # keep the k most likely tokens (None or 0: all)
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches p (1: all)
    min_p: float = 0.0  # drop tokens below min_p x the top probability (0: none)
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the text (1: off)
    seed: int = 1337
    stop: list[str] = field(default_factory=list)  # end a sample at the first occurrence of any of these
    ignore_eot: bool = False  # keep going past the end-of-text token
    use_cache: bool = True

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise NanoGPTError(f"--{name.replace('_', '-')} must be a finite number, got {getattr(self, name)}")
        if self.top_k == 0:  # as in other tools: 0 turns top-k off
            self.top_k = None
        if self.max_new_tokens < 0:
            raise NanoGPTError(f"--max-new-tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise NanoGPTError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise NanoGPTError(f"--top-k must be at least 1, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise NanoGPTError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise NanoGPTError(f"--min-p must be in [0, 1), got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise NanoGPTError(f"--repetition-penalty must be > 0, got {self.repetition_penalty}")
        if any(s == "" for s in self.stop):
            raise NanoGPTError("--stop takes a non-empty text")

    @property
    def params(self) -> SamplingParams:
        """The engine's share of these settings."""
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
        )


@dataclass
class SampleResult:
    prompt: str
    text: str  # the continuation only
    tokens: int  # tokens generated (the stop text and end-of-text included)
    token_ids: list[int]  # those tokens
    stop_reason: str  # "length", "stop" or "eot"
    elapsed_s: float
    draft_acceptance: float | None = None  # with a draft: the share of its proposed tokens that were kept

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


class Sampler:
    """A loaded model and tokenizer, kept for many prompts (the interactive loop reuses it)."""

    def __init__(self, loaded: InferenceModel, draft: Draft | None = None):
        self.model, self.tokenizer, self.device = loaded.model, loaded.tokenizer, loaded.device
        self.draft = draft  # a draft model for speculative decoding (inference/speculative.py), or None

    @classmethod
    def load(cls, checkpoint: str | Path, last: bool = False, device: str = "auto", dtype: str = "auto") -> Sampler:
        return cls(load_for_inference(checkpoint, last=last, device=device, dtype=dtype))

    @property
    def block_size(self) -> int:
        return self.model.config.block_size

    def encode_prompt(self, prompt: str) -> tuple[list[int], int]:
        """Token ids of the prompt and how many leading tokens were cut to fit the context. An empty prompt
        starts from the end-of-text token, or from a newline for tokenizers without one."""
        if prompt == "":
            if self.tokenizer.eot_id is not None:
                return [self.tokenizer.eot_id], 0
            return self.tokenizer.encode("\n") if _encodable(self.tokenizer, "\n") else [0], 0
        ids = self.tokenizer.encode(prompt)  # a char tokenizer names characters outside its vocabulary
        if self.tokenizer.bos_id is not None:  # a model that expects BOS (Llama's <s>) was trained with it
            ids = [self.tokenizer.bos_id, *ids]
        cut = max(0, len(ids) - self.block_size)
        return ids[cut:], cut

    def stream_many(
        self, prompts: list[str | list[int]], settings: SampleSettings, generator: torch.Generator | None = None
    ) -> Iterator[Piece]:
        """Continue every prompt (text, or token ids used as given, such as a rendered chat) at once, as rows of
        one batch on the engine, and yield each sample's text as it is produced: Piece(row, text, result),
        result set on the piece that ends its row. Each row ends on its own (length, end-of-text, stop text) and
        leaves the batch at once. Prompts of different lengths are not padded: each row keeps its own position
        in the KV cache, so its text is what sampling it alone computes, up to float rounding. Row r draws from
        its own generator seeded with settings.seed + r (the first row of a batch is the single sample of that
        seed), or, given `generator`, all rows from that."""
        if not prompts:
            return
        encoded = [p if isinstance(p, list) else self.encode_prompt(p)[0] for p in prompts]
        eot = () if settings.ignore_eot else self.tokenizer.stop_ids  # end-of-text, and a model's end of turn
        rows = [TextStream(self.tokenizer, settings.stop, eot, settings.max_new_tokens) for _ in prompts]
        t0 = time.perf_counter()
        if settings.max_new_tokens == 0:
            for r, row in enumerate(rows):
                yield Piece(r, row.finish(), row.result(prompts[r], time.perf_counter() - t0))
            return
        engine = self._engine(len(prompts), settings.use_cache)
        generators = [
            generator or torch.Generator(device=self.device).manual_seed(settings.seed + r) for r in range(len(prompts))
        ]
        ids = engine.add_many(encoded, settings.params, settings.max_new_tokens, generators, stop_ids=eot)
        which = {row_id: r for r, row_id in enumerate(ids)}
        while engine.active:
            for t in engine.step():
                r = which[t.row]
                text = rows[r].feed(t.token)
                if rows[r].done:
                    engine.remove(t.row)  # a stop text: the engine did not see it (no-op when it ended the row)
                    result = rows[r].result(prompts[r], time.perf_counter() - t0)
                    if self.draft is not None:
                        result.draft_acceptance = engine.row_stats[t.row].rate
                    yield Piece(r, text, result)
                elif text:
                    yield Piece(r, text)

    def _engine(self, rows: int, use_cache: bool) -> Engine:
        """An engine for one batch: a speculative one with the draft."""
        if self.draft is None:
            return Engine(self.model, max_batch=rows, vocab_size=self.tokenizer.vocab_size, use_cache=use_cache)
        from nanogpt_cli.inference.speculative import SpeculativeEngine

        return SpeculativeEngine(
            self.model, self.draft, max_batch=rows, vocab_size=self.tokenizer.vocab_size, use_cache=use_cache
        )

    def stream(
        self,
        prompt: str | list[int],
        settings: SampleSettings,
        generator: torch.Generator | None = None,
        result: dict | None = None,
    ) -> Iterator[str]:
        """Yield the continuation's text as it is produced. Multi-byte characters split across tokens are
        held back until complete, and so is any text that may be the start of a stop string."""
        for piece in self.stream_many([prompt], settings, generator):
            if piece.text:
                yield piece.text
            if piece.result is not None and result is not None:
                result.update(dataclasses.asdict(piece.result))

    def generate_many(
        self, prompts: list[str | list[int]], settings: SampleSettings, generator: torch.Generator | None = None
    ) -> list[SampleResult]:
        """One sample per prompt, generated together as one batch (see stream_many)."""
        results: list[SampleResult | None] = [None] * len(prompts)
        for piece in self.stream_many(prompts, settings, generator):
            if piece.result is not None:
                results[piece.row] = piece.result
        return results

    def generate(self, prompt: str, settings: SampleSettings, generator: torch.Generator | None = None) -> SampleResult:
        return self.generate_many([prompt], settings, generator)[0]

    def samples(
        self, prompt: str, settings: SampleSettings, num_samples: int = 1, results: list | None = None
    ) -> Iterator[Iterator[str]]:
        """num_samples continuations of one prompt, decoded together as one batch and handed out one after
        another: each is a stream of text pieces, and reading sample i drives the whole batch, keeping the
        later samples' text until their turn. So a terminal shows sample 1 live, then each next one at once up
        to where the batch is, then live. The same seed gives the same set. results: a list of num_samples,
        where each sample's SampleResult is put when it ends."""
        if num_samples < 1:
            raise NanoGPTError(f"--num-samples must be at least 1, got {num_samples}")
        pieces = self.stream_many([prompt] * num_samples, settings)
        held: list[deque[str]] = [deque() for _ in range(num_samples)]
        done = [False] * num_samples

        def one(row: int) -> Iterator[str]:
            while True:
                while held[row]:
                    yield held[row].popleft()
                if done[row]:
                    return
                piece = next(pieces)  # never exhausted while a row is not done
                if piece.text:
                    held[piece.row].append(piece.text)
                if piece.result is not None and results is not None:
                    results[piece.row] = piece.result
                done[piece.row] = done[piece.row] or piece.result is not None

        for row in range(num_samples):
            yield one(row)


@dataclass
class Piece:
    """New text of one sample in a batch; `result` is set on the piece that ends that sample."""

    row: int  # which prompt
    text: str
    result: SampleResult | None = None


class TextStream:
    """One sample's text as its tokens arrive: incremental UTF-8 decoding (a character split across tokens is
    held until complete), end of text, stop texts, and how much of the text is safe to show (a stop text
    cannot start before `emitted`: text that could begin one is held). The server streams through it too.

        stream = TextStream(tokenizer, stop=["\n\n"], eot=tokenizer.stop_ids, limit=100)
        piece = stream.feed(token_id)   # new safe text; stream.done, stream.reason ("length", "stop", "eot")

    eot: the token, or the tokens, that end the text (end-of-text, a model's end of turn); None or () for none.
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str], eot: int | Sequence[int] | None, limit: int):
        self.tokenizer, self.stop, self.limit = tokenizer, stop, limit
        self.eot = frozenset([eot] if isinstance(eot, int) else eot or ())
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text, self.emitted, self.reason, self.ids, self.done = "", 0, "length", [], False

    def feed(self, tid: int) -> str:
        """Take the row's next token; return the text that became safe to show (all of it when the row ends)."""
        self.ids.append(tid)
        if tid in self.eot:
            self.reason = "eot"
            return self.finish()
        self.text += self.decoder.decode(self.tokenizer.decode_bytes([tid]))
        hit = min((i for i in (self.text.find(s, self.emitted) for s in self.stop) if i >= 0), default=-1)
        if hit >= 0:
            self.text, self.reason = self.text[:hit], "stop"
            return self.finish()
        if len(self.ids) >= self.limit:
            return self.finish()
        safe = len(self.text) - _held_back(self.text, self.stop)
        out = self.text[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return out

    def finish(self) -> str:
        self.done = True
        if self.reason == "length":
            self.text += self.decoder.decode(b"", final=True)
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out

    def result(self, prompt: str, elapsed_s: float) -> SampleResult:
        return SampleResult(
            prompt=prompt,
            text=self.text,
            tokens=len(self.ids),
            token_ids=self.ids,
            stop_reason=self.reason,
            elapsed_s=elapsed_s,
        )


def _encodable(tokenizer: Tokenizer, text: str) -> bool:
    try:
        tokenizer.encode(text)
        return True
    except NanoGPTError:
        return False


def _held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters of text could still grow into one of the stop strings."""
    longest, last = 0, text[-1:]
    for s in stops:
        # only a beginning of s that ends in text's last character can match: try those, longest first
        k = s.rfind(last, 0, min(len(s) - 1, len(text))) if last else -1
        while k >= 0:
            if text.endswith(s[: k + 1]):
                longest = max(longest, k + 1)
                break
            k = s.rfind(last, 0, k)
    return longest
