"""How a decode step is computed, behind one interface (base.DecodeBackend): `torch`, the model's own forward and
the reference (reference.py), and `cpu`, our kernels and the decoding form (cpu.py, with native.py and
native.cpp, decode.py, quantize.py and the per-model cache of forms, form_cache.py). The engine takes the first
backend in BACKENDS that supports the model (choose), or the one --backend names.

    backend = choose(model)            # or choose(model, "torch"): refused in one sentence where it does not fit

May import: the top-level modules (model, config, errors). Never the rest of inference/, nor any other folder.
"""

from __future__ import annotations

import torch

from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.inference.backends.base import DecodeBackend
from nanogpt_cli.inference.backends.cpu import CPU, FUSED
from nanogpt_cli.inference.backends.reference import TORCH

BACKENDS: tuple[DecodeBackend, ...] = (CPU, TORCH)  # the first that supports a model decodes it
NAMES = tuple(b.name for b in BACKENDS)


def decode_words(config) -> str:
    """Which backend decodes a model of this config on a CPU, and whether the cpu backend's fused step runs it, in
    a few words (for `info`, which reads no weights: the step also needs our kernels built and bf16 or quantized
    weights)."""
    backend = next(b for b in BACKENDS if b.supports(config, torch.bfloat16, torch.device("cpu"), None) is None)
    if backend is not CPU:
        return backend.name
    if FUSED.refusal(config) is None:
        return "cpu, each step of the blocks in one call (bf16, int8, int4)"
    return f"cpu, op by op (its fused step needs {FUSED.needs(config)})"


def choose(model, name: str | None = None) -> DecodeBackend:
    """The backend that decodes the model: the one named (refused in one sentence where it does not fit), else
    the first in BACKENDS that supports it."""
    w = model.transformer.wte.weight
    args = (model.config, w.dtype, w.device, getattr(model, "quantized", None))
    if name is not None:
        backend = next((b for b in BACKENDS if b.name == name), None)
        if backend is None:
            raise NanoGPTError(f"--backend must be one of {', '.join(NAMES)}, got {name!r}")
        why = backend.supports(*args)
        if why is not None:
            raise NanoGPTError(f"--backend {name} does not fit this model: {why}")
        return backend
    for backend in BACKENDS:
        if backend.supports(*args) is None:
            return backend
    raise AssertionError("the torch backend supports every model")


__all__ = ["BACKENDS", "NAMES", "DecodeBackend", "choose", "decode_words"]
