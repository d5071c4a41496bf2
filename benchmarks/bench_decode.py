"""The one-token decode step: the engine's step (cpu.decode_step) against torch.compile of the same blocks driven
with a static cache shape (attention over the whole preallocated cache with a mask, the position a tensor, so one
compiled graph serves every position).

    python benchmarks/bench_decode.py                      # cpu-char and shakespeare-char shapes, batch 1 and 5
    python benchmarks/bench_decode.py --device cuda --tokens 500

Prints ms per token for both, the speed-up, the one-off compile time and whether the two agree (max |diff|).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import sync, table  # noqa: E402

from nanogpt_cli.config import GPTConfig  # noqa: E402
from nanogpt_cli.device import resolve_device  # noqa: E402
from nanogpt_cli.inference.backends.cpu import DecodePlan, decode_plan, decode_step, head_logits  # noqa: E402
from nanogpt_cli.inference.engine import KVCache  # noqa: E402
from nanogpt_cli.model import GPT, Context, softcap  # noqa: E402


class StaticView:
    """The whole preallocated cache as a compiled graph reads it: each layer's new keys and values written at the
    position tensor `at`, and every slot returned (the mask hides the ones not written yet)."""

    def __init__(self, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], at: torch.Tensor):
        self.k, self.v, self.at = k_cache, v_cache, at

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k[layer].index_copy_(2, self.at, k)  # (B, nh, S, hs)
        self.v[layer].index_copy_(2, self.at, v)
        return self.k[layer], self.v[layer]


def static_step(
    p: DecodePlan, idx: torch.Tensor, pos: torch.Tensor, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor]
) -> torch.Tensor:
    """decode_step with shapes that never change: pos is a 1-element tensor, attention covers the whole cache
    (block_size keys) and masks the ones not written yet; the blocks are the model's own (p.ops). (B, V)"""
    B, S, ops = idx.size(0), k_cache[0].size(2), p.ops
    x = torch.embedding(ops.wte, idx.view(B))  # (B, C): T = 1 folded away
    ctx = Context(B, 1, cache=StaticView(k_cache, v_cache, pos))
    ctx.mask = (torch.arange(S, device=idx.device) <= pos).view(1, 1, 1, S)
    if ops.cos is not None:
        ctx.cos, ctx.sin = ops.cos.index_select(0, pos), ops.sin.index_select(0, pos)  # (1, 1, 1, hs)
    else:
        x = x + ops.pos_table.index_select(0, pos)
    for i, block in enumerate(ops.blocks):
        x = block(x, ctx, i)
    return softcap(head_logits(p, ops.ln_f(x)), p.logit_softcap)


def bench(cfg: GPTConfig, batch: int, tokens: int, device: torch.device) -> list:
    torch.manual_seed(0)
    model = GPT(cfg).to(device).eval()
    prompt = torch.randint(0, cfg.vocab_size, (batch, 4), device=device)
    ids = torch.randint(0, cfg.vocab_size, (batch, tokens), device=device)
    n = min(tokens, cfg.block_size - 4)
    with torch.inference_mode():
        plan = decode_plan(model)

        def eager() -> tuple[float, torch.Tensor]:
            cache = KVCache(model, batch)
            model(prompt, cache=cache.view(0, batch))
            sync(device)
            t0 = time.perf_counter()
            for t in range(n):
                out = decode_step(plan, ids[:, t : t + 1], cache)
            sync(device)
            return (time.perf_counter() - t0) / n, out

        compiled = torch.compile(static_step, dynamic=False, fullgraph=True)

        def static(fn) -> tuple[float, torch.Tensor]:
            cache = KVCache(model, batch)
            model(prompt, cache=cache.view(0, batch))
            positions = torch.arange(cfg.block_size, device=device)
            sync(device)
            t0 = time.perf_counter()
            for t in range(n):
                out = fn(plan, ids[:, t : t + 1], positions[4 + t : 5 + t], cache.k, cache.v)
            sync(device)
            return (time.perf_counter() - t0) / n, out

        t0 = time.perf_counter()
        static(compiled)  # compiles once
        compile_s = time.perf_counter() - t0
        eager()
        runs = {"eager": [], "compiled": []}
        outs = {}
        for _ in range(3):  # interleaved: drift hits both alike
            dt, outs["eager"] = eager()
            runs["eager"].append(dt)
            dt, outs["compiled"] = static(compiled)
            runs["compiled"].append(dt)
    e, c = min(runs["eager"]), min(runs["compiled"])
    diff = (outs["eager"].float() - outs["compiled"].float()).abs().max().item()
    return [
        f"{cfg.n_layer}x{cfg.n_embd}, ctx {cfg.block_size}",
        batch,
        f"{e * 1000:.3f}",
        f"{c * 1000:.3f}",
        f"{e / c:.2f}x",
        f"{compile_s:.0f} s",
        f"{diff:.1e}",
    ]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 5])
    p.add_argument("--small-only", action="store_true", help="only the cpu-char shape (compiling is slow)")
    args = p.parse_args()
    device = resolve_device(args.device)
    shapes = [
        GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128),
        GPTConfig(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384),
    ]
    rows = []
    for cfg in shapes[:1] if args.small_only else shapes:
        for b in args.batches:
            rows.append(bench(cfg, b, args.tokens, device))
            print(" | ".join(map(str, rows[-1])), flush=True)
    table(
        f"one-token decode step on {device} ({torch.get_num_threads()} threads), ms per token",
        ["model", "batch", "engine step", "torch.compile, static cache", "speed-up", "compile", "max |diff|"],
        rows,
    )


if __name__ == "__main__":
    main()
