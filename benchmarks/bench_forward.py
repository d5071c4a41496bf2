"""Two copies of the code side by side in one process: the `cpu-fast` training step and the engine's decode step,
alternated in short chunks (the machine's drift hits both alike; compare the ratios).

    git archive main nanogpt_cli | tar -x -C /tmp/before                 # the code to compare against
    python benchmarks/bench_forward.py --before /tmp/before              # this checkout against it
    python benchmarks/bench_forward.py --before /tmp/before --rounds 30 --threads 2

The copy in --before is imported as a package of another name (`nanogpt_before`, its imports rewritten, in a
temporary folder), so both run in this process. Training: `--preset cpu-fast`'s model and optimizer (Muon), batch
16 x 128, `--dtype auto`: forward, backward, clipping and the update. Decoding: decode_step after a 4-token prompt
at batch 1 and 5 on bench_decode.py's two shapes, and at batch 5 with rows at different positions (prompts of 4 to
12 tokens, as a server's rows are). Each time is the median over rounds of one chunk's ms per step, wall and CPU;
each ratio is the median of the rounds' ratios (the two chunks of a round ran seconds apart).

    python benchmarks/bench_forward.py --kernels                         # each kernel against the path without it

--kernels measures this checkout only: the training step with NormRopeQKV and with the norms and RoPE as separate
ops; the decode step through the decoding form (backends/decode.py) and through the modules; the forward that keeps
the attention probabilities (the explicit kernel) against the usual one.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table  # noqa: E402

SHAPES = {
    "4x128": dict(n_layer=4, n_head=4, n_embd=128, block_size=64),
    "6x384": dict(n_layer=6, n_head=6, n_embd=384, block_size=256),
}
CASES = [("4x128", 1, False), ("4x128", 5, False), ("4x128", 5, True), ("6x384", 1, False), ("6x384", 5, False)]


def import_copy(tree: Path, tmp: Path) -> str:
    """The nanogpt_cli in tree, importable as nanogpt_before: copied into tmp with its imports rewritten."""
    dst = tmp / "nanogpt_before"
    shutil.copytree(tree / "nanogpt_cli", dst, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    for path in dst.rglob("*.py"):
        path.write_text(path.read_text().replace("nanogpt_cli", "nanogpt_before"))
    if (tree / "nanogpt_cli" / "assets").is_dir():
        (dst / "assets").symlink_to(tree / "nanogpt_cli" / "assets")
    sys.path.insert(0, str(tmp))
    return "nanogpt_before"


def timed(fn, repeats: int) -> tuple[float, float]:
    """The best of `repeats` calls of fn (which returns how many steps it ran): (wall ms, CPU ms) per step."""
    best = (float("inf"), float("inf"))
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        n = fn()
        best = min(best, ((time.perf_counter() - w0) / n * 1000, (time.process_time() - c0) / n * 1000))
    return best


def train_steps(pkg: str, steps: int):
    """A function that runs `steps` cpu-fast training steps of package pkg's code and returns steps."""
    import torch

    config = importlib.import_module(f"{pkg}.config")
    autocast_for = importlib.import_module(f"{pkg}.device").autocast_for
    dtype = importlib.import_module(f"{pkg}.device").resolve_dtype("auto", torch.device("cpu"))
    GPT = importlib.import_module(f"{pkg}.model").GPT
    make_optimizer = importlib.import_module(f"{pkg}.training.optim").make_optimizer
    model_kw, train_kw = config.split_values(config.preset_values("cpu-fast"))
    torch.manual_seed(0)
    model = GPT(config.GPTConfig(vocab_size=65, **model_kw))
    cfg = config.TrainConfig(**train_kw)
    optimizer = make_optimizer(model, cfg, torch.device("cpu"))
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

    return run


