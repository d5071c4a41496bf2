"""Training: the LR schedule, loss going down, checkpoints, exact resume, signals, accumulation, configs."""

import dataclasses
import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from nanogpt_cli.cli import app
from nanogpt_cli.config import GPTConfig, TrainConfig, preset_values, split_values
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.interop.loading import load_model
from nanogpt_cli.model import GPT
from nanogpt_cli.runs import checkpoint as ckpt
from nanogpt_cli.training.optim import lr_at
from nanogpt_cli.training.plan import plan_run
from nanogpt_cli.training.request import RunRequest
from nanogpt_cli.training.trainer import optimizer_step, train
from conftest import tiny_config, tiny_plan

runner = CliRunner()


def resumed(run_dir, **flags):
    return plan_run(RunRequest(flags, out=run_dir, resume=True))


def metrics(run_dir: Path) -> list[dict]:
    """The evaluation lines of metrics.jsonl (train-step lines have kind "train")."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if m.get("kind", "eval") == "eval"]


def test_lr_schedules_hit_their_endpoints():
    cfg = TrainConfig(learning_rate=1e-3, min_lr=1e-4, warmup_iters=10, max_iters=100)
    assert lr_at(0, cfg) == pytest.approx(1e-3 / 11)
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(55, cfg) == pytest.approx((1e-3 + 1e-4) / 2)  # cosine midpoint
    assert lr_at(100, cfg) == pytest.approx(1e-4) and lr_at(500, cfg) == pytest.approx(1e-4)
    lrs = [lr_at(s, cfg) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    const = TrainConfig(learning_rate=1e-3, warmup_iters=10, lr_schedule="constant", max_iters=100)
    assert lr_at(10, const) == lr_at(99, const) == 1e-3
    wsd = TrainConfig(
        learning_rate=1e-3, min_lr=0.0, warmup_iters=10, lr_schedule="wsd", max_iters=100, wsd_decay_frac=0.2
    )
    assert lr_at(79, wsd) == 1e-3
    assert lr_at(90, wsd) == pytest.approx(5e-4)
    assert lr_at(100, wsd) == 0.0


def test_a_tiny_model_lowers_its_loss_and_checkpoints_are_valid(char_data, tmp_path):
    data_dir, name = char_data
    run = tmp_path / "run"
    plan = tiny_plan(data_dir, name, run, max_iters=50, eval_interval=25)
    model_cfg = plan.model
    result = train(plan)
    first, last = metrics(run)[0], metrics(run)[-1]
    assert [m["step"] for m in metrics(run)] == [0, 25, 50]
    assert first["val_loss"] == pytest.approx(math.log(model_cfg.vocab_size), abs=0.3)
    assert last["val_loss"] < first["val_loss"] - 1.0
    assert result.step == 50 and result.val_loss == last["val_loss"]
    assert set(last) >= {"step", "train_loss", "val_loss", "lr", "tokens", "elapsed_s"}

    with safe_open(str(run / "model.safetensors"), framework="pt") as f:
        meta = f.metadata()
        assert "lm_head.weight" not in f.keys()  # the tied head is stored once
    assert GPTConfig.from_json(meta["config"]) == model_cfg
    dataset_meta = json.loads((data_dir / name / "meta.json").read_text())
    assert json.loads(meta["tokenizer"]) == dataset_meta["tokenizer"]
    assert json.loads(meta["step"]) == 50 and json.loads(meta["tokens"]) == 50 * 8 * 32
    assert json.loads(meta["val_loss"]) == pytest.approx(last["val_loss"])
    assert meta["version"]
    for name_ in ("best.safetensors", "optimizer.safetensors", "trainer.json", "config.json"):
        assert (run / name_).is_file()
    assert not list(run.glob(".*tmp*"))

    model, _ = load_model(run, last=True)
    assert model.lm_head.weight is model.transformer.wte.weight
    x = torch.randint(0, model_cfg.vocab_size, (2, 16))
    reloaded, _ = load_model(run / "model.safetensors")
    torch.testing.assert_close(model(x)[0], reloaded(x)[0], rtol=0, atol=0)


def test_a_stopped_and_resumed_run_equals_an_uninterrupted_one(char_data, tmp_path):
    data_dir, name = char_data
    over = dict(max_iters=30, eval_interval=10, dropout=0.1)  # dropout: the RNG state must resume too
    whole = tmp_path / "whole"
    train(tiny_plan(data_dir, name, whole, **over))
    parts = tmp_path / "parts"
    stopped = train(tiny_plan(data_dir, name, parts, stop_at=17, **over))
    assert stopped.stopped == "stop_at" and stopped.step == 17
    assert json.loads((parts / "trainer.json").read_text())["step"] == 17
    plan = resumed(parts)
    assert plan.train.stop_at is None and plan.train.max_iters == 30  # --stop-at ended that invocation, not the run
    result = train(plan)
    assert result.step == 30 and result.stopped is None
    assert metrics(parts) == [dict(m, elapsed_s=p["elapsed_s"]) for m, p in zip(metrics(whole), metrics(parts))]
    a, _ = load_model(whole, last=True)
    b, _ = load_model(parts, last=True)
    for (n, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), n


@pytest.mark.slow
def test_sigint_leaves_a_resumable_checkpoint(char_data, tmp_path):
    data_dir, name = char_data
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "nanogpt_cli",
        "train",
        "--data",
        name,
        "--data-dir",
        str(data_dir),
        "--preset",
        "tiny",
        "--max-iters",
        "1000000",
        "--eval-interval",
        "1000000",
        "--out",
        str(run),
        "--device",
        "cpu",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, logged = time.monotonic() + 60, run / "metrics.jsonl"
    while proc.poll() is None and time.monotonic() < deadline:  # until its first progress line: steps were taken
        if logged.exists() and '"kind": "train"' in logged.read_text():
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert f"nanogpt train --out {run} --resume" in err
    assert "note: stopped by SIGINT after step " in err and "error" not in err  # a stop asked for is no error
    state = json.loads((run / "trainer.json").read_text())
    assert state["step"] > 0
    assert ckpt.read_metadata(run / "model.safetensors")["step"] == state["step"]
    result = runner.invoke(
        app, ["train", "--out", str(run), "--resume", "--max-iters", str(state["step"] + 3), "--quiet"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads((run / "trainer.json").read_text())["step"] == state["step"] + 3


def test_gradient_accumulation_matches_one_big_batch():
    torch.manual_seed(0)
    cfg = tiny_config()
    a, b = GPT(cfg), GPT(cfg)
    b.load_state_dict(a.state_dict())
    before = [p.detach().clone() for p in a.parameters()]
    x, y = torch.randint(0, cfg.vocab_size, (8, 16)), torch.randint(0, cfg.vocab_size, (8, 16))
    # plain SGD: the update is the (clipped) gradient itself, so the two updates must agree closely
    opt_a = torch.optim.SGD(a.parameters(), lr=1.0)
    opt_b = torch.optim.SGD(b.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    import contextlib

    la = optimizer_step(a, opt_a, [(x[:4], y[:4]), (x[4:], y[4:])], contextlib.nullcontext(), scaler, 1.0)
    lb = optimizer_step(b, opt_b, [(x, y)], contextlib.nullcontext(), scaler, 1.0)
    torch.testing.assert_close(la, lb, rtol=0, atol=1e-6)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), before))


def test_toml_and_flags_merge_with_flags_winning(char_data, tmp_path):
    data_dir, name = char_data
    toml = tmp_path / "run.toml"
    toml.write_text(
        f'data = "{name}"\ndata_dir = "{data_dir}"\n[model]\nn_layer = 3\nn_embd = 48\n'
        "[train]\nlearning-rate = 0.002\nbatch_size = 4\n"
    )
    from nanogpt_cli.config import load_toml

    plan = plan_run(RunRequest({"preset": "tiny", "learning_rate": 5e-4}, config=toml, out=tmp_path / "r"))
    model_cfg, cfg = plan.model, plan.train
    assert (model_cfg.n_layer, model_cfg.n_embd, model_cfg.n_head) == (3, 48, 2)  # toml over preset
    assert cfg.learning_rate == 5e-4 and cfg.batch_size == 4  # flag over toml
    assert model_cfg.vocab_size == json.loads((data_dir / name / "meta.json").read_text())["vocab_size"]
    toml.write_text("n_layers = 3\n")
    with pytest.raises(NanoGPTError, match="unknown key.*n_layers"):
        load_toml(toml)


def test_fine_tuning_starts_from_the_given_weights(char_data, tmp_path):
    data_dir, name = char_data
    base = tmp_path / "base"
    result = train(tiny_plan(data_dir, name, base, max_iters=20, eval_interval=20))
    tuned = tmp_path / "tuned"
    flags = {
        "data": name,
        "data_dir": str(data_dir),
        "dtype": "float32",
        "device": "cpu",
        "max_iters": 5,
        "eval_interval": 5,
        "eval_iters": 4,
        "batch_size": 8,
    }
    train(plan_run(RunRequest(flags, out=tuned, init_from=str(base))))
    assert metrics(tuned)[0]["val_loss"] == pytest.approx(result.val_loss, abs=1e-6)
    other = tmp_path / "other.txt"
    other.write_text("abc" * 200)
    from nanogpt_cli.data import prepare

    prepare(str(other), "abc", tokenizer="char", data_dir=data_dir)
    with pytest.raises(NanoGPTError, match="another tokenizer.*3 characters in dataset 'abc' vs"):
        plan_run(
            RunRequest(
                {"preset": "tiny", "data": "abc", "data_dir": str(data_dir)}, out=tmp_path / "x", init_from=str(base)
            )
        )


def test_a_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(char_data, tmp_path):
    data_dir, name = char_data
    run = tmp_path / "run"
    with pytest.raises(NanoGPTError, match="non-finite at step [0-9]+; no checkpoint had been saved yet"):
        train(
            tiny_plan(
                data_dir,
                name,
                tmp_path / "early",
                max_iters=50,
                learning_rate=1e12,
                grad_clip=0.0,
                warmup_iters=0,
                log_interval=1,
            )
        )
    train(tiny_plan(data_dir, name, run, max_iters=50, eval_interval=5, stop_at=10, log_interval=1))
    kept = (run / "model.safetensors").read_bytes()
    with pytest.raises(NanoGPTError, match="non-finite at step 1[1-9]; the last good checkpoint .* is kept"):
        train(plan_run(RunRequest({"learning_rate": 1e12, "grad_clip": 0.0}, out=run, resume=True)))
    assert (run / "model.safetensors").read_bytes() == kept
    assert math.isfinite(ckpt.read_metadata(run / "model.safetensors")["val_loss"])


def run_cli(*args):
    result = runner.invoke(app, list(args))
    return result.exit_code, result.output


@pytest.mark.parametrize(
    "args,message",
    [
        (["--data", "nope"], "no dataset 'nope'"),
        (["--block-size", "100000"], "fewer than --block-size + 1"),
        (["--preset", "huge"], "unknown preset 'huge'"),
        (["--n-embd", "31"], "--n-embd (31) must be divisible by --n-head (2)"),
        (["--learning-rate", "nan"], "--learning-rate must be a finite number, got nan"),
        (["--beta2", "inf"], "--beta2 must be a finite number, got inf"),
        (["--min-lr", "0.1", "--learning-rate", "0.01"], "--min-lr (0.1) is above --learning-rate (0.01)"),
        (["--vocab-size", "10"], "--vocab-size 10 is smaller than the"),
        (["--resume", "--force"], "give one of them"),
        (["--last"], "give --init-from or drop --last"),
        (["--config", "."], "--config . is a folder"),
        (["--init-from", "missing-run"], "checkpoint missing-run does not exist"),
    ],
)
def test_bad_train_input_is_one_sentence_and_writes_nothing(char_data, tmp_path, args, message):
    data_dir, name = char_data
    run = tmp_path / "run"
    base = ["train", "--data", name, "--data-dir", str(data_dir), "--out", str(run)]
    if "--preset" not in args:
        base += ["--preset", "tiny"]
    code, output = run_cli(*base, *args)
    assert code == 1
    assert message in output and "Traceback" not in output
    assert len(output.strip().splitlines()) == 1  # the error alone, not after the config
    assert not run.exists()


def test_an_out_holding_a_run_needs_resume_or_force(char_data, tmp_path):
    data_dir, name = char_data
    run = tmp_path / "run"
    args = [
        "train",
        "--data",
        name,
        "--data-dir",
        str(data_dir),
        "--preset",
        "tiny",
        "--max-iters",
        "2",
        "--out",
        str(run),
        "--quiet",
    ]
    assert run_cli(*args)[0] == 0
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    code, output = run_cli(*args)
    assert code == 1 and "already holds a run" in output
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    assert run_cli(*args, "--force")[0] == 0
    code, output = run_cli("train", "--out", str(tmp_path / "empty"), "--resume")
    assert code == 1 and "holds no run to resume" in output


def test_out_must_be_a_run_an_empty_folder_or_new(char_data, tmp_path):
    data_dir, name = char_data
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    base = ["train", "--data", name, "--data-dir", str(data_dir), "--preset", "tiny", "--max-iters", "2", "--quiet"]
    for extra in ([], ["--force"]):
        code, output = run_cli(*base, "--out", str(precious), *extra)
        assert code == 1 and "holds other files and no run" in output
    assert (precious / "thesis.tex").read_text() == "years of work"
    a_file = tmp_path / "file"
    a_file.write_text("x")
    code, output = run_cli(*base, "--out", str(a_file))
    assert code == 1 and "is a file, not a folder" in output
    run = tmp_path / "run"
    assert run_cli(*base, "--out", str(run))[0] == 0
    (run / "notes.txt").write_text("mine")
    assert run_cli(*base, "--out", str(run), "--force")[0] == 0
    assert (run / "notes.txt").read_text() == "mine"  # --force deletes the run's files only


def test_resume_keeps_elapsed_time_and_refuses_a_stop_at_behind_it(char_data, tmp_path):
    data_dir, name = char_data
    run = tmp_path / "run"
    train(tiny_plan(data_dir, name, run, max_iters=4, eval_interval=2, stop_at=2))
    first = metrics(run)[-1]["elapsed_s"]
    with pytest.raises(NanoGPTError, match="--stop-at 1 is not after the run's step 2"):
        resumed(run, stop_at=1)
    train(resumed(run))
    assert metrics(run)[-1]["elapsed_s"] >= first > 0


def test_the_schedule_follows_the_time_or_the_steps_whichever_is_further():
    cfg = TrainConfig(learning_rate=1e-3, min_lr=1e-4, warmup_iters=10, max_iters=1000)
    assert lr_at(5, cfg, time_frac=0.9) == lr_at(5, cfg)  # the warmup counts updates only
    assert lr_at(20, cfg, time_frac=0.0) == lr_at(20, cfg)
    assert lr_at(20, cfg, time_frac=0.5) == lr_at(500, cfg)  # the clock is further along
    assert lr_at(900, cfg, time_frac=0.5) == lr_at(900, cfg)  # the steps are
    assert lr_at(20, cfg, time_frac=1.0) == pytest.approx(1e-4)


@pytest.mark.slow
def test_max_time_ends_the_run_on_time_with_its_decay_done_and_a_final_evaluation(char_data, tmp_path):
    data_dir, name = char_data
    run = tmp_path / "run"
    result = train(tiny_plan(data_dir, name, run, max_iters=10**6, eval_interval=10**6, max_time=1.5, warmup_iters=0))
    assert result.stopped == "max_time" and 0 < result.step < 10**6  # the clock, not the steps, ended it
    evals = metrics(run)
    assert [m["step"] for m in evals] == [0, result.step]  # the last update is evaluated and saved
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert lines[-2]["kind"] == "train" and lines[-2]["step"] == result.step  # and logged
    assert evals[-1]["lr"] < 3e-3  # below tiny's peak: by its steps alone (of 10**6) the schedule would be at it
    state = json.loads((run / "trainer.json").read_text())
    assert state["step"] == result.step and state["max_time_spent"] == 1.5 and state["eval_s"] > 0
    again = resumed(run)
    assert again.complete and again.time_over  # its time is spent: resuming trains nothing ...
    assert train(again).step == result.step
    more = resumed(run, max_time=3.0)  # ... unless --max-time is raised
    assert not more.complete
    assert train(more).step > result.step


def test_no_eval_first_evaluates_only_at_the_end_and_keeps_time_for_it(char_data, tmp_path):
    data_dir, name = char_data
    run = tmp_path / "run"
    over = dict(max_iters=10**6, eval_interval=10**6, max_time=1.0, warmup_iters=0, eval_first=False)
    result = train(tiny_plan(data_dir, name, run, **over))
    assert result.stopped == "max_time" and result.step > 0
    assert [m["step"] for m in metrics(run)] == [result.step]  # no loss at init: the final evaluation only


@pytest.mark.slow
def test_cpu_speedrun_under_a_clock_trains_until_it_is_spent_and_evaluates_once(char_data, tmp_path):
    data_dir, name = char_data
    run = tmp_path / "run"
    small = dict(n_layer=1, n_embd=32, block_size=16, batch_size=4, eval_iters=2)  # the preset's recipe, tiny
    result = train(tiny_plan(data_dir, name, run, preset="cpu-speedrun", max_iters=10**6, max_time=2.0, **small))
    assert result.stopped == "max_time" and result.step > 1  # the slow first update did not end it
    assert [m["step"] for m in metrics(run)] == [result.step]


def test_max_time_bounds_each_evaluation_unless_eval_iters_is_given(char_data, tmp_path):
    from nanogpt_cli.training.trainer import Trainer

    class Hints:  # the advice lines the run gives; nothing else shown
        def __init__(self):
            self.said = []

        def on_hint(self, text):
            self.said.append(text)

        def __getattr__(self, name):
            return lambda *args: None

    data_dir, name = char_data
    # 2 % of 0.1 ms is less than any batch takes: one batch a split, of the preset's 4
    short = dict(max_iters=10**6, eval_interval=10**6, max_time=1e-4, warmup_iters=0)
    for given, batches in (({}, 1), ({"eval_iters": 4}, 4)):
        run, shown = tmp_path / f"run{batches}", Hints()
        trainer = Trainer(tiny_plan(data_dir, name, run, **short, **given), shown)
        result = trainer.fit()
        assert result.stopped == "max_time" and metrics(run)[-1]["val_loss"] > 0
        assert [len(trainer.parts.eval_sets[s]) for s in ("train", "val")] == [batches, batches]
        state = json.loads((run / "trainer.json").read_text())
        assert state["eval_batches"] == (1 if not given else None)
        said = [h for h in shown.said if h.startswith("evaluations of")]
        if given:  # the user's --eval-iters stays theirs, and nothing is said
            assert said == []
        else:
            assert len(said) == 1 and "1 batch a split, not 4" in said[0] and "give --eval-iters" in said[0]
    more = Trainer(resumed(tmp_path / "run1", max_time=0.5), Hints())  # a resume scores the same batch
    more.fit()
    assert len(more.parts.eval_sets["val"]) == 1


def test_the_clock_guesses_the_final_evaluation_from_the_update_until_one_is_timed():
    from nanogpt_cli.training.clock import Clock

    for eval_steps, over in ((3, True), (2, False)):  # 8 s spent + a 0.5 s update + the evaluation, of 10 s
        clock = Clock(before=8.0, max_time=10.0, last_eval_s=0.0, step=0, eval_steps=eval_steps)
        clock.steps = [5.0, 2.0, 2.0, 2.0, 2.0]  # the first updates warm up: no guess from them
        assert clock.eval_s() == 0.0
        clock.steps += [0.5, 0.7]
        clock.step_s = 0.5
        assert clock.eval_s() == pytest.approx(0.5 * eval_steps)  # from the fastest steady update
        assert clock.out_of_time(due=False) is over
    clock.last_eval_s = 0.2  # timed: the guess is no longer used
    assert clock.eval_s() == 0.2 and not clock.out_of_time(due=False)


def test_max_time_and_stop_at_on_the_same_step_save_once(char_data, tmp_path):
    data_dir, name = char_data
    run = tmp_path / "run"
    from nanogpt_cli.training.events import NoDisplay

    class Saves(NoDisplay):  # every checkpoint the run reports: with an evaluation, or on its own
        def __init__(self):
            self.steps = []

        def on_eval(self, e):
            if e.saved:
                self.steps.append(e.step)

        def on_save(self, step):
            self.steps.append(step)

    saves = Saves()
    result = train(tiny_plan(data_dir, name, run, max_iters=100, max_time=1e-3, stop_at=1), saves)
    assert result.step == 1 and result.stopped == "max_time"
    assert [m["step"] for m in metrics(run)] == [0, 1]
    assert saves.steps == [1]


def test_a_toml_value_of_the_wrong_type_names_its_flag(char_data, tmp_path):
    data_dir, name = char_data
    toml = tmp_path / "run.toml"
    toml.write_text('learning_rate = "fast"\n')
    code, output = run_cli(
        "train",
        "--data",
        name,
        "--data-dir",
        str(data_dir),
        "--preset",
        "tiny",
        "--config",
        str(toml),
        "--out",
        str(tmp_path / "run"),
    )
    assert code == 1 and "--learning-rate must be a number, got 'fast'" in output


def test_a_config_file_can_name_the_run_folder(char_data, tmp_path, monkeypatch):
    data_dir, name = char_data
    monkeypatch.chdir(tmp_path)
    Path("run.toml").write_text(f'data = "{name}"\ndata_dir = "{data_dir}"\nout = "from-toml"\nmax_iters = 2\n')
    assert run_cli("train", "--preset", "tiny", "--config", "run.toml", "--quiet")[0] == 0
    assert (tmp_path / "from-toml" / "trainer.json").is_file()
    Path("run.toml").write_text('out = "from-toml"\nmax_iters = 4\n')
    assert run_cli("train", "--config", "run.toml", "--resume", "--quiet")[0] == 0
    assert json.loads((tmp_path / "from-toml" / "trainer.json").read_text())["step"] == 4


def test_muon_trains_a_tiny_model_lower_than_adamw_in_the_same_steps(char_data, tmp_path):
    data_dir, name = char_data
    over = dict(max_iters=40, eval_interval=40, eval_iters=8, learning_rate=3e-3)
    adamw = train(tiny_plan(data_dir, name, tmp_path / "adamw", **over))
    muon = train(tiny_plan(data_dir, name, tmp_path / "muon", optimizer="muon", muon_lr=0.02, **over))
    assert muon.val_loss < adamw.val_loss - 0.02, (muon.val_loss, adamw.val_loss)
    with safe_open(str(tmp_path / "muon" / "optimizer.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert any(k.startswith("opt0.state.") and k.endswith("momentum_buffer") for k in keys)  # Muon's
    assert any(k.startswith("opt1.state.") and k.endswith("exp_avg_sq") for k in keys)  # AdamW's


@pytest.mark.parametrize("untied", [False, True])
def test_a_stopped_and_resumed_muon_run_equals_an_uninterrupted_one(char_data, tmp_path, untied):
    data_dir, name = char_data
    over = dict(max_iters=24, eval_interval=8, optimizer="muon", muon_momentum_warmup=10, gradient_accumulation_steps=2)
    if untied:  # the embedding's own AdamW group resumes too
        over |= dict(tie_embeddings=False, embedding_lr=0.01)
    whole = tmp_path / "whole"
    train(tiny_plan(data_dir, name, whole, **over))
    parts = tmp_path / "parts"
    train(tiny_plan(data_dir, name, parts, stop_at=13, **over))
    with pytest.raises(NanoGPTError, match="cannot change to adamw"):
        resumed(parts, optimizer="adamw")
    train(resumed(parts))
    with safe_open(str(parts / "optimizer.safetensors"), framework="pt") as f:
        assert len(json.loads(f.metadata()["opt1.param_groups"])) == (3 if untied else 2)  # AdamW's
    assert metrics(parts) == [dict(m, elapsed_s=p["elapsed_s"]) for m, p in zip(metrics(whole), metrics(parts))]
    a, _ = load_model(whole, last=True)
    b, _ = load_model(parts, last=True)
    for (n, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), n


def test_the_schedule_scales_both_optimizers_and_warms_muons_momentum():
    from nanogpt_cli.training.optim import make_optimizer, set_lr

    cfg = TrainConfig(
        optimizer="muon",
        learning_rate=1e-3,
        muon_lr=0.02,
        muon_momentum=0.95,
        muon_momentum_warmup=10,
        warmup_iters=0,
        max_iters=100,
        min_lr=1e-4,
    )
    model = GPT(tiny_config(bias=True, qk_norm=True))
    opt = make_optimizer(model, cfg, torch.device("cpu"))
    muon, adamw = opt.optimizers
    assert all(p.dim() == 2 for g in muon.param_groups for p in g["params"])
    assert model.transformer.wte.weight in adamw.param_groups[0]["params"]
    n = sum(len(g["params"]) for g in opt.param_groups)
    assert n == len(list(model.parameters()))
    set_lr(opt, lr_at(100, cfg), 5, cfg)  # the end of the decay: both at a tenth of their peak
    assert adamw.param_groups[0]["lr"] == pytest.approx(1e-4)
    assert muon.param_groups[0]["lr"] == pytest.approx(2e-3)
    assert muon.param_groups[0]["momentum"] == pytest.approx(0.9)  # half way from 0.85 to 0.95
    set_lr(opt, lr_at(0, cfg), 10, cfg)
    assert muon.param_groups[0]["momentum"] == 0.95 and muon.param_groups[0]["lr"] == pytest.approx(0.02)


def test_adamw_decays_matrices_only_and_gives_an_untied_embedding_its_own_rate():
    from nanogpt_cli.training.optim import make_optimizer, set_lr

    model = GPT(tiny_config(bias=True))
    decay, no_decay = make_optimizer(model, TrainConfig(weight_decay=0.1), torch.device("cpu")).param_groups
    assert all(p.dim() >= 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert all(p.dim() < 2 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    for optimizer in ("adamw", "muon"):
        cfg = TrainConfig(optimizer=optimizer, learning_rate=1e-3, embedding_lr=0.03, warmup_iters=0, max_iters=100)
        untied = GPT(tiny_config(tie_embeddings=False))
        opt = make_optimizer(untied, cfg, torch.device("cpu"))
        groups = opt.param_groups
        assert sum(len(g["params"]) for g in groups) == len(list(untied.parameters()))
        (embedding,) = [g for g in groups if any(p is untied.transformer.wte.weight for p in g["params"])]
        assert len(embedding["params"]) == 1 and embedding["weight_decay"] == 0.1
        set_lr(opt, lr_at(100, cfg), 100, cfg)  # the end of the decay: a tenth of each peak
        assert embedding["lr"] == pytest.approx(3e-3)
        assert [g["lr"] for g in groups if g is not embedding and "momentum" not in g] == [pytest.approx(1e-4)] * 2
    # tied, the embedding is the head too, and trains with the other matrices at --learning-rate
    tied = make_optimizer(GPT(tiny_config()), TrainConfig(embedding_lr=0.03), torch.device("cpu")).param_groups
    assert len(tied) == 2 and all("lr_scale" not in g for g in tied)


def test_embedding_lr_is_for_an_untied_embedding(char_data, tmp_path):
    data_dir, name = char_data
    with pytest.raises(NanoGPTError, match="--embedding-lr 0.01 is for an untied token embedding"):
        tiny_plan(data_dir, name, tmp_path / "tied", embedding_lr=0.01)
    plan = tiny_plan(data_dir, name, tmp_path / "fast", preset="cpu-fast", tie_embeddings=True)
    assert plan.train.embedding_lr is None
    assert any("--preset cpu-fast's --embedding-lr" in note for note in plan.notes)
    untied = tmp_path / "untied"
    train(tiny_plan(data_dir, name, untied, tie_embeddings=False, max_iters=4, eval_interval=2, stop_at=2))
    with pytest.raises(NanoGPTError, match="an optimizer group of its own, which .* was not trained with"):
        resumed(untied, embedding_lr=0.01)
    run = tmp_path / "run"
    train(tiny_plan(data_dir, name, run, tie_embeddings=False, embedding_lr=0.01, max_iters=4, stop_at=2))
    plan = resumed(run, embedding_lr=0.02)
    assert [str(c) for c in plan.changes] == ["--embedding-lr 0.01 -> 0.02 from step 2"]
    assert train(plan).step == 4
    with safe_open(str(run / "optimizer.safetensors"), framework="pt") as f:
        groups = json.loads(f.metadata()["param_groups"])
    # the resumed run's embedding group took the new rate, not the one its saved state brought along
    assert [g.get("lr_scale") for g in groups] == [None, None, pytest.approx(0.02 / plan.train.learning_rate)]
    tied = tmp_path / "tied-run"
    train(tiny_plan(data_dir, name, tied, max_iters=4, eval_interval=2, stop_at=2))
    with pytest.raises(NanoGPTError, match=f"0.01 is for an untied token embedding, and {tied} ties it.*; drop"):
        resumed(tied, embedding_lr=0.01)
    # a run of cpu-fast's shape trained without --embedding-lr, resumed with the preset: its value is set aside
    shape, _ = split_values(preset_values("cpu-fast"))
    other = tmp_path / "other"
    small = dict(max_iters=4, eval_interval=2, batch_size=2, eval_iters=1)
    train(tiny_plan(data_dir, name, other, preset="cpu-char", optimizer="muon", stop_at=2, **shape, **small))
    plan = resumed(other, preset="cpu-fast", **small)
    assert plan.train.embedding_lr is None
    assert any("--preset cpu-fast's --embedding-lr 0.06 is set aside" in note for note in plan.notes)


def test_muon_ns_steps_reach_the_update():
    from nanogpt_cli.training.optim import make_optimizer

    after = []
    for steps in (5, 2):
        torch.manual_seed(0)
        model = GPT(tiny_config())
        opt = make_optimizer(model, TrainConfig(optimizer="muon", muon_ns_steps=steps), torch.device("cpu"))
        assert opt.optimizers[0].param_groups[0]["ns_steps"] == steps
        for p in model.parameters():
            p.grad = torch.ones_like(p).cumsum(-1).sin()
        opt.step()
        after.append(model.transformer.h[0].attn.c_attn.weight.detach().clone())
    assert not torch.allclose(after[0], after[1])  # fewer steps: a less orthogonal, different update


def test_the_cpu_muon_makes_torchs_muon_update():
    from nanogpt_cli.training.optim import CPUMuon

    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(48, 16)), torch.nn.Parameter(torch.randn(16, 40))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    a = CPUMuon(ours, lr=0.02, momentum=0.9, weight_decay=0.1)
    b = torch.optim.Muon(theirs, lr=0.02, momentum=0.9, weight_decay=0.1)
    for _ in range(3):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        a.step()
        b.step()
    for p, q in zip(ours, theirs):  # torch's orthogonalises in bf16: equal to its precision
        torch.testing.assert_close(p, q, atol=2e-3, rtol=0)
        assert not torch.equal(p, torch.zeros_like(p))
    b.load_state_dict(a.state_dict())  # the same state: checkpoints move between them


def test_the_cpu_muon_orthogonalises_same_shaped_matrices_together_as_each_alone():
    """CPUMuon stacks the updates of one shape, a tall matrix as its transpose, into one batched Newton-Schulz: the
    result is each matrix's own, in fp32 to rounding, for tall and wide matrices stacked together and a shape
    with one matrix."""
    from nanogpt_cli.training.optim import CPUMuon

    torch.manual_seed(0)
    shapes = [(48, 16), (48, 16), (16, 48), (16, 40)]
    together = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    alone = [torch.nn.Parameter(p.detach().clone()) for p in together]
    starts = [p.detach().clone() for p in together]
    a = CPUMuon(together, lr=0.02, momentum=0.9, weight_decay=0.1, ns_dtype=torch.float32)
    singles = [CPUMuon([p], lr=0.02, momentum=0.9, weight_decay=0.1, ns_dtype=torch.float32) for p in alone]
    for _ in range(3):
        for p, q in zip(together, alone):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        a.step()
        for opt in singles:
            opt.step()
    for p, q, start in zip(together, alone, starts):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
        assert (p - start).abs().max() > 1e-3  # updated


# --- resuming with the command that started the run (issue 12) ---


def test_resume_accepts_the_starting_command_and_names_what_differs(char_data, tmp_path):
    data_dir, name = char_data
    run = tmp_path / "run"
    start = [
        "train",
        "--data",
        name,
        "--data-dir",
        str(data_dir),
        "--preset",
        "tiny",
        "--n-layer",
        "1",
        "--max-iters",
        "4",
        "--eval-interval",
        "2",
        "--dtype",
        "float32",
        "--out",
        str(run),
        "--quiet",
    ]
    assert run_cli(*start, "--stop-at", "2")[0] == 0
    code, output = run_cli(*start, "--n-layer", "3", "--resume")
    assert code == 1 and "--n-layer (saved 1, given 3)" in output
    code, output = run_cli(*[a for a in start if a not in ("--n-layer", "1")], "--resume")
    assert code == 1 and "--n-layer (saved 1, --preset tiny gives 2)" in output
    code, output = run_cli(*start, "--resume")  # the same command plus --resume
    assert code == 0, output
    assert json.loads((run / "trainer.json").read_text())["step"] == 4
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    code, output = run_cli(*start, "--resume")
    assert code == 0 and "is already complete: step 4 of --max-iters 4" in output and "tokens/s" not in output
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_a_resume_that_changes_a_training_value_announces_and_records_it(char_data, tmp_path):
    data_dir, name = char_data
    run = tmp_path / "run"
    start = ["train", "--data", name, "--data-dir", str(data_dir), "--preset", "tiny", "--max-iters", "6"]
    start += ["--eval-interval", "2", "--log-interval", "1", "--dtype", "float32", "--out", str(run), "--quiet"]
    assert run_cli(*start, "--stop-at", "2")[0] == 0
    code, output = run_cli(*start, "--learning-rate", "0.001", "--resume", "--stop-at", "4")
    assert code == 0, output
    assert "--learning-rate 0.003 -> 0.001 from step 2\n" in output
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    lrs = {m["step"]: m["lr"] for m in lines if m["kind"] == "train"}
    changed = TrainConfig(learning_rate=1e-3, max_iters=6, warmup_iters=5)
    assert lrs[3] == pytest.approx(lr_at(2, changed)) and lrs[4] == pytest.approx(lr_at(3, changed))
    # the command that started the run, again: the preset's value comes back, announced as well
    code, output = run_cli(*start, "--resume")
    assert code == 0 and "--learning-rate 0.001 -> 0.003 from step 4\n" in output, output
    info = json.loads(run_cli("info", str(run), "--json")[1])
    assert [(h["step"], h["changes"]) for h in info["history"]] == [
        (2, [{"flag": "--learning-rate", "saved": 0.003, "given": 0.001}]),
        (4, [{"flag": "--learning-rate", "saved": 0.001, "given": 0.003}]),
    ]
    table = runner.invoke(app, ["info", str(run)], terminal_width=200).output
    assert "from step 2" in table and "--learning-rate 0.003 -> 0.001" in table
    # architecture and data are the run's: refused, naming both values
    code, output = run_cli(*start, "--n-embd", "64", "--resume")
    assert code == 1 and "--n-embd (saved 32, given 64)" in output
    code, output = run_cli(*[a if a != name else "other" for a in start], "--resume")
    assert code == 1 and "--data other is a different dataset from the one" in output and "'play'" in output
    assert "another tokenizer" not in output


def test_resume_applies_each_fields_declared_rule(char_data, tmp_path):
    import shutil

    from nanogpt_cli.config import Resume

    data_dir, name = char_data
    rules = {f.name: f.metadata["resume"] for f in dataclasses.fields(TrainConfig)}
    run = tmp_path / "run"
    train(tiny_plan(data_dir, name, run, max_iters=4, eval_interval=2, stop_at=2, tie_embeddings=False))
    # fixed: repeated, accepted; changed, refused naming the saved and the given value
    assert rules["optimizer"] is Resume.FIXED
    assert resumed(run, n_layer=2, optimizer="adamw").changes == []
    with pytest.raises(NanoGPTError, match=r"--n-layer \(saved 2, given 3\)"):
        resumed(run, n_layer=3)
    with pytest.raises(NanoGPTError, match="--optimizer adamw; it cannot change to muon"):
        resumed(run, optimizer="muon")
    # changes: from the resumed step, announced
    assert rules["learning_rate"] is Resume.CHANGES
    plan = resumed(run, learning_rate=1e-3)
    assert [str(c) for c in plan.changes] == ["--learning-rate 0.003 -> 0.001 from step 2"]
    assert plan.train.learning_rate == 1e-3
    # changes where the run was trained with a value: this one was not
    assert rules["embedding_lr"] is Resume.CHANGES_IF_SET
    with pytest.raises(NanoGPTError, match=f"its own, which {run} was not trained with"):
        resumed(run, embedding_lr=0.01)
    # local: the given value, else the saved one, not announced
    assert rules["data_dir"] is Resume.LOCAL
    moved = tmp_path / "moved"
    shutil.copytree(data_dir / name, moved / name)
    plan = resumed(run, data_dir=str(moved))
    assert plan.train.data_dir == str(moved) and plan.changes == []
    assert resumed(run).train.data_dir == str(data_dir)
    # this invocation's: the given value, else the default (the saved --stop-at 2 is not kept)
    assert rules["stop_at"] is Resume.INVOCATION
    plan = resumed(run, stop_at=3)
    assert plan.train.stop_at == 3 and plan.changes == []
    assert resumed(run).train.stop_at is None


def test_a_preset_accumulation_adapts_to_the_processes_and_a_given_one_must_divide(char_data, tmp_path):
    data_dir, name = char_data
    flags = {"preset": "tiny", "data": name, "data_dir": str(data_dir), "device": "cpu"}
    plan = plan_run(RunRequest(flags, out=tmp_path / "a"), world_size=3)
    assert plan.train.gradient_accumulation_steps == 3
    assert plan.notes == [
        "--gradient-accumulation-steps 3 instead of the default 1: a multiple of the 3 processes "
        "(1 micro-batch each per update)"
    ]
    with pytest.raises(NanoGPTError, match=r"--gradient-accumulation-steps \(4\) .* divisible by the number of "):
        plan_run(RunRequest({**flags, "gradient_accumulation_steps": 4}, out=tmp_path / "b"), world_size=3)
    assert (
        plan_run(RunRequest({**flags, "gradient_accumulation_steps": 4}, out=tmp_path / "c"), world_size=2).notes == []
    )


def test_warnings_and_notes_before_a_run(char_data, tmp_path):
    data_dir, name = char_data
    plan = tiny_plan(data_dir, name, tmp_path / "a", max_iters=5, warmup_iters=5)
    assert any("--warmup-iters (5) is not below --max-iters (5)" in n for n in plan.notes)
    plan = tiny_plan(data_dir, name, tmp_path / "b", dtype="float16")
    assert any("float16 on the CPU" in n and "slow" in n for n in plan.notes)


def test_init_from_takes_best_unless_last_and_says_which(char_data, tmp_path):
    data_dir, name = char_data
    base = tmp_path / "base"
    train(tiny_plan(data_dir, name, base, max_iters=4, eval_interval=2, learning_rate=3e-2))
    # make the last weights differ from the best by hand: best is step 2's copy
    best_step = ckpt.read_metadata(base / "best.safetensors")["step"]
    flags = {"data": name, "data_dir": str(data_dir), "dtype": "float32", "device": "cpu"}
    plan = plan_run(RunRequest(flags, out=tmp_path / "t1", init_from=str(base)))
    assert plan.init_weights == base / "best.safetensors"
    assert any(f"best.safetensors (step {best_step}" in n for n in plan.notes)
    plan = plan_run(RunRequest(flags, out=tmp_path / "t2", init_from=str(base), last=True))
    assert plan.init_weights == base / "model.safetensors"
    assert any("model.safetensors (step 4" in n for n in plan.notes)


def test_a_dataset_prepared_again_under_a_run_is_named(tmp_path):
    from nanogpt_cli.data import prepare
    from conftest import make_text

    data_dir, text = tmp_path / "data", tmp_path / "a.txt"
    text.write_text(make_text(lines=300, seed=5), encoding="utf-8")
    prepare(str(text), "d", tokenizer="char", data_dir=data_dir)
    run = tmp_path / "run"
    train(tiny_plan(data_dir, "d", run, max_iters=4, eval_interval=2, stop_at=2))
    time.sleep(1.1)  # meta.json's "created" has second resolution
    prepare(str(text), "d", tokenizer="char", data_dir=data_dir)
    plan = resumed(run)
    assert any("dataset 'd' was prepared again since this run started" in n for n in plan.notes)
    text.write_text(make_text(lines=300, seed=5) + "~^", encoding="utf-8")
    prepare(str(text), "d", tokenizer="char", data_dir=data_dir)
    with pytest.raises(NanoGPTError, match=r"prepared again with another tokenizer.*only in dataset 'd' now: '\^' '~'"):
        resumed(run)


def test_metrics_hold_a_train_line_per_log_interval(char_data, tmp_path):
    data_dir, name = char_data
    run = tmp_path / "run"
    train(tiny_plan(data_dir, name, run, max_iters=6, eval_interval=6, log_interval=2))
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(m["kind"], m["step"]) for m in lines] == [
        ("eval", 0),
        ("train", 2),
        ("train", 4),
        ("train", 6),
        ("eval", 6),
    ]
    assert all(math.isfinite(m["loss"]) and m["tokens"] == m["step"] * 8 * 32 for m in lines if m["kind"] == "train")


# --- fp16 with its grad scaler, on the CPU (issue 12) ---


def test_fp16_trains_skips_an_overflow_step_and_resumes_the_scaler_exactly(char_data, tmp_path):
    data_dir, name = char_data
    fp16 = dict(dtype="float16", max_iters=8, eval_interval=4, log_interval=1, warmup_iters=0)
    whole, run = tmp_path / "whole", tmp_path / "run"
    train(tiny_plan(data_dir, name, whole, **fp16))
    m = metrics(whole)
    assert m[-1]["val_loss"] < m[0]["val_loss"] - 0.3  # it learns in fp16
    train(tiny_plan(data_dir, name, run, stop_at=4, **fp16))
    train(resumed(run))
    trainer = lambda r: json.loads((r / "trainer.json").read_text())  # noqa: E731
    assert trainer(whole)["scaler"] == trainer(run)["scaler"] and trainer(run)["scaler"]["scale"] == 65536.0
    assert [x["val_loss"] for x in metrics(run)] == [x["val_loss"] for x in metrics(whole)]

    # a saved scale so large that the next step's fp16 gradients overflow: the scaler must skip that update
    forced = tmp_path / "forced"
    train(tiny_plan(data_dir, name, forced, stop_at=2, **fp16))
    state = trainer(forced)
    state["scaler"]["scale"] = 2.0**100
    (forced / "trainer.json").write_text(json.dumps(state))
    weights_before = (forced / "model.safetensors").read_bytes()
    train(plan_run(RunRequest({"stop_at": 3}, out=forced, resume=True)))
    after = trainer(forced)
    assert after["step"] == 3 and after["scaler"]["scale"] == 2.0**99  # backed off once
    lines = [json.loads(x) for x in (forced / "metrics.jsonl").read_text().splitlines()]
    step3 = [x for x in lines if x["kind"] == "train" and x["step"] == 3][0]
    assert step3["skipped"] == 1 and step3["scale"] == 2.0**99
    from safetensors.torch import load

    old = load(weights_before)
    new = {k: v for k, v in load_model(forced, last=True)[0].state_dict().items() if k in old}
    assert all(torch.equal(old[k], new[k]) for k in old)  # the skipped update left the weights as they were


def test_the_summary_and_info_report_steady_speed_and_the_time_evaluating_and_saving(char_data, tmp_path):
    from nanogpt_cli.inspect.catalog import inspect_path

    data_dir, name = char_data
    result = train(tiny_plan(data_dir, name, tmp_path / "run", max_iters=12, eval_interval=6))
    speed = result.speed
    assert (
        speed.skipped == 5
        and speed.steady_ms_per_iter > 0
        and speed.mean_ms_per_iter == pytest.approx(result.ms_per_iter, abs=1e-3)
    )
    assert speed.eval_s > 0 and speed.save_s > 0  # three evaluations, two saves, none counted as training
    info = inspect_path(tmp_path / "run")
    assert info.speed["skipped"] == 5 and info.speed["steady_ms_per_iter"] > 0 and info.speed["save_s"] > 0


def test_many_processes_ask_for_a_stop_once_per_log_interval_not_every_update(char_data, tmp_path):
    """The stop flag's all-reduce waits for the device: under torchrun it runs at log lines, evaluations and
    the end, not after every update (and once before the first). A world that counts its collectives (and is
    otherwise one process)."""
    from dataclasses import dataclass

    import torch

    from nanogpt_cli.training.distributed import World
    from nanogpt_cli.training.trainer import Trainer

    @dataclass(frozen=True)
    class CountingWorld(World):
        stop_check_every: int | None = None  # as a process group
        calls: list = None

        def max_int(self, value: int) -> int:
            self.calls.append(value)
            return value

    world = CountingWorld(device=torch.device("cpu"), calls=[])
    data_dir, name = char_data
    plan = tiny_plan(data_dir, name, tmp_path / "run", max_iters=40, log_interval=10, eval_interval=20)
    result = Trainer(plan, None, world).fit()
    assert result.step == 40 and len(world.calls) == 5  # before the first step, then steps 10, 20, 30, 40


def test_a_batch_is_one_copy_of_its_windows_sliced_after(char_data):
    from nanogpt_cli.data.batches import Batches

    data_dir, name = char_data
    batches = Batches(data_dir, name, block_size=16, batch_size=4, device=torch.device("cpu"), seed=0)
    starts = batches.draw("train")
    x, y = batches.load("train", starts)
    windows = torch.from_numpy(batches.splits["train"].read(starts, 17).astype("int64"))
    assert torch.equal(x, windows[:, :-1]) and torch.equal(y, windows[:, 1:])
    assert x.data_ptr() == y.data_ptr() - y.element_size()  # views of one block: one copy to the device


# --- a busy machine explained ---


def test_a_busy_machine_is_explained_by_step_times_or_load_with_the_threads_to_use():
    from nanogpt_cli.training.clock import busy_hint

    steady = [0.5] * 5 + [0.01] * 30  # warm-up, then 10 ms steps
    assert busy_hint(steady, load=1.0, cores=2, threads=2) is None
    slowed = steady + [0.05] * 10  # five times as long now
    hint = busy_hint(slowed, load=1.5, cores=2, threads=2)
    assert hint.startswith("steps take 5.0x as long as the first ones (50 ms, were 10 ms): other processes share")
    assert hint.endswith("stop them, or expect it to be slower (this run uses 2 threads)")
    loaded = busy_hint([], load=7.0, cores=2, threads=2)  # before the first step: the load is the others'
    assert loaded.startswith("the load average is 7.0 on 2 cores") and "--threads 1 (this run uses 2)" in loaded
    assert busy_hint(steady[:10], load=None, cores=2, threads=2) is None  # too few steps to judge, no load known


def test_a_busy_machine_hint_is_given_once(char_data, tmp_path, monkeypatch):
    import os

    import torch

    monkeypatch.setattr(os, "getloadavg", lambda: (64.0, 64.0, 64.0))  # as on a machine far busier than its cores
    data_dir, name = char_data
    before = torch.get_num_threads()
    try:
        result = runner.invoke(
            app,
            ["train", "--data", name, "--data-dir", str(data_dir), "--preset", "tiny", "--max-iters", "30"]
            + ["--log-interval", "5", "--dtype", "float32", "--out", str(tmp_path / "run")]
            + ["--threads", "2"],  # given: the advice to use fewer holds whatever OMP_NUM_THREADS says
        )
    finally:
        torch.set_num_threads(before)
    assert result.exit_code == 0, result.output
    assert result.stderr.count("note: the load average is 64.0") == 1 and "--threads 1" in result.stderr
