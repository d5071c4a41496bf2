"""--preset auto against a hand sweep and every preset, at the same --max-time, on three corpora of different kinds.

    python benchmarks/bench_auto.py                                   # everything: 3 corpora x 2, 10, 30 minutes
    python benchmarks/bench_auto.py --corpora prose --budgets 2 --sweep reduced --presets cpu-fast,cpu-char

Corpora (all offline): prose, Tiny Shakespeare (../shared/data/tinyshakespeare.txt); code, the Python files of an
installed package (rich); Russian, the KOI8-R news pages of chardet's test corpus that the Google Cloud SDK ships
(decoded to UTF-8), or the Cyrillic text of pip's vendored chardet models where that is absent. Each is prepared
with a BPE of 4,096 tokens trained on it (`nanogpt tokenizer train`). Every run is `nanogpt train --max-time T` in
a process of its own, one after another; the score is the final weights' bits per byte on the whole val split
(`nanogpt eval perplexity --last`, deterministic: every token scored once), so tokenizers and shapes compare.

The hand sweep (SWEEP, at least 8 points): depths and widths around what auto's rules pick at these budgets,
Muon's and AdamW's rates halved and doubled, and auto's smallest shape trained by the clock past auto's limit of 4
passes over the data, each with the rest of auto's recipe. Target: auto within 2 % of the sweep's best and better
than every preset at every corpus and budget. Each run's line gives its updates, tokens, passes over the training
split and the CPU seconds its training process used (of its wall time: the rest went to other processes).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import shakespeare_path  # noqa: E402

# (label, flags): shapes and rates; with --preset auto, the values not given follow auto's rules
SWEEP = [
    ("2x128", ["--n-layer", "2", "--n-embd", "128", "--n-head", "2"]),
    ("3x128", ["--n-layer", "3", "--n-embd", "128", "--n-head", "2"]),
    ("4x128", ["--n-layer", "4", "--n-embd", "128", "--n-head", "2"]),
    ("4x192", ["--n-layer", "4", "--n-embd", "192", "--n-head", "3"]),
    ("6x192", ["--n-layer", "6", "--n-embd", "192", "--n-head", "3"]),
    ("8x256", ["--n-layer", "8", "--n-embd", "256", "--n-head", "4"]),
    (
        "4x128 rates/2",
        ["--n-layer", "4", "--n-embd", "128", "--n-head", "2", "--muon-lr", "0.01", "--learning-rate", "0.001"],
    ),
    (
        "4x128 rates*2",
        ["--n-layer", "4", "--n-embd", "128", "--n-head", "2", "--muon-lr", "0.04", "--learning-rate", "0.004"],
    ),
    # --max-iters given: the clock ends the run, however many passes over the data it reads
    ("2x128 no pass limit", ["--n-layer", "2", "--n-embd", "128", "--n-head", "2", "--max-iters", "1000000"]),
]
REDUCED = ["2x128", "4x128", "6x192", "4x128 rates*2"]
PRESETS = ["tiny", "cpu-char", "cpu-fast", "cpu-speedrun", "shakespeare-char", "gpt2-124m", "gpt2-350m"]
VOCAB = 4096
LIMIT = 3  # a run (or its scoring) that takes this many times its budget is stopped and reported as failed


def nanogpt(*args: str, capture: bool = True, timeout: float | None = None) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        done = subprocess.run(
            [sys.executable, "-m", "nanogpt_cli", *args],
            env=env,
            capture_output=capture,
            text=True,
            check=False,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"nanogpt {' '.join(args[:2])} ran past {timeout:g} s and was stopped") from None
    if done.returncode != 0:
        raise RuntimeError(f"nanogpt {' '.join(args)} failed:\n{(done.stderr or '')[-2000:]}")
    return done.stdout


def children_cpu_s() -> float:
    """CPU seconds (user and system) of the finished child processes so far."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def corpus_text(kind: str) -> str:
    """The text of one corpus kind, read from files installed on this machine."""
    if kind == "prose":
        return shakespeare_path().read_text(encoding="utf-8")
    if kind == "code":
        import rich

        files = sorted(Path(rich.__file__).parent.rglob("*.py"))
        return "\n\n".join(p.read_text(encoding="utf-8") for p in files)
    if kind == "russian":
        chardet = Path("/usr/lib/google-cloud-sdk/platform/gsutil/third_party/chardet/tests/KOI8-R")
        if chardet.is_dir():
            return "\n\n".join(p.read_bytes().decode("koi8-r", "replace") for p in sorted(chardet.iterdir()))
        pip_models = Path(sysconfig.get_paths()["purelib"]) / "pip/_vendor/chardet/langrussianmodel.py"
        return pip_models.read_text(encoding="utf-8")
    raise SystemExit(f"unknown corpus {kind!r}: prose, code or russian")


def prepare(kind: str, work: Path) -> str:
    """The corpus prepared with a BPE of VOCAB tokens trained on it; its dataset name."""
    name = f"bench-{kind}"
    if (work / "data" / name / "meta.json").is_file():
        return name
    text = work / f"{kind}.txt"
    text.write_text(corpus_text(kind), encoding="utf-8")
    tokenizers, data = str(work / "tokenizers"), str(work / "data")
    nanogpt(
        "tokenizer",
        "train",
        str(text),
        "--name",
        name,
        "--vocab-size",
        str(VOCAB),
        "--tokenizers-dir",
        tokenizers,
        "--force",
    )
    nanogpt(
        "prepare", str(text), "--name", name, "--tokenizer", name, "--tokenizers-dir", tokenizers, "--data-dir", data
    )
    return name


