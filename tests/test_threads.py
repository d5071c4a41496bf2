"""CPU threads: the automatic choice from the load, a given --threads kept, the one-line note, the run that adapts
its count as the load changes, and the count `train --nproc` gives its processes."""

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from nanogpt_cli import device
from nanogpt_cli.cli import app
from nanogpt_cli.device import ThreadChoice, choose_threads, set_threads, take_threads_choice
from nanogpt_cli.training.clock import STEADY_SKIP, ThreadTuner, thread_tuner
from nanogpt_cli.training.launch import LAUNCH_ENV, Launch, worker_env

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()
NOTE = re.compile(r"note: threads: \d+ of \d+ cores \(.*\); --threads N sets it")


@pytest.fixture(autouse=True)
def torch_threads(monkeypatch):
    """Each test leaves torch's thread count, the environment and set_threads' choice as it found them."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
    take_threads_choice()


def test_one_thread_per_free_core_at_most_torchs_count_at_least_one():
    assert choose_threads(cpus=2, top=2, others=0) == 2
    assert choose_threads(cpus=2, top=2, others=0.4) == 2  # a little load leaves the core
    assert choose_threads(cpus=2, top=2, others=1) == 1
    assert choose_threads(cpus=2, top=2, others=3.6) == 1  # never none
    assert choose_threads(cpus=16, top=8, others=1) == 8  # hyper-threads: torch's count (physical cores) is the top
    assert choose_threads(cpus=16, top=8, others=10) == 6
    assert choose_threads(cpus=4, top=4, others=None) == 4  # nothing known: torch's count


def test_the_note_says_what_was_chosen_and_why():
    busy = ThreadChoice(threads=1, cores=2, running=2, load=3.64, source="auto")
    assert busy.line() == "threads: 1 of 2 cores (load 3.6, 2 other threads running); --threads N sets it"
    idle = ThreadChoice(threads=2, cores=2, running=0, load=0.2, source="auto")
    assert idle.line() == "threads: 2 of 2 cores (load 0.2); --threads N sets it"
    assert ThreadChoice(4, 4, None, None, "auto").line().startswith("threads: 4 of 4 cores (load unknown)")


def test_a_given_count_is_kept_and_not_announced(capsys):
    choice = set_threads(3)
    assert torch.get_num_threads() == 3 and choice.source == "given"
    assert thread_tuner(torch.device("cpu"), 1) is None  # no run adapts it
    assert capsys.readouterr().err == capsys.readouterr().out == ""
    with pytest.raises(device.NanoGPTError, match="--threads must be at least 1, got 0"):
        set_threads(0)


def test_omp_num_threads_is_kept_as_given(monkeypatch, capsys):
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    choice = set_threads(None)
    assert choice.source == "environment" and torch.get_num_threads() == 1
    device.say_threads(torch.device("cpu"))
    assert capsys.readouterr().err == ""


def test_the_automatic_choice_is_set_then_said_by_the_run_that_takes_it(capsys):
    choice = set_threads(None)
    assert choice.source == "auto" and torch.get_num_threads() == choice.threads
    assert 1 <= choice.threads <= choice.cores <= device.cpu_cores()
    assert capsys.readouterr().err == ""  # not yet: a refused command prints its error alone
    tuner = thread_tuner(torch.device("cpu"), 1)
    assert tuner.watch([]) == choice.line() and tuner.watch([]) is None  # before the first update, once
    assert thread_tuner(torch.device("cpu"), 1) is None  # taken


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_inference_says_the_choice_on_a_terminal_once(monkeypatch, capsys):
    set_threads(None)
    device.say_threads(torch.device("cpu"))
    assert capsys.readouterr().err == ""  # stderr is not a terminal here: what a script reads stays clean
    choice = set_threads(None)
    monkeypatch.setattr(sys, "stderr", Terminal())
    device.say_threads(torch.device("cpu"))
    device.say_threads(torch.device("cpu"))
    assert sys.stderr.getvalue() == f"note: {choice.line()}\n"  # once


def test_a_cli_training_run_says_the_choice_once_and_not_with_threads(char_data, tmp_path):
    data_dir, name = char_data
    base = ["--data", name, "--data-dir", str(data_dir), "--preset", "tiny", "--max-iters", "2", "--no-plot"]
    result = runner.invoke(app, ["train", *base, "--out", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    assert len(NOTE.findall(result.stderr)) == 1, result.stderr
    assert result.output.index("training from step 0") < result.output.index("note: threads:")  # with the start
    result = runner.invoke(app, ["train", *base, "--threads", "1", "--out", str(tmp_path / "b")])
    assert result.exit_code == 0 and "threads:" not in result.stderr, result.output


# --- a run's thread count follows the load ---


def run_tuner(tuner: ThreadTuner, step_s: dict[int, float], updates: int, running=lambda: 0.0) -> list[str]:
    """Feed the tuner `updates` updates whose length depends on its current thread count; the notes it gave."""
    notes = []
    for _ in range(updates):
        note = tuner.stepped(step_s[tuner.threads], running)
        if note:
            notes.append(note)
    return notes


def test_an_idle_machine_keeps_all_threads_after_comparing_fewer_once():
    applied = []
    tuner = ThreadTuner(threads=2, top=2, cpus=2, apply=applied.append)
    assert run_tuner(tuner, {2: 0.063, 1: 0.097}, 100) == []
    assert tuner.threads == 2 and applied == [1, 2]  # one trial of 1 thread, then back


def test_a_busy_machine_drops_to_fewer_threads_and_says_so():
    applied = []
    tuner = ThreadTuner(threads=2, top=2, cpus=2, apply=applied.append)
    notes = run_tuner(tuner, {2: 3.322, 1: 0.108}, STEADY_SKIP + 10, running=lambda: 1.0)
    assert tuner.threads == 1 and applied == [1]
    assert notes == ["threads: 1 of 2 cores from now on: an update took 108 ms with 1, 3,322 ms with 2"]


def test_updates_that_slow_down_bring_a_new_comparison():
    tuner = ThreadTuner(threads=2, top=2, cpus=2, apply=lambda n: None)
    run_tuner(tuner, {2: 0.063, 1: 0.097}, 40)  # idle: 2 threads stay
    notes = run_tuner(tuner, {2: 0.5, 1: 0.11}, 15, running=lambda: 1.0)  # another process starts
    assert tuner.threads == 1 and len(notes) == 1


def test_more_threads_are_tried_when_cores_free_up_and_a_slow_trial_ends_after_one_update():
    applied = []
    tuner = ThreadTuner(threads=1, top=2, cpus=2, apply=applied.append)
    run_tuner(tuner, {1: 0.1, 2: 3.0}, STEADY_SKIP + 40, running=lambda: 2.0)
    assert applied == []  # the cores are taken: no trial
    run_tuner(tuner, {1: 0.1, 2: 3.0}, 30, running=lambda: 0.0)  # they look free, but 2 threads are slow
    assert applied == [2, 1] and tuner.threads == 1 and tuner.look_every == 50  # one update tried, looks halved
    notes = run_tuner(tuner, {1: 0.1, 2: 0.06}, 60, running=lambda: 0.0)  # now they are free
    assert tuner.threads == 2 and notes[-1].startswith("threads: 2 of 2 cores from now on")


# --- train --nproc gives each process its share ---


def test_nproc_processes_get_the_choice_shared_out_and_keep_a_set_omp_num_threads(monkeypatch, capsys):
    eight = ThreadChoice(threads=8, cores=8, running=0, load=0.0, source="auto")
    assert eight.per_process(2) == 4 and eight.per_process(3) == 2 and eight.per_process(16) == 1
    assert eight.line(2) == "threads: 4 in each of 2 processes, 8 of 8 cores (load 0.0); --threads N sets it"
    choice = set_threads(None)
    env = worker_env(Launch(nproc=2))
    assert env == {LAUNCH_ENV: "--nproc 2", "OMP_NUM_THREADS": str(choice.per_process(2))}
    assert capsys.readouterr().err == f"note: {choice.line(2)}\n"
    set_threads(3)  # given: each process gets it (as its --threads too), and nothing is said
    assert worker_env(Launch(nproc=2)) == {LAUNCH_ENV: "--nproc 2", "OMP_NUM_THREADS": "3"}
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's: every process keeps it
    assert worker_env(Launch(nproc=2)) == {LAUNCH_ENV: "--nproc 2"} and capsys.readouterr().err == ""


@pytest.mark.slow
def test_nproc_processes_do_not_choose_again(char_data, tmp_path):
    """Only the launcher says its choice: the processes it starts keep the count it gives them."""
    data_dir, name = char_data
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("OMP_NUM_THREADS", None)
    args = ["--nproc", "2", "--data", name, "--data-dir", str(data_dir), "--preset", "tiny", "--max-iters", "2"]
    proc = subprocess.run(
        [sys.executable, "-m", "nanogpt_cli", "train", *args, "--device", "cpu", "--out", str(tmp_path / "r")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("note: threads:") == 1, proc.stderr[-3000:]
    assert "note: threads: 1 in each of 2 processes, " in proc.stderr
