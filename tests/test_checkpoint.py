"""Checkpoint files: weights and optimizer round trips, tied weights, atomic writes, invalid files."""

import json
import os
import threading
import time

import pytest
import torch

from nanogpt_cli.config import TrainConfig
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.files import atomic_write, write_json
from nanogpt_cli.interop.loading import load_model
from nanogpt_cli.model import GPT
from nanogpt_cli.runs import checkpoint as ckpt
from nanogpt_cli.runs.rundir import resolve_weights
from nanogpt_cli.training.optim import adamw_groups
from nanogpt_cli.training.plan import plan_run
from nanogpt_cli.training.request import RunRequest
from nanogpt_cli.training.trainer import train
from conftest import tiny_config, tiny_plan


def tiny(**kw):
    return GPT(tiny_config(**kw))


@pytest.mark.parametrize("tie", [True, False])
def test_save_load_gives_identical_logits_and_keeps_ties(tmp_path, tie):
    torch.manual_seed(0)
    model = tiny(tie_embeddings=tie, pos_encoding="learned", bias=True)
    path = tmp_path / "m.safetensors"
    ckpt.save_model(path, model, {"step": 7, "tokenizer": {"name": "byte", "vocab_size": 256}})
    loaded, meta = load_model(path)
    assert meta["step"] == 7 and meta["tokenizer"]["name"] == "byte" and meta["format"] == "nanogpt"
    assert loaded.config == model.config
    x = torch.randint(0, 50, (2, 16))
    assert torch.equal(loaded(x)[0], model(x)[0])
    assert (loaded.lm_head.weight is loaded.transformer.wte.weight) == tie


def test_optimizer_state_round_trips(tmp_path):
    torch.manual_seed(0)
    model = tiny()
    opt = torch.optim.AdamW(adamw_groups(model, list(model.parameters()), TrainConfig(weight_decay=0.1)), lr=1e-3)
    model(torch.randint(0, 50, (2, 8)), torch.randint(0, 50, (2, 8)))[1].backward()
    opt.step()
    ckpt.save_optimizer(tmp_path / "o.safetensors", opt, step=3)
    other = torch.optim.AdamW(adamw_groups(model, list(model.parameters()), TrainConfig(weight_decay=0.5)), lr=9.0)
    assert ckpt.load_optimizer(tmp_path / "o.safetensors", other) == 3
    a, b = opt.state_dict(), other.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for i, state in a["state"].items():
        for key, value in state.items():
            assert torch.equal(value, b["state"][i][key]), key


