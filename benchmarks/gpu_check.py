"""A short check of training on whatever GPUs this machine has: gpt2-124m on random text for ~50 updates in
bf16, with and without torch.compile, in one process and (with more than one GPU) DDP and FSDP over all.

    python benchmarks/gpu_check.py                  # a few minutes on one H100-class GPU
    python benchmarks/gpu_check.py --steps 20 --no-compile

Each row is a fresh training run through the library (torchrun for many GPUs), so the figures are the
trainer's own: ms/iter and tokens/s leave out the first (warm-up / compile) update and the evaluations; MFU
is against the GPUs' datasheet bf16 peak, all of them together; peak memory is rank 0's. Each GPU runs one
micro-batch of 12 x 1024 tokens per update (--accum for more). Without a GPU it runs the `tiny` preset on
the CPU in float32, with 2 processes for DDP and FSDP, so that the script itself can be tried anywhere.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table, train_in_processes  # noqa: E402


def random_text(n_words: int, seed: int = 0) -> str:
    """Words of random letters: the gpt2 tokenizer turns them into a spread of ordinary tokens."""
    rng = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    return " ".join("".join(rng.choices(letters, k=rng.randint(1, 9))) for _ in range(n_words)) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50, help="optimizer updates per row")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per update per process")
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile rows")
    args = p.parse_args()

    gpus = torch.cuda.device_count()
    if gpus:
        base = dict(preset="gpt2-124m", device="cuda", dtype="bfloat16", batch_size=12)
        procs = [1] + ([gpus] if gpus > 1 else [])
        where = f"{gpus} x {torch.cuda.get_device_name(0)}"
    else:
        base = dict(preset="tiny", device="cpu", dtype="float32", batch_size=8)
        procs = [1, 2]
        where = f"the CPU ({os.cpu_count()} cores; no GPU found)"
    compiles = [False] if args.no_compile else [False, True]
    runs = [(n, c, "ddp") for n in procs for c in compiles] + [(n, False, "fsdp") for n in procs if n > 1]
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        from nanogpt_cli.data import prepare

        source = tmp / "random.txt"
        source.write_text(random_text(400_000 if gpus else 50_000))
        prepare(str(source), "random", tokenizer="gpt2" if gpus else "char", data_dir=tmp / "data")
        for n, compile, parallel in runs:
            flags = dict(
                base,
                data="random",
                data_dir=str(tmp / "data"),
                compile=compile,
                parallel=parallel,
                max_iters=args.steps,
                eval_interval=args.steps,
                eval_iters=2,
                log_interval=args.steps,
                warmup_iters=5,
                gradient_accumulation_steps=args.accum * n,
            )
            r = train_in_processes(flags, n, tmp / f"p{n}-{parallel}-{compile}")
            label = f"{n} process{'es, ' + parallel.upper() if n > 1 else ''}{', --compile' if compile else ''}"
            if r is None:
                rows.append([label, "failed", "", "", "", "", ""])
                continue
            rows.append(
                [
                    label,
                    f"{r['ms_per_iter']:.1f}",
                    f"{r['tokens_per_s']:,.0f}",
                    f"{r['mfu']:.1%}" if r["mfu"] is not None else "-",
                    f"{r['peak_bytes'] / 2**30:.1f} GiB" if r["peak_bytes"] else "-",
                    f"{r['train_loss']:.3f}",
                    f"{r['wall_s']:.0f} s",
                ]
            )
    table(
        f"{base['preset']}, {args.steps} updates, {base['dtype']}, random text, {args.accum} micro-batch(es) of "
        f"{base['batch_size']} per process per update, on {where}",
        ["run", "ms/iter", "tokens/s", "MFU", "peak memory", "train loss at the end", "wall (start to exit)"],
        rows,
    )


if __name__ == "__main__":
    main()
