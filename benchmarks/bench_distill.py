"""Distillation against cross-entropy alone: a student distilled from SmolLM2-135M-Instruct and the same student
trained on the same batches with the data's cross-entropy only, for the same number of updates, one after the
other on one thread; then each one's val bits per byte.

    python benchmarks/bench_distill.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --work /tmp/distill --iters 800
    python benchmarks/bench_distill.py --steps     # the step alone: plain, distillation, and autograd's version

Steps, each skipped when its output is there: the GGUF's tokenizer through its Hugging Face export (the data must
be prepared with the teacher's tokenizer); Tiny Shakespeare's first --tokens tokens prepared with it; the
teacher's top-32 labels of the train split (`prepare --teacher`, timed); the distilled run (--iters updates),
then the cross-entropy run to the updates the distilled one made; `eval perplexity` of each run's best weights
on the val split. The load average and the CPU are printed beside each run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, shakespeare_path, table  # noqa: E402

NANOGPT = [sys.executable, "-m", "nanogpt_cli"]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
STUDENT = "--n-layer 4 --n-head 3 --n-embd 192 --block-size 256 --batch-size 4 --dropout 0".split()
SCHEDULE = "--learning-rate 2e-3 --warmup-iters 30 --eval-interval 100 --eval-iters 6 --log-interval 25".split()


def run(args: list[str], log: Path | None = None) -> subprocess.Popen:
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 (the process holds it)
    return subprocess.Popen([*NANOGPT, *args], env=ENV, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)


def check(process: subprocess.Popen, what: str) -> None:
    if process.wait():
        raise SystemExit(f"{what} failed (exit {process.returncode}); see its log")


def bits_per_byte(run_dir: Path, data: list[str]) -> dict:
    command = [*NANOGPT, "eval", "perplexity", "--checkpoint", str(run_dir), *data, "--split", "val"]
    done = subprocess.run(
        [*command, "--dtype", "float32", "--json"],
        env=ENV,
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def autograd_loss(logits, targets, ids, probs, alpha: float):
    """The distillation loss (temperature 1) written with autograd's ops: what DistillHead replaces."""
    import torch

    logq = logits.log_softmax(-1)
    outside = logits.scatter(-1, ids, torch.finfo(logits.dtype).min).logsumexp(-1) - logits.logsumexp(-1)
    rest = (1 - probs.sum(-1)).clamp(min=0)
    kl = (torch.xlogy(probs, probs) - probs * logq.gather(-1, ids)).sum(-1) + torch.xlogy(rest, rest) - rest * outside
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    return alpha * kl.mean() + (1 - alpha) * ce


def time_steps(rounds: int = 2) -> None:
    """Seconds per forward and backward of the example's student on 4 x 512 tokens, one thread: the plain step,
    the distillation step (DistillHead) and the same loss through autograd's ops, alternating."""
    import torch

    from nanogpt_cli.config import GPTConfig
    from nanogpt_cli.model import GPT
    from nanogpt_cli.training.distill import mixed_loss

    torch.set_num_threads(1)
    torch.manual_seed(0)
    V = 49152
    model = GPT(GPTConfig(vocab_size=V, block_size=512, n_layer=4, n_head=3, n_embd=192, dropout=0.0))
    x, y = torch.randint(0, V, (4, 512)), torch.randint(0, V, (4, 512))
    ids, probs = torch.randint(0, V, (4, 512, 32)), torch.softmax(torch.randn(4, 512, 32), -1) * 0.8
    steps = {
        "plain (the model's cross-entropy)": lambda: model(x, y)[1],
        "distillation (DistillHead)": lambda: mixed_loss(model(x)[0], y, ids, probs, 1.0, 0.8, V),
        "distillation (autograd's ops)": lambda: autograd_loss(model(x)[0], y, ids, probs, 0.8),
    }
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            started = time.perf_counter()
            step().backward()
            times[name].append(time.perf_counter() - started)
            model.zero_grad(set_to_none=True)
    plain = sum(times["plain (the model's cross-entropy)"])
    rows = [[k, ", ".join(f"{t:.2f}" for t in v), f"{sum(v) / plain:.2f}x"] for k, v in times.items()]
    table(f"one step, 4 x 512 tokens, 1 thread, load {os.getloadavg()[0]:.1f}", ["step", "seconds", "vs plain"], rows)


def val_curves(ce_dir: Path, student_dir: Path) -> None:
    """Each run's val loss at the same updates (the trainer's evaluations, --eval-iters batches)."""
    curves = []
    for folder in (ce_dir, student_dir):
        lines = (folder / "metrics.jsonl").read_text().splitlines()
        curves.append({e["step"]: e["val_loss"] for e in map(json.loads, lines) if e.get("kind") == "eval"})
    rows = [[f"{s:,}", f"{curves[0][s]:.4f}", f"{curves[1][s]:.4f}"] for s in sorted(curves[1]) if s in curves[0]]
    table("val loss at the same updates (nats/token)", ["updates", "cross-entropy only", "distilled"], rows)


