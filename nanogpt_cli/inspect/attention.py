"""Attention probabilities of every layer and head, from an explicit path beside the fused kernel.

    maps = attention_maps(load_for_inference("checkpoints/shk", dtype="float32"), "ROMEO:")  # one prompt's maps
    logits, probs = attention_forward(model, idx)   # (B, T, V) and (B, L, nh, T, T)

The model's own forward calls scaled_dot_product_attention, which never materializes the weights. This path runs
the same submodules (norms, c_attn, QK-norm, RoPE, c_proj, MLP, soft-cap) but computes the attention as
softmax(q k^T / sqrt(hs) + causal mask) itself, so the weights can be kept. Its logits equal the forward's (the
tests check every position scheme, norm, MLP and option), which is what makes the pictures the model's own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.interop.loading import InferenceModel
from nanogpt_cli.model import GPT, CausalSelfAttention, apply_rope, softcap


def attention_probs(
    attn: CausalSelfAttention, x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One attention layer on its normed input x (B, T, C), the way CausalSelfAttention.forward computes it
    without a cache: its output (B, T, C) and its attention probabilities (B, nh, T, T), in float32."""
    B, T, C = x.size()
    nh, hs = attn.n_head, attn.head_size
    qkv = attn.c_attn(x).view(B, T, 3, nh, hs)  # (B, T, 3, nh, hs)
    q, k, v = qkv.unbind(dim=2)  # (B, T, nh, hs) each
    if attn.q_norm is not None:  # per head, before RoPE, as in the model
        q, k = attn.q_norm(q), attn.k_norm(k)
    if attn.rope:
        c, s = cos[:, 0], sin[:, 0]  # (T, 1, hs): broadcast over (B, T, nh, hs)
        q, k = apply_rope(q, c, s), apply_rope(k, c, s)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh, T, hs)
    # scores in float32 whatever the weights' dtype, so that the probabilities sum to 1 to float precision
    scores = q.float() @ k.float().transpose(-2, -1) / math.sqrt(hs)  # (B, nh, T, T)
    future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(diagonal=1)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)  # (B, nh, T, T); exact zeros above
    y = (probs.to(v.dtype) @ v).transpose(1, 2).reshape(B, T, C)  # (B, T, C)
    return attn.c_proj(y), probs


@torch.no_grad()
def attention_forward(model: GPT, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT.forward(idx) (no cache, no dropout) through attention_probs: the logits (B, T, V) and every layer's
    attention probabilities (B, L, nh, T, T) in float32."""
    # dropout in the MLP would make the result a random draw, not the model's
    assert not model.training, "call model.eval() first"
    cfg = model.config
    T = idx.size(1)
    if T > cfg.block_size:
        raise ValueError(f"{T} tokens exceed the context of {cfg.block_size}")
    tr = model.transformer
    x = tr.wte(idx)  # (B, T, C)
    cos = sin = None
    if cfg.pos_encoding == "learned":
        x = x + tr.wpe(torch.arange(T, device=idx.device))
    elif cfg.pos_encoding == "sinusoidal":
        x = x + model.pos_table[:T]
    else:
        cos, sin = model.rope_cos[:T], model.rope_sin[:T]  # (T, 1, 1, hs)
    layers = []
    for block in tr.h:
        y, probs = attention_probs(block.attn, block.ln_1(x), cos, sin)
        x = x + y
        x = x + block.mlp(block.ln_2(x))  # dropout inside is off: the caller's model is in eval mode
        layers.append(probs)
    logits = softcap(model.lm_head(tr.ln_f(x)), cfg.logit_softcap)  # (B, T, V)
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
