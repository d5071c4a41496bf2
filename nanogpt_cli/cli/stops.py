"""How a training command ends on Ctrl-C or SIGTERM: the lines that say what was saved and how to resume, and
the exit codes. train, finetune and their DPO and GRPO runs share them.

    with cut_short(plan): result = Trainer(plan).fit()   # a stop before the loop could save: said, exit 130/143
"""

from __future__ import annotations

import contextlib

import typer

from nanogpt_cli.cli.common import note, prints
from nanogpt_cli.errors import NanoGPTError


def resume_command(plan) -> str:
    """The command that continues a planned run (with the launch flags of --nproc; a DPO or GRPO run's method)."""
    from nanogpt_cli import api

    method = (plan.finetune or {}).get("objective")
    if method is not None:
        return f"nanogpt finetune {api.launch_flags()}--method {method} --out {plan.run_dir} --resume"
    return f"nanogpt train {api.launch_flags()}--out {plan.run_dir} --resume"


def stopped_line(plan, result) -> str:
    """How a run stopped by a signal ended: what it saved, and the command that resumes it."""
    if result.step == 0 or not plan.run_dir.has_trainer_state():  # stopped before its first step
        return f"stopped by {result.stopped} before the first step; {on_disk(plan)}"
    return f"stopped by {result.stopped} after step {result.step:,}; resume with: {resume_command(plan)}"


def on_disk(plan) -> str:
    """What a run stopped at once left in its folder: the step of its last complete save, or nothing."""
    run = plan.run_dir
    if not run.has_trainer_state():
        return f"nothing was saved in {run}: the command that started it starts it again"
    try:
        step = run.read_trainer().step
    except NanoGPTError as e:
        return f"its last save could not be read: {e}"
    return f"the checkpoint of step {step:,} is in {run}; resume with: {resume_command(plan)}"


def stop_code(signal_name: str | None) -> int:
    """The shell's exit code of a run stopped by a signal: 128 + its number (SIGINT 130, SIGTERM 143)."""
    return 143 if signal_name == "SIGTERM" else 130


@contextlib.contextmanager
def cut_short(plan):
    """A run stopped before its loop could save: by a signal while it was being set up (Interrupted), or at
    once by a second Ctrl-C (KeyboardInterrupt). Says what is on disk and exits with the signal's code."""
    from nanogpt_cli.api import Interrupted

    try:
        yield
    except Interrupted as stop:
        if prints():
            note(f"stopped by {stop.signal} before the run began; {on_disk(plan)}")
        raise typer.Exit(stop_code(stop.signal)) from None
    except KeyboardInterrupt:
        if prints():
            note(f"stopped at once by a second SIGINT; {on_disk(plan)}")
        raise typer.Exit(130) from None


def while_planning(plan_fn, *args, **kwargs):
    """plan_fn(*args, **kwargs), which reads the data and may load a model, dropped at once by Ctrl-C or
    SIGTERM with a line saying nothing was saved (a plan writes nothing)."""
    from nanogpt_cli.api import Interrupted, StopSignals

    try:
        with StopSignals() as signals, signals.interruptible():
            return plan_fn(*args, **kwargs)
    except (Interrupted, KeyboardInterrupt) as stop:
        name = stop.signal if isinstance(stop, Interrupted) else "SIGINT"
        if prints():
            note(f"stopped by {name} while planning the run; nothing was saved")
        raise typer.Exit(stop_code(name)) from None
