"""Prepare a dataset: text sources -> DATA_DIR/NAME/{train,val}-NNNNN.bin shards + meta.json, and read them back.

    result = prepare("examples/tinyshakespeare.txt", "shk", tokenizer="char", data_dir=Path("data"))
    train = open_split(Path("data"), "shk", "train"); x = train.windows(8, 257, torch.Generator())

A source is a text file, a folder or glob of them, a .jsonl/.json/.parquet/.csv file (`text_column`),
`hf:OWNER/NAME` on the Hugging Face hub, or `shakespeare` (Tiny Shakespeare, downloaded once and cached).
Every text file, row or hub record is one document.

The .bin files are flat token ids (uint16 when the vocabulary fits, else uint32). Documents are separated by
the end-of-text token where the tokenizer has one, else by the text "\\n\\n"; the separator goes *between*
documents, so one text gives exactly its own tokens. Each split is cut into shards of `shard_tokens` tokens
(the last one shorter); the shards of a split, in order, are one token stream, and meta.json lists them with
their token counts and sha256. Datasets from before shards (train.bin, val.bin) still load.

Validation is held-out text:
- one document: the head (1 - val_fraction of its tokens) trains, the contiguous tail validates;
- several documents: document i validates when floor((i+1)*f) > floor(i*f), i.e. every (1/f)-th document:
  an exact, deterministic share spread over the whole source. When that picks none (fewer than 1/f documents),
  the last document validates; when it holds more than 2f of the tokens (a few long files), the tail of the
  token stream validates instead;
- `val_tokens=K`: the first K tokens of the stream validate, so even a partial prepare has its validation.

Memory stays bounded: text is read in batches, tokenized by `num_proc` worker processes (in order, so the
output does not depend on their number) and the token ids go straight into the shards. Everything is written
into DATA_DIR/.NAME.partial and renamed into place at the end, so a failed or interrupted prepare leaves an
earlier DATA_DIR/NAME untouched. Each time a shard is complete, the position in the source is saved there
(progress.json); `resume=True` continues from it after Ctrl-C, kill -9 or a lost connection, skipping the
documents already tokenized, and gives the same bytes as a prepare that was never interrupted.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import hashlib
import itertools
import json
import math
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from nanogpt_cli import __version__
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.tokenizer import (ByteTokenizer, CharTokenizer, Tokenizer, build_tokenizer, check_tokenizer_name,
                                   tokenizer_from_description)

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
TEXT_SUFFIXES = (".txt", ".md")  # what a folder contributes besides the structured files
STRUCTURED = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}  # suffix -> datasets builder
SPLITS = ("train", "val")
DOC_SEPARATOR = "\n\n"  # between documents when the tokenizer has no end-of-text token
MIN_SPLIT_TOKENS = 2  # a split needs an input and a target token to be of any use
SHARD_TOKENS = 100_000_000  # default tokens per shard: 200 MB of uint16
PARTIAL = ".{name}.partial"  # the staging folder in DATA_DIR, kept after an interruption for --resume
CHECKPOINT = "progress.json"  # in the staging folder: how far the shards there go
LOCK = "lock"  # in the staging folder: held by the prepare that writes it

# batch sizes: they bound memory, not results (text is only cut where tokenizers split anyway, see _safe_cut)
READ_BYTES = 1 << 20  # plain text is read this many bytes at a time
MAX_PIECE_CHARS = 1 << 23  # a piece with no safe cut in it is cut here anyway
BATCH_CHARS = 1 << 20  # characters sent to a worker process at once
BATCH_DOCS = 4096
COPY_TOKENS = 1 << 22  # tokens copied at a time when the tail of train moves to val


@dataclass
class PrepareProgress:
    """What `prepare` tells its progress callback now and then."""

    stage: str  # "reading characters" (char vocabulary pass), "tokenizing"
    done: int  # in `unit`s: source bytes read, or documents for a hub dataset
    total: int | None  # None when unknown (a streamed hub dataset)
    unit: str  # "bytes" or "documents"
    documents: int = 0
    tokens: int = 0


Progress = Callable[[PrepareProgress], None]
Pieces = Iterator[tuple[str, bool]]  # (text, ends a document); a long document comes in several pieces


@dataclass
class PrepareResult:
    """What `prepare` wrote, for the summary table."""

    name: str
    path: Path  # DATA_DIR/NAME
    source: str
    tokenizer: str
    vocab_size: int
    dtype: str  # of the .bin files
    documents: int
    val_documents: int  # documents in val; with one document its tail is val
    characters: int
    train_tokens: int
    val_tokens: int
    shards: dict[str, int]  # split -> number of shard files
    bytes_on_disk: int  # shards + meta.json
    elapsed_s: float
    source_bytes: int | None = None  # bytes read from local files (None for hub datasets)
    num_proc: int = 1
    resumed_documents: int = 0  # documents that an earlier, interrupted prepare had already written
    val_split: str = "documents"  # "documents" (every (1/f)-th), "tail" (of the token stream) or "head" (--val-tokens)

    @property
    def tokens(self) -> int:
        return self.train_tokens + self.val_tokens

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.elapsed_s, 1e-9)


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned type that holds every token id 0 .. vocab_size-1."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def prepare(source: str, name: str, tokenizer: str = "gpt2", val_fraction: float = 0.1,
            data_dir: Path = Path("data"), text_column: str = "text", subset: str | None = None,
            split: str = "train", streaming: bool = False, max_docs: int | None = None, num_proc: int = 1,
            shard_tokens: int = SHARD_TOKENS, max_tokens: int | None = None, val_tokens: int | None = None,
            resume: bool = False, progress: Progress | None = None) -> PrepareResult:
    """Tokenize `source` into DATA_DIR/NAME/{train-00000.bin, ..., val-00000.bin, ..., meta.json}; replaces an
    earlier NAME only on success. `subset`, `split` and `streaming` apply to hf: sources; `max_docs` keeps the
    first N documents and `max_tokens` the first N tokens; `num_proc` is the number of tokenizer processes;
    `resume` continues an interrupted prepare; `progress(PrepareProgress)` is called now and then."""
    t0 = time.perf_counter()
    data_dir = Path(data_dir)
    _check_name(name)
    if not 0.0 < val_fraction < 1.0:
        raise NanoGPTError(f"--val-fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    for flag, value in (("--max-docs", max_docs), ("--max-tokens", max_tokens), ("--val-tokens", val_tokens),
                        ("--num-proc", num_proc), ("--shard-tokens", shard_tokens)):
        if value is not None and value < 1:
            raise NanoGPTError(f"{flag} must be a positive integer, got {value}")
    if val_tokens is not None and max_tokens is not None and val_tokens >= max_tokens:
        raise NanoGPTError(f"--val-tokens ({val_tokens:,}) must be below --max-tokens ({max_tokens:,}) to leave "
                           "tokens to train on")
    check_tokenizer_name(tokenizer)
    final_dir = data_dir / name
    if final_dir.exists() and not (final_dir / "meta.json").is_file() and (
            not final_dir.is_dir() or any(final_dir.iterdir())):
        raise NanoGPTError(f"{final_dir} exists and is not a prepared dataset; pick another --name or --data-dir")
    # what a resumed prepare must share with the one it continues (num_proc does not change the output)
    settings = dict(source=source, tokenizer=tokenizer, val_fraction=val_fraction, val_tokens=val_tokens,
                    max_docs=max_docs, max_tokens=max_tokens, shard_tokens=shard_tokens, text_column=text_column,
                    subset=subset, split=split, streaming=streaming)

    with contextlib.ExitStack() as stack:
        src = _resolve_source(source, text_column, subset, split, streaming,
                              raw_bytes=tokenizer == "byte", stack=stack)
        created_data_dir = not data_dir.exists()
        stage_dir = data_dir / PARTIAL.format(name=name)
        stage_dir.mkdir(parents=True, exist_ok=True)
        stack.enter_context(_locked(stage_dir))
        try:
            state = _read_checkpoint(stage_dir)
            if state is not None and not resume:
                raise NanoGPTError(f"{stage_dir} holds an interrupted prepare of '{name}' ({_describe(state)}); "
                                   "add --resume to continue it, or delete that folder to start over")
            if state is not None:
                _check_same(state, settings, src.meta, stage_dir)
                tok = tokenizer_from_description(state.tokenizer)
            else:
                for p in stage_dir.iterdir():  # shards of a prepare killed before its first checkpoint
                    if p.name != LOCK:
                        p.unlink()
                tok = _char_tokenizer(src, max_docs, progress) if tokenizer == "char" else build_tokenizer(tokenizer)
                state = _Checkpoint(settings=settings, source_meta=src.meta, tokenizer=tok.describe())
            resumed_documents = state.documents
            stream = _Stream(stage_dir, tok, state, val_fraction, val_tokens, max_docs, max_tokens, shard_tokens)
            tick = _Ticker(progress, "tokenizing", src.total, src.unit)
            pieces = _skip(src.pieces(tick), state.consumed)  # what an interrupted prepare already wrote
            with contextlib.closing(_encoded(_batches(pieces), tok, stream.dtype, num_proc)) as encoded:
                for batch, (flat, lengths) in encoded:
                    more = stream.add(batch, flat, lengths)
                    tick.documents, tick.tokens = state.documents, state.tokens
                    tick(0)  # report the documents and tokens written, not only the bytes read
                    if not more:
                        break
                    if stream.shard_completed:
                        stream.checkpoint()
            tick.finish()
            # from here on the shards change in place (the tail of train may move to val): a prepare stopped now
            # starts over rather than resume from files that no longer match the checkpoint
            (stage_dir / CHECKPOINT).unlink(missing_ok=True)
            if stream.finish() == 0:
                raise NanoGPTError(f"{src.label} has no text")
            n_train, n_val = stream.writers["train"].tokens, stream.writers["val"].tokens
            if min(n_train, n_val) < MIN_SPLIT_TOKENS:
                hint = "--val-tokens" if val_tokens is not None else "--val-fraction"
                raise NanoGPTError(
                    f"{src.label} is too small to split: {n_train + n_val:,} tokens give {n_train:,} train and "
                    f"{n_val:,} validation tokens (at least {MIN_SPLIT_TOKENS} each are needed); use more text or "
                    f"another {hint}")
            meta = {
                "version": __version__,
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "source": source,
                **src.meta,
                "tokenizer": tok.describe(),
                "vocab_size": tok.vocab_size,
                "eot_id": tok.eot_id,
                "dtype": stream.dtype,
                "documents": state.documents,
                "val_documents": state.val_documents,
                "val_split": stream.val_split,
                "val_fraction": val_fraction,
                "characters": state.characters,
                "train_tokens": n_train,
                "val_tokens": n_val,
                "shard_tokens": shard_tokens,
                "shards": {s: w.shards for s, w in stream.writers.items()},
            }
            for key, value in (("max_docs", max_docs), ("max_tokens", max_tokens), ("val_head_tokens", val_tokens)):
                if value is not None:
                    meta[key] = value
            (stage_dir / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n",
                                                 encoding="utf-8")
            (stage_dir / LOCK).unlink(missing_ok=True)
            bytes_on_disk = sum(p.stat().st_size for p in stage_dir.iterdir())
            _replace_dir(stage_dir, final_dir)
        except BaseException:
            if not (stage_dir / CHECKPOINT).is_file():  # nothing to resume from: leave no trace
                shutil.rmtree(stage_dir, ignore_errors=True)
                if created_data_dir:
                    with contextlib.suppress(OSError):
                        data_dir.rmdir()
            raise

    return PrepareResult(name=name, path=final_dir, source=source, tokenizer=tok.name, vocab_size=tok.vocab_size,
                         dtype=stream.dtype, documents=state.documents, val_documents=state.val_documents,
                         characters=state.characters, train_tokens=n_train, val_tokens=n_val,
                         shards={s: len(w.shards) for s, w in stream.writers.items()}, bytes_on_disk=bytes_on_disk,
                         elapsed_s=time.perf_counter() - t0, source_bytes=src.total if src.unit == "bytes" else None,
                         num_proc=num_proc, resumed_documents=resumed_documents, val_split=stream.val_split)


def interrupted_prepare(data_dir: Path, name: str) -> str | None:
    """One line about the interrupted prepare of NAME kept in DATA_DIR, or None when there is none."""
    stage_dir = Path(data_dir) / PARTIAL.format(name=name)
    state = _read_checkpoint(stage_dir) if stage_dir.is_dir() else None
    return None if state is None else f"{stage_dir} keeps {_describe(state)}; rerun with --resume to continue"


def load_meta(data_dir: Path, name: str) -> dict[str, Any]:
    """The meta.json of a prepared dataset, or a NanoGPTError that names the datasets there are."""
    data_dir = Path(data_dir)
    meta_path = data_dir / name / "meta.json"
    if not meta_path.is_file():
        existing = list_datasets(data_dir)
        hint = f"these exist: {', '.join(existing)}" if existing else \
            f"run `nanogpt prepare SOURCE --name {name} --data-dir {data_dir}` first"
        raise NanoGPTError(f"no dataset {name!r} in {data_dir}/; {hint}")
    try:
        return json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise NanoGPTError(f"{meta_path} is unreadable ({e}); prepare the dataset again") from None


def list_datasets(data_dir: Path) -> list[str]:
    """Names of the prepared datasets in data_dir."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        return []
    return sorted(p.name for p in data_dir.iterdir() if not p.name.startswith(".") and (p / "meta.json").is_file())


