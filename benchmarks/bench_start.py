"""Where a training run's time goes from the command to its first step, and the whole run, in a fresh process.

    python benchmarks/bench_start.py                          # this checkout, cpu-char, 300 iters
    python benchmarks/bench_start.py --checkouts . ../main    # two checkouts side by side (before / after)

Each checkout runs in its own child `python` (PYTHONPATH set to it), timed from the moment it is launched:
start-up of Python and `import torch`, the package's imports, the model and optimizer (torch's optimizers
import torch._dynamo on first use), the step-0 evaluation (and, in older versions, its checkpoint), the first
step, then the rest of the run. Rounds alternate the checkouts, so a drifting machine hits each alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import shakespeare_path, table  # noqa: E402

CHILD = r"""
import json, sys, time
t_launch = float(sys.argv[1]); marks = {}
def mark(name): marks.setdefault(name, time.time() - t_launch)
mark("python up")
import torch; mark("import torch")
from nanogpt_cli.training.events import NoDisplay; from nanogpt_cli.training.plan import plan_run
from nanogpt_cli.training.request import RunRequest
from nanogpt_cli.training.trainer import train; mark("import nanogpt_cli")
plan = plan_run(RunRequest(json.loads(sys.argv[2]), out=sys.argv[3])); mark("plan the run")
class Marks(NoDisplay):
    def on_start(self, e): mark("model and optimizer built")
    def on_eval(self, e):
        if e.step == 0: mark("step-0 evaluation (and save)")
    def on_step(self, e):
        if e.step == 1: mark("first step")
train(plan, Marks()); mark("whole run")
print(json.dumps(marks))
"""


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkouts", nargs="+", default=[str(Path(__file__).resolve().parent.parent)])
    p.add_argument("--max-iters", type=int, default=300)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--preset", default="cpu-char")
    args = p.parse_args()
    checkouts = [str(Path(c).resolve()) for c in args.checkouts]
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from nanogpt_cli.data import prepare; "
                "prepare(sys.argv[1], 'shk', tokenizer='char', data_dir=sys.argv[2])",
                str(shakespeare_path()),
                str(data_dir),
            ],
            check=True,
            env=dict(os.environ, PYTHONPATH=checkouts[0]),
        )
        flags = dict(
            preset=args.preset,
            data="shk",
            data_dir=str(data_dir),
            max_iters=args.max_iters,
            log_interval=1,
            device="cpu",
        )
        times: dict[str, list[dict]] = {c: [] for c in checkouts}
        for _ in range(args.rounds):
            for c in checkouts:
                out = Path(tmp) / f"run-{len(times[c])}-{abs(hash(c))}"
                env = dict(os.environ, PYTHONPATH=c)
                proc = subprocess.run(
                    [sys.executable, "-c", CHILD, repr(time.time()), json.dumps(flags), str(out)],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                times[c].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    phases = list(times[checkouts[0]][0])
    rows = []
    for phase in phases:
        row = [phase]
        for c in checkouts:
            ends = [statistics.median(m[phase] for m in times[c]) if all(phase in m for m in times[c]) else None]
            row.append("" if ends[0] is None else f"{ends[0]:.2f}")
        rows.append(row)
    table(
        f"seconds from launch (median of {args.rounds}), preset {args.preset}, {args.max_iters} iters",
        ["reached", *[Path(c).name for c in checkouts]],
        rows,
    )


if __name__ == "__main__":
    main()
