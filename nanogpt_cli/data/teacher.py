"""A teacher's next-token distributions stored beside a dataset's tokens (`prepare --teacher`), read back by the
training batches of a distillation run.

    writer = TeacherWriter(data_dir / "shk", "train-00000.bin", tokens=n, top_k=32, vocab_size=49152)
    writer.write(start, ids, probs); writer.finish()     # (n, k) rows, one per token, in order
    shards = open_teacher_split(data_dir, "shk", "train")   # None when the dataset has no teacher's

Row i of a token shard's teacher files is the teacher's distribution of the token *after* token i (so it lines up
with the inputs x of a window, as y does): its top-k token ids and their probabilities at the recorded temperature,
most likely first. The probability left over is the "rest" bucket the loss needs, 1 minus their sum. Ids are
uint16 when the vocabulary fits (uint32 otherwise), probabilities float16: k * 4 bytes per token with uint16 ids.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from nanogpt_cli.data.reader import load_meta
from nanogpt_cli.errors import NanoGPTError

PROB_DTYPE = np.float16


def id_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65536 else np.uint32)


def teacher_files(token_file: str) -> tuple[str, str]:
    """The ids' and probabilities' file names beside a token shard."""
    stem = token_file.removesuffix(".bin")
    return f"{stem}.teacher-ids.bin", f"{stem}.teacher-probs.bin"


def bytes_per_token(top_k: int, vocab_size: int) -> int:
    """What the teacher's files add to each token on disk."""
    return top_k * (id_dtype(vocab_size).itemsize + np.dtype(PROB_DTYPE).itemsize)


class TeacherWriter:
    """The two files of one token shard, filled in place under temporary names and moved into place by finish()."""

    def __init__(self, folder: Path, token_file: str, tokens: int, top_k: int, vocab_size: int):
        self.folder, self.names = Path(folder), teacher_files(token_file)
        shape = (tokens, top_k)
        self.ids = np.memmap(self._tmp(0), dtype=id_dtype(vocab_size), mode="w+", shape=shape)
        self.probs = np.memmap(self._tmp(1), dtype=PROB_DTYPE, mode="w+", shape=shape)

    def _tmp(self, i: int) -> Path:
        return self.folder / f".{self.names[i]}.tmp"

    def write(self, start: int, ids: np.ndarray, probs: np.ndarray) -> None:
        """Rows start .. start + len(ids) - 1: (n, k) ids and probabilities."""
        self.ids[start : start + len(ids)] = ids
        self.probs[start : start + len(probs)] = probs

    def finish(self) -> None:
        for i, array in enumerate((self.ids, self.probs)):
            array.flush()
            os.replace(self._tmp(i), self.folder / self.names[i])
        del self.ids, self.probs


class TeacherShards:
    """One split's teacher files, memory-mapped: windows of rows read at the token shards' (shard, offset)."""

    def __init__(self, paths: list[tuple[Path, Path]], counts: list[int], top_k: int, vocab_size: int):
        self.paths, self.counts, self.top_k, self.vocab_size = paths, counts, top_k, vocab_size
        self._maps: dict[int, tuple[np.memmap, np.memmap]] = {}

    def shard(self, i: int) -> tuple[np.memmap, np.memmap]:
        if i not in self._maps:
            n, k = self.counts[i], self.top_k
            ids = np.memmap(self.paths[i][0], dtype=id_dtype(self.vocab_size), mode="r", shape=(n, k))
            self._maps[i] = ids, np.memmap(self.paths[i][1], dtype=PROB_DTYPE, mode="r", shape=(n, k))
        return self._maps[i]

    def read(self, starts: list[tuple[int, ...]], length: int) -> tuple[np.ndarray, np.ndarray]:
        """(B, length, k) ids (int64) and probabilities (float32) of the windows at these starts; a window that
        ends early (a packed conversation: (shard, offset, n)) is padded with id 0 and probability 0."""
        ids = np.zeros((len(starts), length, self.top_k), dtype=np.int64)
        probs = np.zeros((len(starts), length, self.top_k), dtype=np.float32)
        for row, start in enumerate(starts):
            shard, offset = start[0], start[1]
            n = min(length, start[2] - 1) if len(start) == 3 else length
            i, p = self.shard(shard)
            ids[row, :n], probs[row, :n] = i[offset : offset + n], p[offset : offset + n]
        return ids, probs


def teacher_record(meta: dict[str, Any]) -> dict[str, Any] | None:
    """What meta.json says of the dataset's teacher (source, top_k, temperature, context, splits), or None."""
    return meta.get("teacher")


def open_teacher_split(data_dir: Path, name: str, split: str) -> TeacherShards | None:
    """The teacher's files of one split, checked against their token shards, or None when the dataset has none."""
    meta = load_meta(data_dir, name)
    record = teacher_record(meta)
    if record is None or split not in record.get("splits", ()):
        return None
    folder, k, vocab = Path(data_dir) / name, record["top_k"], meta["vocab_size"]
    shards = meta.get("shards", {}).get(split) or [{"file": f"{split}.bin", "tokens": meta[f"{split}_tokens"]}]
    paths = []
    for shard in shards:
        pair = tuple(folder / f for f in teacher_files(shard["file"]))
        for path, itemsize in zip(pair, (id_dtype(vocab).itemsize, np.dtype(PROB_DTYPE).itemsize), strict=True):
            expected = shard["tokens"] * k * itemsize
            if not path.is_file() or path.stat().st_size != expected:
                raise NanoGPTError(
                    f"{path} should hold {expected:,} bytes of the teacher's top-{k}; run `nanogpt prepare "
                    f"--teacher` again"
                )
        paths.append(pair)
    return TeacherShards(paths, [s["tokens"] for s in shards], k, vocab)