# --- reading shards ---


class TokenShards:
    """The tokens of one split: its shard files in order, each memory-mapped (read-only) on first use.

    `windows` draws fixed-length windows uniformly from all the windows that lie inside one shard, so a shard
    is drawn in proportion to its size and no window spans two files. With one shard the draws are exactly
    those of `torch.randint(len - length + 1)`, as before shards.
    """

    def __init__(self, paths: list[Path], counts: list[int], dtype: str):
        self.paths, self.counts, self.dtype = list(paths), list(counts), np.dtype(dtype)
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
            raise NanoGPTError(f"no shard of {self.paths[0].parent} holds {length:,} tokens (the longest has "
                               f"{max(self.counts):,})")
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
        return np.stack([self.shard(s)[o:o + length] for s, o in starts])


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
            raise NanoGPTError(f"{path} should hold {shard['tokens']:,} tokens ({expected:,} bytes) but "
                               f"{'is missing' if size < 0 else f'has {size:,} bytes'}; prepare the dataset again")
    return TokenShards([folder / s["file"] for s in shards], [s["tokens"] for s in shards], meta["dtype"])


# --- sources ---


@dataclass
class _Source:
    label: str  # how messages name it
    pieces: Callable[[Callable[[int], None]], Pieces]  # one pass over the text; calls tick(n) as it goes
    total: int | None  # the progress total in tick units (bytes or documents), None when unknown
    meta: dict[str, Any]  # what meta.json records about it besides the SOURCE string
    unit: str = "bytes"  # of tick and total: "bytes" for local files, "documents" for hub datasets


