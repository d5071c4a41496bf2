"""CPU inference of real-sized models: ours at float32, bf16, int8 and int4 (--quantize) against llama.cpp (PyPI's
xllamacpp, used only here) on our own GGUF exports at f16, q8_0 and q4_0, with the same threads, in alternating
rounds: prefill of 512 tokens, decode at batch 1 and 8, peak memory, at 1 and 2 threads. Random weights (speed does
not depend on them) in SmolLM2-135M's, Qwen2.5-0.5B's, Gemma-3-270M's and Pythia-160M's shapes.

    python benchmarks/bench_cpu_inference.py --models smollm2-135m --rounds 3 --threads 1 2
    python benchmarks/bench_cpu_inference.py --profile --models qwen2.5-0.5b   # where a decode step's time goes
    python benchmarks/bench_cpu_inference.py --quality        # perplexity and greedy agreement of a trained model
    python benchmarks/bench_cpu_inference.py --memory --models smollm2-135m   # peak RSS of a load

Each of our runs is a fresh process (its peak RSS is the model's alone: VmHWM from /proc, as Linux carries
getrusage's ru_maxrss over from the parent); llama.cpp runs as its own server, one per file, whose peak RSS is read
from /proc too, with slots of the model's whole context, so that its KV cache holds as many tokens as our 8 rows.
The ratio column is ours / llama.cpp in tokens per second, per round, then the median: rounds alternate the two so
that the load other jobs put on a shared machine hits both alike.

Every decode figure is also given as its memory-bandwidth utilisation (MBU): the bytes a step reads (each side's
weights in the form its step reads them, the head included, and the KV cache of every row up to its position) /
the step's time / the bandwidth a STREAM-like probe reads at the same thread count (the best of 5 sums of a 1 GiB
float32 buffer, far larger than the caches, in a fresh process, measured before and after each table).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import start  # noqa: E402
from common import table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# the real models' shapes, grouped-query attention and Qwen2.5's q/k/v biases included (random weights)
MODELS = {
    "smollm2-135m": dict(
        n_layer=30,
        n_embd=576,
        n_head=9,
        n_kv_head=3,
        mlp_hidden=1536,
        vocab_size=49152,
        rope_theta=100000.0,
        block_size=2048,
    ),
    "qwen2.5-0.5b": dict(
        n_layer=24,
        n_embd=896,
        n_head=14,
        n_kv_head=2,
        qkv_bias=True,
        mlp_hidden=4864,
        vocab_size=151936,
        rope_theta=1e6,
        block_size=2048,
    ),
    # Gemma 3 270M: five sliding-window layers to one global, QK-norm, post-norms, tanh-GELU gate, a 262k vocabulary
    "gemma-3-270m": dict(
        n_layer=18,
        n_embd=640,
        n_head=4,
        n_kv_head=1,
        head_dim=256,
        mlp_hidden=2048,
        vocab_size=262144,
        rope_theta=1e6,
        rope_local_theta=1e4,
        sliding_window=512,
        window_pattern="LLLLLG",
        mlp="geglu",
        qk_norm=True,
        embed_scale=True,
        norm_offset=True,
        post_norms=True,
        block_size=2048,
    ),
    # Pythia-160M (GPT-NeoX): the parallel residual, RoPE on a quarter of each head, LayerNorm and biases; GELU's
    # tanh form, the one llama.cpp computes (the same cost as the exact one)
    "pythia-160m": dict(
        n_layer=12,
        n_embd=768,
        n_head=12,
        vocab_size=50304,
        rotary_dim=16,
        parallel_residual=True,
        norm="layernorm",
        mlp="gelu_tanh",
        bias=True,
        tie_embeddings=False,
        block_size=2048,
    ),
}
PAIRS = [("bfloat16", "f16"), ("int8", "q8_0"), ("int4", "q4_0"), ("float32", None)]


def make_model(folder: Path, name: str, quants: list[str]) -> tuple[Path, dict[str, Path]]:
    import torch

    from nanogpt_cli.config import GPTConfig
    from nanogpt_cli.interop.export import export
    from nanogpt_cli.model import GPT
    from nanogpt_cli.runs import checkpoint as ckpt
    from nanogpt_cli.tokenizer import build_tokenizer

    torch.manual_seed(0)
    tok = build_tokenizer("byte")  # the vocabulary is padded to the model's: speed does not depend on the tokenizer
    cfg = GPTConfig(**{"norm": "rmsnorm", "mlp": "swiglu", "bias": False, "tie_embeddings": True, **MODELS[name]})
    weights = folder / f"{name}.safetensors"
    ckpt.save_model(weights, GPT(cfg), {"tokenizer": tok.describe(), "step": 0})
    ggufs = {}
    for q in quants:
        ggufs[q] = folder / f"{name}-{q}.gguf"
        export(weights, "gguf", ggufs[q], force=True, quant=q)
    return weights, ggufs


OURS = """
import json, sys, time, torch
from nanogpt_cli.interop.loading import load_for_inference
from nanogpt_cli.inference.backends.cpu import decode_plan
from nanogpt_cli.inference.backends.quantize import QuantizedLinear
from nanogpt_cli.inference.engine import Engine, SamplingParams
path, precision = sys.argv[1], sys.argv[2]
threads, prompt, tokens = (int(a) for a in sys.argv[3:6])
torch.set_num_threads(threads)
quant = precision if precision.startswith("int") else None
dtype = "float32" if precision == "float32" else "bfloat16"
m = load_for_inference(path, device="cpu", dtype=dtype, quantize=quant)
out = {}
with torch.inference_mode():
    ids = torch.randint(0, 256, (prompt,)).tolist()
    engine = Engine(m.model, max_batch=1)
    engine.add(ids[:16], SamplingParams(temperature=0.0), 1)  # warm up
    list(engine.run())
    t0 = time.perf_counter()
    engine.add(ids, SamplingParams(temperature=0.0), 1)
    out["prefill_ms"] = (time.perf_counter() - t0) * 1000
    list(engine.run())
    for batch in (1, 8):
        engine = None  # the last engine's cache freed first: the peak holds one cache, as llama.cpp's server does
        engine = Engine(m.model, max_batch=batch)  # the full head, as llama.cpp computes it
        engine.add_many([ids[:8]] * batch, SamplingParams(temperature=0.0), tokens + 4)
        for _ in range(4):
            engine.step()
        t0 = time.perf_counter()
        for _ in range(tokens):
            engine.step()
        out[f"decode{batch}_ms"] = (time.perf_counter() - t0) / tokens * 1000
# VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so a child would report its parent's peak
status = open("/proc/self/status").read()
out["peak_mb"] = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM")) / 1024
# the bytes a decode step reads: the blocks' projections in the form the step multiplies (a QuantizedLinear's values,
# scales and zeros; a float weight's own bytes) and the head's decoding form; norms' gains are a rounding error
plan, nbytes = decode_plan(m.model), lambda ts: sum(t.numel() * t.element_size() for t in ts if t is not None)
mats = [x for x in m.model.transformer.h.modules() if isinstance(x, (torch.nn.Linear, QuantizedLinear))]
mats += [plan.head_q] if plan.head_q is not None else []
read = lambda x: [t for n, t in [*x.named_parameters(), *x.named_buffers()] if n != "nibbles"]  # nibbles: prefill's
out["weight_bytes"] = sum(nbytes(read(x)) for x in mats) + (0 if plan.head_q is not None else nbytes([plan.head]))
c = m.model.config
out["kv_bytes"] = 2 * c.n_layer * c.kv_heads * c.head_size * m.model.transformer.wte.weight.element_size()
print(json.dumps(out))
"""

PROBE = """
import json, sys, time, torch
buf = torch.ones(2**28)  # 1 GiB of float32: 32x the L3 cache
out = {}
for threads in map(int, sys.argv[1:]):
    torch.set_num_threads(threads)
    buf.sum()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    out[threads] = buf.numel() * 4 / best / 1e9
