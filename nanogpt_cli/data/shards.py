"""The shard writer: token ids -> DATA_DIR/.NAME.partial/{train,val}-NNNNN.bin, and how far they go.

    stream = SplitStream(stage_dir, tok, Checkpoint(settings, source_meta, tok.describe()), val_fraction=0.1)
    stream.add(pieces, flat_ids, lengths); stream.checkpoint(); ...; stream.finish()

The .bin files are flat token ids (uint16 when the vocabulary fits, else uint32). Documents are separated by
the end-of-text token where the tokenizer has one, else by the text "\\n\\n"; the separator goes *between*
documents, so one text gives exactly its own tokens. Each split is cut into shards of `shard_tokens` tokens
(the last one shorter); the shards of a split, in order, are one token stream.

Validation is held-out text:
- one document: the head (1 - val_fraction of its tokens) trains, the contiguous tail validates;
- several documents: document i validates when floor((i+1)*f) > floor(i*f), i.e. every (1/f)-th document:
  an exact, deterministic share spread over the whole source. When that picks none (fewer than 1/f documents),
  the last document validates; when it holds more than 2f of the tokens (a few long files), the tail of the
  token stream validates instead;
- `val_tokens=K`: the first K tokens of the stream validate, so even a partial prepare has its validation.

Each time a shard is complete the position in the source is saved in progress.json (a `Checkpoint`); a resumed
prepare builds its writers from it, cutting the open shards back to where the checkpoint says they ended.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nanogpt_cli.data.reader import SPLITS, sha256_file
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.tokenizer import Tokenizer

DOC_SEPARATOR = "\n\n"  # between documents when the tokenizer has no end-of-text token
MIN_SPLIT_TOKENS = 2  # a split needs an input and a target token to be of any use
SHARD_TOKENS = 100_000_000  # default tokens per shard: 200 MB of uint16
CHECKPOINT = "progress.json"  # in the staging folder: how far the shards there go
COPY_TOKENS = 1 << 22  # tokens copied at a time when the tail of train moves to val


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned type that holds every token id 0 .. vocab_size-1."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@dataclass
class Checkpoint:
    """progress.json in the staging folder: the prepare's settings and how far its shards go."""

    settings: dict[str, Any]
    source_meta: dict[str, Any]
    tokenizer: dict[str, Any]
    consumed: int = 0  # pieces of the source whose tokens are written
    documents: int = 0  # documents started (the last one may be unfinished)
    val_documents: int = 0
    characters: int = 0
    tokens: int = 0  # tokens in both splits
    in_doc: bool = False  # the last piece written did not end its document
    doc_split: str = "train"  # where the current (or last) document goes
    doc_tokens: int = 0  # tokens of the current (or last) document, its separator included
    shards: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: {s: [] for s in SPLITS})  # complete
    partial: dict[str, int] = field(default_factory=lambda: {s: 0 for s in SPLITS})  # tokens in the open shard

    @classmethod
    def read(cls, stage_dir: Path) -> Checkpoint | None:
        """The checkpoint saved in a staging folder, or None when there is none."""
        path = stage_dir / CHECKPOINT
        if not path.is_file():
            return None
        try:
            return cls(**json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError) as e:
            raise NanoGPTError(f"{path} is unreadable ({e}); delete {stage_dir} to start over") from None

    def describe(self) -> str:
        shards = sum(len(v) for v in self.shards.values())
        return f"{self.documents:,} documents, {self.tokens:,} tokens, {shards} complete shard{'s' * (shards != 1)}"