def cpu_model() -> str:
    return next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")


def train(kind: list[str], common: list[str], iters: int, run_dir: Path, log: Path) -> dict:
    """One run to `iters` updates; what it made: updates, tokens, steady ms a step, wall seconds, the load."""
    before, started = os.getloadavg()[0], time.time()
    check(run([*kind, *common, "--max-iters", str(iters), "--out", str(run_dir)], log), f"{kind[0]} {run_dir}")
    trained = json.loads((run_dir / "trainer.json").read_text())
    wall, after = time.time() - started, os.getloadavg()[0]
    print(f"{run_dir.name}: {trained['step']:,} updates in {wall:,.0f} s, load average {before:.1f} -> {after:.1f}")
    return dict(trained, wall=wall, load=(before, after))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, help="the teacher: SmolLM2-135M-Instruct's .gguf")
    parser.add_argument("--work", type=Path, default=Path("/tmp/distill"), help="the data and the tokenizer")
    parser.add_argument("--out", type=Path, default=Path("/tmp/distill/out"), help="the runs and their logs")
    parser.add_argument("--iters", type=int, default=800, help="updates of each run")
    parser.add_argument("--tokens", type=int, default=170_000, help="Tiny Shakespeare's tokens used (10 %% val)")
    parser.add_argument("--alpha", type=float, default=0.9, help="--distill-alpha")
    parser.add_argument("--dtype", default="bfloat16", help="the runs' --dtype (bf16 autocast: 1.5x float32 here)")
    parser.add_argument("--steps", action="store_true", help="only time one training step of each loss")
    args = parser.parse_args()
    if args.steps:
        return time_steps()
    if args.gguf is None:
        parser.error("--gguf names the teacher (or give --steps)")
    work, name = args.work, f"shk-smol-{args.tokens // 1000}k"
    data = ["--data", name, "--data-dir", str(work / "data")]
    if not (work / "smol-hf" / "tokenizer.json").is_file():
        check(run(["export", str(args.gguf), "--format", "hf", "--out", str(work / "smol-hf")]), "export")
    meta = work / "data" / name / "meta.json"
    if not meta.is_file() or "teacher" not in json.loads(meta.read_text()):
        prep = ["prepare", str(shakespeare_path()), "--name", name, "--tokenizer", str(work / "smol-hf")]
        prep += ["--data-dir", str(work / "data"), "--max-tokens", str(args.tokens), "--teacher", str(args.gguf)]
        check(run(prep, work / "prepare.log"), "prepare --teacher")
    teacher = json.loads(meta.read_text())["teacher"]
    common = [*data, *STUDENT, *SCHEDULE, "--device", "cpu", "--dtype", args.dtype, "--threads", "1", "--no-plot"]
    common.append("--force")
    print(f"{cpu_model()}, 1 thread")
    args.out.mkdir(parents=True, exist_ok=True)
    distill = ["finetune", "--method", "distill", "--distill-alpha", str(args.alpha)]
    student = train(distill, common, args.iters, args.out / "student", args.out / "student.log")
    ce = train(["train"], common, student["step"], args.out / "ce", args.out / "ce.log")  # the same updates
    rows = []
    for label, folder, done in (
        ("cross-entropy only", args.out / "ce", ce),
        ("distilled", args.out / "student", student),
    ):
        scored = bits_per_byte(folder, data)
        step = done["speed"]["steady_ms_per_iter"] / 1e3
        rows.append(
            [label, f"{done['step']:,}", f"{done['tokens']:,}", f"{step:.2f} s", f"{done['wall']:,.0f} s"]
            + ["{:.1f} -> {:.1f}".format(*done["load"]), f"{scored['loss']:.4f}", f"{scored['bits_per_byte']:.4f}"]
        )
    ratio = float(rows[1][-1]) / float(rows[0][-1])
    table(
        f"SmolLM2-135M-Instruct -> 4x192 student, {args.dtype}, 1 thread, {cpu_model()}; labels: "
        f"{teacher['seconds']:,.0f} s, {teacher['bytes_per_token']} B/token",
        ["run", "updates", "tokens", "steady step", "wall", "load average", "val loss (best weights)", "val bits/byte"],
        rows,
    )
    val_curves(args.out / "ce", args.out / "student")
    print(f"distilled / cross-entropy bits per byte: {ratio:.3f} ({(1 - ratio) * 100:.1f} % lower)")


if __name__ == "__main__":
    main()
