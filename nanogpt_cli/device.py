"""Devices and precisions: which device `auto` means, which dtype `auto` means there, and peak FLOP/s.

device = resolve_device("auto"); dtype = resolve_dtype(Dtype.auto, device)
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch

from nanogpt_cli.config import Dtype
from nanogpt_cli.errors import NanoGPTError

# Dense bf16 tensor-core peaks (FLOP/s) by device-name fragment, for MFU; a device not listed gets no MFU.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "A10G": 125e12,
    "L4": 121e12,
    "L40S": 362e12,
    "4090": 165e12,
    "3090": 71e12,
    "V100": 125e12,
    "T4": 65e12,
}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise NanoGPTError(f"--device {name!r} is not a device; use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise NanoGPTError("--device cuda was asked for, but this torch sees no CUDA GPU; use --device cpu")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise NanoGPTError("--device mps was asked for, but MPS is not available here; use --device cpu")
    return device


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 BF16 or AMX), where bf16 autocast pays off."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


# --dtype's names (besides auto) and the torch dtypes they stand for: the one table of this vocabulary
TORCH_DTYPES = {Dtype.float32: torch.float32, Dtype.bfloat16: torch.bfloat16, Dtype.float16: torch.float16}


def resolve_dtype(name: Dtype, device: torch.device) -> torch.dtype:
    """auto: bf16 where the hardware supports it (CUDA, or a CPU with native bf16), else fp16 on older
    CUDA GPUs, else fp32."""
    if name == Dtype.auto:
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if device.type == "cpu" and cpu_has_bf16():
            return torch.bfloat16
        return torch.float32
    # float16 runs anywhere: torch's autocast and GradScaler work on the CPU too (slowly), so the path that
    # T4/V100-class GPUs take is exercised by the CPU tests
    return TORCH_DTYPES[Dtype(name)]


def autocast_for(device: torch.device, dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device))


def peak_flops_of(device_name: str) -> float | None:
    # longest fragment first, so an "L40S" is not taken for an "L4"
    return next((PEAK_FLOPS[k] for k in sorted(PEAK_FLOPS, key=len, reverse=True) if k in device_name), None)


def resolve_inference_dtype(name: Dtype, device: torch.device, weight_bytes: int) -> torch.dtype:
    """The dtype to cast weights to for sampling and evaluation. auto: bf16 on CUDA GPUs that have it; on a
    CPU with native bf16, bf16 once the fp32 weights outgrow its caches (> 16 MB: one-token decoding then
    streams every weight from memory, and half the bytes is ~1.6x the speed), else fp32, where small models
    are bound by per-op overhead that narrower types do not remove."""
    if name == Dtype.auto:
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if device.type == "cpu" and cpu_has_bf16() and weight_bytes > 16 * 2**20:
            return torch.bfloat16
        return torch.float32
    return TORCH_DTYPES[Dtype(name)]


def set_threads(n: int | None) -> None:
    """--threads: torch's CPU threads for this process (None: torch's default, one per core)."""
    if n is None:
        return
    if n < 1:
        raise NanoGPTError(f"--threads must be at least 1, got {n}")
    torch.set_num_threads(n)
