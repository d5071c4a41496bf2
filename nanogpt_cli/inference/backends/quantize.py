"""Quantization for inference: the blocks' nn.Linear layers swapped for QuantizedLinear, per-channel
int8 or grouped int4, whose few-row products run in our x86 kernels (native.py) or, where those cannot run,
torch's own packed CPU kernels (aten._weight_int8pack_mm, aten._weight_int4pack_mm_for_cpu). Activations stay in
the model's dtype (float32 or bfloat16), except that our kernels round them to int8 in blocks of 32 inside the
product, as llama.cpp's q8_0 and q4_0 do; the weights are stored in 8 or 4 bits, which is what a CPU decode step
is bound by: the bytes of weights read per token.

    quantize_model(model, "int4", group_size=32)   # in place, after GPT.cast; the model is for inference only

The token embedding and the model's own lm_head stay in the model's dtype: the embedding is a lookup, not a matmul,
and a tied head shares its tensor with it (SmolLM2, Qwen2.5); there is no packed kernel for a gather. The decode
step reads a quantized copy of the head instead (quantize_head, built by the engine's decode_plan): at batch 1 the
head is the biggest matmul left once the blocks are quantized.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from nanogpt_cli.inference.backends import native

QUANT_KINDS = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what the int4 kernel takes
# from this many rows on (a prefill) the weight is dequantized to the activations' dtype and multiplied by
# F.linear: the packed kernels are written for the few rows of a decode step, and the dequantization's one pass over
# the weight costs little beside a matmul of many rows
PREFILL_ROWS = 32
PACK_ROWS = 4096  # rows of int4 values packed at a time (a multiple of the kernel's 64)
ROWS_BYTES = 4 * 2**20  # float32 rows quantized at a time (_by_rows)


class QuantizedLinear(nn.Module):
    """y = x @ W.T + b with W held as int8 per output channel (w = q * scale) or as int4 in groups of group_size
    along the input (w = (q - 8) * scale + zero, q in 0..15). Where our kernels run (native.py) the values
    are held in their tiled order, and int4's scales and zeros as fp16 bits (w = q * scale + (zero - 8 * scale),
    in `scales` and `zeros`); elsewhere in the layouts of torch's own kernels, whose float buffers follow the model's
    dtype on .to(dtype). `native` says which."""

    def __init__(self, in_features: int, out_features: int, kind: str, group_size: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features, self.kind, self.group_size = in_features, out_features, kind, group_size
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        code = native.INT8 if kind == "int8" else native.INT4
        self.native = native.available() and native.takes(code, in_features, group_size)
        self._kernel: tuple | None = None  # (the tensors it was built from, native.Packed)

    @classmethod
    def int8(cls, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> QuantizedLinear:
        """From int8 values q (out, in) and one scale per output row (out,)."""
        m = cls(q.size(1), q.size(0), "int8", q.size(1), bias)
        q = q.to(torch.int8)
        m.register_buffer("weight_q", native.int8_tiles(q) if m.native else q.contiguous())
        m.register_buffer("scales", scale.contiguous())
        return m

    @classmethod
    def int4(
        cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int, bias: torch.Tensor | None = None
    ) -> QuantizedLinear:
        """From 4-bit values q (out, in) in 0..15 and per-group scale and zero (out, in / group_size), meaning
        w = (q - 8) * scale + zero."""
        m = cls(q.size(1), q.size(0), "int4", group_size, bias)
        if m.native:
            m.register_buffer("weight_q", native.int4_tiles(q))
            # fp16 bits held as int16, (out / 16, in / group_size, 16): a model's .to(dtype) leaves them as they are
            s, rows = scale.float(), native.INT4_ROWS
            m.register_buffer("scales", native.tiles(s.half(), 1, rows).squeeze(-1).view(torch.int16))
            zeros = native.tiles((zero.float() - 8 * s).half(), 1, rows).squeeze(-1)
            m.register_buffer("zeros", zeros.view(torch.int16))
            return m
        m.register_buffer("weight_q", _int4_pack(q))
        # (in / group_size, out, 2): the kernel's layout of scales and zeros
        m.register_buffer("scales", torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous())
        # the values once more, two to a byte in a plain layout, for the prefill's dequantization (the kernel's own
        # layout is its private business): int4 holds 1 byte per weight in all, as int8 does, read 0.5 per token
        q = q.to(torch.uint8)
        m.register_buffer("nibbles", q[:, 0::2] | (q[:, 1::2] << 4), persistent=False)
        return m

    @classmethod
    def joined(cls, parts: list[QuantizedLinear]) -> QuantizedLinear:
        """One layer of parts' rows, one after another: parts in our tiled layout, each but the last of a whole
        number of tiles, without biases."""
        first = parts[0]
        assert all(p.native and p.bias is None for p in parts), "joined takes bias-free layers in our layout"
        rows = native.tile_rows(native.INT8 if first.kind == "int8" else native.INT4)
        assert all(p.out_features % rows == 0 for p in parts[:-1]), "joined parts end on whole tiles"
        m = cls(first.in_features, sum(p.out_features for p in parts), first.kind, first.group_size, None)
        for name in ("weight_q", "scales", "zeros"):
            if hasattr(first, name):  # tiles (and int8's scale per row) join along their first dimension
                m.register_buffer(name, torch.cat([getattr(p, name) for p in parts]))
        return m

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight (out, in) in dtype."""
        N, K = self.out_features, self.in_features
        if self.kind == "int8":
            q = native.int8_untiled(self.weight_q, N) if self.native else self.weight_q
            return (q.to(dtype) * self.scales.to(dtype)[:, None]).to(dtype)
        G = K // self.group_size
        if self.native:  # in our kernels: 17 ms for a 3,072 x 576 layer in torch, 0.4 ms there (bit for bit)
            out = dtype if dtype in native.FLOATS else torch.float32
            # on one thread: between a prefill's products, a second thread of ours waited for the core that torch's
            # own thread still spun on (Gemma 3's 270M shape at 2 threads: 600-690 ms a prefill, 500-510 on one)
            return native.dequantize(self.kernel(), out, 1).to(dtype)
        q = torch.stack([self.nibbles & 15, self.nibbles >> 4], dim=-1)  # (out, in / 2, 2)
        q = q.view(N, G, self.group_size).to(dtype)  # (out, G, g)
        scale, zero = self.scales[..., 0].t().to(dtype), self.scales[..., 1].t().to(dtype)  # (out, G)
        return torch.addcmul(zero[..., None], q - 8, scale[..., None]).reshape(N, K)

    def kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """x (N, in) -> x @ W.T + b for few rows: our kernel (native.Packed, built once per set of buffers) or
        torch's packed one with its arguments bound."""
        if self.native:
            tensors = (self.weight_q, self.scales, getattr(self, "zeros", None), self.bias)
            held = [(id(t), t.data_ptr()) if t is not None else None for t in tensors]
            if self._kernel is None or self._kernel[0] != held:
                N, K, bias = self.out_features, self.in_features, self.bias
                if self.kind == "int8":
                    packed = native.pack_int8(self.weight_q, self.scales, N, K, bias)
                else:
                    scale, zero = self.scales.view(torch.float16), self.zeros.view(torch.float16)
                    packed = native.pack_int4(self.weight_q, scale, zero, N, K, self.group_size, bias)
                self._kernel = (held, packed)
            return self._kernel[1]
        if self.kind == "int8":
            kernel, args = torch.ops.aten._weight_int8pack_mm.default, (self.weight_q, self.scales)
        else:
            kernel = torch.ops.aten._weight_int4pack_mm_for_cpu.default
            args = (self.weight_q, self.group_size, self.scales)
        bias = self.bias

        def op(x: torch.Tensor) -> torch.Tensor:
            y = kernel(x, *args)
            return y if bias is None else y.add_(bias)

        return op

    def __getstate__(self) -> dict:
        """Copies (deepcopy, pickle) leave the kernel behind: it points at this module's tensors."""
        return {**super().__getstate__(), "_kernel": None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.in_features)  # (N, in)
        if x.size(0) >= PREFILL_ROWS:
            y = F.linear(x, self.dequantize(x.dtype), self.bias)
        else:
            y = self.kernel()(x.contiguous())
        return y.view(*shape[:-1], self.out_features)

    def decode_op(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """x (N, in) -> y (N, out), what forward computes, with the kernel bound once: a decode step's few rows
        skip the module call, the reshapes and the attribute lookups (~4 us a call, 120 calls a token in a
        30-layer model). Rows from PREFILL_ROWS on still go through forward."""
        kernel = self.kernel()

        def op(x: torch.Tensor) -> torch.Tensor:
            return self(x) if x.size(0) >= PREFILL_ROWS else kernel(x)

        return op

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.kind == "int4" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}{group}"


