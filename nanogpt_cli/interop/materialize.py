"""Building a model for inference without ever holding all of it in float32: the model is made on the meta device
(shapes, no memory), then each tensor is read from its file on its own and cast to the inference dtype, and each
block's projections are quantized as soon as that block is in. The peak is the finished model and one block's
float tensors, where building the float32 model, loading the file into it and casting it after held the float32
model, the file's tensors and the cast copy at once.

    lazy = LazyModel(empty_model(config), file.get, meta)
    model = materialize(lazy, torch.bfloat16, quantize="int4", group_size=32)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nanogpt_cli.config import GPTConfig
from nanogpt_cli.device import release_freed_memory
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.model import GPT

# the most values one position table (context x rotary width) may hold: 64M, 256 MB in float32, as a Gemma 3 of
# 128k positions by 256 needs; a context beyond it in a file is damage, not a model a CPU runs
MAX_TABLE = 2**26


def empty_model(config: GPTConfig, source: str = "") -> GPT:
    """GPT(config) with its parameters on the meta device, uninitialised, and its position tables made on the CPU
    (a context whose tables would pass MAX_TABLE is one sentence naming `source`)."""
    width = config.n_embd if config.pos_encoding == "sinusoidal" else config.rotary_size
    if config.pos_encoding != "learned" and config.block_size * width > MAX_TABLE:
        raise NanoGPTError(
            f"{source or 'the model'} has a context of {config.block_size:,} positions, whose position tables "
            f"({config.block_size:,} x {width}) pass the {MAX_TABLE:,} values nanogpt holds: a damaged config"
        )
    with torch.device("meta"):
        model = GPT(config, init=False)
    model.make_tables()
    return model


def check_blocks(source: str, n_layer: int, names, pattern: str = r"transformer\.h\.(\d+)\.") -> None:
    """The file's blocks (its tensor names matching `pattern`, group 1 the block's index) against the config's
    n_layer, before a model of n_layer blocks is built: a missing or extra block is one sentence."""
    import re

    blocks: dict[int, str] = {}
    for name in sorted(names):
        m = re.match(pattern, name)
        if m:
            blocks.setdefault(int(m.group(1)), name)
    if n_layer < len(blocks) or (blocks and max(blocks) >= n_layer):
        extra = min(i for i in blocks if i >= n_layer)
        raise NanoGPTError(
            f"{source} does not match its config: it holds {blocks[extra]}, and the config has {n_layer:,} "
            f"block{'s' if n_layer != 1 else ''} (0 to {n_layer - 1:,})"
        )
    if len(blocks) < n_layer:
        gap = min(set(range(n_layer)) - set(blocks))
        raise NanoGPTError(
            f"{source} does not match its config: the config has {n_layer:,} blocks, and the file has no tensors "
            f"of block {gap:,}"
        )


def check_tensors(source: str, expected: dict[str, tuple], found: dict[str, tuple], optional=frozenset()) -> None:
    """The file's tensors (name -> shape) against those the config implies, before any is read: one sentence
    naming the first tensor that is missing, extra, or of another shape. optional: names that may be absent."""
    for name, shape in expected.items():
        if name in found and tuple(found[name]) != tuple(shape):
            raise NanoGPTError(
                f"{source} does not match its config: {name} has shape {tuple(found[name])}, and the config "
                f"implies {tuple(shape)}"
            )
    missing = sorted(set(expected) - set(found) - set(optional))
    if missing:
        raise NanoGPTError(
            f"{source} does not match its config: it has no {missing[0]}, which the config implies "
            f"(shape {tuple(expected[missing[0]])})"
        )
    extra = sorted(set(found) - set(expected))
    if extra:
        raise NanoGPTError(
            f"{source} does not match its config: it holds {extra[0]} (shape {tuple(found[extra[0]])}), which "
            "the config has no place for"
        )


@dataclass
class LazyModel:
    """A model on the meta device and where each of its tensors comes from."""

    model: GPT  # from empty_model
    # (a state-dict name, dtype) -> its tensor on the CPU in dtype, by way of float32 (as loading it into a float32
    # model and casting after gives), never holding a large tensor whole in float32
    read: Callable[[str, torch.dtype], torch.Tensor]
    meta: dict[str, Any]  # the file's metadata, as load_model gives it
    source: str = ""  # the file, for error messages
    # a projection's module name -> its layer built from the file's quantized blocks, given its bias (float32)
    packed: dict[str, Callable[[torch.Tensor | None], nn.Module]] = field(default_factory=dict)

    @property
    def weight_bytes(self) -> int:
        """What the parameters would take in float32, the packed projections' weights left out: the size the
        automatic dtype is chosen by (device.resolve_inference_dtype)."""
        return sum(
            p.numel() * p.element_size()
            for name, p in self.model.named_parameters()
            if name.removesuffix(".weight") not in self.packed
        )


def materialize(lazy: LazyModel, dtype: torch.dtype, quantize: str | None = None, group_size: int = 32) -> GPT:
    """The model on the CPU in dtype, its blocks' projections quantized (backends/quantize.py) as each block is read:
    the same tensors as building it in float32, loading the file, GPT.cast and quantize_model. Raises ValueError
    for a quantization the model's widths do not allow, before reading anything."""
    from nanogpt_cli.inference.backends.quantize import check_widths, quantize_block

    model = lazy.model
    if quantize is not None:
        check_widths(model, quantize, group_size)
    with torch.no_grad():
        for i, block in enumerate(model.transformer.h):
            prefix = f"transformer.h.{i}"
            for name in [n for n, _ in block.named_modules()]:
                if f"{prefix}.{name}" in lazy.packed:
                    _swap_packed(lazy, block, name, prefix)
            _fill(lazy, block, prefix, dtype)
            if quantize is not None:
                quantize_block(block, quantize, group_size)
            release_freed_memory()  # the block's float tensors, now freed, give their pages back
        _fill(lazy, model, "", dtype)  # the rest: embeddings, the final norm, an untied head
    if model.config.tie_embeddings:
        model.lm_head.weight = model.transformer.wte.weight
    if quantize is not None:
        model.quantized, model.quant_group_size = quantize, group_size  # what decode_plan quantizes the head with
    assert not any(t.is_meta for t in model.state_dict().values()), "a tensor was left on the meta device"
    return model.cast(dtype)


