"""A short check of training on whatever GPUs this machine has: gpt2-124m on random text for ~50 updates in
bf16, with and without torch.compile, in one process and (with more than one GPU) DDP over all of them.

    python benchmarks/gpu_check.py                  # a few minutes on one H100-class GPU
    python benchmarks/gpu_check.py --steps 20 --no-compile

Each row is a fresh `nanogpt train` (torchrun for DDP) through the library, so the figures are the trainer's
own: ms/iter and tokens/s leave out the first (warm-up / compile) update and the evaluations; MFU is against
the GPU's datasheet bf16 peak over all GPUs; peak memory is rank 0's. Without a GPU it runs the `tiny` preset
on the CPU in float32, DDP over 2 processes, so the script itself can be tried anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, table  # noqa: E402


def random_text(n_words: int, seed: int = 0) -> str:
    """Words of random letters: the gpt2 tokenizer turns them into a spread of ordinary tokens."""
    rng = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    words = ("".join(rng.choices(letters, k=rng.randint(1, 9))) for _ in range(n_words))
    return " ".join(words) + "\n"


def worker(args) -> None:
    """One row: train in this process (under torchrun: as one of its ranks) and have rank 0 write the figures."""
    from nanogpt_cli.train import run_configs, train

    values = dict(data="random", data_dir=args.data_dir, device=args.device, dtype=args.dtype, compile=args.compile,
                  max_iters=args.steps, eval_interval=args.steps, eval_iters=1, log_interval=args.steps,
                  warmup_iters=5, gradient_accumulation_steps=args.accum, batch_size=args.batch_size)
    model_cfg, cfg = run_configs(args.preset, values, Path(args.run_dir))
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    result = train(model_cfg, cfg, Path(args.run_dir))
    if int(os.environ.get("RANK", "0")) == 0:
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
        Path(args.result).write_text(json.dumps(dict(ms_per_iter=result.ms_per_iter, tokens_per_s=result.tokens_per_s,
                                                     mfu=result.mfu, peak_bytes=peak, loss=result.train_loss,
                                                     elapsed_s=result.elapsed_s)))


def run_row(args, tmp: Path, procs: int, compile: bool) -> dict | None:
    name = f"p{procs}-{'compile' if compile else 'eager'}"
    result = tmp / f"{name}.json"
    worker_args = [str(Path(__file__).resolve()), "--worker", "--data-dir", str(tmp / "data"), "--run-dir",
                   str(tmp / name), "--result", str(result), "--preset", args.preset, "--steps", str(args.steps),
                   "--device", args.device, "--dtype", args.dtype, "--batch-size", str(args.batch_size),
                   "--accum", str(args.accum * procs)] + (["--compile"] if compile else [])
    launcher = [sys.executable] if procs == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    proc = subprocess.run(launcher + worker_args, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if not result.is_file():
        print(f"--- {name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    return dict(json.loads(result.read_text()), wall_s=wall, returncode=proc.returncode)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50, help="optimizer updates per row")
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile rows")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per update per process")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--data-dir", "--run-dir", "--result", "--preset", "--device", "--dtype"):
        p.add_argument(name, help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    gpus = torch.cuda.device_count()
    if gpus:
        args.preset, args.device, args.dtype, args.batch_size = "gpt2-124m", "cuda", "bfloat16", 12
        procs = [1] + ([gpus] if gpus > 1 else [])
        where = f"{gpus} x {torch.cuda.get_device_name(0)}"
    else:
        args.preset, args.device, args.dtype, args.batch_size = "tiny", "cpu", "float32", 8
        procs = [1, 2]
        where = f"CPU ({os.cpu_count()} cores), tiny preset: no GPU found"
    compiles = [False] if args.no_compile else [False, True]
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        from nanogpt_cli.data import prepare

        source = tmp / "random.txt"
        source.write_text(random_text(400_000 if gpus else 50_000))
        prepare(str(source), "random", tokenizer="gpt2" if gpus else "char", data_dir=tmp / "data")
        for n in procs:
            for compile in compiles:
                r = run_row(args, tmp, n, compile)
                label = f"{n} process{'es, DDP' if n > 1 else ''}{', --compile' if compile else ''}"
                if r is None:
                    rows.append([label, "failed", "", "", "", "", ""])
                    continue
                rows.append([label, f"{r['ms_per_iter']:.1f}", f"{r['tokens_per_s']:,.0f}",
                             f"{r['mfu']:.1%}" if r["mfu"] is not None else "-",
                             f"{r['peak_bytes'] / 2**30:.1f} GiB" if r["peak_bytes"] else "-",
                             f"{r['loss']:.3f}", f"{r['wall_s']:.0f} s"])
    table(f"{args.preset}, {args.steps} updates of {args.batch_size} x block_size tokens x {args.accum} per process, "
          f"{args.dtype}, random text, on {where}",
          ["run", "ms/iter", "tokens/s", "MFU", "peak memory", "last train loss", "wall (start to exit)"], rows)


if __name__ == "__main__":
    main()
