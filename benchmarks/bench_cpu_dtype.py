"""bf16 autocast against fp32 for a CPU training update, by model size: the basis of `--dtype auto`'s size
threshold on a CPU with native bf16 (device.BF16_MIN_FLOPS). The two dtypes alternate block by block in one
process, so a machine whose load drifts treats both alike.

    python benchmarks/bench_cpu_dtype.py                 # 1 thread, 7 sizes from 0.03M to 85M parameters
    python benchmarks/bench_cpu_dtype.py --threads 2 --blocks 6
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

from nanogpt_cli.config import GPTConfig  # noqa: E402
from nanogpt_cli.device import BF16_MIN_FLOPS, cpu_has_bf16, resolve_dtype, update_flops  # noqa: E402
from nanogpt_cli.model import GPT  # noqa: E402

# (layers, heads, width, context, rows, vocabulary): the `tiny` preset, the fine-tuning example's base, cpu-char
# with fewer rows, cpu-char, shakespeare-char's 10.7M, gpt2-small's shape at 2 rows
SIZES = [
    (2, 2, 32, 32, 8, 65),
    (2, 4, 64, 32, 8, 65),
    (2, 4, 64, 128, 12, 256),
    (4, 4, 128, 32, 4, 65),
    (4, 4, 128, 64, 12, 65),
    (6, 6, 384, 256, 8, 65),
    (12, 12, 768, 256, 2, 65),
]


def time_update(model: GPT, opt, x: torch.Tensor, bf16: bool, reps: int) -> float:
    """ms per training update (forward, backward, AdamW) over `reps` updates."""
    t0 = time.perf_counter()
    for _ in range(reps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return (time.perf_counter() - t0) / reps * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=4, help="blocks per dtype, alternated")
    parser.add_argument("--block-s", type=float, default=0.6, help="seconds of updates per block")
    parser.add_argument("--max-params", type=float, default=100e6, help="leave out larger models")
    args = parser.parse_args()
    if not cpu_has_bf16():
        raise SystemExit("this CPU has no native bf16 (AVX-512 BF16 or AMX): auto trains in fp32 at any size")
    torch.set_num_threads(args.threads)
    rows = []
    for layers, heads, width, context, batch, vocab in SIZES:
        cfg = GPTConfig(n_layer=layers, n_head=heads, n_embd=width, block_size=context, vocab_size=vocab)
        torch.manual_seed(0)
        model = GPT(cfg)
        params = sum(p.numel() for p in model.parameters())
        if params > args.max_params:
            continue
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randint(0, vocab, (batch, context))
        time_update(model, opt, x, False, 1)  # warm-up, both dtypes
        time_update(model, opt, x, True, 1)
        reps = max(1, int(args.block_s / (time_update(model, opt, x, False, 1) / 1000)))
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.blocks):
            for bf16 in (False, True):
                times[bf16].append(time_update(model, opt, x, bf16, reps))
        fp32, bf16 = statistics.median(times[False]), statistics.median(times[True])
        auto = resolve_dtype("auto", torch.device("cpu"), cfg, batch)
        rows.append(
            [
                f"{layers} x {width}, context {context}, {batch} rows, vocab {vocab}",
                f"{params / 1e6:.2f}M",
                f"{update_flops(cfg, batch) / 1e6:,.0f}",
                f"{fp32:,.1f}",
                f"{bf16:,.1f}",
                f"{fp32 / bf16:.2f}x",
                "bf16" if auto == torch.bfloat16 else "fp32",
            ]
        )
        print(*rows[-1], sep=" | ", flush=True)
    table(
        f"training update, ms (median of {args.blocks} alternated blocks), {args.threads} thread(s); "
        f"auto keeps fp32 under {BF16_MIN_FLOPS / 1e6:.0f} MFLOP",
        ["model", "params", "MFLOP/update", "fp32 ms", "bf16 ms", "bf16 speed", "auto"],
        rows,
    )


if __name__ == "__main__":
    main()
