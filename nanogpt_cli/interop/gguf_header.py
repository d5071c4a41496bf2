"""A GGUF file's header: its metadata and its tensor table, every count, length and size checked against the
file's length before anything is read or allocated, so that a damaged or hostile file is one sentence.

    header = read_header(Path("model.gguf"))   # header.fields["general.architecture"], header.tensors[0].name

The gguf package's GGUFReader trusts each count it reads (a flipped bit in a count can make it loop or allocate
for minutes) and wraps every value, each of a vocabulary's tens of thousands of tokens too, in numpy views:
seconds for a real model's header. This reads the same layout (GGUF versions 2 and 3, little-endian) with plain
struct unpacking; the format's constants, the tensor types' block sizes and the dequantization stay the gguf
package's.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nanogpt_cli.errors import NanoGPTError

MAGIC = b"GGUF"
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
# a value type -> its struct format (scalars), in GGUF's numbering (gguf.GGUFValueType)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
# the smallest number of bytes one value of a type takes: bounds a count before the values are read
SMALLEST = {**{t: struct.calcsize("<" + f) for t, f in SCALARS.items()}, STRING: 8, ARRAY: 12}
# tensor types held as plain numbers (numpy dtypes); the others are raw blocks of bytes
PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16}
PLAIN |= {"I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    """One entry of the tensor table, as GGUFReader names its parts."""

    name: str
    shape: tuple[int, ...]  # ggml's order: the row length first (PyTorch's shape reversed)
    tensor_type: Any  # a gguf.GGMLQuantizationType
    data_offset: int  # in the file
    n_bytes: int

    @property
    def dims(self) -> tuple[int, ...]:
        """The shape in PyTorch's (out, in) order."""
        return tuple(reversed(self.shape))

    @property
    def data_dtype(self):
        return PLAIN.get(self.tensor_type.name, np.uint8)

    @property
    def data_shape(self) -> tuple[int, ...]:
        """The shape of its data as GGUFReader holds it: the values, or each row's bytes for blocks."""
        import gguf

        if self.tensor_type.name in PLAIN:
            return self.dims
        return tuple(gguf.quant_shape_to_byte_shape(self.dims, self.tensor_type))


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    fields: dict[str, Any]  # every key -> its value (str, int, float, bool, or a list of them)
    tensors: list[GGUFTensor]  # in the file's order

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


