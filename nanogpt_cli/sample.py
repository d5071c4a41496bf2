"""Text generation from a checkpoint: the model and its tokenizer come from the checkpoint alone.

    sampler = Sampler.load("checkpoints/shk")
    for piece in sampler.stream("ROMEO:", SampleSettings(max_new_tokens=100)): print(piece, end="")

Each step's next-token logits go through, in this order: the repetition penalty (on the raw logits),
temperature, top-k, top-p, then min-p; temperature 0 takes the most likely token (greedy).
"""

from __future__ import annotations

import codecs
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nanogpt_cli.checkpoint import InferenceModel, load_for_inference
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.tokenizer import Tokenizer


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


@dataclass
class SampleResult:
    prompt: str
    text: str  # the continuation only
    tokens: int  # tokens generated (the stop text and end-of-text included)
    token_ids: list[int]  # those tokens
    stop_reason: str  # "length", "stop" or "eot"
    elapsed_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


class Sampler:
    """A loaded model and tokenizer, kept for many prompts (the interactive loop reuses it)."""

    def __init__(self, loaded: InferenceModel):
        self.model, self.tokenizer, self.device = loaded.model, loaded.tokenizer, loaded.device

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
        cut = max(0, len(ids) - self.block_size)
        return ids[cut:], cut

    def stream(self, prompt: str, settings: SampleSettings, generator: torch.Generator | None = None,
               result: dict | None = None) -> Iterator[str]:
        """Yield the continuation's text as it is produced. Multi-byte characters split across tokens are
        held back until complete, and so is any text that may be the start of a stop string."""
        ids, _ = self.encode_prompt(prompt)
        generator = generator or torch.Generator(device=self.device).manual_seed(settings.seed)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        eot = None if settings.ignore_eot else self.tokenizer.eot_id
        text, emitted, reason, out_ids = "", 0, "length", []
        idx = torch.tensor([ids], dtype=torch.long, device=self.device)
        t0 = time.perf_counter()
        tokens = self.model.generate_tokens(idx, settings.max_new_tokens, settings.temperature, settings.top_k,
                                            settings.top_p, settings.min_p, settings.repetition_penalty,
                                            settings.use_cache, generator, vocab_size=self.tokenizer.vocab_size)
        for token in tokens:
            tid = int(token[0])
            out_ids.append(tid)
            if tid == eot:
                reason = "eot"
                break
            text += decoder.decode(self.tokenizer.decode_bytes([tid]))
            # a stop text cannot start before `emitted`: any text that could begin one is held back
            hit = min((i for i in (text.find(s, emitted) for s in settings.stop) if i >= 0), default=-1)
            if hit >= 0:
                text, reason = text[:hit], "stop"
                break
            safe = len(text) - _held_back(text, settings.stop)
            if safe > emitted:
                yield text[emitted:safe]
                emitted = safe
        tokens.close()
        if reason == "length":
            text += decoder.decode(b"", final=True)
        if len(text) > emitted:
            yield text[emitted:]
        if result is not None:
            result.update(text=text, tokens=len(out_ids), token_ids=out_ids, stop_reason=reason,
                          elapsed_s=time.perf_counter() - t0)

    def generate(self, prompt: str, settings: SampleSettings, generator: torch.Generator | None = None
                 ) -> SampleResult:
        info: dict = {}
        text = "".join(self.stream(prompt, settings, generator, info))
        assert text == info["text"]
        return SampleResult(prompt=prompt, text=text, tokens=info["tokens"], token_ids=info["token_ids"],
                            stop_reason=info["stop_reason"], elapsed_s=info["elapsed_s"])

    def samples(self, prompt: str, settings: SampleSettings, num_samples: int = 1) -> Iterator[Iterator[str]]:
        """num_samples continuations of one prompt, one after another, all drawn from one generator seeded
        with settings.seed (so the same seed gives the same set); each is a stream of text pieces."""
        if num_samples < 1:
            raise NanoGPTError(f"--num-samples must be at least 1, got {num_samples}")
        generator = torch.Generator(device=self.device).manual_seed(settings.seed)
        for _ in range(num_samples):
            yield self.stream(prompt, settings, generator)


def _encodable(tokenizer: Tokenizer, text: str) -> bool:
    try:
        tokenizer.encode(text)
        return True
    except NanoGPTError:
        return False


def _held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters of text could still grow into one of the stop strings."""
    longest = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                longest = max(longest, k)
                break
    return longest
