"""The decode step's matrix products on an x86 CPU in our own kernels (native.cpp), compiled on first use with the
machine's C++ compiler for the machine's own instructions and loaded through ctypes. A decode step reads every
weight once per token, so its speed is the weights' bytes over the memory's bandwidth, if the kernels keep up:

- bf16 weights meet bf16 rows in AVX512-BF16's dot products; int8 (a scale per row) and int4 (a scale and zero
  per group) meet the rows rounded to int8 in blocks of 32, as llama.cpp's q8_0 and q4_0 do, in VNNI's integer
  dot products, 16 weight rows at once, one in each lane (int8_tiles, int4_tiles);
- each weight is laid out in tiles of rows (pack, int8_tiles, int4_tiles), so that one product reads it as one
  stream: the hardware prefetchers follow one stream well and four short ones (four rows side by side) poorly;
- with more than one thread, a product's tiles and the attention's (row, key/value head) pairs are split over a
  small pool of threads (native.cpp's pool::run) in which the caller never waits for a worker that has not started
  on its share: where another process holds the other core, a step runs at one thread's speed rather than waiting
  a time slice at every product, as OpenMP's barriers did;
- decode runs a whole step of every block in one call (ng_decode): norms, RoPE, the cache write, attention and the
  MLP's activation included, for each block we load (pre-norm or parallel residual, RMSNorm or LayerNorm, gated
  or plain MLPs, post-norms, sliding windows), where torch would make ~20 calls a layer of a few microseconds each.

torch's kernels stay the fallback: no x86 (AVX2, FMA, F16C), no compiler, NANOGPT_NATIVE=0, or a shape the
kernels do not take. `status()` says which, in one line; `take_note()` the build's one note for the CLI (its time
and instruction set, or why it failed). NANOGPT_NATIVE_MARCH compiles for another instruction set than the
machine's (haswell: the AVX2 kernels, which the tests run too); NANOGPT_NATIVE_FLAGS adds compiler flags (the
tests' sanitizers).

The boundary is typed: each C entry point has one Python wrapper here (`linear`, `decode`, and the layout check
on loading) that checks every tensor's dtype, shape, contiguity and device before the call, so a wrong call is a
ValueError naming the argument, never a crash; the C side exports the offset and size of every field of the
structs it shares (ng_layout), and loading compares each with the ctypes mirrors below. The C code keeps no
mutable state of its own: the profile clock is the caller's buffer.

    lin = native.pack(weight, bias)          # a bf16 (N, K) nn.Linear weight in the tiled form, or None
    y = lin(x)                               # x (B, K) bf16 or float32 -> (B, N), in x's dtype
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("native.cpp")
BF16, INT8, INT4 = 0, 1, 2
TILE_ROWS = 4  # weight rows per tile (native.cpp's R)
INT4_ROWS = 16  # int4's and int8's rows per tile, one a 32-bit lane of a 512-bit register (native.cpp's R4)
CHUNK = 32  # inputs per chunk of a tile; int4 pairs two chunks in one byte each
FLAGS = ["-O3", "-pthread", "-shared", "-fPIC", "-std=c++17"]


def march() -> str:
    """The instruction set compiled for: the machine's own, or NANOGPT_NATIVE_MARCH's (haswell: AVX2 only)."""
    return os.environ.get("NANOGPT_NATIVE_MARCH", "native")


def flags() -> list[str]:
    """The compiler's flags: ours, the instruction set, and NANOGPT_NATIVE_FLAGS' (e.g. the sanitizers)."""
    return [*FLAGS, f"-march={march()}", *shlex.split(os.environ.get("NANOGPT_NATIVE_FLAGS", ""))]


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


class Norm(ctypes.Structure):
    _fields_ = [
        ("gain", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("eps", ctypes.c_float),
        ("layer", ctypes.c_int32),
    ]


class Block(ctypes.Structure):
    _fields_ = [
        ("qkv", Linear),
        ("proj", Linear),
        ("fc", Linear),
        ("down", Linear),
        ("ln1", Norm),
        ("ln2", Norm),
        ("q_norm", Norm),
        ("k_norm", Norm),
        ("post1", Norm),
        ("post2", Norm),
        ("C", ctypes.c_int64),
        ("nh", ctypes.c_int64),
        ("nkv", ctypes.c_int64),
        ("hs", ctypes.c_int64),
        ("H", ctypes.c_int64),
        ("S", ctypes.c_int64),
        ("act", ctypes.c_int64),
        ("parallel", ctypes.c_int64),
        ("rd", ctypes.c_int64),
        ("window", ctypes.c_int64),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
    ]


# the MLP activations the fused step computes, by config.MLP's names, as native.cpp's ACT_* numbers them
ACTIVATIONS = {"swiglu": 0, "geglu": 1, "gelu": 2, "gelu_tanh": 3, "relu2": 4}
GATED = ("swiglu", "geglu")  # c_fc's output: the gate half, then the up half


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


def cpu_name() -> str | None:
    """The CPU's model name (Linux), or None."""
    line = next((x for x in cpu_flags().splitlines() if x.startswith("model name")), None)
    return None if line is None else line.split(":", 1)[1].strip()


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


