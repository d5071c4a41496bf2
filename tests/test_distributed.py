"""Training under torchrun on the CPU (gloo, 2 processes): world-size invariance for DDP and FSDP, stop and
resume across world sizes, SIGTERM to one rank, and checkpoints that load anywhere; fine-tuning (distillation
from a live teacher and from teacher shards, LoRA stopped and resumed) under --nproc 2 as in one process.

Each run is a real `python -m torch.distributed.run ... -m nanogpt_cli train` (or `nanogpt train --nproc 2`, or
finetune); the tests judge the files rank 0 wrote and the launcher's exit status.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from nanogpt_cli.cli import app

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()
pytestmark = pytest.mark.slow  # every test here starts torchrun or the CLI
# eval_iters 3: an odd number, so the two ranks evaluate unequal shares and one makes a padding pass
SMALL = [
    "--preset",
    "tiny",
    "--batch-size",
    "4",
    "--max-iters",
    "6",
    "--eval-interval",
    "2",
    "--eval-iters",
    "3",
    "--log-interval",
    "1",
    "--dtype",
    "float32",
    "--device",
    "cpu",
]
ACCUM = "--gradient-accumulation-steps"


def env() -> dict:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)


def launch(procs: int, *args: str) -> list[str]:
    if procs == 1:
        return [sys.executable, "-m", "nanogpt_cli", "train", *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(procs),
        "-m",
        "nanogpt_cli",
        "train",
        *args,
    ]


def train(procs: int, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(launch(procs, *args), env=env(), capture_output=True, text=True, timeout=120)
    if ok:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def metrics(run: Path, kind: str = "eval") -> list[dict]:
    """The evaluation lines of metrics.jsonl, or with kind="train" the progress lines (every --log-interval)."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if m.get("kind", "eval") == kind]


def assert_same_run(a: Path, b: Path, tol: float = 1e-5) -> None:
    ma, mb = metrics(a), metrics(b)
    assert [m["step"] for m in ma] == [m["step"] for m in mb]
    for x, y in zip(ma, mb):
        assert x["tokens"] == y["tokens"] and x["lr"] == y["lr"]
        assert x["train_loss"] == pytest.approx(y["train_loss"], abs=tol)
        assert x["val_loss"] == pytest.approx(y["val_loss"], abs=tol)
    # every update's training loss (all-reduced over the processes), as logged
    ta, tb = metrics(a, "train"), metrics(b, "train")
    assert [m["step"] for m in ta] == [m["step"] for m in tb] == list(range(1, 7))
    for x, y in zip(ta, tb):
        assert x["loss"] == pytest.approx(y["loss"], abs=tol)
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=0, atol=tol, msg=name)


def train_here(*args: str) -> None:
    """One process, in this one: no launch to pay for."""
    result = runner.invoke(app, ["train", *args, "--quiet"])
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def runs(char_data, tmp_path_factory) -> dict[str, Path]:
    """The same run in 1 process and in 2 with DDP (accumulation 2: one micro-batch per process); with
    accumulation 4 (two per process, the gradients reduced after the second) in 1 process, and with FSDP in
    2 processes stopped at step 3, then resumed in 2 processes (fsdp) and in 1."""
    data_dir, name = char_data
    root = tmp_path_factory.mktemp("dist")
    data = ["--data", name, "--data-dir", str(data_dir)]
    out = {k: root / k for k in ("one", "ddp", "one-accum-4", "stopped", "fsdp", "fsdp-then-one")}
    train_here(*data, *SMALL, ACCUM, "2", "--out", str(out["one"]))
    train(2, *data, *SMALL, ACCUM, "2", "--out", str(out["ddp"]), "--parallel", "ddp")
    train_here(*data, *SMALL, ACCUM, "4", "--out", str(out["one-accum-4"]))
    train(2, *data, *SMALL, ACCUM, "4", "--out", str(out["stopped"]), "--parallel", "fsdp", "--stop-at", "3", "--quiet")
    for resumed in ("fsdp", "fsdp-then-one"):
        shutil.copytree(out["stopped"], out[resumed])
    train(2, "--out", str(out["fsdp"]), "--resume", "--quiet")
    train_here("--out", str(out["fsdp-then-one"]), "--resume")
    return out


