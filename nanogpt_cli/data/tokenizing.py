"""Pieces of text -> token ids, in order, in this process or in `num_proc` worker processes.

    for batch, (flat, lengths) in encoded(batches(pieces, lambda: 0), tok, "uint16", num_proc=2): ...

Text goes to the workers in batches of about BATCH_CHARS characters, at most 2 * num_proc batches in flight, and
comes back in order, so the output does not depend on the number of workers. A worker exits when its parent
dies, even of kill -9, so no tokenizer process outlives the prepare that started it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from nanogpt_cli.data.sources import Pieces
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.tokenizer import (
    ByteTokenizer,
    CharTokenizer,
    Tokenizer,
    tokenizer_from_description,
)

# batch sizes: they bound memory, not results
BATCH_CHARS = 1 << 20  # characters sent to a worker process at once
BATCH_DOCS = 4096
WATCH_PARENT_S = 1.0  # how often a worker checks its parent where the kernel cannot tell it


class Batch(NamedTuple):
    """Consecutive pieces of the source: the unit of work of a worker."""

    pieces: list[tuple[str, bool]]
    read_to: int  # how far the source had been read (bytes or documents) when the batch was complete


def first_docs(pieces: Pieces, max_docs: int | None) -> Pieces:
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


def skip(pieces: Pieces, n: int) -> Pieces:
    """All but the first n pieces; they are still read (a stream has no other way to get past them)."""
    with contextlib.closing(pieces):
        for i, piece in enumerate(pieces):
            if i >= n:
                yield piece


def batches(pieces: Pieces, position: Callable[[], int]) -> Iterator[Batch]:
    """Pieces in batches of about BATCH_CHARS characters or BATCH_DOCS pieces, each with `position()`: how far
    the source was read when it was complete."""
    with contextlib.closing(pieces):
        batch: list[tuple[str, bool]] = []
        chars = 0
        for text, ends in pieces:
            batch.append((text, ends))
            chars += len(text)
            if chars >= BATCH_CHARS or len(batch) >= BATCH_DOCS:
                yield Batch(batch, position())
                batch, chars = [], 0
        if batch:
            yield Batch(batch, position())


def encode_batch(tok: Tokenizer, texts: list[str], dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """The token ids of `texts` end to end, and how many belong to each text."""
    if isinstance(tok, (CharTokenizer, ByteTokenizer)):  # both encode to arrays without a list of ints
        ids = [
            tok.encode_array(t)
            if isinstance(tok, CharTokenizer)
            else np.frombuffer(t.encode("utf-8", errors="surrogateescape"), dtype=np.uint8)
            for t in texts
        ]
        lengths = np.array([len(i) for i in ids], dtype=np.int64)
        return (np.concatenate(ids).astype(dtype) if ids else np.zeros(0, dtype)), lengths
    ids = tok.encode_batch(texts)
    lengths = np.array([len(i) for i in ids], dtype=np.int64)
    return np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum())), lengths


_worker: tuple[Tokenizer, str] | None = None  # the tokenizer of a worker process, built once


def _start_worker(description: dict[str, Any], dtype: str, parent_pid: int, text: str | None = None) -> None:
    import signal

    global _worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops the pool
    _exit_with_parent(parent_pid)
    _worker = (tokenizer_from_description(description, text=text), dtype)


def _exit_with_parent(parent_pid: int) -> None:
    """End this worker when its parent dies. kill -9 runs no clean-up in the parent, and a worker waiting for
    its next batch would wait forever (it holds the queue's write end itself). On Linux the kernel sends it
    SIGKILL (PR_SET_PDEATHSIG); elsewhere a thread compares the parent's pid now and then."""
    import signal

    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        with contextlib.suppress(OSError, AttributeError):
            if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL) == 0:
                if os.getppid() != parent_pid:  # the parent died before the call: no signal will come
                    os._exit(1)
                return
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCH_PARENT_S)
        os._exit(1)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    tok, dtype = _worker
    return encode_batch(tok, texts, dtype)


def encoded(
    work: Iterator[Batch], tok: Tokenizer, dtype: str, num_proc: int
) -> Iterator[tuple[Batch, tuple[np.ndarray, np.ndarray]]]:
    """Each batch with its tokens, in order. With num_proc > 1 the batches go to that many worker processes
    (spawned, so no lock of a reader thread is inherited), at most 2 * num_proc of them in flight."""
    if num_proc == 1:
        for batch in work:
            yield batch, encode_batch(tok, [t for t, _ in batch.pieces], dtype)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    before = set(multiprocessing.active_children())
    # an executor, not multiprocessing.Pool: a worker that dies (out of memory) fails the prepare instead of
    # being replaced while its batch is waited for forever
    pool = ProcessPoolExecutor(
        num_proc,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_start_worker,
        initargs=(tok.describe(), dtype, os.getpid(), getattr(tok, "text", None)),  # a tokenizer.json's text
    )
    finished = False
    try:
        pending: deque = deque()
        for batch in work:
            pending.append((batch, pool.submit(_encode_in_worker, [t for t, _ in batch.pieces])))
            if len(pending) >= 2 * num_proc:
                batch, future = pending.popleft()
                yield batch, future.result()
        while pending:
            batch, future = pending.popleft()
            yield batch, future.result()
        finished = True
    except BrokenProcessPool:
        raise NanoGPTError(
            "a tokenizer worker process died (out of memory?); resume with --resume, perhaps with a smaller --num-proc"
        ) from None
    finally:
        pool.shutdown(wait=finished, cancel_futures=True)
        if not finished:  # Ctrl-C or an error: stop the workers now rather than after the batches they hold
            for worker in set(multiprocessing.active_children()) - before:
                worker.terminate()