MIRRORS = {"Linear": Linear, "Norm": Norm, "Block": Block}  # the structs native.cpp shares, by its names


@dataclass
class Build:
    """What loading the kernels found: the library, or None and why not (line), where it is kept, and what to tell
    the user once (note): a build this process made, with its time and instruction set, or one that failed."""

    lib: ctypes.CDLL | None
    line: str
    path: Path | None = None
    note: str | None = None


@functools.cache
def build() -> Build:
    """The kernels' library, built once per source, compiler, flags and CPU (in cache_dir), or why not."""
    if os.environ.get("NANOGPT_NATIVE", "1") == "0":
        return Build(None, "off (NANOGPT_NATIVE=0)")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return Build(None, f"not built for {platform.machine()}: torch's kernels")
    cxx = compiler()
    if cxx is None:
        return Build(None, "no C++ compiler found (set CXX): torch's kernels")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return Build(None, f"the compiler {cxx} does not run ({e}): torch's kernels")
    args = flags()
    key = hashlib.sha256("\0".join([SOURCE.read_text(), cxx, version, *args, cpu_flags()]).encode()).hexdigest()
    path = cache_dir() / f"native-{key[:16]}.so"
    seconds = None
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                out = Path(tmp) / path.name
                start = time.perf_counter()
                done = subprocess.run([cxx, *args, str(SOURCE), "-o", str(out)], capture_output=True, text=True)
                seconds = time.perf_counter() - start
                if done.returncode != 0:
                    errors = [line for line in done.stderr.splitlines() if "error" in line]
                    why = (errors or done.stderr.strip().splitlines() or ["no output"])[-1].strip()
                    line = f"the kernels did not compile here ({why}): torch's kernels"
                    return Build(None, line, path, f"our decode kernels did not compile ({why}); torch's kernels run")
                os.replace(out, path)  # whole or not at all, for processes building at once
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        line = f"the kernels could not be built or loaded in {path.parent} ({e}): torch's kernels"
        return Build(None, line, path, f"our decode kernels could not be built or loaded ({e}); torch's kernels run")
    mismatch = check_library(lib)
    if mismatch is not None:
        return Build(None, f"the kernels' library does not match this package ({mismatch}): torch's kernels", path)
    isa = lib.ng_isa().decode()
    note = None
    if seconds is not None:
        note = f"built our decode kernels for {isa} in {seconds:.1f} s (kept in {path.parent})"
    return Build(lib, isa, path, note)


