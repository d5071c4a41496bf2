"""Prepare a dataset: text sources -> DATA_DIR/NAME/{train,val}.bin + meta.json, and read one back.

    result = prepare("examples/tinyshakespeare.txt", "shk", tokenizer="char", data_dir=Path("data"))

A source is a text file, a folder or glob of them, a .jsonl/.json/.parquet/.csv file (`text_column`),
`hf:OWNER/NAME` on the Hugging Face hub, or `shakespeare` (Tiny Shakespeare, downloaded once and cached).
Every text file, row or hub record is one document.

The .bin files are flat token ids (uint16 when the vocabulary fits, else uint32). Documents are separated by
the end-of-text token where the tokenizer has one, else by the text "\\n\\n"; the separator goes *between*
documents, so one text gives exactly its own tokens.

Validation is held-out text:
- one document: the head (1 - val_fraction of its tokens) trains, the contiguous tail validates;
- several documents: document i validates when floor((i+1)*f) > floor(i*f), i.e. every (1/f)-th document:
  an exact, deterministic share spread over the whole source. When that picks none (fewer than 1/f documents),
  the last document validates; when the documents it picks hold more than 2f of the tokens (a few files), the
  tail of the token stream validates instead, cut at a document boundary within a quarter of its length.

Memory stays bounded: text is read and tokenized in batches and the token ids go straight to disk. Everything
is written into DATA_DIR/.NAME.tmp-PID and renamed into place at the end, so a failed or interrupted prepare
leaves an earlier DATA_DIR/NAME untouched.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import hashlib
import itertools
import json
import os
import shutil
import time
import urllib.error
import urllib.request
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from nanogpt_cli import __version__
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.tokenizer import Tokenizer, build_tokenizer, check_tokenizer_name

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
TEXT_SUFFIXES = (".txt", ".md")  # what a folder contributes besides the structured files
STRUCTURED = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}  # suffix -> datasets builder
SPLITS = ("train", "val")
DOC_SEPARATOR = "\n\n"  # between documents when the tokenizer has no end-of-text token
MIN_SPLIT_TOKENS = 2  # a split needs an input and a target token to be of any use

# batch sizes: they bound memory, not results (text is only cut where tokenizers split anyway, see _safe_cut)
READ_BYTES = 1 << 20  # plain text is read this many bytes at a time
MAX_PIECE_CHARS = 1 << 23  # a piece with no safe cut in it is cut here anyway
BATCH_CHARS = 1 << 24  # characters handed to the tokenizer at once; its threads share a batch
BATCH_DOCS = 4096
SPLIT_TOKENS = 1 << 22  # tokens copied at a time when splitting into train and val

Progress = Callable[[str, int, "int | None"], None]  # (stage, done, total or None when unknown)
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
    val_documents: int  # documents in val.bin (wholly or in part); with one document its tail is val
    characters: int
    train_tokens: int
    val_tokens: int
    bytes_on_disk: int  # train.bin + val.bin + meta.json
    elapsed_s: float
    val_split: str = "documents"  # "tail" (of the token stream) or "documents" (every (1/f)-th)

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
            progress: Progress | None = None) -> PrepareResult:
    """Tokenize `source` into DATA_DIR/NAME/{train.bin, val.bin, meta.json}; replaces an earlier NAME only on
    success. `subset`, `split` and `streaming` apply to hf: sources; `max_docs` keeps the first N documents;
    `num_proc` is the number of tokenizer threads; `progress(stage, done, total)` is called now and then."""
    t0 = time.perf_counter()
    data_dir = Path(data_dir)
    _check_name(name)
    if not 0.0 < val_fraction < 1.0:
        raise NanoGPTError(f"--val-fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    if max_docs is not None and max_docs < 1:
        raise NanoGPTError(f"--max-docs must be a positive integer, got {max_docs}")
    if num_proc < 1:
        raise NanoGPTError(f"--num-proc must be a positive integer, got {num_proc}")
    check_tokenizer_name(tokenizer)
    final_dir = data_dir / name
    if final_dir.exists() and not (final_dir / "meta.json").is_file() and (
            not final_dir.is_dir() or any(final_dir.iterdir())):
        raise NanoGPTError(f"{final_dir} exists and is not a prepared dataset; pick another --name or --data-dir")

    with contextlib.ExitStack() as stack:
        src = _resolve_source(source, text_column, subset, split, streaming,
                              raw_bytes=tokenizer == "byte", stack=stack)
        if tokenizer == "char":
            tok = _char_tokenizer(src, max_docs, progress)
        else:
            tok = build_tokenizer(tokenizer)
        dtype = token_dtype(tok.vocab_size)

        created_data_dir = not data_dir.exists()
        tmp_dir = data_dir / f".{name}.tmp-{os.getpid()}"
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp_dir, ignore_errors=True)
            tmp_dir.mkdir()
            all_path = tmp_dir / "all.bin"
            tick = _Ticker(progress, "tokenizing", src.total)
            documents, characters, doc_ends = _write_tokens(_first_docs(src.pieces(tick), max_docs), tok,
                                                            all_path, dtype, num_proc)
            tick.finish()
            if documents == 0:
                raise NanoGPTError(f"{src.label} has no text")
            n_train, n_val, val_documents, val_split = _split(all_path, tmp_dir, dtype, doc_ends, val_fraction,
                                                              progress)
            if min(n_train, n_val) < MIN_SPLIT_TOKENS:
                raise NanoGPTError(
                    f"{src.label} is too small to split: {n_train + n_val:,} tokens give {n_train:,} train and "
                    f"{n_val:,} validation tokens (at least {MIN_SPLIT_TOKENS} each are needed); use more text or "
                    "another --val-fraction")
            meta = {
                "version": __version__,
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "source": source,
                **src.meta,
                "tokenizer": tok.describe(),
                "vocab_size": tok.vocab_size,
                "eot_id": tok.eot_id,
                "dtype": dtype,
                "documents": documents,
                "val_documents": val_documents,
                "val_split": val_split,
                "val_fraction": val_fraction,
                "characters": characters,
                "train_tokens": n_train,
                "val_tokens": n_val,
            }
            if max_docs is not None:
                meta["max_docs"] = max_docs
            (tmp_dir / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
            bytes_on_disk = sum(p.stat().st_size for p in tmp_dir.iterdir())
            _replace_dir(tmp_dir, final_dir)
        except BaseException:
            if created_data_dir:  # leave no trace of a failed run, not even the folder we made for it
                shutil.rmtree(tmp_dir, ignore_errors=True)
                with contextlib.suppress(OSError):
                    data_dir.rmdir()
            raise
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)

    return PrepareResult(name=name, path=final_dir, source=source, tokenizer=tok.name, vocab_size=tok.vocab_size,
                         dtype=dtype, documents=documents, val_documents=val_documents, characters=characters,
                         train_tokens=n_train, val_tokens=n_val, bytes_on_disk=bytes_on_disk,
                         elapsed_s=time.perf_counter() - t0, val_split=val_split)


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


def open_split(data_dir: Path, name: str, split: str) -> np.memmap:
    """The tokens of one split ('train' or 'val') as a read-only memmap with meta.json's dtype."""
    if split not in SPLITS:
        raise NanoGPTError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    meta = load_meta(data_dir, name)
    path = Path(data_dir) / name / f"{split}.bin"
    dtype = np.dtype(meta["dtype"])
    expected = meta[f"{split}_tokens"] * dtype.itemsize
    size = path.stat().st_size if path.is_file() else -1
    if size != expected or size == 0:
        raise NanoGPTError(f"{path} should hold {meta[f'{split}_tokens']:,} tokens ({expected:,} bytes) but "
                           f"{'is missing' if size < 0 else f'has {size:,} bytes'}; prepare the dataset again")
    return np.memmap(path, dtype=dtype, mode="r")