def test_a_failed_write_keeps_the_previous_file(tmp_path):
    path = tmp_path / "f.json"
    write_json(path, {"v": 1})

    def broken(tmp):
        tmp.write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_write(path, broken)
    assert json.loads(path.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_rng_state_round_trips():
    state = torch.get_rng_state()
    assert torch.equal(ckpt.decode_rng(ckpt.encode_rng(state)), state)


def test_run_folders_resolve_to_best_then_last(tmp_path):
    model = tiny()
    ckpt.save_model(tmp_path / "model.safetensors", model, {"step": 2})
    assert resolve_weights(tmp_path) == tmp_path / "model.safetensors"
    ckpt.save_model(tmp_path / "best.safetensors", model, {"step": 1})
    assert resolve_weights(tmp_path) == tmp_path / "best.safetensors"
    assert resolve_weights(tmp_path, last=True) == tmp_path / "model.safetensors"
    with pytest.raises(NanoGPTError, match="does not exist; runs in"):
        resolve_weights(tmp_path.parent / "nope")


def metrics(run_dir):
    """The evaluation lines of metrics.jsonl (train-step lines have kind "train")."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if m.get("kind", "eval") == "eval"]


def test_a_save_cut_short_between_its_renames_resumes_from_the_previous_one(char_data, tmp_path):
    data_dir, name = char_data
    whole = tmp_path / "whole"
    train(tiny_plan(data_dir, name, whole, max_iters=6, eval_interval=2))
    run = tmp_path / "run"
    train(tiny_plan(data_dir, name, run, max_iters=6, eval_interval=2, stop_at=2))
    # a crash after the step-4 weights and optimizer were renamed into place, before trainer.json was
    for fname in ("model.safetensors", "optimizer.safetensors"):
        os.link(run / fname, run / f".{fname}.prev")
    train(tiny_plan(data_dir, name, tmp_path / "ahead", max_iters=6, eval_interval=2, stop_at=4))
    for fname in ("model.safetensors", "optimizer.safetensors"):
        os.replace(tmp_path / "ahead" / fname, run / fname)
    result = train(plan_run(RunRequest({}, out=run, resume=True)))
    assert result.step == 6
    assert metrics(run) == [dict(m, elapsed_s=p["elapsed_s"]) for m, p in zip(metrics(whole), metrics(run))]
    (run / "trainer.json").write_text(json.dumps(dict(json.loads((run / "trainer.json").read_text()), step=3)))
    with pytest.raises(NanoGPTError, match="model.safetensors is from step 6, not the trainer's step 3"):
        train(plan_run(RunRequest({}, out=run, resume=True)))


# --- damaged run folders are one sentence with a way forward (issue 12) ---


@pytest.fixture
def stopped_run(char_data, tmp_path):
    """A tiny run stopped at step 4 of 8 (evaluated at 2 and 4, so best and last both exist)."""
    data_dir, name = char_data
    run = tmp_path / "run"
    train(tiny_plan(data_dir, name, run, max_iters=8, eval_interval=2, stop_at=4))
    return run


def cli(*args):
    from typer.testing import CliRunner

    from nanogpt_cli.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def truncate(path):
    """A torn copy of the file under its name, as a write cut short leaves one: a new file (the run's files are
    only ever replaced, never written in place, so another name linked to the old one keeps it whole)."""
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data[: len(data) // 2])


def test_a_truncated_last_weights_file_points_to_best(stopped_run):
    truncate(stopped_run / "model.safetensors")
    with pytest.raises(
        NanoGPTError,
        match=r"cannot resume .*model.safetensors is truncated or damaged.*"
        r"best.safetensors \(step \d\) is intact.*--init-from",
    ):
        plan_run(RunRequest({}, out=stopped_run, resume=True))
    code, output = cli("sample", "--checkpoint", stopped_run, "--last", "--max-new-tokens", "2")
    assert code == 1 and "model.safetensors is truncated or damaged" in output
    assert "its best.safetensors (step" in output and "use it without --last" in output
    assert cli("sample", "--checkpoint", stopped_run, "--max-new-tokens", "2")[0] == 0  # best still works


def test_a_truncated_best_points_to_last(stopped_run, char_data):
    data_dir, name = char_data
    truncate(stopped_run / "best.safetensors")
    code, output = cli("eval", "perplexity", "--checkpoint", stopped_run, "--data", name, "--data-dir", data_dir)
    assert code == 1 and "best.safetensors is truncated or damaged" in output and "use it with --last" in output
    code, output = cli(
        "train",
        "--data",
        name,
        "--data-dir",
        data_dir,
        "--init-from",
        stopped_run,
        "--out",
        stopped_run.parent / "tuned",
        "--max-iters",
        "1",
    )
    assert code == 1 and "best.safetensors is truncated or damaged" in output and "use it with --last" in output
    assert (
        plan_run(RunRequest({}, out=stopped_run, resume=True)).step == 4
    )  # resuming needs only last, optimizer, trainer


@pytest.mark.parametrize(
    "name,damage,message",
    [
        ("optimizer.safetensors", "truncate", "optimizer.safetensors is truncated or damaged"),
        ("optimizer.safetensors", "delete", "optimizer.safetensors is missing"),
        ("trainer.json", "garbage", "trainer.json is damaged"),
        ("trainer.json", "delete", "trainer.json is missing"),
        ("trainer.json", "empty object", "trainer.json is damaged (missing 'step')"),
        ("config.json", "garbage", "config.json is damaged"),
        ("config.json", "delete", "config.json is missing"),
    ],
)
def test_damaged_resume_files_are_one_sentence_naming_the_way_on(stopped_run, name, damage, message):
    path = stopped_run / name
    if damage == "truncate":
        truncate(path)
    elif damage == "delete":
        path.unlink()
    elif damage == "garbage":
        path.write_bytes(b'{"step": 4, "tok\xff')
    else:
        path.write_text("{}")
    before = {p.name: p.read_bytes() for p in stopped_run.iterdir()}
    code, output = cli("train", "--out", stopped_run, "--resume")
    assert code == 1 and message in output, output
    assert "is intact: start a new run from it with `nanogpt train --init-from" in output
    assert {p.name: p.read_bytes() for p in stopped_run.iterdir()} == before  # nothing changed


def test_a_torn_last_metrics_line_is_skipped_with_a_note(stopped_run):
    with open(stopped_run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "eval", "step": 6, "train_lo')  # a crash mid-line
    plan = plan_run(RunRequest({}, out=stopped_run, resume=True))
    assert any("skipped 1 damaged line" in n for n in plan.notes)
    train(plan)
    lines = [json.loads(x) for x in (stopped_run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if m["kind"] == "eval"] == [0, 2, 4, 6, 8]


def test_only_rundir_knows_the_run_folder_file_names():
    # one owner per file format: every other module asks RunDir (its docstring lists the layout)
    from pathlib import Path

    import nanogpt_cli
    from nanogpt_cli.runs import rundir

    names = [rundir.BEST, rundir.OPTIMIZER, rundir.TRAINER, rundir.METRICS]
    package = Path(nanogpt_cli.__file__).parent
    for path in package.rglob("*.py"):
        if path.name != "rundir.py":
            text = path.read_text(encoding="utf-8")
            assert not [n for n in names if n in text], path


def test_every_file_of_a_run_gets_the_umask_mode(char_data, tmp_path):
    """safetensors creates its files 0600; the run's weights and optimizer get the mode of every other file."""
    data_dir, name = char_data
    old = os.umask(0o022)
    try:
        train(tiny_plan(data_dir, name, tmp_path / "run", max_iters=2, eval_interval=2))
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "run").iterdir() if p.is_file()}
    assert {"model.safetensors", "optimizer.safetensors", "trainer.json"} <= set(modes)
    assert set(modes.values()) == {0o644}, modes


