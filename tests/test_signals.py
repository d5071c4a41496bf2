"""Ctrl-C and SIGTERM in real processes: during an evaluation, a save and a second Ctrl-C; the run stops within
seconds, saves the steps it trained, says how to resume, and the resume evaluates what the stop dropped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanogpt_cli.interop.loading import load_model
from nanogpt_cli.runs import checkpoint as ckpt
from nanogpt_cli.training.plan import plan_run
from nanogpt_cli.training.request import RunRequest
from nanogpt_cli.training.trainer import train


def start(run: Path, data_dir: Path, name: str, *flags: str, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "nanogpt_cli", "train", "--data", name, "--data-dir", str(data_dir)]
    cmd += ["--preset", "tiny", "--out", str(run), "--device", "cpu", "--dtype", "float32", "--no-plot", *flags]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
    )


def records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def wait_for(proc: subprocess.Popen, done, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run never got there"
        time.sleep(0.05)


def stop(proc: subprocess.Popen, sig: int) -> tuple[str, str, float]:
    """Send sig; the run's stdout, stderr and the seconds it took to exit."""
    sent = time.monotonic()
    proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return out, err, time.monotonic() - sent


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_an_evaluation_stops_at_once_saves_and_the_resume_evaluates(char_data, tmp_path, sig):
    data_dir, name = char_data
    run = tmp_path / "run"
    # an evaluation of 2 x 3,000 batches of 32 rows takes 20 s of CPU and more: long enough to see it dropped
    proc = start(run, data_dir, name, "--max-iters", "100", "--eval-interval", "2", "--log-interval", "1",
                 "--eval-iters", "3000", "--batch-size", "32", "--no-eval-first")  # fmt: skip
    wait_for(proc, lambda: any(r["step"] == 2 for r in records(run)))  # step 2's line: its evaluation follows
    time.sleep(0.3)
    out, err, took = stop(proc, sig)
    assert proc.returncode == 128 + sig, err
    assert took < 20, f"{took:.1f} s to stop"  # the evaluation alone takes longer
    assert not [r for r in records(run) if r["kind"] == "eval"]  # it was dropped, not finished
    name_ = signal.Signals(sig).name
    assert f"note: stopped by {name_} after step 2; resume with: nanogpt train --out {run} --resume" in err
    assert "step 2: checkpoint saved" in " ".join(out.split())
    assert json.loads((run / "trainer.json").read_text())["step"] == 2
    assert ckpt.file_step(run / "model.safetensors") == 2
    load_model(run, last=True)
    # the resume evaluates step 2 first (with fewer batches now), so the metrics are those of an unbroken run
    result = train(plan_run(RunRequest({"max_iters": 3, "eval_iters": 2}, out=run, resume=True)))
    assert result.step == 3
    assert [r["step"] for r in records(run) if r["kind"] == "eval"] == [2, 3]


@pytest.mark.slow
def test_a_second_sigint_stops_at_once_and_says_what_is_on_disk(char_data, tmp_path):
    data_dir, name = char_data
    run = tmp_path / "run"
    # every save sleeps 1.5 s halfway through: the second Ctrl-C lands in a save (in the background or the last)
    proc = start(run, data_dir, name, "--max-iters", "100000", "--eval-interval", "2", "--eval-iters", "2",
                 "--log-interval", "1", env={"NANOGPT_TEST_SLOW_SAVE": "1.5"})  # fmt: skip
    wait_for(proc, lambda: (run / "trainer.json").is_file())
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    out, err, took = stop(proc, signal.SIGINT)
    assert proc.returncode == 130, err
    assert took < 15, f"{took:.1f} s to stop"
    step = json.loads((run / "trainer.json").read_text())["step"]
    line = " ".join(err.split())
    assert f"note: stopped at once by a second SIGINT; the checkpoint of step {step:,} is in {run}; " in line
    assert f"resume with: nanogpt train --out {run} --resume" in line
    assert not list(run.glob(".*.staged"))
    result = train(plan_run(RunRequest({"max_iters": step + 1}, out=run, resume=True)))
    assert result.step == step + 1


class SignalAt:
    """A display that sends this process a signal when the run says `when` (the trainer's status lines)."""

    def __init__(self, when: str, sig: int):
        self.when, self.sig, self.seen = when, sig, []

    def on_status(self, text: str) -> None:
        self.seen.append(text)
        if text == self.when:
            os.kill(os.getpid(), self.sig)

    def __getattr__(self, name):
        return lambda *args: None


def test_a_signal_while_the_model_is_built_stops_the_run_before_it_writes_anything(char_data, tmp_path):
    from nanogpt_cli.training.signals import Interrupted
    from nanogpt_cli.training.trainer import Trainer
    from conftest import tiny_plan

    data_dir, name = char_data
    run = tmp_path / "run"
    display = SignalAt("building the model", signal.SIGTERM)
    with pytest.raises(Interrupted) as stopped:
        Trainer(tiny_plan(data_dir, name, run, max_iters=5), display).fit()
    assert stopped.value.signal == "SIGTERM" and display.seen == ["loading the data", "building the model"]
    assert not run.exists()  # nothing was written: the same command starts the run
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are put back
    assert train(tiny_plan(data_dir, name, run, max_iters=2)).step == 2
