"""Loss curves from runs' metrics: train and val loss against tokens seen, for one run or several.

    write_png([Path("checkpoints/shk")], Path("loss.png"))   # matplotlib (the `plot` extra)
    print(terminal_plot([Path("checkpoints/shk")]))          # plotext (the `plot` extra, plotext<6), in the terminal

The run folder's metrics are the source of truth: train lines (kind "train", one per --log-interval) give the train
curve,
evaluation lines the val curve. Runs from before train lines existed draw their evaluations' train loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nanogpt_cli.errors import NanoGPTError, require
from nanogpt_cli.files import atomic_write
from nanogpt_cli.runs.rundir import RunDir


@dataclass
class Curves:
    name: str
    train: list[tuple[int, float]]  # (tokens seen, train loss)
    val: list[tuple[int, float]]  # (tokens seen, val loss)


def load_curves(run: Path) -> Curves:
    run_dir = RunDir(run)
    if not run_dir.metrics_path.is_file():
        raise NanoGPTError(f"{run} has no {run_dir.metrics_path.name}: give run folders made by `nanogpt train`")
    records, _ = run_dir.read_metrics()
    steps = [r for r in records if r.get("kind") == "train" and "loss" in r]
    evals = [r for r in records if r.get("kind", "eval") == "eval" and "val_loss" in r]
    train = [(r["tokens"], r["loss"]) for r in steps] or [(r["tokens"], r["train_loss"]) for r in evals]
    return Curves(run_dir.path.name, train, [(r["tokens"], r["val_loss"]) for r in evals])


def _load_all(runs: list[Path]) -> list[Curves]:
    if not runs:
        raise NanoGPTError("give at least one run folder")
    curves = [load_curves(r) for r in runs]
    if not any(c.train or c.val for c in curves):
        raise NanoGPTError("the runs have no losses in their metrics yet")
    return curves


def write_png(runs: list[Path], out: Path) -> Path:
    """Draw the curves of the runs into out (png, svg or pdf by its suffix) with matplotlib."""
    matplotlib = require("matplotlib", "plot", "plotting to a file")
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    curves = _load_all(runs)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for i, c in enumerate(curves):
        color = f"C{i}"
        label = f"{c.name} " if len(curves) > 1 else ""
        if c.train:
            ax.plot(*zip(*c.train), color=color, alpha=0.45, linewidth=1, label=f"{label}train")
        if c.val:
            ax.plot(*zip(*c.val), color=color, marker="o", markersize=3, linewidth=1.8, label=f"{label}val")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(out)
    atomic_write(out, lambda tmp: fig.savefig(tmp, format=out.suffix.lstrip(".") or "png"))
    plt.close(fig)
    return out


def terminal_plot(runs: list[Path], width: int | None = None, height: int | None = None, color: bool = True) -> str:
    """The curves drawn with plotext as text for the terminal (plain text without color)."""
    plx = require("plotext", "plot", "plotting in the terminal", also=" (or pass --out loss.png)")
    curves = _load_all(runs)
    plx.clear_figure()
    plx.theme("pro" if color else "clear")
    if width or height:
        plx.plotsize(width or 80, height or 20)
    for c in curves:
        label = f"{c.name} " if len(curves) > 1 else ""
        if c.train:
            plx.plot(*map(list, zip(*c.train)), label=f"{label}train", marker="braille")
        if c.val:
            plx.plot(*map(list, zip(*c.val)), label=f"{label}val", marker="braille")
    plx.xlabel("tokens seen")
    plx.ylabel("loss")
    text = plx.build()
    return text if color else plx.uncolorize(text)
