"""The one script to run on a first GPU: does every CUDA path work, and how fast is it. One table; exit 1 on
any failed check.

    python benchmarks/gpu_check.py                               # CUDA: gpt2-124m shapes, a few minutes
    python benchmarks/gpu_check.py --device cpu --preset tiny    # every check path, tiny, on the CPU

Checks, each a row: the environment (printed first); one bf16 forward+backward with attention forced onto
the flash backend; training throughput of the preset's shapes (gpt2-124m on a GPU) eager and compiled, with
the GPT-2 vocabulary as it is (50,257) and padded (50,304): tokens/s, MFU, peak memory, and the loss on a
repeated batch falling well below ln(vocab); a cpu-fast-style run (Muon, fp16 with the grad scaler,
--compile) stopped halfway and resumed; greedy sampling with and without the KV cache agreeing; evaluation
on the device agreeing with the CPU to ~1e-4. Multi-GPU parity stays in the torchrun tests.
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import sync as sync_device  # noqa: E402
from common import table  # noqa: E402

from nanogpt_cli.config import Dtype, GPTConfig, preset_values  # noqa: E402
from nanogpt_cli.device import autocast_for, peak_flops, resolve_device, resolve_dtype  # noqa: E402

GPT2_VOCAB, PADDED_VOCAB = 50257, 50304


def environment(device: torch.device) -> str:
    dtype = resolve_dtype(Dtype.auto, device)
    parts = [f"torch {torch.__version__}", f"CUDA {torch.version.cuda or '-'}", f"device {device}"]
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        parts += [
            torch.cuda.get_device_name(device),
            f"capability {cap[0]}.{cap[1]}",
            f"native bf16 {'yes' if cap >= (8, 0) else 'no'}",
        ]
    peak = peak_flops(device, dtype)
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    parts += [
        f"auto dtype {str(dtype).removeprefix('torch.')}",
        f"MFU peak {peak / 1e12:,.0f} TFLOP/s" if peak else "MFU peak: none known",
        f"C compiler {compiler or 'MISSING (torch.compile needs one)'}",
    ]
    return ", ".join(parts)


def check_flash(device: torch.device, args) -> tuple[bool, str]:
    """One bf16 forward+backward of causal attention on the flash backend only, against the math backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 128, 64, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()
    grad = q.grad.clone()
    q.grad = None
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        ref.sum().backward()
    diff = (out - ref).abs().max().item()
    gdiff = (grad - q.grad).abs().max().item()
    return diff < 0.05 and gdiff < 0.1, f"max |out - math| {diff:.1e}, |dq - math| {gdiff:.1e}"


