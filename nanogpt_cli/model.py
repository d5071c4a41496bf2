"""The GPT: a decoder-only Transformer with Pre-LN blocks and RoPE / sinusoidal / learned positions.

    model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128))
    logits, loss = model(idx, targets)

The architecture only: running it token by token (the KV cache, the decode step, sampling) is engine.py's.

Shape legend: B batch, T tokens in this call, S tokens held in the KV cache, C n_embd, nh n_head,
hs head size (C // nh), H MLP hidden width, V vocab_size.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from nanogpt_cli.config import GPTConfig

__all__ = ["GPT", "Cache", "GPTConfig", "activation", "apply_rope", "rope_tables", "sinusoidal_table", "softcap"]


# --- positions ---------------------------------------------------------------------------------------


def sinusoidal_table(n_pos: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """Vaswani et al. (2017): pe[p, 2i] = sin(p / base^(2i/dim)), pe[p, 2i+1] = cos(same). (n_pos, dim)"""
    pos = torch.arange(n_pos, dtype=torch.float64)[:, None]
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = pos * inv_freq  # (n_pos, dim/2)
    pe = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)  # interleave -> (n_pos, dim)
    return pe.float()


def rope_tables(positions: torch.Tensor, head_size: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin for RoPE (Su et al. 2021) at the given positions, in Llama's half-split layout,
    where x[i] and x[i + hs/2] form a rotating pair. The sin table's first half is negated, so that
    apply_rope needs one roll instead of a split, a negation and a concatenation. (T, hs) each"""
    inv_freq = theta ** (-torch.arange(0, head_size, 2, dtype=torch.float64, device=positions.device) / head_size)
    angles = positions.to(torch.float64)[:, None] * inv_freq  # (T, hs/2)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)  # (T, hs): the two halves of a head share frequencies
    sin = torch.cat([-angles.sin(), angles.sin()], dim=-1)
    return cos.float(), sin.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x[i], x[i + hs/2]) by their position's angle:
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). x: (..., hs); cos, sin from rope_tables, broadcast to x."""
    half = x.size(-1) // 2
    # the fp32 tables meet x in x's dtype: under bf16 autocast q and k stay bf16 (fp32 tables would upcast
    # them, and attention would cast them back, two extra passes over q and k)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.addcmul(x * cos, x.roll(half, dims=-1), sin)  # roll: (x1, x2) -> (x2, x1)


def rotate_half_into(out: torch.Tensor, x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """out = x * c + roll(x) * s over the last dimension, roll being the swap of its two halves, written half by
    half into out: torch.roll copies through a concatenation, a pass that costs as much as the product."""
    half = x.size(-1) // 2
    for lo, hi in ((slice(None, half), slice(half, None)), (slice(half, None), slice(None, half))):
        torch.mul(x[..., lo], c[..., lo], out=out[..., lo]).addcmul_(x[..., hi], s[..., lo])
    return out


class NormRopeQKV(torch.autograd.Function):
    """QK-norm then RoPE on the fused qkv (B, T, 3, nh, hs), returning q, k, v each (B, nh, T, hs) contiguous in
    out_dtype, as scaled_dot_product_attention reads them: the same values as norming q and k with their
    RMSNorms, apply_rope and the transposes, with a hand-written backward that writes qkv's gradient in one
    buffer. On a CPU these passes over small tensors are bound by memory, and autograd's graph for them (the
    norms' composite ops, a stack, torch.roll's concatenations, the slices' zero-filled gradients) made a
    4 x 128 model's update ~1.3x slower. q and k are normed and rotated in fp32, laid out (2, B, nh, T, hs) from
    the first copy on; the gains fold into RoPE's tables, n * (g cos) + roll(n) * (roll(g) sin) with
    n = x / rms(x), as the gain, the rotation and the roll all act per dimension."""

    @staticmethod
    def forward(ctx, qkv, q_gain, k_gain, cos, sin, eps: float, out_dtype: torch.dtype):
        T, hs = qkv.size(1), qkv.size(-1)
        dtype = torch.promote_types(qkv.dtype, torch.float32)
        x = qkv[:, :, :2].permute(2, 0, 3, 1, 4).to(dtype, memory_format=torch.contiguous_format, copy=True)
        inv_rms = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(hs).add_(eps).rsqrt_()
        n = x.mul_(inv_rms)  # (2, B, nh, T, hs): x is a copy, normalised in place
        g = torch.stack([q_gain, k_gain]).to(dtype).view(2, 1, 1, 1, hs)
        cos, sin = cos.to(dtype).view(T, hs), sin.to(dtype).view(T, hs)
        out = rotate_half_into(torch.empty_like(n), n, g * cos, g.roll(hs // 2, dims=-1) * sin)
        if out_dtype != dtype:
            out = out.to(out_dtype)
        v = qkv.select(2, 2).transpose(1, 2).to(out_dtype, memory_format=torch.contiguous_format)
        ctx.save_for_backward(n, inv_rms, g, cos, sin)
        ctx.qkv_dtype, ctx.gain_dtype = qkv.dtype, q_gain.dtype
        return out[0], out[1], v

    @staticmethod
    @once_differentiable
    def backward(ctx, dq, dk, dv):
        n, inv_rms, g, cos, sin = ctx.saved_tensors
        B, nh, T, hs = dq.shape
        d_qkv = torch.empty(B, T, 3, nh, hs, dtype=ctx.qkv_dtype, device=dq.device)
        d_gains = []
        for i, d_out in enumerate((dq, dk)):  # q, then k: no stack of the two
            d_out = d_out.to(n.dtype)
            # RoPE's transpose: the swap of halves is its own inverse, so d(n g) = d_out cos + roll(d_out sin)
            d_y = rotate_half_into(torch.empty_like(d_out), d_out, cos, sin.roll(hs // 2, dims=-1))
            d_gains.append((d_y * n[i]).sum(dim=(0, 1, 2)).to(ctx.gain_dtype))
            d_n = d_y.mul_(g[i])
            # RMSNorm's backward without the gain: (d_n - n * mean(d_n * n)) / rms
            d_x = torch.addcmul(d_n, n[i], (d_n * n[i]).mean(dim=-1, keepdim=True), value=-1.0).mul_(inv_rms[i])
            d_qkv[:, :, i] = d_x.transpose(1, 2)
        d_qkv[:, :, 2] = dv.transpose(1, 2)
        return d_qkv, d_gains[0], d_gains[1], None, None, None, None


# --- the cache a forward can fill ---------------------------------------------------------------


class Cache(Protocol):
    """What forward reads and writes when given a cache (engine.CacheView): the position of the first new
    token, the dtype it holds, and update, which stores a layer's new keys and values and returns all held."""

    pos: int
    dtype: torch.dtype

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


