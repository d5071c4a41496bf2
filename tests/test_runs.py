"""The daily-use commands around runs: `runs`, `info`, `plot`, loss.png, trackers and shell completion."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nanogpt_cli.cli import app
from nanogpt_cli.training.trainer import train
from conftest import tiny_plan

runner = CliRunner()


def ok(*args):
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def three_runs(char_data, tmp_path_factory):
    """A finished run, a run stopped half-way, and a copy of the finished one with a broken trainer.json."""
    import shutil

    data_dir, name = char_data
    root = tmp_path_factory.mktemp("runs")
    train(tiny_plan(data_dir, name, root / "done", max_iters=6, eval_interval=3, log_interval=2))
    train(tiny_plan(data_dir, name, root / "half", max_iters=6, eval_interval=3, log_interval=2, stop_at=3))
    shutil.copytree(root / "done", root / "broken")
    (root / "broken" / "trainer.json").write_text("{")
    return root


def test_runs_lists_every_run_with_its_status(three_runs):
    rows = {r["name"]: r for r in map(json.loads, ok("runs", three_runs, "--json").splitlines())}
    assert {n: r["status"] for n, r in rows.items()} == {"done": "finished", "half": "resumable", "broken": "damaged"}
    assert rows["done"]["step"] == 6 and rows["half"]["step"] == 3 and rows["half"]["max_iters"] == 6
    assert rows["done"]["tokens"] == 6 * 8 * 32 and rows["done"]["params"] > 0
    assert "trainer.json is damaged" in rows["broken"]["problem"]
    table = ok("runs", three_runs)
    assert "finished" in table and "resumable" in table and "damaged" in table and "3/6" in table


@pytest.mark.parametrize("width", [80, 60])
def test_runs_fits_the_width_without_wrapping_a_name(three_runs, tmp_path, width):
    import io
    import shutil

    from rich.console import Console

    from nanogpt_cli.cli import ui
    from nanogpt_cli.inspect.catalog import list_runs

    names = ["shakespeare-char-cpu-fast-muon-wsd-20261201-120000", "shakespeare-char-cpu-fast-muon-wsd-20261202-093000"]
    for name in names:
        shutil.copytree(three_runs / "done", tmp_path / name)
    shutil.copytree(three_runs / "half", tmp_path / "half")
    console = Console(file=io.StringIO(), width=width, color_system=None)  # a pipe or a terminal of that width
    console.print(ui.runs_table(list_runs(tmp_path), tmp_path, width=width))
    lines = console.file.getvalue().splitlines()
    assert all(len(line) <= width for line in lines), lines
    rows = [line for line in lines if "finished" in line or "resumable" in line]
    assert len(rows) == 3, lines  # one line per run: no name folded over several
    assert any("…" in row and row.split()[0].endswith("120000") for row in rows)  # the ends that tell them apart
    assert any(row.split()[0].endswith("093000") for row in rows)
    assert all("best val" in line for line in lines if "status" in line)  # steps, best val and status always stay
    assert "6/6" in "".join(rows) and "3/6" in "".join(rows)


def test_runs_of_a_missing_folder_is_one_sentence(tmp_path):
    result = runner.invoke(app, ["runs", str(tmp_path / "nope")])
    assert result.exit_code == 1 and "is not a folder of runs" in result.output


@pytest.fixture
def runs_folder(three_runs, tmp_path, monkeypatch):
    """A fresh working folder whose checkpoints/ holds one run, done: what `nanogpt runs` lists by default."""
    import shutil

    shutil.copytree(three_runs / "done", tmp_path / "checkpoints" / "done")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_run_name_as_runs_prints_it_is_the_run_in_checkpoints(runs_folder, char_data):
    """`nanogpt runs` prints a run's name; the commands that load weights take that name (a path that exists wins)."""
    data_dir, name = char_data
    assert [json.loads(line)["name"] for line in ok("runs", "--json").splitlines()] == ["done"]
    ok("sample", "--checkpoint", "done", "--max-new-tokens", "3")
    ok("eval", "perplexity", "--checkpoint", "done", "--data", name, "--data-dir", data_dir)
    assert json.loads(ok("info", "done", "--json"))["path"] == str(Path("checkpoints") / "done")
    init = ["train", "--data", name, "--data-dir", data_dir, "--preset", "tiny", "--init-from", "done", "--out", "new"]
    ok(*init, "--max-iters", "1", "--eval-iters", "1", "--no-plot", "--dtype", "float32", "--device", "cpu")
    missing = runner.invoke(app, ["sample", "--checkpoint", "nope"])
    assert missing.exit_code == 1
    assert "checkpoint nope does not exist, nor does checkpoints/nope; runs in checkpoints: done" in missing.output
    (runs_folder / "done").mkdir()  # a folder of that name here is what the user means: it wins over the run
    (runs_folder / "done" / "notes.txt").write_text("not a run")
    shadowed = runner.invoke(app, ["sample", "--checkpoint", "done"])
    assert shadowed.exit_code == 1 and "no checkpoint in done: it holds notes.txt" in shadowed.output