def check_library(lib: ctypes.CDLL) -> str | None:
    """Declare the C entry points' signatures; None where every shared struct's fields (offset and size) and
    sizes agree with the ctypes mirrors, else the first difference."""
    ptr, i64, cint = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.ng_isa.restype = ctypes.c_char_p
    lib.ng_tile_rows.restype = cint
    lib.ng_int4_rows.restype = cint
    lib.ng_layout.argtypes = [i64, *[ctypes.POINTER(ctypes.c_char_p)] * 2, *[ctypes.POINTER(i64)] * 2]
    lib.ng_layout.restype = cint
    lib.ng_linear.argtypes = [ptr, i64, ptr, ptr, ptr, cint, cint]
    lib.ng_linear.restype = cint
    lib.ng_dequantize.argtypes = [ptr, ptr, cint, cint]
    lib.ng_dequantize.restype = cint
    lib.ng_decode.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, cint, ptr, ptr, cint, cint, cint, ptr]
    lib.ng_decode.restype = cint
    if lib.ng_tile_rows() != TILE_ROWS or lib.ng_int4_rows() != INT4_ROWS:
        return f"tiles of {lib.ng_tile_rows()} and {lib.ng_int4_rows()} rows, not {TILE_ROWS} and {INT4_ROWS}"
    seen = set()
    for kind, name, offset, size in layout(lib):
        mirror = MIRRORS.get(kind)
        if mirror is None:
            return f"a struct {kind} with no mirror"
        seen.add((kind, name))
        if name == "":
            if ctypes.sizeof(mirror) != size:
                return f"{kind} is {size} bytes, its mirror {ctypes.sizeof(mirror)}"
            continue
        field = getattr(mirror, name, None)
        if not isinstance(field, type(Linear.w)):
            return f"{kind}.{name} is not in its mirror"
        if (field.offset, field.size) != (offset, size):
            return f"{kind}.{name} at {offset} ({size} bytes), its mirror at {field.offset} ({field.size} bytes)"
    for kind, mirror in MIRRORS.items():
        for name, *_ in mirror._fields_:
            if (kind, name) not in seen:
                return f"{kind}.{name} of the mirror is not in the library"
        if (kind, "") not in seen:
            return f"the library does not say {kind}'s size"
    return None


def layout(lib: ctypes.CDLL) -> list[tuple[str, str, int, int]]:
    """ng_layout's table: (struct, field, offset, size) for each shared field, field "" for the whole size."""
    rows = []
    kind, name, offset, size = ctypes.c_char_p(), ctypes.c_char_p(), ctypes.c_int64(), ctypes.c_int64()
    while lib.ng_layout(len(rows), *(ctypes.byref(v) for v in (kind, name, offset, size))):
        rows.append((kind.value.decode(), name.value.decode(), offset.value, size.value))
    return rows


def library() -> tuple[ctypes.CDLL | None, str]:
    """The kernels' library (built on first use), or None and why not."""
    b = build()
    return b.lib, b.line


_told = False


def take_note() -> str | None:
    """What the CLI says once per process about the kernels' build: the time and instruction set of a build this
    process made, or the one line of a failed one; None otherwise, or when told already. Builds nothing."""
    global _told
    if _told or build.cache_info().currsize == 0:
        return None
    _told = True
    return build().note


def available() -> bool:
    return library()[0] is not None


def status() -> str:
    """One line: the kernels' instruction set, or why torch's kernels run instead."""
    lib, why = library()
    return f"ours ({why})" if lib is not None else why


