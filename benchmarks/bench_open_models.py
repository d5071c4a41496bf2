"""A SmolLM2-135M-shaped Llama (random weights) loaded from its Hugging Face folder: our prefill, decode and LoRA
step against transformers (+ peft) on the same weights, and llama.cpp (PyPI xllamacpp) on our GGUF export.

    python benchmarks/bench_open_models.py                      # float32 and bfloat16, 1 thread
    python benchmarks/bench_open_models.py --quick              # 4 layers, float32, fewer tokens: under a minute
    python benchmarks/bench_open_models.py --threads 2 --dtypes float32

The model is transformers' LlamaForCausalLM in SmolLM2-135M's configuration (30 layers, 576 wide, 9 heads with 3
key/value heads, 1536 in the MLP, vocabulary 49,152, tied, rope_theta 100,000), seeded, saved with a small byte-level
BPE tokenizer to a temporary folder; ours loads that folder as `--init-from FOLDER` does. Nothing is downloaded.

- prefill: one 512-token prompt into an empty cache, logits of its last token (transformers: logits_to_keep=1, as
  its generate does).
- decode: tokens/s of one-token steps through the cache after a 16-token prompt, batch 1 and 8; ours is the
  engine's decode_step, transformers a forward loop with its DynamicCache (no generate overhead; its StaticCache
  is no faster without torch.compile: 10.8-11.8 against 10.7-11.3 tok/s at batch 1), llama.cpp its server with
  n_parallel rows, timed by llama.cpp itself (its `timings`). transformers runs its default SDPA attention.
- LoRA step: forward, backward and AdamW on rank-8 adapters of the attention projections (ours: the fused q, k, v;
  peft: q_proj, k_proj, v_proj), batch 1 x 256 tokens. bfloat16 is autocast over the float32 checkpoint, as
  finetune runs it: ours holds the frozen base's matrices in bf16 (what autocast casts them to every step; the
  embedding and the adapters stay float32), transformers' row casts them every step; a second row loads their
  base in bf16 (dtype=torch.bfloat16, peft's adapters float32), as peft users usually hold it. Each tool runs in
  its own process; peak memory is the highest RSS sampled during the steps.

Rounds alternate ours and theirs; each figure is the median over rounds. llama.cpp runs in child processes on
f16 and q8_0 exports (its logs go to /dev/null).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, shakespeare_path, table  # noqa: E402

SMOLLM2 = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=0,
    eos_token_id=0,
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_folder(folder: Path, layers: int) -> None:
    """Save the seeded random LlamaForCausalLM and a byte-level BPE tokenizer (trained on Tiny Shakespeare) there."""
    import tokenizers
    import transformers
    from tokenizers import decoders, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet)
    tok.train_from_iterator([shakespeare_path().read_text()[:200_000]], trainer)
    end = "<|endoftext|>"
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=end, eos_token=end).save_pretrained(folder)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**SMOLLM2, "num_hidden_layers": layers})
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def load_both(folder: Path, dtype: torch.dtype):
    """(ours, transformers') models from the folder, in dtype, eval."""
    import transformers

    from nanogpt_cli.interop.loading import load_model

    ours, _ = load_model(folder)
    theirs = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    return ours.cast(dtype).eval(), theirs


def ours_prefill(model, prompt):
    from nanogpt_cli.inference.engine import KVCache

    cache = KVCache(model, prompt.size(0))  # allocated once, as an engine holds it

    def run():
        cache.pos = [0] * cache.rows  # every call prefills an empty cache, as transformers' does
        return model(prompt, cache=cache.view(0, cache.rows), last_only=True)

    return run


def theirs_prefill(model, prompt):
    return lambda: model(prompt, use_cache=True, logits_to_keep=1)


def ours_decode(model, ids: torch.Tensor, start: int):
    """A callable that prefills ids[:, :start] and then decodes the rest one token at a time; returns the decode
    seconds."""
    from nanogpt_cli.inference.backends.cpu import decode_plan, decode_step
    from nanogpt_cli.inference.engine import KVCache

    plan = decode_plan(model)

    def run() -> float:
        cache = KVCache(model, ids.size(0))
        model(ids[:, :start], cache=cache.view(0, ids.size(0)), last_only=True)
        t0 = time.perf_counter()
        for t in range(start, ids.size(1)):
            logits = decode_step(plan, ids[:, t], cache)
        logits.argmax(-1)
        return time.perf_counter() - t0

    return run


def theirs_decode(model, ids: torch.Tensor, start: int):
    from transformers import DynamicCache

    def run() -> float:
        cache = DynamicCache(config=model.config)
        model(ids[:, :start], cache=cache, use_cache=True, logits_to_keep=1)
        t0 = time.perf_counter()
        for t in range(start, ids.size(1)):
            logits = model(ids[:, t : t + 1], cache=cache, use_cache=True).logits
        logits.argmax(-1)
        return time.perf_counter() - t0

    return run


def inference_rows(folder: Path, dtype_name: str, args) -> list[dict]:
    """Prefill and decode figures of ours and transformers in this process, rounds alternating the two."""
    dtype = DTYPES[dtype_name]
    ours, theirs = load_both(folder, dtype)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 1000, (1, args.prompt), generator=g)
    rows = []
    with torch.inference_mode():
        jobs = {"prefill 512": (ours_prefill(ours, prompt), theirs_prefill(theirs, prompt), args.prompt)}
        for batch in (1, 8):
            ids = torch.randint(0, 1000, (batch, 16 + args.tokens), generator=g)
            jobs[f"decode b{batch}"] = (ours_decode(ours, ids, 16), theirs_decode(theirs, ids, 16), batch * args.tokens)
        for task, (mine, other, tokens) in jobs.items():
            # a warm-up call of each, then alternating rounds; decode callables return their own timed part
            mine(), other()
            times = {"ours": [], "transformers": []}
            for _ in range(args.rounds):
                for name, fn in (("ours", mine), ("transformers", other)):
                    t0 = time.perf_counter()
                    inner = fn()
                    secs = time.perf_counter() - t0
                    times[name].append(inner if isinstance(inner, float) else secs)
            rows.append(
                {
                    "task": task,
                    "dtype": dtype_name,
                    "ours": tokens / statistics.median(times["ours"]),
                    "transformers": tokens / statistics.median(times["transformers"]),
                }
            )
            print(f"  {dtype_name} {task}: {rows[-1]['ours']:,.0f} against {rows[-1]['transformers']:,.0f} tok/s")
    return rows


