"""The run folder as a user meets it across processes: a save that cannot be written is one sentence and keeps the
previous one, "checkpoint saved" is said of files on disk, a running run is `running` and refuses a second start,
a run killed before its first save is `empty` and starts again by the same command, the start command plus
--resume resumes any run (--init-from included), and a resume keeps the thread count its run last used."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from nanogpt_cli.cli import app
from nanogpt_cli.device import set_threads, take_threads_choice
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.inspect.catalog import list_runs
from nanogpt_cli.runs.rundir import RunDir
from nanogpt_cli.training.clock import thread_tuner
from nanogpt_cli.training.plan import plan_run
from nanogpt_cli.training.request import RunRequest
from nanogpt_cli.training.trainer import train
from conftest import tiny_plan

runner = CliRunner()


def command(data, run, *flags, init_from=None):
    """The `nanogpt train` command line of the tiny preset on the char dataset, as a user would type it."""
    data_dir, name = data
    cmd = [sys.executable, "-m", "nanogpt_cli", "train", "--data", name, "--data-dir", str(data_dir)]
    cmd += ["--preset", "tiny", "--dtype", "float32", "--device", "cpu", "--out", str(run), "--no-plot"]
    return cmd + (["--init-from", str(init_from)] if init_from else []) + [str(f) for f in flags]


def environment(**extra):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("OMP_NUM_THREADS", None)  # the automatic thread choice, as a user's shell has it
    env.pop("NANOGPT_TEST_SLOW_SAVE", None)
    return dict(env, **extra)


def invoke(cmd):
    """A command line of command() run in this process (no interpreter to start), leaving the thread count and
    set_threads' choice as they were."""
    before = torch.get_num_threads()
    try:
        return runner.invoke(app, [str(a) for a in cmd[3:]])
    finally:
        torch.set_num_threads(before)
        take_threads_choice()


def status(run):
    (summary,) = list_runs(run)
    return summary.status


def wait_until(proc, condition, timeout=60):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def step_of(run):
    try:
        return json.loads((run / "trainer.json").read_text())["step"]
    except (FileNotFoundError, ValueError):
        return None


# --- saves tell the truth ---


def small_files(limit):
    """In the child: files may grow to `limit` bytes only (RLIMIT_FSIZE); a longer write fails with EFBIG (the
    signal that would kill the process is ignored), as a full disk fails one with ENOSPC."""

    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.slow
def test_a_save_that_cannot_be_written_is_one_line_and_keeps_the_previous_checkpoint(char_data, tmp_path):
    run = tmp_path / "run"
    train(tiny_plan(*char_data, run, max_iters=8, eval_interval=2, stop_at=2))
    before = {n: (run / n).read_bytes() for n in ("model.safetensors", "optimizer.safetensors", "trainer.json")}
    # the weights (103 kB) no longer fit; config.json, metrics.jsonl and trainer.json (14 kB) do. The step-4 save
    # is written in the background, so its failure is found by the loop after it
    cmd = command(char_data, run, "--max-iters", 8, "--eval-interval", 2, "--resume")
    done = subprocess.run(
        cmd, capture_output=True, text=True, env=environment(), timeout=120, preexec_fn=small_files(50_000)
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "checkpoint saved" not in done.stdout
    assert "step 4: train loss" in done.stdout  # the evaluation is still shown
    errors = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("note: ")]
    assert errors == [
        f"error: saving step 4 in {run} failed (File too large); the checkpoint of step 2 there is intact: once that "
        "is fixed, --resume continues from it"
    ]
    assert {n: (run / n).read_bytes() for n in before} == before
    assert not [p.name for p in run.iterdir() if p.name.endswith(".staged") or ".tmp-" in p.name]
    assert status(run) == "resumable"
    assert train(plan_run(RunRequest({"max_iters": 4}, out=run, resume=True))).step == 4


@pytest.mark.slow
def test_checkpoint_saved_is_said_once_the_files_are_on_disk(char_data, tmp_path):
    run = tmp_path / "run"
    cmd = command(char_data, run, "--max-iters", "4", "--eval-interval", "2", "--log-interval", "1")
    # each save sleeps 0.5 s between its weights and its optimizer: the loop trains on while it is written
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(
        NANOGPT_TEST_SLOW_SAVE="0.5"))  # fmt: skip
    said = {}
    try:
        for line in proc.stdout:
            if "checkpoint saved" in line:
                said[int(line.split(":")[0].split()[-1])] = step_of(run)  # the step on disk when it is said
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == 0
    assert sorted(said) == [2, 4] and all((on_disk or 0) >= step for step, on_disk in said.items()), said


