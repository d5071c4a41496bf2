"""Devices and precisions: which device `auto` means, which dtype `auto` means there, and peak FLOP/s.

device = resolve_device("auto"); dtype = resolve_dtype(Dtype.auto, device)
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from nanogpt_cli.config import Dtype, GPTConfig
from nanogpt_cli.errors import NanoGPTError

# Dense peaks (FLOP/s) by device-name fragment, for MFU: (bf16/fp16 tensor cores, fp32 matmuls as this tool runs
# them: TF32 tensor cores from Ampere on, plain fp32 before). A device not listed gets no MFU. The H100/H200
# variants differ by clocks and power: SXM boards report "HBM3" (H100) or plain "H200", PCIe and NVL say so.
PEAK_FLOPS = {
    "H200 NVL": (835e12, 417e12),
    "H200": (989e12, 494e12),
    "H100 NVL": (835e12, 417e12),
    "H100 PCIe": (756e12, 378e12),
    "H100": (989e12, 494e12),
    "A100": (312e12, 156e12),
    "A10G": (70e12, 35e12),  # AWS's A10G: lower clocks than the A10 (125 bf16)
    "A10": (125e12, 62.5e12),
    "L40S": (362e12, 183e12),
    "L40": (181e12, 90.5e12),
    "L4": (121e12, 60e12),
    "4090": (165e12, 82.6e12),
    "3090": (71e12, 35.6e12),
    "V100": (125e12, 15.7e12),  # no TF32: fp32 runs on the plain cores
    "T4": (65e12, 8.1e12),
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
    if device.type == "cuda" and device.index is not None:
        if device.index >= torch.cuda.device_count():
            raise NanoGPTError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
        torch.cuda.set_device(device)  # current, so that nothing (a context, a cache) lands on GPU 0
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


def resolve_dtype(
    name: Dtype,
    device: torch.device,
    model: GPTConfig | None = None,
    rows: int | None = None,
    seq_len: int | None = None,
) -> torch.dtype:
    """auto: bf16 where the hardware supports it (CUDA, or a CPU with native bf16: there only for a model and
    micro-batch of `rows` sequences of `seq_len` tokens, default the context, big enough, see BF16_MIN_FLOPS;
    without them, bf16), else fp16 on older CUDA GPUs, else fp32."""
    if name == Dtype.auto:
        if device.type == "cuda":
            return cuda_auto_dtype(torch.cuda.get_device_capability(device))
        if device.type == "cpu" and cpu_has_bf16():
            small = model is not None and update_flops(model, rows or 1, seq_len) < BF16_MIN_FLOPS
            return torch.float32 if small else torch.bfloat16
        return torch.float32
    # float16 runs anywhere: torch's autocast and GradScaler work on the CPU too (slowly), so the path that
    # T4/V100-class GPUs take is exercised by the CPU tests
    return TORCH_DTYPES[Dtype(name)]


# A CPU update's matmul work (FLOPs of one micro-batch) under which bf16 autocast is no faster than fp32: its casts
# cost what the narrower matmuls save. Measured with benchmarks/bench_cpu_dtype.py on 2 cores of an AMD EPYC with
# AVX-512 BF16, 1 thread, the dtypes alternated in one process (benchmarks/README.md, "--dtype auto on a CPU"):
# 41 MFLOP (the tiny preset) 0.67-0.80x, 157 MFLOP 0.98-1.01x, 226-1,057 MFLOP 1.10-1.23x, cpu-char's 3.7 GFLOP
# 1.34-1.65x, 131-261 GFLOP (10.7M, 85M parameters) 1.8x. On a tie fp32 stays: no casts, and exact.
BF16_MIN_FLOPS = 200e6


def update_flops(model: GPTConfig, rows: int, seq_len: int | None = None) -> float:
    """Training FLOPs of the matmuls (6 per weight per token) of one micro-batch of `rows` windows of `seq_len`
    tokens (default: the context)."""
    C = model.n_embd
    mlp = (3 if model.gated else 2) * C * model.hidden_size
    weights = model.n_layer * (4 * C * C + mlp) + model.vocab_size * C  # attention, MLP, the LM head
    return 6.0 * weights * rows * (seq_len or model.block_size)


def cuda_auto_dtype(capability: tuple[int, int]) -> torch.dtype:
    """bf16 on GPUs with bf16 tensor cores (Ampere, compute capability 8.0, and newer); fp16 with the grad
    scaler before them, where torch would emulate bf16 (is_bf16_supported() counts emulation, and asks about
    the current device rather than the chosen one)."""
    return torch.bfloat16 if capability >= (8, 0) else torch.float16


def enable_tf32() -> None:
    """fp32 matmuls and convolutions on TF32 tensor cores (Ampere and newer), through the current API where this
    torch has it (the allow_tf32 setters are deprecated)."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    if hasattr(matmul, "fp32_precision") and hasattr(cudnn, "conv"):
        matmul.fp32_precision = "tf32"
        cudnn.conv.fp32_precision = "tf32"
    else:  # pragma: no cover - older torch
        matmul.allow_tf32 = True
        cudnn.allow_tf32 = True


