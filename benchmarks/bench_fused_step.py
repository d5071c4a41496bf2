"""The cpu backend's fused decode step (every block in one call, decode.FusedStep) against the same backend's step op
by op (the decoding form, what these families ran before the step took them), in one process, in alternating
rounds on the same engine, the same weights and the same cache. Random weights (speed does not depend on them) in
real models' shapes: Pythia-160M (parallel residual, partial rotary, LayerNorm with biases), Gemma 3
270M (gated GELU, post-norms, QK-norm, 1 + w gains, local and global layers), GPT-2 124M (learned positions) and
our default block at GPT-2's size.

    python benchmarks/bench_fused_step.py --models pythia-160m gemma3-270m --rounds 3 --threads 1
    python benchmarks/bench_fused_step.py --batch 8 --precisions int8

Each figure is engine steps (the blocks, the final norm, the head and the greedy pick) at --batch rows (1: as a
token of `sample` or a single chat costs), in tokens per second of all rows; the ratio is fused / op by op, per
round, then the median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table  # noqa: E402

from nanogpt_cli.config import GPTConfig  # noqa: E402
from nanogpt_cli.inference.backends.quantize import quantize_model  # noqa: E402
from nanogpt_cli.inference.engine import Engine, SamplingParams  # noqa: E402
from nanogpt_cli.model import GPT  # noqa: E402

GPT2_SMALL = dict(n_layer=12, n_embd=768, n_head=12, block_size=1024)
MODELS = {
    "pythia-160m": dict(
        GPT2_SMALL,
        vocab_size=50304,
        norm="layernorm",
        mlp="gelu",
        bias=True,
        parallel_residual=True,
        rotary_dim=16,
        tie_embeddings=False,
    ),
    "gemma3-270m": dict(
        n_layer=18,
        n_embd=640,
        n_head=4,
        n_kv_head=1,
        head_dim=256,
        mlp_hidden=2048,
        vocab_size=262144,
        block_size=2048,
        norm="rmsnorm",
        norm_eps=1e-6,
        mlp="geglu",
        qk_norm=True,
        embed_scale=True,
        norm_offset=True,
        post_norms=True,
        sliding_window=512,
        window_pattern="LLLLLG",
        rope_theta=1e6,
        rope_local_theta=1e4,
    ),
    "gpt2-124m": dict(GPT2_SMALL, vocab_size=50257, pos_encoding="learned", bias=True, mlp="gelu_tanh"),
    "default-124m": dict(GPT2_SMALL, vocab_size=50304),
}


def build(name: str, precision: str) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODELS[name])).eval().cast(torch.bfloat16)
    return quantize_model(model, precision, 32) if precision != "bf16" else model


def measure(model: GPT, args) -> list[tuple[float, float]]:
    """(op by op, fused) tokens per second, every row's together, for each round, on one engine of --batch rows
    past their prompts."""
    engine = Engine(model, max_batch=args.batch)
    fused = engine.plan
    assert fused.fused is not None, "the fused step does not run here (our kernels?)"
    by_op = fused._replace(fused=None)
    prompts = torch.randint(0, 256, (args.batch, args.prompt)).tolist()
    engine.add_many(prompts, SamplingParams(temperature=0.0), 4 + 2 * args.rounds * args.tokens)
    with torch.inference_mode():
        for _ in range(4):  # the prefill and warm steps
            engine.step()
        rounds = []
        for _ in range(args.rounds):
            speeds = []
            for plan in (by_op, fused):
                engine.plan = plan
                t0 = time.perf_counter()
                for _ in range(args.tokens):
                    engine.step()
                speeds.append(args.batch * args.tokens / (time.perf_counter() - t0))
            rounds.append(tuple(speeds))
    return rounds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--precisions", nargs="+", choices=["bf16", "int8", "int4"], default=["bf16", "int8", "int4"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=1, help="rows decoded together")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt", type=int, default=128, help="tokens held before the timed steps")
    p.add_argument("--tokens", type=int, default=32, help="decode steps timed per round and side")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    rows = []
    for name in args.models:
        for precision in args.precisions:
            rounds = measure(build(name, precision), args)
            print(name, precision, [f"{a:.1f} / {b:.1f}" for a, b in rounds], flush=True)
            before, after = (statistics.median(r[i] for r in rounds) for i in (0, 1))
            ratio = statistics.median(b / a for a, b in rounds)
            rows.append([name, precision, f"{before:.1f}", f"{after:.1f}", f"{ratio:.2f}x"])
    load_after = " ".join(f"{x:.1f}" for x in os.getloadavg())
    table(
        f"batch-{args.batch} decode, tokens/s, op by op / fused step, {args.threads} thread(s), after "
        f"{args.prompt}-token prompts, {args.tokens} steps a side, medians of {args.rounds} alternating rounds, "
        f"load average {load_before} before, {load_after} after; ratio: fused / op by op per round",
        ["model shape", "weights", "op by op tok/s", "fused tok/s", "ratio"],
        rows,
    )


if __name__ == "__main__":
    main()