def _read(lazy: LazyModel, name: str, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The file's tensor for `name` in dtype, checked against the model's shape."""
    t = lazy.read(name, dtype)
    if tuple(t.shape) != tuple(like.shape):
        raise NanoGPTError(
            f"{lazy.source} does not match its config: {name} is {tuple(t.shape)}, not {tuple(like.shape)}"
        )
    assert t.dtype == dtype, f"{name} was read as {t.dtype}, not {dtype}"
    return t


def _fill(lazy: LazyModel, module: nn.Module, prefix: str, dtype: torch.dtype) -> None:
    """Every parameter of module still on the meta device read from the file (a tied head is tied after)."""
    tied = module is lazy.model and lazy.model.config.tie_embeddings
    for name, p in list(module.named_parameters()):
        if not p.is_meta or (tied and name == "lm_head.weight"):
            continue
        owner, _, attr = name.rpartition(".")
        parent = module.get_submodule(owner)
        full = f"{prefix}.{name}" if prefix else name
        setattr(parent, attr, nn.Parameter(_read(lazy, full, p, dtype), requires_grad=p.requires_grad))


def _swap_packed(lazy: LazyModel, block: nn.Module, name: str, prefix: str) -> None:
    """A projection the file holds in quantized blocks, built from them with its bias."""
    linear = block.get_submodule(name)
    full = f"{prefix}.{name}"
    bias = None if linear.bias is None else _read(lazy, f"{full}.bias", linear.bias, torch.float32)
    parent_name, _, attr = name.rpartition(".")
    setattr(block.get_submodule(parent_name), attr, lazy.packed[full](bias))