def test_best_weights_saved_last_are_one_file_on_disk_and_resume_exactly(char_data, tmp_path):
    data_dir, name = char_data
    whole = train(tiny_plan(data_dir, name, tmp_path / "whole", max_iters=6, eval_interval=3))
    run = tmp_path / "run"
    train(tiny_plan(data_dir, name, run, max_iters=6, eval_interval=3, stop_at=3))
    best, last = (run / "best.safetensors").stat(), (run / "model.safetensors").stat()
    assert best.st_ino == last.st_ino and last.st_nlink == 2  # the step-3 save was the best: one copy
    resumed = train(plan_run(RunRequest({}, out=run, resume=True)))
    assert resumed.val_loss == whole.val_loss and resumed.train_loss == whole.train_loss
    best, last = (run / "best.safetensors").stat(), (run / "model.safetensors").stat()
    if resumed.best_val_loss == resumed.val_loss:  # the final save was the best again
        assert best.st_ino == last.st_ino
    else:  # the best stays the step-3 file, untouched by the later save
        assert best.st_ino != last.st_ino and best.st_nlink == 1


# --- saves written in the background ---


def trained_pair(muon: bool = False):
    """A tiny model and its optimizer after two updates, so the optimizer has state to save."""
    from nanogpt_cli.config import TrainConfig
    from nanogpt_cli.training.optim import make_optimizer

    torch.manual_seed(0)
    model = tiny()
    opt = make_optimizer(model, TrainConfig(optimizer="muon" if muon else "adamw"), torch.device("cpu"))
    for _ in range(2):
        update(model, opt)
    return model, opt


def update(model, opt):
    model(torch.randint(0, 50, (2, 8)), torch.randint(0, 50, (2, 8)))[1].backward()
    opt.step()
    opt.zero_grad()


def files(run):
    """Each file of a run folder by name: its bytes, safetensors files as (header, data bytes). safetensors'
    writer orders the header's metadata keys at random (a Rust HashMap), so two saves of one state differ in
    that order and in nothing else: everything else is compared byte for byte."""
    out = {}
    for path in sorted(run.iterdir()):
        data = path.read_bytes()
        if path.suffix == ".safetensors":
            n = int.from_bytes(data[:8], "little")
            out[path.name] = (json.loads(data[8 : 8 + n]), len(data), data[8 + n :])
        else:
            out[path.name] = data
    return out


@pytest.mark.parametrize("muon", [False, True])
def test_a_background_save_is_the_synchronous_one_byte_for_byte_while_training_goes_on(tmp_path, monkeypatch, muon):
    from nanogpt_cli.runs import rundir

    model, opt = trained_pair(muon)
    state = ckpt.TrainerState(step=2, tokens=32, best_val_loss=1.5, rng_torch=torch.get_rng_state())
    meta = {"tokenizer": {"name": "byte", "vocab_size": 256}, "val_loss": 1.5}
    (tmp_path / "sync").mkdir(), (tmp_path / "background").mkdir()
    rundir.RunDir(tmp_path / "sync").save(model, opt, state, meta, is_best=True)
    go_on = threading.Event()  # the write stops half way until training has changed the state
    monkeypatch.setattr(rundir, "_between_files", lambda: go_on.wait(timeout=30))
    with rundir.Saver(rundir.RunDir(tmp_path / "background")) as saver:
        saver.save(model, opt, state, meta, is_best=True)
        update(model, opt)  # what training does next: weights and optimizer state change in place
        state.step, state.best_val_loss = 3, 1.0
        staged, until = tmp_path / "background" / ".model.safetensors.staged", time.monotonic() + 30
        while not staged.is_file():  # the writer thread (at a lower priority) has begun: the weights are written
            assert time.monotonic() < until, "the background writer wrote nothing within 30 s"
            time.sleep(0.01)
        assert saver.busy()  # and it waits half way, on go_on
        go_on.set()
    sync, background = files(tmp_path / "sync"), files(tmp_path / "background")
    assert {"model.safetensors", "best.safetensors", "optimizer.safetensors", "trainer.json"} == set(background)
    assert background == sync  # the snapshot, not the state it was written after
    assert (tmp_path / "background" / "best.safetensors").stat().st_nlink == 2