class _Cursor:
    """Reads values from a buffer at a position, each read first checked against the bytes there are."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)

    def fail(self, what: str) -> NanoGPTError:
        return NanoGPTError(f"{self.path} is a damaged GGUF file: {what}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"{what} needs {n:,} bytes at byte {self.pos:,}, past the end of the file ({self.size:,})")

    def scalar(self, fmt: str, what: str):
        n = struct.calcsize("<" + fmt)
        self.need(n, what)
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self, what: str) -> str:
        n = self.scalar("Q", what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8 text") from None

    def count(self, smallest: int, what: str) -> int:
        """A count of items of at least `smallest` bytes each, which must fit in what is left of the file."""
        n = self.scalar("Q", what)
        if n * smallest > self.size - self.pos:
            raise self.fail(f"{what} is {n:,}, more than the {self.size - self.pos:,} bytes left can hold")
        return n

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype in SCALARS:
            return self.scalar(SCALARS[vtype], what)
        if vtype == STRING:
            return self.string(what)
        if vtype != ARRAY or depth > 0:  # llama.cpp's arrays hold scalars or strings
            raise self.fail(f"{what} has value type {vtype}, which GGUF does not define here")
        item = self.scalar("I", what)
        if item not in SMALLEST or item == ARRAY:
            raise self.fail(f"{what} is an array of value type {item}, which GGUF does not define here")
        n = self.count(SMALLEST[item], f"the length of {what}")
        if item in SCALARS:  # numbers at once, as numpy reads them
            fmt = SCALARS[item]
            values = np.frombuffer(self.buf, dtype=np.dtype("<" + fmt), count=n, offset=self.pos)
            self.pos += n * SMALLEST[item]
            return values.tolist()
        return self.strings(n, what)

    def strings(self, n: int, what: str) -> list[str]:
        """n strings in a row (a vocabulary's tokens, its merges): the plain loop, as this is most of a header."""
        buf, pos, size, unpack = self.buf, self.pos, self.size, struct.Struct("<Q").unpack_from
        raw = []
        for _ in range(n):
            if pos + 8 > size:
                raise self.fail(f"{what} runs past the end of the file")
            (length,) = unpack(buf, pos)
            if pos + 8 + length > size:
                raise self.fail(f"{what} has a string of {length:,} bytes, past the end of the file")
            raw.append(buf[pos + 8 : pos + 8 + length])
            pos += 8 + length
        self.pos = pos
        try:
            return [b.decode("utf-8") for b in raw]
        except UnicodeDecodeError:
            raise self.fail(f"{what} holds a string that is not UTF-8 text") from None


def read_header(path: str | Path) -> GGUFHeader:
    """The metadata and tensor table of a GGUF file, or one sentence saying what in it is damaged."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            if f.read(4) != MAGIC:
                raise NanoGPTError(f"{path} is not a GGUF file (it does not begin with the bytes GGUF)")
            f.seek(0)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(buf, path)
    except OSError as e:
        raise NanoGPTError(f"{path} could not be read ({e.strerror or e})") from None
    except ValueError as e:  # mmap of an empty file
        raise NanoGPTError(f"{path} is not a GGUF file ({e})") from None


def _parse(buf, path: Path) -> GGUFHeader:
    import gguf

    r = _Cursor(buf, path)
    r.pos = 4
    version = r.scalar("I", "the version")
    if version not in (2, 3):
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        why = "big-endian GGUF files are not read here" if swapped in (2, 3) else "nanogpt reads versions 2 and 3"
        raise NanoGPTError(f"{path} is a GGUF file of version {version}; {why}")
    # each tensor entry takes at least a name length, a dimension count, one dimension, a type and an offset
    n_tensors = r.count(8 + 4 + 8 + 4 + 8, "the tensor count")
    n_fields = r.count(8 + 4 + 1, "the metadata count")
    fields: dict[str, Any] = {}
    for i in range(n_fields):
        key = r.string(f"metadata key {i}")
        if key in fields:
            raise r.fail(f"the metadata key {key!r} appears twice")
        fields[key] = r.value(r.scalar("I", f"the type of {key}"), key)
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise r.fail(f"general.alignment = {alignment!r} is not a power of two")
    entries = []
    for i in range(n_tensors):
        name = r.string(f"the name of tensor {i}")
        n_dims = r.scalar("I", f"the dimension count of {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise r.fail(f"{name} has {n_dims} dimensions (ggml's tensors have 1 to {MAX_DIMS})")
        shape = tuple(r.scalar("Q", f"the shape of {name}") for _ in range(n_dims))
        raw_type = r.scalar("I", f"the type of {name}")
        offset = r.scalar("Q", f"the offset of {name}")
        entries.append((name, shape, raw_type, offset))
    start = -(-r.pos // alignment) * alignment  # the data begins at the next multiple of the alignment
    tensors, names = [], set()
    for name, shape, raw_type, offset in entries:
        if name in names:
            raise r.fail(f"the tensor {name} appears twice")
        names.add(name)
        try:
            qtype = gguf.GGMLQuantizationType(raw_type)
            block, size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise r.fail(f"{name} has tensor type {raw_type}, which gguf does not know") from None
        if 0 in shape:
            raise r.fail(f"{name} has a zero dimension (its shape is {tuple(reversed(shape))})")
        if shape[0] % block:
            raise r.fail(f"{name}'s rows of {shape[0]:,} values are not whole {qtype.name} blocks of {block}")
        n_bytes = int(np.prod(shape, dtype=object)) // block * size
        begin = start + offset
        if offset % alignment or begin + n_bytes > r.size:
            raise r.fail(
                f"{name} ({qtype.name}, shape {tuple(reversed(shape))}) needs bytes {begin:,} to {begin + n_bytes:,}"
                f"{' (misaligned)' if offset % alignment else ''}, and the file has {r.size:,}"
            )
        tensors.append(GGUFTensor(name, shape, qtype, begin, n_bytes))
    ordered = sorted(tensors, key=lambda t: t.data_offset)
    for a, b in zip(ordered, ordered[1:]):  # a damaged type or offset shows as data two tensors claim
        if a.data_offset + a.n_bytes > b.data_offset:
            raise r.fail(f"{a.name} ({a.tensor_type.name}) runs into the data of {b.name}")
    return GGUFHeader(path, version, fields, tensors)
