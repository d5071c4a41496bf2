"""Serving under load: N concurrent streaming clients against `nanogpt serve` and, side by side on the same model
exported to GGUF, llama.cpp's own OpenAI server (PyPI's xllamacpp, used only here).

    python benchmarks/bench_serve.py                                  # 1, 4 and 16 clients, both servers
    python benchmarks/bench_serve.py --clients 1 16 --requests 128 --max-tokens 64 --threads 1 --only nanogpt
    python benchmarks/bench_serve.py --step        # the decode step alone, ours against llama.cpp's, batch 1 and 5
    python benchmarks/bench_serve.py --baseline ../other-checkout   # that checkout's server too, side by side
    python benchmarks/bench_serve.py --conversation --turns 10      # time to first token per turn, prompt cache on/off

The model is a 4 x 128 Llama-shaped GPT with the gpt2 vocabulary and random weights (speed does not depend on
them). Each client sends streamed completions one after another (loopback only, a bounded number of requests,
each with a time limit) and the table gives the aggregate generated tokens/s, time to first token and the
time between streamed chunks (inter-token latency), p50 and p95.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

LLAMA_SERVER = """
import sys, time, xllamacpp as x
p = x.CommonParams()
p.model.path = sys.argv[1]
p.n_parallel = int(sys.argv[2])
p.n_ctx = int(sys.argv[2]) * int(sys.argv[3])
p.cpuparams.n_threads = p.cpuparams_batch.n_threads = int(sys.argv[4])
p.port = 0
server = x.Server(p)
print("listening", server.listening_address, flush=True)
sys.stdin.read()  # until the benchmark closes our stdin
"""


def make_model(folder: Path, block_size: int) -> tuple[Path, Path]:
    import torch

    from nanogpt_cli.config import GPTConfig
    from nanogpt_cli.interop.export import export
    from nanogpt_cli.model import GPT
    from nanogpt_cli.runs import checkpoint as ckpt
    from nanogpt_cli.tokenizer import build_tokenizer

    torch.manual_seed(0)
    tok = build_tokenizer("gpt2")
    cfg = GPTConfig(
        vocab_size=tok.vocab_size,
        block_size=block_size,
        n_layer=4,
        n_head=4,
        n_embd=128,
        pos_encoding="rope",
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
    )
    weights = folder / "llama4x128.safetensors"
    ckpt.save_model(weights, GPT(cfg), {"tokenizer": tok.describe(), "step": 0})
    gguf = folder / "llama4x128.gguf"
    export(weights, "gguf", gguf, force=True)
    return weights, gguf


def start(
    kind: str,
    weights: Path,
    gguf: Path,
    slots: int,
    ctx: int,
    threads: int,
    root: Path = ROOT,
    extra: tuple[str, ...] = (),
) -> tuple[subprocess.Popen, str]:
    """A server in its own process; returns it and its base URL once it listens (at most 120 s). root: the
    checkout whose `nanogpt serve` runs; extra: more flags for it."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    if kind.startswith("nanogpt"):
        cmd = [
            sys.executable,
            "-m",
            "nanogpt_cli",
            "serve",
            str(weights),
            "--port",
            "0",
            "--max-batch",
            str(slots),
            "--threads",
            str(threads),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--max-queue",
            "1000",
            *extra,
        ]
    else:
        cmd = [sys.executable, "-c", LLAMA_SERVER, str(gguf), str(slots), str(ctx), str(threads)]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    box: list[str] = []

    def read():
        for line in proc.stdout:
            if "http://" in line:
                box.append(line)
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(120)
    if not box:
        proc.kill()
        raise SystemExit(f"{kind} did not start within 120 s")
    url = next(w for w in box[0].split() if w.startswith("http://"))
    return proc, url.rstrip("/")


def one_request(url: str, i: int, max_tokens: int, timeout: float) -> dict:
    """One streamed completion: its generated tokens, time to first token and the gaps between chunks."""
    host, port = url.removeprefix("http://").split(":")
    body = {
        "prompt": f"Request number {i} says",
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": i,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    t0 = time.perf_counter()
    times, tokens = [], None
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{response.status}: {response.read()[:200]!r}")
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("text") for c in chunk.get("choices", [])):
                times.append(time.perf_counter())
    finally:
        conn.close()
    return {
        "tokens": tokens if tokens is not None else len(times),
        "ttft": times[0] - t0 if times else None,
        "gaps": [b - a for a, b in zip(times, times[1:])],
    }