def test_two_processes_with_ddp_train_like_one(runs):
    assert_same_run(runs["one"], runs["ddp"])
    # the run folder holds the same files as a one-process run, written once
    assert sorted(p.name for p in runs["ddp"].iterdir()) == sorted(p.name for p in runs["one"].iterdir())
    assert json.loads((runs["ddp"] / "config.json").read_text())["train"]["parallel"] == "ddp"


def test_fsdp_stopped_under_two_processes_resumes_under_two_or_one_like_one_process(runs):
    stopped = runs["stopped"]
    assert json.loads((stopped / "trainer.json").read_text())["step"] == 3
    assert [m["step"] for m in metrics(stopped)] == [0, 2]
    assert json.loads((runs["fsdp"] / "config.json").read_text())["train"]["parallel"] == "fsdp"
    assert_same_run(runs["one-accum-4"], runs["fsdp"])
    assert_same_run(runs["one-accum-4"], runs["fsdp-then-one"])


def test_a_checkpoint_from_two_processes_samples_like_one_from_one(runs):
    texts = []
    for run in (runs["one"], runs["ddp"], runs["one-accum-4"], runs["fsdp"]):
        result = runner.invoke(
            app,
            [
                "sample",
                "--checkpoint",
                str(run),
                "--prompt",
                "KING:",
                "--temperature",
                "0",
                "--max-new-tokens",
                "40",
                "--no-stream",
                "--device",
                "cpu",
                "--dtype",
                "float32",
            ],
        )
        assert result.exit_code == 0, result.output
        texts.append(result.output)
    assert texts[0] == texts[1] and texts[2] == texts[3] and "KING:" in texts[0]