def autocast_for(device: torch.device, dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def peak_flops(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> float | None:
    if device.type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device), dtype)


def peak_flops_of(device_name: str, dtype: torch.dtype = torch.bfloat16) -> float | None:
    """The dense peak MFU is measured against: the tensor-core one for bf16/fp16 runs, the TF32 (or plain
    fp32) one for fp32 runs."""
    # longest fragment first, so an "L40S" is not taken for an "L4", nor an "H100 PCIe" for an "H100"
    key = next((k for k in sorted(PEAK_FLOPS, key=len, reverse=True) if k in device_name), None)
    if key is None:
        return None
    half, single = PEAK_FLOPS[key]
    return single if dtype == torch.float32 else half


def resolve_inference_dtype(name: Dtype, device: torch.device, weight_bytes: int) -> torch.dtype:
    """The dtype to cast weights to for sampling and evaluation. auto: bf16 on CUDA GPUs that have it; on a
    CPU with native bf16, bf16 once the fp32 weights outgrow its caches (> 16 MB: one-token decoding then
    streams every weight from memory, and half the bytes is ~1.6x the speed), else fp32, where small models
    are bound by per-op overhead that narrower types do not remove."""
    if name == Dtype.auto:
        if device.type == "cuda":
            return cuda_auto_dtype(torch.cuda.get_device_capability(device))
        if device.type == "cpu" and cpu_has_bf16() and weight_bytes > 16 * 2**20:
            return torch.bfloat16
        return torch.float32
    return TORCH_DTYPES[Dtype(name)]


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


@functools.cache
def keep_freed_memory() -> bool:
    """Have glibc's malloc keep the memory that freed tensors leave, for the next ones; True when it took.

    A training step on a CPU frees and allocates the same activations every update. By default glibc serves
    blocks over its mmap threshold (which adapts, starting at 128 KiB) with fresh pages and gives free memory at
    the heap's top back to the system past its trim threshold, so every update faults its activations in
    again: a 4 x 128 model's update faulted ~7,000 pages (28 MB) and 150 updates took 20.6 s against 18.2 s
    with these settings, which leave ~100 faults per update. Blocks under 32 MiB now come from the heap, and up
    to 1 GiB of free memory stays in the process; larger tensors are still mapped and unmapped on their own.
    Elsewhere (not Linux, or another C library) nothing changes."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(M_TRIM_THRESHOLD, 1 << 30))


def release_freed_memory() -> bool:
    """Give the memory that freed blocks hold back to the system now (glibc's malloc_trim); True when it did.

    keep_freed_memory keeps up to 1 GiB of it for the next allocations, which serves a training loop; a setup
    that frees a model's worth of weights once (a converted checkpoint copied into the run's model, a LoRA base
    recast, see lora.hold_frozen) would keep all of it: the trainer calls this once after such a setup. Loading a
    model a block at a time (interop/materialize.py) calls it after each block: the block's float tensors are
    freed and its packed form kept, and glibc serves the next block's from the heap (its mmap threshold has grown
    past their size), behind the kept ones, so the heap's free pages would stay resident. A q8_0 GGUF of
    SmolLM2-135M's shape peaked at 855 MB without this, 528 MB with it after each block. Elsewhere (not Linux, or
    another C library) nothing happens."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))


# --- CPU threads ---

# torch's own count, read before anything changes it: one per physical core, or OMP_NUM_THREADS
TORCH_THREADS = torch.get_num_threads()


