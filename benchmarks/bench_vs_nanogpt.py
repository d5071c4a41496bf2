"""Whole processes side by side with nanoGPT's own scripts: a 300-iteration run of its CPU recipe (`train.py`
against `nanogpt train --preset cpu-char`) and 5 samples of 1,000 tokens (`sample.py` against `nanogpt sample
--num-samples 5`), each command a fresh process timed from launch to exit.

    git clone https://github.com/karpathy/nanoGPT /tmp/nanoGPT
    python benchmarks/bench_vs_nanogpt.py --nanogpt /tmp/nanoGPT --rounds 3

nanoGPT's Tiny Shakespeare is prepared with its own `data/shakespeare_char/prepare.py` from our copy of the text
(so nothing is downloaded; input.txt and the .bin files land in that checkout), ours with `nanogpt prepare`; both
use the python running this script, both on the CPU (nanoGPT in fp32, ours with --dtype auto: bf16 autocast
where the CPU has native bf16, else fp32). One round runs ours then nanoGPT's for each task; the first round
warms the page cache and is not counted. The speed-up is the median of the per-round ratios, so a machine that
drifts between rounds hits both sides alike.

The work is as each tool does it by default: nanoGPT makes 301 updates, evaluates at steps 0 and 250 and saves
once; ours makes 300, evaluates at 0, 250 and 300 (the last step's loss is the run's result), saves twice and
draws loss.png when matplotlib is installed (about 1 s).
"""

from __future__ import annotations

import argparse
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import shakespeare_path, table  # noqa: E402

ITERS = 300
CPU_RECIPE = [  # nanoGPT README's "I only have a macbook" run, at its own length
    "--device=cpu",
    "--compile=False",
    "--eval_iters=20",
    "--log_interval=1",
    "--block_size=64",
    "--batch_size=12",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=128",
    "--dropout=0.0",
]
RECIPE = [*CPU_RECIPE, f"--max_iters={ITERS}", f"--lr_decay_iters={ITERS}"]
EVAL_LINE = re.compile(r"step\s+([\d,]+): train loss ([\d.]+), val loss ([\d.]+)")


def timed(cmd: list[str], cwd: Path) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the process and its children, stdout and stderr) of one whole process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd[:3])} ... failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stdout + done.stderr


def prepare_nanogpt(nano: Path) -> None:
    data = nano / "data" / "shakespeare_char"
    if (data / "train.bin").exists() and (data / "meta.pkl").exists():
        return
    if not (data / "prepare.py").exists():
        sys.exit(f"{nano} does not look like a nanoGPT checkout (no data/shakespeare_char/prepare.py)")
    shutil.copyfile(shakespeare_path(), data / "input.txt")  # prepare.py downloads only when this is missing
    subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nanogpt", type=Path, required=True, help="a checkout of github.com/karpathy/nanoGPT")
    p.add_argument("--rounds", type=int, default=3, help="counted rounds (one more warms up)")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    nano = args.nanogpt.resolve()
    prepare_nanogpt(nano)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ours = [sys.executable, "-m", "nanogpt_cli"]
        subprocess.run(
            ours
            + [
                "prepare",
                str(shakespeare_path()),
                "--name",
                "shakespeare-char",
                "--tokenizer",
                "char",
                "--data-dir",
                str(tmp / "data"),
            ],
            check=True,
            capture_output=True,
        )
        tasks = {
            f"train, {ITERS} iters of the CPU recipe": (
                ours
                + [
                    "train",
                    "--device",
                    "cpu",
                    "--data",
                    "shakespeare-char",
                    "--data-dir",
                    str(tmp / "data"),
                    "--preset",
                    "cpu-char",
                    "--max-iters",
                    str(ITERS),
                    "--lr-decay-iters",
                    str(ITERS),
                    "--out",
                    str(tmp / "ours"),
                    "--force",
                ],
                [
                    sys.executable,
                    "train.py",
                    "config/train_shakespeare_char.py",
                    *RECIPE,
                    f"--out_dir={tmp / 'nano'}",
                    "--wandb_log=False",
                ],
            ),
            "sample, 5 x 1,000 tokens": (
                ours
                + [
                    "sample",
                    "--device",
                    "cpu",
                    "--checkpoint",
                    str(tmp / "ours"),
                    "--prompt",
                    "ROMEO:",
                    "--num-samples",
                    "5",
                    "--max-new-tokens",
                    "1000",
                ],
                [
                    sys.executable,
                    "sample.py",
                    f"--out_dir={tmp / 'nano'}",
                    "--device=cpu",
                    "--num_samples=5",
                    "--max_new_tokens=1000",
                    "--compile=False",
                    "--start=ROMEO:",
                ],
            ),
        }
        walls = {task: ([], [], [], []) for task in tasks}  # ours wall, nanoGPT wall, ours cpu, nanoGPT cpu
        losses = {}
        for round_ in range(args.rounds + 1):
            for task, (a, b) in tasks.items():
                wa, ca, out_a = timed(a, tmp)
                wb, cb, out_b = timed(b, nano)
                if round_ == 0:
                    losses[task] = [EVAL_LINE.findall(out_a)[-1:], EVAL_LINE.findall(out_b)[-1:]]
                    continue
                for series, value in zip(walls[task], (wa, wb, ca, cb)):
                    series.append(value)
                print(f"round {round_}: {task}: ours {wa:.1f} s, nanoGPT {wb:.1f} s", flush=True)

    rows = []
    for task, (wa, wb, ca, cb) in walls.items():
        ratios = [b / a for a, b in zip(wa, wb)]
        rows.append(
            [
                task,
                f"{statistics.median(wa):.1f} s",
                f"{statistics.median(wb):.1f} s",
                f"{statistics.median(ratios):.2f}x",
                f"{min(ratios):.2f}-{max(ratios):.2f}x",
                f"{statistics.median(ca):.0f} / {statistics.median(cb):.0f} s",
            ]
        )
    table(
        f"whole process, median of {args.rounds} rounds (speed-up: nanoGPT's wall time / ours)",
        ["task", "ours", "nanoGPT", "speed-up", "range", "CPU time (ours / nanoGPT)"],
        rows,
    )
    for task, (a, b) in losses.items():
        if a and b:
            print(f"{task}: last evaluation, ours step {a[0][0]} val {a[0][2]}; nanoGPT step {b[0][0]} val {b[0][2]}")


if __name__ == "__main__":
    main()