# --- the LoRA step, one process per tool ----------------------------------------------------------------


class PeakRSS:
    """The highest resident set size sampled every 2 ms while it runs (a context manager), in bytes."""

    def __enter__(self):
        self.peak, self.done = 0, False
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self):
        page = os.sysconf("SC_PAGE_SIZE")
        while not self.done:
            with open("/proc/self/statm") as f:
                self.peak = max(self.peak, int(f.read().split()[1]) * page)
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.done = True
        self.thread.join()


def lora_child(tool: str, folder: str, dtype_name: str, steps: int, tokens: int, threads: int) -> None:
    """Print {tokens_per_s, peak_gb, loaded_gb} of LoRA steps by one tool (ours or transformers + peft)."""
    import gc

    torch.set_num_threads(threads)
    if tool == "ours":
        from nanogpt_cli.device import keep_freed_memory
        from nanogpt_cli.interop.loading import load_model
        from nanogpt_cli.lora import LoRAConfig, add_lora, hold_frozen

        keep_freed_memory()  # as the trainer sets it on a CPU
        model, _ = load_model(folder)
        params = add_lora(model, LoRAConfig(r=8, alpha=16.0, targets=("attn.c_attn",)))
        if dtype_name == "bfloat16":  # as the trainer holds a frozen base under autocast
            hold_frozen(model, torch.bfloat16)

        def loss_of(ids):
            return model(ids, ids, keep_logits=False)[1]  # as the trainer asks for it
    else:
        import peft
        import transformers

        # "transformers-bf16": the base loaded in bf16 (peft keeps the adapters in fp32), as peft users hold it
        held = torch.bfloat16 if tool == "transformers-bf16" else torch.float32
        model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=held)
        lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj"], task_type="CAUSAL_LM")
        model = peft.get_peft_model(model, lora)
        params = [p for p in model.parameters() if p.requires_grad]

        def loss_of(ids):
            return model(input_ids=ids, labels=ids).loss

    model.train()
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    gc.collect()
    with open("/proc/self/statm") as f:
        loaded = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    g = torch.Generator().manual_seed(0)
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=dtype_name == "bfloat16")
    times = []
    with PeakRSS() as rss:
        for _ in range(steps + 1):  # the first is a warm-up
            ids = torch.randint(0, 1000, (1, tokens), generator=g)
            t0 = time.perf_counter()
            with autocast:
                loss = loss_of(ids)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
    print(json.dumps({"tokens_per_s": tokens / statistics.median(times[1:]), "peak": rss.peak, "loaded": loaded}))


