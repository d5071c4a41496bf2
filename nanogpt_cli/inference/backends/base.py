"""The one interface every decode backend fills in (DecodeBackend): what it computes, declared (`features`), and
how it computes a prefill and a one-token step through the engine's KV cache.

    reason = backend.supports(model.config, dtype, device, quantization)   # None, or one sentence
    plan = backend.prepare(model, vocab_size)                              # its own forms of the weights
    logits = backend.prefill(plan, idx, cache_view)                        # (B, V) at each row's last token
    logits = backend.step(plan, idx, cache, n)                             # (n, V) after one token per row
    logits = backend.score(plan, idx, cache_view)                          # (B, T, V) after each new token
    with backend.decoding(plan): ...                                       # the engine's picks and steps
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from nanogpt_cli.config import Features, GPTConfig


class DecodeBackend:
    """How the engine's decode steps are computed. A backend owns every form of the weights it needs (packed,
    transposed, quantized heads): the engine holds only the opaque plan prepare() returns. Every backend is held
    to the torch backend by tests/test_backends.py's conformance matrix."""

    name: str  # what --backend takes
    features: Features  # the config fields and values it computes

    def supports(
        self, config: GPTConfig, dtype: torch.dtype, device: torch.device, quantization: str | None
    ) -> str | None:
        """None where it computes this model, else the one sentence saying why not."""
        raise NotImplementedError

    def prepare(self, model, vocab_size: int) -> Any:
        """Everything prefill and step read for the model as it is now (built once per model state where it
        copies weights); vocab_size: logits for the first vocab_size tokens only."""
        raise NotImplementedError

    def prefill(self, plan: Any, idx: torch.Tensor, cache) -> torch.Tensor:
        """Next-token logits (B, V) after idx (B, T), soft-capped, in the model's dtype; cache: a CacheView the
        tokens' keys and values go into (None: no cache, the rows are the whole context)."""
        raise NotImplementedError

    def step(self, plan: Any, idx: torch.Tensor, cache, n: int) -> torch.Tensor:
        """Next-token logits (n, V) after one new token for each of the cache's first n rows (idx (n,)), each at
        its own position; the rows advance by one. Called under torch.inference_mode()."""
        raise NotImplementedError

    def score(self, plan: Any, idx: torch.Tensor, cache) -> torch.Tensor:
        """Next-token logits (B, T, V) after each of idx's tokens (B, T), soft-capped, in the model's dtype, fed
        through cache (a CacheView) at each row's own position: how a speculative step checks a draft's tokens
        (inference/speculative.py) in one forward."""
        raise NotImplementedError

    def decoding(self, plan: Any) -> AbstractContextManager:
        """What the engine holds while it picks tokens and steps its rows (not while it prefills new ones): a
        backend that runs its own threads can keep torch's from competing with them there."""
        return nullcontext()

    def describe(self, plan: Any) -> str:
        """One line for `info` and /health: the backend's name and what it runs for this model."""
        return self.name


def reason_for_device(name: str, device: torch.device) -> str:
    return f"the {name} backend runs on a CPU, and the model is on {device}"
