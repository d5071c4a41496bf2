"""--preset auto's rules (given a probe's figures: no timing), time strings for --max-time, the report card of
finished, stopped and clock-ended runs, `nanogpt report` comparing runs, and `prepare --compare`."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest
from typer.testing import CliRunner

from nanogpt_cli.cli import app
from nanogpt_cli.config import build_configs, parse_duration
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.training.auto import MAX_PASSES, MIN_DATA_RATIO, DataFigures, choose, wants_auto
from conftest import tiny_plan

runner = CliRunner()
# a probe's figures: tokens/s of one process at depths 2, 4 and 8 (a CPU's, roughly)
SPEEDS = {2: 60_000.0, 4: 25_000.0, 8: 6_000.0}
# enough text that no budget here reads it more than MAX_PASSES times: the time, not the data, sizes these runs
PROSE = DataFigures(train_tokens=200_000_000, vocab_size=4096, doc_tokens=300.0)


def ok(*args):
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize(
    "text, seconds", [("90s", 90.0), ("20m", 1200.0), ("2h", 7200.0), ("1.5", 1.5), (600, 600.0), (" 45 ", 45.0)]
)
def test_max_time_takes_seconds_or_a_time_with_its_unit(text, seconds):
    assert parse_duration(text) == seconds


def test_a_time_string_is_read_from_the_cli_and_a_config_file_and_a_bad_one_is_one_sentence(tmp_path):
    assert build_configs({"max_time": "20m"})[1].max_time == 1200.0  # a config file's value
    result = runner.invoke(app, ["train", "--data", "x", "--max-time", "2 days"])
    assert result.exit_code != 0 and "--max-time takes seconds or a time like 90s, 20m or 2h" in result.output
    with pytest.raises(NanoGPTError, match="90s, 20m or 2h"):
        parse_duration("-5m")


def test_the_plan_is_the_same_for_the_same_figures_and_grows_with_time_and_speed():
    first = choose(PROSE, 120, SPEEDS)
    assert first.values == choose(PROSE, 120, SPEEDS).values  # deterministic given the probe's figures
    longer = choose(PROSE, 30 * 60, SPEEDS)
    faster = choose(PROSE, 120, {d: s * 50 for d, s in SPEEDS.items()})
    assert first.values["n_layer"] < longer.values["n_layer"] and first.values["n_layer"] < faster.values["n_layer"]
    for choice in (first, longer, faster):
        v = choice.values
        assert v["n_embd"] % v["n_head"] == 0 and v["n_embd"] // v["n_head"] == 64  # heads of 64
        assert v["n_embd"] >= 32 * v["n_layer"]  # width scales with depth
        assert v["min_lr"] < v["learning_rate"] and v["warmup_iters"] < choice.expected_updates
        assert v["max_iters"] > choice.expected_updates  # a cap: the clock ends the run
    # learning rates fall as the width grows (1 / sqrt(width))
    assert longer.values["learning_rate"] < first.values["learning_rate"]
    assert faster.values["embedding_lr"] < first.values["embedding_lr"]
    build_configs({**first.values, "vocab_size": PROSE.vocab_size})  # a valid config


def batch_tokens(choice):
    v = choice.values
    return v["batch_size"] * v["gradient_accumulation_steps"] * v["block_size"]


def test_a_small_corpus_is_read_at_most_four_times_and_the_run_ends_before_the_clock():
    small = DataFigures(train_tokens=100_000, vocab_size=4096, doc_tokens=100_000.0)  # one long document
    for budget in (120, 600, 1800):
        choice = choose(small, budget, SPEEDS)
        v = choice.values
        # --max-iters ends it at MAX_PASSES passes, whatever the probe read; the schedule ends there too
        assert v["max_iters"] * batch_tokens(choice) <= MAX_PASSES * small.train_tokens + batch_tokens(choice)
        assert choice.expected_updates <= v["max_iters"] <= choice.expected_updates + 1 > v["warmup_iters"]
        assert choice.expected_updates >= 100  # the batch follows the tokens read, not the time: updates remain
        assert any("before --max-time" in note for note in choice.notes)
    # the same time and speeds on a corpus large enough: the clock ends the run, --max-iters is only a cap
    large = choose(PROSE, 600, SPEEDS)
    assert large.values["max_iters"] == 10 * large.expected_updates and large.notes == []
    # the spare time goes to size: the largest depth that reads the 4 passes in the time, at no fewer than
    # MIN_DATA_RATIO tokens per block parameter
    spare = choose(small, 600, SPEEDS)
    v = spare.values
    assert MAX_PASSES * small.train_tokens / (12 * v["n_layer"] * v["n_embd"] ** 2) >= MIN_DATA_RATIO
    assert v["n_layer"] > 2 and spare.rows[0].why.startswith("the largest that reads 4 passes over the data")
    assert choose(small, 120, {2: 3_000.0}).values["n_layer"] == 2  # no time to spare: the ratio rule's depth
    given = choose(small, 600, SPEEDS, {"max_iters": 10**6})  # a --max-iters given: the clock ends it, as the user said
    assert given.values["max_iters"] == 10**6 and given.notes == []


def test_a_slow_cpu_trains_sixteen_windows_of_at_least_1024_tokens_an_update():
    slow = {2: 1_500.0, 4: 800.0}  # a busy 2-core CPU's probe: 128 tokens an update would make 1,000 updates
    choice = choose(PROSE, 120, slow)
    v = choice.values
    assert batch_tokens(choice) >= 1024 and v["batch_size"] * v["gradient_accumulation_steps"] >= 16
    assert v["block_size"] == 64  # halved from 128 to hold 16 windows in 1,024 tokens
    assert "16 windows in an update of 1,024 tokens" in next(r.why for r in choice.rows if r.name == "block_size")
    gpu = choose(PROSE, 120, slow, device="cuda")  # a GPU keeps its floor of 4 windows
    assert gpu.values["block_size"] == 128 and batch_tokens(gpu) == 512
    given = choose(PROSE, 120, slow, {"block_size": 128})  # a given context stays, the rows follow
    assert given.values["block_size"] == 128 and given.values["batch_size"] >= 16


def test_values_given_stay_and_the_rules_follow_them():
    choice = choose(PROSE, 600, SPEEDS, {"n_layer": 6, "learning_rate": 1e-3, "block_size": 64})
    v = choice.values
    assert (v["n_layer"], v["learning_rate"], v["block_size"]) == (6, 1e-3, 64)
    assert v["n_embd"] == 192 and v["n_head"] == 3  # the width of depth 6
    given = {r.name for r in choice.rows if r.given}
    assert given == {"n_layer", "learning_rate", "block_size"}
    assert all(r.why == "given" for r in choice.rows if r.given)


def test_the_global_batch_counts_every_process():
    one = choose(PROSE, 600, SPEEDS, device="cuda")
    four = choose(PROSE, 600, SPEEDS, device="cuda", world_size=4)
    assert four.values["gradient_accumulation_steps"] % 4 == 0

    # four GPUs see four times the tokens: the updates keep their number, each a larger batch
    assert batch_tokens(four) >= 2 * batch_tokens(one)


def test_a_vocabulary_too_large_for_the_time_is_noted_not_refused():
    gpt2 = DataFigures(train_tokens=300_000, vocab_size=50_304, doc_tokens=300.0)
    slow = {2: 3_000.0, 4: 1_500.0}
    choice = choose(gpt2, 120, slow)
    assert len(choice.notes) == 1 and "50,304-token vocabulary's head is" in choice.notes[0]
    assert choose(PROSE, 120, SPEEDS).notes == []


def test_auto_is_the_default_for_a_time_without_a_model_shape():
    assert wants_auto(None, {"max_time": 60}, None, False)
    assert wants_auto("auto", {}, None, False)
    assert not wants_auto(None, {"max_time": 60, "n_layer": 4}, None, False)  # a shape given
    assert not wants_auto("cpu-char", {"max_time": 60}, None, False)
    assert not wants_auto(None, {"max_time": 60}, "checkpoints/base", False)  # other weights
    assert not wants_auto(None, {}, None, False)
    with pytest.raises(NanoGPTError, match="--preset auto sizes a new model, and --init-from base brings its own"):
        wants_auto("auto", {"max_time": 60}, "base", False)


def test_auto_is_refused_in_one_sentence_without_a_time(char_data, tmp_path):
    from nanogpt_cli.training.plan import plan_run
    from nanogpt_cli.training.request import RunRequest

    data_dir, name = char_data
    flags = {"preset": "auto", "data": name, "data_dir": str(data_dir)}
    with pytest.raises(NanoGPTError, match="give --max-time too"):
        plan_run(RunRequest(flags, out=tmp_path / "a"))
    assert not (tmp_path / "a").exists()


@pytest.mark.slow
def test_train_with_a_time_probes_sizes_and_ends_by_the_clock_with_a_report(char_data, tmp_path):
    data_dir, name = char_data
    run = tmp_path / "auto"
    # --max-iters given: auto's cap of 4 passes over this small text would otherwise end a run on a fast machine
    # before its 3 s
    args = ("--max-time", "3s", "--max-iters", "100000", "--device", "cpu", "--out", run)
    out = ok("train", "--data", name, "--data-dir", data_dir, *args)
    assert "probe: 2 layers x 128" in out and "--preset auto" in out and "report: " in out
    config = json.loads((run / "config.json").read_text())
    assert "n_layer" in config["auto"]["chosen"] and config["train"]["max_time"] == 3.0
    report = (run / "report.md").read_text()
    assert "ended by the clock (--max-time 3 s spent)" in report
    # the shape is the machine's speed's to choose (2 layers on a quiet one); chosen by auto, given by the user
    assert re.search(r"^\| --n-layer \| \d+ \| auto \|$", report, re.M) and "| --max-time | 3 |  |" in report
    figures = json.loads((run / "report.json").read_text())
    assert figures["ending"] == "max_time" and figures["val_bpb"] > 0 and figures["samples"]


@pytest.mark.slow
def test_a_finished_run_and_a_stopped_one_have_reports_that_report_compares(char_data, tmp_path):
    from test_eval_tasks import sum_docs, write_tasks

    from nanogpt_cli.inspect.report import write_report
    from nanogpt_cli.runs.rundir import RunDir
    from nanogpt_cli.training.trainer import Trainer

    data_dir, name = char_data
    done = tmp_path / "done"
    task = write_tasks(tmp_path / "tasks", sum_docs()) / "sums_mc.yaml"  # a local lm-eval task: nothing downloaded
    ok("train", "--preset", "tiny", "--data", name, "--data-dir", data_dir, "--device", "cpu", "--dtype", "float32",
       "--max-iters", "20", "--eval-interval", "10", "--out", done, "--eval-tasks", task)  # fmt: skip
    report = (done / "report.md").read_text()
    assert "## Tasks" in report and "| sums_mc | acc | " in report  # scored at the end, as `eval tasks` does
    assert report.startswith("# Report: done\n\nfinished at step 20.")
    assert "| --n-layer | 2 |  |" in report and "## Samples" in report and "bits per byte" in report
    figures = json.loads((done / "report.json").read_text())
    # bits per byte: nats per token over ln 2 and the bytes of a token (about 1 for this char data)
    per_token = figures["bytes_per_token"]
    assert 1.0 <= per_token < 1.2
    assert figures["val_bpb"] == pytest.approx(figures["val_loss"] / 0.6931471805599453 / per_token, rel=1e-9)

    class CtrlCAt:  # Ctrl-C once the run has trained a few updates
        def on_step(self, event):
            if event.step >= 4:
                os.kill(os.getpid(), signal.SIGINT)

        def __getattr__(self, name):
            return lambda *args: None

    stopped = tmp_path / "stopped"
    plan = tiny_plan(data_dir, name, stopped, max_iters=200, log_interval=2, eval_interval=100)
    result = Trainer(plan, CtrlCAt()).fit()
    assert result.stopped == "SIGINT" and result.step < 200
    write_report(RunDir(stopped), result, eval_tasks=[str(task)])  # a stop ends within seconds: no samples, no tasks
    card = (stopped / "report.md").read_text()
    assert f"stopped early (Ctrl-C) at step {result.step:,}." in card
    assert "no samples: the run was stopped by a signal" in card and "not scored: the run was stopped by SIGINT" in card

    shown = ok("report", done)
    assert "Report: done" in shown and "finished at step 20" in shown
    table = ok("report", done, stopped)
    assert "runs compared" in table and "stopped early (Ctrl-C)" in table and "finished, step 20" in table
    assert "val bits/byte" in table and "sums_mc acc" in table
    result = runner.invoke(app, ["report", str(tmp_path / "nothing")])
    assert result.exit_code == 1 and "is not a run folder" in result.output


def test_prepare_compare_counts_each_tokenizers_tokens(tmp_path):
    from nanogpt_cli.data.tokenizer_compare import compare_tokenizers

    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat; " * 400 + "héllo wörld " * 50, encoding="utf-8")
    found = compare_tokenizers(str(text), sizes=(300,))
    counts = {r.name.split(" (")[0]: r for r in found.rows}
    chars = len(text.read_text(encoding="utf-8"))
    assert found.whole and counts["char"].tokens == chars
    assert counts["byte"].tokens == len(text.read_bytes()) > chars  # two bytes for é, ö
    assert counts["bpe 300"].tokens < counts["byte"].tokens and counts["gpt2"].tokens < chars / 2
    out = ok("prepare", text, "--compare")
    assert "bpe 1,024" in out and "gpt2" in out and not (tmp_path / "data").exists()  # nothing prepared
