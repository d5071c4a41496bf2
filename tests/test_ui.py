"""The displays: the training progress line fits 80 columns, evaluation and prepare report progress."""

import io

import pytest
from rich.console import Console

from nanogpt_cli import ui
from nanogpt_cli.events import Evaluated, RunStarted, StepLogged


def terminal(monkeypatch, width):
    console = Console(
        file=io.StringIO(), force_terminal=True, width=width, highlight=False, soft_wrap=True, color_system=None
    )
    monkeypatch.setattr(ui, "console", console)
    return console


@pytest.mark.parametrize("width", [80, 200])
def test_the_live_progress_line_fits_the_terminal_and_keeps_the_step_counter(monkeypatch, width):
    console = terminal(monkeypatch, width)
    display = ui.TrainDisplay()
    display.on_start(
        RunStarted(
            step=0,
            max_iters=600_000,
            device="cuda",
            dtype="float16",
            params=85_000_000,
            tokens_per_iter=491_520,
            run_dir="checkpoints/gpt2",
            resume=False,
            model={},
            train={},
        )
    )
    display.on_eval(
        Evaluated(step=0, train_loss=10.98, val_loss=10.99, lr=6e-4, tokens=0, elapsed_s=0.0, best_val_loss=10.99)
    )
    display.on_step(
        StepLogged(
            step=12_345,
            loss=3.1234,
            lr=5.9e-4,
            tokens=12_345 * 491_520,
            elapsed_s=9000.0,
            ms_per_iter=1234.5,
            tokens_per_s=398_000.0,
            mfu=0.4567,
            skipped=2,
            scale=32768.0,
        )
    )
    display.progress.refresh()
    display.__exit__(None, None, None)
    lines = console.file.getvalue().splitlines()
    bar = [ln for ln in lines if "12345/600000" in ln]
    assert bar, lines
    assert all(len(ln) <= width for ln in bar) and bar[-1].count("ETA") == 1
    assert "loss 3.1234" in bar[-1]
    if width == 200:  # room for everything, the fp16 skips included
        assert "skipped 2" in bar[-1] and "MFU 45.7%" in bar[-1]


def test_fit_fields_drops_the_least_important_first():
    parts = [(0, "loss 1.0000"), (5, "lr 1.00e-03"), (1, "ETA 0:00:10")]
    assert ui.fit_fields(parts, 100) == "loss 1.0000 | lr 1.00e-03 | ETA 0:00:10"
    assert ui.fit_fields(parts, 30) == "loss 1.0000 | ETA 0:00:10"
    assert ui.fit_fields(parts, 5) == "loss 1.0000"


def test_eval_reports_progress_up_to_every_token(trained_run):
    from nanogpt_cli.evaluate import score_tokens
    from nanogpt_cli.loading import load_for_inference

    model = load_for_inference(trained_run, device="cpu", dtype="float32").model
    calls = []
    nll, n = score_tokens(
        model,
        list(range(20)) * 10,
        stride=8,
        batch_size=3,
        progress=lambda label, done, total: calls.append((label, done, total)),
    )
    assert len(calls) > 1 and all(total == n for _, _, total in calls)
    done = [d for _, d, _ in calls]
    assert done == sorted(done) and done[-1] == n


def test_prepare_prints_a_line_per_stage_in_a_pipe(text_file, data_dir):
    from typer.testing import CliRunner

    from nanogpt_cli.cli import app

    out = (
        CliRunner()
        .invoke(app, ["prepare", str(text_file), "--name", "p", "--tokenizer", "char", "--data-dir", str(data_dir)])
        .output
    )
    stages = [ln.split(":")[0] for ln in out.splitlines() if ": done in " in ln]
    assert stages == ["reading characters", "tokenizing"]
