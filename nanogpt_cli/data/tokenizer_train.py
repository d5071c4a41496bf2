"""Train a byte-level BPE tokenizer on any source `prepare` reads and save it as TOKENIZERS_DIR/NAME.

    result = train_tokenizer("examples/tinyshakespeare.txt", "shk2k", vocab_size=2048)
    # then: nanogpt prepare examples/tinyshakespeare.txt --name shk --tokenizer shk2k

The folder holds ranks.tiktoken and tokenizer.json (see tokenizer.py); it is written beside the target and
renamed into place, so a refusal, an error or Ctrl-C leaves nothing behind.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from nanogpt_cli import __version__
from nanogpt_cli.data import PrepareProgress, Progress, open_source
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.tokenizer import EOT, TOKENIZERS_DIR, BPETokenizer, available_tokenizers, check_bpe_settings, train_bpe


@dataclass
class TokenizerTrainResult:
    tokenizer: BPETokenizer
    path: Path  # TOKENIZERS_DIR/NAME
    source: str
    characters: int  # read from the source (at most --max-chars)
    documents: int
    elapsed_s: float
    requested_vocab_size: int

    @property
    def chars_per_s(self) -> float:
        return self.characters / max(self.elapsed_s, 1e-9)


def train_tokenizer(
    source: str,
    name: str,
    vocab_size: int,
    pattern: str = "gpt4",
    special_tokens: Sequence[str] = (EOT,),
    max_chars: int | None = None,
    tokenizers_dir: Path = TOKENIZERS_DIR,
    text_column: str = "text",
    subset: str | None = None,
    split: str = "train",
    streaming: bool = False,
    force: bool = False,
    progress: Progress | None = None,
) -> TokenizerTrainResult:
    """Learn a `vocab_size` BPE from the first `max_chars` characters of `source` (all of it when None) and
    save it as TOKENIZERS_DIR/NAME. `progress(PrepareProgress)` hears the reading and the merging stages."""
    t0 = time.perf_counter()
    check_bpe_settings(vocab_size, pattern, special_tokens)
    _check_name(name)
    if max_chars is not None and max_chars < 1:
        raise NanoGPTError(f"--max-chars must be a positive integer, got {max_chars}")
    out = Path(tokenizers_dir) / name
    if out.exists() and not force:
        raise NanoGPTError(f"{out} already exists; pass --force to replace it, or pick another --name")
    counts = {"characters": 0, "documents": 0}
    with open_source(source, text_column, subset, split, streaming) as src:
        texts = _texts(src, max_chars, counts, progress)
        tok = train_bpe(texts, vocab_size, name, pattern, special_tokens)
        if counts["characters"] == 0:
            raise NanoGPTError(f"{src.label} has no text")
    if progress is not None:
        progress(PrepareProgress("learning merges", 1, 1, "documents", counts["documents"]))
    elapsed = time.perf_counter() - t0
    trained = {
        "source": source,
        "characters": counts["characters"],
        "documents": counts["documents"],
        "requested_vocab_size": vocab_size,
        "seconds": round(elapsed, 3),
        "nanogpt": __version__,
    }
    _save(tok, out, trained)
    return TokenizerTrainResult(tok, out, source, counts["characters"], counts["documents"], elapsed, vocab_size)


def _texts(src, max_chars: int | None, counts: dict[str, int], progress: Progress | None) -> Iterator[str]:
    """The source's pieces, cut at max_chars, counting characters and documents and reporting progress."""
    done, last = 0, 0.0

    def tick(n: int) -> None:
        nonlocal done, last
        done += n
        if progress is not None and time.monotonic() - last >= 0.1:
            last = time.monotonic()
            progress(PrepareProgress("reading text", done, src.total, src.unit, counts["documents"]))

    pieces = src.pieces(tick)
    try:
        for text, ends in pieces:
            if max_chars is not None:
                text = text[: max_chars - counts["characters"]]
            counts["characters"] += len(text)
            counts["documents"] += bool(ends and text)
            if text:
                yield text
            if max_chars is not None and counts["characters"] >= max_chars:
                break
    finally:
        pieces.close()
    if progress is not None and counts["characters"]:  # no text is an error, said once by the caller
        progress(PrepareProgress("reading text", done, done, src.unit, counts["documents"]))
        progress(PrepareProgress("learning merges", 0, None, "documents", counts["documents"]))


def _check_name(name: str) -> None:
    if not name or name.startswith(".") or "/" in name or "\\" in name or (os.sep in name):
        raise NanoGPTError(f"--name must be a plain folder name, got {name!r}")
    if name in available_tokenizers():
        raise NanoGPTError(f"--name {name!r} is the name of a built-in tokenizer; pick another")


def _save(tok: BPETokenizer, out: Path, trained: dict) -> None:
    """Write into a hidden folder beside `out`, then rename it into place (an existing `out` goes only then)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    try:
        tmp.mkdir()
        tok.save(tmp, trained)
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
