"""The one thread that runs the engine: continuous batching of every request's rows.

    scheduler = Scheduler(loaded, max_batch=8, max_queue=64); scheduler.start()
    scheduler.submit([job])          # job.sink(event) is called from the engine thread: Delta..., then Done
    scheduler.cancel([job])          # a client went away: its row leaves the batch before the next step

Each loop: take cancellations (their rows leave at once), admit waiting jobs into free rows (each after its own
prefill), pick one token for every row and turn it into text (TextStream: whole characters, stop texts, end of
text; a job's constraint masks its row's tokens and its end ends the row), then run the batch one token on
(Engine.pick, Engine.advance). A failure inside the engine fails only the rows it concerns.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.inference.engine import Engine, RowError, SamplingParams, StepToken
from nanogpt_cli.inference.sample import TextStream

log = logging.getLogger("nanogpt.serve")


@dataclass
class Delta:
    """New text of one row (possibly empty while a character or a possible stop text is held back), and the
    tokens it came from with their log-probabilities when asked for."""

    text: str
    tokens: list[int]
    logprobs: list[StepToken] = field(default_factory=list)


@dataclass
class Done:
    text: str  # the last piece of text
    tokens: list[int]
    finish_reason: str  # "stop" or "length"
    completion_tokens: int
    logprobs: list[StepToken] = field(default_factory=list)


@dataclass
class Failed:
    message: str
    status: int = 500


@dataclass
class Job:
    """One row's worth of work: a prompt's tokens and how to continue them. sink receives Delta and then one Done
    or Failed, called from the engine thread (it must only hand the event over)."""

    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop: list[str]
    sink: Callable[[Any], None]
    seed: int | None = None
    ignore_eos: bool = False
    adapter: int = 0  # the engine's adapter (0: the base model)
    cache_prompt: bool = True  # start from the prefix cache and leave its tokens there
    constraint: Any = None  # a LogitsMask (inference/grammar.py's Constraint): the grammar its tokens follow
    row: int | None = None  # the engine's row id while it runs
    submitted: float = 0.0  # time.monotonic() when queued
    last_token: float | None = None  # time.monotonic() of its last token (metrics)
    generator: torch.Generator | None = None
    eot: tuple[int, ...] = ()  # the tokens that end it: end-of-text, end of turn (none with ignore_eos)
    text: TextStream | None = None
    pending: list[int] = field(default_factory=list)  # tokens whose text is held back
    pending_logprobs: list[StepToken] = field(default_factory=list)


class QueueFull(Exception):
    pass


class Scheduler:
    """prefix_cache, adapters: the engine's (Engine); metrics: serve/metrics.py's, moved from this thread; draft: a
    speculative draft (inference/speculative.py)."""

    def __init__(
        self,
        model,
        tokenizer,
        device,
        max_batch: int = 8,
        max_queue: int = 64,
        prefix_cache=None,
        adapters=None,
        metrics=None,
        draft=None,
    ):
        self.tokenizer, self.device, self.max_queue, self.metrics = tokenizer, device, max_queue, metrics
        options = dict(
            max_batch=max_batch, vocab_size=tokenizer.vocab_size, prefix_cache=prefix_cache, adapters=adapters
        )
        if draft is None:
            self.engine = Engine(model, **options)
        else:  # speculative decoding: each step gives a row one or more tokens (inference/speculative.py)
            from nanogpt_cli.inference.speculative import SpeculativeEngine

            self.engine = SpeculativeEngine(model, draft, **options)
        self.eot = tokenizer.stop_ids
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._cancelled: list[Job] = []
        self._calls: list[tuple[Callable[[], Any], Future]] = []
        self._running: dict[int, Job] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="nanogpt-engine", daemon=True)

    @property
    def active(self) -> int:
        """Rows in the running batch."""
        return self.engine.active

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """End every running and waiting job (Failed: the server is stopping) and the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, jobs: list[Job]) -> None:
        """Queue jobs (all or none): QueueFull when the queue would grow past max_queue."""
        with self._cond:
            if self._stopping:
                raise QueueFull("the server is stopping")
            if len(self._waiting) + len(jobs) > self.max_queue:
                raise QueueFull(f"the server's queue is full ({self.max_queue} waiting requests); retry shortly")
            now = time.monotonic()
            for job in jobs:
                job.submitted = now
            self._waiting.extend(jobs)
            self._cond.notify_all()

    def cancel(self, jobs: list[Job]) -> None:
        """Drop jobs whose client went away: waiting ones never start, running ones leave the batch."""
        with self._cond:
            self._cancelled.extend(jobs)
            self._cond.notify_all()

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run fn in the engine thread between steps (the model is used by one thread only)."""
        future: Future = Future()
        with self._cond:
            if self._stopping:
                future.set_exception(QueueFull("the server is stopping"))
                return future
            self._calls.append((fn, future))
            self._cond.notify_all()
        return future

    # --- the engine thread ---

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._waiting or self._cancelled or self._calls or self.engine.active):
                    self._cond.wait()
                if self._stopping:
                    break
                cancelled, self._cancelled = self._cancelled, []
                calls, self._calls = self._calls, []
                for job in cancelled:
                    if job in self._waiting:
                        self._waiting.remove(job)
                admit = [self._waiting.popleft() for _ in range(min(self.engine.free, len(self._waiting)))]
            for job in cancelled:
                self._drop(job)
            for fn, future in calls:
                self._run_call(fn, future)
            if admit:
                self._admit(admit)
            if self.engine.active:
                self._step()
        self._shutdown()

    def _run_call(self, fn, future: Future) -> None:
        try:
            future.set_result(fn())
        except Exception as e:  # handed to the caller, who turns it into a response
            future.set_exception(e)

    def _drop(self, job: Job) -> None:
        if job.row is not None and self._running.pop(job.row, None) is not None:
            self.engine.remove(job.row)

    def _admit(self, jobs: list[Job]) -> None:
        """Prefill the jobs into free rows, those of one prompt length together; a job the engine refuses fails
        alone (then each is added on its own)."""
        ready = []
        for job in sorted(jobs, key=lambda job: len(job.prompt)):
            try:
                self._prepare(job)
            except Exception as e:  # this thread serves every request: a job that cannot start fails alone
                log.exception("a request could not start")
                job.sink(Failed(f"the request could not start: {e}", 500))
            else:
                ready.append(job)
        jobs = ready
        groups = [[job for job in jobs if job.eot == eot] for eot in {job.eot for job in jobs}]
        for group in groups:
            try:
                self._add(group)
            except Exception:  # find the job at fault: each on its own
                for job in group:
                    self._add_alone(job)

    def _prepare(self, job: Job) -> None:
        """A job's generator (seeded as asked) and its text stream, before its prefill."""
        generator = torch.Generator(device=self.device)
        if job.seed is not None:
            generator.manual_seed(job.seed)
        else:
            generator.seed()
        job.generator = generator
        job.eot = () if job.ignore_eos else self.eot
        job.text = TextStream(self.tokenizer, job.stop, job.eot, job.max_tokens)

    def _add(self, jobs: list[Job]) -> None:
        rows = self.engine.add_many(
            [j.prompt for j in jobs],
            [j.params for j in jobs],
            [j.max_tokens for j in jobs],
            [j.generator for j in jobs],
            stop_ids=jobs[0].eot,
            adapters=[j.adapter for j in jobs],
            cache_prompt=[j.cache_prompt for j in jobs],
            masks=[j.constraint for j in jobs],
        )
        for job, row in zip(jobs, rows):
            job.row = row
            self._running[row] = job
        if self.metrics is not None:
            self.metrics.admitted(sum(len(j.prompt) for j in jobs))

    def _add_alone(self, job: Job) -> None:
        try:
            self._add([job])
        except NanoGPTError as e:
            job.sink(Failed(str(e), 400))
        except Exception as e:  # a request that fails inside the engine fails alone
            log.exception("prefill failed")
            job.sink(Failed(f"the model failed on this request: {e}", 500))

    def _step(self) -> None:
        """Pick every row's token, hand the tokens out, then run the batch one token on: the text of a step goes
        out while the next one computes, and a row's first token right after its prefill."""
        try:
            tokens = self.engine.pick()
        except RowError as e:  # only these rows: the pick changed nothing for the others
            for row in e.rows:
                job = self._running.pop(row)
                self.engine.remove(row)
                job.sink(
                    Failed(
                        f"the request's grammar failed: {e}" if e.request_fault else str(e),
                        400 if e.request_fault else 500,
                    )
                )
            return
        except Exception as e:
            return self._fail_all(e)
        running = self._running
        for t in tokens:
            job = running.get(t.row)
            if job is None:
                continue
            try:
                self._deliver(job, t)
            except Exception as e:  # its text (a tokenizer, a stop text) failed: this request ends, no other
                log.exception("a request failed while its text was made")
                self._fail(
                    job, f"the request failed while its text was made: {e}", 400 if isinstance(e, NanoGPTError) else 500
                )
        try:
            self.engine.advance()
        except Exception as e:
            self._fail_all(e)

    def _fail_all(self, e: Exception) -> None:
        log.exception("a decode step failed", exc_info=e)
        for row, job in list(self._running.items()):
            self.engine.remove(row)
            job.sink(Failed(f"the model failed on this request: {e}", 500))
        self._running.clear()

    def _fail(self, job: Job, message: str, status: int) -> None:
        """End one running job with its own error; the other rows go on."""
        if self._running.pop(job.row, None) is not None:
            self.engine.remove(job.row)
        job.sink(Failed(message, status))

    def _deliver(self, job: Job, t: StepToken) -> None:
        if t.finish == "error":  # its grammar failed on this token: the engine has removed the row
            return self._fail(job, f"the request's grammar failed: {t.error}", 400)
        if self.metrics is not None:
            self.metrics.token(job)
        piece = job.text.feed(t.token)
        if t.finish == "stop" and not job.text.done:  # its grammar is complete: the row has ended
            job.text.reason = "stop"
            piece += job.text.finish()
        job.pending.append(t.token)
        if job.params.logprobs is not None:
            job.pending_logprobs.append(t)
        if job.text.done:
            self._running.pop(job.row, None)
            self.engine.remove(job.row)  # a stop text: the engine did not see it (no-op when it ended the row)
            reason = "length" if job.text.reason == "length" else "stop"
            job.sink(Done(piece, job.pending, reason, len(job.text.ids), job.pending_logprobs))
        elif piece or job.params.logprobs is not None:
            job.sink(Delta(piece, job.pending, job.pending_logprobs))
            job.pending, job.pending_logprobs = [], []

    def _shutdown(self) -> None:
        with self._cond:
            jobs = list(self._running.values()) + list(self._waiting)
            self._waiting.clear()
            calls, self._calls = self._calls, []
        for job in jobs:
            job.sink(Failed("the server is stopping", 503))
        for _, future in calls:
            future.set_exception(QueueFull("the server is stopping"))
        self._running.clear()
