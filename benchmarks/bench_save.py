"""How long a checkpoint save stalls the training loop, written on the training thread (`--sync-save`) against
the background writer (the default), at ~10M, ~85M and ~300M parameters. Both modes run the same loop in this
process, through the trainer's own pieces (`optimizer_step`, `rundir.Saver`): AdamW updates (batch 1 at context
256, --dtype auto) until the previous save is written (at least --updates), then a save, and again. The stall is
the time until save() returns: the whole write for a synchronous save, the host copy of the state for a
background one. On a machine with few cores the writer competes with training: the seconds per update (the
cycles' time less their stalls, per update) show what that costs.

    python benchmarks/bench_save.py                      # the three sizes, ~5 min on 2 cores
    python benchmarks/bench_save.py --sizes 10M --saves 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table  # noqa: E402

from nanogpt_cli.config import GPTConfig, TrainConfig  # noqa: E402
from nanogpt_cli.device import autocast_for, resolve_dtype  # noqa: E402
from nanogpt_cli.model import GPT  # noqa: E402
from nanogpt_cli.runs.checkpoint import TrainerState  # noqa: E402
from nanogpt_cli.runs.rundir import RunDir, Saver  # noqa: E402
from nanogpt_cli.training.optim import make_optimizer  # noqa: E402
from nanogpt_cli.training.trainer import optimizer_step  # noqa: E402

SIZES = {"10M": (6, 6, 384), "85M": (12, 12, 768), "300M": (24, 16, 1024)}  # n_layer, n_head, n_embd
CONTEXT, VOCAB = 256, 65


def cycles(model, optimizer, ctx, run: RunDir, background: bool, saves: int, updates: int) -> dict:
    """Each save's stall, and each cycle's updates and seconds (a cycle: the updates, then the save); training
    goes on while a background write is still running, as it would with saves hundreds of updates apart."""
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    g = torch.Generator().manual_seed(0)
    out = dict(stall=[], cycle_s=[], updates=[])
    with Saver(run, background=background) as saver:
        for i in range(saves):
            started, done = time.perf_counter(), 0
            while done < updates or saver.busy():
                x, y = (torch.randint(0, VOCAB, (1, CONTEXT), generator=g) for _ in range(2))
                optimizer_step(model, optimizer, [(x, y)], ctx, scaler, grad_clip=1.0)
                done += 1
            t = time.perf_counter()
            saver.save(model, optimizer, TrainerState(step=i + 1), {"tokenizer": {"name": "char"}}, is_best=False)
            out["stall"].append(time.perf_counter() - t)
            out["cycle_s"].append(time.perf_counter() - started)
            out["updates"].append(done)
        t = time.perf_counter()
        saver.wait()
        out["final_wait"] = time.perf_counter() - t
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated subset of {', '.join(SIZES)}")
    p.add_argument("--saves", type=int, default=3, help="saves per mode (the first warms up)")
    p.add_argument("--updates", type=int, default=1, help="updates before each save, at least (more while writing)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    args = p.parse_args()
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if [s for s in sizes if s not in SIZES] or args.saves < 2:
        p.error(f"--sizes: choose from {', '.join(SIZES)}; --saves must be at least 2")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    dtype = resolve_dtype("auto", device)
    ctx = autocast_for(device, dtype)
    rows, load = [], os.getloadavg()[0]
    for size in sizes:
        n_layer, n_head, n_embd = SIZES[size]
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=VOCAB, block_size=CONTEXT, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
        model = GPT(cfg)
        optimizer = make_optimizer(model, TrainConfig(), device)
        results = {}
        with tempfile.TemporaryDirectory() as tmp:
            for mode in ("synchronous", "background"):
                run = RunDir(Path(tmp) / mode)
                run.path.mkdir()
                results[mode] = cycles(model, optimizer, ctx, run, mode == "background", args.saves, args.updates)
            on_disk = sum(f.stat().st_size for f in (Path(tmp) / "background").iterdir())
        base = statistics.median(results["synchronous"]["stall"][1:])
        for mode, r in results.items():
            stall = statistics.median(r["stall"][1:])  # the first save of each mode warms up (allocations)
            per_update = sum(r["cycle_s"][1:]) - sum(r["stall"][1:])
            rows.append(
                [
                    f"{size} ({model.num_params(non_embedding=False) / 1e6:.0f}M), {on_disk / 2**30:.2f} GiB a save",
                    mode,
                    f"{stall:.2f} s",
                    f"{base / stall:.1f}x",
                    f"{per_update / sum(r['updates'][1:]):.2f} s",
                    "/".join(str(u) for u in r["updates"][1:]),
                    f"{r['final_wait']:.2f} s",
                ]
            )
            print(" | ".join(rows[-1]), flush=True)
        del model, optimizer
    table(
        f"stall per save, {torch.get_num_threads()} threads, {dtype}, load average {load:.1f} at the start and "
        f"{os.getloadavg()[0]:.1f} at the end (cut: synchronous stall / this one)",
        ["size", "save", "stall per save", "cut", "s per update", "updates before each save", "last save's wait"],
        rows,
    )


if __name__ == "__main__":
    main()