@contextlib.contextmanager
def open_source(source: str, text_column: str = "text", subset: str | None = None, split: str = "train",
                streaming: bool = False) -> Iterator[_Source]:
    """Any SOURCE that `prepare` reads, for other readers (tokenizer training): `.label`, `.total`, `.unit`, and
    `.pieces(tick)`, which yields (text, ends a document) and calls tick(n) with the bytes or documents read."""
    with contextlib.ExitStack() as stack:
        yield _resolve_source(source, text_column, subset, split, streaming, raw_bytes=False, stack=stack)


def _resolve_source(source: str, text_column: str, subset: str | None, split: str, streaming: bool,
                    raw_bytes: bool, stack: contextlib.ExitStack) -> _Source:
    path = Path(source).expanduser()
    if not path.exists() and source.startswith("hf:"):
        _offline_unless_hub_reachable()
        stack.enter_context(_quiet_datasets(progress_bars=True))
        return _hf_source(source[3:], text_column, subset, split, streaming)
    downloaded = not path.exists() and source == "shakespeare"
    if downloaded:
        files = [download_shakespeare()]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")
                       and p.suffix.lower() in TEXT_SUFFIXES + tuple(STRUCTURED))
        if not files:
            raise NanoGPTError(f"folder {source} has no {', '.join(TEXT_SUFFIXES + tuple(STRUCTURED))} files")
    elif path.is_file():
        files = [path]
    elif any(c in source for c in "*?["):
        # an explicit glob takes whatever it matches; anything not structured is read as text
        files = sorted(p for p in map(Path, glob.glob(os.path.expanduser(source), recursive=True)) if p.is_file())
        if not files:
            raise NanoGPTError(f"no files match {source}")
    else:
        raise NanoGPTError(f"{source} does not exist; SOURCE is a text file, a folder or glob of them, a "
                           ".jsonl/.json/.parquet/.csv file, hf:OWNER/NAME, or shakespeare")
    if len(files) == 1 and files[0].stat().st_size == 0:
        raise NanoGPTError(f"{files[0]} is empty")  # several files: empty ones are skipped like empty rows
    if any(f.suffix.lower() in STRUCTURED for f in files):
        stack.enter_context(_quiet_datasets(progress_bars=False))
    meta: dict[str, Any] = {}
    if len(files) == 1:
        meta["source_sha256"] = _sha256_file(files[0])
        if downloaded:
            meta["source_url"] = SHAKESPEARE_URL
    if any(f.suffix.lower() in STRUCTURED for f in files):
        meta["text_column"] = text_column
    errors = "surrogateescape" if raw_bytes else "strict"

    def pieces(tick: Callable[[int], None]) -> Pieces:
        # consecutive files of one structured format go to `datasets` together: one load for many shards
        for builder, group in itertools.groupby(files, key=lambda f: STRUCTURED.get(f.suffix.lower())):
            if builder is None:
                for f in group:
                    yield from _read_text_file(f, errors, tick)
            else:
                yield from _read_structured(builder, list(group), text_column, tick)

    label = str(files[0]) if len(files) == 1 else source
    return _Source(label=label, pieces=pieces, total=sum(f.stat().st_size for f in files), meta=meta)


