"""A training run's evaluation that takes a while reports its progress: the trainer's EvalProgress events, the
live bar's text on a terminal, and a line now and then in a pipe."""

import io

import pytest
from rich.console import Console

from nanogpt_cli import api
from nanogpt_cli.cli import train_ui, ui
from nanogpt_cli.training import trainer as training
from nanogpt_cli.training.events import EvalProgress, Evaluated, RunStarted, StepLogged


def started() -> RunStarted:
    return RunStarted(
        step=0,
        max_iters=200,
        device="cpu",
        dtype="bfloat16",
        params=100_000_000,
        tokens_per_iter=1024,
        run_dir="checkpoints/smol",
        resume=False,
        model={},
        train={},
    )


def evaluated(step: int) -> Evaluated:
    return Evaluated(step=step, train_loss=2.5, val_loss=2.6, lr=1e-3, tokens=0, elapsed_s=30.0, best_val_loss=2.6)


@pytest.mark.slow
def test_a_slow_evaluation_reports_each_batch_after_the_quiet_seconds(char_data, tmp_path, monkeypatch):
    """Every batch of both splits after EVAL_QUIET_S (here 0), in order, each evaluation counted from 1 (with the
    default, a tiny model's quick evaluations report nothing: test_api's list of events)."""
    data_dir, name = char_data
    common = dict(data=name, data_dir=str(data_dir), device="cpu", dtype="float32", max_iters=2, eval_interval=2)
    monkeypatch.setattr(training, "EVAL_QUIET_S", 0.0)
    events = []
    api.train("tiny", eval_iters=3, out=tmp_path / "run", callback=events.append, **common)
    shown = [e for e in events if isinstance(e, (EvalProgress, Evaluated))]
    kinds = [(type(e).__name__, e.step, getattr(e, "done", None)) for e in shown]
    assert kinds == [
        *[("EvalProgress", 0, i) for i in range(1, 7)],
        ("Evaluated", 0, None),
        *[("EvalProgress", 2, i) for i in range(1, 7)],
        ("Evaluated", 2, None),
    ]
    assert all(e.total == 6 and e.elapsed_s >= 0 for e in shown if isinstance(e, EvalProgress))


def test_the_live_bar_shows_the_evaluations_batches_and_time_left_then_its_last_line(monkeypatch):
    console = Console(file=io.StringIO(), force_terminal=True, width=120, soft_wrap=True, color_system=None)
    monkeypatch.setattr(ui, "console", console)
    display = train_ui.TrainDisplay()
    display.on_start(started())
    display.on_step(StepLogged(10, 2.75, 1e-3, 10240, 60.0, 6000.0, 170.0, None))
    display.on_eval_progress(EvalProgress(step=10, done=3, total=8, elapsed_s=12.0))  # 4 s a batch: 5 more left
    assert display.progress.tasks[0].fields["stats"] == "evaluating: 3/8 batches, 0:20 left"
    display.on_eval(evaluated(10))
    assert display.progress.tasks[0].fields["stats"].startswith("loss 2.7500")
    display.__exit__(None, None, None)


def test_in_a_pipe_a_slow_evaluation_prints_a_line_every_15_seconds(monkeypatch):
    console = Console(file=io.StringIO(), width=100, soft_wrap=True, color_system=None)
    monkeypatch.setattr(ui, "console", console)
    display = train_ui.TrainDisplay()
    display.on_start(started())
    before = console.file.getvalue()
    for done, seconds in enumerate([4.0, 9.0, 16.0, 21.0, 32.0, 40.0], start=1):
        display.on_eval_progress(EvalProgress(step=0, done=done, total=8, elapsed_s=seconds))
    display.on_eval_progress(EvalProgress(step=0, done=8, total=8, elapsed_s=50.0))  # the eval line says the end
    display.on_eval(evaluated(0))
    lines = console.file.getvalue()[len(before) :].splitlines()
    assert lines == [
        "step   0: evaluating: 3/8 batches, 0:26 left (0:16 so far)",
        "step   0: evaluating: 5/8 batches, 0:19 left (0:32 so far)",
        "step   0: train loss 2.5000, val loss 2.6000 (best 2.6000), checkpoint saved",
    ]
    display.on_eval_progress(EvalProgress(step=10, done=1, total=8, elapsed_s=15.0))  # the next evaluation anew
    assert console.file.getvalue().splitlines()[-1].startswith("step  10: evaluating: 1/8 batches")
