"""The architecture settings' cost: the cpu-fast training step with each against the same step without, and the
decode step and KV cache of a sliding-window model against the full-context one, alternated in one process.

    python benchmarks/bench_arch.py                      # --rounds 10 --steps 3 --tokens 200
    python benchmarks/bench_arch.py --threads 2

Training: --preset cpu-fast's model (QK-norm, so the fused NormRopeQKV kernel where it applies) and Muon at batch
16 x 128, --dtype auto. Partial rotary and the sliding window keep the kernel (the window masks attention).
Decoding: the 6 x 384 shape at context 256, batch 1, 200 tokens after a 4-token prompt, every layer local with a
window of 64 against none.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_forward import alternate, timed_steps  # noqa: E402
from common import table  # noqa: E402


def train_steps(overrides: dict, steps: int):
    import torch

    from nanogpt_cli.config import GPTConfig, TrainConfig, preset_values, split_values
    from nanogpt_cli.device import autocast_for, resolve_dtype
    from nanogpt_cli.model import GPT
    from nanogpt_cli.training.optim import make_optimizer

    model_kw, train_kw = split_values(preset_values("cpu-fast"))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, **{**model_kw, **overrides}))
    cfg = TrainConfig(**train_kw)
    optimizer = make_optimizer(model, cfg, torch.device("cpu"))
    dtype = resolve_dtype("auto", torch.device("cpu"))
    x = torch.randint(0, 65, (cfg.batch_size, model.config.block_size))

    def run() -> int:
        for _ in range(steps):
            with autocast_for(torch.device("cpu"), dtype):
                _, loss = model(x, x)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return steps

    return run, model


def decode_run(window: int | None, tokens: int):
    import torch

    from nanogpt_cli.config import GPTConfig
    from nanogpt_cli.inference.backends.cpu import decode_plan, decode_step
    from nanogpt_cli.inference.engine import KVCache
    from nanogpt_cli.model import GPT

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=65, n_layer=6, n_head=6, n_embd=384, block_size=256, sliding_window=window)
    model = GPT(cfg).eval()
    ids = torch.randint(0, 65, (1, cfg.block_size))
    with torch.inference_mode():
        plan = decode_plan(model)

    @torch.inference_mode()
    def run() -> tuple[float, float]:
        cache = KVCache(model, 1)
        model(ids[:, :4], cache=cache.view(0, 1))
        w0, c0 = time.perf_counter(), time.process_time()
        for t in range(4, 4 + tokens):
            decode_step(plan, ids[:, t], cache)
        return (time.perf_counter() - w0) / tokens * 1000, (time.process_time() - c0) / tokens * 1000

    return run, KVCache(model, 1).bytes_per_token()


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base, model = train_steps({}, args.steps)
    hs = model.config.head_size
    settings = {
        f"--rotary-dim {hs // 4} (the fused kernel)": dict(rotary_dim=hs // 4),
        "--parallel-residual": dict(parallel_residual=True),
        "--sliding-window 32": dict(sliding_window=32),
        "Gemma set (--norm rmsnorm --norm-offset --post-norms --embed-scale --mlp geglu)": dict(
            norm="rmsnorm", norm_offset=True, post_norms=True, embed_scale=True, mlp="geglu"
        ),
    }
    rows = []
    for label, overrides in settings.items():
        got = alternate({"default": base, "with": train_steps(overrides, args.steps)[0]}, args.rounds, timed_steps)
        rows.append([f"cpu-fast training step, {label}", f"{got['default'][0]:.1f}", f"{got['with'][0]:.1f}",
                     f"{got['ratio'][0]:.3f}"])  # fmt: skip
    (full, full_bytes), (local, local_bytes) = decode_run(None, args.tokens), decode_run(64, args.tokens)
    got = alternate({"default": full, "with": local}, args.rounds, lambda run: run())
    rows.append(["decode step 6x384, batch 1, --sliding-window 64", f"{got['default'][0]:.3f}",
                 f"{got['with'][0]:.3f}", f"{got['ratio'][0]:.3f}"])  # fmt: skip
    rows.append(["KV cache bytes per token, --sliding-window 64", f"{full_bytes:,.0f}", f"{local_bytes:,.0f}",
                 f"{local_bytes / full_bytes:.3f}"])  # fmt: skip
    title = f"{args.rounds} alternating rounds, {args.threads} thread(s)"
    table(title, ["case", "without ms", "with ms", "with / without"], rows)


if __name__ == "__main__":
    main()
