"""Where prepare's text comes from: every source as one stream of pieces of documents.

    src = resolve_source("docs.jsonl", text_column="text", stack=stack); for text, ends in src.pieces(tick): ...

A source is a text file, a folder or glob of them, a .jsonl/.json/.parquet/.csv file (`text_column`, read
through `datasets` with local data_files), `hf:OWNER/NAME` on the Hugging Face hub, or `shakespeare` (Tiny
Shakespeare, downloaded once and cached). Every text file, row or hub record is one document; a long text file
comes in pieces cut only where tokenizers split anyway. `datasets` is imported only when a source needs it.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import hashlib
import itertools
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanogpt_cli.data.reader import sha256_file
from nanogpt_cli.errors import NanoGPTError, first_line

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
TEXT_SUFFIXES = (".txt", ".md")  # what a folder contributes besides the structured files
STRUCTURED = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}  # suffix -> datasets builder
DEFAULT_ENCODING = "utf-8"

# batch sizes: they bound memory, not results (text is only cut where tokenizers split anyway, see safe_cut)
READ_BYTES = 1 << 20  # plain text is read this many bytes at a time
MAX_PIECE_CHARS = 1 << 23  # a piece with no safe cut in it is cut here anyway

Tick = Callable[[int], None]  # called with what was just read: bytes, or 1 per document of a hub dataset
Pieces = Iterator[tuple[str, bool]]  # (text, ends a document); a long document comes in several pieces


@dataclass
class Source:
    """One pass over a source's text, and what prepare reports and records about it."""

    label: str  # how messages name it
    pieces: Callable[[Tick], Pieces]  # one pass over the text; calls tick(n) as it goes
    total: int | None  # the progress total in tick units (bytes or documents), None when unknown
    meta: dict[str, Any]  # what meta.json records about it besides the SOURCE string
    unit: str = "bytes"  # of tick and total: "bytes" for local files, "documents" for hub datasets


@contextlib.contextmanager
def open_source(
    source: str,
    text_column: str = "text",
    subset: str | None = None,
    split: str = "train",
    streaming: bool = False,
    encoding: str = DEFAULT_ENCODING,
) -> Iterator[Source]:
    """Any SOURCE that `prepare` reads, for other readers (tokenizer training): `.label`, `.total`, `.unit`, and
    `.pieces(tick)`, which yields (text, ends a document) and calls tick(n) with the bytes or documents read."""
    with contextlib.ExitStack() as stack:
        yield resolve_source(source, stack, text_column, subset, split, streaming, encoding=encoding)


def resolve_source(
    source: str,
    stack: contextlib.ExitStack,
    text_column: str = "text",
    subset: str | None = None,
    split: str = "train",
    streaming: bool = False,
    raw_bytes: bool = False,
    encoding: str = DEFAULT_ENCODING,
) -> Source:
    """The source named by SOURCE. `subset`, `split` and `streaming` apply to hf: sources; `raw_bytes` keeps
    bytes that do not decode (for the byte tokenizer); `encoding` decodes text, .jsonl/.json and .csv files.
    `datasets` stays quiet until `stack` closes."""
    path = Path(source).expanduser()
    if not path.exists() and source.startswith("hf:"):
        offline_unless_hub_reachable()
        stack.enter_context(_quiet_datasets(progress_bars=True))
        return _hf_source(source[3:], text_column, subset, split, streaming)
    files, downloaded = _local_files(source, path)
    if len(files) == 1 and files[0].stat().st_size == 0:
        raise NanoGPTError(f"{files[0]} is empty")  # several files: empty ones are skipped like empty rows
    if any(f.suffix.lower() in STRUCTURED for f in files):
        stack.enter_context(_quiet_datasets(progress_bars=False))
    meta: dict[str, Any] = {}
    if len(files) == 1:
        meta["source_sha256"] = sha256_file(files[0])
        if downloaded:
            meta["source_url"] = SHAKESPEARE_URL
    if any(f.suffix.lower() in STRUCTURED for f in files):
        meta["text_column"] = text_column

    def pieces(tick: Tick) -> Pieces:
        # consecutive files of one structured format go to `datasets` together: one load for many shards
        for builder, group in itertools.groupby(files, key=lambda f: STRUCTURED.get(f.suffix.lower())):
            if builder is None:
                for f in group:
                    yield from _read_text_file(f, encoding, raw_bytes, tick)
            else:
                yield from _read_structured(builder, list(group), text_column, encoding, tick)

    label = str(files[0]) if len(files) == 1 else source
    return Source(label=label, pieces=pieces, total=sum(f.stat().st_size for f in files), meta=meta)


