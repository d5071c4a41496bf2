"""llama.cpp's Q8_0 and Q4_0 blocks read straight into QuantizedLinear, without a float copy of the weight: a
GGUF export at q4_0 loads as `--quantize int4` (group 32) with the file's very values and scales, one at q8_0 as
`--quantize int8`.

    layer = linear_from_blocks(raw, "Q4_0", bias=None)   # raw: (out, in / 32 * 18) bytes, as GGUFReader holds them

Q8_0: blocks of 32 int8 values and an fp16 scale, w = q * d. Q4_0: blocks of an fp16 scale and 16 bytes, value j
in byte j's low nibble and value j + 16 in its high one, w = (q - 8) * d.
"""

from __future__ import annotations

import numpy as np
import torch

from nanogpt_cli.inference.backends.quantize import QuantizedLinear

# --quantize -> the GGUF block type that loads into it as it is (int4: at group size 32 only)
GGUF_FORMS = {"int8": "Q8_0", "int4": "Q4_0"}
BLOCK = 32


def _split(raw: np.ndarray, block_bytes: int) -> tuple[torch.Tensor, np.ndarray]:
    """(out, bytes) -> each block's scale (out, n_blocks) in float32 and its value bytes (out, n_blocks, rest)."""
    blocks = np.ascontiguousarray(raw).reshape(raw.shape[0], -1, block_bytes)
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    return torch.from_numpy(d), blocks[..., 2:]


def linear_from_blocks(raw: np.ndarray, block_type: str, bias: torch.Tensor | None) -> QuantizedLinear:
    """One layer from its raw GGUF rows (out, bytes) of block_type Q8_0 or Q4_0."""
    if block_type == "Q4_0":
        d, qs = _split(raw, 2 + BLOCK // 2)
        qs = torch.from_numpy(np.ascontiguousarray(qs))  # (out, n_blocks, 16)
        q = torch.cat([qs & 15, qs >> 4], dim=-1).flatten(1)  # (out, in): values 0..15 in their order
        return QuantizedLinear.int4(q, d, torch.zeros_like(d), BLOCK, bias)  # zero 0: w = (q - 8) * d exactly
    d, qs = _split(raw, 2 + BLOCK)
    q = torch.from_numpy(np.ascontiguousarray(qs).view(np.int8).astype(np.float32))  # (out, n_blocks, 32)
    # the int8 kernel takes one scale per row: the row's largest block scale, each block's values rescaled to it in
    # whole steps; exact where a row's blocks share a scale, otherwise within half a step of the row's scale
    scale = d.abs().amax(dim=1).clamp(min=torch.finfo(torch.float16).tiny)  # (out,)
    q = torch.round(q * (d / scale[:, None])[..., None]).clamp(-127, 127).flatten(1)
    return QuantizedLinear.int8(q.to(torch.int8), scale, bias)
