"""The torch backend: the model's own forward (GPT.hidden_states through the KV cache) and its own head. It
computes every config on every device, and is the reference every other backend is tested against
(tests/test_backends.py).

    plan = TORCH.prepare(model, vocab_size); logits = TORCH.step(plan, idx, cache, n)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn import functional as F

from nanogpt_cli.config import EVERY_FIELD, features
from nanogpt_cli.inference.backends.base import DecodeBackend
from nanogpt_cli.model import GPT, softcap


class Plan(NamedTuple):
    model: GPT
    head: torch.Tensor  # (V, C), V cut to the vocabulary prepare was given
    logit_softcap: float | None


class TorchBackend(DecodeBackend):
    """The modules' own forward: what `GPT.forward` computes, one token at a time."""

    name = "torch"
    features = features("the torch backend", EVERY_FIELD)  # the model's own forward computes every config

    def supports(self, config, dtype, device, quantization) -> str | None:
        return self.features.refusal(config)

    def prepare(self, model: GPT, vocab_size: int) -> Plan:
        return Plan(model, model.lm_head.weight[:vocab_size], model.config.logit_softcap)

    def prefill(self, plan: Plan, idx: torch.Tensor, cache) -> torch.Tensor:
        h = plan.model.hidden_states(idx, cache=cache)[:, -1]  # (B, C)
        return softcap(F.linear(h, plan.head), plan.logit_softcap)

    def step(self, plan: Plan, idx: torch.Tensor, cache, n: int) -> torch.Tensor:
        h = plan.model.hidden_states(idx.view(n, 1), cache=cache.view(0, n))  # (n, 1, C)
        return softcap(F.linear(h[:, -1], plan.head), plan.logit_softcap)

    def score(self, plan: Plan, idx: torch.Tensor, cache) -> torch.Tensor:
        h = plan.model.hidden_states(idx, cache=cache)  # (B, T, C)
        return softcap(F.linear(h, plan.head), plan.logit_softcap)

    def describe(self, plan: Plan) -> str:
        return f"{self.name} (the model's own forward)"


TORCH = TorchBackend()
