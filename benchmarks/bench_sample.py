"""Sampling tokens/s with and without the KV cache, N samples as one batch against one after another, and
perplexity-eval tokens/s, through the real sampler.

    python benchmarks/bench_sample.py
    python benchmarks/bench_sample.py --new-tokens 200 --contexts 64 256 --num-samples 1 5 20

Models have random weights (speed does not depend on them) and a char vocabulary of 65. "no cache" is
nanoGPT's way: a full forward over the last block_size tokens for every new token. Against nanoGPT's own
sample.py, whole process: benchmarks/bench_vs_nanogpt.py.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table  # noqa: E402

from nanogpt_cli.config import GPTConfig  # noqa: E402
from nanogpt_cli.inference.evaluate import score_tokens  # noqa: E402
from nanogpt_cli.inference.sample import Sampler, SampleSettings  # noqa: E402
from nanogpt_cli.model import GPT  # noqa: E402
from nanogpt_cli.runs import checkpoint as ckpt  # noqa: E402
from nanogpt_cli.tokenizer import build_tokenizer  # noqa: E402

CHARS = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"  # Tiny Shakespeare's 65


def models(contexts: list[int], large: bool = True) -> list[tuple[str, GPTConfig]]:
    out = []
    for T in contexts:
        cfg = GPTConfig(vocab_size=65, block_size=T, n_layer=4, n_head=4, n_embd=128)
        out.append((f"cpu-char 4x128, ctx {T}", cfg))
    if large:
        out.append(
            (
                "shakespeare-char 6x384, ctx 256",
                GPTConfig(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384),
            )
        )
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=500)
    p.add_argument("--contexts", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--device", default="auto")
    p.add_argument("--num-samples", type=int, nargs="+", default=[1, 5, 20])
    p.add_argument("--no-large", action="store_true", help="leave out the shakespeare-char model")
    args = p.parse_args()
    tok = build_tokenizer("char", [CHARS])
    rows, eval_rows, batch_rows = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for label, cfg in models(args.contexts, large=not args.no_large):
            torch.manual_seed(0)
            path = Path(tmp) / f"{cfg.block_size}-{cfg.n_embd}.safetensors"
            ckpt.save_model(path, GPT(cfg), {"tokenizer": tok.describe(), "step": 0})
            sampler = Sampler.load(path, device=args.device)
            speed = {}
            for use_cache in (True, False):
                settings = SampleSettings(max_new_tokens=args.new_tokens, use_cache=use_cache)
                sampler.generate("ROMEO:", SampleSettings(max_new_tokens=20, use_cache=use_cache))  # warm up
                result = sampler.generate("ROMEO:", settings)
                speed[use_cache] = result.tokens_per_s
            rows.append([label, f"{speed[True]:,.0f}", f"{speed[False]:,.0f}", f"{speed[True] / speed[False]:.1f}x"])
            if cfg.block_size == 64 or cfg.n_embd == 384:
                batch_rows += batched(label, sampler, args.new_tokens, args.num_samples)
            tokens = torch.randint(0, 65, (50_000,)).numpy()
            t0 = time.perf_counter()
            score_tokens(sampler.model, tokens, stride=cfg.block_size // 2, batch_size=32)
            eval_rows.append([label, f"{len(tokens) / (time.perf_counter() - t0):,.0f}"])
    table(
        f"sampling {args.new_tokens} new tokens on {sampler.device} (tokens/s)",
        ["model", "KV cache", "no cache", "cache / no cache"],
        rows,
    )
    table(
        f"--num-samples N: {args.new_tokens} new tokens per sample, KV cache (tokens/s over all samples)",
        ["model", "N", "one batch", "one after another", "batch / sequential"],
        batch_rows,
    )
    table("perplexity eval, stride = half the context, batch 32", ["model", "tokens/s"], eval_rows)


def batched(label: str, sampler: Sampler, new_tokens: int, counts: list[int]) -> list[list]:
    """N samples of one prompt decoded as one batch (what `--num-samples N` does) against N in turn."""
    settings = SampleSettings(max_new_tokens=new_tokens)
    rows = []
    for n in counts:
        t0 = time.perf_counter()
        results = sampler.generate_many(["ROMEO:"] * n, settings)
        together = sum(r.tokens for r in results) / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        total = sum(sampler.generate("ROMEO:", settings).tokens for _ in range(n))
        alone = total / (time.perf_counter() - t0)
        rows.append([label, n, f"{together:,.0f}", f"{alone:,.0f}", f"{together / alone:.1f}x"])
    return rows


if __name__ == "__main__":
    main()