def _local_files(source: str, path: Path) -> tuple[list[Path], bool]:
    """The files SOURCE names, in the order they are read, and whether it is the Tiny Shakespeare download."""
    downloaded = not path.exists() and source == "shakespeare"
    if downloaded:
        files = [download_shakespeare()]
    elif path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in TEXT_SUFFIXES + tuple(STRUCTURED)
        )
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
        raise NanoGPTError(
            f"{source} does not exist; SOURCE is a text file, a folder or glob of them, a "
            ".jsonl/.json/.parquet/.csv file, hf:OWNER/NAME, or shakespeare"
        )
    return files, downloaded


def _read_text_file(path: Path, encoding: str, raw_bytes: bool, tick: Tick) -> Pieces:
    """One text file as one document, in pieces of about READ_BYTES, cut only where tokenization is unaffected.
    With raw_bytes (and UTF-8), bytes that do not decode are kept as surrogates: the byte tokenizer gets them back."""
    errors = "surrogateescape" if raw_bytes and encoding == DEFAULT_ENCODING else "strict"
    decoder = codecs.getincrementaldecoder(encoding)(errors=errors)  # no newline translation: \r\n stays
    offset = 0
    pending = ""
    with open(path, "rb") as f:
        while True:
            block = f.read(READ_BYTES)
            try:
                text = decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:
                raise _not_decodable(path, encoding, offset + e.start) from None
            if not raw_bytes and "\x00" in text:
                raise NanoGPTError(
                    f"{path} looks binary (it contains NUL bytes); use --tokenizer byte to tokenize raw bytes"
                )
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


def _not_decodable(path: Path, encoding: str, offset: int) -> NanoGPTError:
    what = "UTF-8" if encoding == DEFAULT_ENCODING else encoding
    hint = (
        "pass its encoding with --encoding (e.g. --encoding cp1252)"
        if encoding == DEFAULT_ENCODING
        else "pass its encoding with --encoding"
    )
    return NanoGPTError(
        f"{path} is not {what} text (invalid byte near offset {offset:,}); {hint}, or use "
        "--tokenizer byte to tokenize raw bytes"
    )


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


def _read_structured(builder: str, files: list[Path], text_column: str, encoding: str, tick: Tick) -> Pieces:
    """Rows of .jsonl/.json/.parquet/.csv files through `datasets`, streamed: no Arrow copy, bounded memory.
    Parquet text is UTF-8 by its format; json and csv files are decoded with `encoding`."""
    import datasets

    label = str(files[0]) if len(files) == 1 else f"the {builder} files"
    # progress in bytes, as for text files: a row's text counts its UTF-8 bytes (the file's rest, its JSON or CSV
    # around the text, is counted at the end), so the bar and MB/s measure bytes, not characters
    left = sum(f.stat().st_size for f in files)

    def spend(n: int) -> None:
        nonlocal left
        n = min(n, left)
        left -= n
        tick(n)

    try:
        options = {"encoding": encoding} if encoding != DEFAULT_ENCODING and builder != "parquet" else {}
        ds = datasets.load_dataset(
            builder, data_files=[str(f) for f in files], split="train", streaming=True, **options
        )
        yield from _rows(ds, label, text_column, spend, text_bytes=True)
    except NanoGPTError:
        raise
    except Exception as e:  # pyarrow and datasets raise many types for a bad file; all mean "cannot read it"
        raise NanoGPTError(f"could not read {label}: {first_line(e)}") from None
    tick(left)


