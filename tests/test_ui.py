"""The displays: the training progress line fits 80 columns, evaluation and prepare report progress."""

import io

import pytest
from rich.console import Console

from nanogpt_cli.cli import train_ui, ui
from nanogpt_cli.training.events import Evaluated, RunStarted, StepLogged


def terminal(monkeypatch, width):
    console = Console(
        file=io.StringIO(), force_terminal=True, width=width, highlight=False, soft_wrap=True, color_system=None
    )
    monkeypatch.setattr(ui, "console", console)
    return console


@pytest.mark.parametrize("width", [80, 200])
def test_the_live_progress_line_fits_the_terminal_and_keeps_the_step_counter(monkeypatch, width):
    console = terminal(monkeypatch, width)
    display = train_ui.TrainDisplay()
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
    assert train_ui.fit_fields(parts, 100) == "loss 1.0000 | lr 1.00e-03 | ETA 0:00:10"
    assert train_ui.fit_fields(parts, 30) == "loss 1.0000 | ETA 0:00:10"
    assert train_ui.fit_fields(parts, 5) == "loss 1.0000"


def test_eval_reports_progress_up_to_every_token(trained_run):
    from nanogpt_cli.inference.evaluate import score_tokens
    from nanogpt_cli.interop.loading import load_for_inference

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


def started(**over) -> RunStarted:
    from nanogpt_cli.config import GPTConfig, TrainConfig, preset_values, split_values

    model, train = split_values(preset_values("cpu-char"))
    values = dict(
        step=0,
        max_iters=2000,
        device="cpu",
        dtype="float32",
        params=787_584,
        tokens_per_iter=768,
        run_dir="checkpoints/shakespeare-char-20261201-120000",
        resume=False,
        model=GPTConfig(vocab_size=65, **model).to_dict(),
        train=TrainConfig(data="shakespeare-char", **train).to_dict(),
    )
    return RunStarted(**{**values, **over})


def step(n: int, **over) -> StepLogged:
    values = dict(step=n, loss=2.1234, lr=9.9e-4, tokens=n * 768, elapsed_s=75.0, ms_per_iter=405.7)
    return StepLogged(**{**values, "tokens_per_s": 1893.0, "mfu": None, **over})


def test_a_run_starts_with_a_few_lines_that_fit_80_columns_and_the_whole_config_under_verbose(monkeypatch):
    console = Console(file=io.StringIO(), width=80, highlight=False, soft_wrap=True, color_system=None)
    monkeypatch.setattr(ui, "console", console)
    train_ui.TrainDisplay().on_start(started())
    lines = console.file.getvalue().splitlines()
    assert len(lines) <= 5 and all(len(ln) <= 80 for ln in lines[:-1]), lines  # the last ends with the run folder
    text = "\n".join(lines)
    for said in ("787,584 non-embedding params", "4 layers, 128 wide", "768 tokens per step", "saved every 250"):
        assert said in text, text
    assert lines[-1] == "training from step 0 of 2,000 on cpu (float32) -> checkpoints/shakespeare-char-20261201-120000"
    assert '"n_layer"' not in text
    console.file = io.StringIO()
    train_ui.TrainDisplay(verbose=True).on_start(started())
    assert '"n_layer": 4' in console.file.getvalue() and '"learning_rate": 0.001' in console.file.getvalue()


def test_the_progress_line_in_a_pipe_labels_its_times_and_keeps_loss_val_and_speed_in_80_columns(monkeypatch):
    console = Console(file=io.StringIO(), width=80, highlight=False, soft_wrap=True, color_system=None)
    monkeypatch.setattr(ui, "console", console)
    display = train_ui.TrainDisplay()
    display.on_start(started())
    display.on_eval(Evaluated(step=0, train_loss=4.2, val_loss=4.2003, lr=0, tokens=0, elapsed_s=0, best_val_loss=4.2))
    display.on_step(step(10))
    line = console.file.getvalue().splitlines()[-1]
    assert len(line) <= 80 and line.startswith("step    10/2,000 | loss 2.1234 | val 4.2003 | 1,893 tok/s"), line
    assert "ETA 13:27" in line  # 1,990 steps of 405.7 ms, labelled
    wide = Console(file=io.StringIO(), width=200, highlight=False, soft_wrap=True, color_system=None)
    monkeypatch.setattr(ui, "console", wide)
    display.on_step(step(20))
    assert "elapsed 1:15" in wide.file.getvalue() and "ms/it" in wide.file.getvalue()


def test_the_live_bar_labels_elapsed_and_stops_at_the_step_saved_on_ctrl_c(monkeypatch):
    console = terminal(monkeypatch, 100)
    display = train_ui.TrainDisplay()
    display.on_start(started(max_iters=50))
    display.on_step(step(10))
    display.on_save(13)  # Ctrl-C at step 13: saved there, between two progress lines
    display.__exit__(None, None, None)
    frames = [ln for ln in console.file.getvalue().splitlines() if "/50" in ln]
    assert "13/50" in frames[-1] and "elapsed" in frames[-1], frames
