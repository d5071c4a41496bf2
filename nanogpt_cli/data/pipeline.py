"""The prepare pipeline: a source -> DATA_DIR/NAME/{train,val}-NNNNN.bin shards + meta.json, resumable.

    result = prepare("examples/tinyshakespeare.txt", "shk", tokenizer="char", data_dir=Path("data"))

Memory stays bounded: text is read in batches, tokenized by `num_proc` worker processes (in order, so the
output does not depend on their number) and the token ids go straight into the shards. Everything is written
into the staging folder DATA_DIR/.NAME.partial and renamed into place at the end, so a failed or interrupted
prepare leaves an earlier DATA_DIR/NAME untouched. Each time a shard is complete, the position in the source is
saved there (progress.json); `resume=True` continues from it after Ctrl-C, kill -9 or a lost connection,
skipping the documents already tokenized, and gives the same bytes as a prepare that was never interrupted.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from nanogpt_cli import __version__
from nanogpt_cli.data.reader import META
from nanogpt_cli.data.shards import (
    CHECKPOINT,
    DOC_SEPARATOR,
    MIN_SPLIT_TOKENS,
    SHARD_TOKENS,
    Checkpoint,
    SplitStream,
)
from nanogpt_cli.data.sources import DEFAULT_ENCODING, Source, resolve_source
from nanogpt_cli.data.tokenizing import batches, encoded, first_docs, skip
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.tokenizer import (
    Tokenizer,
    build_tokenizer,
    check_tokenizer_name,
    tokenizer_from_description,
)

PARTIAL = ".{name}.partial"  # the staging folder in DATA_DIR, kept after an interruption for --resume
LOCK = "lock"  # in the staging folder: held by the prepare that writes it


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


@dataclass
class PrepareOptions:
    """What to prepare and how; checked on construction, each error naming its flag."""

    source: str  # SOURCE: a text file, folder or glob, .jsonl/.json/.parquet/.csv, hf:OWNER/NAME, shakespeare
    name: str  # the folder DATA_DIR/NAME
    tokenizer: str = "gpt2"
    val_fraction: float = 0.1
    data_dir: Path = Path("data")
    text_column: str = "text"  # of structured files and hub datasets
    subset: str | None = None  # of a hub dataset
    split: str = "train"  # of a hub dataset
    streaming: bool = False  # a hub dataset, without downloading it first
    max_docs: int | None = None  # keep the first N documents
    num_proc: int = 1  # tokenizer processes; the output does not depend on it
    shard_tokens: int = SHARD_TOKENS
    max_tokens: int | None = None  # keep the first N tokens
    val_tokens: int | None = None  # the first N tokens validate, instead of val_fraction
    resume: bool = False  # continue an interrupted prepare
    encoding: str = DEFAULT_ENCODING  # of text, .jsonl/.json and .csv files

    # what a resumed prepare must share with the one it continues (num_proc does not change the output)
    SAME_ON_RESUME = (
        "source",
        "tokenizer",
        "val_fraction",
        "val_tokens",
        "max_docs",
        "max_tokens",
        "shard_tokens",
        "text_column",
        "subset",
        "split",
        "streaming",
        "encoding",
    )

    def __post_init__(self):
        self.data_dir = Path(self.data_dir)
        if (
            not self.name
            or self.name in (".", "..")
            or self.name.startswith(".")
            or any(sep and sep in self.name for sep in ("/", "\\", os.sep, os.altsep))
        ):
            raise NanoGPTError(
                f"--name must be a plain folder name (no path separators, no leading '.'), got {self.name!r}"
            )
        if not 0.0 < self.val_fraction < 1.0:
            raise NanoGPTError(f"--val-fraction must be between 0 and 1 (exclusive), got {self.val_fraction}")
        for key in ("max_docs", "max_tokens", "val_tokens", "num_proc", "shard_tokens"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise NanoGPTError(f"{flag(key)} must be a positive integer, got {value}")
        if self.val_tokens is not None and self.max_tokens is not None and self.val_tokens >= self.max_tokens:
            raise NanoGPTError(
                f"--val-tokens ({self.val_tokens:,}) must be below --max-tokens "
                f"({self.max_tokens:,}) to leave tokens to train on"
            )
        check_tokenizer_name(self.tokenizer)
        try:
            text_codec = getattr(codecs.lookup(self.encoding), "_is_text_encoding", True)  # not base64, rot13...
        except LookupError:
            text_codec = False
        if not text_codec:
            raise NanoGPTError(
                f"unknown --encoding {self.encoding!r}; give a Python text encoding such as utf-8, cp1252 or latin-1"
            )

    @property
    def final_dir(self) -> Path:
        return self.data_dir / self.name

    @property
    def settings(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in self.SAME_ON_RESUME}


def flag(key: str) -> str:
    """The command-line name of a PrepareOptions field."""
    return "SOURCE" if key == "source" else "--" + key.replace("_", "-")


def prepare(source: str, name: str, *, progress: Progress | None = None, **options: Any) -> PrepareResult:
    """Tokenize `source` into DATA_DIR/NAME/{train-00000.bin, ..., val-00000.bin, ..., meta.json}; replaces an
    earlier NAME only on success. `options` are the fields of `PrepareOptions` (tokenizer, data_dir, max_docs,
    num_proc, resume, ...); `progress(PrepareProgress)` is called now and then."""
    return prepare_with(PrepareOptions(source, name, **options), progress)


def prepare_with(opts: PrepareOptions, progress: Progress | None = None) -> PrepareResult:
    """`prepare` for options already built."""
    t0 = time.perf_counter()
    final_dir = opts.final_dir
    if final_dir.exists() and not (final_dir / META).is_file() and (not final_dir.is_dir() or any(final_dir.iterdir())):
        raise NanoGPTError(f"{final_dir} exists and is not a prepared dataset; pick another --name or --data-dir")
    with contextlib.ExitStack() as stack:
        src = resolve_source(
            opts.source,
            stack,
            text_column=opts.text_column,
            subset=opts.subset,
            split=opts.split,
            streaming=opts.streaming,
            raw_bytes=opts.tokenizer == "byte",
            encoding=opts.encoding,
        )
        with staging(opts.data_dir, opts.name) as stage:
            state, tok = _start_or_resume(stage, opts, src, progress)
            resumed_documents = state.documents
            stream = SplitStream(
                stage.path,
                tok,
                state,
                val_fraction=opts.val_fraction,
                val_tokens=opts.val_tokens,
                max_docs=opts.max_docs,
                max_tokens=opts.max_tokens,
                shard_tokens=opts.shard_tokens,
            )
            _tokenize(src, stream, opts.num_proc, progress)
            stage.drop_checkpoint()
            n_train, n_val = _finish_splits(stream, src, opts)
            bytes_on_disk = stage.commit(_meta(opts, src, stream), final_dir)
    return PrepareResult(
        name=opts.name,
        path=final_dir,
        source=opts.source,
        tokenizer=tok.name,
        vocab_size=tok.vocab_size,
        dtype=stream.dtype,
        documents=state.documents,
        val_documents=state.val_documents,
        characters=state.characters,
        train_tokens=n_train,
        val_tokens=n_val,
        shards={s: len(w.shards) for s, w in stream.writers.items()},
        bytes_on_disk=bytes_on_disk,
        elapsed_s=time.perf_counter() - t0,
        source_bytes=src.total if src.unit == "bytes" else None,
        num_proc=opts.num_proc,
        resumed_documents=resumed_documents,
        val_split=stream.val_split,
    )


def interrupted_prepare(data_dir: Path, name: str) -> str | None:
    """One line about the interrupted prepare of NAME kept in DATA_DIR, or None when there is none."""
    stage_dir = Path(data_dir) / PARTIAL.format(name=name)
    state = Checkpoint.read(stage_dir) if stage_dir.is_dir() else None
    return None if state is None else f"{stage_dir} keeps {state.describe()}; rerun with --resume to continue"


def _start_or_resume(
    stage: Staging, opts: PrepareOptions, src: Source, progress: Progress | None
) -> tuple[Checkpoint, Tokenizer]:
    """The checkpoint to continue from (a fresh one unless resuming) and the tokenizer it was made with."""
    state = Checkpoint.read(stage.path)
    if state is not None and not opts.resume:
        raise NanoGPTError(
            f"{stage.path} holds an interrupted prepare of '{opts.name}' ({state.describe()}); "
            "add --resume to continue it, or delete that folder to start over"
        )
    if state is not None:
        _check_same(state, opts, src.meta, stage.path)
        return state, tokenizer_from_description(state.tokenizer, stage.path)
    stage.clear()  # shards of a prepare killed before its first checkpoint
    tok = _char_tokenizer(src, opts.max_docs, progress) if opts.tokenizer == "char" else build_tokenizer(opts.tokenizer)
    tok.save_files(stage.path)  # a Hugging Face tokenizer.json goes beside meta.json
    return Checkpoint(settings=opts.settings, source_meta=src.meta, tokenizer=tok.describe()), tok


def _check_same(state: Checkpoint, opts: PrepareOptions, source_meta: dict[str, Any], stage_dir: Path) -> None:
    """A resumed prepare must make the same stream as the one it continues."""
    defaults = {f.name: f.default for f in fields(PrepareOptions)}  # what a checkpoint without the key meant
    for key, value in opts.settings.items():
        saved = state.settings.get(key, defaults[key])
        if saved != value:
            raise NanoGPTError(
                f"the interrupted prepare in {stage_dir} was started with {flag(key)} {saved}, not "
                f"{value}; resume with the same options, or delete that folder to start over"
            )
    if state.source_meta.get("source_sha256") != source_meta.get("source_sha256"):
        raise NanoGPTError(
            f"{opts.source} changed since the interrupted prepare in {stage_dir} started "
            "(its sha256 differs); delete that folder to start over"
        )


def _tokenize(src: Source, stream: SplitStream, num_proc: int, progress: Progress | None) -> None:
    """Read the source past what the checkpoint holds, tokenize it and write the shards, checkpointing each time
    a shard is complete. Progress counts what is written: the reading runs ahead of the workers."""
    state = stream.state
    tick = Ticker(progress, "tokenizing", src.total, src.unit)
    read = Ticker(None, "reading", src.total, src.unit)  # counts only
    pieces = skip(src.pieces(read), state.consumed)  # what an interrupted prepare already wrote
    with contextlib.closing(encoded(batches(pieces, lambda: read.done), stream.tok, stream.dtype, num_proc)) as work:
        for batch, (flat, lengths) in work:
            more = stream.add(batch.pieces, flat, lengths)
            tick.report(batch.read_to, state.documents, state.tokens)
            if not more:
                break
            if stream.shard_completed:
                stream.checkpoint()
    tick.finish()


def _finish_splits(stream: SplitStream, src: Source, opts: PrepareOptions) -> tuple[int, int]:
    """Close the shards and check both splits are of use: (train tokens, val tokens)."""
    if stream.finish() == 0:
        raise NanoGPTError(f"{src.label} has no text")
    n_train, n_val = stream.writers["train"].tokens, stream.writers["val"].tokens
    if min(n_train, n_val) < MIN_SPLIT_TOKENS:
        hint = "--val-tokens" if opts.val_tokens is not None else "--val-fraction"
        raise NanoGPTError(
            f"{src.label} is too small to split: {n_train + n_val:,} tokens give {n_train:,} train and "
            f"{n_val:,} validation tokens (at least {MIN_SPLIT_TOKENS} each are needed); use more text or "
            f"another {hint}"
        )
    return n_train, n_val


def _meta(opts: PrepareOptions, src: Source, stream: SplitStream) -> dict[str, Any]:
    """meta.json: what the dataset is, how it was made, and its shards."""
    state, tok = stream.state, stream.tok
    meta = {
        "version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "source": opts.source,
        **src.meta,
        "tokenizer": tok.describe(),
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "dtype": stream.dtype,
        "documents": state.documents,
        "val_documents": state.val_documents,
        "val_split": stream.val_split,
        "val_fraction": opts.val_fraction,
        "characters": state.characters,
        "train_tokens": stream.writers["train"].tokens,
        "val_tokens": stream.writers["val"].tokens,
        "shard_tokens": opts.shard_tokens,
        "shards": {s: w.shards for s, w in stream.writers.items()},
    }
    encoding = opts.encoding if opts.encoding != DEFAULT_ENCODING else None
    for key, value in (
        ("max_docs", opts.max_docs),
        ("max_tokens", opts.max_tokens),
        ("val_head_tokens", opts.val_tokens),
        ("encoding", encoding),
    ):
        if value is not None:
            meta[key] = value
    return meta


def _char_tokenizer(src: Source, max_docs: int | None, progress: Progress | None) -> Tokenizer:
    """A first pass over the source: the char vocabulary is every character in it (plus the separator)."""
    tick = Ticker(progress, "reading characters", src.total, src.unit)
    docs = 0

    def texts():
        nonlocal docs
        started = False
        for text, ends in first_docs(src.pieces(tick), max_docs):
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


# --- the staging folder ---


class Staging:
    """DATA_DIR/.NAME.partial while a prepare writes it: shards, progress.json, and the lock."""

    def __init__(self, path: Path):
        self.path = path

    def clear(self) -> None:
        """Delete what an earlier prepare left before its first checkpoint: nothing there can be resumed."""
        for p in self.path.iterdir():
            if p.name != LOCK:
                p.unlink()

    def drop_checkpoint(self) -> None:
        """From here on the shards change in place (the tail of train may move to val): a prepare stopped now
        starts over rather than resume from files that no longer match the checkpoint."""
        (self.path / CHECKPOINT).unlink(missing_ok=True)

    def commit(self, meta: dict[str, Any], final_dir: Path) -> int:
        """Write meta.json and put the folder in place of `final_dir`; returns the bytes on disk."""
        (self.path / META).write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        (self.path / LOCK).unlink(missing_ok=True)
        bytes_on_disk = sum(p.stat().st_size for p in self.path.iterdir())
        _replace_dir(self.path, final_dir)
        return bytes_on_disk


@contextlib.contextmanager
def staging(data_dir: Path, name: str) -> Iterator[Staging]:
    """The staging folder of NAME, created and locked. On an error it is deleted unless it holds a checkpoint to
    resume from (then it is kept for --resume), and so is DATA_DIR when this created it."""
    created_data_dir = not data_dir.exists()
    path = data_dir / PARTIAL.format(name=name)
    path.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        try:
            yield Staging(path)
        except BaseException:
            if not (path / CHECKPOINT).is_file():  # nothing to resume from: leave no trace
                shutil.rmtree(path, ignore_errors=True)
                if created_data_dir:
                    with contextlib.suppress(OSError):
                        data_dir.rmdir()
            raise


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


class Ticker:
    """Adds up progress (bytes or documents) and reports it at most ten times a second, with the documents and
    tokens written so far."""

    def __init__(self, progress: Progress | None, stage: str, total: int | None, unit: str):
        self.progress, self.stage, self.total, self.unit = progress, stage, total, unit
        self.done, self.last = 0, 0.0
        self.documents = self.tokens = 0

    def __call__(self, n: int) -> None:
        self.done += n
        if self.progress is not None and time.monotonic() - self.last >= 0.1:
            self.last = time.monotonic()
            self.progress(PrepareProgress(self.stage, self.done, self.total, self.unit, self.documents, self.tokens))

    def report(self, done: int, documents: int, tokens: int) -> None:
        """Where the stage is now, and the documents and tokens written so far."""
        self.documents, self.tokens = documents, tokens
        self(done - self.done)

    def finish(self) -> None:
        if self.progress is not None:
            self.progress(PrepareProgress(self.stage, self.done, self.done, self.unit, self.documents, self.tokens))