print(json.dumps(out))
"""


def probe(threads: list[int]) -> dict[int, float]:
    """GB/s read by a STREAM-like sum of a 1 GiB buffer at each thread count, in a fresh process."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *map(str, threads)], capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        raise SystemExit(f"the bandwidth probe failed:\n{done.stderr[-2000:]}")
    return {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def ours(weights: Path, precision: str, threads: int, args, root: Path = ROOT) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-c", OURS, str(weights), precision, str(threads), str(args.prompt), str(args.tokens)]
    # run in root: `python -c` puts the working folder first on the path, ahead of PYTHONPATH, so that from another
    # checkout --against would time this one's package twice
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=root)
    if done.returncode != 0:
        raise SystemExit(f"ours at {precision} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def ask(url: str, body: dict) -> dict:
    import http.client

    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    conn.request("POST", "/completion", body=json.dumps(body), headers={"Content-Type": "application/json"})
    reply = json.loads(conn.getresponse().read())
    conn.close()
    return reply["timings"]


def one_row(url: str, body: dict, per_token: list[float]) -> None:
    per_token.append(ask(url, body)["predicted_per_token_ms"])


def theirs(url: str, pid: int, args) -> dict:
    """llama.cpp's own timings: the prompt's ms for a 512-token prefill (no prompt cache), and each row's ms per
    generated token of 1 and 8 concurrent greedy requests (the median row)."""
    import random
    import threading

    ids = [random.randrange(256) for _ in range(args.prompt)]
    out = {"prefill_ms": ask(url, {"prompt": ids, "n_predict": 1, "cache_prompt": False})["prompt_ms"]}
    for batch in (1, 8):
        per_token: list[float] = []
        body = {
            "prompt": ids[:8],
            "n_predict": args.tokens,
            "temperature": 0,
            "ignore_eos": True,
            "cache_prompt": False,
        }
        threads = [threading.Thread(target=one_row, args=(url, body, per_token)) for _ in range(batch)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        out[f"decode{batch}_ms"] = statistics.median(per_token)
    status = Path(f"/proc/{pid}/status").read_text()
    out["peak_mb"] = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM")) / 1024
    return out


def speed(args) -> None:
    for name in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            pairs = [(o, t) for o, t in PAIRS if o in args.ours]
            weights, ggufs = make_model(Path(tmp), name, [t for _, t in pairs if t])
            for threads in args.threads:
                load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
                bw_before = probe([threads])[threads]
                rows = [
                    one_precision(name, weights, ggufs, precision, quant, threads, args) for precision, quant in pairs
                ]
                bw_after = probe([threads])[threads]
                bandwidth = (bw_before + bw_after) / 2
                load_after = " ".join(f"{x:.1f}" for x in os.getloadavg())
                table(
                    f"{name} shape (random weights), {threads} thread(s), prefill {args.prompt} tokens, decode "
                    f"{args.tokens} tokens per row, medians of {args.rounds} alternating rounds, load average "
                    f"{load_before} before, {load_after} after; probe {bw_before:.1f} GB/s before, {bw_after:.1f} "
                    f"after (MBU against their mean); the default's thread count on a quiet machine: {quiet_default()}",
                    HEADER,
                    [row(precision, quant, rounds, bandwidth, args) for precision, quant, rounds in rows],
                )


HEADER = ["ours", "llama.cpp", "prefill ms", "ratio", "decode b1 ms", "ratio", "MBU b1", "decode b8 ms/step"]
HEADER += ["ratio", "MBU b8", "peak MB"]


def one_precision(name: str, weights: Path, ggufs: dict, precision: str, quant: str | None, threads: int, args):
    """(precision, quant, rounds): each round ours in a fresh process and llama.cpp's server on the matching GGUF,
    alternating."""
    server = None
    if quant is not None:
        # XLLAMACPP_PATH: a `pip install --target` folder of xllamacpp, when it is not installed
        path = ":".join(filter(None, [str(ROOT), os.environ.get("XLLAMACPP_PATH")]))
        # each slot holds the model's whole context, as each row of our cache does (the same KV bytes)
        server = start("llama.cpp", weights, ggufs[quant], 8, MODELS[name]["block_size"], threads, root=path)
    try:
        if server:
            theirs(server[1], server[0].pid, args)  # warm up
        rounds = []
        for _ in range(args.rounds):
            t = theirs(server[1], server[0].pid, args) if server else None
            if t is not None:  # f16 keys and values, llama.cpp's default
                c = MODELS[name]
                hs = c.get("head_dim", c["n_embd"] // c["n_head"])
                t.update(
                    weight_bytes=gguf_step_bytes(ggufs[quant]),
                    kv_bytes=2 * c["n_layer"] * c.get("n_kv_head", c["n_head"]) * hs * 2,
                )
            rounds.append((ours(weights, precision, threads, args), t))
            print(name, threads, precision, quant, rounds[-1], flush=True)
    finally:
        if server:
            server[0].stdin.close()
            server[0].terminate()
            server[0].wait(30)
    return precision, quant, rounds


def gguf_step_bytes(path: Path) -> int:
    """The bytes of a GGUF's tensors that llama.cpp's decode step reads: all of them, but the token embedding where
    the file has an output matrix of its own (the embedding is then only looked up)."""
    from nanogpt_cli.interop.gguf_header import read_header

    tensors = {t.name: t.n_bytes for t in read_header(path).tensors}
    return sum(tensors.values()) - (tensors.get("token_embd.weight", 0) if "output.weight" in tensors else 0)


def quiet_default() -> int:
    """The threads `nanogpt` chooses on this machine when nothing else runs (device.choose_threads)."""
    from nanogpt_cli.device import TORCH_THREADS, choose_threads, cpu_cores

    cpus = cpu_cores()
    return choose_threads(cpus, max(1, min(TORCH_THREADS, cpus)), 0.0)


def mbu(side: dict, batch: int, keys: float, bandwidth: float) -> float:
    """The share of the probe's bandwidth (GB/s) one decode step at `batch` rows reads at: its weights once and each
    row's KV cache over `keys` positions, in the step's time."""
    step_bytes = side["weight_bytes"] + batch * keys * side["kv_bytes"]
    return step_bytes / (side[f"decode{batch}_ms"] / 1000) / (bandwidth * 1e9)


def against(args) -> None:
    """This checkout against another one (--against PATH: its package, e.g. the main branch's worktree) on the same
    weights, in alternating rounds: prefill and decode at batch 1 and 8, before (PATH) / after (this checkout)."""
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    other = Path(args.against).resolve()
    for name in args.models:
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            weights, _ = make_model(Path(tmp), name, [])
            for precision in args.ours:
                rounds = []
                for _ in range(args.rounds):
                    threads = args.threads[0]
                    rounds.append(
                        (ours(weights, precision, threads, args, other), ours(weights, precision, threads, args))
                    )
                    print(name, precision, rounds[-1], flush=True)
                out = [precision]
                for key in ("prefill_ms", "decode1_ms", "decode8_ms"):
                    before = statistics.median(r[0][key] for r in rounds)
                    after = statistics.median(r[1][key] for r in rounds)
                    ratio = statistics.median(r[0][key] / r[1][key] for r in rounds)
                    out += [f"{before:.1f} / {after:.1f}", f"{ratio:.2f}x"]
                rows.append(out)
        load_after = " ".join(f"{x:.1f}" for x in os.getloadavg())
        table(
            f"{name} shape (random weights), before ({other}) / after ({ROOT}), {args.threads[0]} thread(s), prefill "
            f"{args.prompt} tokens, decode {args.tokens} tokens per row, medians of {args.rounds} alternating rounds, "
            f"load average {load_before} before, {load_after} after; ratio: before / after per round (> 1: faster)",
            ["ours", "prefill ms", "ratio", "decode b1 ms", "ratio", "decode b8 ms/step", "ratio"],
            rows,
        )


def row(precision: str, quant: str | None, rounds: list, bandwidth: float, args) -> list:
    med = lambda key, side: statistics.median(r[side][key] for r in rounds)  # noqa: E731
    # the keys a timed step reads, on average: ours after an 8-token prompt and 4 untimed steps, llama.cpp's from
    # its first generated token on
    keys = (8 + 4 + (args.tokens + 1) / 2, 8 + (args.tokens + 1) / 2)
    out = [precision, quant or "-"]
    for key in ("prefill_ms", "decode1_ms", "decode8_ms"):
        ratio = statistics.median(r[1][key] / r[0][key] for r in rounds) if quant else None  # their ms / ours
        theirs_ms = f" / {med(key, 1):.1f}" if quant else ""
        out += [f"{med(key, 0):.1f}{theirs_ms}", f"{ratio:.2f}x" if ratio else "-"]
        if key != "prefill_ms":
            batch = int(key[6])
            shares = [
                statistics.median(mbu(r[s], batch, keys[s], bandwidth) for r in rounds)
                for s in (0, 1)[: 1 + bool(quant)]
            ]
            out.append(" / ".join(f"{100 * x:.0f}%" for x in shares))
    out.append(f"{med('peak_mb', 0):,.0f}" + (f" / {med('peak_mb', 1):,.0f}" if quant else ""))
    return out


def profile(args) -> None:
    """torch.profiler over decode steps of each --models shape at batch 1: the time by operator, grouped."""
    import torch

    torch.set_num_threads(args.threads[0])
    label_our_calls()
    for name in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            weights, _ = make_model(Path(tmp), name, [])
            for precision in args.ours:
                profile_one(weights, name, precision, args)


def profile_one(weights: Path, name: str, precision: str, args) -> None:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from nanogpt_cli.inference.engine import Engine, SamplingParams
    from nanogpt_cli.interop.loading import load_for_inference

    quant = precision if precision.startswith("int") else None
    dtype = "float32" if precision == "float32" else "bfloat16"
    m = load_for_inference(weights, device="cpu", dtype=dtype, quantize=quant)
    engine = Engine(m.model, max_batch=1)
    with torch.inference_mode():
        engine.add(list(range(8)), SamplingParams(temperature=0.0), 2 * args.tokens + 8)
        for _ in range(4):
            engine.step()
        t0 = time.perf_counter()
        for _ in range(args.tokens):
            engine.step()
        plain_ms = (time.perf_counter() - t0) / args.tokens * 1000
        if engine.plan.fused is not None:
            engine.plan.fused.timers.zero_()  # the step's own profile clock
        with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            t0 = time.perf_counter()
            for _ in range(args.tokens):
                engine.step()
            step_ms = (time.perf_counter() - t0) / args.tokens * 1000
    groups = group_profile(prof, args.tokens, m.model.config.vocab_size)
    if engine.plan.fused is not None:  # inside the one call, by its own clock over the profiled steps
        products, attention, total = (1000 * t / args.tokens for t in engine.plan.fused.timers.tolist())
        groups["  of which: matmuls"] = products
        groups["  of which: attention over the cache"] = attention
        groups["  of which: norms, RoPE, SwiGLU, cache writes"] = total - products - attention
    rows = [[k, f"{v:.2f}", f"{100 * v / step_ms:.0f}%"] for k, v in groups.items()]
    rows.append(["step (wall, profiled)", f"{step_ms:.2f}", "100%"])
    rows.append(["step (wall, not profiled)", f"{plain_ms:.2f}", ""])
    title = f"{name} decode step at batch 1, {precision}, {args.threads[0]} thread(s)"
    table(title, ["part", "ms", "share"], rows)


LOAD = """
import json, sys, torch
from nanogpt_cli.interop.loading import load_for_inference
# VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so a child would report its parent's peak
status = lambda: open("/proc/self/status").read().splitlines()
rss = lambda: next(int(line.split()[1]) for line in status() if line.startswith("VmHWM")) / 1024
path, dtype, quant = sys.argv[1], sys.argv[2], None if sys.argv[3] == "-" else sys.argv[3]
torch.set_num_threads(1)
before = rss()
m = load_for_inference(path, device="cpu", dtype=dtype, quantize=quant)
tensors = {t.data_ptr(): t.untyped_storage().nbytes() for t in [*m.model.parameters(), *m.model.buffers()]}
print(json.dumps({"before_mb": before, "peak_mb": rss(), "model_mb": sum(tensors.values()) / 2**20}))
"""

LLAMA_LOAD = """
import sys, xllamacpp as x
p = x.CommonParams()
p.model.path = sys.argv[1]
p.n_ctx, p.n_parallel, p.port = 512, 1, 0
p.cpuparams.n_threads = p.cpuparams_batch.n_threads = 1
server = x.Server(p)
status = open("/proc/self/status").read()
print(next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM")) / 1024)
"""


def memory(args) -> None:
    """Peak RSS of loading alone, each load a fresh process: ours from our weights file at each precision and from
    our q8_0 / q4_0 GGUF exports into the matching form; llama.cpp's server started on the same GGUF with a 512-token
    context, one slot (its VmHWM once it listens; xllamacpp loaded in that process too)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if os.environ.get("XLLAMACPP_PATH"):
        env["PYTHONPATH"] += ":" + os.environ["XLLAMACPP_PATH"]
    for name in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            weights, ggufs = make_model(Path(tmp), name, ["q8_0", "q4_0"])
            cases = [(weights, d, q) for d, q in (("float32", "-"), ("bfloat16", "-"), ("bfloat16", "int8"))]
            cases += [(weights, "bfloat16", "int4"), (ggufs["q8_0"], "bfloat16", "int8")]
            cases.append((ggufs["q4_0"], "bfloat16", "int4"))
            rows = []
            for path, dtype, quant in cases:
                cmd = [sys.executable, "-c", LOAD, str(path), dtype, quant]
                done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
                if done.returncode != 0:
                    raise SystemExit(f"loading {path.name} at {dtype} {quant} failed:\n{done.stderr[-2000:]}")
                out = json.loads(done.stdout.strip().splitlines()[-1])
                theirs = "-"
                if path.suffix == ".gguf":
                    done = subprocess.run(
                        [sys.executable, "-c", LLAMA_LOAD, str(path)], capture_output=True, text=True, env=env
                    )
                    theirs = f"{float(done.stdout.split()[-1]):,.0f}" if done.returncode == 0 else "failed"
                source = path.suffix.removeprefix(".") + ("" if path.suffix != ".gguf" else f" {path.stem[-4:]}")
                rows.append(
                    [source, dtype, quant, f"{path.stat().st_size / 2**20:,.0f}", f"{out['model_mb']:,.0f}"]
                    + [f"{out['before_mb']:,.0f}", f"{out['peak_mb']:,.0f}", theirs]
                )
                print(rows[-1], flush=True)
        table(
            f"{name} shape (random weights): peak RSS of a load (MB), each a fresh process",
            ["file", "dtype", "--quantize", "file MB", "model MB", "before load", "peak", "llama.cpp peak"],
            rows,
        )


GROUPS = {  # operator -> the part of the step it belongs to
    "matmuls": (
        "aten::mm",
        "aten::addmm",
        "aten::_weight_int8pack_mm",
        "aten::_weight_int4pack_mm_for_cpu",
        "aten::linear",
        "mkldnn::_linear_pointwise",
    ),
    "attention over the cache": (
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::copy_",
        "aten::index_put_",
    ),
    "norms, activations, RoPE": (
        "aten::mul",
        "aten::add",
        "aten::addcmul",
        "aten::linalg_vector_norm",
        "aten::rsqrt_",
        "aten::silu",
        "aten::rms_norm",
        "aten::cat",
    ),
    "sampling": (
        "aten::argmax",
        "aten::max",
        "aten::softmax",
        "aten::multinomial",
        "aten::topk",
        "aten::item",
        "aten::_local_scalar_dense",
    ),
}


FUSED, HEAD = "blocks in one call (ours)", "head"


def label_our_calls() -> None:
    """Our kernels are ctypes calls, which torch.profiler does not see: a record_function range around the fused
    step and the head puts them in the profile (benchmark only)."""
    from torch.profiler import record_function

    from nanogpt_cli.inference.backends import cpu
    from nanogpt_cli.inference.backends.decode import FusedStep

    def labelled(fn, name):
        def call(*a, **kw):
            with record_function(name):
                return fn(*a, **kw)

        return call

    FusedStep.__call__ = labelled(FusedStep.__call__, FUSED)
    cpu.head_logits = labelled(cpu.head_logits, HEAD)


def group_profile(prof, steps: int, vocab: int) -> dict[str, float]:
    """Self CPU time per step (ms) of each part; the head's matmul is the (1, C) x (C, V) mm, told apart by its
    shape; what no operator accounts for is Python and dispatch."""
    parts = ("matmuls", HEAD, "attention over the cache", "norms, activations, RoPE", "sampling", "other ops")
    totals = {k: 0.0 for k in (FUSED, *parts)}
    for e in prof.key_averages(group_by_input_shape=True):
        ms = e.self_cpu_time_total / 1000 / steps
        part = e.key if e.key in (FUSED, HEAD) else next((k for k, ops in GROUPS.items() if e.key in ops), "other ops")
        if part == "matmuls" and str(vocab) in str(e.input_shapes):
            part = HEAD
        totals[part] += ms
    return {k: v for k, v in totals.items() if v or k != FUSED}


def quality(args) -> None:
    """A small model trained briefly on Tiny Shakespeare (char level): validation perplexity at float32, int8 and
    int4, and how many of the prompts' first 32 greedy tokens int8 and int4 give exactly as float32 does."""
    from common import shakespeare_path

    from nanogpt_cli import api
    from nanogpt_cli.data import prepare

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prepare(str(shakespeare_path()), "shk", tokenizer="char", data_dir=tmp / "data")
        run = tmp / "run"
        n_layer, n_embd, n_head = (int(n) for n in args.quality_shape.split("x"))
        flags = dict(
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            block_size=128,
            norm="rmsnorm",
            mlp="swiglu",
            batch_size=16,
            max_iters=args.train_iters,
            eval_interval=args.train_iters,
            eval_iters=4,
            dtype="float32",
        )
        api.train(data="shk", data_dir=str(tmp / "data"), out=run, device="cpu", **flags)
        text = shakespeare_path().read_text()
        held = text[-20000:]  # the end of the file: in the validation split
        (tmp / "held.txt").write_text(held)
        prompts = [held[i : i + 24] for i in range(0, 20000, 1000)]
        results, greedy = [], {}
        for q in (None, "int8", "int4"):
            model = api.load(run, device="cpu", dtype="float32", quantize=q)
            score = model.score(files=[tmp / "held.txt"])
            greedy[q] = [model.generate(p, max_new_tokens=32, temperature=0.0).token_ids for p in prompts]
            stepped = decode_perplexity(model.module, model.tokenizer.encode(held), 128)
            results.append([q or "float32", f"{score.perplexity:.4f}", f"{stepped:.4f}"])
        base, base_step = float(results[0][1]), float(results[0][2])
        for r, q in zip(results, (None, "int8", "int4")):
            same = sum(a == b for a, b in zip(greedy[q], greedy[None]))
            r[2:] = [f"{100 * (float(r[1]) / base - 1):+.2f}%", r[2], f"{100 * (float(r[2]) / base_step - 1):+.2f}%"]
            r.append(f"{same} of {len(prompts)}")
        table(
            f"{n_layer} x {n_embd} char model ({n_head} heads), {args.train_iters} iterations on Tiny Shakespeare; "
            "perplexity on its last 20,000 characters, scored whole and token by token through the decode step",
            ["weights", "perplexity", "vs float32", "decode-step perplexity", "vs float32", "first 32 greedy equal"],
            results,
        )


def decode_perplexity(model, ids: list[int], window: int) -> float:
    """Perplexity of ids in windows of `window` tokens, each token's logits from the engine's decode step (the
    kernels a reply runs through: one to a few rows), 8 windows at a time."""
    import torch
    from torch.nn import functional as F

    from nanogpt_cli.inference.backends.cpu import decode_plan, decode_step
    from nanogpt_cli.inference.engine import KVCache

    windows = [ids[i : i + window] for i in range(0, len(ids) - window + 1, window)]
    nll, count, plan = 0.0, 0, decode_plan(model)
    with torch.inference_mode():
        for b in range(0, len(windows), 8):
            x = torch.tensor(windows[b : b + 8])
            cache = KVCache(model, x.size(0))
            for t in range(window - 1):
                logits = decode_step(plan, x[:, t], cache).float()
                nll += F.cross_entropy(logits, x[:, t + 1], reduction="sum").item()
                count += x.size(0)
    return math.exp(nll / count)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--ours", nargs="+", default=[o for o, _ in PAIRS], choices=[o for o, _ in PAIRS])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="one table per count (--profile: the first)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--tokens", type=int, default=16, help="decode steps timed per batch")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--quality", action="store_true")
    p.add_argument("--memory", action="store_true", help="peak RSS of loading alone, against llama.cpp's")
    p.add_argument("--against", help="another checkout's root: its speed before this one's, alternating (no llama.cpp)")
    p.add_argument("--train-iters", type=int, default=600)
    p.add_argument("--quality-shape", default="4x128x4", help="--quality's model: layers x width x heads")
    args = p.parse_args()
    if args.quality:
        return quality(args)
    if args.profile:
        return profile(args)
    if args.memory:
        return memory(args)
    if args.against:
        return against(args)
    speed(args)


if __name__ == "__main__":
    main()
