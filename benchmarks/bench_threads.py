"""Training-step time with 1 thread against torch's default (one per core), alternated block by block in one
process, so that a machine whose load changes over minutes treats both alike (the basis of --threads' README).

    python benchmarks/bench_threads.py                     # cpu-char, 6 blocks of 10 steps per setting
    python benchmarks/bench_threads.py --preset tiny --blocks 10
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table  # noqa: E402

from nanogpt_cli.config import GPTConfig, preset_values, split_values  # noqa: E402
from nanogpt_cli.model import GPT  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu-char")
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    model_kw, train_kw = split_values(preset_values(args.preset))
    cfg = GPTConfig(**{"vocab_size": 65, **model_kw})
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 65, (train_kw.get("batch_size", 12), cfg.block_size))
    default = torch.get_num_threads()
    settings = sorted({1, default})
    times: dict[int, list[float]] = {n: [] for n in settings}

    def step() -> None:
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up
    for _ in range(args.blocks):
        for n in settings:
            torch.set_num_threads(n)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[n].append((time.perf_counter() - t0) / args.steps * 1000)
    base = statistics.median(times[default])
    rows = [
        [
            f"{n} thread{'s' if n > 1 else ''}" + (" (default)" if n == default else ""),
            f"{statistics.median(times[n]):.1f}",
            f"{min(times[n]):.1f}-{max(times[n]):.1f}",
            f"{base / statistics.median(times[n]):.2f}x",
        ]
        for n in settings
    ]
    table(
        f"{args.preset}: training step, ms (median of {args.blocks} blocks of {args.steps} steps)",
        ["threads", "median ms/step", "range", "speed vs default"],
        rows,
    )


if __name__ == "__main__":
    main()
