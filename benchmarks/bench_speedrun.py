"""Time to nanoGPT's quality, whole processes: nanoGPT's own `train.py` with its CPU recipe (4 x 128, context 64,
batch 12, 2,000 iterations, Tiny Shakespeare char) sets the wall time T and the val loss to reach; then ours trains
`--preset cpu-speedrun` for T/3 and `--preset cpu-fast` for T, each a fresh process timed from launch to exit.

    python benchmarks/bench_speedrun.py --nanogpt /tmp/nanoGPT               # one round (a few minutes)
    python benchmarks/bench_speedrun.py --nanogpt /tmp/nanoGPT --rounds 3    # three, one after another

Prints the table (run, wall, val) and writes val loss against wall time (benchmarks/bench_speedrun.png, with
matplotlib). nanoGPT's data is prepared by its own `prepare.py` from our copy of the text (nothing is downloaded),
ours by `nanogpt prepare`, both with the python running this script, on the CPU, with the threads a user gets
unless --threads is given.

Our budget is the whole process: `--max-time` counts training only (evaluations included, the final one kept
in), so a short probe run first measures what comes around it (imports, data, model, the final save, the summary
and exit; with `--no-plot`, as nanoGPT draws no picture either), and each run gets `--max-time` = budget - that
- 1 % of the budget (at least 0.3 s), as the end of a run varies by a few tenths of a second.
The wall in the table is measured, not derived: a run that overshoots shows it. Every line each tool prints is
timestamped on arrival, which gives the curves: nanoGPT's evaluations (every 250 iterations), ours (at the end
and every --eval-interval), and both tools' train-loss lines.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_nanogpt import CPU_RECIPE as RECIPE  # noqa: E402  (at its 2,000 iterations here)
from bench_vs_nanogpt import EVAL_LINE, prepare_nanogpt  # noqa: E402
from common import ROOT, shakespeare_path, table  # noqa: E402

# kept back from each budget: the end of a run (its final evaluation, save and exit) varies by a few tenths of a
# second from run to run, with the machine, and a run that lands past its budget has missed it
MARGIN, MARGIN_S = 0.01, 0.3
TRAIN_LINE = re.compile(r"(?:iter|step)\s+([\d,]+)(?::|/[\d,]+ \|) loss ([\d.]+)")  # nanoGPT's / ours


def run_timed(cmd: list[str], cwd: Path, env: dict) -> tuple[float, list[tuple[float, str]]]:
    """(wall seconds from launch to exit, every output line with its arrival time since launch)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = [(time.perf_counter() - t0, line.rstrip("\n")) for line in proc.stdout]
    proc.wait()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = "\n".join(line for _, line in lines[-30:])
        sys.exit(f"{' '.join(cmd[:4])} ... failed (exit {proc.returncode}):\n{tail}")
    return wall, lines


def curves(lines: list[tuple[float, str]]) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(val loss points, train loss points) as (seconds since launch, loss)."""
    val, train = [], []
    for t, line in lines:
        if m := EVAL_LINE.search(line):
            val.append((t, float(m.group(3))))
        elif m := TRAIN_LINE.search(line):
            train.append((t, float(m.group(2))))
    return val, train


def ours_cmd(data_dir: Path, out: Path, preset: str, max_time: float, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "nanogpt_cli",
        "train",
        "--device",
        "cpu",
        "--data",
        "shakespeare-char",
        "--data-dir",
        str(data_dir),
        "--preset",
        preset,
        "--max-iters",
        str(10**6),  # the clock ends the run, and the schedule follows it
        "--max-time",
        f"{max_time:.2f}",
        "--out",
        str(out),
        "--force",
        "--no-plot",  # nanoGPT draws nothing either; loss.png costs ~1 s of matplotlib
        *extra,
    ]


def overhead_s(data_dir: Path, tmp: Path, preset: str, env: dict, extra: list[str]) -> float:
    """Seconds of a whole process of ours outside its --max-time: a 2-second run's wall minus its clock."""
    out = tmp / "probe"
    wall, _ = run_timed(ours_cmd(data_dir, out, preset, 2.0, extra), tmp, env)
    return wall - json.loads((out / "trainer.json").read_text())["elapsed_s"]


