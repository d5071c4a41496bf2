"""Quality per wall-clock second: nanoGPT's CPU recipe (preset cpu-char) through our trainer against the
`cpu-fast` preset given the same wall time, on Tiny Shakespeare (char). Prints val loss against wall time for
both (a table, and benchmarks/bench_quality.png when matplotlib is installed).

    python benchmarks/bench_quality.py                       # the recipe's 2000 iters set the budget
    python benchmarks/bench_quality.py --baseline-iters 500  # a quicker look

The budget is the wall time of the recipe's training loop, evaluations and checkpoints included (imports and
data preparation are the same for both and left out). cpu-fast then trains with `--max-time` set to that
budget: it stops when the time is spent, and its schedule (warm-up, stable, decay) follows the time, so it
ends its decay on time at whatever speed the machine runs. Run it on a quiet machine: a busy one slows the two
runs unequally.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, shakespeare_path, table  # noqa: E402

from nanogpt_cli.data import prepare  # noqa: E402
from nanogpt_cli.training.events import NoDisplay  # noqa: E402
from nanogpt_cli.training.plan import plan_run  # noqa: E402
from nanogpt_cli.training.request import RunRequest  # noqa: E402
from nanogpt_cli.training.trainer import train  # noqa: E402


class Curve(NoDisplay):
    """The (step, wall seconds, val loss) of every evaluation."""

    def __init__(self):
        self.points: list[tuple[int, float, float]] = []

    def on_eval(self, event) -> None:
        self.points.append((event.step, event.elapsed_s, event.val_loss))


def run(preset: str, data_dir: Path, out: Path, **over):
    curve = Curve()
    plan = plan_run(
        RunRequest({"preset": preset, "data": "shakespeare-char", "data_dir": str(data_dir), **over}, out=out)
    )
    result = train(plan, curve)
    return result, curve, plan


def val_at(points: list[tuple[int, float, float]], seconds: float) -> float | None:
    """The val loss of the last evaluation done within `seconds`."""
    done = [v for _, t, v in points if t <= seconds]
    return done[-1] if done else None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline-iters", type=int, default=2000, help="iterations of the cpu-char recipe")
    p.add_argument("--fast", default="cpu-fast", help="the preset to compare")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--budget-s", type=float, default=None, help="skip the baseline run; use this wall time")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        prepare(str(shakespeare_path()), "shakespeare-char", tokenizer="char", data_dir=data_dir)
        runs = {}
        n = args.baseline_iters
        if args.budget_s is None:
            result, curve, _ = run(
                "cpu-char", data_dir, Path(tmp) / "base", max_iters=n, lr_decay_iters=n, dtype=args.dtype
            )
            runs[f"cpu-char (nanoGPT's recipe), {n:,} iters"] = (result, curve.points)
            budget = result.elapsed_s
        else:
            budget = args.budget_s
        # --max-time: the run ends when the budget is spent, and its schedule (warm-up, stable, decay) follows the
        # time, so it ends its decay on time however fast this machine runs it today
        result, curve, _ = run(
            args.fast, data_dir, Path(tmp) / "fast", max_iters=10**6, max_time=budget, dtype=args.dtype
        )
        runs[f"{args.fast}, --max-time {budget:.0f}"] = (result, curve.points)

    rows = [
        [
            name,
            f"{r.step:,}",
            f"{r.ms_per_iter:.1f}",
            f"{r.elapsed_s:.0f} s",
            f"{points[-1][2]:.4f}",
            f"{val_at(points, budget) or float('nan'):.4f}",
        ]
        for name, (r, points) in runs.items()
    ]
    table(
        f"Tiny Shakespeare char on {torch.get_num_threads()} threads: budget {budget:.0f} s",
        ["run", "iters", "ms/iter", "wall", "final val loss", f"val loss within {budget:.0f} s"],
        rows,
    )
    curve_rows = []
    for name, (_, points) in runs.items():
        curve_rows += [[name.split(",")[0], f"{step:,}", f"{t:.0f}", f"{v:.4f}"] for step, t, v in points]
    table("val loss against wall time", ["run", "step", "wall s", "val loss"], curve_rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot)")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, (_, points) in runs.items():
        ax.plot([t for _, t, _ in points], [v for _, _, v in points], marker="o", label=name)
    ax.axhline(1.65, color="grey", linestyle=":", label="target 1.65")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("val loss (nats/char)")
    ax.set_ylim(top=2.6)
    ax.legend()
    ax.grid(alpha=0.3)
    path = ROOT / "benchmarks" / "bench_quality.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
