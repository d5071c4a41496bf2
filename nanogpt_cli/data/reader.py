"""Read a prepared dataset: meta.json and the token shards of its splits. All that training and eval import.

    train = open_split(Path("data"), "shk", "train"); x = train.windows(8, 257, torch.Generator())

DATA_DIR/NAME holds SPLIT-00000.bin, SPLIT-00001.bin, ... (flat token ids, uint16 or uint32) and meta.json,
which lists each split's shards with their token counts and sha256. Datasets from before shards (train.bin,
val.bin, no shard list) still load. This module needs only numpy (and torch to draw windows).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from nanogpt_cli.errors import NanoGPTError

SPLITS = ("train", "val")
META = "meta.json"


def load_meta(data_dir: Path, name: str) -> dict[str, Any]:
    """The meta.json of a prepared dataset, or a NanoGPTError that names the datasets there are."""
    data_dir = Path(data_dir)
    meta_path = data_dir / name / META
    if not meta_path.is_file():
        existing = list_datasets(data_dir)
        hint = (
            f"these exist: {', '.join(existing)}"
            if existing
            else f"run `nanogpt prepare SOURCE --name {name} --data-dir {data_dir}` first"
        )
        raise NanoGPTError(f"no dataset {name!r} in {data_dir}/; {hint}")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise NanoGPTError(f"{meta_path} is unreadable ({e}); prepare the dataset again") from None
    problem = _meta_problem(meta)
    if problem:
        raise NanoGPTError(f"{meta_path} is damaged: {problem}; prepare the dataset again")
    return meta


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _plain_name(value: Any) -> bool:
    """A file name inside the dataset's folder (a shard list never points elsewhere)."""
    return isinstance(value, str) and value not in ("", ".", "..") and "/" not in value and "\\" not in value


def _meta_problem(meta: Any) -> str | None:
    """Why a meta.json cannot be read as a dataset's (the fields the readers use, their types and ranges), or None."""
    if not isinstance(meta, dict):
        return "it is not a JSON object"
    if meta.get("format") in ("preference", "prompts"):
        return None  # rows in JSON lines (data/preference.py), no shards
    if meta.get("dtype") not in ("uint16", "uint32"):
        return f"its dtype is {meta.get('dtype')!r}, not uint16 or uint32"
    vocab = meta.get("vocab_size")
    if vocab is not None and (not _count(vocab) or vocab == 0 or vocab > np.iinfo(meta["dtype"]).max + 1):
        return f"its vocab_size {vocab!r} does not fit its {meta['dtype']} tokens"
    shards = meta.get("shards", {})
    if not isinstance(shards, dict):
        return "its shards are not a JSON object"
    for split in SPLITS:
        listed = shards.get(split)
        if not listed:  # datasets from before shards: one SPLIT.bin of SPLIT_tokens
            if not _count(meta.get(f"{split}_tokens")):
                return f"it lists no {split} shards and no {split}_tokens"
            continue
        if not isinstance(listed, list):
            return f"its {split} shards are not a list"
        for shard in listed:
            if not isinstance(shard, dict) or not _plain_name(shard.get("file")) or not _count(shard.get("tokens")):
                return f"a {split} shard is {shard!r}, not a file name in the folder and its token count"
            if ("mask" in shard or meta.get("masks")) and not _plain_name(shard.get("mask")):
                return f"a {split} shard's mask is {shard.get('mask')!r}, not a file name in the folder"
    conversations = meta.get("conversations") or {}
    if not isinstance(conversations, dict) or not all(
        isinstance(e, dict) and _plain_name(e.get("file")) and _count(e.get("count")) for e in conversations.values()
    ):
        return "its conversations are not file names with their counts"
    return None


def list_datasets(data_dir: Path) -> list[str]:
    """Names of the prepared datasets in data_dir."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        return []
    return sorted(p.name for p in data_dir.iterdir() if not p.name.startswith(".") and (p / META).is_file())


class TokenShards:
    """The tokens of one split: its shard files in order, each memory-mapped (read-only) on first use.

    `windows` draws fixed-length windows uniformly from all the windows that lie inside one shard, so a shard
    is drawn in proportion to its size and no window spans two files. With one shard the draws are exactly
    those of `torch.randint(len - length + 1)`, as before shards.
    """

    def __init__(self, paths: list[Path], counts: list[int], dtype: str, vocab_size: int | None = None):
        self.paths, self.counts, self.dtype = list(paths), list(counts), np.dtype(dtype)
        self.vocab_size = vocab_size  # every id read is checked to be below it (a damaged shard is one sentence)
        self._maps: dict[int, np.memmap] = {}

    def __len__(self) -> int:
        return sum(self.counts)

    def __iter__(self) -> Iterator[np.memmap]:
        return (self.shard(i) for i in range(len(self.paths)))

    def shard(self, i: int) -> np.memmap:
        if i not in self._maps:
            self._maps[i] = np.memmap(self.paths[i], dtype=self.dtype, mode="r")
        return self._maps[i]

    def num_windows(self, length: int) -> int:
        return sum(max(0, n - length + 1) for n in self.counts)

    def starts(self, count: int, length: int, generator) -> list[tuple[int, int]]:
        """(shard, offset) of `count` random windows of `length` tokens; the draws come from `generator`
        (a torch.Generator), so saving its state saves the position in the stream of batches."""
        import torch

        per_shard = np.array([max(0, n - length + 1) for n in self.counts], dtype=np.int64)
        total = int(per_shard.sum())
        if total == 0:
            raise NanoGPTError(
                f"no shard of {self.paths[0].parent} holds {length:,} tokens (the longest has {max(self.counts):,})"
            )
        ix = torch.randint(total, (count,), generator=generator).numpy()
        ends = np.cumsum(per_shard)
        shard = np.searchsorted(ends, ix, side="right")
        offset = ix - (ends[shard] - per_shard[shard])
        return list(zip(shard.tolist(), offset.tolist()))

    def windows(self, count: int, length: int, generator) -> np.ndarray:
        """`count` random windows of `length` tokens as an array (count, length) of the shards' dtype."""
        return self.read(self.starts(count, length, generator), length)

    def read(self, starts: list[tuple[int, int]], length: int) -> np.ndarray:
        """The windows of `length` tokens at these (shard, offset) starts, as an array (len(starts), length)."""
        out = np.stack([self.shard(s)[o : o + length] for s, o in starts])
        if self.vocab_size is not None and out.size and int(out.max()) >= self.vocab_size:
            bad = next(s for s, o in starts if int(self.shard(s)[o : o + length].max()) >= self.vocab_size)
            raise NanoGPTError(
                f"{self.paths[bad]} holds token id {int(out.max()):,}, past the vocabulary of {self.vocab_size:,}: "
                "the shard is damaged; prepare the dataset again"
            )
        return out