def _read_text_file(path: Path, errors: str, tick: Callable[[int], None]) -> Pieces:
    """One text file as one document, in pieces of about READ_BYTES, cut only where tokenization is unaffected."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors=errors)  # no newline translation: \r\n stays
    offset = 0
    pending = ""
    with open(path, "rb") as f:
        while True:
            block = f.read(READ_BYTES)
            try:
                text = decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:
                raise NanoGPTError(f"{path} is not UTF-8 text (invalid byte near offset {offset + e.start:,}); "
                                   "use --tokenizer byte to tokenize raw bytes") from None
            if errors == "strict" and "\x00" in text:
                raise NanoGPTError(f"{path} looks binary (it contains NUL bytes); use --tokenizer byte to "
                                   "tokenize raw bytes")
            offset += len(block)
            tick(len(block))
            pending += text
            if not block:
                break
            if len(pending) >= READ_BYTES:
                cut = _safe_cut(pending)
                if cut == 0 and len(pending) >= MAX_PIECE_CHARS:
                    cut = len(pending)  # no line break to cut at: a BPE merge may differ at this one point
                if cut:
                    yield pending[:cut], False
                    pending = pending[cut:]
    yield pending, True


def _safe_cut(text: str) -> int:
    """The index just after the last newline that has a non-space before it and a letter or digit after it.

    GPT-2's, cl100k's and o200k's regexes all end a piece at such a newline and start a fresh one after it, so
    tokenizing the two sides separately gives the same tokens as tokenizing them together. 0 when there is none.
    """
    i = len(text) - 1
    while (i := text.rfind("\n", 0, i)) > 0:
        if not text[i - 1].isspace() and text[i + 1].isalnum():
            return i + 1
    return 0


def _read_structured(builder: str, files: list[Path], text_column: str, tick: Callable[[int], None]) -> Pieces:
    """Rows of .jsonl/.json/.parquet/.csv files through `datasets`, streamed: no Arrow copy, bounded memory."""
    import datasets

    label = str(files[0]) if len(files) == 1 else f"the {builder} files"
    left = sum(f.stat().st_size for f in files)  # progress in bytes: a row's text stands in for its bytes

    def spend(n: int) -> None:
        nonlocal left
        n = min(n, left)
        left -= n
        tick(n)

    try:
        ds = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", streaming=True)
        yield from _rows(ds, label, text_column, spend)
    except NanoGPTError:
        raise
    except Exception as e:  # pyarrow and datasets raise many types for a bad file; all mean "cannot read it"
        raise NanoGPTError(f"could not read {label}: {_first_line(e)}") from None
    tick(left)


def _rows(ds, label: str, text_column: str, tick: Callable[[int], None]) -> Pieces:
    columns = ds.column_names  # None for a streamed json/csv until it is read
    if columns is not None and text_column not in columns:
        raise _no_column(label, text_column, columns)
    for batch in ds.iter(batch_size=1000):
        if text_column not in batch:
            raise _no_column(label, text_column, list(batch))
        for value in batch[text_column]:
            if value is None:
                continue
            if not isinstance(value, str):
                raise NanoGPTError(f"column {text_column!r} of {label} holds {type(value).__name__} values, not "
                                   "text; pass --text-column with a text column")
            tick(len(value))
            yield value, True


def _no_column(label: str, text_column: str, columns: list[str]) -> NanoGPTError:
    return NanoGPTError(f"{label} has no column {text_column!r}; its columns are {', '.join(columns)} "
                        "(choose one with --text-column)")


def _hf_source(repo: str, text_column: str, subset: str | None, split: str, streaming: bool) -> _Source:
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    if repo.count("/") > 1 or not repo.strip("/"):
        raise NanoGPTError(f"hf:{repo} is not a hub dataset name; write hf:OWNER/NAME")
    try:
        ds = datasets.load_dataset(repo, subset, split=split, streaming=streaming)
    except DatasetNotFoundError:
        raise NanoGPTError(f"hf:{repo} is not a dataset on the Hugging Face hub, or it is gated or private "
                           "(log in with `hf auth login`)") from None
    except ConnectionError:
        raise NanoGPTError(f"could not reach the Hugging Face hub to load hf:{repo} ({_hub_unreachable or 'offline?'})"
                           "; load it once while online so it is cached, or pass a local file") from None
    except Exception as e:  # a missing subset or split: datasets' message lists the valid ones
        raise NanoGPTError(f"could not load hf:{repo}: {_first_line(e)}") from None
    label = f"hf:{repo}"

    def pieces(tick: Callable[[int], None]) -> Pieces:
        try:
            yield from _rows(ds, label, text_column, lambda n: tick(1))
        except NanoGPTError:
            raise
        except ConnectionError:
            raise NanoGPTError(f"lost the connection to the Hugging Face hub while streaming hf:{repo}") from None
        except Exception as e:
            raise NanoGPTError(f"could not read hf:{repo}: {_first_line(e)}") from None

    meta = {"subset": subset, "split": split, "text_column": text_column}
    return _Source(label=label, pieces=pieces, total=None if streaming else len(ds), meta=meta, unit="documents")


def _import_datasets():
    """`datasets`, imported without torch when nothing imported torch yet: it would load torch (seconds, half
    the start-up of a small prepare) only to hand its streams to a DataLoader. USE_TORCH is read once, on
    import, and put back at once, so what imports later (transformers) sees the environment as it was."""
    if "datasets" in sys.modules or "torch" in sys.modules:
        import datasets

        return datasets
    saved = os.environ.get("USE_TORCH")
    os.environ["USE_TORCH"] = "0"
    try:
        import datasets
    finally:
        if saved is None:
            del os.environ["USE_TORCH"]
        else:
            os.environ["USE_TORCH"] = saved
    return datasets


_hub_unreachable = ""  # why the hub was switched offline, for the error message


def _offline_unless_hub_reachable(timeout_s: float = 3.0) -> None:
    """Ask the hub once, with a short timeout; when it does not answer, switch the hub libraries to offline mode
    (cached datasets still load), instead of their ~30 s of retries before the same failure."""
    import sys

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint + "/api/whoami-v2", method="HEAD"),
                               timeout=timeout_s).close()
        return
    except urllib.error.HTTPError:
        return  # it answered (401 without a token): reachable
    except (OSError, ValueError):
        pass
    global _hub_unreachable
    _hub_unreachable = f"it did not answer within {timeout_s:g} s, so only the local cache was searched"
    os.environ["HF_HUB_OFFLINE"] = "1"  # read when the hub libraries are imported...
    for module, name in (("huggingface_hub.constants", "HF_HUB_OFFLINE"), ("datasets.config", "HF_HUB_OFFLINE")):
        if module in sys.modules:  # ...and where this process imported them already, set where they keep it
            setattr(sys.modules[module], name, True)


@contextlib.contextmanager
def _quiet_datasets(progress_bars: bool):
    """Silence `datasets` while we read: its log lines ("Failed to load JSON ...", retries) would follow our
    one-sentence error, and our own progress bar covers local files. Restores the settings after."""
    datasets = _import_datasets()
    from huggingface_hub.utils import logging as hub_logging

    verbosity, hub_verbosity = datasets.logging.get_verbosity(), hub_logging.get_verbosity()
    bars = datasets.is_progress_bar_enabled()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    hub_logging.set_verbosity(hub_logging.CRITICAL)
    if not progress_bars:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        hub_logging.set_verbosity(hub_verbosity)
        if bars:
            datasets.enable_progress_bars()


def cache_dir() -> Path:
    """Where downloads are kept: $NANOGPT_CACHE, else ~/.cache/nanogpt."""
    return Path(os.environ.get("NANOGPT_CACHE") or Path.home() / ".cache" / "nanogpt")


def download_shakespeare() -> Path:
    """Tiny Shakespeare in the cache, downloaded and sha256-checked on first use."""
    path = cache_dir() / "tinyshakespeare.txt"
    if path.is_file() and _sha256_file(path) == SHAKESPEARE_SHA256:
        return path
    try:
        with urllib.request.urlopen(SHAKESPEARE_URL, timeout=30) as response:
            data = response.read()
    except (OSError, ValueError) as e:  # URLError is an OSError
        raise NanoGPTError(f"could not download Tiny Shakespeare from {SHAKESPEARE_URL} ({_first_line(e)}); "
                           "pass a local copy instead, e.g. nanogpt prepare examples/tinyshakespeare.txt "
                           "--name shakespeare") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHAKESPEARE_SHA256:
        raise NanoGPTError(f"the download from {SHAKESPEARE_URL} has sha256 {digest}, not {SHAKESPEARE_SHA256}; "
                           "it was not kept, try again or pass a local copy of Tiny Shakespeare")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


# --- tokenizing into shards ---


def _char_tokenizer(src: _Source, max_docs: int | None, progress: Progress | None) -> Tokenizer:
    """A first pass over the source: the char vocabulary is every character in it (plus the separator)."""
    tick = _Ticker(progress, "reading characters", src.total, src.unit)
    docs = 0

    def texts():
        nonlocal docs
        started = False
        for text, ends in _first_docs(src.pieces(tick), max_docs):
            yield text
            started |= bool(text)
            if ends and started:
                docs, started = docs + 1, False
        if docs == 0:
            raise NanoGPTError(f"{src.label} has no text")
        if docs > 1:
            yield DOC_SEPARATOR  # it goes between documents, so it needs tokens too

    tok = build_tokenizer("char", texts())
    tick.finish()
    return tok


def _first_docs(pieces: Pieces, max_docs: int | None) -> Pieces:
    """The pieces of the first max_docs non-empty documents (all of them when None)."""
    with contextlib.closing(pieces):
        docs, started = 0, False
        for text, ends in pieces:
            yield text, ends
            started |= bool(text)
            if ends and started:
                docs, started = docs + 1, False
                if max_docs is not None and docs >= max_docs:
                    return


def _skip(pieces: Pieces, n: int) -> Pieces:
    """All but the first n pieces; they are still read (a stream has no other way to get past them)."""
    with contextlib.closing(pieces):
        for i, piece in enumerate(pieces):
            if i >= n:
                yield piece


def _batches(pieces: Pieces) -> Iterator[list[tuple[str, bool]]]:
    """Pieces in batches of about BATCH_CHARS characters or BATCH_DOCS pieces: the unit of work of a worker."""
    with contextlib.closing(pieces):
        batch: list[tuple[str, bool]] = []
        chars = 0
        for text, ends in pieces:
            batch.append((text, ends))
            chars += len(text)
            if chars >= BATCH_CHARS or len(batch) >= BATCH_DOCS:
                yield batch
                batch, chars = [], 0
        if batch:
            yield batch


def _encode(tok: Tokenizer, texts: list[str], dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """The token ids of `texts` end to end, and how many belong to each text."""
    if isinstance(tok, (CharTokenizer, ByteTokenizer)):  # both encode to arrays without a list of ints
        ids = [tok.encode_array(t) if isinstance(tok, CharTokenizer) else
               np.frombuffer(t.encode("utf-8", errors="surrogateescape"), dtype=np.uint8) for t in texts]
        lengths = np.array([len(i) for i in ids], dtype=np.int64)
        return (np.concatenate(ids).astype(dtype) if ids else np.zeros(0, dtype)), lengths
    ids = [tok.encode(t) for t in texts]
    lengths = np.array([len(i) for i in ids], dtype=np.int64)
    return np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum())), lengths


_worker: tuple[Tokenizer, str] | None = None  # the tokenizer of a worker process, built once


def _start_worker(description: dict[str, Any], dtype: str) -> None:
    import signal

    global _worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops the pool
    _worker = (tokenizer_from_description(description), dtype)


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    tok, dtype = _worker
    return _encode(tok, texts, dtype)


def _encoded(batches: Iterator[list[tuple[str, bool]]], tok: Tokenizer, dtype: str, num_proc: int
             ) -> Iterator[tuple[list[tuple[str, bool]], tuple[np.ndarray, np.ndarray]]]:
    """Each batch with its tokens, in order. With num_proc > 1 the batches go to that many worker processes
    (spawned, so no lock of a reader thread is inherited), at most 2 * num_proc of them in flight."""
    if num_proc == 1:
        for batch in batches:
            yield batch, _encode(tok, [t for t, _ in batch], dtype)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    before = set(multiprocessing.active_children())
    # an executor, not multiprocessing.Pool: a worker that dies (out of memory) fails the prepare instead of
    # being replaced while its batch is waited for forever
    pool = ProcessPoolExecutor(num_proc, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_start_worker, initargs=(tok.describe(), dtype))
    finished = False
    try:
        pending: deque = deque()
        for batch in batches:
            pending.append((batch, pool.submit(_encode_in_worker, [t for t, _ in batch])))
            if len(pending) >= 2 * num_proc:
                batch, future = pending.popleft()
                yield batch, future.result()
        while pending:
            batch, future = pending.popleft()
            yield batch, future.result()
        finished = True
    except BrokenProcessPool:
        raise NanoGPTError("a tokenizer worker process died (out of memory?); resume with --resume, perhaps "
                           "with a smaller --num-proc") from None
    finally:
        pool.shutdown(wait=finished, cancel_futures=True)
        if not finished:  # Ctrl-C or an error: stop the workers now rather than after the batches they hold
            for worker in set(multiprocessing.active_children()) - before:
                worker.terminate()


@dataclass
class _Checkpoint:
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


def _read_checkpoint(stage_dir: Path) -> _Checkpoint | None:
    path = stage_dir / CHECKPOINT
    if not path.is_file():
        return None
    try:
        return _Checkpoint(**json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError) as e:
        raise NanoGPTError(f"{path} is unreadable ({e}); delete {stage_dir} to start over") from None


def _describe(state: _Checkpoint) -> str:
    shards = sum(len(v) for v in state.shards.values())
    return f"{state.documents:,} documents, {state.tokens:,} tokens, {shards} complete shard{'s' * (shards != 1)}"


FLAGS = {"source": "SOURCE", "tokenizer": "--tokenizer", "val_fraction": "--val-fraction",
         "val_tokens": "--val-tokens", "max_docs": "--max-docs", "max_tokens": "--max-tokens",
         "shard_tokens": "--shard-tokens", "text_column": "--text-column", "subset": "--subset",
         "split": "--split", "streaming": "--streaming"}


def _check_same(state: _Checkpoint, settings: dict[str, Any], source_meta: dict[str, Any], stage_dir: Path) -> None:
    """A resumed prepare must make the same stream as the one it continues."""
    for key, value in settings.items():
        if state.settings.get(key) != value:
            raise NanoGPTError(f"the interrupted prepare in {stage_dir} was started with {FLAGS[key]} "
                               f"{state.settings.get(key)}, not {value}; resume with the same options, or delete "
                               "that folder to start over")
    if state.source_meta.get("source_sha256") != source_meta.get("source_sha256"):
        raise NanoGPTError(f"{settings['source']} changed since the interrupted prepare in {stage_dir} started "
                           "(its sha256 differs); delete that folder to start over")


@contextlib.contextmanager
def _locked(stage_dir: Path):
    """Only one prepare writes a staging folder at a time."""
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; one prepare per name is up to the user
        yield
        return
    with open(stage_dir / LOCK, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise NanoGPTError(f"another prepare is writing {stage_dir}; wait for it to finish") from None
        except OSError:  # a filesystem without locks (some NFS mounts): go on unlocked
            pass
        yield


class _ShardWriter:
    """Appends tokens to SPLIT-00000.bin, SPLIT-00001.bin, ... of at most shard_tokens tokens each, hashing as
    it goes. Built from a checkpoint it first cuts the open shard back to the checkpoint's length."""

    def __init__(self, folder: Path, split: str, dtype: str, shard_tokens: int, shards: list[dict[str, Any]],
                 partial: int):
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
            self.hash = _sha256_file(path, hashlib.sha256())
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
            part = ids[:self.shard_tokens - self.partial]
            data = part.tobytes()
            self.file.write(data)
            self.hash.update(data)
            self.partial += len(part)
            ids = ids[len(part):]
            if self.partial == self.shard_tokens:
                self._close()

    def _close(self) -> None:
        if self.file is None:
            return
        self.file.close()
        self.shards.append({"file": self._name(len(self.shards)), "tokens": self.partial,
                            "sha256": self.hash.hexdigest()})
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
                    yield np.array(tokens[i:min(hi, i + COPY_TOKENS)])
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
                kept.append({**shard, "tokens": keep, "sha256": _sha256_file(path)})
            else:
                kept.append(shard)
            offset += shard["tokens"]
        self.shards[:] = kept


