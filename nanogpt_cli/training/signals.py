"""Ctrl-C and SIGTERM in a training run: noted by the loop, which saves and stops, or, in work that a stop may
drop halfway (loading, an evaluation, a rollout), acted on at once.

    with StopSignals() as signals:
        with signals.interruptible():  # a signal here raises Interrupted now, not after the evaluation
            losses = evaluate(model)
        if signals.received: save_and_stop()

Work inside interruptible() must leave nothing half-changed that is saved: it reads the weights and writes
nothing (a forward pass, a rollout, building the model). A second Ctrl-C raises KeyboardInterrupt wherever the
run is, except under torchrun, which passes a terminal's Ctrl-C on to its workers a second time (and kills them
itself if they have not ended 30 s later).
"""

from __future__ import annotations

import contextlib
import signal
from typing import Any


class Interrupted(BaseException):  # noqa: N818  (like KeyboardInterrupt: a stop asked for, not an error)
    """A signal that ended work inside StopSignals.interruptible(). A BaseException, so that code catching
    Exception (a user's reward function, a library) lets it through."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal = signal_name


class StopSignals:
    """Ctrl-C / SIGTERM set `received`; the loop finishes its step, saves and stops. Inside interruptible() the
    first one raises Interrupted at once. A second Ctrl-C aborts (KeyboardInterrupt) when abort_on_second."""

    def __init__(self, abort_on_second: bool = True, abandon: bool = True):
        self.abort_on_second = abort_on_second
        # abandon: interruptible() acts at once. False under torchrun, where every rank must reach the same
        # collectives: one rank leaving an evaluation would leave the others waiting for it
        self.abandon = abandon
        self.received: str | None = None
        self._raising = False
        self._old: dict[int, Any] = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: no handlers, Ctrl-C works as usual
                pass
        return self

    def _handle(self, signum, frame):
        if self.received is not None and signum == signal.SIGINT and self.abort_on_second:
            raise KeyboardInterrupt
        self.received = self.received or signal.Signals(signum).name
        if self._raising:
            self._raising = False
            raise Interrupted(self.received)

    @contextlib.contextmanager
    def interruptible(self):
        """Work a stop may drop: a signal received before or during it raises Interrupted (with abandon)."""
        if not self.abandon or not self._old:
            yield
            return
        self._raising = True  # before the look at `received`: a signal between the two is never missed
        try:
            if self.received is not None:
                raise Interrupted(self.received)
            yield
        finally:
            self._raising = False

    def __exit__(self, *exc):
        self._raising = False
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
