"""Grouped-query attention: the KV cache's bytes per token and `nanogpt serve`'s tokens/s at 16 clients for
n_kv_head = n_head against n_head / 4 on the same width; and, with --baseline, the cpu-fast training step and the
engine's decode step (batch 1 and 5) of this checkout against another, alternating, in fresh processes.

    python benchmarks/bench_gqa.py                                   # cache bytes and serve tokens/s
    python benchmarks/bench_gqa.py --baseline /work/main --rounds 5  # plus the step times, side by side
    python benchmarks/bench_gqa.py --skip-serve --baseline ../main   # the step times only

The served model is bench_serve.py's 4 x 128 Llama-shaped GPT (gpt2 vocabulary, random weights), with 4 key/value
heads or 1. Step times are the best of each round's median, per checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import ROOT, load, start  # noqa: E402
from common import table  # noqa: E402

# one checkout's step times, run with PYTHONPATH at that checkout: JSON {name: ms}
STEP_WORKER = r"""
import json, statistics, sys, time, torch
from nanogpt_cli.config import GPTConfig, preset_values, split_values
from nanogpt_cli.inference.engine import KVCache, decode_plan, decode_step
from nanogpt_cli.model import GPT
torch.set_num_threads(int(sys.argv[1]))
torch.manual_seed(0)
def median_ms(fn, n, warm=3):
    for _ in range(warm):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter(); fn(); times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000
out = {}
model_kw, train_kw = split_values(preset_values("cpu-fast"))
model = GPT(GPTConfig(vocab_size=65, **model_kw))
x = torch.randint(0, 65, (train_kw["batch_size"], model.config.block_size))
def train_step():
    _, loss = model(x, x)
    loss.backward()
out["cpu-fast train step (fwd+bwd)"] = median_ms(train_step, 10)
for name, cfg in (("default 6x384", GPTConfig(vocab_size=65)), ("cpu-fast 3x128", model.config)):
    m = GPT(cfg).eval()
    plan = decode_plan(m)
    for batch in (1, 5):
        with torch.inference_mode():
            cache = KVCache(m, batch)
            tok = torch.zeros(batch, dtype=torch.long)
            def step():
                if cache.pos[0] >= cfg.block_size - 1:
                    cache.pos[:] = [0] * batch
                decode_step(plan, tok, cache)
            out[f"{name} decode step, batch {batch}"] = median_ms(step, 200, warm=20)
print(json.dumps(out))
"""


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


def steps(args) -> None:
    roots = {"baseline": Path(args.baseline).resolve(), "this checkout": ROOT}
    best: dict[str, dict[str, float]] = {name: {} for name in roots}
    for r in range(args.rounds):
        for name, root in roots.items() if r % 2 == 0 else reversed(list(roots.items())):
            env = {**os.environ, "PYTHONPATH": str(root)}
            out = subprocess.run(
                [sys.executable, "-c", STEP_WORKER, str(args.threads)], env=env, capture_output=True, text=True
            )
            if out.returncode != 0:
                raise SystemExit(f"{name}: {out.stderr[-2000:]}")
            for key, ms in json.loads(out.stdout).items():
                best[name][key] = min(ms, best[name].get(key, float("inf")))
            print(name, json.dumps(best[name]), flush=True)
    rows = [
        [key, f"{best['baseline'][key]:.3f}", f"{best['this checkout'][key]:.3f}",
         f"{best['this checkout'][key] / best['baseline'][key]:.3f}"]
        for key in best["baseline"]
    ]  # fmt: skip
    table(
        f"ms per step, best of {args.rounds} alternating rounds' medians ({args.threads} threads)",
        ["step", f"baseline ({args.baseline})", "this checkout", "after / before"],
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
    p.add_argument("--baseline", default=None, help="another checkout: step times of both, side by side")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    cache_and_serve(args)
    if args.baseline:
        steps(args)


if __name__ == "__main__":
    main()
