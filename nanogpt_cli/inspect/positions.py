"""What a model's position scheme looks like, as numbers to draw: the tables the tutorials describe in prose.

    pos = position_views(model)   # PositionViews: the scheme and its figures' data

- sinusoidal (Vaswani et al. 2017): the fixed table added to the embeddings, and the cosine similarity of its
  rows, which depends only on the distance between two positions;
- learned (GPT-2): the trained table, and the cosine similarity of its rows, which shows what training made of
  nearby and distant positions;
- RoPE (Su et al. 2021): nothing is added; each pair of a head's dimensions is rotated by position x frequency.
  The figures are the frequencies (as wavelengths in tokens), the rotation angles' cosines by position, and the
  score q.k of two equal vectors d tokens apart, which falls off with the distance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from nanogpt_cli.model import GPT, rope_inv_freq


@dataclass
class PositionViews:
    kind: str  # rope | sinusoidal | learned
    summary: str  # one line for the terminal
    table: torch.Tensor  # (block_size, n_embd) added table, or RoPE's cos(position x frequency) (block_size, hs/2)
    similarity: torch.Tensor | None  # (block_size, block_size) cosine similarity of the table's rows; None for RoPE
    wavelengths: torch.Tensor | None  # RoPE: tokens per full turn of each pair (hs/2,); None otherwise
    decay: torch.Tensor | None  # RoPE: q.k of two equal all-ones vectors d = 0..block_size-1 tokens apart, / hs


def cosine_matrix(table: torch.Tensor) -> torch.Tensor:
    unit = F.normalize(table.float(), dim=-1)
    return unit @ unit.T  # (P, P)


@torch.no_grad()
def position_views(model: GPT) -> PositionViews:
    cfg = model.config
    P = cfg.block_size
    if cfg.pos_encoding == "rope":
        hs = cfg.rotary_size  # the dimensions RoPE turns (--rotary-dim); the rest of a head has no position
        inv_freq = rope_inv_freq(hs, cfg.rope_theta, cfg)  # (hs/2,), float64, with the model's RoPE scaling
        dims = f"head size {hs}" if cfg.rotary_dim is None else f"on {hs} of {cfg.head_size} head dims"
        angles = torch.arange(P, dtype=torch.float64)[:, None] * inv_freq  # (P, hs/2)
        wavelengths = 2 * math.pi / inv_freq
        # q = k = ones: each pair contributes 2 cos(d * freq) to q.k, so the mean over pairs is the score's shape
        decay = angles.cos().mean(dim=-1)  # (P,) at d = 0..P-1
        scaled = "" if cfg.rope_scaling == "none" else f" ({cfg.rope_scaling} scaling x{cfg.rope_factor:g})"
        summary = (
            f"RoPE, theta {cfg.rope_theta:,g}{scaled}, {dims}: {hs // 2} rotating pairs per head, wavelengths "
            f"from {wavelengths[0]:.1f} to {wavelengths[-1]:,.0f} tokens (context {P:,})"
        )
        return PositionViews("rope", summary, angles.cos().float(), None, wavelengths.float(), decay.float())
    if cfg.pos_encoding == "learned":
        table = model.transformer.wpe.weight.detach().float().cpu()
        what = "learned"
    else:
        table = model.pos_table.float().cpu()
        what = "sinusoidal"
    sim = cosine_matrix(table)
    neighbours = sim.diagonal(offset=1).mean().item() if P > 1 else 1.0
    far = sim.triu(diagonal=P // 2).sum().item() / max(1, (P - P // 2) * (P - P // 2 + 1) // 2)
    summary = (
        f"{what} positions, {P:,} x {cfg.n_embd}: neighbouring positions' cosine similarity {neighbours:.2f} "
        f"on average, positions half the context or more apart {far:.2f}"
    )
    return PositionViews(what, summary, table, sim, None, None)