def throughput(device: torch.device, cfg: GPTConfig, vocab: int, compile: bool, args) -> tuple[bool, str]:
    """Updates on one repeated batch: speed after the warm-up, and the loss falling well below ln(vocab)."""
    from nanogpt_cli.model import GPT

    torch.manual_seed(0)
    dtype = resolve_dtype(Dtype.auto, device)
    model = GPT(replace(cfg, vocab_size=vocab)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=device.type == "cuda")
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    step_model = torch.compile(model) if compile else model
    B, T = args.batch_size, cfg.block_size
    # a random cycle of 97 distinct real tokens, each row from its own offset: a bigram to learn, so the loss
    # falls far below ln(vocab) in a few updates (padding tokens are never targets)
    cycle = torch.randperm(GPT2_VOCAB)[:97]
    data = cycle[(torch.arange(B)[:, None] * 13 + torch.arange(T + 1)[None, :]) % 97].to(device)  # (B, T+1)
    x, y = data[:, :-1], data[:, 1:]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, warm = [], 3
    for i in range(args.steps):
        if i == warm:
            sync_device(device)
            t0 = time.perf_counter()
        with autocast_for(device, dtype):
            _, loss = step_model(x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    sync_device(device)
    dt = (time.perf_counter() - t0) / (args.steps - warm)
    tokens_s = B * T / dt
    peak = peak_flops(device, dtype)
    mfu = model.flops_per_token() * tokens_s / peak if peak else None
    memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    first, last = losses[0].item(), losses[-1].item()
    ok = math.isfinite(last) and last < 0.5 * math.log(GPT2_VOCAB)
    return ok, (
        f"{tokens_s:,.0f} tok/s, {dt * 1000:.1f} ms/iter, MFU {f'{mfu:.1%}' if mfu else '-'}, "
        f"peak mem {f'{memory:.1f} GiB' if memory else '-'}, loss {first:.2f} -> {last:.2f} "
        f"(ln V {math.log(GPT2_VOCAB):.2f})"
    )


def stopped_and_resumed(device: torch.device, data_dir: Path, run_dir: Path, args) -> tuple[bool, str]:
    """A cpu-fast-style run (Muon, fp16 with the scaler, --compile) stopped halfway, resumed, and compared
    with the same run uninterrupted."""
    from nanogpt_cli.training.plan import plan_run
    from nanogpt_cli.training.request import RunRequest
    from nanogpt_cli.training.trainer import train

    flags = dict(
        preset=args.run_preset,
        data="check",
        gradient_accumulation_steps=1,
        data_dir=str(data_dir),
        device=str(device),
        dtype="float16",
        optimizer="muon",
        compile=True,
        qk_norm=True,
        mlp="relu2",
        logit_softcap=30.0,
        max_iters=args.run_steps,
        eval_interval=args.run_steps // 2,
        eval_iters=2,
        log_interval=args.run_steps // 2,
        warmup_iters=2,
        lr_schedule="wsd",
    )
    whole = train(plan_run(RunRequest(flags, out=run_dir / "whole")))
    train(plan_run(RunRequest({**flags, "stop_at": args.run_steps // 2}, out=run_dir / "run")))
    resumed = train(plan_run(RunRequest({**flags}, out=run_dir / "run", resume=True)))
    ok = (
        resumed.step == whole.step == args.run_steps
        and math.isfinite(resumed.val_loss)
        and abs(resumed.val_loss - whole.val_loss) < 1e-2
    )
    return ok, (
        f"{args.run_steps} updates: val loss {whole.val_loss:.4f} uninterrupted, {resumed.val_loss:.4f} "
        f"stopped at {args.run_steps // 2} and resumed"
    )


def sampling_and_eval(device: torch.device, run_dir: Path, data_dir: Path) -> list[tuple[str, bool, str]]:
    from nanogpt_cli.data import open_split
    from nanogpt_cli.inference.engine import generate
    from nanogpt_cli.inference.evaluate import score_tokens
    from nanogpt_cli.interop.loading import load_for_inference

    loaded = load_for_inference(run_dir, device=str(device), dtype=Dtype.float32)
    model = loaded.model
    prompt = torch.tensor([[1, 2, 3, 4]], device=device)
    cached = generate(model, prompt, 24, temperature=0.0, use_cache=True)
    full = generate(model, prompt, 24, temperature=0.0, use_cache=False)
    same = torch.equal(cached, full)
    rows = [
        (
            "greedy sampling, cache vs none",
            same,
            "identical 24 tokens" if same else f"differ from token {int((cached != full).nonzero()[0, 1]) - 4}",
        )
    ]
    tokens = next(iter(open_split(data_dir, "check", "val")))[:2000]
    nll_dev, n = score_tokens(model, tokens, None, 8, vocab_size=loaded.tokenizer.vocab_size)
    nll_cpu, _ = score_tokens(model.to("cpu"), tokens, None, 8, vocab_size=loaded.tokenizer.vocab_size)
    rel = abs(nll_dev - nll_cpu) / max(abs(nll_cpu), 1e-12)
    rows.append(
        (
            f"eval {device} vs cpu (fp32)",
            rel < 1e-4,
            f"{nll_dev / n:.6f} vs {nll_cpu / n:.6f} nats/token, relative difference {rel:.1e}",
        )
    )
    return rows


def run_check(rows: list, name: str, fn, *a) -> None:
    started = time.perf_counter()
    try:
        ok, detail = fn(*a)
    except Exception as e:  # a check that raises is a failed check; the others still run
        traceback.print_exc()
        ok, detail = False, f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
    rows.append([name, "ok" if ok else "FAILED", detail, f"{time.perf_counter() - started:.0f} s"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--preset", default=None, help="model shapes (default: gpt2-124m on CUDA, tiny on the CPU)")
    p.add_argument("--steps", type=int, default=None, help="updates per throughput row (default 30; 20 on the CPU)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per throughput update")
    p.add_argument("--run-steps", type=int, default=40, help="updates of the stopped-and-resumed run")
    p.add_argument("--run-preset", default=None, help="its shapes (default: cpu-fast on CUDA, --preset on the CPU)")
    p.add_argument("--lr", type=float, default=None, help="throughput rows' learning rate (1e-3; 1e-2 on the CPU)")
    args = p.parse_args()
    device = resolve_device(args.device)
    gpu = device.type == "cuda"
    args.preset = args.preset or ("gpt2-124m" if gpu else "tiny")
    args.steps = args.steps or (30 if gpu else 20)
    args.run_preset = args.run_preset or ("cpu-fast" if gpu else args.preset)
    args.batch_size = args.batch_size or 8
    args.lr = args.lr or (1e-3 if gpu else 1e-2)
    values = preset_values(args.preset)
    cfg = GPTConfig(**{k: v for k, v in values.items() if k in GPTConfig.__dataclass_fields__})
    print(environment(device), flush=True)

    rows: list[list] = []
    run_check(rows, "flash attention bf16 fwd+bwd", check_flash, device, args)
    for compile in (False, True):
        for vocab in (GPT2_VOCAB, PADDED_VOCAB):
            name = f"{args.preset} {'compiled' if compile else 'eager'}, vocab {vocab:,}"
            run_check(rows, name, throughput, device, cfg, vocab, compile, args)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        from nanogpt_cli.data import prepare

        rng = random.Random(0)
        text = "".join(rng.choice("abcdefgh \n") for _ in range(200_000 if gpu else 40_000))
        prepare_ok = True
        try:
            (tmp / "check.txt").write_text(text)
            prepare(str(tmp / "check.txt"), "check", tokenizer="char", data_dir=tmp / "data")
        except Exception:
            traceback.print_exc()
            prepare_ok = False
        run_check(
            rows,
            "Muon + fp16 + --compile, stopped and resumed",
            stopped_and_resumed,
            device,
            tmp / "data",
            tmp / "runs",
            args,
        )
        if prepare_ok and (tmp / "runs" / "whole").is_dir():
            for name, ok, detail in _safe_rows(sampling_and_eval, device, tmp / "runs" / "whole", tmp / "data"):
                rows.append([name, "ok" if ok else "FAILED", detail, ""])
        else:
            rows.append(["sampling and eval", "FAILED", "no trained run to load", ""])
    table(f"GPU check on {device} ({args.preset})", ["check", "result", "figures", "time"], rows)
    failed = [r[0] for r in rows if r[1] != "ok"]
    print(
        f"{len(rows) - len(failed)} of {len(rows)} checks passed" + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


def _safe_rows(fn, *a) -> list[tuple[str, bool, str]]:
    try:
        return fn(*a)
    except Exception as e:
        traceback.print_exc()
        return [("sampling and eval", False, f"{type(e).__name__}: {str(e)[:100]}")]


if __name__ == "__main__":
    sys.exit(main())
