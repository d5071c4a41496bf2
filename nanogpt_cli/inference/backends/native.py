"""The decode step's matrix products on an x86 CPU in our own kernels (native.cpp), compiled on first use with the
machine's C++ compiler for the machine's own instructions and loaded through ctypes. A decode step reads every
weight once per token, so its speed is the weights' bytes over the memory's bandwidth, if the kernels keep up:

- bf16 weights meet bf16 rows in AVX512-BF16's dot products; int8 (a scale per row) turn into bf16 or float32 in
  registers; int4 (a scale and zero per group) meet the rows rounded to int8 in blocks of 32, as llama.cpp's
  q4_0 does, in VNNI's integer dot products;
- each weight is laid out in tiles of TILE_ROWS rows (pack), so that one product reads it as one stream: the
  hardware prefetchers follow one stream well and four short ones (four rows side by side) poorly;
- decode runs a whole step of a Llama-shaped model's blocks in one call (DecodeBlocks), norms, RoPE, the cache
  write and attention included, where torch would make ~20 calls a layer of a few microseconds each.

torch's kernels stay the fallback: no x86 (AVX2, FMA, F16C), no compiler, NANOGPT_NATIVE=0, or a shape the
kernels do not take. `status()` says which, in one line. NANOGPT_NATIVE_MARCH compiles for another instruction set
than the machine's (haswell: the AVX2 kernels, which the tests run too).

    lin = native.pack(weight, bias)          # a bf16 (N, K) nn.Linear weight in the tiled form, or None
    y = lin(x)                               # x (B, K) bf16 or float32 -> (B, N), in x's dtype
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("native.cpp")
BF16, INT8, INT4 = 0, 1, 2
TILE_ROWS = 4  # weight rows per tile (native.cpp's R)
CHUNK = 32  # inputs per chunk of a tile; int4 pairs two chunks in one byte each
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]


def march() -> str:
    """The instruction set compiled for: the machine's own, or NANOGPT_NATIVE_MARCH's (haswell: AVX2 only)."""
    return os.environ.get("NANOGPT_NATIVE_MARCH", "native")


class Linear(ctypes.Structure):
    _fields_ = [
        ("w", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("scale4", ctypes.c_void_p),
        ("zero4", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("kind", ctypes.c_int64),
        ("N", ctypes.c_int64),
        ("K", ctypes.c_int64),
        ("group", ctypes.c_int64),
    ]


class Block(ctypes.Structure):
    _fields_ = [
        ("qkv", Linear),
        ("proj", Linear),
        ("fc", Linear),
        ("down", Linear),
        ("ln1", ctypes.c_void_p),
        ("ln2", ctypes.c_void_p),
        ("eps1", ctypes.c_float),
        ("eps2", ctypes.c_float),
        ("C", ctypes.c_int64),
        ("nh", ctypes.c_int64),
        ("nkv", ctypes.c_int64),
        ("hs", ctypes.c_int64),
        ("H", ctypes.c_int64),
        ("S", ctypes.c_int64),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("eps_q", ctypes.c_float),
        ("eps_k", ctypes.c_float),
    ]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "nanogpt" / "native"


def cpu_flags() -> str:
    """The CPU's model and feature flags (Linux), part of the build's key: -march=native compiles for them."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
    return "\n".join(keep)


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


@functools.cache
def library() -> tuple[ctypes.CDLL | None, str]:
    """The kernels' library, built once per source, compiler and CPU (in cache_dir), or None and why not."""
    if os.environ.get("NANOGPT_NATIVE", "1") == "0":
        return None, "off (NANOGPT_NATIVE=0)"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"not built for {platform.machine()}: torch's kernels"
    cxx = compiler()
    if cxx is None:
        return None, "no C++ compiler found (set CXX): torch's kernels"
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"the compiler {cxx} does not run ({e}): torch's kernels"
    flags = [*FLAGS, f"-march={march()}"]
    key = hashlib.sha256("\0".join([SOURCE.read_text(), cxx, version, *flags, cpu_flags()]).encode()).hexdigest()
    path = cache_dir() / f"native-{key[:16]}.so"
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                out = Path(tmp) / path.name
                done = subprocess.run([cxx, *flags, str(SOURCE), "-o", str(out)], capture_output=True, text=True)
                if done.returncode != 0:
                    why = (done.stderr.strip().splitlines() or ["no output"])[-1]
                    return None, f"the kernels did not compile here ({why}): torch's kernels"
                os.replace(out, path)  # whole or not at all, for processes building at once
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return None, f"the kernels could not be built or loaded in {path.parent} ({e}): torch's kernels"
    lib.ng_isa.restype = ctypes.c_char_p
    lib.ng_sizeof_block.restype = ctypes.c_int64
    if lib.ng_tile_rows() != TILE_ROWS or lib.ng_sizeof_block() != ctypes.sizeof(Block):
        return None, "the kernels' library does not match this package: torch's kernels"
    ptr, i64, cint = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.ng_linear.argtypes = [ptr, i64, ptr, ptr, ptr, cint, cint]
    lib.ng_decode.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, cint, cint, cint]
    return lib, lib.ng_isa().decode()