def one_round(nano: Path, tmp: Path, args, env: dict, extra: list[str]) -> list[tuple]:
    """nanoGPT's recipe, then ours for T/3 and for T: (name, wall, val points, train points, budget) each."""
    iters = [f"--max_iters={args.iters}", f"--lr_decay_iters={args.iters}"]
    nano_cmd = [sys.executable, "train.py", "config/train_shakespeare_char.py", *RECIPE, *iters]
    T, lines = run_timed(nano_cmd + [f"--out_dir={tmp / 'nano'}", "--wandb_log=False"], nano, env)
    runs = [(f"nanoGPT train.py, CPU recipe, {args.iters:,} iters", T, *curves(lines), None)]
    print(f"nanoGPT: {T:.1f} s, val {runs[0][2][-1][1]:.4f} (load {os.getloadavg()[0]:.1f})", flush=True)
    for preset, budget in ((args.speedrun, T / 3), (args.fast, T)):
        over = overhead_s(tmp / "data", tmp, preset, env, extra)
        if budget - over < 1:
            sys.exit(
                f"the budget of {budget:.1f} s leaves no time to train after our {over:.1f} s of start-up: more --iters"
            )
        max_time = budget - over - max(MARGIN_S, MARGIN * budget)
        wall, lines = run_timed(ours_cmd(tmp / "data", tmp / preset, preset, max_time, extra), tmp, env)
        runs.append((f"ours, --preset {preset} --max-time {max_time:.1f}", wall, *curves(lines), budget))
        print(f"{preset}: {wall:.1f} s of {budget:.1f}, val {runs[-1][2][-1][1]:.4f} (load {os.getloadavg()[0]:.1f})")
    return runs


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nanogpt", type=Path, required=True, help="a checkout of github.com/karpathy/nanoGPT")
    p.add_argument("--rounds", type=int, default=1, help="nanoGPT then ours, this many times")
    p.add_argument("--iters", type=int, default=2000, help="nanoGPT's iterations (its recipe: 2000)")
    p.add_argument("--speedrun", default="cpu-speedrun", help="our preset for T/3")
    p.add_argument("--fast", default="cpu-fast", help="our preset for T")
    p.add_argument("--fast-val", type=float, default=1.55, help="the val loss --fast is to reach in T")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for every run (default: torch's)")
    p.add_argument("--plot", type=Path, default=ROOT / "benchmarks" / "bench_speedrun.png")
    args = p.parse_args()
    nano = args.nanogpt.resolve()
    prepare_nanogpt(nano)
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path)
    extra = []
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
        extra = ["--threads", str(args.threads)]
    rows, runs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prep = [sys.executable, "-m", "nanogpt_cli", "prepare", str(shakespeare_path()), "--name", "shakespeare-char"]
        prep += ["--tokenizer", "char", "--data-dir", str(tmp / "data")]
        subprocess.run(prep, check=True, env=env, capture_output=True)
        for r in range(1, args.rounds + 1):
            load_before = os.getloadavg()[0]
            runs = one_round(nano, tmp, args, env, extra)
            load = f"{load_before:.1f} / {os.getloadavg()[0]:.1f}"
            for i, (name, wall, val, _, budget) in enumerate(runs):
                target = args.fast_val if i == 2 else runs[0][2][-1][1]  # T/3: nanoGPT's val; T: --fast-val
                final = val[-1][1]
                goal = met = ""
                if budget is not None:
                    goal = f"<= {budget:.1f} s, val <= {target:.4f}"
                    met = "yes" if wall <= budget and final <= target else "no"
                rows.append([r, name, f"{wall:.1f} s", f"{final:.4f}", goal, met, load])
            print(f"round {r}: " + ", ".join(f"{row[1]} {row[2]} val {row[3]}" for row in rows[-3:]), flush=True)
    table(
        f"Tiny Shakespeare char, whole processes, threads: {args.threads or 'default'} (T = nanoGPT's wall)",
        ["round", "run", "wall", "val", "goal", "met", "load before / after"],
        rows,
    )
    if args.rounds > 1:
        for i, name in enumerate(("nanoGPT", args.speedrun, args.fast)):
            walls = [float(row[2].split()[0]) for row in rows[i::3]]
            vals = [float(row[3]) for row in rows[i::3]]
            print(f"{name}: median wall {statistics.median(walls):.1f} s, median val {statistics.median(vals):.4f}")
    draw(runs, args.plot)


def draw(runs, path: Path) -> None:
    """Val loss (points) and train loss (faint) against wall time since launch, for the last round."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot)")
        return
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    target = runs[0][2][-1][1]
    for (name, wall, val, train, budget), color in zip(runs, ("tab:grey", "tab:orange", "tab:blue")):
        if train:
            ax.plot([t for t, _ in train], [v for _, v in train], color=color, alpha=0.25, linewidth=0.8)
        ax.plot([t for t, _ in val], [v for _, v in val], marker="o", color=color, label=f"{name} ({wall:.0f} s)")
        if budget is not None:
            ax.axvline(budget, color=color, linestyle=":", linewidth=1)
    ax.axhline(target, color="tab:grey", linestyle="--", linewidth=1, label=f"nanoGPT's final val {target:.3f}")
    ax.set_xlabel("wall time since launch (s)")
    ax.set_ylabel("loss (nats/char)")
    ax.set_ylim(1.4, 3.2)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
