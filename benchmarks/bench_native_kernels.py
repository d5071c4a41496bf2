"""Our decode kernels (backends/native.py) against torch's own, product by product: one pass over every
matrix of a model's blocks and its head, as a decode step makes them, at batch 1 and 8. Random weights in
SmolLM2-135M's or Qwen2.5-0.5B's shape, each matrix its own tensor (a pass streams them from memory, as a real
step does). torch's side: oneDNN's packed bf16 product, aten._weight_int8pack_mm and
aten._weight_int4pack_mm_for_cpu, each with its own packed copy. Medians of alternating passes. At 1 thread the
clock is the thread's CPU time (time.thread_time: every product runs in the calling thread), which the waits of a
loaded machine do not inflate; at more, the wall clock.

    python benchmarks/bench_native_kernels.py --model smollm2-135m --threads 1
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

SHAPES = {  # n_embd, MLP hidden, layers, vocabulary, q/k/v width
    "smollm2-135m": (576, 1536, 30, 49152, 960),
    "qwen2.5-0.5b": (896, 4864, 24, 151936, 1152),
}


def products(kind: str, shapes: list[tuple[int, int]]):
    """(ours, theirs): for each (K, N), a function of x (B, K) bf16."""
    from nanogpt_cli.inference.backends import native
    from nanogpt_cli.inference.backends.decode import packed_form
    from nanogpt_cli.inference.backends.quantize import quantize_linear

    ours, theirs = [], []
    for K, N in shapes:
        layer = torch.nn.Linear(K, N, bias=False)
        torch.nn.init.normal_(layer.weight, std=0.02)
        if kind == "bfloat16":
            w = layer.weight.detach().bfloat16()
            packed = packed_form(w)
            ours.append(native.pack(w))
            theirs.append(lambda x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""))
            continue
        with torch.no_grad():
            layer.to(torch.bfloat16)
        mine = quantize_linear(layer, kind, 32)
        ours.append(mine.kernel())
        native_library = native.library
        native.library = lambda: (None, "off")  # torch's layout for the other side
        try:
            torch_side = quantize_linear(layer, kind, 32)
        finally:
            native.library = native_library
        theirs.append(torch_side.kernel())
    return ours, theirs


def main() -> None:
    from nanogpt_cli.inference.backends import native

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=list(SHAPES), default="smollm2-135m")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if not native.available():
        raise SystemExit(f"our kernels do not run here: {native.status()}")
    torch.set_num_threads(args.threads)
    C, H, L, V, qkv = SHAPES[args.model]
    shapes = [(C, qkv), (C, C), (C, 2 * H), (H, C)] * L + [(C, V)]
    rows = []
    for kind in ("bfloat16", "int8", "int4"):
        ours, theirs = products(kind, shapes)
        for B in (1, 8):
            xs = {K: torch.randn(B, K).bfloat16() for K in (C, H)}

            clock = time.thread_time if args.threads == 1 else time.perf_counter

            def run(fns, xs=xs, clock=clock):
                t0 = clock()
                for (K, _), f in zip(shapes, fns):
                    f(xs[K])
                return (clock() - t0) * 1000

            run(ours), run(theirs)
            times = [(run(ours), run(theirs)) for _ in range(args.rounds)]
            a, b = (statistics.median(t[i] for t in times) for i in (0, 1))
            rows.append([kind, B, f"{a:.2f}", f"{b:.2f}", f"{b / a:.2f}x"])
    table(
        f"{args.model}'s block matrices and head, one pass, {args.threads} thread(s), ours: {native.status()}",
        ["weights", "rows", "ours ms", "torch ms", "torch / ours"],
        rows,
    )


if __name__ == "__main__":
    main()