def lora_rows(folder: Path, dtype_name: str, args) -> list[dict]:
    """The LoRA step's rows: against transformers + peft on the float32 weights (autocast for bfloat16, as ours
    is run), and for bfloat16 also against their base loaded in bf16, the way peft users hold it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    theirs = {"transformers": "LoRA step"}
    if dtype_name == "bfloat16":
        theirs["transformers-bf16"] = "LoRA step, their base in bf16"
    results = {tool: [] for tool in ("ours", *theirs)}
    for _ in range(args.lora_rounds):
        for tool in results:
            cmd = [sys.executable, __file__, "--child", "lora", tool, str(folder), dtype_name]
            cmd += [str(args.lora_steps), str(args.lora_tokens), str(args.threads)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"the {tool} LoRA run failed:\n{out.stderr[-3000:]}")
            results[tool].append(json.loads(out.stdout.strip().splitlines()[-1]))
    speed = {tool: statistics.median(r["tokens_per_s"] for r in runs) for tool, runs in results.items()}
    peak = {tool: max(r["peak"] for r in runs) for tool, runs in results.items()}
    rows = []
    for tool, task in theirs.items():
        rows.append(
            {
                "task": task,
                "dtype": dtype_name,
                "ours": speed["ours"],
                "transformers": speed[tool],
                "ours_peak": peak["ours"],
                "transformers_peak": peak[tool],
            }
        )
        print(
            f"  {dtype_name} {task}: {speed['ours']:,.0f} against {speed[tool]:,.0f} tok/s, peak RSS "
            f"{peak['ours'] / 1e9:.2f} against {peak[tool] / 1e9:.2f} GB"
        )
    return rows


# --- llama.cpp, one process per GGUF file ---------------------------------------------------------------


def llama_child(gguf: str, threads: int, prompt: int, tokens: int, rounds: int) -> None:
    """Print {task: tokens/s} of llama.cpp's server on one GGUF file, as its own timings give them."""
    import xllamacpp

    p = xllamacpp.CommonParams()
    p.model.path = gguf
    p.n_ctx, p.n_parallel, p.n_batch, p.n_ubatch = 8 * 2048, 8, 512, 512
    p.cpuparams.n_threads = p.cpuparams_batch.n_threads = threads
    server = xllamacpp.Server(p)
    g = torch.Generator().manual_seed(0)

    def complete(ids: list[int], n: int) -> dict:
        request = {"prompt": ids, "n_predict": n, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
        return server.handle_completions(request)["timings"]

    def ids(n: int) -> list[int]:
        return torch.randint(0, 1000, (n,), generator=g).tolist()

    complete(ids(prompt), 4)  # warm-up
    out = {"prefill 512": [], "decode b1": [], "decode b8": []}
    for _ in range(rounds):
        out["prefill 512"].append(complete(ids(prompt), 1)["prompt_per_second"])
        out["decode b1"].append(complete(ids(16), tokens)["predicted_per_second"])
        # 8 requests at once: the server decodes them as one batch; throughput = all their tokens over the
        # longest one's decoding time
        done: list[dict] = []
        prompts = [ids(16) for _ in range(8)]
        workers = [threading.Thread(target=lambda q=q, d=done: d.append(complete(q, tokens))) for q in prompts]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        out["decode b8"].append(sum(t["predicted_n"] for t in done) / max(t["predicted_ms"] for t in done) * 1e3)
    print(json.dumps({task: statistics.median(v) for task, v in out.items()}))


def llama_rows(folder: Path, work: Path, args) -> dict[str, dict[str, float]] | None:
    """{quant: {task: tokens/s}} of llama.cpp on our f16 and q8_0 exports, or None (said why) without xllamacpp."""
    try:
        import xllamacpp  # noqa: F401
    except Exception as e:  # a missing or broken wheel: the columns are left out
        print(f"llama.cpp columns left out: xllamacpp does not import here ({type(e).__name__}: {e}).")
        return None
    from nanogpt_cli.interop.export import export_gguf
    from nanogpt_cli.interop.loading import load_model, tokenizer_of

    model, meta = load_model(folder)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    results = {}
    for quant in ("f16", "q8_0"):
        path = work / f"model-{quant}.gguf"
        export_gguf(model, meta["tokenizer"], path, quant=quant, tokenizer=tokenizer_of(meta, folder), force=True)
        cmd = [sys.executable, __file__, "--child", "llama", str(path), str(args.threads), str(args.prompt)]
        cmd += [str(args.tokens), str(args.rounds)]
        out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        if out.returncode != 0:
            print(f"llama.cpp columns left out: xllamacpp failed on {path.name} (exit {out.returncode}).")
            return None
        results[quant] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"  llama.cpp {quant}: " + ", ".join(f"{k} {v:,.0f}" for k, v in results[quant].items()))
    return results