def load(url: str, clients: int, requests: int, max_tokens: int, pid: int | None = None) -> dict:
    """`clients` threads send `requests` requests in all; aggregate tokens/s and latency percentiles, and with
    pid the server process's CPU time per generated token."""
    results, errors, lock = [], [], threading.Lock()
    counter = iter(range(requests))

    def client():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            try:
                r = one_request(url, i, max_tokens, timeout=120)
            except Exception as e:  # reported below, never hidden
                with lock:
                    errors.append(str(e))
                continue
            with lock:
                results.append(r)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    t0, c0 = time.perf_counter(), cpu_seconds(pid) if pid else 0.0
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    wall = time.perf_counter() - t0
    cpu = cpu_seconds(pid) - c0 if pid else 0.0
    ttft = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    gaps = sorted(g for r in results for g in r["gaps"])
    tokens = sum(r["tokens"] for r in results)
    return {
        "tok_s": tokens / wall,
        "cpu_ms": cpu / max(tokens, 1) * 1000,
        "ttft": ttft,
        "gaps": gaps,
        "errors": errors,
        "done": len(results),
    }


def cpu_seconds(pid: int) -> float:
    """CPU time used so far by every thread of process pid (the scheduler's nanosecond count)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that just ended
            pass
    return total / 1e9


def our_step(loaded, batch: int, tokens: int) -> tuple[float, float]:
    """ms per engine step (sample, then one decode step) with `batch` greedy rows, after their prefill: wall
    time and this process's CPU time."""
    from nanogpt_cli.inference.engine import Engine, SamplingParams

    engine = Engine(loaded.model, max_batch=batch, vocab_size=loaded.tokenizer.vocab_size)
    engine.add_many([[464, 3290, 318, 257]] * batch, SamplingParams(temperature=0.0), tokens + 8)
    for _ in range(8):  # warm up
        engine.step()
    t0, c0 = time.perf_counter(), cpu_seconds(os.getpid())
    for _ in range(tokens):
        engine.step()
    return (time.perf_counter() - t0) / tokens * 1000, (cpu_seconds(os.getpid()) - c0) / tokens * 1000


def llama_step(url: str, pid: int, batch: int, tokens: int) -> tuple[float, float]:
    """ms per generated token of each of `batch` concurrent greedy requests (their median), from llama.cpp's own
    timings, and the server process's CPU time per step (all its threads; the 4-token prompts included)."""
    host, port = url.removeprefix("http://").split(":")
    per_token: list[float] = []

    def ask():
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        body = {"prompt": "The cat is a", "n_predict": tokens, "temperature": 0, "ignore_eos": True}
        conn.request("POST", "/completion", body=json.dumps(body), headers={"Content-Type": "application/json"})
        per_token.append(json.loads(conn.getresponse().read())["timings"]["predicted_per_token_ms"])
        conn.close()

    threads = [threading.Thread(target=ask, daemon=True) for _ in range(batch)]
    c0 = cpu_seconds(pid)
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return statistics.median(per_token), (cpu_seconds(pid) - c0) / tokens * 1000


def step_table(args) -> None:
    """Rounds that alternate llama.cpp's server and our engine, so that the load other jobs put on the machine
    hits both alike. Wall time counts whatever else the shared CPU runs meanwhile; CPU time (ours: this process,
    theirs: the server's) counts only the work, so its ratio is the steadier one on a busy machine."""
    import torch

    from nanogpt_cli.interop.loading import load_for_inference

    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        weights, gguf = make_model(Path(tmp), block_size=1024)
        loaded = load_for_inference(weights, device="cpu", dtype="float32")
        proc, url = start("llama.cpp", weights, gguf, max(args.batches), 1024, args.threads)
        try:
            llama_step(url, proc.pid, 1, 16)  # warm up
            for b in args.batches:
                ours, theirs = [], []
                for _ in range(args.rounds):
                    theirs.append(llama_step(url, proc.pid, b, args.step_tokens))
                    ours.append(our_step(loaded, b, args.step_tokens))
                wall = statistics.median(o[0] / t[0] for o, t in zip(ours, theirs))
                cpu = statistics.median(o[1] / t[1] for o, t in zip(ours, theirs))
                rows.append(
                    [
                        b,
                        f"{statistics.median(o[0] for o in ours):.2f}",
                        f"{statistics.median(t[0] for t in theirs):.2f}",
                        f"{wall:.2f}x",
                        f"{statistics.median(o[1] for o in ours):.2f}",
                        f"{statistics.median(t[1] for t in theirs):.2f}",
                        f"{cpu:.2f}x",
                    ]
                )
                print(" | ".join(map(str, rows[-1])), flush=True)
        finally:
            proc.stdin.close()
            proc.terminate()
            proc.wait(30)
    load_avg = " ".join(f"{x:.1f}" for x in os.getloadavg())
    table(
        f"decode step, 4x128 Llama-shaped gpt2-vocab model, greedy, {args.step_tokens} tokens per row, "
        f"{args.threads} thread(s), medians of {args.rounds} alternating rounds, load average {load_avg}",
        [
            "batch",
            "nanogpt ms/step",
            "llama.cpp ms/token",
            "ours / llama.cpp",
            "nanogpt CPU ms/step",
            "llama.cpp CPU ms/step",
            "ours / llama.cpp (CPU)",
        ],
        rows,
    )