def _rows(ds, label: str, text_column: str, tick: Tick, text_bytes: bool = False) -> Pieces:
    """The text of each row; tick(n) with its UTF-8 bytes (text_bytes) or its characters."""
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
                raise NanoGPTError(
                    f"column {text_column!r} of {label} holds {type(value).__name__} values, not "
                    "text; pass --text-column with a text column"
                )
            tick(len(value.encode("utf-8", "surrogatepass")) if text_bytes else len(value))
            yield value, True


def _no_column(label: str, text_column: str, columns: list[str]) -> NanoGPTError:
    return NanoGPTError(
        f"{label} has no column {text_column!r}; its columns are {', '.join(columns)} (choose one with --text-column)"
    )


def _hf_source(repo: str, text_column: str, subset: str | None, split: str, streaming: bool) -> Source:
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    if repo.count("/") > 1 or not repo.strip("/"):
        raise NanoGPTError(f"hf:{repo} is not a hub dataset name; write hf:OWNER/NAME")
    try:
        ds = datasets.load_dataset(repo, subset, split=split, streaming=streaming)
    except DatasetNotFoundError:
        raise NanoGPTError(
            f"hf:{repo} is not a dataset on the Hugging Face hub, or it is gated or private "
            "(log in with `hf auth login`)"
        ) from None
    except ConnectionError:
        raise NanoGPTError(
            f"could not reach the Hugging Face hub to load hf:{repo} ({_hub_unreachable or 'offline?'})"
            "; load it once while online so it is cached, or pass a local file"
        ) from None
    except Exception as e:  # a missing subset or split: datasets' message lists the valid ones
        raise NanoGPTError(f"could not load hf:{repo}: {first_line(e)}") from None
    label = f"hf:{repo}"

    def pieces(tick: Tick) -> Pieces:
        try:
            yield from _rows(ds, label, text_column, lambda n: tick(1))
        except NanoGPTError:
            raise
        except ConnectionError:
            raise NanoGPTError(f"lost the connection to the Hugging Face hub while streaming hf:{repo}") from None
        except Exception as e:
            raise NanoGPTError(f"could not read hf:{repo}: {first_line(e)}") from None

    meta = {"subset": subset, "split": split, "text_column": text_column}
    return Source(label=label, pieces=pieces, total=None if streaming else len(ds), meta=meta, unit="documents")


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


def offline_unless_hub_reachable(timeout_s: float = 3.0) -> None:
    """Ask the hub once, with a short timeout; when it does not answer, switch the hub libraries to offline mode
    (cached datasets still load), instead of their ~30 s of retries before the same failure."""

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:
        urllib.request.urlopen(
            urllib.request.Request(endpoint + "/api/whoami-v2", method="HEAD"), timeout=timeout_s
        ).close()
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
    if path.is_file() and sha256_file(path) == SHAKESPEARE_SHA256:
        return path
    try:
        with urllib.request.urlopen(SHAKESPEARE_URL, timeout=30) as response:
            data = response.read()
    except (OSError, ValueError) as e:  # URLError is an OSError
        raise NanoGPTError(
            f"could not download Tiny Shakespeare from {SHAKESPEARE_URL} ({first_line(e)}); "
            "pass a local copy instead, e.g. nanogpt prepare examples/tinyshakespeare.txt "
            "--name shakespeare"
        ) from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHAKESPEARE_SHA256:
        raise NanoGPTError(
            f"the download from {SHAKESPEARE_URL} has sha256 {digest}, not {SHAKESPEARE_SHA256}; "
            "it was not kept, try again or pass a local copy of Tiny Shakespeare"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path