class ShardWriter:
    """Appends tokens to SPLIT-00000.bin, SPLIT-00001.bin, ... of at most shard_tokens tokens each, hashing as
    it goes. Built from a checkpoint it first cuts the open shard back to the checkpoint's length."""

    def __init__(
        self, folder: Path, split: str, dtype: str, shard_tokens: int, shards: list[dict[str, Any]], partial: int
    ):
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, np.dtype(dtype), shard_tokens
        self.shards = shards  # the complete ones: {"file", "tokens", "sha256"}
        self.completed = False  # a shard was completed since the last checkpoint
        for shard in shards:
            path = folder / shard["file"]
            if not path.is_file() or path.stat().st_size != shard["tokens"] * self.dtype.itemsize:
                raise NanoGPTError(f"{path} is missing or has the wrong size; delete {folder} to start over")
        for path in folder.glob(f"{split}-*.bin"):  # written after the checkpoint: they will be written again
            if path.name > self._name(len(shards)):
                path.unlink()
        self.file, self.hash, self.partial = None, hashlib.sha256(), 0
        if partial:
            path = folder / self._name(len(shards))
            if not path.is_file() or path.stat().st_size < partial * self.dtype.itemsize:
                raise NanoGPTError(f"{path} is shorter than its checkpoint says; delete {folder} to start over")
            os.truncate(path, partial * self.dtype.itemsize)
            self.hash = sha256_file(path, hashlib.sha256())
            self.file, self.partial = open(path, "ab"), partial
        else:
            (folder / self._name(len(shards))).unlink(missing_ok=True)

    def _name(self, i: int) -> str:
        return f"{self.split}-{i:05d}.bin"

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards) + self.partial

    def write(self, ids: np.ndarray) -> None:
        while len(ids):
            if self.file is None:
                self.file = open(self.folder / self._name(len(self.shards)), "wb")
            part = ids[: self.shard_tokens - self.partial]
            data = part.tobytes()
            self.file.write(data)
            self.hash.update(data)
            self.partial += len(part)
            ids = ids[len(part) :]
            if self.partial == self.shard_tokens:
                self._close()

    def _close(self) -> None:
        if self.file is None:
            return
        self.file.close()
        self.shards.append(
            {"file": self._name(len(self.shards)), "tokens": self.partial, "sha256": self.hash.hexdigest()}
        )
        self.file, self.hash, self.partial, self.completed = None, hashlib.sha256(), 0, True

    def sync(self) -> None:
        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())

    def finish(self) -> None:
        self._close()

    def take_tail(self, n: int) -> Iterator[np.ndarray]:
        """The last n tokens (in blocks), then cut off: for a validation split taken from the end of train."""
        self.finish()
        start = self.tokens - n
        offset = 0
        for shard in self.shards:
            lo, hi = max(start - offset, 0), shard["tokens"]
            if lo < hi:
                tokens = np.memmap(self.folder / shard["file"], dtype=self.dtype, mode="r")
                for i in range(lo, hi, COPY_TOKENS):
                    yield np.array(tokens[i : min(hi, i + COPY_TOKENS)])
                del tokens  # release the map before the file shrinks under it
            offset += shard["tokens"]
        kept, offset = [], 0
        for shard in self.shards:
            keep = min(shard["tokens"], max(start - offset, 0))
            path = self.folder / shard["file"]
            if keep == 0:
                path.unlink()
            elif keep < shard["tokens"]:
                os.truncate(path, keep * self.dtype.itemsize)
                kept.append({**shard, "tokens": keep, "sha256": sha256_file(path)})
            else:
                kept.append(shard)
            offset += shard["tokens"]
        self.shards[:] = kept