def _int4_pack(q: torch.Tensor) -> torch.Tensor:
    """4-bit values (out, in) in the int4 kernel's layout, PACK_ROWS rows at a time: the kernel takes int32 values,
    4 bytes a weight, which for a 151,936-row head at once would be the load's peak (545 MB for Qwen2.5-0.5B's). It
    packs 64 rows at a time, so whole slices of them pack to the same bytes as the matrix at once."""
    pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu
    return torch.cat([pack(q[r : r + PACK_ROWS].to(torch.int32), 1) for r in range(0, q.size(0), PACK_ROWS)])


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (out, in) -> int8 values and one symmetric scale per row, max |w| / 127, in w's dtype."""
    return _by_rows(w, _int8_rows)


def _int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w32 = w.float()
    scale = w32.abs().amax(dim=1).clamp(min=1e-12) / 127
    q = torch.round(w32 / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale.to(w.dtype)


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w (out, in) -> 4-bit values in 0..15, scale and zero per group (out, in / g): asymmetric, min to max in 15
    steps, which halves the error of a symmetric grid for groups that are not centred on zero."""
    return _by_rows(w, lambda rows: _int4_rows(rows, group_size))


def _int4_rows(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out, n = w.shape
    g = w.float().view(out, n // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).view(out, n)
    zero = lo + 8 * scale  # the kernel's w = (q - 8) * scale + zero
    return q, scale.to(w.dtype), zero.to(w.dtype)


def _by_rows(w: torch.Tensor, quantize) -> tuple[torch.Tensor, ...]:
    """quantize over slices of w's rows, its outputs joined: the same values (every step is per row), without
    several float32 copies of a large w at once (the head of a 49,152-token vocabulary: ~350 MB)."""
    step = max(1, ROWS_BYTES // (4 * w.size(1)))
    if w.size(0) <= step:
        return quantize(w)
    parts = [quantize(w[r : r + step]) for r in range(0, w.size(0), step)]
    return tuple(torch.cat(p) for p in zip(*parts))


def check_quantize(kind: str | None, group_size: int) -> None:
    """Refuse a --quantize or --int4-group the kernels do not take."""
    if kind is not None and kind not in QUANT_KINDS:
        raise ValueError(f"--quantize must be one of {', '.join(QUANT_KINDS)}, got {kind!r}")
    if kind == "int4" and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"--int4-group must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, got {group_size}")


def quantize_linear(module: nn.Linear, kind: str, group_size: int = 32) -> QuantizedLinear | nn.Linear:
    """One layer in its quantized form; a layer that is not on a CPU, or whose input width is not a whole number
    of int4 groups (quantize_model refuses those), stays as it is."""
    w = module.weight.detach()
    if w.device.type != "cpu" or (kind == "int4" and w.size(1) % group_size != 0):
        return module
    if kind == "int8":
        return QuantizedLinear.int8(*quantize_int8(w), bias=module.bias)
    return QuantizedLinear.int4(*quantize_int4(w, group_size), group_size, bias=module.bias)


def quantize_model(model: nn.Module, kind: str, group_size: int = 32) -> nn.Module:
    """Every nn.Linear inside the Transformer blocks swapped in place for its quantized form (see the module's
    docstring for the embedding and the head). Returns the model."""
    check_widths(model, kind, group_size)
    for block in model.transformer.h:
        quantize_block(block, kind, group_size)
    model.quantized, model.quant_group_size = kind, group_size  # what decode_plan quantizes the head with
    return model


def check_widths(model: nn.Module, kind: str, group_size: int) -> None:
    """Refuse a kind or group size the kernels do not take, or int4 groups that do not divide some projection's
    input width (checked before any layer is touched; the model may still be on the meta device)."""
    check_quantize(kind, group_size)
    widths = {m.in_features for m in model.transformer.h.modules() if type(m) is nn.Linear}
    if kind == "int4" and any(w % group_size for w in widths):
        listed = ", ".join(map(str, sorted(widths)))
        raise ValueError(f"--int4-group ({group_size}) must divide every projection's input width ({listed})")


def quantize_block(block: nn.Module, kind: str, group_size: int) -> None:
    """One block's nn.Linear layers swapped in place for their quantized form."""
    for name, module in list(block.named_modules()):
        if type(module) is nn.Linear:
            parent_name, _, attr = name.rpartition(".")
            parent = block.get_submodule(parent_name) if parent_name else block
            setattr(parent, attr, quantize_linear(module, kind, group_size))


def quantize_head(head: torch.Tensor, kind: str, group_size: int) -> QuantizedLinear:
    """A packed copy of the head (V, C) for the few rows of a decode step only (it is never dequantized: its caller
    multiplies PREFILL_ROWS rows or more by the float head). The int4 kernel takes a multiple of 16 rows, so the
    vocabulary is padded with zero rows there: the caller cuts the logits back to head.size(0)."""
    w = head.detach()
    code = native.INT8 if kind == "int8" else native.INT4
    if native.available() and native.takes(code, w.size(1), group_size) and w.size(0) > PACK_ROWS:
        # our tiled layout joins along its rows: quantized PACK_ROWS rows at a time, the values of a large
        # vocabulary's head are never all held at once before their tiled copy (Qwen2.5's int4 head: ~270 MB)
        parts = [quantize_head(w[r : r + PACK_ROWS], kind, group_size) for r in range(0, w.size(0), PACK_ROWS)]
        return QuantizedLinear.joined(parts)
    if kind == "int8":
        return QuantizedLinear.int8(*quantize_int8(w))
    ours = native.available() and native.takes(native.INT4, w.size(1), group_size)
    pad = 0 if ours else -w.size(0) % 16  # torch's kernel takes whole 16s of rows
    if pad:
        w = torch.cat([w, w.new_zeros(pad, w.size(1))])
    m = QuantizedLinear.int4(*quantize_int4(w, group_size), group_size)
    if not m.native:
        del m.nibbles  # the prefill's plain copy of the values, which this copy never reads: V x C / 2 bytes saved
    return m
