"""Training speed from 0.8M to 300M parameters, side by side with nanoGPT's `train.py`: four sizes (4 x 128 at
context 64, then 6 x 384, 12 x 768 and 24 x 1024 at context 256, char-level Tiny Shakespeare), ours with
`--dtype auto` and `--dtype float32` against nanoGPT in fp32 (what its train.py runs on a CPU), each run a fresh
process. One table: steady ms/iter, tokens/s, achieved GFLOP/s, peak RSS and wall, with nanoGPT's figure over
ours as the speed-up.

    python benchmarks/bench_scale.py --nanogpt DIR            # all four sizes, ~10 min on 2 cores
    python benchmarks/bench_scale.py --nanogpt DIR --sizes 0.8M,10M

The nanoGPT files it needs are copied into a temporary folder (its checkout is never written to), and its
Tiny Shakespeare is made by its own `data/shakespeare_char/prepare.py` from our copy of the text. Both sides
train the same architecture: learned positions, exact GELU, LayerNorm without biases, a tied LM head, no
dropout. Both evaluate once at the start on one batch; ours also evaluates and saves at the end (nanoGPT saves
only when an evaluation after step 0 improves, which these short runs never reach), which is in the wall time
but not in ms/iter. ms/iter is the median step after the first 5 on both sides (warm-up); GFLOP/s is our
model's `flops_per_token()` (6 per matmul weight plus attention) times tokens/s, the same count for both.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, shakespeare_path, table  # noqa: E402

# name: (n_layer, n_head, n_embd, block_size, batch_size, iters); batch and iters keep the 300M size's three
# runs to a few minutes on 2 cores
SIZES = {
    "0.8M": (4, 4, 128, 64, 12, 30),
    "10M": (6, 6, 384, 256, 8, 12),
    "85M": (12, 12, 768, 256, 2, 9),
    "300M": (24, 16, 1024, 256, 1, 8),
}
SKIP = 5  # warm-up steps left out of ms/iter, as our own steady-state figure does
NANO_STEP = re.compile(r"iter (\d+): loss [\d.]+, time ([\d.]+)ms")


def run(cmd: list[str], cwd: Path, env: dict) -> tuple[float, int, str]:
    """(wall seconds, peak RSS in bytes, output) of one whole process; its own peak (wait4), not the largest
    child's so far."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd[:4])} ... failed (exit {proc.returncode}):\n{out[-3000:]}")
    return wall, usage.ru_maxrss * 1024, out


def copy_nanogpt(src: Path, dst: Path) -> Path:
    """The files of nanoGPT's train.py, and its Tiny Shakespeare prepared by its own script, under dst."""
    need = ["train.py", "model.py", "configurator.py", "data/shakespeare_char/prepare.py"]
    missing = [n for n in need if not (src / n).is_file()]
    if missing:
        sys.exit(f"{src} does not look like a nanoGPT checkout (no {', '.join(missing)})")
    for name in need:
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / name, dst / name)
    data = dst / "data" / "shakespeare_char"
    shutil.copyfile(shakespeare_path(), data / "input.txt")  # prepare.py downloads only when this is missing
    subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True)
    return dst


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nanogpt", type=Path, required=True, help="a checkout of github.com/karpathy/nanoGPT")
    p.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated subset of {', '.join(SIZES)}")
    p.add_argument("--iters", type=int, default=None, help="iterations per run (default: per size)")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of every run (default: torch's)")
    args = p.parse_args()
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        p.error(f"--sizes: unknown {', '.join(unknown)}; choose from {', '.join(SIZES)}")
    if args.iters is not None and args.iters <= SKIP:
        p.error(f"--iters must be above {SKIP} (the warm-up steps left out)")

    import torch

    from nanogpt_cli.config import GPTConfig
    from nanogpt_cli.model import GPT
    from nanogpt_cli.runs.rundir import RunDir

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)  # for the table's title
    rows, load = [], os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        nano = copy_nanogpt(args.nanogpt.resolve(), tmp / "nanoGPT")
        ours = [sys.executable, "-m", "nanogpt_cli"]
        subprocess.run(
            ours
            + ["prepare", str(shakespeare_path()), "--name", "shk", "--tokenizer", "char"]
            + ["--data-dir", str(tmp / "data")],
            check=True,
            capture_output=True,
            env=env,
        )
        for size in sizes:
            n_layer, n_head, n_embd, block, batch, iters = SIZES[size]
            iters = args.iters or iters
            arch = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block, bias=False, dropout=0.0)
            model = GPT(GPTConfig(vocab_size=65, pos_encoding="learned", mlp="gelu", **arch))
            params, flops_per_token = model.num_params(non_embedding=False), model.flops_per_token()
            del model
            tokens_per_iter = batch * block
            figures = {}
            for dtype in ("auto", "float32"):
                out_dir = tmp / f"ours-{size}-{dtype}"
                cmd = ours + ["train", "--data", "shk", "--data-dir", str(tmp / "data"), "--device", "cpu"]
                cmd += [f"--{k.replace('_', '-')}={v}" for k, v in arch.items() if k != "bias"] + ["--no-bias"]
                cmd += ["--pos-encoding", "learned", "--mlp", "gelu", "--batch-size", str(batch)]
                cmd += ["--max-iters", str(iters), "--eval-interval", str(iters), "--eval-iters", "1"]
                cmd += ["--warmup-iters", "2", "--log-interval", "1", "--dtype", dtype, "--out", str(out_dir)]
                cmd += ["--quiet"]
                wall, rss, _ = run(cmd, tmp, env)
                ms = RunDir(out_dir).read_trainer().speed["steady_ms_per_iter"]
                figures[f"ours, --dtype {dtype}"] = (ms, rss, wall)
                shutil.rmtree(out_dir)
            cmd = [sys.executable, "train.py", "--dataset=shakespeare_char", "--device=cpu", "--compile=False"]
            cmd += ["--dtype=float32", f"--out_dir={tmp / 'nano-out'}", "--wandb_log=False", "--log_interval=1"]
            cmd += [f"--{k}={v}" for k, v in arch.items()]
            cmd += [f"--batch_size={batch}", "--gradient_accumulation_steps=1", "--warmup_iters=2"]
            cmd += [f"--max_iters={iters}", f"--lr_decay_iters={iters}", "--eval_interval=100000", "--eval_iters=1"]
            wall, rss, out = run(cmd, nano, env)
            steps = [float(ms) for it, ms in NANO_STEP.findall(out) if int(it) >= SKIP]
            figures["nanoGPT train.py (fp32)"] = (statistics.median(steps), rss, wall)
            base = figures["nanoGPT train.py (fp32)"][0]
            for name, (ms, rss, wall) in figures.items():
                tps = tokens_per_iter / (ms / 1000)
                rows.append(
                    [
                        f"{size} ({params / 1e6:.1f}M), {n_layer}x{n_embd} ctx {block}, batch {batch}",
                        name,
                        f"{ms:,.1f}",
                        f"{tps:,.0f}",
                        f"{flops_per_token * tps / 1e9:,.1f}",
                        f"{base / ms:.2f}x",
                        f"{rss / 2**30:.2f} GiB",
                        f"{wall:.1f} s",
                    ]
                )
                print(" | ".join(rows[-1]), flush=True)
    load = f"{load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    table(
        f"training steps, {torch.get_num_threads()} threads, load average {load} (speed-up: nanoGPT's ms/iter / ours)",
        ["size", "run", "ms/iter", "tokens/s", "GFLOP/s", "speed-up", "peak RSS", "wall"],
        rows,
    )


if __name__ == "__main__":
    main()