# --- running, empty, and the same command again ---


@pytest.mark.slow
def test_a_run_killed_before_its_first_save_is_empty_and_the_same_command_starts_it_again(char_data, tmp_path):
    run = tmp_path / "run"
    flags = ("--max-iters", "4", "--eval-interval", "2", "--log-interval", "1")
    # its first save takes a minute: killed while writing it, the run has nothing saved but a staged file
    proc = subprocess.Popen(command(char_data, run, *flags), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=environment(NANOGPT_TEST_SLOW_SAVE="60"))  # fmt: skip
    try:
        wait_until(proc, lambda: (run / ".model.safetensors.staged").is_file())
        assert status(run) == "running"
        listed = runner.invoke(app, ["runs", str(tmp_path)])
        assert "running" in listed.output and f"being trained by process {proc.pid}" in listed.output
        again = invoke(command(char_data, run, *flags))  # a second start, while it trains
        assert again.exit_code == 1 and f"error: {run} is being trained now by process {proc.pid}" in again.output
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    assert status(run) == "empty"
    resumed = invoke(command(char_data, run, *flags, "--resume"))
    assert resumed.exit_code == 1 and "was stopped before its first save, so there is nothing to resume" in (
        resumed.output
    )
    done = invoke(command(char_data, run, *flags))  # the same command, without --force
    assert done.exit_code == 0, done.output
    assert status(run) == "finished" and step_of(run) == 4
    assert not [p.name for p in run.iterdir() if p.name.endswith(".staged")]  # the killed save's file is cleared
    evals = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines() if '"eval"' in ln]
    assert evals == [0, 2, 4]  # the killed run's lines went with it


def test_a_folder_with_someone_elses_config_json_is_not_an_empty_run_and_keeps_its_files(char_data, tmp_path):
    # a Hugging Face model folder with sharded weights: config.json, but none of a run's checkpoint files
    folder = tmp_path / "hf-model"
    folder.mkdir()
    files = {
        "config.json": '{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}',
        "tokenizer.json": '{"model": {}}',
        "model-00001-of-00002.safetensors": "weights",
    }
    for name, text in files.items():
        (folder / name).write_text(text)
    assert not RunDir(folder).is_empty()
    with pytest.raises(NanoGPTError, match="already holds a run"):
        tiny_plan(*char_data, folder, max_iters=2)
    assert {p.name: p.read_text() for p in folder.iterdir()} == files
    (folder / "model-00001-of-00002.safetensors").unlink()  # config.json and tokenizer.json alone: not ours either
    assert not RunDir(folder).is_empty()


def test_a_refused_start_leaves_no_folder_and_a_stopped_lock_says_nothing(char_data, tmp_path):
    run = tmp_path / "new"
    plan = tiny_plan(*char_data, run, max_iters=2)
    plan.train.data = "nothing-prepared-here"  # refused while the run is set up, after the lock is taken
    with pytest.raises(NanoGPTError):
        train(plan)
    assert not run.exists()
    with RunDir(run).hold():
        assert RunDir(run).running()["pid"] == os.getpid()
    assert RunDir(run).running() is None


def test_leftovers_of_a_save_cut_short_are_cleared_and_a_needed_predecessor_is_kept(char_data, tmp_path):
    run = tmp_path / "run"
    train(tiny_plan(*char_data, run, max_iters=4, eval_interval=2, stop_at=2))
    leftovers = [".model.safetensors.staged", ".optimizer.safetensors.staged", ".config.json.tmp-99999"]
    for name in leftovers:
        (run / name).write_bytes(b"half written")
    os.link(run / "trainer.json", run / ".trainer.json.prev")
    os.link(run / "best.safetensors", run / ".best.safetensors.prev")  # replaced by a complete save: not needed
    # a save cut short after renaming the step-4 weights: their step-2 predecessor is what a resume loads
    os.link(run / "model.safetensors", run / ".model.safetensors.prev")
    train(tiny_plan(*char_data, tmp_path / "ahead", max_iters=4, eval_interval=2, stop_at=4))
    os.replace(tmp_path / "ahead" / "model.safetensors", run / "model.safetensors")
    with RunDir(run).hold():
        hidden = sorted(p.name for p in run.iterdir() if p.name.startswith("."))
    assert hidden == [".lock", ".model.safetensors.prev"]
    assert train(plan_run(RunRequest({}, out=run, resume=True))).step == 4