def chat_turn(url: str, messages: list[dict], max_tokens: int, timeout: float = 120) -> tuple[float, str]:
    """One streamed greedy chat completion: its time to first token (s) and its text."""
    host, port = url.removeprefix("http://").split(":")
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    t0, first, text = time.perf_counter(), None, []
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{response.status}: {response.read()[:200]!r}")
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            piece = "".join(c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"])
            if piece and first is None:
                first = time.perf_counter() - t0
            text.append(piece)
    finally:
        conn.close()
    return first, "".join(text)


def conversation(url: str, turns: int, user_tokens: int, max_tokens: int, seed: int) -> list[tuple[float, str]]:
    """A conversation of `turns` turns, each prompt the whole conversation so far: (TTFT, reply) per turn."""
    import random

    rng = random.Random(seed)
    words = "the king queen lord thou thee art hath love death night day sword crown blood heart fair".split()
    messages, out = [{"role": "system", "content": f"You are assistant number {seed}."}], []
    for _ in range(turns):
        messages.append({"role": "user", "content": " ".join(rng.choice(words) for _ in range(user_tokens))})
        out.append(chat_turn(url, messages, max_tokens))
        messages.append({"role": "assistant", "content": out[-1][1]})
    return out


def conversation_table(args) -> None:
    """Time to first token at each turn of a conversation, with the prompt cache and without (--prompt-cache-mb
    0), the two servers taking turns conversation by conversation; the greedy replies must be the same."""
    kinds = {"prompt cache": (), "no prompt cache": ("--prompt-cache-mb", "0")}
    ttft: dict[str, list[list[float]]] = {k: [] for k in kinds}
    servers = {}
    with tempfile.TemporaryDirectory() as tmp:
        weights, gguf = make_model(Path(tmp), block_size=args.ctx)
        try:
            for kind, extra in kinds.items():
                servers[kind] = start("nanogpt", weights, gguf, 4, args.ctx, args.threads, extra=extra)
                conversation(servers[kind][1], 2, 8, 4, seed=-1)  # warm up
            for r in range(args.conversations):
                replies = {}
                for kind in kinds:
                    turns = conversation(servers[kind][1], args.turns, args.user_words, args.max_tokens, seed=r)
                    ttft[kind].append([t for t, _ in turns])
                    replies[kind] = [text for _, text in turns]
                assert replies["prompt cache"] == replies["no prompt cache"], "the prompt cache changed a reply"
                print(f"conversation {r}: turn {args.turns}", {k: f"{v[-1][-1] * 1e3:.1f} ms" for k, v in ttft.items()})
        finally:
            for proc, _ in servers.values():
                proc.stdin.close()
                proc.terminate()
                proc.wait(30)
    rows = []
    for turn in sorted({0, args.turns // 2 - 1, args.turns - 1}):
        on = statistics.median(c[turn] for c in ttft["prompt cache"]) * 1e3
        off = statistics.median(c[turn] for c in ttft["no prompt cache"]) * 1e3
        rows.append([turn + 1, f"{off:.1f}", f"{on:.1f}", f"{off / on:.2f}x"])
    load_avg = " ".join(f"{x:.1f}" for x in os.getloadavg())
    table(
        f"TTFT of greedy streamed chat turns ({args.user_words} words a user turn, {args.max_tokens}-token replies), "
        f"4x128 Llama-shaped gpt2-vocab model, context {args.ctx}, {args.threads} thread(s), median of "
        f"{args.conversations} conversations, load average {load_avg}",
        ["turn", "TTFT ms, no cache", "TTFT ms, cache", "no cache / cache"],
        rows,
    )


def merge(runs: list[dict]) -> dict:
    """Rounds of one server at one client count: the median round's tokens/s, latencies pooled."""
    return {
        "tok_s": statistics.median(r["tok_s"] for r in runs),
        "cpu_ms": statistics.median(r["cpu_ms"] for r in runs),
        "ttft": sorted(t for r in runs for t in r["ttft"]),
        "gaps": sorted(g for r in runs for g in r["gaps"]),
        "errors": [e for r in runs for e in r["errors"]],
        "done": sum(r["done"] for r in runs),
    }


def pct(values: list[float], q: float) -> str:
    if not values:
        return "-"
    return f"{values[min(len(values) - 1, int(q * len(values)))] * 1000:.1f}"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument(
        "--requests",
        type=int,
        default=128,
        help="requests per client count and round (at least one per client); 16 clients then make 8 each, so the "
        "figure is the full batch's, not its filling and draining",
    )
    p.add_argument(
        "--max-tokens", type=int, default=None, help="tokens per request (default 64; 32 a reply for --conversation)"
    )
    p.add_argument("--threads", type=int, default=1, help="CPU threads for each server")
    p.add_argument("--only", choices=["nanogpt", "llama.cpp"], default=None)
    p.add_argument("--baseline", type=Path, default=None, help="another checkout whose nanogpt serve runs alongside")
    p.add_argument("--step", action="store_true", help="the decode step alone instead (--batches, --step-tokens)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 5])
    p.add_argument("--step-tokens", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds per batch size for --step")
    p.add_argument("--serve-rounds", type=int, default=3, help="rounds per client count (median tokens/s)")
    p.add_argument("--conversation", action="store_true", help="TTFT per turn with and without the prompt cache")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--conversations", type=int, default=5, help="conversations per server for --conversation")
    p.add_argument("--user-words", type=int, default=40, help="words in each user turn for --conversation")
    p.add_argument("--ctx", type=int, default=1024, help="the model's context for --conversation")
    return p.parse_args()


def main():
    args = parse_args()
    if args.step:
        return step_table(args)
    if args.conversation:
        args.max_tokens = args.max_tokens or 32
        return conversation_table(args)
    args.max_tokens = args.max_tokens or 64
    slots, ctx = max(args.clients), 256
    kinds = [k for k in ("nanogpt", "llama.cpp") if args.only in (None, k)]
    roots = {"nanogpt": ROOT}
    if args.baseline is not None:
        kinds.insert(1, "nanogpt baseline")
        roots["nanogpt baseline"] = args.baseline.resolve()
    results: dict[str, list] = {k: [] for k in kinds}
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        weights, gguf = make_model(Path(tmp), block_size=ctx)
        try:
            for kind in kinds:  # all up at once, idle while another is measured
                servers[kind] = start(kind, weights, gguf, slots, ctx, args.threads, roots.get(kind, ROOT))
                load(servers[kind][1], 1, 2, 8)  # warm up
            for c in args.clients:  # every server in turn, round after round: load drift hits all alike
                runs: dict[str, list[dict]] = {k: [] for k in kinds}
                for _ in range(args.serve_rounds):
                    for kind in kinds:
                        r = load(servers[kind][1], c, max(args.requests, c), args.max_tokens, servers[kind][0].pid)
                        runs[kind].append(r)
                        print(kind, c, f"{r['tok_s']:,.0f} tokens/s", len(r["errors"]), "errors", flush=True)
                        if r["errors"]:
                            print(f"  first error: {r['errors'][0]}", flush=True)
                for kind in kinds:
                    results[kind].append((c, merge(runs[kind])))
        finally:
            for proc, _ in servers.values():
                proc.stdin.close()
                proc.terminate()
                proc.wait(30)
    rows = []
    for kind in kinds:
        single = results[kind][0][1]["tok_s"]
        for c, r in results[kind]:
            rows.append(
                [
                    kind,
                    c,
                    f"{r['done']}",
                    f"{r['tok_s']:,.0f}",
                    f"{r['tok_s'] / single:.1f}x",
                    f"{r['cpu_ms']:.2f}",
                    pct(r["ttft"], 0.5),
                    pct(r["ttft"], 0.95),
                    pct(r["gaps"], 0.5),
                    pct(r["gaps"], 0.95),
                    len(r["errors"]),
                ]
            )
    load_avg = " ".join(f"{x:.1f}" for x in os.getloadavg())
    table(
        f"streamed completions of {args.max_tokens} tokens, 4x128 Llama-shaped gpt2-vocab model, {args.threads} "
        f"thread(s) per server, median of {args.serve_rounds} alternating rounds, load average {load_avg}",
        [
            "server",
            "clients",
            "requests",
            "tokens/s",
            "vs 1 client",
            "server CPU ms/token",
            "TTFT p50 ms",
            "TTFT p95 ms",
            "ITL p50 ms",
            "ITL p95 ms",
            "errors",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