@pytest.mark.slow
def test_a_run_name_is_the_run_in_checkpoints_for_pictures_and_exports_too(runs_folder):
    ok("inspect", "positions", "done", "--out", "positions.png")
    ok("plot", "done", "--out", "loss.png")
    ok("export", "done", "--format", "hf", "--out", "exports/done")
    origin = json.loads((runs_folder / "exports" / "done" / "config.json").read_text())["nanogpt_origin"]
    assert origin["run"] == str(Path("checkpoints") / "done")  # the export names the run it came from


def test_info_of_a_run_and_of_a_weights_file(three_runs):
    info = json.loads(ok("info", three_runs / "half", "--json"))
    assert info["kind"] == "run" and info["status"] == "resumable" and info["step"] == 3
    assert info["params"] > info["params_non_embedding"] > 0 and info["flops_per_token"] > 6 * info["params"] / 2
    assert info["tokenizer"].startswith("char (") and info["model"]["n_layer"] == 2
    files = {f["name"]: f for f in info["files"]}
    assert files["model.safetensors"]["loads"] and files["model.safetensors"]["note"] == "step 3"
    assert files["metrics.jsonl"]["note"].endswith("records")
    broken = json.loads(ok("info", three_runs / "broken", "--json"))
    assert broken["status"] == "damaged" and not {f["name"]: f for f in broken["files"]}["trainer.json"]["loads"]
    weights = json.loads(ok("info", three_runs / "done" / "best.safetensors", "--json"))
    assert weights["kind"] == "weights" and weights["step"] in (3, 6) and weights["params"] == info["params"]
    assert weights["dataset"] == info["dataset"] == "play"
    assert "FLOPs per token" in ok("info", three_runs / "done")


