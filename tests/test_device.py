"""Device and dtype resolution, the peak-FLOPs table used for MFU, and the CPU allocator's settings."""

import platform
import subprocess
import sys

import pytest
import torch

from nanogpt_cli.config import Dtype
from nanogpt_cli.device import peak_flops_of, resolve_device, resolve_dtype, resolve_inference_dtype
from nanogpt_cli.errors import NanoGPTError


def test_peak_flops_takes_the_longest_matching_name():
    assert peak_flops_of("NVIDIA L40S") == 362e12
    assert peak_flops_of("NVIDIA L40") == 181e12
    assert peak_flops_of("NVIDIA L4") == 121e12
    assert peak_flops_of("NVIDIA H100 80GB HBM3") == 989e12  # SXM
    assert peak_flops_of("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_of("NVIDIA H100 NVL") == 835e12
    assert peak_flops_of("NVIDIA H200") == 989e12
    assert peak_flops_of("NVIDIA A10G") == 70e12 and peak_flops_of("NVIDIA A10") == 125e12
    assert peak_flops_of("Some Future GPU") is None


def test_fp32_runs_are_measured_against_the_tf32_or_fp32_peak():
    assert peak_flops_of("NVIDIA H100 80GB HBM3", torch.float32) == 494e12
    assert peak_flops_of("NVIDIA A100-SXM4-40GB", torch.float32) == 156e12
    assert peak_flops_of("Tesla V100-SXM2-16GB", torch.float32) == 15.7e12  # no TF32 there
    assert peak_flops_of("NVIDIA A100-SXM4-40GB", torch.float16) == peak_flops_of("NVIDIA A100-SXM4-40GB")


def test_auto_is_bf16_from_ampere_on_and_fp16_with_the_scaler_before():
    from nanogpt_cli.device import cuda_auto_dtype

    assert cuda_auto_dtype((9, 0)) == cuda_auto_dtype((8, 0)) == cuda_auto_dtype((8, 6)) == torch.bfloat16
    assert cuda_auto_dtype((7, 5)) == cuda_auto_dtype((7, 0)) == cuda_auto_dtype((6, 1)) == torch.float16


def test_dtypes_on_cpu():
    cpu = torch.device("cpu")
    assert resolve_dtype("float32", cpu) == torch.float32
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_dtype("auto", cpu) in (torch.float32, torch.bfloat16)
    assert resolve_dtype("float16", cpu) == torch.float16  # the fp16 path (autocast + scaler) runs on CPUs too
    assert resolve_inference_dtype("auto", cpu, weight_bytes=1000) == torch.float32  # small: overhead-bound
    assert resolve_inference_dtype(Dtype.bfloat16, cpu, 0) == resolve_dtype(Dtype.bfloat16, cpu) == torch.bfloat16


def test_auto_on_a_bf16_cpu_trains_small_updates_in_fp32_and_larger_ones_in_bf16(monkeypatch):
    from nanogpt_cli import device
    from nanogpt_cli.config import GPTConfig

    cpu = torch.device("cpu")
    toy = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=65)  # the tiny preset, 8 rows
    small = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=65)  # at the line: 8 rows, 157 MFLOP
    cpu_char = GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=65)
    assert device.update_flops(toy, 8) < device.update_flops(small, 8) < device.BF16_MIN_FLOPS
    assert device.update_flops(small, 16) > device.BF16_MIN_FLOPS  # more rows: more work per update
    monkeypatch.setattr(device, "cpu_has_bf16", lambda: True)
    assert resolve_dtype(Dtype.auto, cpu, toy, 8) == resolve_dtype(Dtype.auto, cpu, small, 8) == torch.float32
    assert resolve_dtype(Dtype.auto, cpu, small, 16) == resolve_dtype(Dtype.auto, cpu, cpu_char, 12) == torch.bfloat16
    assert resolve_dtype(Dtype.auto, cpu, cpu_char, 12, seq_len=2) == torch.float32  # --seq-len: the rows' tokens
    assert resolve_dtype(Dtype.auto, cpu) == torch.bfloat16  # no size given: the hardware decides
    assert resolve_dtype(Dtype.bfloat16, cpu, toy, 8) == torch.bfloat16  # a given dtype is kept
    monkeypatch.setattr(device, "cpu_has_bf16", lambda: False)
    assert resolve_dtype(Dtype.auto, cpu, cpu_char, 12) == torch.float32  # no native bf16: fp32 at any size


@pytest.mark.parametrize(
    "command", [["train"], ["sample", "--checkpoint", "x"], ["eval", "perplexity", "--checkpoint", "x"]]
)
def test_a_dtype_is_parsed_once_at_the_flag(command):
    from typer.testing import CliRunner

    from nanogpt_cli.cli import app

    result = CliRunner().invoke(app, [*command, "--dtype", "fp8"])
    assert result.exit_code != 0 and "'fp8' is not one of 'auto', 'float32', 'bfloat16', 'float16'" in result.output


def test_devices():
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(NanoGPTError, match="is not a device"):
        resolve_device("toaster")
    if not torch.cuda.is_available():
        with pytest.raises(NanoGPTError, match="sees no CUDA GPU"):
            resolve_device("cuda")


FAULTS = """
import ctypes, resource, sys, torch
from nanogpt_cli.device import M_MMAP_THRESHOLD, keep_freed_memory
torch.set_num_threads(1)
# glibc's default threshold adapts to the sizes freed, so a process may or may not map each tensor afresh
# (it varies from run to run with the heap's layout); fixed at its starting 128 KiB, every one is
ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 128 << 10)
if sys.argv[1] == "keep":
    assert keep_freed_memory()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):  # what an update does to its activations: the same sizes allocated and freed again
    a = torch.ones(1 << 20)
    b = torch.ones(1 << 20)
    c = a + b
    del c, b, a
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc settings")
def test_keeping_freed_memory_stops_tensors_faulting_their_pages_in_again():
    """Each fresh process allocates and frees three 4 MiB tensors 50 times: mapped afresh, each faults its 1,024
    pages in every round; after keep_freed_memory they come from the heap, and only the first round faults."""
    faults = {}
    for mode in ("mapped", "keep"):
        out = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, check=True)
        faults[mode] = int(out.stdout.split()[-1])
    assert faults["mapped"] > 50 * 3 * 1000 and faults["keep"] * 10 < faults["mapped"], faults


RELEASE = """
import os, torch
from nanogpt_cli.device import keep_freed_memory, release_freed_memory
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
assert keep_freed_memory()
blocks = [torch.ones(1 << 18) for _ in range(256)]  # 256 MiB in 1 MiB blocks, from the heap
held = rss()
del blocks  # freed: the heap keeps it, as keep_freed_memory asks
kept = rss()
release_freed_memory()
print(held, kept, rss())
"""


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_releasing_freed_memory_gives_back_what_keep_freed_memory_kept():
    out = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True, check=True)
    held, kept, released = (int(v) for v in out.stdout.split())
    assert kept > held - (32 << 20)  # freed but kept
    assert released < kept - (200 << 20)  # given back
