"""The model's operations in the form that decodes a few rows fastest: the same blocks (block_forward, attention),
each primitive a cheaper call than its module's. Decoding a small model on a CPU is bound by per-call overhead: a
token makes ~100 module calls and attribute lookups of about a microsecond or more each, and for one to a few
rows MKL multiplies x @ W (W stored (in, out)) ~2x faster than F.linear's x @ W.T. bf16 and quantized weights on
an x86 CPU go to our own kernels (native.py) in their tiled layout; without those, bf16 goes to oneDNN in
its own packed layout (packed_form), 1.4-2x faster than torch's bf16 matmuls at real sizes.

    ops = decode_ops(model)                                 # copies the small or bf16 matrices (form_cache.py)
    h = model.hidden_states(idx, cache, ops=ops)            # (B, T, C), in inference mode
    step = fused_step(model)                                # the blocks' whole step in one call, or None
                                                            # (for a config cpu.FUSED takes)

Only for inference (no dropout, no gradients). A QuantizedLinear is its kernel bound once (decode_op); any other
projection that is not a plain nn.Linear (a LoRA layer not merged) is called as the module it is.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F

from nanogpt_cli.inference.backends import native
from nanogpt_cli.inference.backends.quantize import PREFILL_ROWS, QuantizedLinear
from nanogpt_cli.model.attention import AttentionOps, OffsetRMSNorm, Op, norm_gain
from nanogpt_cli.model.blocks import Block, BlockOps, Residual, activation, block_forward, post_normed
from nanogpt_cli.model.gpt import GPT, ModelOps


def decode_ops(model: GPT, packs: dict | None = None) -> ModelOps:
    """The model's operations in their decoding form, for GPT.hidden_states. Tensors are shared, not copied,
    except the transposed matrices (matmul_form) and packed forms; packs: the bf16 weights packed for our kernels
    so far, by module, shared with fused_step (each packed once)."""
    ops = model.ops()  # the tables, looked up here once rather than on every token
    packs = {} if packs is None else packs
    blocks = [partial(block_forward, block_ops(b, packs)) for b in ops.blocks]
    ops = ops._replace(blocks=blocks, ln_f=norm_function(ops.ln_f))
    dtype = ops.wte.dtype
    if ops.cos is not None and ops.cos.dtype != dtype and dtype in (torch.bfloat16, torch.float16):
        # RoPE's fp32 tables in the activations' dtype once, not per layer and token: apply_rope casts them to
        # q's and k's dtype anyway, so the values are the same
        tables = [t.to(dtype) for t in (ops.cos, ops.sin)]
        same = ops.local_cos is ops.cos
        local = tables if same else [t.to(dtype) for t in (ops.local_cos, ops.local_sin)]
        ops = ops._replace(cos=tables[0], sin=tables[1], local_cos=local[0], local_sin=local[1])
    return ops


def block_ops(b: Block, packs: dict) -> BlockOps:
    a = b.attn
    q_norm, k_norm = norm_function(a.q_norm), norm_function(a.k_norm)
    attn = AttentionOps(linear_op(a.c_attn, packs), q_norm, k_norm, a.n_head, a.head_size, 0, a.n_kv_head, a.local)
    if b.post_ln_1 is None:
        attn_out, mlp_out = residual_op(a.c_proj, packs), residual_op(b.mlp.c_proj, packs)
    else:  # the post-norm sits between the projection and the add, which then cannot ride in addmm
        attn_out = post_normed_residual(linear_op(a.c_proj, packs), norm_function(b.post_ln_1))
        mlp_out = post_normed_residual(linear_op(b.mlp.c_proj, packs), norm_function(b.post_ln_2))
    return BlockOps(
        ln_1=norm_function(b.ln_1),
        attn=attn,
        attn_out=attn_out,
        ln_2=norm_function(b.ln_2),
        c_fc=linear_op(b.mlp.c_fc, packs),
        act=partial(activation, mlp=b.mlp.kind),
        mlp_out=mlp_out,
        parallel=b.parallel,
    )


def post_normed_residual(proj: Op, norm: Op) -> Residual:
    """(y, x) -> x + norm(proj(y))."""
    branch = post_normed(proj, norm)
    return lambda y, x: x + branch(y)


def norm_function(module: nn.Module | None) -> Op | None:
    """A norm module -> a one-argument function with its weights bound (None stays None)."""
    if module is None:
        return None
    shape, weight, eps = module.normalized_shape, module.weight, module.eps
    if isinstance(module, nn.RMSNorm):
        weight = norm_gain(module).detach()  # 1 + w under --norm-offset, added once here rather than per token
        if weight is not None and weight.dtype in (torch.float32, torch.bfloat16) and weight.device.type == "cpu":
            # x / sqrt(mean(x^2) + eps) from the row's norm in three calls, cheaper than F.rms_norm on one row of
            # a few hundred values on a CPU, and within 1e-6 of it in float32. bf16 rows take their norm and the
            # products in fp32 and round once, as F.rms_norm's fused kernel does (the same values), in 6 calls
            # where its composite for bf16 makes ~12
            scale = 1.0 / weight.numel()
            eps = torch.tensor(torch.finfo(torch.float32).eps if eps is None else eps)
            if weight.dtype == torch.bfloat16:
                gain = weight.float()

                def rms_norm_bf16(x: torch.Tensor) -> torch.Tensor:
                    n = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
                    return (x * torch.addcmul(eps, n, n, value=scale).rsqrt_()).mul_(gain).to(x.dtype)

                return rms_norm_bf16

            def rms_norm(x: torch.Tensor) -> torch.Tensor:
                n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
                return x * torch.addcmul(eps, n, n, value=scale).rsqrt_() * weight

            return rms_norm
        return lambda x: F.rms_norm(x, shape, weight, eps)
    bias = module.bias
    return lambda x: torch.layer_norm(x, shape, weight, bias, eps)


def matmul_form(w: torch.Tensor) -> torch.Tensor:
    """A weight (out, in) as the decoding form multiplies it, x @ w: (in, out). On a CPU a contiguous copy of the
    transpose for small matrices, where MKL's kernel for one to a few rows is ~2x faster than for x @ W.T (what
    F.linear computes): 4 against 8 us for 128 -> 384 at batch 1, the same at 768 -> 2304; the copies add the
    body's matrices once more, for small models only. Elsewhere the transposed view, F.linear's own product."""
    if w.device.type == "cpu" and w.numel() <= 1 << 20:
        return w.t().contiguous()
    return w.t()


def packed_form(w: torch.Tensor) -> torch.Tensor | None:
    """A bf16 weight (out, in) on a CPU in oneDNN's own blocked layout, or None where that does not apply. Torch's
    bf16 matmuls (F.linear, mm) reach oneDNN unpacked and reorder or fall back on every call: for one to eight rows
    against the 135M model's matrices the packed product is ~1.4-2x faster (576 -> 3072 at batch 1: 75 against
    153 us; the 49,152-row head: 3.2 against 9.6 ms), and its residual add rides in it (_linear_pointwise.binary),
    as addmm's does. The packed copy costs the matrix's bytes once more."""
    if w.dtype != torch.bfloat16 or w.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1)  # laid out for a batch of 1, the decode step's


def packed_linear(w: torch.Tensor, b: torch.Tensor | None) -> Op:
    """x (N, in) -> x @ W.T + b against a packed_form weight."""
    kernel = torch.ops.mkldnn._linear_pointwise.default  # the overload bound once: no lookup per call
    return lambda x: kernel(x, w, b, "none", [], "")


def native_linear(module: nn.Module, packs: dict | None = None) -> native.Packed | None:
    """Our kernel for the few rows of a decode step (native.py): a bf16 nn.Linear's weight packed in its
    tiled form (kept in packs, by module: a copy of the weight), or a QuantizedLinear's own; None where it does
    not run."""
    if type(module) is QuantizedLinear:
        return module.kernel() if module.native else None
    if type(module) is not nn.Linear:
        return None
    packs = {} if packs is None else packs
    if module not in packs:
        packs[module] = native.pack(module.weight, module.bias)
    return packs[module]


def few_rows(kernel: native.Packed, module: nn.Module, res: bool = False) -> Op | Residual:
    """kernel for fewer than PREFILL_ROWS rows, the module itself for more (a large batch, where the library's
    matmuls are faster); res: the (y, x) -> x + module(y) form."""
    if res:
        return lambda y, x: kernel(y, x) if y.size(0) < PREFILL_ROWS else x + module(y)
    return lambda x: kernel(x) if x.size(0) < PREFILL_ROWS else module(x)


def linear_op(module: nn.Module, packs: dict | None = None) -> Op:
    """x (N, in) -> x @ W.T + b: a QuantizedLinear's bound kernel (decode_op: ours or torch's); a bf16 nn.Linear
    in our kernel (native_linear) where it runs; otherwise one mm or addmm against the matmul form or one oneDNN
    call (packed_form)."""
    if type(module) is QuantizedLinear:
        return module.decode_op()
    kernel = native_linear(module, packs)
    if kernel is not None:
        return few_rows(kernel, module)
    if type(module) is not nn.Linear:
        return module
    packed = packed_form(module.weight)
    if packed is not None:
        return packed_linear(packed, module.bias)
    w, b = matmul_form(module.weight), module.bias
    if b is None:
        return lambda x: torch.mm(x, w)
    return lambda x: torch.addmm(b, x, w)


def residual_op(module: nn.Module, packs: dict | None = None) -> Residual:
    """(y, x) -> x + y @ W.T + b, the residual add riding in our kernel (native_linear), or in addmm (or oneDNN's
    product) where there is no bias."""
    kernel = native_linear(module, packs)
    if kernel is not None:
        return few_rows(kernel, module, res=True)
    if type(module) is QuantizedLinear:
        op = module.decode_op()
        return lambda y, x: x + op(y)
    if type(module) is not nn.Linear:
        return lambda y, x: x + module(y)
    packed, b = packed_form(module.weight), module.bias
    if packed is not None:
        if b is None:
            kernel = torch.ops.mkldnn._linear_pointwise.binary
            return lambda y, x: kernel(y, x, packed, None, "add")
        proj = packed_linear(packed, b)
        return lambda y, x: x + proj(y)
    w = matmul_form(module.weight)
    if b is None:
        return lambda y, x: torch.addmm(x, y, w)
    return lambda y, x: x + torch.addmm(b, y, w)


# --- a whole decode step in one call --------------------------------------------------------------------------


class FusedStep:
    """The model's blocks as native.cpp's Block structs: one decode step of every block in one call (ng_decode),
    the norms, RoPE, the cache writes, attention and the activation included, for fewer than PREFILL_ROWS rows. A
    30-layer model's step makes ~600 torch calls of a few microseconds each otherwise, as much time as its int4
    weights take to read. Its values are those of the blocks' own forward up to rounding: the sub-blocks' inner
    values stay float32 where torch rounds each op's output to bf16."""

    def __init__(self, model: GPT, layers: list[native.Layer]):
        cfg = model.config
        self.model = model
        self.blocks = native.Blocks(
            cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.kv_heads, cfg.head_size, cfg.hidden_size, cfg.block_size
        )
        for i, layer in enumerate(layers):
            self.blocks.layer(i, layer)
        self.embed_scale = math.sqrt(cfg.n_embd) if cfg.embed_scale else None
        ops = model.ops()
        self.pos_table = ops.pos_table  # learned or sinusoidal positions, added to the embeddings; RoPE: None
        # this step's own profile clock (the benchmarks read it): seconds in the products, the attention, in all
        self.timers = torch.zeros(3, dtype=torch.float64)

    def __call__(self, idx: torch.Tensor, cache, B: int) -> torch.Tensor:
        """The last block's output (B, C) after one new token for each of the cache's first B rows, idx (B,); the
        cache holds the new keys and values and its rows advance by one."""
        pos = cache.pos[:B]
        if max(pos) >= cache.capacity:
            raise AssertionError(f"a row at position {max(pos)} overflows a cache of {cache.capacity}")
        x = self.run(idx.reshape(B), cache, torch.tensor(pos, dtype=torch.int64))
        cache.pos[:B] = [p + 1 for p in pos]
        return x

    def score(self, idx: torch.Tensor, cache, start: int, stop: int) -> torch.Tensor:
        """The last block's output (B * T, C) after T new tokens for each of the cache's rows start..stop-1 (idx
        (B, T)), in one call: a row's T tokens go in as T rows of the step that share its cache row, at positions
        pos, pos + 1, ..., each seeing the ones before it (ng_decode). The rows advance by T."""
        B, T = idx.size()
        pos = cache.pos[start:stop]
        if max(pos) + T > cache.capacity:
            raise AssertionError(f"a row at position {max(pos)} overflows a cache of {cache.capacity} by {T} tokens")
        at = (torch.tensor(pos, dtype=torch.int64).unsqueeze(1) + torch.arange(T)).view(-1)  # (B * T,)
        rows = torch.arange(start, stop, dtype=torch.int64).repeat_interleave(T)
        x = self.run(idx.reshape(B * T), cache, at, rows)
        cache.pos[start:stop] = [p + T for p in pos]
        return x

    def run(self, idx: torch.Tensor, cache, at: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """ng_decode of the tokens idx (N,) at positions at (N,) in cache rows `rows` (None: row n): (N, C)."""
        x = torch.embedding(self.model.transformer.wte.weight, idx)  # (N, C), a new tensor
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if self.pos_table is not None:
            x = x + self.pos_table[at]  # as hidden_states adds them, in the dtypes it does
        x = x.contiguous()
        caches = cache.__dict__.get("native_caches")
        if caches is None or caches.blocks is not self.blocks:  # the cache's tensors are its own for its lifetime
            caches = cache.native_caches = native.Caches(self.blocks, cache.k, cache.v)
        native.decode(self.blocks, caches, x, at, native.kernel_threads(), self.timers, rows)
        return x


def eps_of(norm: nn.Module) -> float:
    """A norm's epsilon as the decoding form's norms take it (norm_function): float32's for an RMSNorm with none."""
    return float(torch.finfo(torch.float32).eps if norm.eps is None else norm.eps)


def norm_weights(norm: nn.Module | None) -> native.NormWeights | None:
    """An RMSNorm or LayerNorm module with a gain as ng_decode reads it (None stays None)."""
    if norm is None:
        return None
    layer = isinstance(norm, nn.LayerNorm)
    gain = (norm.weight if layer else norm_gain(norm)).detach().float().contiguous()
    bias = None if getattr(norm, "bias", None) is None else norm.bias.detach().float().contiguous()
    return native.NormWeights(gain, bias, eps_of(norm), layer)


def rope_of(model: GPT, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A layer's RoPE tables (S, rd) float32: a local layer's own base where it has one; None without RoPE."""
    cfg = model.config
    if cfg.pos_encoding != "rope":
        return None, None
    local = cfg.rope_local_theta is not None and cfg.is_local(layer)
    cos, sin = (model.rope_local_cos, model.rope_local_sin) if local else (model.rope_cos, model.rope_sin)
    S, rd = cfg.block_size, cfg.rotary_size
    return cos.float().reshape(S, rd).contiguous(), sin.float().reshape(S, rd).contiguous()


def fused_step(model: GPT, packs: dict | None = None) -> FusedStep | None:
    """The model's decode step in one call, for a config the cpu backend's FUSED declaration takes (its caller
    checks that), where the model's own tensors fit native.cpp's block too: our kernels built here, not training,
    float32 or bf16 activations on a CPU, RMSNorm or LayerNorm modules with gains, and every projection one our
    kernels multiply (bf16, or int8 / int4 quantized). None where they do not."""
    w, cfg = model.transformer.wte.weight, model.config
    if not native.available() or model.training or w.dtype not in (torch.float32, torch.bfloat16):
        return None
    if w.device.type != "cpu":
        return None
    ring = cfg.sliding_window if cfg.sliding_window is not None and cfg.sliding_window < cfg.block_size else 0
    layers = []
    for i, block in enumerate(model.transformer.h):
        a = block.attn
        norms = [block.ln_1, block.ln_2, a.q_norm, a.k_norm, block.post_ln_1, block.post_ln_2]
        if any(n is not None and (type(n) not in NORMS or n.weight is None) for n in norms):
            return None
        kernels = [native_linear(m, packs) for m in (a.c_attn, a.c_proj, block.mlp.c_fc, block.mlp.c_proj)]
        if any(k is None for k in kernels):
            return None
        ln1, ln2, q_norm, k_norm, post1, post2 = map(norm_weights, norms)
        cos, sin = rope_of(model, i)
        window = ring if a.local else 0  # KVCache's ring for the layer (native.Caches checks the two agree)
        extra = dict(q_norm=q_norm, k_norm=k_norm, post1=post1, post2=post2, window=window)
        layers.append(native.Layer(*kernels, ln1, ln2, block.mlp.kind, block.parallel, cos, sin, **extra))
    return FusedStep(model, layers)


NORMS = (nn.RMSNorm, OffsetRMSNorm, nn.LayerNorm)  # the norm modules native.cpp computes, by exact type