def test_plot_draws_in_the_terminal_and_to_a_file(three_runs, tmp_path):
    pytest.importorskip("plotext")
    text = ok("plot", three_runs / "done", three_runs / "half")
    assert "done train" in text and "half val" in text and "tokens seen" in text
    pytest.importorskip("matplotlib")
    out = tmp_path / "loss.png"
    assert "wrote" in ok("plot", three_runs / "done", "--out", out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = runner.invoke(app, ["plot", str(tmp_path)])
    assert result.exit_code == 1 and "has no metrics.jsonl" in result.output


def test_training_writes_loss_png_and_feeds_tensorboard(char_data, tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data_dir, name = char_data
    run = tmp_path / "run"
    ok(
        "train",
        "--data",
        name,
        "--data-dir",
        data_dir,
        "--preset",
        "tiny",
        "--max-iters",
        "4",
        "--eval-interval",
        "2",
        "--log-interval",
        "1",
        "--dtype",
        "float32",
        "--out",
        run,
        "--tracker",
        "tensorboard",
        "--quiet",
    )
    assert (run / "loss.png").read_bytes()[:4] == b"\x89PNG"
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [s.step for s in events.Scalars("train/loss")] == [1, 2, 3, 4]
    val = [s.value for s in events.Scalars("eval/val_loss")]
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert val == pytest.approx([m["val_loss"] for m in metrics if m["kind"] == "eval"])


def test_loss_png_not_drawn_for_lack_of_matplotlib_is_said_once_at_the_end(char_data, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as where the plot extra is not installed: import fails
    data_dir, name = char_data
    run = tmp_path / "run"
    args = ["train", "--data", name, "--data-dir", data_dir, "--preset", "tiny", "--max-iters", "2"]
    result = runner.invoke(app, [str(a) for a in [*args, "--eval-interval", "2", "--dtype", "float32", "--out", run]])
    assert result.exit_code == 0, result.output
    assert not (run / "loss.png").exists()
    hint = 'note: loss.png not drawn: plotting to a file needs the matplotlib package: pip install -e ".[plot]"'
    assert result.stderr.count("loss.png") == 1 and hint in result.stderr
    after = result.output.rstrip().split(hint)[-1].strip().splitlines()  # the last thing the run says, before its
    assert [line.split(":")[0] for line in after] == ["writing the report", "report"]  # report card's lines
    assert "Loss curves not drawn: plotting to a file needs the matplotlib package" in (run / "report.md").read_text()


def test_no_plot_skips_loss_png(char_data, tmp_path):
    pytest.importorskip("matplotlib")
    data_dir, name = char_data
    run = tmp_path / "run"
    ok(
        "train",
        "--data",
        name,
        "--data-dir",
        data_dir,
        "--preset",
        "tiny",
        "--max-iters",
        "2",
        "--out",
        run,
        "--no-plot",
    )
    assert (run / "model.safetensors").is_file() and not (run / "loss.png").exists()


@pytest.mark.slow
def test_wandb_runs_offline_without_network(char_data, tmp_path, monkeypatch, no_network):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    data_dir, name = char_data
    run = tmp_path / "run"
    ok(
        "train",
        "--data",
        name,
        "--data-dir",
        data_dir,
        "--preset",
        "tiny",
        "--max-iters",
        "2",
        "--eval-interval",
        "2",
        "--dtype",
        "float32",
        "--out",
        run,
        "--tracker",
        "wandb",
        "--quiet",
    )
    offline = list((run / "wandb").glob("offline-run-*/*.wandb"))
    assert len(offline) == 1 and offline[0].stat().st_size > 0


def test_an_unknown_tracker_is_one_sentence(char_data, tmp_path):
    data_dir, name = char_data
    result = runner.invoke(
        app,
        [
            "train",
            "--data",
            name,
            "--data-dir",
            str(data_dir),
            "--preset",
            "tiny",
            "--out",
            str(tmp_path / "r"),
            "--tracker",
            "mlflow",
        ],
    )
    assert result.exit_code == 1 and "--tracker must be one of tensorboard, wandb, got 'mlflow'" in result.output


def test_shell_completion_is_offered():
    out = ok("--help")
    assert "--install-completion" in out and "--show-completion" in out


def test_info_system_describes_the_machine_and_info_needs_one_thing_to_describe(tmp_path):
    import torch

    from nanogpt_cli.inference.backends import native

    out = runner.invoke(app, ["info", "--system", "--json"])
    assert out.exit_code == 0, out.output
    found = json.loads(out.stdout)
    assert found["torch"] == torch.__version__ and found["threads"] == torch.get_num_threads()
    assert found["kernels"] == native.status() and found["kernels_cache"] == str(native.cache_dir())
    assert found["devices"][0] == "cpu" and isinstance(found["cpu_features"], list)
    if native.available():
        assert Path(found["kernels_library"]).is_file()
    for args, message in ((["info"], "or --system"), (["info", str(tmp_path), "--system"], "not both")):
        out = runner.invoke(app, args)
        assert out.exit_code == 1 and message in out.output, out.output