# --- blocks -------------------------------------------------------------------------------------------


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
    """The MLP's nonlinearity on its hidden layer (B, T, H), or on the fused gate and up halves (B, T, 2H)."""
    if mlp == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
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
        return nn.RMSNorm(config.n_embd, eps=config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.head_size = config.n_head, config.head_size
        self.rope = config.pos_encoding == "rope"
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # fused q, k, v
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        if config.qk_norm:  # QK-norm (Dehghani et al. 2023; OLMo 2, Qwen3): bounded attention logits
            self.q_norm = nn.RMSNorm(config.head_size, eps=config.norm_eps)
            self.k_norm = nn.RMSNorm(config.head_size, eps=config.norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos=None, sin=None, cache: Cache | None = None, layer: int = 0):
        B, T, C = x.size()
        qkv = self.c_attn(x).view(B, T, 3, self.n_head, self.head_size)  # (B, T, 3, nh, hs)
        cpu_autocast = x.device.type == "cpu" and torch.is_autocast_enabled("cpu")
        if cache is None and self.rope and self.q_norm is not None:  # training's path: one Function for all three
            out_dtype = torch.float32 if cpu_autocast else qkv.dtype  # fp32 for the CPU's attention below
            q, k, v = NormRopeQKV.apply(
                qkv, self.q_norm.weight, self.k_norm.weight, cos, sin, self.q_norm.eps, out_dtype
            )  # (B, nh, T, hs) each
        else:
            qk = qkv[:, :, :2]  # (B, T, 2, nh, hs)
            if self.q_norm is not None:  # per head, before RoPE
                qk = torch.stack([self.q_norm(qkv[:, :, 0]), self.k_norm(qkv[:, :, 1])], dim=2)
            if self.rope:
                # rotate q and k together: one set of elementwise ops instead of two
                qk = apply_rope(qk, cos, sin)  # (B, T, 2, nh, hs); cos, sin: (T, 1, 1, hs)
            q, k = qk.unbind(dim=2)
            v = qkv[:, :, 2]
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh, T, hs)
        if cache is None:
            dropout_p = self.dropout if self.training else 0.0
            if cpu_autocast:
                # the CPU flash-attention kernel's bf16 backward is much slower than its fp32 one, and autocast
                # would cast fp32 inputs back down: run it in fp32 outside autocast
                with torch.autocast("cpu", enabled=False):
                    y = F.scaled_dot_product_attention(
                        q.float(), k.float(), v.float(), is_causal=True, dropout_p=dropout_p
                    )
            else:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
        else:
            if k.dtype != cache.dtype:  # under autocast the cache holds the autocast dtype
                k, v = k.to(cache.dtype), v.to(cache.dtype)
            k, v = cache.update(layer, k, v)  # (B, nh, S, hs)
            if q.dtype != k.dtype:
                k, v = k.to(q.dtype), v.to(q.dtype)
            if T == 1:  # one new token attends to everything held: no mask needed
                y = F.scaled_dot_product_attention(q, k, v)
            else:  # new tokens at the end of S: token i sees the cache and new tokens up to i
                S = k.size(2)
                mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(diagonal=S - T)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return dropout(self.c_proj(y), self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.kind = config.mlp
        H = config.hidden_size
        # SwiGLU (Shazeer 2020) fuses its gate and up projections into one matrix: (C, 2H)
        self.c_fc = nn.Linear(config.n_embd, 2 * H if self.kind == "swiglu" else H, bias=config.bias)
        self.c_proj = nn.Linear(H, config.n_embd, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, x):
        h = activation(self.c_fc(x), self.kind)  # (B, T, H)
        return dropout(self.c_proj(h), self.dropout, self.training)


class Block(nn.Module):
    """Pre-LN residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x, cos=None, sin=None, cache=None, layer=0):
        x = x + self.attn(self.ln_1(x), cos, sin, cache, layer)
        return x + self.mlp(self.ln_2(x))


# --- the model ------------------------------------------------------------------------------------------


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=make_norm(config),
            )
        )
        if config.pos_encoding == "learned":
            self.transformer["wpe"] = nn.Embedding(config.block_size, config.n_embd)
        elif config.pos_encoding == "sinusoidal":
            self.register_buffer("pos_table", sinusoidal_table(config.block_size, config.n_embd), persistent=False)
        else:
            cos, sin = rope_tables(torch.arange(config.block_size), config.head_size, config.rope_theta)
            # shaped to broadcast over (B, T, 2, nh, hs) as they are: no reshapes per call
            self.register_buffer("rope_cos", cos[:, None, None, :], persistent=False)  # (block_size, 1, 1, hs)
            self.register_buffer("rope_sin", sin[:, None, None, :], persistent=False)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        # GPT-2: scale the init of each residual branch's output by 1/sqrt(2 * n_layer), as the
        # residual stream sums 2 * n_layer of them; --zero-init-proj starts them at zero instead, so every
        # block begins as the identity (modded-nanogpt, nanochat)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                if config.zero_init_proj:
                    nn.init.zeros_(p)
                else:
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    # --- forward ---

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: Cache | None = None,
        last_only: bool = False,
    ):
        """Logits (B, T, V) for every position (or (B, 1, V) with last_only) and the mean cross-entropy
        over targets (B, T) when given (ignore_index -1). With a cache, idx holds the new tokens only."""
        x = self.hidden_states(idx, cache)
        if last_only:
            x = x[:, -1:]  # (B, 1, C): generation needs only the next token's logits
        logits = softcap(self.lm_head(x), self.config.logit_softcap)  # (B, T, V)
        loss = None
        if targets is not None:
            # the mean over the targets that count; a batch with none (a chat window of prompt only) gives 0, not
            # 0/0 = NaN, and no gradient
            flat = targets.reshape(-1)
            total = F.cross_entropy(logits.float().view(-1, logits.size(-1)), flat, ignore_index=-1, reduction="sum")
            loss = total / (flat != -1).sum().clamp(min=1)
        return logits, loss

    def hidden_states(self, idx: torch.Tensor, cache: Cache | None = None) -> torch.Tensor:
        """The last block's output after the final norm (B, T, C): what lm_head turns into logits. A caller that
        needs some positions' logits only (a prefill needs the last one) applies the head to those."""
        B, T = idx.size()
        pos = cache.pos if cache is not None else 0
        assert pos + T <= self.config.block_size, f"{pos + T} tokens exceed the context of {self.config.block_size}"
        x = self.transformer.wte(idx)  # (B, T, C)
        cos = sin = None
        if self.config.pos_encoding == "learned":
            x = x + self.transformer.wpe(torch.arange(pos, pos + T, device=idx.device))
        elif self.config.pos_encoding == "sinusoidal":
            x = x + self.pos_table[pos : pos + T]
        else:
            cos, sin = self.rope_cos[pos : pos + T], self.rope_sin[pos : pos + T]
        x = dropout(x, self.config.dropout, self.training)
        for i, block in enumerate(self.transformer.h):
            x = block(x, cos, sin, cache, i)
        if cache is not None:
            cache.pos += T
        return self.transformer.ln_f(x)

    # --- accounting ---

    def cast(self, dtype: torch.dtype) -> GPT:
        """The weights in `dtype` for inference; the RoPE tables stay fp32 as in training (apply_rope meets
        q and k in their dtype)."""
        self.to(dtype)
        if self.config.pos_encoding == "rope":
            self.rope_cos, self.rope_sin = self.rope_cos.float(), self.rope_sin.float()
        return self

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters, each shared tensor once; non_embedding leaves out the token and position tables."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wte.weight.numel()
            if "wpe" in self.transformer:
                n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward = 3 x forward), PaLM-style: 6 per matmul weight
        (the LM head included, embeddings lookups excluded) plus 12 * n_layer * C * T for attention scores."""
        cfg = self.config
        T = seq_len or cfg.block_size
        matmul = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        return 6 * matmul + 12 * cfg.n_layer * cfg.n_embd * T
