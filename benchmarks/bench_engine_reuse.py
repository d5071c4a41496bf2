"""Engines built in a row on one model, as `nanogpt chat` builds one per reply: each engine's time (its build, a
prompt's prefill and a few greedy tokens) and the peak RSS over the model's, on SmolLM2-135M's shape in bf16
(random weights), one thread. The decode plan's packed copies are built by the first engine only.

    python benchmarks/bench_engine_reuse.py --engines 5 --tokens 8
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu_inference import MODELS  # noqa: E402


def status_mb(field: str) -> float:
    """A /proc/self/status memory field (VmRSS, VmHWM) in MiB."""
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=list(MODELS), default="smollm2-135m")
    p.add_argument("--engines", type=int, default=5)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()

    import torch

    from nanogpt_cli.config import GPTConfig
    from nanogpt_cli.inference.engine import Engine, SamplingParams
    from nanogpt_cli.model import GPT

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = GPTConfig(**MODELS[args.model], norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=True)
    model = GPT(cfg).to(torch.bfloat16).eval()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM from here: the engines' peak, not the float32 model built above
    base = status_mb("VmRSS")
    prompt = list(range(100, 100 + args.prompt))
    times = []
    for _ in range(args.engines):
        t0 = time.perf_counter()
        with torch.inference_mode():
            engine = Engine(model, max_batch=1)
            engine.add(prompt, SamplingParams(temperature=0.0), args.tokens)
            for _ in engine.run():
                pass
            del engine  # let go before the next is built, as a reply's engine is
        times.append(time.perf_counter() - t0)
    later = times[1:] or times
    print("seconds per engine:", " ".join(f"{t:.3f}" for t in times))
    print(f"first {times[0]:.3f} s, later ones {sum(later) / len(later):.3f} s on average, all {sum(times):.2f} s")
    peak = status_mb("VmHWM") - base
    gc.collect()
    held = status_mb("VmRSS") - base  # what stays once the engines are gone: the model's cached decode plan
    print(f"RSS with the model {base:,.0f} MiB; peak over it while the engines ran {peak:,.0f} MiB, after {held:,.0f}")


if __name__ == "__main__":
    main()