def decode_steps(pkg: str, shape: str, batch: int, staggered: bool, tokens: int):
    """A function that prefills `batch` prompts and times `tokens` decode steps of package pkg's engine."""
    import torch

    config = importlib.import_module(f"{pkg}.config")
    engine = importlib.import_module(f"{pkg}.inference.engine")
    try:  # the decode step's plan lives with the cpu backend; a checkout from before it, in the engine
        cpu = importlib.import_module(f"{pkg}.inference.backends.cpu")
    except ModuleNotFoundError:
        cpu = engine
    GPT = importlib.import_module(f"{pkg}.model").GPT
    torch.manual_seed(0)
    cfg = config.GPTConfig(vocab_size=65, **SHAPES[shape])
    model = GPT(cfg).eval()
    lengths = [4 + 2 * r if staggered else 4 for r in range(batch)]
    n = min(tokens, cfg.block_size - max(lengths))
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size))
    with torch.inference_mode():
        plan = cpu.decode_plan(model)

    @torch.inference_mode()
    def run() -> tuple[float, float]:
        cache = engine.KVCache(model, batch)
        for r, length in enumerate(lengths):
            model(ids[r : r + 1, :length], cache=cache.view(r, r + 1))
        w0, c0 = time.perf_counter(), time.process_time()
        for t in range(n):
            cpu.decode_step(plan, ids[:, t], cache, batch)
        return (time.perf_counter() - w0) / n * 1000, (time.process_time() - c0) / n * 1000

    return run


def timed_steps(run) -> tuple[float, float]:
    w0, c0 = time.perf_counter(), time.process_time()
    n = run()
    return (time.perf_counter() - w0) / n * 1000, (time.process_time() - c0) / n * 1000


def alternate(runs: dict, rounds: int, timer) -> dict:
    """Each run's median (wall, CPU) ms per step, called in turn with the order swapped every round, and the median
    over rounds of the ratio of the second run to the first within the round (the pair ran seconds apart, so
    this ratio drifts less than the ratio of the medians)."""
    for run in runs.values():
        timer(run)  # warm-up: the allocator, Muon's buffers, first calls
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            got[name].append(timer(runs[name]))
    out = {name: tuple(statistics.median(t[i] for t in v) for i in (0, 1)) for name, v in got.items()}
    first, second = got[names[0]], got[names[1]]
    out["ratio"] = tuple(statistics.median(b[i] / a[i] for a, b in zip(first, second)) for i in (0, 1))
    return out


def unfused_training(run_steps, pkg: str):
    """The same training steps with QK-norm and RoPE as separate ops: each q_norm handed to attention as a plain
    function, which the fused kernel's choice (an nn.RMSNorm) passes over."""
    blocks = importlib.import_module(f"{pkg}.model.blocks")
    plain = blocks.Block.ops

    def ops(self):
        w = plain(self)
        q, k = w.attn.q_norm, w.attn.k_norm
        return w._replace(attn=w.attn._replace(q_norm=lambda x: q(x), k_norm=lambda x: k(x)))

    def run() -> int:
        blocks.Block.ops = ops
        try:
            return run_steps()
        finally:
            blocks.Block.ops = plain

    return run


def module_decoding(shape: str, batch: int, tokens: int):
    """decode_step's computation through the modules (GPT.hidden_states without a decoding form)."""
    import torch

    from nanogpt_cli.config import GPTConfig
    from nanogpt_cli.inference.backends.cpu import decode_plan, head_logits
    from nanogpt_cli.inference.engine import KVCache
    from nanogpt_cli.model import GPT

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=65, **SHAPES[shape])
    model = GPT(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size))
    n = min(tokens, cfg.block_size - 4)
    with torch.inference_mode():
        plan = decode_plan(model)

    def runner(ops):
        @torch.inference_mode()
        def run() -> tuple[float, float]:
            cache = KVCache(model, batch)
            model(ids[:, :4], cache=cache.view(0, batch))
            w0, c0 = time.perf_counter(), time.process_time()
            for t in range(n):
                h = model.hidden_states(ids[:, t : t + 1], cache.view(0, batch), ops=ops)
                head_logits(plan, h.view(batch, -1))
            return (time.perf_counter() - w0) / n * 1000, (time.process_time() - c0) / n * 1000

        return run

    return {"with": runner(plan.ops), "without": runner(None)}