def run(label: str, flags: list[str], data: str, minutes: float, work: Path, threads: list[str]) -> dict:
    """One run, or its failure as a row scoring inf: a preset too large for the time (on a 2-core CPU,
    shakespeare-char's first evaluation of 200 batches, or one update of gpt2-124m's 491,520 tokens, takes longer
    than 2 minutes), stopped at LIMIT times its budget."""
    try:
        return score(label, flags, data, minutes, work, threads)
    except RuntimeError as e:
        result = {"label": label, "data": data, "minutes": minutes, "bpb": float("inf"), "error": str(e)[-400:]}
        print(json.dumps(result), flush=True)
        return result


def score(label: str, flags: list[str], data: str, minutes: float, work: Path, threads: list[str]) -> dict:
    """One training run of `minutes`, then its final weights' bits per byte on the val split."""
    out = work / "runs" / f"{data}-{minutes:g}m-{label.replace(' ', '_').replace('/', 'd').replace('*', 'x')}"
    t0, cpu0 = time.perf_counter(), children_cpu_s()
    nanogpt(
        "train", "--data", data, "--data-dir", str(work / "data"), "--max-time", f"{minutes * 60:g}",
        "--out", str(out), "--force", "--no-plot", "--quiet", *threads, *flags, timeout=LIMIT * minutes * 60,
    )  # fmt: skip
    wall, cpu = time.perf_counter() - t0, children_cpu_s() - cpu0
    t0 = time.perf_counter()
    scored = json.loads(
        nanogpt(
            "eval",
            "perplexity",
            "--checkpoint",
            str(out),
            "--last",
            "--data",
            data,
            "--data-dir",
            str(work / "data"),
            "--json",
            "--dtype",
            "float32",
            *threads,
            timeout=LIMIT * minutes * 60,
        )  # fmt: skip
    )
    config = json.loads((out / "config.json").read_text())
    state = json.loads((out / "trainer.json").read_text())
    train_tokens = json.loads((work / "data" / data / "meta.json").read_text())["train_tokens"]
    shape = config["model"]
    result = {
        "label": label,
        "data": data,
        "minutes": minutes,
        "bpb": scored["bits_per_byte"],
        "loss": scored["loss"],
        "shape": f"{shape['n_layer']}x{shape['n_embd']} ctx {shape['block_size']}",
        "updates": state["step"],
        "tokens": state["tokens"],
        "passes": round(state["tokens"] / train_tokens, 2),
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),  # the training process's (its probe included), of wall_s
        "eval_s": round(time.perf_counter() - t0, 1),
        "load": os.getloadavg()[0],
    }
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpora", default="prose,code,russian")
    ap.add_argument("--budgets", default="2,10,30", help="minutes of training, comma-separated")
    ap.add_argument("--sweep", default="full", help="full, reduced (REDUCED), none, or sweep labels, comma-separated")
    ap.add_argument("--presets", default=",".join(PRESETS), help="comma-separated, or none")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench_auto"))
    ap.add_argument("--results", type=Path, default=None, help="append each run's JSON line to this file")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for every run (default: each run picks)")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    chosen = {"full": [s[0] for s in SWEEP], "reduced": REDUCED, "none": []}.get(args.sweep, args.sweep.split(","))
    sweep = [s for s in SWEEP if s[0] in chosen]
    presets = [] if args.presets == "none" else args.presets.split(",")
    threads = ["--threads", str(args.threads)] if args.threads else []
    rows = []
    for kind in args.corpora.split(","):
        data = prepare(kind, args.work)
        for minutes in [float(b) for b in args.budgets.split(",")]:
            runs = [run("auto", ["--preset", "auto"], data, minutes, args.work, threads)]
            runs += [run(label, ["--preset", "auto", *f], data, minutes, args.work, threads) for label, f in sweep]
            runs += [run(f"preset {p}", ["--preset", p], data, minutes, args.work, threads) for p in presets]
            if args.results:
                with args.results.open("a") as f:
                    f.writelines(json.dumps(r) + "\n" for r in runs)
            auto, others = runs[0], runs[1:]
            swept = [r for r in others if not r["label"].startswith("preset")] or [auto]
            best = min(swept, key=lambda r: r["bpb"])
            best_preset = min(
                (r for r in others if r["label"].startswith("preset")), key=lambda r: r["bpb"], default=None
            )
            rows.append(
                [
                    kind,
                    f"{minutes:g}",
                    f"{auto['bpb']:.4f} ({auto['shape']})",
                    f"{best['bpb']:.4f} ({best['label']})",
                    f"{(auto['bpb'] / best['bpb'] - 1) * 100:+.1f} %",
                    f"{best_preset['bpb']:.4f} ({best_preset['label'][7:]})" if best_preset else "-",
                ]  # fmt: skip
            )
    print("\n| corpus | minutes | auto bpb (shape) | sweep's best | auto vs best | best preset |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
