"""Grouped-query attention: the KV cache's bytes per token and `nanogpt serve`'s tokens/s at 16 clients for
n_kv_head = n_head against n_head / 4 on the same width, and the training step of each.

    python benchmarks/bench_gqa.py                       # cache bytes, serve tokens/s, training step
    python benchmarks/bench_gqa.py --skip-serve          # cache bytes and the training step only

The served model is bench_serve.py's 4 x 128 Llama-shaped GPT (gpt2 vocabulary, random weights), with 4 key/value
heads or 1; its `nanogpt serve` runs with bench_serve.py's helpers (16 slots, streamed completions). The training
step is cpu-fast's model (3 x 128, 4 heads, QK-norm) with 4 or 1 key/value heads, forward and backward at batch
16 x 128, alternated in one process: 4 heads take the fused NormRopeQKV kernel, grouped heads the general path.
(bench_forward.py compares the training and decode steps against another copy of the code.)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import load, start  # noqa: E402
from common import table  # noqa: E402


def cache_and_serve(args) -> None:
    import torch

    from nanogpt_cli.config import GPTConfig
    from nanogpt_cli.inference.engine import Engine
    from nanogpt_cli.model import GPT
    from nanogpt_cli.runs import checkpoint as ckpt
    from nanogpt_cli.tokenizer import build_tokenizer

    tok = build_tokenizer("gpt2")
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for kv in (4, 1):
            torch.manual_seed(0)
            cfg = GPTConfig(
                vocab_size=tok.vocab_size,
                block_size=args.ctx,
                n_layer=4,
                n_head=4,
                n_kv_head=kv,
                n_embd=128,
                norm="rmsnorm",
                mlp="swiglu",
            )
            model = GPT(cfg).eval()
            weights = Path(tmp) / f"kv{kv}.safetensors"
            ckpt.save_model(weights, model, {"tokenizer": tok.describe(), "step": 0})
            per_token = Engine(model, max_batch=1).cache_bytes_per_token
            tok_s = None
            if not args.skip_serve:
                runs = []
                for _ in range(args.serve_rounds):
                    proc, url = start("nanogpt", weights, weights, 16, args.ctx, args.threads)
                    try:
                        load(url, 4, 8, 8)  # warm-up
                        runs.append(load(url, 16, args.requests, args.max_tokens, proc.pid)["tok_s"])
                    finally:
                        proc.kill()
                        proc.wait()
                tok_s = max(runs)
            results[kv] = (per_token, tok_s, model.num_params())
    full, grouped = results[4], results[1]
    for kv, (per_token, tok_s, params) in results.items():
        cache_mb = per_token * 16 * args.ctx / 2**20
        rows.append(
            [
                f"4 heads, {kv} key/value",
                f"{params:,}",
                f"{per_token:,}",
                f"{cache_mb:.1f}",
                "-" if tok_s is None else f"{tok_s:.0f}",
            ]
        )
    ratio = "-" if full[1] is None else f"{grouped[1] / full[1]:.2f}x"
    rows.append(["ratio (n_head / 4 over n_head)", "", f"{grouped[0] / full[0]:.2f}x", "", ratio])
    table(
        f"4 x 128 Llama-shaped model, float32, serve at 16 clients ({args.requests} requests x {args.max_tokens} "
        f"tokens, best of {args.serve_rounds}, {args.threads} threads)",
        ["attention", "non-embedding params", "KV cache B/token", f"cache MB at 16 x {args.ctx}", "serve tokens/s"],
        rows,
    )


def train_steps(args) -> None:
    import statistics
    import time

    import torch

    from nanogpt_cli.config import GPTConfig, preset_values, split_values
    from nanogpt_cli.model import GPT

    torch.set_num_threads(args.threads)
    model_kw, _ = split_values(preset_values("cpu-fast"))
    models = {}
    for kv in (4, 1):
        torch.manual_seed(0)
        models[kv] = GPT(GPTConfig(vocab_size=65, **model_kw, n_kv_head=kv))
    x = torch.randint(0, 65, (16, 128))
    times: dict[int, list[float]] = {kv: [] for kv in models}

    def step(model):
        _, loss = model(x, x)
        loss.backward()

    for model in models.values():
        step(model)
    for _ in range(args.rounds):
        for kv, model in models.items():
            t0 = time.perf_counter()
            for _ in range(3):
                step(model)
            times[kv].append((time.perf_counter() - t0) / 3 * 1000)
    ms = {kv: statistics.median(t) for kv, t in times.items()}
    rows = [[f"4 heads, {kv} key/value", f"{models[kv].num_params():,}", f"{ms[kv]:.1f}"] for kv in models]
    rows.append(["ratio", "", f"{ms[1] / ms[4]:.2f}x"])
    table(
        f"cpu-fast model, forward + backward at 16 x 128, median of {args.rounds} rounds ({args.threads} threads)",
        ["attention", "non-embedding params", "ms per step"],
        rows,
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--serve-rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip-serve", action="store_true")
    p.add_argument("--rounds", type=int, default=10, help="training-step rounds")
    args = p.parse_args()
    cache_and_serve(args)
    train_steps(args)


if __name__ == "__main__":
    main()