class SplitStream:
    """Routes the tokens of each batch to the train and val shards, as the module docstring says."""

    def __init__(
        self,
        stage_dir: Path,
        tok: Tokenizer,
        state: Checkpoint,
        val_fraction: float = 0.1,
        val_tokens: int | None = None,
        max_docs: int | None = None,
        max_tokens: int | None = None,
        shard_tokens: int = SHARD_TOKENS,
    ):
        self.stage_dir, self.tok, self.state = stage_dir, tok, state
        self.val_fraction, self.val_tokens, self.max_docs, self.max_tokens = (
            val_fraction,
            val_tokens,
            max_docs,
            max_tokens,
        )
        self.dtype = token_dtype(tok.vocab_size)
        self.writers = {
            s: ShardWriter(stage_dir, s, self.dtype, shard_tokens, state.shards[s], state.partial[s]) for s in SPLITS
        }
        self.val_split = "head" if val_tokens is not None else "documents"
        self._sep: np.ndarray | None = None  # encoded on first use: one document's char vocabulary may lack it

    @property
    def shard_completed(self) -> bool:
        return any(w.completed for w in self.writers.values())

    def _separator(self) -> np.ndarray:
        if self._sep is None:
            tok = self.tok
            self._sep = np.array([tok.eot_id] if tok.eot_id is not None else tok.encode(DOC_SEPARATOR), self.dtype)
        return self._sep

    def add(self, batch: list[tuple[str, bool]], flat: np.ndarray, lengths: np.ndarray) -> bool:
        """Write one batch; False once --max-docs or --max-tokens is reached (the rest is not needed)."""
        st = self.state
        out: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
        more = True

        def emit(ids: np.ndarray) -> None:
            if self.max_tokens is not None:
                ids = ids[: self.max_tokens - st.tokens]
            if self.val_tokens is not None:  # the head of the stream validates, token by token
                n_val = min(max(self.val_tokens - st.tokens, 0), len(ids))
                out["val"].append(ids[:n_val])
                out["train"].append(ids[n_val:])
            else:
                out[st.doc_split].append(ids)
            st.tokens += len(ids)
            st.doc_tokens += len(ids)

        starts = np.concatenate(([0], np.cumsum(lengths)))
        for k, (text, ends) in enumerate(batch):
            if text:
                if not st.in_doc:
                    if self.max_docs is not None and st.documents >= self.max_docs:
                        more = False
                        break
                    i = st.documents
                    if self.val_tokens is not None:
                        in_val = st.tokens < self.val_tokens
                    else:
                        in_val = math.floor((i + 1) * self.val_fraction) > math.floor(i * self.val_fraction)
                    st.doc_split, st.in_doc, st.doc_tokens = ("val" if in_val else "train"), True, 0
                    st.documents += 1
                    st.val_documents += in_val
                    if i > 0:  # between documents, not after the last: one text is its tokens
                        emit(self._separator())
                    if self.tok.bos_id is not None:  # a model that expects BOS sees it at each document's start
                        emit(np.array([self.tok.bos_id], self.dtype))
                st.characters += len(text)
                emit(flat[starts[k] : starts[k + 1]])
            if ends:
                st.in_doc = False
            st.consumed += 1
            if self.max_tokens is not None and st.tokens >= self.max_tokens:
                more = False
                break
        for split, parts in out.items():
            if parts:
                self.writers[split].write(np.concatenate(parts))
        return more

    def checkpoint(self) -> None:
        """Save how far the shards go (after the batch just written), so a resumed prepare starts there."""
        st = self.state
        for split, writer in self.writers.items():
            writer.sync()
            st.shards[split], st.partial[split] = writer.shards, writer.partial
            writer.completed = False
        path = self.stage_dir / CHECKPOINT
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(st)), encoding="utf-8")
        os.replace(tmp, path)

    def finish(self) -> int:
        """Close the shards; when no document validated, move the tail of train to val. Returns documents."""
        st = self.state
        for writer in self.writers.values():
            writer.finish()
        if st.documents == 0 or self.val_tokens is not None or st.val_documents:
            return st.documents
        train, val = self.writers["train"], self.writers["val"]
        if st.documents == 1:  # one text: its tail validates
            self.val_split = "tail"
            n_val = round(train.tokens * self.val_fraction)
            if min(n_val, train.tokens - n_val) < MIN_SPLIT_TOKENS:
                return st.documents  # too small: the caller says so
        else:  # fewer than 1/f documents: the last one validates, unless it holds far more than the share
            n_val, share = st.doc_tokens, round(train.tokens * self.val_fraction)
            if n_val > 2 * share:  # a few long files: the tail of the token stream validates instead
                self.val_split, n_val = "tail", share
        for block in train.take_tail(n_val):
            val.write(block)
        val.finish()
        st.val_documents = 1
        return st.documents