def available() -> bool:
    return library()[0] is not None


def status() -> str:
    """One line: the kernels' instruction set, or why torch's kernels run instead."""
    lib, why = library()
    return f"ours ({why})" if lib is not None else why


def tiles(t: torch.Tensor, width: int) -> torch.Tensor:
    """(N, W) -> the tiled order native.cpp reads: N padded to whole tiles with zero rows, then for each tile and
    each run of `width` columns the tile's rows' runs one after another, (N / R, W / width, R, width)."""
    N, W = t.shape
    pad = -N % TILE_ROWS
    if pad:
        t = torch.cat([t, t.new_zeros(pad, W)])
    return t.reshape(-1, TILE_ROWS, W // width, width).permute(0, 2, 1, 3).contiguous()


def untile(t: torch.Tensor, N: int) -> torch.Tensor:
    """tiles' inverse: (N / R, W / width, R, width) -> (N, W)."""
    T, runs, R, width = t.shape
    return t.permute(0, 2, 1, 3).reshape(T * R, runs * width)[:N]


def takes(kind: int, K: int, group: int = CHUNK) -> bool:
    """Whether the kernels take a weight of K inputs (int4: in groups of `group`)."""
    if kind == INT4:
        return K % (2 * CHUNK) == 0 and group % CHUNK == 0 and K % group == 0
    return K % CHUNK == 0


class Packed:
    """One weight in the kernels' tiled form with what goes with it, and the product: x (B, K) -> (B, N) in x's
    dtype (float32 or bf16), plus res (B, N) when given. The tensors it holds stay alive with it."""

    def __init__(self, kind: int, w: torch.Tensor, N: int, K: int, bias=None, scale=None, zero=None, group=0):
        self.kind, self.N, self.K = kind, N, K
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.keep = (w, scale, zero)
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        self.struct = Linear(ptr(w), None, None, None, ptr(self.bias), kind, N, K, group)
        if kind == INT8:
            self.struct.scale = ptr(scale)
        elif kind == INT4:
            self.struct.scale4, self.struct.zero4 = ptr(scale), ptr(zero)
        self.ref = ctypes.byref(self.struct)
        self.call = library()[0].ng_linear

    def __call__(self, x: torch.Tensor, res: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype not in (torch.float32, torch.bfloat16):  # float16: the kernels read float32 or bf16 only
            return self(x.float(), None if res is None else res.float()).to(x.dtype)
        if x.dim() != 2 or x.size(1) != self.K:
            raise ValueError(f"expected rows of {self.K} inputs, got a tensor of shape {tuple(x.shape)}")
        x = x.contiguous()
        B = x.size(0)
        if res is not None:  # held here: the kernel reads it after this line
            res = res.to(x.dtype).contiguous()
            if res.shape != (B, self.N):
                raise ValueError(f"expected a residual of shape {(B, self.N)}, got {tuple(res.shape)}")
        y = torch.empty(B, self.N, dtype=x.dtype)
        r = None if res is None else res.data_ptr()
        self.call(self.ref, B, x.data_ptr(), r, y.data_ptr(), x.dtype == torch.bfloat16, torch.get_num_threads())
        return y


def pack(w: torch.Tensor, bias: torch.Tensor | None = None) -> Packed | None:
    """A bf16 weight (N, K) on a CPU in the tiled form (a copy: the weight's bytes once more), or None where the
    kernels do not apply."""
    if w.dtype != torch.bfloat16 or w.device.type != "cpu" or not available() or not takes(BF16, w.size(1)):
        return None
    return Packed(BF16, tiles(w.detach(), CHUNK), w.size(0), w.size(1), bias)


def pack_int8(q_tiles: torch.Tensor, scale: torch.Tensor, N: int, K: int, bias=None) -> Packed:
    """int8 values already in the tiled order (QuantizedLinear's), one scale per row."""
    s = scale.detach().float()
    s = torch.cat([s, s.new_zeros(-N % TILE_ROWS)]).contiguous()
    return Packed(INT8, q_tiles, N, K, bias, scale=s)


def pack_int4(nibbles: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, N: int, K: int, group: int, bias=None):
    """int4 values in the tiled order with their scales and zeros (N / R, K / group, R), made fp16 here."""
    return Packed(
        INT4, nibbles, N, K, bias, scale=scale.half().contiguous(), zero=zero.half().contiguous(), group=group
    )


def int4_nibbles(q: torch.Tensor) -> torch.Tensor:
    """4-bit values (N, K) in 0..15 -> the kernels' bytes (N, K / 2): per 64 inputs, 32 bytes, input j of the first
    32 in byte j's low nibble and input j of the next 32 in its high one."""
    N, K = q.shape
    pairs = q.to(torch.uint8).view(N, K // 64, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(N, K // 2)


def int4_values(nibbles: torch.Tensor) -> torch.Tensor:
    """int4_nibbles' inverse: (N, K / 2) bytes -> (N, K) values in 0..15."""
    N, half = nibbles.shape
    b = nibbles.view(N, half // 32, 1, 32)
    return torch.cat([b & 15, b >> 4], dim=2).reshape(N, 2 * half)