# --- sources ---


@dataclass
class _Source:
    label: str  # how messages name it
    pieces: Callable[[Callable[[int], None]], Pieces]  # one pass over the text; calls tick(n) as it goes
    total: int | None  # the progress total in tick units (bytes or documents), None when unknown
    meta: dict[str, Any]  # what meta.json records about it besides the SOURCE string


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
    return _Source(label=label, pieces=pieces, total=None if streaming else len(ds), meta=meta)


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
    import datasets
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


# --- tokenizing and splitting ---


def _char_tokenizer(src: _Source, max_docs: int | None, progress: Progress | None) -> Tokenizer:
    """A first pass over the source: the char vocabulary is every character in it (plus the separator)."""
    tick = _Ticker(progress, "reading characters", src.total)
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


def _write_tokens(pieces: Pieces, tok: Tokenizer, path: Path, dtype: str, num_proc: int
                  ) -> tuple[int, int, np.ndarray]:
    """Tokenize every piece into `path`; returns (documents, characters, token offset where each document ends)."""
    sep: list[int] | None = None  # encoded on first use: one document's char vocabulary may lack it
    documents = characters = written = 0
    started = False  # the current document has text (empty documents are skipped entirely)
    doc_ends = array("q")
    batch: list[tuple[str, bool]] = []
    batch_chars = 0

    with open(path, "wb") as f:
        def flush():
            nonlocal documents, characters, written, started, sep
            chunks: list[list[int]] = []  # the batch's tokens in file order, written with one call
            for (text, ends), ids in zip(batch, tok.encode_batch([t for t, _ in batch], num_threads=num_proc)):
                if text:
                    if not started and documents > 0:
                        if sep is None:
                            sep = [tok.eot_id] if tok.eot_id is not None else tok.encode(DOC_SEPARATOR)
                        chunks.append(sep)  # between documents, not after the last: one text is its tokens
                        written += len(sep)
                    started = True
                    characters += len(text)
                    chunks.append(ids)
                    written += len(ids)
                if ends and started:
                    documents += 1
                    doc_ends.append(written)
                    started = False
            np.array(list(itertools.chain.from_iterable(chunks)), dtype=dtype).tofile(f)
            batch.clear()

        for text, ends in pieces:
            batch.append((text, ends))
            batch_chars += len(text)
            if batch_chars >= BATCH_CHARS or len(batch) >= BATCH_DOCS:
                flush()
                batch_chars = 0
        flush()
    return documents, characters, np.frombuffer(doc_ends, dtype=np.int64) if doc_ends else np.zeros(0, np.int64)


