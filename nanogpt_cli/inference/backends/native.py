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
import time
from collections.abc import Sequence
from dataclasses import dataclass
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


def cpu_name() -> str | None:
    """The CPU's model name (Linux), or None."""
    line = next((x for x in cpu_flags().splitlines() if x.startswith("model name")), None)
    return None if line is None else line.split(":", 1)[1].strip()


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


MIRRORS = {"Linear": Linear, "Block": Block}  # the structs native.cpp shares, by its names


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
    lib.ng_layout.argtypes = [i64, *[ctypes.POINTER(ctypes.c_char_p)] * 2, *[ctypes.POINTER(i64)] * 2]
    lib.ng_layout.restype = cint
    lib.ng_linear.argtypes = [ptr, i64, ptr, ptr, ptr, cint, cint]
    lib.ng_linear.restype = cint
    lib.ng_decode.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, cint, cint, cint, ptr]
    lib.ng_decode.restype = cint
    if lib.ng_tile_rows() != TILE_ROWS:
        return f"tiles of {lib.ng_tile_rows()} rows, not {TILE_ROWS}"
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
    here against the layout the kernel reads (tiles: N padded to whole tiles of TILE_ROWS)."""

    def __init__(self, kind: int, w: torch.Tensor, N: int, K: int, bias=None, scale=None, zero=None, group=0):
        check_count("N", N)
        check_count("K", K)
        if kind not in (BF16, INT8, INT4):
            raise ValueError(f"kind must be BF16, INT8 or INT4, got {kind!r}")
        group = group if kind == INT4 else CHUNK
        if not takes(kind, K, group):
            raise ValueError(f"K ({K}) and group ({group}) are not a shape the kernels take")
        self.kind, self.N, self.K = kind, N, K
        rows = N + -N % TILE_ROWS
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
        linear(self, x, res, y, torch.get_num_threads())
        return y


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


class Blocks:
    """n_layer Block structs for ng_decode (one decode step of Llama-shaped pre-norm blocks), each layer's
    weights and tables checked as they are set, and the tensors they point at kept alive here. C: the width, H:
    the MLP's hidden size, S: the cache's positions per row."""

    def __init__(self, n_layer: int, C: int, nh: int, nkv: int, hs: int, H: int, S: int):
        for name, n in dict(n_layer=n_layer, C=C, nh=nh, nkv=nkv, hs=hs, H=H, S=S).items():
            check_count(name, n)
        if nh % nkv:
            raise ValueError(f"nh ({nh}) must be a multiple of nkv ({nkv})")
        if hs % 16 or hs > 512:
            raise ValueError(f"hs ({hs}) must be a multiple of 16 of at most 512")
        self.n_layer, self.C, self.nh, self.nkv, self.hs, self.H, self.S = n_layer, C, nh, nkv, hs, H, S
        self.structs = (Block * n_layer)()
        self.keep: list[list] = [[] for _ in range(n_layer)]
        self.set = [False] * n_layer

    def layer(self, i: int, qkv: Packed, proj: Packed, fc: Packed, down: Packed, ln1, ln2, eps1: float, eps2: float,
              cos, sin, q_norm=None, k_norm=None, eps_q: float = 0.0, eps_k: float = 0.0) -> None:  # fmt: skip
        """Layer i: its four products, RMSNorm gains ln1, ln2 (C,) float32, RoPE tables cos, sin (S, hs)
        float32, and QK-norm's gains (hs,) float32 or None."""
        if not 0 <= i < self.n_layer:
            raise ValueError(f"i must be a layer in 0..{self.n_layer - 1}, got {i}")
        C, nh, nkv, hs, H = self.C, self.nh, self.nkv, self.hs, self.H
        shapes = dict(qkv=(qkv, (nh + 2 * nkv) * hs, C), proj=(proj, C, nh * hs), fc=(fc, 2 * H, C), down=(down, C, H))
        for name, (p, N, K) in shapes.items():
            if not isinstance(p, Packed):
                raise ValueError(f"{name} must be a native.Packed, got {type(p).__name__}")
            if (p.N, p.K) != (N, K):
                raise ValueError(f"{name} must map {K} inputs to {N} outputs, got {p.K} to {p.N}")
        check("ln1", ln1, (torch.float32,), (C,))
        check("ln2", ln2, (torch.float32,), (C,))
        check("cos", cos, (torch.float32,), (self.S, hs))
        check("sin", sin, (torch.float32,), (self.S, hs))
        if (q_norm is None) != (k_norm is None):
            raise ValueError("q_norm and k_norm must be given together")
        if q_norm is not None:
            check("q_norm", q_norm, (torch.float32,), (hs,))
            check("k_norm", k_norm, (torch.float32,), (hs,))
        b = self.structs[i]
        b.qkv, b.proj, b.fc, b.down = qkv.struct, proj.struct, fc.struct, down.struct
        b.ln1, b.ln2, b.eps1, b.eps2 = ln1.data_ptr(), ln2.data_ptr(), eps1, eps2
        b.C, b.nh, b.nkv, b.hs, b.H, b.S = C, nh, nkv, hs, H, self.S
        b.cos, b.sin = cos.data_ptr(), sin.data_ptr()
        if q_norm is not None:
            b.q_norm, b.k_norm, b.eps_q, b.eps_k = q_norm.data_ptr(), k_norm.data_ptr(), eps_q, eps_k
        self.keep[i] = [qkv, proj, fc, down, ln1, ln2, cos, sin, q_norm, k_norm]
        self.set[i] = True


