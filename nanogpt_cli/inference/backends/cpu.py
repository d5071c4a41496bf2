"""The cpu backend: the model's operations in their decoding form (decode.py: transposed and packed weight copies,
norms with their weights bound), our x86 kernels for bf16 and quantized projections (native.py), the whole step of
the blocks in one call where the kernels take them (decode.FusedStep, FUSED), and one fast form of the head.
Its forms are built once per model state and shared by every engine on it (form_cache.py).

    backend = CPU; plan = backend.prepare(model, vocab_size); logits = backend.step(plan, idx, cache, n)
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import NamedTuple

import torch
from torch.nn import functional as F

from nanogpt_cli.config import Takes, features
from nanogpt_cli.inference.backends import native
from nanogpt_cli.inference.backends.base import DecodeBackend, reason_for_device
from nanogpt_cli.inference.backends.decode import FusedStep, decode_ops, fused_step, packed_form
from nanogpt_cli.inference.backends.form_cache import cached_form
from nanogpt_cli.inference.backends.quantize import PREFILL_ROWS, QuantizedLinear, quantize_head
from nanogpt_cli.model import GPT, ModelOps, softcap

# The decoding form is the blocks' own forward (block_forward) with each primitive a cheaper call: it computes
# every config the model does, each field below looked at once (a new field is added here by hand, after checking
# that decode.block_ops binds what it changes)
FEATURES = features(
    "the cpu backend",
    (
        "vocab_size",
        "block_size",
        "n_layer",
        "n_head",
        "n_embd",
        "n_kv_head",
        "head_dim",
        "qkv_bias",
        "rope_scaling",
        "rope_factor",
        "rope_low_freq_factor",
        "rope_high_freq_factor",
        "rope_original_context",
        "rope_beta_fast",
        "rope_beta_slow",
        "dropout",
        "bias",
        "pos_encoding",
        "rope_theta",
        "norm",
        "norm_eps",
        "mlp",
        "mlp_hidden",
        "tie_embeddings",
        "qk_norm",
        "rotary_dim",
        "parallel_residual",
        "sliding_window",
        "window_pattern",
        "rope_local_theta",
        "embed_scale",
        "norm_offset",
        "post_norms",
        "logit_softcap",
        "zero_init_proj",
    ),  # fmt: skip
)

# What native.cpp's one-call step of whole blocks computes: every block the model builds (RMSNorm or LayerNorm with
# or without biases and 1 + w gains, every MLP activation, gated or not, the parallel residual, QK-norm, post-norms,
# RoPE on all or part of each head with a base per kind of layer, learned or sinusoidal positions, sliding windows
# on some layers or all), with heads our attention loop takes. The model's own tensors say the rest (fused_step):
# every projection one our kernels multiply, bf16 or float32 activations, a CPU. A new field is added here by hand,
# after checking that decode.fused_step and native.cpp's Block compute what it changes.
FUSED = features(
    "the cpu backend's fused step",
    (
        "vocab_size",
        "block_size",
        "n_layer",
        "n_head",
        "n_embd",
        "n_kv_head",
        "qkv_bias",
        "rope_scaling",
        "rope_factor",
        "rope_low_freq_factor",
        "rope_high_freq_factor",
        "rope_original_context",
        "rope_beta_fast",
        "rope_beta_slow",
        "dropout",
        "bias",
        "pos_encoding",
        "rope_theta",
        "norm",
        "norm_eps",
        "mlp",
        "mlp_hidden",
        "tie_embeddings",
        "qk_norm",
        "rotary_dim",
        "parallel_residual",
        "sliding_window",
        "window_pattern",
        "rope_local_theta",
        "embed_scale",
        "norm_offset",
        "post_norms",
        "logit_softcap",
        "zero_init_proj",
    ),  # fmt: skip
    head_dim=Takes(
        lambda v, c: c.head_size % 16 == 0 and c.head_size <= 512,
        "a head size that is a multiple of 16, up to 512",
        shows=lambda c: f"a head size of {c.head_size}",
    ),
)
FUSED_CACHE = (torch.float32, torch.bfloat16)  # the cache dtypes the fused step reads and writes
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CPUBackend(DecodeBackend):
    """Our kernels and the decoding form, on a CPU."""

    name = "cpu"
    features = FEATURES

    def supports(self, config, dtype: torch.dtype, device: torch.device, quantization: str | None) -> str | None:
        if device.type != "cpu":
            return reason_for_device(self.name, device)
        if dtype not in DTYPES:
            return f"the cpu backend decodes float32, bfloat16 and float16 weights, not {dtype}"
        return self.features.refusal(config)

    def prepare(self, model: GPT, vocab_size: int) -> DecodePlan:
        return decode_plan(model, vocab_size)

    def prefill(self, plan: DecodePlan, idx: torch.Tensor, cache) -> torch.Tensor:
        with native.torch_threads():  # torch's products, on every thread, also where a step restarts a row
            hs = plan.model.hidden_states(idx, cache=cache)  # (B, T, C): many rows, through the modules
        return softcap(head_logits(plan, hs[:, -1]), plan.logit_softcap)

    def step(self, plan: DecodePlan, idx: torch.Tensor, cache, n: int) -> torch.Tensor:
        return decode_step(plan, idx, cache, n)

    def score(self, plan: DecodePlan, idx: torch.Tensor, cache) -> torch.Tensor:
        # a few rows of a few tokens: the fused step, each row's tokens as rows that share its cache row, where it
        # runs the model (the same values as T steps, at about the cost of one step of T rows); else the decoding
        # form (not the modules a long prefill runs). The head's form for few rows on every position.
        B, T = idx.size()
        kv = cache.cache
        if plan.fused is not None and B * T < PREFILL_ROWS and kv.ring is None and kv.dtype in FUSED_CACHE:
            hs = plan.ops.ln_f(plan.fused.score(idx, kv, cache.start, cache.stop))  # (B * T, C)
        else:
            with native.torch_threads():
                hs = plan.model.hidden_states(idx, cache=cache, ops=plan.ops).view(B * T, -1)  # (B * T, C)
        return softcap(head_logits(plan, hs), plan.logit_softcap).view(B, T, -1)

    def decoding(self, plan: DecodePlan):
        # the fused step's calls run on our pool's threads, and torch's ops between them on one (native.torch_alone)
        return native.torch_alone() if plan.fused is not None else nullcontext()

    def describe(self, plan: DecodePlan) -> str:
        parts = ["fused step" if plan.fused is not None else "decoding form", f"kernels: {native.status()}"]
        return f"{self.name} ({', '.join(parts)})"


CPU = CPUBackend()


class DecodePlan(NamedTuple):
    """Everything decode_step reads, looked up once per model state (decode_plan)."""

    model: GPT
    ops: ModelOps  # the model's operations in their decoding form
    head: torch.Tensor  # (V, C), V cut to the vocabulary decode_plan was given
    head_t: torch.Tensor | None  # (C, V) contiguous on a CPU (head_logits)
    head_packed: torch.Tensor | None  # a bf16 head on a CPU in oneDNN's layout (decode.packed_form), else None
    head_q: QuantizedLinear | None  # the head in the blocks' int8 / int4 form, for a quantized model (head_logits)
    logit_softcap: float | None
    head_native: native.Packed | None = None  # a bf16 head in our kernel's tiled form (inference/backends/native.py)
    fused: FusedStep | None = None  # the whole step's blocks in one call, where they fit (decode.fused_step)


def decode_plan(model: GPT, vocab_size: int | None = None) -> DecodePlan:
    """What decode_step reads, built once per model and reused by every engine on it while its weights, modules
    and training mode are unchanged (backends/form_cache.py): its packed and transposed copies cost the weights' bytes
    once more and ~0.3 s per 100M bf16 parameters to build. vocab_size: logits for the first vocab_size tokens
    only (a padded head has rows no tokenizer token reaches). Tensors are shared, not copied, except those forms."""
    V = min(vocab_size or model.config.vocab_size, model.config.vocab_size)  # None and the full size: one plan
    return cached_form(model, lambda: build_plan(model, V), V)


def build_plan(model: GPT, vocab_size: int) -> DecodePlan:
    """A new DecodePlan for the model as it is now (decode_plan)."""
    cfg = model.config
    head = model.lm_head.weight[:vocab_size]
    cpu, kind = head.device.type == "cpu", getattr(model, "quantized", None)
    head_t = head_packed = head_q = head_native = None  # one form of the head is built: each copies a large matrix
    if kind is not None and cpu and (kind == "int4" or native.available()):
        # a quantized model's head read in the same bits as its blocks: the float head (tied to the embedding)
        # stays for the lookup and for PREFILL_ROWS rows or more. With our kernels int8 too, which read the 135M
        # model's head in about half bf16's time at batch 1 (0.8 against 1.5-1.9 ms)
        head_q = quantize_head(head, kind, model.quant_group_size)
    elif (head_native := native.pack(head)) is None:
        # bf16 on a CPU without our kernels: oneDNN's layout (backends/decode.py), 3.2 against 9.6 ms for the 135M
        # model's head at batch 1. An int8 model's bf16 head goes this way too: torch's int8 kernel reads the 135M
        # model's head slower than oneDNN reads it in bf16 (3.9 against 3.5 ms at batch 1, 11.7 against 4.4 at
        # batch 8)
        head_packed = packed_form(head)
        if head_packed is None and kind is not None and cpu:
            head_q = quantize_head(head, kind, model.quant_group_size)
        elif head_packed is None and cpu and head.size(0) >= 8 * head.size(1):
            # MKL's kernel for h @ W.T with a tall, thin W (V x C, V in the tens of thousands) is much slower than
            # for h @ W_t with the transpose stored contiguous (C x V): one copy of the head, once per model, for
            # the biggest matmul of a small model's token; a GPU has no such gap
            head_t = head.t().contiguous()
    packs = {}  # bf16 weights packed for our kernels, shared by the two forms
    fused = fused_step(model, packs) if FUSED.refusal(cfg) is None else None
    ops = decode_ops(model, packs)
    return DecodePlan(model, ops, head, head_t, head_packed, head_q, cfg.logit_softcap, head_native, fused)


def decode_step(p: DecodePlan, idx: torch.Tensor, cache, n: int | None = None) -> torch.Tensor:
    """Logits (B, V) after one new token for each of the cache's first n rows (idx (B,) or (B, 1)), each at its
    own position: GPT.hidden_states through the cache with the model's decoding form (backends/decode.py), which
    makes a small model's token ~1.5x cheaper than its modules do. When every row is at the same position (one
    prompt, or prompts of one length) attention needs no mask; otherwise each row's keys past its own position
    are masked. Call it under torch.inference_mode()."""
    B = idx.size(0) if n is None else n
    if p.fused is not None and B < PREFILL_ROWS and cache.dtype in FUSED_CACHE:
        h = p.ops.ln_f(p.fused(idx, cache, B))  # (B, C)
    else:
        with native.torch_threads():  # many rows: torch's products
            h = p.model.hidden_states(idx.view(B, 1), cache.view(0, B), ops=p.ops)  # (B, 1, C)
    return softcap(head_logits(p, h.view(B, -1)), p.logit_softcap)  # (B, V)


def head_logits(p: DecodePlan, h: torch.Tensor) -> torch.Tensor:
    """h (B, C) @ head.T -> (B, V), contiguous. On a CPU with a large vocabulary, h @ the transposed copy: at
    batch 5, 1.4 against 2.8 ms for F.linear (128 x 50,257, one thread, AVX-512); at batch 1 an engine step is
    ~18% faster with it than with F.linear, though alone the two cost the same there. Its logits come out row by
    row, which every pass after it (temperature, the draw, the pick) reads ~2x faster than the transposed view
    that W @ h.T gives (that form is the fastest matmul from three rows on with AVX2). A quantized model's few rows
    go through the packed kernel of its head_q instead, and a bf16 head on a CPU through oneDNN (head_packed)."""
    if p.head_q is not None and h.size(0) < PREFILL_ROWS:
        logits = p.head_q(h.contiguous())  # the kernel takes contiguous rows; a prefill hands h[:, -1]
        V = p.head.size(0)
        return logits if logits.size(1) == V else logits[:, :V].contiguous()  # int4's rows padded to 16
    if p.head_native is not None and h.size(0) < PREFILL_ROWS:
        return p.head_native(h)
    if p.head_packed is not None:
        return torch.ops.mkldnn._linear_pointwise(h.contiguous(), p.head_packed, None, "none", [], "")
    if p.head_t is None:
        return F.linear(h, p.head)
    return torch.mm(h, p.head_t)