def open_split(data_dir: Path, name: str, split: str) -> TokenShards:
    """The shards of one split ('train' or 'val'), checked against meta.json; old datasets have one file."""
    if split not in SPLITS:
        raise NanoGPTError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    meta = load_meta(data_dir, name)
    folder = Path(data_dir) / name
    shards = meta.get("shards", {}).get(split) or [{"file": f"{split}.bin", "tokens": meta[f"{split}_tokens"]}]
    dtype = np.dtype(meta["dtype"])
    for shard in shards:
        path = folder / shard["file"]
        expected = shard["tokens"] * dtype.itemsize
        size = path.stat().st_size if path.is_file() else -1
        if size != expected or size == 0:
            raise NanoGPTError(
                f"{path} should hold {shard['tokens']:,} tokens ({expected:,} bytes) but "
                f"{'is missing' if size < 0 else f'has {size:,} bytes'}; prepare the dataset again"
            )
    files, counts = [folder / s["file"] for s in shards], [s["tokens"] for s in shards]
    return TokenShards(files, counts, meta["dtype"], meta.get("vocab_size"))


def open_mask_split(data_dir: Path, name: str, split: str) -> TokenShards | None:
    """The loss-mask shards of one split (uint8, 1 = trained on, beside each token shard), or None when the
    dataset has no masks (plain text: every token is trained on)."""
    meta = load_meta(data_dir, name)
    shards = meta.get("shards", {}).get(split) or []
    if not meta.get("masks") or not shards:
        return None
    folder = Path(data_dir) / name
    for shard in shards:
        path = folder / shard["mask"]
        if not path.is_file() or path.stat().st_size != shard["tokens"]:
            raise NanoGPTError(f"{path} should hold {shard['tokens']:,} mask bytes; prepare the dataset again")
    return TokenShards([folder / s["mask"] for s in shards], [s["tokens"] for s in shards], "uint8")


def open_conversations(data_dir: Path, name: str, split: str) -> np.ndarray | None:
    """The lengths of a chat dataset's conversations in one split, in order (uint32), or None when the dataset
    does not record them (plain text, or chat datasets prepared before it did)."""
    entry = (load_meta(data_dir, name).get("conversations") or {}).get(split)
    if not entry:
        return None
    path = Path(data_dir) / name / entry["file"]
    if not path.is_file() or path.stat().st_size != 4 * entry["count"]:
        raise NanoGPTError(f"{path} should hold {entry['count']:,} conversation lengths; prepare the dataset again")
    return np.fromfile(path, dtype=np.uint32)


def pack_windows(lengths: np.ndarray, counts: list[int], length: int) -> np.ndarray:
    """Windows of at most `length` tokens made of whole conversations, as rows (shard, offset, tokens). In order,
    conversations are added to a window while they fit; a conversation longer than a window (or cut by a shard's
    end) is cut into windows that overlap by one token, so each of its targets is in exactly one window, and its
    last piece starts a window that the next conversations may join. A window that is one token has no target and
    is dropped."""
    windows: list[tuple[int, int, int]] = []
    current: list[int] | None = None  # [shard, offset, tokens] of the window being filled

    def close():
        if current is not None and current[2] > 1:
            windows.append(tuple(current))

    shard, offset = 0, 0  # where the next conversation starts
    for n in lengths.tolist():
        while n > 0:
            while offset >= counts[shard]:  # a conversation that ends a shard: the next starts the next shard
                shard, offset = shard + 1, 0
            take = min(n, counts[shard] - offset)  # the piece of it in this shard
            start, n = offset, n - take
            offset += take
            if current is not None and current[0] == shard and current[1] + current[2] == start:
                if current[2] + take <= length:  # it fits beside the conversations already there
                    current[2] += take
                    continue
            if take > length:  # longer than a window: whole windows, overlapping by one token
                close()
                while take > length:
                    windows.append((shard, start, length))
                    start, take = start + length - 1, take - length + 1
            else:
                close()
            current = [shard, start, take]
    close()
    return np.asarray(windows, dtype=np.int64).reshape(-1, 3)


def sha256_file(path: Path, h=None):
    """The hex sha256 of a file (meta.json records one per shard); with `h` given, that hash object updated
    with the file (to go on hashing)."""
    digest = h if h is not None else hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest if h is not None else digest.hexdigest()
