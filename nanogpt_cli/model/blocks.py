"""The Transformer block, written once (`block_forward`), and its parts: norms, the MLP's activations, dropout and
the logits' soft-cap. The modules hold the weights; `Block.ops` hands them to block_forward as they are, and
inference/backends/decode.py hands it faster forms of the same operations for decoding a few rows.

    x = block(x, ctx, layer)   # x (N, C), the residual stream of N = B * T tokens
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from nanogpt_cli.config import GPTConfig
from nanogpt_cli.model.attention import AttentionOps, CausalSelfAttention, Context, Op, attention, rms_norm

Residual = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (branch input, x) -> x + projection


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    # a function, not nn.Dropout modules: decoding one token at a time pays for every module call, and dropout
    # has no weights to hold
    return F.dropout(x, p, training) if training and p > 0 else x


class ReLUSquared(torch.autograd.Function):
    """relu(h)**2 with a hand-written backward, 2 * relu(h) * grad: autograd's own graph for relu().square()
    makes six passes over the (B, T, H) hidden layer where this makes three, and on a CPU these passes are bound
    by memory (benchmarks/README.md, measurements behind the code)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        r = F.relu(h)
        ctx.save_for_backward(r)
        return r * r

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (r,) = ctx.saved_tensors
        # one pass: addcmul against a broadcast zero, where grad.mul(r).mul_(2) makes two; doubling is exact, so the
        # result is the same bit for bit
        return torch.addcmul(grad.new_zeros(()), grad, r, value=2.0)


def activation(h: torch.Tensor, mlp: str) -> torch.Tensor:
    """The MLP's nonlinearity on its hidden layer (N, H), or on the fused gate and up halves (N, 2H)."""
    if mlp == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    if mlp == "geglu":  # Gemma: the gate through tanh-approximated GELU (Shazeer 2020's GEGLU)
        gate, up = h.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
    if mlp == "relu2":  # squared ReLU (So et al. 2021, Primer): as cheap as ReLU, trains like GELU or better
        if torch.is_grad_enabled() and h.requires_grad:
            return ReLUSquared.apply(h)
        return F.relu(h).square()  # decoding: no graph, and a Function's call costs more than the two ops
    # exact GELU is cheaper than the tanh form on a CPU; GPT-2's weights need the tanh form
    return F.gelu(h, approximate="tanh" if mlp == "gelu_tanh" else "none")


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's logit soft-capping, cap * tanh(logits / cap), in fp32: a smooth bound on the logits' size that
    keeps early training from making them large. None: the logits as they are."""
    if cap is None:
        return logits
    return cap * torch.tanh(logits.float() / cap)


def make_norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return rms_norm(config.n_embd, config)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)


class BlockOps(NamedTuple):
    """One block's operations as block_forward calls them: its modules (Block.ops), or faster forms of the same
    operations (inference/backends/decode.py), which fold each residual add into the projection's matmul."""

    ln_1: Op
    attn: AttentionOps
    attn_out: Residual  # (heads' outputs, x) -> x + c_proj(heads' outputs)
    ln_2: Op
    c_fc: Op  # (N, C) -> (N, H), or (N, 2H) for SwiGLU's gate and up halves
    act: Op
    mlp_out: Residual  # (hidden, x) -> x + c_proj(hidden)
    parallel: bool = False  # GPT-NeoX's parallel residual: the MLP reads the block's input, not attention's sum


def block_forward(w: BlockOps, x: torch.Tensor, ctx: Context, layer: int) -> torch.Tensor:
    """Pre-LN residual block on the residual stream x (N, C): x + attn(norm(x)), then x + mlp(norm(x)); with the
    parallel residual x + attn(ln_1(x)) + mlp(ln_2(x)). A post-norm (Gemma 3) rides in attn_out and mlp_out."""
    if w.parallel:
        h = w.ln_2(x)
        x = w.attn_out(attention(w.attn, w.ln_1(x), ctx, layer), x)
    else:
        x = w.attn_out(attention(w.attn, w.ln_1(x), ctx, layer), x)
        h = w.ln_2(x)
    return w.mlp_out(w.act(w.c_fc(h)), x)


def post_normed(proj: Op, norm: Op) -> Op:
    """A sub-block's output projection followed by its post-norm (Gemma 3's post_attention_layernorm)."""
    return lambda y: norm(proj(y))


class MLP(nn.Module):
    """The MLP's weights; its computation is block_forward's second half."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.kind = config.mlp
        H = config.hidden_size
        # SwiGLU (Shazeer 2020) fuses its gate and up projections into one matrix: (C, 2H)
        self.c_fc = nn.Linear(config.n_embd, 2 * H if config.gated else H, bias=config.bias)
        self.c_proj = nn.Linear(H, config.n_embd, bias=config.bias)


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)
        self.dropout = config.dropout
        self.parallel = config.parallel_residual
        if config.post_norms:  # Gemma 3: each sub-block's output normed before its residual add
            self.post_ln_1, self.post_ln_2 = make_norm(config), make_norm(config)
        else:
            self.post_ln_1 = self.post_ln_2 = None

    def forward(self, x: torch.Tensor, ctx: Context, layer: int = 0) -> torch.Tensor:
        return block_forward(self.ops(), x, ctx, layer)

    def ops(self) -> BlockOps:
        """The modules as block_forward calls them, looked up on each call (LoRA replaces projections in place),
        with dropout on each residual branch while training."""
        attn, mlp = self.attn, self.mlp
        p = self.dropout if self.training else 0.0
        attn_proj, mlp_proj = attn.c_proj, mlp.c_proj
        if self.post_ln_1 is not None:
            attn_proj = post_normed(attn_proj, self.post_ln_1)
            mlp_proj = post_normed(mlp_proj, self.post_ln_2)
        return BlockOps(
            ln_1=self.ln_1,
            attn=attn.ops(),
            attn_out=lambda y, x: x + dropout(attn_proj(y), p, self.training),
            ln_2=self.ln_2,
            c_fc=mlp.c_fc,
            act=partial(activation, mlp=mlp.kind),
            mlp_out=lambda h, x: x + dropout(mlp_proj(h), p, self.training),
            parallel=self.parallel,
        )