def test_a_failed_background_write_is_raised_on_the_training_thread(tmp_path):
    from nanogpt_cli.runs import rundir

    model, opt = trained_pair()
    saver = rundir.Saver(rundir.RunDir(tmp_path / "gone"))  # no such folder: the write fails
    saver.save(model, opt, ckpt.TrainerState(step=2), {}, is_best=False)
    with pytest.raises(Exception, match="No such file or directory"):
        saver.wait()
    saver.wait()  # raised once


def test_a_run_saved_in_the_background_equals_one_saved_synchronously(char_data, tmp_path):
    data_dir, name = char_data
    for mode, sync in (("sync", True), ("background", False)):
        train(tiny_plan(data_dir, name, tmp_path / mode, max_iters=6, eval_interval=2, sync_save=sync))
    sync, background = files(tmp_path / "sync"), files(tmp_path / "background")
    assert set(sync) == set(background)
    for fname in ("model.safetensors", "best.safetensors", "optimizer.safetensors"):
        assert sync[fname] == background[fname], fname
    timings = ("elapsed_s", "eval_s", "speed")
    a, b = (json.loads(run["trainer.json"]) for run in (sync, background))
    assert {k: v for k, v in a.items() if k not in timings} == {k: v for k, v in b.items() if k not in timings}
    assert metrics(tmp_path / "sync") == [
        dict(m, elapsed_s=s["elapsed_s"]) for m, s in zip(metrics(tmp_path / "background"), metrics(tmp_path / "sync"))
    ]


def slow_train(run, data_dir, name, *flags, delay="1.5"):
    """`nanogpt train` of the tiny preset in a process of its own, each save taking `delay` more seconds
    between writing its weights and its optimizer state."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "nanogpt_cli", "train", "--data", name, "--data-dir", str(data_dir)]
    cmd += ["--preset", "tiny", "--dtype", "float32", "--device", "cpu", "--out", str(run), *flags]
    env = dict(os.environ, NANOGPT_TEST_SLOW_SAVE=delay)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def wait_for(proc, condition, timeout=60):
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def trained_steps(run):
    """The steps of metrics.jsonl's train lines: how far the loop has got."""
    if not (run / "metrics.jsonl").is_file():
        return []
    lines = (json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.endswith("}"))
    return [m["step"] for m in lines if m.get("kind") == "train"]


def saved_step(run):
    try:
        return json.loads((run / "trainer.json").read_text())["step"]
    except (FileNotFoundError, ValueError):
        return None


@pytest.mark.slow
def test_kill_9_during_a_background_save_resumes_from_the_previous_complete_one(char_data, tmp_path):
    import signal

    data_dir, name = char_data
    flags = dict(max_iters=8, eval_interval=2)
    whole = tmp_path / "whole"
    train(tiny_plan(data_dir, name, whole, **flags))
    run = tmp_path / "run"
    proc = slow_train(run, data_dir, name, "--max-iters", "8", "--eval-interval", "2", "--log-interval", "1")
    try:
        # the step-2 save is complete, the step-4 one is half written, and the loop has trained on past it
        wait_for(proc, lambda: saved_step(run) == 2 and max(trained_steps(run)) >= 5)
        assert (run / ".model.safetensors.staged").is_file() and saved_step(run) == 2
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    result = train(plan_run(RunRequest({}, out=run, resume=True)))
    assert result.step == 8
    assert metrics(run) == [dict(m, elapsed_s=p["elapsed_s"]) for m, p in zip(metrics(whole), metrics(run))]
    assert not list(run.glob(".*.staged"))
    a, _ = load_model(whole, last=True)
    b, _ = load_model(run, last=True)
    for (n, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), n


@pytest.mark.slow
def test_sigint_during_a_background_save_waits_for_it_and_leaves_a_resumable_run(char_data, tmp_path):
    import signal

    data_dir, name = char_data
    run = tmp_path / "run"
    proc = slow_train(run, data_dir, name, "--max-iters", "100000", "--eval-interval", "2", "--log-interval", "1")
    try:
        # the first save (step 2) is half written and the loop has trained on past it
        wait_for(proc, lambda: (run / ".model.safetensors.staged").is_file() and max(trained_steps(run)) >= 3)
        assert saved_step(run) is None
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    step = saved_step(run)
    assert step >= 3  # the final save, written after the one in progress
    assert ckpt.file_step(run / "model.safetensors") == ckpt.file_step(run / "optimizer.safetensors") == step
    assert not list(run.glob(".*.staged")) and not list(run.glob(".*.prev"))
    result = train(plan_run(RunRequest({"max_iters": step + 2}, out=run, resume=True)))
    assert result.step == step + 2
