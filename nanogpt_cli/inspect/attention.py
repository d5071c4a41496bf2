"""Attention probabilities of every layer and head, from the model's own forward with the explicit kernel.

    maps = attention_maps(load_for_inference("checkpoints/shk", dtype="float32"), "ROMEO:")  # one prompt's maps
    logits, probs = attention_forward(model, idx)   # (B, T, V) and (B, L, nh, T, T)

The model's forward usually calls scaled_dot_product_attention, which never materializes the weights. Asked for
them, its attention (model/attention.py) computes the softmax over q k^T / sqrt(hs) itself and keeps them;
everything else is the forward as it always runs, so the pictures are the model's own (the tests check its logits
against the usual kernel's for every position scheme, norm, MLP and option).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.interop.loading import InferenceModel
from nanogpt_cli.model import GPT


@torch.no_grad()
def attention_forward(model: GPT, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT.forward(idx) (no cache, no dropout) with the attention probabilities kept: the logits (B, T, V) and
    every layer's attention probabilities (B, L, nh, T, T) in float32."""
    # dropout in the MLP would make the result a random draw, not the model's
    assert not model.training, "call model.eval() first"
    T = idx.size(1)
    if T > model.config.block_size:
        raise ValueError(f"{T} tokens exceed the context of {model.config.block_size}")
    layers: list[torch.Tensor] = []
    logits, _ = model(idx, probs=layers)  # (B, T, V)
    return logits, torch.stack(layers, dim=1)  # (B, L, nh, T, T)


@dataclass
class AttentionMaps:
    """One prompt's attention: every layer's and head's probabilities over its tokens."""

    source: str  # what was loaded
    name: str  # the run's name, for titles
    tokens: list[str]  # each token's text (bytes that are not whole UTF-8 characters shown as U+FFFD)
    ids: list[int]
    probs: torch.Tensor  # (L, nh, T, T) float32: row i is token i's attention over tokens 0..i
    cut: int = 0  # leading tokens of the prompt cut to fit the context

    def to_dict(self) -> dict[str, Any]:
        L, nh = self.probs.shape[:2]
        return {
            "source": self.source,
            "name": self.name,
            "tokens": self.tokens,
            "ids": self.ids,
            "cut": self.cut,
            "n_layer": L,
            "n_head": nh,
            "attention": self.probs.tolist(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AttentionMaps:
        return cls(
            source=d["source"],
            name=d["name"],
            tokens=d["tokens"],
            ids=d["ids"],
            cut=d.get("cut", 0),
            probs=torch.tensor(d["attention"], dtype=torch.float32),
        )


def attention_maps(loaded: InferenceModel, prompt: str, source: str = "", name: str = "") -> AttentionMaps:
    """The attention of every layer and head over prompt's tokens (its last block_size if it is longer)."""
    tok = loaded.tokenizer
    ids = tok.encode(prompt)
    if not ids:
        raise NanoGPTError("--prompt is empty: give some text to look at the attention over")
    cut = max(0, len(ids) - loaded.model.config.block_size)
    ids = ids[cut:]
    _, probs = attention_forward(loaded.model, torch.tensor([ids], device=loaded.device))
    tokens = [tok.decode_bytes([i]).decode("utf-8", errors="replace") for i in ids]
    return AttentionMaps(source, name, tokens, ids, probs[0].cpu(), cut)


def check_selection(n_layer: int, n_head: int, layer: int | None, head: int | None) -> None:
    """--layer and --head name a layer and a head the model has (counted from 0)."""
    if layer is not None and not 0 <= layer < n_layer:
        raise NanoGPTError(f"--layer must be between 0 and {n_layer - 1} (the model has {n_layer} layers), got {layer}")
    if head is not None and not 0 <= head < n_head:
        raise NanoGPTError(f"--head must be between 0 and {n_head - 1} (the model has {n_head} heads), got {head}")


def display_name(source: str | Path, meta: dict[str, Any] | None = None) -> str:
    """A short name for a loaded source: a run folder's name, a weights file with its folder, a hub model's name;
    with the training step when the weights know it."""
    text = str(source)
    if text.startswith("hf:"):
        name = text[3:]
    else:
        path = Path(text).resolve()
        name = f"{path.parent.name}/{path.name}" if path.is_file() else path.name
    step = (meta or {}).get("step")
    return f"{name} (step {step:,})" if isinstance(step, int) else name