@dataclass(frozen=True)
class ThreadChoice:
    """The CPU threads a command computes with, and why."""

    threads: int  # torch's intra-op threads
    cores: int  # the most it would use: torch's own count (one per physical core)
    running: float | None  # other threads running at the start; None where that cannot be seen
    load: float | None  # the 1-minute load average; None where the platform has none
    source: str  # "auto" (chosen here), "given" (--threads) or "environment" (OMP_NUM_THREADS)

    def line(self, processes: int = 1) -> str:
        """What was chosen and why, for the note an automatic choice prints; shared out between `processes`."""
        why = [] if self.load is None else [f"load {self.load:.1f}"]
        if self.running:
            why.append(f"{self.running:g} other thread{'s' if self.running > 1 else ''} running")
        why_text = ", ".join(why) or "load unknown"
        if processes > 1:
            return (
                f"threads: {self.per_process(processes)} in each of {processes} processes, {self.threads} of "
                f"{self.cores} cores ({why_text}); --threads N sets it"
            )
        return f"threads: {self.threads} of {self.cores} cores ({why_text}); --threads N sets it"

    def per_process(self, processes: int) -> int:
        """The count shared out between `processes` on this machine, at least one each."""
        return max(1, self.threads // processes)


def cpu_cores() -> int:
    """The CPUs this process may run on (logical ones: hyper-threads count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not on this platform
        return None


def _running_now() -> int | None:
    """Threads running or waiting for a CPU now, on the whole machine, less this process's own."""
    try:
        runnable = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])  # this reading thread included
        own = 0
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):  # a thread that just ended
                own += Path(f"/proc/self/task/{task}/stat").read_text().rpartition(")")[2].split()[0] == "R"
    except (OSError, ValueError, IndexError):  # not Linux
        return None
    return max(0, runnable - own)


def running_elsewhere(samples: int = 5, gap_s: float = 0.004) -> float | None:
    """Other threads running now: the median of a few looks (~20 ms), so that a short-lived process does not
    count. None where /proc is not there."""
    counts = []
    for i in range(samples):
        if i:
            time.sleep(gap_s)
        count = _running_now()
        if count is None:
            return None
        counts.append(count)
    return statistics.median(counts)


def choose_threads(cpus: int, top: int, others: float | None) -> int:
    """One thread per CPU the other running threads leave free, at most `top` (torch's count), at least one.

    A thread that waits for a core is not just idle: torch's OpenMP threads spin at every barrier, and a step
    waits for the slowest one. On 2 cores with one other CPU-bound process, 2 threads took 3,322 ms a cpu-char
    update and 1 thread 108 ms (idle: 63 and 97 ms); see benchmarks/README.md, "Busy CPU"."""
    if others is None:
        return top
    return max(1, min(top, math.floor(cpus - others + 0.5)))


def auto_threads() -> ThreadChoice:
    """The automatic choice from what runs on the machine now: the threads running elsewhere at this moment,
    or the 1-minute load average where that is higher (a process that comes and goes shows there). The load
    average lags by a minute both ways; a training run corrects the count as it goes (clock.ThreadTuner)."""
    cpus, load, running = cpu_cores(), load_average(), running_elsewhere()
    top = max(1, min(TORCH_THREADS, cpus))
    others = None if running is None and load is None else max(running or 0.0, load or 0.0)
    return ThreadChoice(choose_threads(cpus, top, others), top, running, load, "auto")


_chosen: ThreadChoice | None = None  # set_threads' last choice, until the command's work takes it


def set_threads(n: int | None) -> ThreadChoice:
    """--threads: torch's CPU threads for this process. A given value is kept, and so is OMP_NUM_THREADS (the
    user's, torchrun's, or the one `train --nproc` gives its processes). Otherwise the count is chosen from the
    load now (auto_threads), and the work that follows says so in one line once it starts (take_threads_choice):
    a refused command prints its error alone."""
    global _chosen
    _chosen = None
    if n is not None:
        if n < 1:
            raise NanoGPTError(f"--threads must be at least 1, got {n}")
        torch.set_num_threads(n)
        _chosen = ThreadChoice(n, n, None, None, "given")
    elif os.environ.get("OMP_NUM_THREADS"):
        _chosen = ThreadChoice(torch.get_num_threads(), torch.get_num_threads(), None, None, "environment")
    else:
        _chosen = auto_threads()
        torch.set_num_threads(_chosen.threads)
    return _chosen


def take_threads_choice() -> ThreadChoice | None:
    """The choice the last set_threads made, once, for the work that follows: a CPU training run says an
    automatic one and adapts it as it goes, a model loaded for inference says it and keeps it. A run started
    without set_threads (the library, a test) gets None and keeps its threads, so that two such runs compute
    the same bits."""
    global _chosen
    choice, _chosen = _chosen, None
    return choice


def say_threads(device: torch.device) -> None:
    """Before inference on the CPU: the automatic thread choice, in one note line on stderr when that is a
    terminal (a person reads it; a script that reads what sample or eval write gets that alone)."""
    choice = take_threads_choice()
    if choice is not None and choice.source == "auto" and device.type == "cpu" and sys.stderr.isatty():
        print(f"note: {choice.line()}", file=sys.stderr, flush=True)
