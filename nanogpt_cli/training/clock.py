"""A run's clock and its speed: wall time across invocations, --max-time's budget, steady step times, the
thread count that follows a busy CPU, and the hint that names one.

    clock = Clock(before=0.0, max_time=60.0, last_eval_s=0.0, step=0); clock.stepped(started, first=True)
    tuner = thread_tuner(device, world_size); note = tuner.watch(clock.steps) if tuner else None
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

from nanogpt_cli.device import cpu_cores, load_average, running_elsewhere, take_threads_choice
from nanogpt_cli.training.events import RunSpeed

__all__ = ["Clock", "ThreadTuner", "busy_hint", "cpu_cores", "load_average", "thread_tuner"]

STEADY_SKIP = 5  # updates left out of the steady-state step time: warm-up, compilation, allocator growth
# the share of --max-time one evaluation may take when --eval-iters is not given: a 2-minute run of shakespeare-char
# (200 batches of 64 x 256 tokens a split) spent over 8 minutes in its first evaluation on one CPU core
EVAL_SHARE = 0.02


class Clock:
    """A run's wall time and what it went to: the time of earlier invocations, this one's, the time spent
    evaluating and saving (left out of the speed figures), the first update (warm-up or compilation, also left
    out), and --max-time's budget, which keeps the last evaluation's length free for the final one."""

    def __init__(self, before: float, max_time: float | None, last_eval_s: float, step: int, eval_steps: float = 0.0):
        self.before, self.max_time, self.last_eval_s = before, max_time, last_eval_s
        self.eval_steps = eval_steps  # an evaluation's length in updates, guessed, until one has been timed
        self.t0 = time.perf_counter()
        self.window_t, self.window_step = self.t0, step  # since the last progress line
        self.set_aside_s = 0.0  # evaluating and saving
        self.save_s = 0.0  # the saving part of it
        self.step_s = self.first_s = 0.0  # the last update's length; the first one's
        self.sync: Callable[[], None] | None = None  # waits for the device (CUDA with --max-time)
        # several processes: rank 0's reading of the clock, sent to every rank (World.from_main), so that each one
        # sets the same learning rate and all stop after the same update; one process: its own reading
        self.agree: Callable[[list[float]], list[float]] = lambda values: values
        self.steps: list[float] = []  # every update's length in this invocation

    def elapsed(self, at: float | None = None) -> float:
        """Wall time of every invocation so far (up to `at`, a perf_counter time)."""
        return self.before + (time.perf_counter() if at is None else at) - self.t0

    def share(self) -> float | None:
        """--max-time: the share of it spent, out of the time left once the final evaluation is set aside."""
        if self.max_time is None:
            return None
        return self.agree([self.elapsed() / max(self.max_time - self.eval_s(), 1e-9)])[0]

    def eval_s(self) -> float:
        """The final evaluation's expected length: the last one's, or (when none has run: --no-eval-first) a
        guess from the fastest update after the first STEADY_SKIP: the first few warm up, and on a busy CPU
        can each take ten times a steady one."""
        if self.last_eval_s:
            return self.last_eval_s
        return self.eval_steps * min(self.steps[STEADY_SKIP:]) if len(self.steps) > STEADY_SKIP else 0.0

    def out_of_time(self, due: bool) -> bool:
        """Whether another update and the final evaluation (after the one due now) would not fit."""
        if self.max_time is None:
            return False
        over = self.elapsed() + self.step_s + self.eval_s() * (2 if due else 1) >= self.max_time
        return self.agree([float(over)])[0] > 0

    def stepped(self, started: float, first: bool) -> None:
        if self.sync is not None:
            self.sync()
        self.step_s = time.perf_counter() - started
        self.steps.append(self.step_s)
        if first:
            self.first_s = self.step_s

    def window(self, step: int) -> tuple[float, float]:
        """(seconds per update since the last progress line, elapsed now), and a new window starts."""
        now = time.perf_counter()
        dt = (now - self.window_t) / max(1, step - self.window_step)
        self.window_t, self.window_step = now, step
        return dt, self.elapsed(now)

    def set_aside(self, started: float, evaluation: bool = True) -> None:
        """An evaluation (and its save) that began at `started` is over: its time is not training time (nor is
        other work, evaluation=False, whose length does not stand for the final evaluation's)."""
        spent = time.perf_counter() - started
        if evaluation:
            self.last_eval_s = spent
        self.set_aside_s += spent
        self.window_t += spent  # the next progress line reports training speed only

    def saved(self, started: float) -> None:
        self.save_s += time.perf_counter() - started

    def ended(self, started: float) -> None:
        """The end of the run since `started` (the final save, the wait for the writer): not training time."""
        self.set_aside_s += time.perf_counter() - started

    def speed(self, average_ms: float) -> RunSpeed:
        """This invocation's speed: the median update after the first STEADY_SKIP (warm-up, compilation,
        allocator growth), the whole-run average, and the time evaluations and saves took."""
        steady = self.steps[STEADY_SKIP:] or self.steps[1:] or self.steps
        median = statistics.median(steady) * 1000 if steady else 0.0
        skipped = len(self.steps) - len(steady)
        eval_s = self.set_aside_s - self.save_s
        return RunSpeed(round(median, 3), round(average_ms, 3), skipped, round(eval_s, 3), round(self.save_s, 3))

    def training_time(self, done: int) -> tuple[int, float, float]:
        """(updates timed, their seconds, this invocation's seconds): the warm-up step is left out when there
        are others."""
        elapsed = time.perf_counter() - self.t0
        timed = done - 1 if done > 1 else done
        return timed, max(elapsed - self.set_aside_s - (self.first_s if done > 1 else 0.0), 1e-9), elapsed


SLOW = 2.5  # steps this many times longer than the first steady ones: something else took the CPU


def busy_hint(steps_s: list[float], load: float | None, cores: int, threads: int) -> str | None:
    """Why a CPU run is slow, when the machine is busy: the steady steps now against the first steady ones, and the
    load average against the cores; None when neither shows it. The advice names --threads."""
    said = []
    first, recent = steps_s[STEADY_SKIP : STEADY_SKIP + 10], steps_s[-10:]
    if len(steps_s) >= STEADY_SKIP + 20:
        before, now = statistics.median(first), statistics.median(recent)
        if now > SLOW * before:
            said.append(
                f"steps take {now / before:.1f}x as long as the first ones ({now * 1000:,.0f} ms, were "
                f"{before * 1000:,.0f} ms)"
            )
    if load is not None and load > cores:
        said.append(f"the load average is {load:.1f} on {cores} cores")
    if not said:
        return None
    others = max(0.0, (load or 0.0) - (threads if steps_s else 0))  # once it trains, the load counts this run too
    free = max(1, int(cores - others))
    if free < threads:
        advice = (
            f"stop them, or train with --threads {free} (this run uses {threads}), as threads that wait for a "
            "core slow every step"
        )
    else:
        advice = f"stop them, or expect it to be slower (this run uses {threads} thread{'s' if threads > 1 else ''})"
    return " and ".join(said) + ": other processes share the CPU; " + advice


PROBE = 5  # updates timed at each thread count when two are compared (their median)
SLOWER = 1.5  # updates this much slower than the kept count's: compare fewer threads again
GIVE_UP = 2.0  # a trial update this much slower than the kept count's ends the trial at once
LOOK_EVERY = 25  # updates between looks for freed cores while below the top count (doubled after a failed trial)


class ThreadTuner:
    """Keeps a CPU run at the thread count whose updates are fastest now, as the machine's load changes.

    Threads that wait for a core slow every update: torch's OpenMP threads spin at each barrier and an update
    waits for the slowest, so on 2 cores with one other busy process a cpu-char update took 3,322 ms with 2
    threads and 108 ms with 1. The run starts at set_threads' choice, compares half as many threads after the
    first updates and whenever updates slow down by SLOWER, and compares twice as many once the threads
    running elsewhere leave the cores for them; each comparison keeps the faster, and a trial of more threads
    ends after one update GIVE_UP times as long, so a wrong guess costs one update."""

    def __init__(
        self,
        threads: int,
        top: int,
        cpus: int,
        apply: Callable[[int], None] = torch.set_num_threads,
        note: str = "",
        fixed: bool = False,
    ):
        self.threads, self.top, self.cpus, self.apply = threads, top, cpus, apply
        self.note = note  # the start's choice and why, said with the run's first lines
        self.fixed = fixed  # says its note and keeps the count (a resumed run: see thread_tuner)
        self.times: list[float] = []  # the current count's updates (the trial's during one)
        self.kept: float | None = None  # the kept count's update time (a median of PROBE)
        self.trial: tuple[int, float] | None = None  # during a trial: the kept count and its time
        self.skip = STEADY_SKIP  # the first updates warm up: not timed
        self.look_every = self.until_look = LOOK_EVERY
        self.probed = False  # the comparison after the first updates is done

    def watch(self, steps_s: list[float]) -> str | None:
        """The trainer's call, before the first update (the start's note) and after each (stepped)."""
        if not steps_s:
            note, self.note = self.note, ""
            return note or None
        return self.stepped(steps_s[-1])

    def stepped(self, step_s: float, running: Callable[[], float | None] | None = None) -> str | None:
        """After each update, its length: the note to print when the thread count changed, else None. running:
        the threads running elsewhere now (default: three looks at /proc, ~4 ms, made every LOOK_EVERY updates)."""
        if self.fixed:
            return None
        if self.skip:
            self.skip -= 1
            return None
        self.times.append(step_s)
        if self.trial is not None:
            return self._judge()
        if len(self.times) < PROBE:
            return None
        now, self.times = statistics.median(self.times), []
        self.kept = now if self.kept is None else min(self.kept, now)
        if self.threads > 1 and (not self.probed or now > SLOWER * self.kept):
            self.probed = True
            return self._try(max(1, self.threads // 2), now)
        self.probed = True
        self.until_look -= PROBE
        if self.threads < self.top and self.until_look <= 0:
            self.until_look = self.look_every
            others = running() if running is not None else running_elsewhere(samples=3, gap_s=0.002)
            if others is not None and math.floor(self.cpus - others + 0.5) > self.threads:
                return self._try(min(self.top, self.threads * 2), now)
        return None

    def _try(self, threads: int, now: float) -> None:
        self.trial, self.times = (self.threads, now), []
        self.threads = threads
        self.apply(threads)

    def _judge(self) -> str | None:
        """A trial's update: the trial ends once it is clearly slower, or after PROBE updates; the faster stays."""
        (kept, kept_s), tried = self.trial, self.threads
        gave_up = tried > kept and self.times[-1] > GIVE_UP * kept_s
        if not gave_up and len(self.times) < PROBE:
            return None
        tried_s, self.times, self.trial = statistics.median(self.times), [], None
        if not gave_up and tried_s < kept_s:
            self.kept, self.look_every = tried_s, LOOK_EVERY
            self.until_look = self.look_every
            return (
                f"threads: {tried} of {self.top} cores from now on: an update took {tried_s * 1000:,.0f} ms with "
                f"{tried}, {kept_s * 1000:,.0f} ms with {kept}"
            )
        self.threads, self.kept = kept, kept_s  # the kept count's time now, so that the same slowness is not retried
        self.apply(kept)
        if tried > kept:
            self.look_every *= 2
            self.until_look = self.look_every
        return None


def thread_tuner(device: torch.device, world_size: int, last_used: int | None = None) -> ThreadTuner | None:
    """For a CPU run of one process whose threads set_threads chose itself, the tuner that says the choice and
    adapts it; None for every other run (a given --threads or OMP_NUM_THREADS, several processes, a GPU, a run
    started without set_threads), whose threads stay as they are.

    A resumed run (last_used: the threads it last trained with) keeps that count instead, fixed, so that it
    computes the very sums an uninterrupted run would (CPU sums differ by thread count in their last digits); a
    count the user gives wins, with a note saying what it may change."""
    choice = take_threads_choice()
    if choice is None or device.type != "cpu" or world_size > 1:
        return None
    if last_used is not None and choice.source == "auto":
        torch.set_num_threads(last_used)
        note = (
            f"threads: {last_used}, as this run last trained with: a resume keeps them, so that it computes what an "
            "uninterrupted run would; --threads N sets it"
        )
        return ThreadTuner(last_used, last_used, cpu_cores(), note=note, fixed=True)
    if last_used is not None and choice.threads != last_used:
        said = "--threads" if choice.source == "given" else "OMP_NUM_THREADS"
        note = (
            f"{said} {choice.threads}: this run last trained with {last_used} threads, and sums differ by thread "
            "count, so its losses may differ in the last digits from a run that did not stop"
        )
        return ThreadTuner(choice.threads, choice.threads, cpu_cores(), note=note, fixed=True)
    if choice.source != "auto":
        return None
    return ThreadTuner(choice.threads, choice.cores, cpu_cores(), note=choice.line())