def tiles(t: torch.Tensor, width: int, rows: int = TILE_ROWS) -> torch.Tensor:
    """(N, W) -> the tiled order native.cpp reads: N padded to whole tiles of `rows` with zero rows, then for each
    tile and each run of `width` columns the tile's rows' runs one after another, (N / rows, W / width, rows,
    width)."""
    N, W = t.shape
    pad = -N % rows
    if pad:
        t = torch.cat([t, t.new_zeros(pad, W)])
    return t.reshape(-1, rows, W // width, width).permute(0, 2, 1, 3).contiguous()


def untile(t: torch.Tensor, N: int) -> torch.Tensor:
    """tiles' inverse: (N / R, W / width, R, width) -> (N, W)."""
    T, runs, R, width = t.shape
    return t.permute(0, 2, 1, 3).reshape(T * R, runs * width)[:N]


def tile_rows(kind: int) -> int:
    """The weight rows of one of kind's tiles: bf16 TILE_ROWS, int8 and int4 INT4_ROWS."""
    return TILE_ROWS if kind == BF16 else INT4_ROWS


def takes(kind: int, K: int, group: int = CHUNK) -> bool:
    """Whether the kernels take a weight of K inputs (int4: in groups of `group`)."""
    if kind == INT4:
        return K % (2 * CHUNK) == 0 and group > 0 and group % CHUNK == 0 and K % group == 0
    return K % CHUNK == 0


def check(
    name: str, t, dtypes: tuple[torch.dtype, ...], shape: tuple[int | None, ...] | None = None, numel: int | None = None
) -> None:
    """A ValueError naming the argument unless t is a contiguous CPU tensor of one of dtypes, of shape (None: any
    size there) or of numel values in whatever shape: what a pointer handed to native.cpp must be."""
    if type(t) is torch.Tensor and t.is_cpu and t.dtype in dtypes and t.is_contiguous():  # the common case, fast
        if (shape is None or t.shape == shape or fits(t.shape, shape)) and (numel is None or t.numel() == numel):
            return
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if shape is not None and not fits(t.shape, shape):
        want = ", ".join("any" if n is None else str(n) for n in shape)
        raise ValueError(f"{name} must have shape ({want}), got {tuple(t.shape)}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} must hold {numel} values, got {t.numel()}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def fits(got: torch.Size, shape: tuple[int | None, ...]) -> bool:
    return len(got) == len(shape) and all(n is None or n == m for n, m in zip(shape, got))


def check_count(name: str, n, low: int = 1) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < low:
        raise ValueError(f"{name} must be an int of at least {low}, got {n!r}")


FLOATS = (torch.float32, torch.bfloat16)


class Packed:
    """One weight in the kernels' tiled form with what goes with it, and the product: x (B, K) -> (B, N) in x's
    dtype (float32 or bf16), plus res (B, N) when given. The tensors it holds stay alive with it; each is checked
    here against the layout the kernel reads (tiles: N padded to whole tiles of tile_rows(kind))."""

    def __init__(self, kind: int, w: torch.Tensor, N: int, K: int, bias=None, scale=None, zero=None, group=0):
        check_count("N", N)
        check_count("K", K)
        if kind not in (BF16, INT8, INT4):
            raise ValueError(f"kind must be BF16, INT8 or INT4, got {kind!r}")
        group = group if kind == INT4 else CHUNK
        if not takes(kind, K, group):
            raise ValueError(f"K ({K}) and group ({group}) are not a shape the kernels take")
        self.kind, self.N, self.K = kind, N, K
        rows = N + -N % tile_rows(kind)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        if self.bias is not None:
            check("bias", self.bias, (torch.float32,), (N,))
        if kind == BF16:
            check("w", w, (torch.bfloat16,), numel=rows * K)
        elif kind == INT8:
            check("w", w, (torch.int8,), numel=rows * K)
            check("scale", scale, (torch.float32,), (rows,))
        else:
            check("w", w, (torch.uint8,), numel=rows * K // 2)
            check("scale", scale, (torch.float16,), numel=rows * K // group)
            check("zero", zero, (torch.float16,), numel=rows * K // group)
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
        if x.dtype not in FLOATS:  # float16: the kernels read float32 or bf16 only
            return self(x.float(), None if res is None else res.float()).to(x.dtype)
        x = x.contiguous()
        if res is not None:  # held here: the kernel reads it after this line
            res = res.to(x.dtype).contiguous()
        y = torch.empty(x.size(0), self.N, dtype=x.dtype)
        linear(self, x, res, y, kernel_threads())
        return y


# Our calls' threads apart from torch's. While an engine decodes on a CPU (torch_alone), torch's own ops between
# our calls (the logits' copy, the pick, a norm) run on one thread and our calls on the threads torch had: each of
# torch's parallel regions there woke a sleeping thread or left one spinning on the core our pool wanted, so that a
# 135M model's bf16 step took longer at 2 threads than at 1 (benchmarks/README.md). Per Python thread, as torch's
# own count is.
_held = threading.local()


def kernel_threads() -> int:
    """The threads our kernels split a call over: torch's count, or the one torch_alone() set aside."""
    return getattr(_held, "threads", 0) or torch.get_num_threads()


@contextmanager
def torch_alone() -> Iterator[None]:
    """Inside: torch's ops on one thread, ours on the threads torch had (kernel_threads)."""
    n = kernel_threads()
    if n == 1 or getattr(_held, "threads", 0):  # nothing to set aside, or set aside already
        yield
        return
    _held.threads = n
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
        _held.threads = 0


@contextmanager
def torch_threads() -> Iterator[None]:
    """Inside torch_alone(): torch's threads back for its own large work (a prefill's products)."""
    n = getattr(_held, "threads", 0)
    if not n:
        yield
        return
    _held.threads = 0
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(1)
        _held.threads = n


def linear(weight: Packed, x: torch.Tensor, res: torch.Tensor | None, y: torch.Tensor, threads: int) -> None:
    """ng_linear: y (B, N) = x (B, K) @ W.T (+ bias) (+ res), x, res and y of one dtype (float32 or bf16)."""
    if not isinstance(weight, Packed):
        raise ValueError(f"weight must be a native.Packed, got {type(weight).__name__}")
    B = x.size(0) if isinstance(x, torch.Tensor) and x.dim() == 2 else None
    check("x", x, FLOATS, (B, weight.K))
    if B < 1:
        raise ValueError("x must have at least one row")
    if res is not None:
        check("res", res, (x.dtype,), (B, weight.N))
    check("y", y, (x.dtype,), (B, weight.N))
    if type(threads) is not int or threads < 1:
        check_count("threads", threads)
    r = None if res is None else res.data_ptr()
    rc = weight.call(weight.ref, B, x.data_ptr(), r, y.data_ptr(), x.dtype == torch.bfloat16, threads)
    if rc == 2:
        raise MemoryError("the kernel's product ran out of memory")
    assert rc == 0, f"ng_linear refused a checked call ({rc})"


def dequantize(weight: Packed, dtype: torch.dtype, threads: int) -> torch.Tensor:
    """ng_dequantize: an int4 weight's values (N, K) in dtype (float32 or bf16), as a prefill multiplies them."""
    if not isinstance(weight, Packed) or weight.kind != INT4:
        raise ValueError("weight must be an int4 native.Packed")
    if dtype not in FLOATS:
        raise ValueError(f"dtype must be {' or '.join(map(str, FLOATS))}, got {dtype}")
    check_count("threads", threads)
    out = torch.empty(weight.N, weight.K, dtype=dtype)
    rc = library()[0].ng_dequantize(weight.ref, out.data_ptr(), dtype == torch.bfloat16, threads)
    assert rc == 0, f"ng_dequantize refused a checked call ({rc})"
    return out


@dataclass(frozen=True)
class NormWeights:
    """One norm as ng_decode computes it: gain (n,) float32 (an offset norm's 1 + w added already), LayerNorm's
    bias (n,) float32 or None, its epsilon, and whether it is a LayerNorm (else an RMSNorm). Frozen, as Layer is:
    the Block structs hold its tensors' pointers."""

    gain: torch.Tensor
    bias: torch.Tensor | None
    eps: float
    layer: bool = False


@dataclass(frozen=True)
class Layer:
    """One block for ng_decode: its four products, its norms, its MLP's activation (one of ACTIVATIONS) and its
    attention's choices. cos, sin: RoPE's tables (S, rd) float32 for the first rd dimensions of each head, this
    layer's own (a local layer's base), or None for no RoPE; window: a sliding-window layer's ring of that many
    slots in the cache (KVCache's), 0 for a cache of S positions."""

    qkv: Packed
    proj: Packed
    fc: Packed
    down: Packed
    ln1: NormWeights
    ln2: NormWeights
    act: str = "swiglu"
    parallel: bool = False  # the MLP reads the block's input (GPT-NeoX)
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    q_norm: NormWeights | None = None  # QK-norm, (hs,) each
    k_norm: NormWeights | None = None
    post1: NormWeights | None = None  # each sub-block's output normed before its add (Gemma 3), (C,) each
    post2: NormWeights | None = None
    window: int = 0


class Blocks:
    """n_layer Block structs for ng_decode (one decode step of the blocks), each layer checked as it is set and
    the tensors it points at kept alive here. C: the width, H: the MLP's hidden size, S: the context's positions,
    the cache's per row (a ring layer's window fewer)."""

    def __init__(self, n_layer: int, C: int, nh: int, nkv: int, hs: int, H: int, S: int):
        for name, n in dict(n_layer=n_layer, C=C, nh=nh, nkv=nkv, hs=hs, H=H, S=S).items():
            check_count(name, n)
        if nh % nkv:
            raise ValueError(f"nh ({nh}) must be a multiple of nkv ({nkv})")
        if hs % 16 or hs > 512:
            raise ValueError(f"hs ({hs}) must be a multiple of 16 of at most 512")
        self.n_layer, self.C, self.nh, self.nkv, self.hs, self.H, self.S = n_layer, C, nh, nkv, hs, H, S
        self.structs = (Block * n_layer)()
        self.keep: list[Layer | None] = [None] * n_layer
        self.set = [False] * n_layer
        self.slots = [S] * n_layer  # each layer's cache positions per row in a ring cache (a window's fewer)

    def layer(self, i: int, layer: Layer) -> None:
        """Set layer i, each of its tensors checked against the shape ng_decode reads."""
        if not 0 <= i < self.n_layer:
            raise ValueError(f"i must be a layer in 0..{self.n_layer - 1}, got {i}")
        if not isinstance(layer, Layer):
            raise ValueError(f"layer must be a native.Layer, got {type(layer).__name__}")
        C, nh, nkv, hs, H, S, L = self.C, self.nh, self.nkv, self.hs, self.H, self.S, layer
        if L.act not in ACTIVATIONS:
            raise ValueError(f"act must be one of {', '.join(ACTIVATIONS)}, got {L.act!r}")
        fc_out = 2 * H if L.act in GATED else H
        shapes = dict(qkv=((nh + 2 * nkv) * hs, C), proj=(C, nh * hs), fc=(fc_out, C), down=(C, H))
        for name, (N, K) in shapes.items():
            p = getattr(L, name)
            if not isinstance(p, Packed):
                raise ValueError(f"{name} must be a native.Packed, got {type(p).__name__}")
            if (p.N, p.K) != (N, K):
                raise ValueError(f"{name} must map {K} inputs to {N} outputs, got {p.K} to {p.N}")
        norms = dict(ln1=C, ln2=C, q_norm=hs, k_norm=hs, post1=C, post2=C)
        for name, n in norms.items():
            check_norm(name, getattr(L, name), n, required=name in ("ln1", "ln2"))
        for a, b in (("q_norm", "k_norm"), ("post1", "post2"), ("cos", "sin")):
            if (getattr(L, a) is None) != (getattr(L, b) is None):
                raise ValueError(f"{a} and {b} must be given together")
        rd = 0
        if L.cos is not None:
            check("cos", L.cos, (torch.float32,), (S, None))  # a tensor of S rows, whose columns say rd
            rd = L.cos.size(-1)
            if not 2 <= rd <= hs or rd % 2:
                raise ValueError(f"cos must have an even number of columns from 2 to {hs}, got {rd}")
            check("cos", L.cos, (torch.float32,), (S, rd))
            check("sin", L.sin, (torch.float32,), (S, rd))
        if not isinstance(L.window, int) or not 0 <= L.window <= S:
            raise ValueError(f"window must be an int from 0 to {S}, got {L.window!r}")
        b = self.structs[i]
        b.qkv, b.proj, b.fc, b.down = L.qkv.struct, L.proj.struct, L.fc.struct, L.down.struct
        for name in norms:
            setattr(b, name, norm_struct(getattr(L, name)))
        b.C, b.nh, b.nkv, b.hs, b.H, b.S = C, nh, nkv, hs, H, S
        b.act, b.parallel, b.rd, b.window = ACTIVATIONS[L.act], int(bool(L.parallel)), rd, L.window
        b.cos, b.sin = (None, None) if L.cos is None else (L.cos.data_ptr(), L.sin.data_ptr())
        self.keep[i], self.set[i], self.slots[i] = L, True, L.window or S  # L is frozen: its tensors stay alive

    def cache_slots(self, ring: bool) -> list[int]:
        """Each layer's positions per row in a cache whose windowed layers are rings (ring) or hold every
        position (a speculative engine's, whose rows roll back)."""
        return list(self.slots) if ring else [self.S] * self.n_layer


def check_norm(name: str, norm: NormWeights | None, n: int, required: bool) -> None:
    if norm is None and not required:
        return
    if not isinstance(norm, NormWeights):
        raise ValueError(f"{name} must be a native.NormWeights, got {type(norm).__name__}")
    check(f"{name}.gain", norm.gain, (torch.float32,), (n,))
    if norm.bias is not None:
        check(f"{name}.bias", norm.bias, (torch.float32,), (n,))
    if not isinstance(norm.eps, float) or not norm.eps > 0:
        raise ValueError(f"{name}.eps must be a positive float, got {norm.eps!r}")


def norm_struct(norm: NormWeights | None) -> Norm:
    if norm is None:
        return Norm()  # a null gain: no norm there
    bias = None if norm.bias is None else norm.bias.data_ptr()
    return Norm(norm.gain.data_ptr(), bias, norm.eps, int(norm.layer))


class Caches:
    """A cache's keys and values for ng_decode: ks[l] and vs[l] (rows, nkv, slots, hs) for each of the blocks'
    layers, float32 or bf16, checked once and their pointers kept (a cache holds its tensors for its lifetime).
    slots: a windowed layer's window where its cache is a ring (KVCache's), or S where every layer holds every
    position (KVCache(ring=False)); the tensors say which, and ring is whether the windowed layers are rings."""

    def __init__(self, blocks: Blocks, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor]):
        if len(ks) != blocks.n_layer or len(vs) != blocks.n_layer:
            raise ValueError(f"ks and vs must hold {blocks.n_layer} layers, got {len(ks)} and {len(vs)}")
        self.dtype = ks[0].dtype if isinstance(ks[0], torch.Tensor) else None
        self.rows = ks[0].size(0) if isinstance(ks[0], torch.Tensor) else 0
        held = [k.size(2) if isinstance(k, torch.Tensor) and k.dim() == 4 else None for k in ks]
        self.ring = held == blocks.cache_slots(True)  # else every layer must hold S
        self.slots = blocks.cache_slots(
            self.ring
        )  # what the tensors are checked against: a layer set again may change it
        for name, ts in (("ks", ks), ("vs", vs)):
            for i, t in enumerate(ts):
                shape = (self.rows, blocks.nkv, self.slots[i], blocks.hs)
                check(f"{name}[{i}]", t, (self.dtype,) if self.dtype in FLOATS else FLOATS, shape)
        self.blocks, self.keep = blocks, (list(ks), list(vs))
        kinds = ctypes.c_void_p * blocks.n_layer
        self.ks, self.vs = kinds(*(k.data_ptr() for k in ks)), kinds(*(v.data_ptr() for v in vs))


def decode(
    blocks: Blocks, caches: Caches, x: torch.Tensor, pos: torch.Tensor, threads: int, timers=None, rows=None
) -> None:
    """ng_decode: one step of every block for B rows, x (B, C) the residual stream (float32 or bf16) in and out,
    pos (B,) int64 each row's position, which its new key and value take in caches; timers: the caller's profile
    clock, a float64 tensor (3,) that the step's seconds in its products, its attention and in all are added to,
    or None. rows: (B,) int64, the cache row of each of x's rows (None: row b), several of which may share one
    (one sequence's next tokens at consecutive positions, each seeing those before it) where no layer is a ring."""
    if not isinstance(blocks, Blocks):
        raise ValueError(f"blocks must be a native.Blocks, got {type(blocks).__name__}")
    if not all(blocks.set):
        raise ValueError(f"blocks must have every layer set; layer {blocks.set.index(False)} is not")
    if not isinstance(caches, Caches) or caches.blocks is not blocks or caches.slots != blocks.cache_slots(caches.ring):
        raise ValueError("caches must be a native.Caches made for these blocks as they are now")
    check("x", x, FLOATS, (None, blocks.C))
    B = x.size(0)
    if rows is None and not 1 <= B <= caches.rows:
        raise ValueError(f"x must have 1 to {caches.rows} rows (the cache's), got {B}")
    check("pos", pos, (torch.int64,), (B,))
    if rows is not None:
        check("rows", rows, (torch.int64,), (B,))
        if caches.ring and blocks.slots != [blocks.S] * blocks.n_layer and len(set(rows.tolist())) < B:
            raise ValueError("rows may share a cache row only in a cache without rings (a later key overwrites one)")
    check_count("threads", threads)
    if timers is not None:
        check("timers", timers, (torch.float64,), (3,))
    t = None if timers is None else timers.data_ptr()
    bf16, kv_bf16 = x.dtype == torch.bfloat16, caches.dtype == torch.bfloat16
    call = library()[0].ng_decode
    at = None if rows is None else rows.data_ptr()
    rc = call(blocks.structs, blocks.n_layer, B, x.data_ptr(), pos.data_ptr(), at, caches.rows, caches.ring, caches.ks,
              caches.vs, bf16, kv_bf16, threads, t)  # fmt: skip
    if rc == 3:
        raise ValueError(
            f"pos must be positions in the cache, 0 to {blocks.S - 1}, and rows its rows, 0 to {caches.rows - 1}; got "
            f"{pos.tolist()} and {None if rows is None else rows.tolist()}"
        )
    if rc == 2:
        raise MemoryError("the fused decode step ran out of memory")
    assert rc == 0, f"ng_decode refused a checked call ({rc})"


def pack(w: torch.Tensor, bias: torch.Tensor | None = None) -> Packed | None:
    """A bf16 weight (N, K) on a CPU in the tiled form (a copy: the weight's bytes once more), or None where the
    kernels do not apply."""
    if w.dtype != torch.bfloat16 or w.device.type != "cpu" or not available() or not takes(BF16, w.size(1)):
        return None
    return Packed(BF16, tiles(w.detach(), CHUNK), w.size(0), w.size(1), bias)


def pack_int8(q_tiles: torch.Tensor, scale: torch.Tensor, N: int, K: int, bias=None) -> Packed:
    """int8 values already in the tiled order (int8_tiles, QuantizedLinear's), one scale per row."""
    s = scale.detach().float()
    s = torch.cat([s, s.new_zeros(-N % tile_rows(INT8))]).contiguous()
    return Packed(INT8, q_tiles, N, K, bias, scale=s)


def pack_int4(nibbles: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, N: int, K: int, group: int, bias=None):
    """int4 values in the tiled order with their scales and zeros (N / R, K / group, R), made fp16 here."""
    return Packed(
        INT4, nibbles, N, K, bias, scale=scale.half().contiguous(), zero=zero.half().contiguous(), group=group
    )


def int8_tiles(q: torch.Tensor) -> torch.Tensor:
    """int8 values (N, K) -> the int8 kernel's order (N / 16, K / 4, 16, 4), N padded to whole tiles of INT4_ROWS
    with zero rows: for each tile, each run of 4 inputs, the 16 rows' 4 bytes (a row's in one 32-bit lane)."""
    return tiles(q, 4, INT4_ROWS)


def int8_untiled(t: torch.Tensor, N: int) -> torch.Tensor:
    """int8_tiles' inverse, (N, K): a row's 4 bytes of a run moved as one int32 (a prefill dequantizes every weight,
    and a permute of single bytes is several times slower)."""
    T, runs = t.shape[:2]
    lanes = t.view(torch.int32).view(T, runs, INT4_ROWS).transpose(1, 2)
    return lanes.reshape(T * INT4_ROWS, runs)[:N].contiguous().view(torch.int8)  # one tile: reshape is a view


def int4_tiles(q: torch.Tensor) -> torch.Tensor:
    """4-bit values (N, K) in 0..15 -> the int4 kernel's bytes (N / 16, K / 32, 4, 16, 4), N padded to whole tiles
    of INT4_ROWS with zero rows: for each tile and block of 32 inputs, four runs j of 16 rows x 4 bytes, byte m of
    row i holding input 8j + m of the block in its low nibble and input 8j + 4 + m in its high one."""
    N, K = q.shape
    q = q.to(torch.uint8)
    if N % INT4_ROWS:
        q = torch.cat([q, q.new_zeros(-N % INT4_ROWS, K)])
    v = q.view(-1, INT4_ROWS, K // 32, 4, 2, 4)  # (tile, row i, block, run j, low/high, byte m)
    v = v.permute(0, 2, 3, 1, 5, 4)  # (tile, block, j, i, m, low/high)
    return (v[..., 0] | (v[..., 1] << 4)).contiguous()
