"""nanoGPT's CPU recipe for Tiny Shakespeare (char), run by our trainer: ms/iter, tokens/s, MFU, val loss.

    python benchmarks/bench_train.py                      # 2000 iters with --dtype auto, then float32
    python benchmarks/bench_train.py --max-iters 300 --dtypes auto
    python benchmarks/bench_train.py --presets cpu-char cpu-fast --dtypes auto   # with Muon and the block options

The recipe (nanoGPT README, "I only have a macbook"): 4 layers, 4 heads, 128 wide, context 64, batch 12,
2000 iters, lr 1e-3 decayed over 2000 iters, dropout 0, eval 20 iters. On these 2 cores nanoGPT's train.py
runs it at 40-52 ms/iter (15,000-19,000 tokens/s) and reaches val loss 1.886 (2.396 with 300 iters).
MFU is against the matmul peak measured in this process for the dtype that does the matmuls.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import matmul_peak, shakespeare_path, table  # noqa: E402

from nanogpt_cli.data import prepare  # noqa: E402
from nanogpt_cli.device import resolve_device, resolve_dtype  # noqa: E402
from nanogpt_cli.training.events import NoDisplay  # noqa: E402
from nanogpt_cli.training.plan import plan_run  # noqa: E402
from nanogpt_cli.training.request import RunRequest  # noqa: E402
from nanogpt_cli.training.trainer import train  # noqa: E402

NANOGPT = {"ms_per_iter": (40, 52), "tokens_per_s": (15_000, 19_000), "val_loss_2000": 1.886, "val_loss_300": 2.396}


def interleaved(device: torch.device, dtype_names: list[str], rounds: int = 5, steps: int = 40) -> None:
    """The same training step in each dtype, alternated round by round in one process: the machine's drift
    hits every dtype alike, so the ratio holds even when the absolute times of the full runs moved."""
    import contextlib
    import statistics
    import time

    from nanogpt_cli.config import GPTConfig, TrainConfig, preset_values, split_values
    from nanogpt_cli.device import autocast_for
    from nanogpt_cli.model import GPT
    from nanogpt_cli.training.optim import make_optimizer

    model_kw, _ = split_values(preset_values("cpu-char"))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, **model_kw)).to(device)
    optimizer = make_optimizer(model, TrainConfig(), device)
    x = torch.randint(0, 65, (12, 64), device=device)
    dtypes = {name: resolve_dtype(name, device) for name in dtype_names}

    def step(dtype):
        with autocast_for(device, dtype) if dtype != torch.float32 else contextlib.nullcontext():
            _, loss = model(x, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {name: [] for name in dtypes}
    for dtype in dtypes.values():
        for _ in range(5):
            step(dtype)
    for _ in range(rounds):
        for name, dtype in dtypes.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                step(dtype)
            times[name].append((time.perf_counter() - t0) / steps * 1000)
    base = statistics.median(times[dtype_names[-1]])
    rows = [
        [
            f"--dtype {name}",
            f"{statistics.median(t):.1f}",
            f"{min(t):.1f}-{max(t):.1f}",
            f"{base / statistics.median(t):.2f}x",
        ]
        for name, t in times.items()
    ]
    table(
        f"training step alone, interleaved: {rounds} rounds x {steps} steps",
        ["run", "median ms/iter", "range", f"speed vs --dtype {dtype_names[-1]}"],
        rows,
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-iters", type=int, default=2000)
    p.add_argument("--dtypes", nargs="+", default=["auto", "float32"])
    p.add_argument("--compile", action="store_true", help="also torch.compile the model")
    p.add_argument("--presets", nargs="+", default=["cpu-char"], help="cpu-char (the recipe) and/or cpu-fast")
    args = p.parse_args()
    device = resolve_device("auto")
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        prepare(str(shakespeare_path()), "shakespeare-char", tokenizer="char", data_dir=data_dir)
        rows = []
        for preset, dtype_name in [(p_, d) for p_ in args.presets for d in args.dtypes]:
            dtype = resolve_dtype(dtype_name, device)
            peak = matmul_peak(device, dtype)
            run = Path(tmp) / f"run-{preset}-{dtype_name}"
            values = dict(
                data="shakespeare-char",
                data_dir=str(data_dir),
                dtype=dtype_name,
                max_iters=args.max_iters,
                lr_decay_iters=args.max_iters,
                compile=args.compile,
                log_interval=args.max_iters,
            )
            plan = plan_run(RunRequest({"preset": preset, **values}, out=run))
            model_cfg, cfg = plan.model, plan.train
            evals: list = []

            class Evals(NoDisplay):
                def on_eval(self, event, evals=evals):
                    evals.append(event)

            result = train(plan, Evals())
            from nanogpt_cli.model import GPT

            flops_per_iter = GPT(model_cfg).flops_per_token() * cfg.batch_size * model_cfg.block_size
            rows.append(
                [
                    f"ours, {preset}, --dtype {dtype_name} ({str(dtype).replace('torch.', '')})",
                    f"{result.ms_per_iter:.1f}",
                    f"{result.tokens_per_s:,.0f}",
                    f"{flops_per_iter / (result.ms_per_iter / 1000) / peak:.1%} of {peak / 1e9:,.0f} GFLOP/s",
                    f"{evals[-1].val_loss:.4f}",
                    f"{result.elapsed_s:.0f} s",
                    f"{(sum(NANOGPT['ms_per_iter']) / 2) / result.ms_per_iter:.2f}x",
                ]
            )
        ref_loss = (
            NANOGPT["val_loss_2000"]
            if args.max_iters == 2000
            else (NANOGPT["val_loss_300"] if args.max_iters == 300 else float("nan"))
        )
        rows.append(
            ["nanoGPT train.py (published, these cores)", "40-52", "15,000-19,000", "", f"{ref_loss:.3f}", "", "1.00x"]
        )
    interleaved(device, args.dtypes)
    table(
        f"nanoGPT CPU recipe, Tiny Shakespeare char, {args.max_iters} iters on {device} "
        f"({torch.get_num_threads()} threads)",
        ["run", "ms/iter", "tokens/s", "MFU", "final val loss", "whole run", "speed vs nanoGPT (46 ms)"],
        rows,
    )


if __name__ == "__main__":
    main()