# --- the table ----------------------------------------------------------------------------------------------


def report(rows: list[dict], llama: dict | None, args) -> None:
    header = ["task", "dtype", "ours tok/s", "transformers tok/s", "ours / transformers"]
    if llama:
        header += ["llama.cpp f16", "llama.cpp q8_0", "ours / f16", "ours / q8_0"]
    header += ["peak RSS ours / theirs (GB)", "memory ratio"]
    lines = []
    for r in rows:
        line = [
            r["task"],
            r["dtype"],
            f"{r['ours']:,.0f}",
            f"{r['transformers']:,.0f}",
            f"{r['ours'] / r['transformers']:.2f}x",
        ]
        if llama:
            theirs = [llama[q].get(r["task"]) for q in ("f16", "q8_0")]
            line += [f"{t:,.0f}" if t else "" for t in theirs] + [f"{r['ours'] / t:.2f}x" if t else "" for t in theirs]
        if "ours_peak" in r:
            line += [
                f"{r['ours_peak'] / 1e9:.2f} / {r['transformers_peak'] / 1e9:.2f}",
                f"{r['ours_peak'] / r['transformers_peak']:.2f}x",
            ]
        else:
            line += ["", ""]
        lines.append(line)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    title = (
        f"SmolLM2-135M shape, {args.layers} layers, random weights, {args.threads} thread(s), load {load}; "
        "llama.cpp on our GGUF export (its own f16/q8_0 compute)"
    )
    table(title, header, lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4 layers, fewer tokens, steps and rounds")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--threads", type=int, default=1, help="torch threads and llama.cpp threads alike")
    p.add_argument("--dtypes", help="comma-separated: float32, bfloat16 (default both; --quick: float32)")
    p.add_argument("--prompt", type=int, default=512, help="prefill prompt length")
    p.add_argument("--tokens", type=int, default=16, help="decoded tokens per row")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--lora-steps", type=int, default=2)
    p.add_argument("--lora-tokens", type=int, default=256)
    p.add_argument("--lora-rounds", type=int, default=2)
    p.add_argument("--skip-llama", action="store_true", help="leave out the llama.cpp columns")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "lora":
            tool, folder, dtype_name, steps, tokens, threads = rest
            return lora_child(tool, folder, dtype_name, int(steps), int(tokens), int(threads))
        gguf, threads, prompt, tokens, rounds = rest
        return llama_child(gguf, int(threads), int(prompt), int(tokens), int(rounds))
    if args.quick:  # its smaller sizes, except those given on the command line
        quick = dict(layers=4, tokens=8, rounds=1, lora_steps=1, lora_rounds=1, lora_tokens=128)
        for name, value in quick.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    args.dtypes = args.dtypes or ("float32" if args.quick else "float32,bfloat16")
    torch.set_num_threads(args.threads)
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-open-") as tmp:
        work = Path(tmp)
        build_folder(work / "smollm2", args.layers)
        rows = []
        for dtype_name in args.dtypes.split(","):
            rows += inference_rows(work / "smollm2", dtype_name, args)
            rows += lora_rows(work / "smollm2", dtype_name, args)
        llama = None if args.skip_llama else llama_rows(work / "smollm2", work, args)
    report(rows, llama, args)


if __name__ == "__main__":
    main()