# --- the start command plus --resume ---


@pytest.mark.slow
def test_a_running_fine_tune_is_running_and_its_start_command_resumes_it(char_data, trained_run, tmp_path):
    run = tmp_path / "ft"
    flags = ("--max-iters", "100000", "--eval-interval", "2", "--log-interval", "1")
    proc = subprocess.Popen(command(char_data, run, *flags, init_from=trained_run), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=environment())  # fmt: skip
    try:
        wait_until(proc, lambda: (step_of(run) or 0) >= 2)  # saved, and training on
        assert status(run) == "running"  # not "resumable": it has not stopped
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    assert status(run) == "resumable"
    step = step_of(run)
    resumed = invoke(command(char_data, run, *flags[2:], "--max-iters", step + 2, "--resume", init_from=trained_run))
    assert resumed.exit_code == 0, resumed.output
    assert step_of(run) == step + 2


def test_resume_accepts_the_init_from_the_run_started_with_and_refuses_another(
    char_data, trained_run, tmp_path, monkeypatch
):
    data_dir, name = char_data
    run = tmp_path / "ft"
    flags = dict(preset="tiny", data=name, data_dir=str(data_dir), device="cpu", dtype="float32")
    train(
        plan_run(RunRequest(dict(flags, max_iters=4, eval_interval=2, stop_at=2), out=run, init_from=str(trained_run)))
    )
    best = str((trained_run / "best.safetensors").resolve())
    assert json.loads((run / "config.json").read_text())["init_from"] == {
        "source": str(trained_run), "last": False, "path": best
    }  # fmt: skip
    assert plan_run(RunRequest(flags, out=run, resume=True, init_from=str(trained_run))).step == 2
    monkeypatch.chdir(trained_run.parent)  # the same weights, spelled another way
    assert plan_run(RunRequest(flags, out=run, resume=True, init_from=trained_run.name)).step == 2
    with pytest.raises(NanoGPTError, match=r"--init-from \S+ --last is not what \S+ was started from \(--init-from "):
        plan_run(RunRequest(flags, out=run, resume=True, init_from=str(trained_run), last=True))
    with pytest.raises(NanoGPTError, match=r"was not started from other weights.*drop --init-from"):
        plan_run(RunRequest({}, out=trained_run, resume=True, init_from=str(trained_run)))


# --- threads ---


def test_a_resume_keeps_the_thread_count_its_run_last_used(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        set_threads(None)  # automatic: gives way to the run's count
        tuner = thread_tuner(torch.device("cpu"), 1, last_used=3)
        assert torch.get_num_threads() == 3 and tuner.fixed
        assert tuner.watch([]).startswith("threads: 3, as this run last trained with")
        assert all(tuner.watch([0.1] * n) is None for n in range(1, 40)) and torch.get_num_threads() == 3
        set_threads(1)  # given: wins, said
        tuner = thread_tuner(torch.device("cpu"), 1, last_used=3)
        assert torch.get_num_threads() == 1 and "may differ in the last digits" in tuner.watch([])
        set_threads(3)  # given, the same: nothing to say
        assert thread_tuner(torch.device("cpu"), 1, last_used=3) is None
    finally:
        torch.set_num_threads(before)
        take_threads_choice()


@pytest.mark.slow
def test_a_resumed_run_equals_an_uninterrupted_one_bit_for_bit(char_data, tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the automatic choice, which follows the load
    flags = ("--max-iters", "4", "--eval-interval", "2", "--threads", "1", "--quiet")
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert invoke(command(char_data, whole, *flags)).exit_code == 0
    assert invoke(command(char_data, parts, *flags, "--stop-at", "2")).exit_code == 0
    assert json.loads((parts / "trainer.json").read_text())["threads"] == 1
    resumed = invoke(command(char_data, parts, *flags[:4], "--resume"))  # no --threads: the run's own count
    assert resumed.exit_code == 0, resumed.output
    assert "threads: 1, as this run last trained with" in resumed.output
    a, b = (load_file(run / "model.safetensors") for run in (whole, parts))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
