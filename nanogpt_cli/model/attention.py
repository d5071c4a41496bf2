"""Causal self-attention, written once: the q, k, v projection, QK-norm, RoPE, the causal mask over a cache, and
the kernels that compute it. Training, the engine's prefill and decode step and `inspect`'s attention maps all
run `attention`; only the kernel differs, chosen inside it:

- no cache (training, evaluation): scaled_dot_product_attention with is_causal, after NormRopeQKV when the model
  has QK-norm and RoPE (one autograd Function for the norms, the rotation and the layout);
- a cache (prefill, decode): the same kernel over the held keys with the causal mask, none when every held key
  is visible (one new token per row, every row at one position);
- probabilities asked for (Context.probs): an explicit softmax over the scores, which keeps them.

    y = attention(block.attn.ops(), x, ctx, layer)   # x (N, C) normed, N = B * T; y (N, nh * hs), before c_proj

Shape legend as in gpt.py: B rows, T new tokens, S keys held (T without a cache), nh heads, nkv key/value heads
(nh with one per query head), hs head size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from nanogpt_cli.config import GPTConfig

Op = Callable[[torch.Tensor], torch.Tensor]


# --- RoPE -----------------------------------------------------------------------------------------------


def rope_inv_freq(head_size: int, theta: float, scaling: GPTConfig | None = None) -> torch.Tensor:
    """RoPE's frequencies (Su et al. 2021), theta^(-2i/hs) for pair i, in float64, stretched by the scaling that
    `scaling`'s rope_* fields choose (none when not given). (hs/2,)"""
    inv_freq = theta ** (-torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)
    kind = "none" if scaling is None else scaling.rope_scaling
    if kind == "none":
        return inv_freq
    factor, context = scaling.rope_factor, scaling.rope_context
    if kind == "linear":  # position interpolation: position p is computed as p / factor
        return inv_freq / factor
    if kind == "llama3":
        # Llama 3.1: wavelengths longer than context / low_freq_factor are interpolated (divided by factor), those
        # shorter than context / high_freq_factor kept, and a linear ramp in context / wavelength between
        low, high = scaling.rope_low_freq_factor, scaling.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = ((context / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        return (1 - smooth) * inv_freq / factor + smooth * inv_freq

    # YaRN ("NTK-by-parts"): a dimension that turns fewer than beta_slow times over the original context is
    # interpolated, one that turns more than beta_fast times kept, a linear ramp over the dimensions between
    def dim_at(rotations: float) -> float:  # the dimension index d (of hs) whose pair turns `rotations` times
        return head_size * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo = max(math.floor(dim_at(scaling.rope_beta_fast)), 0)
    hi = min(math.ceil(dim_at(scaling.rope_beta_slow)), head_size - 1)
    ramp = ((torch.arange(head_size // 2, dtype=torch.float64) - lo) / max(hi - lo, 1e-3)).clamp(0.0, 1.0)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def yarn_attention_factor(factor: float) -> float:
    """YaRN's temperature for a context stretched `factor` times: q and k (through cos and sin) scaled by
    0.1 ln(s) + 1, so that attention's logits keep their sharpness over the longer context."""
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope_tables(
    positions: torch.Tensor, head_size: int, theta: float, scaling: GPTConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin for RoPE at the given positions, in Llama's half-split layout, where x[i] and
    x[i + hs/2] form a rotating pair. The sin table's first half is negated, so that apply_rope needs one roll
    instead of a split, a negation and a concatenation. scaling: the config whose RoPE scaling applies (YaRN's
    temperature rides in the tables). (T, hs) each"""
    inv_freq = rope_inv_freq(head_size, theta, scaling).to(positions.device)
    angles = positions.to(torch.float64)[:, None] * inv_freq  # (T, hs/2)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)  # (T, hs): the two halves of a head share frequencies
    sin = torch.cat([-angles.sin(), angles.sin()], dim=-1)
    mscale = yarn_attention_factor(scaling.rope_factor) if scaling is not None and scaling.rope_scaling == "yarn" else 1
    if mscale != 1:
        cos, sin = cos * mscale, sin * mscale
    return cos.float(), sin.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x[i], x[i + hs/2]) by their position's angle:
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). x: (..., hs); cos, sin from rope_tables, broadcast to x.
    Tables narrower than x (partial rotary, rd < hs) rotate the first rd dimensions, in pairs (x[i], x[i + rd/2]),
    and leave the rest as they are (GPT-NeoX's rotary_pct)."""
    rd = cos.size(-1)
    if rd != x.size(-1):
        return torch.cat([apply_rope(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)
    half = rd // 2
    # the fp32 tables meet x in x's dtype: under bf16 autocast q and k stay bf16 (fp32 tables would upcast
    # them, and attention would cast them back, two extra passes over q and k)
    if cos.dtype != x.dtype:  # a .to that does nothing still costs a call
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
    n = x / rms(x), as the gain, the rotation and the roll all act per dimension. Tables narrower than the head
    (partial rotary, rd < hs) rotate its first rd dimensions; the rest are only normed."""

    @staticmethod
    def forward(ctx, qkv, q_gain, k_gain, cos, sin, eps: float, out_dtype: torch.dtype):
        T, hs = qkv.size(1), qkv.size(-1)
        dtype = torch.promote_types(qkv.dtype, torch.float32)
        x = qkv[:, :, :2].permute(2, 0, 3, 1, 4).to(dtype, memory_format=torch.contiguous_format, copy=True)
        inv_rms = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(hs).add_(eps).rsqrt_()
        n = x.mul_(inv_rms)  # (2, B, nh, T, hs): x is a copy, normalised in place
        g = torch.stack([q_gain, k_gain]).to(dtype).view(2, 1, 1, 1, hs)
        rd = cos.size(-1)
        cos, sin = cos.to(dtype).view(T, rd), sin.to(dtype).view(T, rd)
        out, g_rot = torch.empty_like(n), g[..., :rd]
        rotate_half_into(out[..., :rd], n[..., :rd], g_rot * cos, g_rot.roll(rd // 2, dims=-1) * sin)
        if rd < hs:  # the dimensions RoPE leaves: normed and scaled only
            torch.mul(n[..., rd:], g[..., rd:], out=out[..., rd:])
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
        rd = cos.size(-1)
        sin_t = sin.roll(rd // 2, dims=-1)
        d_qkv = torch.empty(B, T, 3, nh, hs, dtype=ctx.qkv_dtype, device=dq.device)
        d_gains = []
        for i, d_out in enumerate((dq, dk)):  # q, then k: no stack of the two
            d_out = d_out.to(n.dtype)
            # RoPE's transpose: the swap of halves is its own inverse, so d(n g) = d_out cos + roll(d_out sin)
            d_y = torch.empty_like(d_out)
            rotate_half_into(d_y[..., :rd], d_out[..., :rd], cos, sin_t)
            if rd < hs:
                d_y[..., rd:] = d_out[..., rd:]
            d_gains.append((d_y * n[i]).sum(dim=(0, 1, 2)).to(ctx.gain_dtype))
            d_n = d_y.mul_(g[i])
            # RMSNorm's backward without the gain: (d_n - n * mean(d_n * n)) / rms
            d_x = torch.addcmul(d_n, n[i], (d_n * n[i]).mean(dim=-1, keepdim=True), value=-1.0).mul_(inv_rms[i])
            d_qkv[:, :, i] = d_x.transpose(1, 2)
        d_qkv[:, :, 2] = dv.transpose(1, 2)
        return d_qkv, d_gains[0], d_gains[1], None, None, None, None


# --- what one forward shares ------------------------------------------------------------------------------


class Cache(Protocol):
    """What attention reads and writes through a cache (engine.CacheView): where each row's new tokens start
    (one position for every row, or a list with one per row), and update, which stores a layer's new keys and
    values (in the cache's dtype) and returns every key and value held, the new ones included. It advances its
    rows' positions by T on the last layer's update."""

    pos: int | list[int]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def window_keys(self, T: int, device: torch.device) -> torch.Tensor | None:
        """The positions of the keys that a sliding-window layer's update returns for T new tokens, in order: (S,),
        or (B, S) a row each; -1 marks a slot that holds no key yet; None when every key returned is visible. A
        cache may keep only a local layer's window."""
        ...


def causal_mask(query_pos: torch.Tensor, S: int) -> torch.Tensor:
    """Which of S held keys each new token sees, the tokens at query_pos ((T,), or (B, T) a row each): key j is
    visible to a token at position p when j <= p. (T, S), or (B, 1, T, S) to broadcast over the heads; bool"""
    visible = torch.arange(S, device=query_pos.device) <= query_pos.unsqueeze(-1)
    return visible if query_pos.dim() == 1 else visible.unsqueeze(1)


def window_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Which keys a sliding-window layer's token sees (Mistral, Gemma): the key at position j is visible to the
    token at p when p - window < j <= p; key_pos -1 is an empty slot. query_pos (T,) or (B, T), key_pos (S,) or
    (B, S); (T, S), or (B, 1, T, S) when either has rows; bool"""
    q, k = query_pos.unsqueeze(-1), key_pos.unsqueeze(-2)  # (.., T, 1), (.., 1, S)
    visible = (k >= 0) & (k <= q) & (k > q - window)
    return visible if visible.dim() == 2 else visible.unsqueeze(1)


@dataclass(slots=True)
class Context:
    """What every block of one forward shares (GPT.hidden_states builds it): the call's shape, the RoPE angles at
    its positions, the cache and the mask over it, and where to keep the attention probabilities."""

    B: int
    T: int
    cos: torch.Tensor | None = None  # RoPE at the new tokens' positions, (T, 1, 1, rd) or (B, T, 1, 1, rd)
    sin: torch.Tensor | None = None
    cache: Cache | None = None
    mask: torch.Tensor | None = None  # causal_mask over the cache; None when every held key is visible
    # sliding-window layers': their RoPE tables (a base of their own) and window_mask over what they see
    local_cos: torch.Tensor | None = None
    local_sin: torch.Tensor | None = None
    local_mask: torch.Tensor | None = None
    probs: list[torch.Tensor] | None = None  # when a list, each layer's probabilities (B, nh, T, S) go in it


# --- attention --------------------------------------------------------------------------------------------


class AttentionOps(NamedTuple):
    """One layer's attention as `attention` calls it: the modules themselves (CausalSelfAttention.ops) or faster
    forms of the same operations (inference/backends/decode.py)."""

    c_attn: Op  # (N, C) -> (N, (nh + 2 nkv) hs): the queries of every head, then the keys and values
    q_norm: Op | None  # QK-norm over each head's hs dimensions; None without it
    k_norm: Op | None
    n_head: int
    head_size: int
    dropout: float  # on the attention weights; 0 outside training
    n_kv_head: int  # key/value heads, each shared by n_head / n_kv_head query heads in a row
    local: bool = False  # a sliding-window layer: Context's local tables and mask


def attention(w: AttentionOps, x: torch.Tensor, ctx: Context, layer: int) -> torch.Tensor:
    """Causal self-attention of the normed residual stream x (N, C), N = B * T rows, through ctx's cache when it
    has one: the heads' outputs side by side, (N, nh * hs), for the output projection."""
    B, T, nh, hs = ctx.B, ctx.T, w.n_head, w.head_size
    if w.local:
        cos, sin, mask = ctx.local_cos, ctx.local_sin, ctx.local_mask
    else:
        cos, sin, mask = ctx.cos, ctx.sin, ctx.mask
    if w.n_kv_head == nh:
        qkv = w.c_attn(x).view(B, T, 3, nh, hs)  # (B, T, 3, nh, hs)
        q, k, v = queries_keys_values(w, qkv, ctx, cos, sin)  # (B, nh, T, hs) each
    else:
        q, k, v = grouped_queries_keys_values(w, w.c_attn(x).view(B, T, -1, hs), cos, sin)
    cache = ctx.cache
    if cache is not None:
        k, v = cache.update(layer, k, v)  # (B, nkv, S, hs): everything held, in the cache's dtype
        if q.dtype != k.dtype:
            q = q.to(k.dtype)
    gqa = w.n_kv_head != nh  # each key/value head serves a group of query heads: the kernels take enable_gqa
    if ctx.probs is not None:
        y = explicit_attention(q, k, v, ctx, mask)
    elif cache is None:
        y = causal_attention(q, k, v, w.dropout, mask, gqa)
    elif T == 1 and q.device.type == "cpu":  # a decode step: one new token per row
        y = decode_attention(q, k, v, mask)
    else:  # new tokens at the end of what each row holds: the mask shows each its past and itself
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    if T == 1:  # (B, nh, 1, hs) is (B, 1, nh, hs) already: a decode step's one-row form skips the transpose
        return y.view(B, nh * hs)
    return y.transpose(1, 2).reshape(B * T, nh * hs)  # (N, nh * hs)


def queries_keys_values(w: AttentionOps, qkv: torch.Tensor, ctx: Context, cos, sin):
    """q, k, v (B, nh, T, hs) from the fused projection (B, T, 3, nh, hs): QK-norm per head, then RoPE on q and
    k with the layer's tables cos, sin (None: no RoPE). narrow and select rather than qkv[:, :, :2]: Python's
    tuple indexing costs a few microseconds a call, which a decode step makes a few hundred of."""
    if ctx.cache is None and cos is not None and isinstance(w.q_norm, nn.RMSNorm):
        # training's kernel: the norms, the rotation and the layout in one Function (it reads the norms' gains)
        cpu_autocast = qkv.device.type == "cpu" and torch.is_autocast_enabled("cpu")
        out_dtype = torch.float32 if cpu_autocast else qkv.dtype  # fp32 for the CPU's attention (causal_attention)
        q_gain, k_gain = norm_gain(w.q_norm), norm_gain(w.k_norm)
        return NormRopeQKV.apply(qkv, q_gain, k_gain, cos, sin, w.q_norm.eps, out_dtype)
    qk = qkv.narrow(2, 0, 2)  # (B, T, 2, nh, hs)
    if w.q_norm is not None:  # per head, before RoPE
        qk = torch.stack([w.q_norm(qkv.select(2, 0)), w.k_norm(qkv.select(2, 1))], dim=2)
    if cos is not None:
        # rotate q and k together: one set of elementwise ops instead of two
        qk = apply_rope(qk, cos, sin)  # cos, sin (T, 1, 1, rd) or (B, T, 1, 1, rd) broadcast
    q, k = qk.permute(2, 0, 3, 1, 4).unbind(0)  # (B, nh, T, hs) each: two calls for both
    return q, k, qkv.select(2, 2).transpose(1, 2)


def grouped_queries_keys_values(w: AttentionOps, qkv: torch.Tensor, cos, sin):
    """q (B, nh, T, hs), k and v (B, nkv, T, hs) from the fused projection (B, T, nh + 2 nkv, hs): QK-norm per head,
    then RoPE on q and k with the layer's tables, as queries_keys_values does for nh = nkv. The fused training
    kernel (NormRopeQKV) assumes three equal parts; here q and k take the general path (benchmarks/README.md,
    grouped-query attention)."""
    nh, nkv = w.n_head, w.n_kv_head
    if w.q_norm is None and cos is not None:  # q and k rotated together: one set of elementwise ops for both
        qk = apply_rope(qkv.narrow(2, 0, nh + nkv), cos.squeeze(-2), sin.squeeze(-2))  # (B, T, nh + nkv, hs)
        q, k = qk.split([nh, nkv], dim=2)
        return q.transpose(1, 2), k.transpose(1, 2), qkv.narrow(2, nh + nkv, nkv).transpose(1, 2)
    q, k, v = qkv.split([nh, nkv, nkv], dim=2)  # (B, T, heads, hs) each
    if w.q_norm is not None:
        q, k = w.q_norm(q), w.k_norm(k)
    if cos is not None:  # cos, sin (T, 1, 1, rd) or (B, T, 1, 1, rd): a head axis of 1 for (B, T, heads, hs)
        cos, sin = cos.squeeze(-2), sin.squeeze(-2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    mask: torch.Tensor | None = None,
    gqa: bool = False,
) -> torch.Tensor:
    """Attention of T tokens over themselves, each seeing itself and those before it (mask None), or the keys
    mask shows it (a sliding window's); gqa: k and v have fewer heads, each serving a group of q's.
    (B, nh, T, hs)"""
    causal = mask is None
    if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        # the CPU flash-attention kernel's bf16 backward is much slower than its fp32 one, and autocast would cast
        # fp32 inputs back down: run it in fp32 outside autocast
        with torch.autocast("cpu", enabled=False):
            q, k, v = q.float(), k.float(), v.float()
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout_p, enable_gqa=gqa
            )
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout_p, enable_gqa=gqa
    )


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """One new token per row over the cache on a CPU, q (B, nh, 1, hs), k and v (B, nkv, S, hs), mask None or
    (B, 1, 1, S). The CPU's attention kernel handles one query per head poorly: with grouped-query attention the
    query heads of each key/value group go in as that many queries over the group's keys, one call without
    enable_gqa and the same values (the mask broadcasts over them), 1.5-6x faster in bf16 (9 heads over 3, batch
    8: 0.32 against 2.2 ms at 256 keys); without groups, a bf16 or f16 cache is attended in fp32, 2-4x faster from
    256 keys on than the kernel's own bf16 path. (B, nh, 1, hs)"""
    B, nh, _, hs = q.shape
    nkv = k.size(1)
    if nkv != nh:
        y = F.scaled_dot_product_attention(q.reshape(B, nkv, nh // nkv, hs), k, v, attn_mask=mask)
        return y.view(B, nh, 1, hs)
    if q.dtype in (torch.bfloat16, torch.float16):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def explicit_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: Context, mask: torch.Tensor | None
) -> torch.Tensor:
    """softmax(q k^T / sqrt(hs) + mask) v, computed step by step so that the probabilities can be kept
    (scaled_dot_product_attention never materialises them): they go into ctx.probs, (B, nh, T, S) float32.
    mask: the layer's (None: causal without a cache, every key visible with one). No dropout: the probabilities
    are the model's own. (B, nh, T, hs)"""
    T, S = q.size(2), k.size(2)
    if k.size(1) != q.size(1):  # grouped-query attention: each key/value head serves its group of query heads
        groups = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, nh, S, hs)
    if mask is None and ctx.cache is None:
        mask = causal_mask(torch.arange(T, device=q.device), S)
    # scores in float32 whatever the weights' dtype, so that the probabilities sum to 1 to float precision
    scores = q.float() @ k.float().transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, nh, T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))  # exact zeros in the probabilities where masked
    probs = scores.softmax(dim=-1)
    ctx.probs.append(probs)
    return probs.to(v.dtype) @ v


class OffsetRMSNorm(nn.RMSNorm):
    """RMSNorm with the gain 1 + w, w starting at 0 (Gemma): x / rms(x) * (1 + w)."""

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, 1.0 + self.weight, self.eps)


def rms_norm(size: int, config: GPTConfig) -> nn.RMSNorm:
    """An RMSNorm over the last `size` dimensions, with the gain 1 + w under --norm-offset."""
    return (OffsetRMSNorm if config.norm_offset else nn.RMSNorm)(size, eps=config.norm_eps)


def norm_gain(norm: nn.RMSNorm) -> torch.Tensor:
    """The gain an RMSNorm multiplies by: its weight, or 1 + weight (OffsetRMSNorm)."""
    return 1.0 + norm.weight if isinstance(norm, OffsetRMSNorm) else norm.weight


class CausalSelfAttention(nn.Module):
    """The attention's weights: the fused q, k, v projection, the output projection and the QK-norm gains. The
    computation is `attention` (the output projection is the block's, with its residual)."""

    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_size = config.n_head, config.kv_heads, config.head_size
        self.local = config.is_local(layer)  # a sliding-window layer
        self.dropout = config.dropout
        width = (self.n_head + 2 * self.n_kv_head) * self.head_size  # fused q, k, v: nh query heads, nkv k and v
        self.c_attn = nn.Linear(config.n_embd, width, bias=config.attn_bias)
        self.c_proj = nn.Linear(self.n_head * self.head_size, config.n_embd, bias=config.bias)
        if config.qk_norm:  # QK-norm (Dehghani et al. 2023; OLMo 2, Qwen3): bounded attention logits
            # one gain per head dimension, shared by the heads, as Qwen3 and Gemma 3 have it
            self.q_norm = rms_norm(config.head_size, config)
            self.k_norm = rms_norm(config.head_size, config)
        else:
            self.q_norm = self.k_norm = None

    def ops(self) -> AttentionOps:
        """The modules as `attention` calls them (looked up on each call: LoRA replaces c_attn in place)."""
        dropout = self.dropout if self.training else 0.0
        heads = (self.n_head, self.head_size, dropout, self.n_kv_head, self.local)
        return AttentionOps(self.c_attn, self.q_norm, self.k_norm, *heads)