def probs_forward(keep: bool):
    """A forward of 8 x 64 tokens on the 4 x 128 model, keeping the attention probabilities or not."""
    import torch

    from nanogpt_cli.config import GPTConfig
    from nanogpt_cli.model import GPT

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, **SHAPES["4x128"])).eval()
    idx = torch.randint(0, 65, (8, 64))

    @torch.no_grad()
    def run() -> int:
        for _ in range(5):
            model(idx, probs=[] if keep else None)
        return 5

    return run


def kernels(args) -> list[list[str]]:
    """Each kept kernel's step against the same step without it, in this checkout: (label, with, without, ratio)."""
    cases = [
        ("cpu-fast training step: NormRopeQKV / norms and RoPE as ops", lambda: {
            "with": train_steps("nanogpt_cli", args.steps),
            "without": unfused_training(train_steps("nanogpt_cli", args.steps), "nanogpt_cli"),
        }, timed_steps),
        ("forward 8 x 64, 4x128: explicit kernel, probabilities kept / SDPA", lambda: {
            "with": probs_forward(True), "without": probs_forward(False),
        }, timed_steps),
    ]  # fmt: skip
    for shape, batch in (("4x128", 1), ("4x128", 5), ("6x384", 1), ("6x384", 5)):
        label = f"decode step, {shape}, batch {batch}: decoding form / modules"
        cases.append((label, lambda s=shape, b=batch: module_decoding(s, b, args.tokens), lambda run: run()))
    rows = []
    for label, make, timer in cases:
        runs = make()
        med = alternate({"without": runs["without"], "with": runs["with"]}, args.rounds, timer)  # ratio: with / without
        w, wo, r = med["with"], med["without"], med["ratio"]
        rows.append([label, *(f"{x:.3f}" for x in (w[0], wo[0], r[0], w[1], wo[1], r[1]))])
        print(" | ".join(rows[-1]), flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, help="a folder holding the nanogpt_cli to compare against")
    p.add_argument("--kernels", action="store_true", help="each kernel against the path without it, this checkout")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=5, help="training steps per chunk")
    p.add_argument("--tokens", type=int, default=60, help="decode steps per chunk")
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    if args.kernels:
        return table(
            f"{args.rounds} alternating rounds in one process, {args.threads} thread(s), load average {load[0]:.1f}",
            ["step: with / without", "with ms", "without ms", "ratio", "with CPU ms", "without CPU ms", "ratio (CPU)"],
            kernels(args),
        )
    if args.before is None:
        p.error("--before or --kernels is required")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        pkgs = {"before": import_copy(args.before.resolve(), Path(tmp)), "after": "nanogpt_cli"}
        cases = [("cpu-fast training step", lambda pkg: train_steps(pkg, args.steps), timed_steps)]
        for shape, batch, staggered in CASES:
            where = ", rows at different positions" if staggered else ""
            make = lambda pkg, c=(shape, batch, staggered): decode_steps(pkg, *c, args.tokens)  # noqa: E731
            cases.append((f"decode step, {shape}, batch {batch}{where}", make, lambda run: run()))
        for label, make, timer in cases:
            med = alternate({name: make(pkg) for name, pkg in pkgs.items()}, args.rounds, timer)
            b, a, r = med["before"], med["after"], med["ratio"]
            rows.append([label, *(f"{x:.3f}" for x in (b[0], a[0], r[0], b[1], a[1], r[1]))])
            print(" | ".join(rows[-1]), flush=True)
    load = os.getloadavg()
    table(
        f"{args.rounds} alternating rounds in one process, {args.threads} thread(s), load average {load[0]:.1f}",
        ["step", "before ms", "after ms", "after / before", "before CPU ms", "after CPU ms", "after / before (CPU)"],
        rows,
    )


if __name__ == "__main__":
    main()