def test_sigterm_to_one_rank_stops_both_after_a_save(char_data, tmp_path):
    data_dir, name = char_data
    run = tmp_path / "run"
    launcher = subprocess.Popen(
        launch(
            2,
            "--data",
            name,
            "--data-dir",
            str(data_dir),
            *SMALL,
            ACCUM,
            "4",
            "--max-iters",
            "100000",
            "--eval-interval",
            "100000",
            "--out",
            str(run),
        ),
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline, logged = time.monotonic() + 60, run / "metrics.jsonl"
        while launcher.poll() is None and time.monotonic() < deadline:  # until rank 0 logs a step (--log-interval 1)
            if logged.exists() and '"kind": "train"' in logged.read_text():
                break
            time.sleep(0.05)
        rank1 = next(pid for pid in workers(launcher.pid) if rank_of(pid) == 1)
        os.kill(rank1, signal.SIGTERM)
        out, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode != 0
    resume = f"nanogpt train --out {run} --resume"
    said, report = err.split("Traceback (most recent call last)", 1)  # rank 0's lines, then torchrun's report
    assert (out + said).count(resume) == 1, out + err
    # the report's root cause is our line too (the error file), not a pointer to the docs
    assert resume in [line for line in report.splitlines() if "traceback :" in line][-1], report[-3000:]
    # torchrun's failure report: both ranks ended with SIGTERM's 143 (none was killed by torchrun on the way out)
    assert re.findall(r"exitcode\s*:\s*(-?\d+) \(pid", err) == ["143", "143"], err[-3000:]
    state = json.loads((run / "trainer.json").read_text())
    assert state["step"] > 0
    result = runner.invoke(
        app, ["train", "--out", str(run), "--resume", "--max-iters", str(state["step"] + 2), "--quiet"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads((run / "trainer.json").read_text())["step"] == state["step"] + 2


def workers(launcher_pid: int) -> list[int]:
    children = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
    return [int(pid) for pid in children]


def rank_of(pid: int) -> int | None:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    rank = next((v for v in environ if v.startswith(b"RANK=")), None)
    return int(rank[5:]) if rank else None


def test_evaluation_batches_are_dealt_out_with_equal_passes():
    from nanogpt_cli.training.distributed import ProcessGroup, World

    worlds = [ProcessGroup(torch.device("cpu"), rank, rank, 2) for rank in (0, 1)]
    assert [w.eval_share(3) for w in worlds] == [([0, 2], 2), ([1, 1], 1)]  # rank 1 repeats its batch, uncounted
    assert [w.eval_share(4) for w in worlds] == [([0, 2], 2), ([1, 3], 2)]
    assert [list(w.micro_share(4)) for w in worlds] == [[0, 1], [2, 3]]
    one = World(torch.device("cpu"))  # one process: all the work, and collectives that return their input
    assert one.eval_share(3) == ([0, 1, 2], 3) and list(one.micro_share(4)) == [0, 1, 2, 3]
    model, loss = torch.nn.Linear(2, 2), torch.tensor(1.5)
    assert one.wrap(model, "fsdp", torch.float32) is model and one.mean(loss) is loss and one.max_int(2) == 2


def test_a_shortened_evaluation_keeps_each_ranks_share_of_the_first_batches():
    from nanogpt_cli.training.distributed import ProcessGroup, eval_prefix

    for size in (1, 2, 3):  # each rank holds its share of 7 batches (their indices); --max-time keeps the first n
        for rank in range(size):
            world = ProcessGroup(torch.device("cpu"), rank, rank, size)
            mine = world.eval_share(7)[0]
            for n in range(1, 8):
                kept, counted = eval_prefix(mine, n, world)
                share, should = world.eval_share(n)
                assert counted == should and kept[:counted] == share[:counted]  # the same batches count
                assert len(kept) == len(share)  # and every rank makes the same forward passes


def test_accumulation_not_divisible_by_processes_is_one_sentence(char_data, tmp_path, monkeypatch):
    data_dir, name = char_data
    # what torchrun tells rank 0 of 2; refused before the process group is joined, so nothing waits for rank 1
    for var, value in dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0").items():
        monkeypatch.setenv(var, value)
    result = runner.invoke(
        app, ["train", "--data", name, "--data-dir", str(data_dir), *SMALL, ACCUM, "3", "--out", str(tmp_path / "run")]
    )
    assert result.exit_code == 1
    assert "--gradient-accumulation-steps (3) counts micro-batches over all processes" in result.output
    assert not (tmp_path / "run").exists()


# --- nanogpt train --nproc: torch's elastic launcher, run inside our process ---


def test_nproc_refusals_are_one_line_before_any_process_starts(char_data, tmp_path):
    data_dir, name = char_data
    base = ["train", "--nproc", "2", "--data", name, "--data-dir", str(data_dir), *SMALL, "--out", str(tmp_path / "r")]
    for extra, said in (
        ([ACCUM, "3"], "--gradient-accumulation-steps (3) counts micro-batches over all processes"),
        (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
        (["--device", "cuda:1"], "--device cuda:1: with several processes each takes the GPU of its local rank"),
    ):
        result = runner.invoke(app, [*base, *extra])
        assert result.exit_code == 1 and said in result.output, result.output
        assert result.output.count("\n") == 1 and not (tmp_path / "r").exists()


def test_nproc_trains_and_ctrl_c_stops_every_process_with_one_resume_line(char_data, tmp_path):
    """`nanogpt train --nproc 2` as a user runs it: the launcher is the nanogpt process; Ctrl-C (SIGINT to it, as a
    terminal sends) stops both processes after a save, and the command printed to resume resumes."""
    data_dir, name = char_data
    run = tmp_path / "run"
    args = ["--nproc", "2", "--data", name, "--data-dir", str(data_dir), *SMALL, "--max-iters", "100000"]
    nanogpt = [sys.executable, "-m", "nanogpt_cli", "train"]
    launcher = subprocess.Popen(
        [*nanogpt, *args, "--eval-interval", "100000", "--out", str(run)],
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline, logged = time.monotonic() + 90, run / "metrics.jsonl"
        while launcher.poll() is None and time.monotonic() < deadline:  # until rank 0 logs a step (--log-interval 1)
            if logged.exists() and '"kind": "train"' in logged.read_text():
                break
            time.sleep(0.05)
        started = workers(launcher.pid)
        assert len(started) == 2 and sorted(rank_of(p) for p in started) == [0, 1]
        os.kill(launcher.pid, signal.SIGINT)
        out, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 130, err[-3000:]
    resume = f"nanogpt train --nproc 2 --out {run} --resume"
    assert (out + err).count("resume with") == 1 and err.rstrip().endswith(resume), err[-3000:]
    assert "Traceback" not in err and "torch.distributed" not in err
    assert not [p for p in started if Path(f"/proc/{p}").exists()]  # no process left behind
    step = json.loads((run / "trainer.json").read_text())["step"]
    assert step > 0
    # the printed command, as printed (plus where to stop), continues the run in two processes
    proc = subprocess.run(
        [*nanogpt, *resume.split()[2:], "--stop-at", str(step + 2)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming at step {step:,}" in proc.stdout and "2 x cpu, ddp" in proc.stdout
    assert json.loads((run / "trainer.json").read_text())["step"] == step + 2


def test_auto_in_two_processes_plans_one_run_and_rank_0s_clock_ends_both(char_data, tmp_path):
    """--preset auto under --nproc 2 (the launcher probes once and hands its figures down) and under plain torchrun
    (rank 0 probes for both): both processes plan the same run, with accumulation a multiple of 2, and --max-time
    ends both after the same update (a rank that went on alone would wait for the other until the timeout)."""
    data_dir, name = char_data
    args = ["--data", name, "--data-dir", str(data_dir), "--max-time", "3s", "--device", "cpu", "--dtype", "float32"]
    args += ["--max-iters", "100000"]  # given: auto's cap of 4 passes over this small text would end a fast run first
    nanogpt = [sys.executable, "-m", "nanogpt_cli", "train", "--nproc", "2"]
    for run in (tmp_path / "nproc", tmp_path / "torchrun"):
        command = nanogpt if run.name == "nproc" else launch(2)
        proc = subprocess.run(
            [*command, *args, "--out", str(run), "--no-plot"], env=env(), capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.count("probe: 2 layers") == 1 and "--preset auto" in proc.stdout
        config = json.loads((run / "config.json").read_text())
        assert "n_layer" in config["auto"]["chosen"] and config["train"]["gradient_accumulation_steps"] % 2 == 0
        assert json.loads((run / "report.json").read_text())["ending"] == "max_time"


def test_a_failing_process_under_plain_torchrun_reports_our_sentence(char_data, tmp_path):
    data_dir, name = char_data
    proc = train(
        2, "--data", name, "--data-dir", str(data_dir), *SMALL, ACCUM, "3", "--out", str(tmp_path / "r"), ok=False
    )
    assert proc.returncode == 1
    said = "error: --gradient-accumulation-steps (3) counts micro-batches over all processes"
    # torchrun's report ends with the root cause: its traceback line is our sentence, not a pointer to the docs
    last = [line for line in proc.stderr.splitlines() if "traceback :" in line][-1]
    assert said in last, proc.stderr[-3000:]


def test_each_process_gets_the_command_as_given_with_the_planned_run_folder():
    from nanogpt_cli.config import LRSchedule
    from nanogpt_cli.training.launch import train_args

    given = {"learning_rate": 1e-3, "compile": False, "lr_schedule": LRSchedule.wsd}
    options = {"preset": "tiny", "resume": True, "quiet": False, "config": None, "threads": 2, "distill_top_k": 0}
    assert train_args(given, options, Path("checkpoints/x")) == [
        *["--learning-rate", "0.001", "--no-compile", "--lr-schedule", "wsd", "--preset", "tiny", "--resume"],
        *["--threads", "2", "--distill-top-k", "0", "--out", "checkpoints/x"],
    ]


# --- nanogpt finetune --nproc: sft (full or LoRA) and distill, through the same launcher ---


def nanogpt(*args: str) -> subprocess.CompletedProcess:
    """`nanogpt ARGS` as a user runs it (with --nproc the launcher is this process), checked to succeed."""
    command = [sys.executable, "-m", "nanogpt_cli", *args]
    proc = subprocess.run(command, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def finetune_here(*args: str) -> None:
    result = runner.invoke(app, ["finetune", *args, "--quiet", "--no-plot"])
    assert result.exit_code == 0, result.output


def test_distill_from_a_live_teacher_in_two_processes_trains_like_one(char_data, trained_run, tmp_path):
    """finetune --method distill --nproc 2: each process loads its own teacher, takes its share of the micro-batches
    and the gradients are averaged, so the run is the one-process run (a new student, full vocabulary)."""
    data_dir, name = char_data
    args = ["--method", "distill", "--teacher", str(trained_run), "--distill-top-k", "0", "--block-size", "16"]
    args += ["--data", name, "--data-dir", str(data_dir), *SMALL, ACCUM, "2"]
    finetune_here(*args, "--out", str(tmp_path / "one"))
    proc = nanogpt("finetune", "--nproc", "2", *args, "--out", str(tmp_path / "two"), "--no-plot")
    assert "2 x cpu, ddp" in proc.stdout and "distilled from" in proc.stdout
    assert_same_run(tmp_path / "one", tmp_path / "two")
    assert (tmp_path / "two" / "report.md").is_file()


def test_distill_from_teacher_shards_in_two_processes_trains_like_one(char_data, trained_run, tmp_path):
    from nanogpt_cli.training.distill import label_dataset

    data_dir, name = char_data
    shutil.copytree(data_dir / name, tmp_path / "data" / name)  # labeled here: the shared dataset stays unlabeled
    label_dataset(tmp_path / "data", name, str(trained_run), top_k=5, temperature=0.5, context=16)
    args = [
        "--method",
        "distill",
        "--init-from",
        str(trained_run),
        "--data",
        name,
        "--data-dir",
        str(tmp_path / "data"),
    ]
    args += [*SMALL, ACCUM, "2", "--distill-alpha", "0.8"]
    finetune_here(*args, "--out", str(tmp_path / "one"))
    nanogpt("finetune", "--nproc", "2", *args, "--out", str(tmp_path / "two"), "--no-plot", "--quiet")
    assert json.loads((tmp_path / "two" / "config.json").read_text())["finetune"]["distill"]["shards"] is True
    assert_same_run(tmp_path / "one", tmp_path / "two")


def test_lora_under_nproc_stops_and_resumes_with_the_printed_command_like_one_process(trained_run, char_data, tmp_path):
    data_dir, name = char_data
    args = ["--init-from", str(trained_run), "--lora", "--lora-r", "4", "--data", name, "--data-dir", str(data_dir)]
    args += [*SMALL, ACCUM, "2"]
    finetune_here(*args, "--out", str(tmp_path / "one"))
    run = tmp_path / "two"
    proc = nanogpt("finetune", "--nproc", "2", *args, "--stop-at", "3", "--out", str(run), "--no-plot")
    assert json.loads((run / "trainer.json").read_text())["step"] == 3
    resume = re.search(r"resume with: (nanogpt .*)", proc.stdout).group(1)
    assert resume == f"nanogpt train --nproc 2 --out {run} --resume", proc.stdout
    proc = nanogpt(*resume.split()[1:], "--no-plot", "--quiet")
    assert_same_run(tmp_path / "one", run)
    saved = load_file(str(run / "model.safetensors"))
    assert saved and all("lora_" in k for k in saved)  # rank 0 saved the adapters only


def test_finetune_nproc_refusals_are_one_line_before_any_process_starts(char_data, trained_run, tmp_path, monkeypatch):
    data_dir, name = char_data
    base = ["finetune", "--init-from", str(trained_run), "--data", name, "--data-dir", str(data_dir), *SMALL]
    base += ["--out", str(tmp_path / "r")]
    for extra, said in (
        (["--nproc", "2", "--method", "dpo"], "--method dpo trains in one process only; drop --nproc"),
        (["--nproc", "2", "--method", "grpo"], "--method grpo trains in one process only; drop --nproc"),
        (["--nproc", "2", ACCUM, "3"], "--gradient-accumulation-steps (3) counts micro-batches over all processes"),
        (["--nproc", "2", "--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    ):
        result = runner.invoke(app, [*base, *extra])
        assert result.exit_code == 1 and said in result.output, result.output
        assert result.output.count("\n") == 1 and not (tmp_path / "r").exists()
    for var, value in dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0").items():  # what torchrun tells rank 0 of 2
        monkeypatch.setenv(var, value)
    result = runner.invoke(app, [*base, "--method", "dpo"])
    assert (
        result.exit_code == 1 and "--method dpo trains in one process only; start it without torchrun" in result.output
    )
    assert not (tmp_path / "r").exists()