class Caches:
    """A cache's keys and values for ng_decode: ks[l] and vs[l] (rows, nkv, S, hs) for each of the blocks'
    layers, float32 or bf16, checked once and their pointers kept (a cache holds its tensors for its lifetime)."""

    def __init__(self, blocks: Blocks, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor]):
        if len(ks) != blocks.n_layer or len(vs) != blocks.n_layer:
            raise ValueError(f"ks and vs must hold {blocks.n_layer} layers, got {len(ks)} and {len(vs)}")
        self.dtype = ks[0].dtype if isinstance(ks[0], torch.Tensor) else None
        self.rows = ks[0].size(0) if isinstance(ks[0], torch.Tensor) else 0
        shape = (self.rows, blocks.nkv, blocks.S, blocks.hs)
        for name, ts in (("ks", ks), ("vs", vs)):
            for i, t in enumerate(ts):
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
    (one sequence's next tokens at consecutive positions, each seeing those before it)."""
    if not isinstance(blocks, Blocks):
        raise ValueError(f"blocks must be a native.Blocks, got {type(blocks).__name__}")
    if not all(blocks.set):
        raise ValueError(f"blocks must have every layer set; layer {blocks.set.index(False)} is not")
    if not isinstance(caches, Caches) or caches.blocks is not blocks:
        raise ValueError("caches must be a native.Caches made for these blocks")
    check("x", x, FLOATS, (None, blocks.C))
    B = x.size(0)
    if rows is None and not 1 <= B <= caches.rows:
        raise ValueError(f"x must have 1 to {caches.rows} rows (the cache's), got {B}")
    check("pos", pos, (torch.int64,), (B,))
    if rows is not None:
        check("rows", rows, (torch.int64,), (B,))
    check_count("threads", threads)
    if timers is not None:
        check("timers", timers, (torch.float64,), (3,))
    t = None if timers is None else timers.data_ptr()
    bf16, kv_bf16 = x.dtype == torch.bfloat16, caches.dtype == torch.bfloat16
    call = library()[0].ng_decode
    at = None if rows is None else rows.data_ptr()
    rc = call(blocks.structs, blocks.n_layer, B, x.data_ptr(), pos.data_ptr(), at, caches.rows, caches.ks, caches.vs,
              bf16, kv_bf16, threads, t)  # fmt: skip
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