class _Stream:
    """Routes the tokens of each batch to the train and val shards, as the module docstring says."""

    def __init__(self, stage_dir: Path, tok: Tokenizer, state: _Checkpoint, val_fraction: float,
                 val_tokens: int | None, max_docs: int | None, max_tokens: int | None, shard_tokens: int):
        self.stage_dir, self.tok, self.state = stage_dir, tok, state
        self.val_fraction, self.val_tokens, self.max_docs, self.max_tokens = val_fraction, val_tokens, max_docs, \
            max_tokens
        self.dtype = token_dtype(tok.vocab_size)
        self.writers = {s: _ShardWriter(stage_dir, s, self.dtype, shard_tokens, state.shards[s], state.partial[s])
                        for s in SPLITS}
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
                ids = ids[:self.max_tokens - st.tokens]
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
                st.characters += len(text)
                emit(flat[starts[k]:starts[k + 1]])
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


def _replace_dir(new: Path, final: Path) -> None:
    """Put `new` at `final`; an existing `final` is moved aside first and deleted only once `new` is in place."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    try:
        os.replace(new, final)
    except BaseException:
        if old is not None:
            os.replace(old, final)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)




# --- small helpers ---


class _Ticker:
    """Adds up progress (bytes or documents read) and reports it at most ten times a second, with the
    documents and tokens written so far."""

    def __init__(self, progress: Progress | None, stage: str, total: int | None, unit: str):
        self.progress, self.stage, self.total, self.unit = progress, stage, total, unit
        self.done, self.last = 0, 0.0
        self.documents = self.tokens = 0

    def __call__(self, n: int) -> None:
        self.done += n
        if self.progress is not None and time.monotonic() - self.last >= 0.1:
            self.last = time.monotonic()
            self.progress(PrepareProgress(self.stage, self.done, self.total, self.unit, self.documents, self.tokens))

    def finish(self) -> None:
        if self.progress is not None:
            self.progress(PrepareProgress(self.stage, self.done, self.done, self.unit, self.documents, self.tokens))


def _check_name(name: str) -> None:
    if not name or name in (".", "..") or name.startswith(".") or any(
            sep and sep in name for sep in ("/", "\\", os.sep, os.altsep)):
        raise NanoGPTError(f"--name must be a plain folder name (no path separators, no leading '.'), got {name!r}")


def _sha256_file(path: Path, h=None):
    """The hex sha256 of a file; with `h` given, that hash object updated with the file (to go on hashing)."""
    digest = h if h is not None else hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest if h is not None else digest.hexdigest()


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
