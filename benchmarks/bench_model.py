"""Forward + backward time and tokens/s of the model presets, fp32 against bf16 autocast, on this device.

python benchmarks/bench_model.py                       # shakespeare-char and gpt2-124m
python benchmarks/bench_model.py --presets cpu-char --iters 20
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import matmul_peak, sync, table  # noqa: E402

from nanogpt_cli.config import GPTConfig, preset_values, split_values  # noqa: E402
from nanogpt_cli.device import resolve_device  # noqa: E402
from nanogpt_cli.model import GPT  # noqa: E402


def bench(preset: str, device: torch.device, dtype: torch.dtype, batch_size: int, iters: int) -> dict:
    model_kw, _ = split_values(preset_values(preset))
    cfg = GPTConfig(**{"vocab_size": 50304 if preset.startswith("gpt2") else 65, **model_kw, "dropout": 0.0})
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    x = torch.randint(0, cfg.vocab_size, (batch_size, cfg.block_size), device=device)
    ctx = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()

    def step():
        with ctx:
            _, loss = model(x, x)
        loss.backward()

    for _ in range(2):
        step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    sync(device)
    dt = (time.perf_counter() - t0) / iters
    tokens = batch_size * cfg.block_size
    return dict(ms=dt * 1000, tps=tokens / dt, flops=model.flops_per_token() * tokens / dt)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["shakespeare-char", "gpt2-124m"])
    p.add_argument("--device", default="auto")
    p.add_argument("--batch-size", type=int, default=None, help="default: 4 on CPU, 16 on CUDA")
    p.add_argument("--iters", type=int, default=None, help="default: 3 on CPU, 20 on CUDA")
    args = p.parse_args()
    device = resolve_device(args.device)
    batch = args.batch_size or (16 if device.type == "cuda" else 4)
    iters = args.iters or (20 if device.type == "cuda" else 3)
    dtypes = [torch.float32, torch.bfloat16]
    peaks = {dt: matmul_peak(device, dt) for dt in dtypes}
    rows = []
    for preset in args.presets:
        results = {dt: bench(preset, device, dt, batch, iters) for dt in dtypes}
        for dt, r in results.items():
            rows.append(
                [
                    preset,
                    str(dt).replace("torch.", ""),
                    f"{r['ms']:,.1f}",
                    f"{r['tps']:,.0f}",
                    f"{r['flops'] / 1e9:,.1f}",
                    f"{r['flops'] / peaks[dt]:.1%}",
                    f"{results[torch.float32]['ms'] / r['ms']:.2f}x",
                ]
            )
    peak_text = ", ".join(f"{str(dt).replace('torch.', '')} {v / 1e9:,.0f} GFLOP/s" for dt, v in peaks.items())
    table(
        f"forward+backward on {device}, batch {batch}; measured matmul peak: {peak_text}",
        ["preset", "dtype", "ms/iter", "tokens/s", "GFLOP/s", "of peak", "speed vs fp32"],
        rows,
    )


if __name__ == "__main__":
    main()