def _split(all_path: Path, out_dir: Path, dtype: str, doc_ends: np.ndarray, val_fraction: float,
           progress: Progress | None) -> tuple[int, int, int, str]:
    """all.bin -> train.bin + val.bin as the module docstring says; returns (train tokens, val tokens, val docs,
    "tail" or "documents")."""
    itemsize = np.dtype(dtype).itemsize
    n = all_path.stat().st_size // itemsize
    train_path, val_path = out_dir / "train.bin", out_dir / "val.bin"
    tick = _Ticker(progress, "splitting", n)
    i = np.arange(len(doc_ends))
    in_val = np.floor((i + 1) * val_fraction) > np.floor(i * val_fraction)
    if len(doc_ends) > 1 and not in_val.any():
        in_val[-1] = True
    doc_lengths = np.diff(np.concatenate(([0], doc_ends)))
    if len(doc_ends) <= 1 or doc_lengths[in_val].sum() > 2 * val_fraction * n:
        # one text, or a few documents where whole ones would put far more than val_fraction into val (2 files:
        # 55 %): the tail of the token stream validates, cut at a document boundary when one is close
        n_val = round(n * val_fraction)
        boundaries = doc_ends[:-1]
        if len(boundaries):
            near = int(boundaries[np.argmin(np.abs(boundaries - (n - n_val)))])
            if abs(near - (n - n_val)) <= n_val // 4:
                n_val = n - near
        val_documents = max(1, int((doc_ends > n - n_val).sum()))
        if min(n_val, n - n_val) < MIN_SPLIT_TOKENS:
            return n - n_val, n_val, val_documents, "tail"
        tokens = np.memmap(all_path, dtype=dtype, mode="r")
        with open(val_path, "wb") as fv:
            for start in range(n - n_val, n, SPLIT_TOKENS):
                np.asarray(tokens[start:min(n, start + SPLIT_TOKENS)]).tofile(fv)
                tick(min(SPLIT_TOKENS, n - start))
        del tokens  # release the map before the file shrinks under it
        os.replace(all_path, train_path)
        os.truncate(train_path, (n - n_val) * itemsize)
        tick.finish()
        return n - n_val, n_val, val_documents, "tail"

    tokens = np.memmap(all_path, dtype=dtype, mode="r")
    n_val = 0
    with open(train_path, "wb") as ft, open(val_path, "wb") as fv:
        for start in range(0, n, SPLIT_TOKENS):
            stop = min(n, start + SPLIT_TOKENS)
            # the documents that overlap [start, stop) and how many of their tokens lie inside it
            d0 = np.searchsorted(doc_ends, start, side="right")
            d1 = np.searchsorted(doc_ends, stop - 1, side="right")
            edges = np.clip(doc_ends[d0:d1 + 1], start, stop)
            lengths = np.diff(np.concatenate(([start], edges)))
            mask = np.repeat(in_val[d0:d1 + 1], lengths)
            block = np.asarray(tokens[start:stop])
            block[~mask].tofile(ft)
            block[mask].tofile(fv)
            n_val += int(mask.sum())
            tick(stop - start)
    del tokens
    all_path.unlink()
    tick.finish()
    return n - n_val, n_val, int(in_val.sum()), "documents"


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
    """Adds up progress and reports it at most ten times a second."""

    def __init__(self, progress: Progress | None, stage: str, total: int | None):
        self.progress, self.stage, self.total = progress, stage, total
        self.done, self.last = 0, 0.0

    def __call__(self, n: int) -> None:
        self.done += n
        if self.progress is not None and time.monotonic() - self.last >= 0.1:
            self.last = time.monotonic()
            self.progress(self.stage, self.done, self.total)

    def finish(self) -> None:
        if self.progress is not None:
            self.progress(self.stage, self.done, self.done)


def _check_name(name: str) -> None:
    if not name or name in (".", "..") or name.startswith(".") or any(
            sep and sep in name for sep in ("/", "\\", os.sep, os.altsep)):
        raise NanoGPTError(f"--name must be a plain folder name (no path separators, no leading '.'), got {name!r}")


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
