"""Many processes on the CPU: nanoGPT's CPU recipe (cpu-char, Tiny Shakespeare) in 1 process and in 2 under
torchrun with DDP and FSDP, side by side, with the scaling efficiency.

    python benchmarks/bench_distributed.py                 # 200 updates per row, float32
    python benchmarks/bench_distributed.py --max-iters 100 --two-threads

Every row trains the same run: 2 micro-batches of 12 x 64 tokens per update (global), which 2 processes
split one each, so the losses agree and the speeds compare like for like. Scaling efficiency is tokens/s
over (processes x the tokens/s of 1 process with 1 thread); each process has 1 thread. --two-threads adds
1 process with 2 threads: what the same cores do without torchrun (on a busy machine OpenMP's threads
wait on each other and that row crawls). On a machine shared with other work the figures move between
runs; the ratios within one run are what to read.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import shakespeare_path, table, train_in_processes  # noqa: E402

from nanogpt_cli.data import prepare  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-iters", type=int, default=200)
    p.add_argument("--two-threads", action="store_true", help="add 1 process with 2 threads")
    args = p.parse_args()
    runs = [("1 process, 1 thread", 1, 1, "ddp")] + (
        [("1 process, 2 threads", 1, 2, "ddp")] if args.two_threads else []
    )
    runs += [("2 processes, DDP, 1 thread each", 2, 1, "ddp"), ("2 processes, FSDP, 1 thread each", 2, 1, "fsdp")]
    rows, base = [], None
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        prepare(str(shakespeare_path()), "shakespeare-char", tokenizer="char", data_dir=tmp / "data")
        for label, procs, threads, parallel in runs:
            flags = dict(
                preset="cpu-char",
                data="shakespeare-char",
                data_dir=str(tmp / "data"),
                device="cpu",
                dtype="float32",
                max_iters=args.max_iters,
                lr_decay_iters=args.max_iters,
                gradient_accumulation_steps=2,
                log_interval=args.max_iters,
                parallel=parallel,
            )
            r = train_in_processes(flags, procs, tmp / f"run-{len(rows)}", threads=threads)
            if r is None:
                rows.append([label, "failed", "", "", "", ""])
                continue
            base = base or r["tokens_per_s"]
            rows.append(
                [
                    label,
                    f"{r['ms_per_iter']:.1f}",
                    f"{r['tokens_per_s']:,.0f}",
                    f"{r['tokens_per_s'] / (procs * base):.0%}" if procs > 1 else "",
                    f"{r['val_loss']:.4f}",
                    f"{r['wall_s']:.0f} s",
                ]
            )
    table(
        f"cpu-char recipe, {args.max_iters} updates of 2 x 12 x 64 tokens, float32, on the CPU",
        ["run", "ms/iter", "tokens/s", "scaling efficiency", "final val loss", "wall (start to exit)"],
        rows,
    )


if __name__ == "__main__":
    main()
