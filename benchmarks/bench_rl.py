"""Held-out accuracy of the worked example for preference tuning and RL (examples/count_letters.py): a base model
pre-trained briefly on Tiny Shakespeare (bytes), an SFT on a small subset of the counting conversations, then
GRPO from that SFT with the exact reward, and DPO from it on pairs of a right and a wrong count. Prints one table.

    python benchmarks/bench_rl.py                       # the README's flags, in a temporary folder
    python benchmarks/bench_rl.py --work /tmp/rl        # keep the data and runs

Accuracy is the exact match of the greedy reply (temperature 0, stripped) with the number of letters, over the
held-out words, none of which is in a training file. Every command is the `nanogpt` CLI in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_finetune import BASE_FLAGS, accuracy, load_avg, nanogpt  # noqa: E402 (it sets PYTHONPATH too)
from common import ROOT, shakespeare_path, table  # noqa: E402

F32 = ["--dtype", "float32", "--no-plot"]
SFT_FLAGS = "--max-iters 120 --learning-rate 3e-3 --warmup-iters 10"
GRPO_FLAGS = "--max-iters 120 --batch-size 8 --group-size 8 --max-new-tokens 16 --learning-rate 1e-3 --warmup-iters 0"
GRPO_FLAGS += " --kl 0.05 --eval-interval 40 --log-interval 10"
DPO_FLAGS = "--max-iters 100 --batch-size 16 --learning-rate 1e-3 --warmup-iters 0 --beta 0.1 --eval-interval 50"


def last_eval(run: Path, key: str) -> float | None:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    values = [r[key] for r in records if r.get("kind") == "eval" and key in r]
    return values[-1] if values else None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, help="keep the data and runs here (default: a temporary folder)")
    p.add_argument("--reuse", action="store_true", help="keep the runs already in --work (their time is not shown)")
    p.add_argument("--sft-rows", type=int, default=200, help="conversations the SFT trains on (default 200)")
    p.add_argument("--sft-flags", default=SFT_FLAGS)
    p.add_argument("--grpo-flags", default=GRPO_FLAGS)
    p.add_argument("--dpo-flags", default=DPO_FLAGS)
    args = p.parse_args()
    work = (args.work or Path(tempfile.mkdtemp(prefix="bench-rl-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    print(f"load average before: {load_avg()}", flush=True)
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "count_letters.py"), "--out", str(work)]
        + ["--train", "2000", "--heldout", "200", "--sft", str(args.sft_rows), "--pairs", "2000"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    for source, name, fmt in [
        (str(shakespeare_path()), "shk-byte", "text"),
        ("count-sft.jsonl", "count-sft", "chat"),
        ("count-train.jsonl", "count-prompts", "prompts"),
        ("count-pairs.jsonl", "count-pairs", "preference"),
    ]:
        command = [sys.executable, "-m", "nanogpt_cli", "prepare", source, "--name", name, "--format", fmt]
        subprocess.run([*command, "--tokenizer", "byte"], cwd=work, check=True, stdout=subprocess.DEVNULL)
    seconds = {}
    GRPO = ["finetune", "--method", "grpo", "--init-from", "sft"]
    DPO = ["finetune", "--method", "dpo", "--init-from", "sft"]
    steps = [
        ("base", ["train", "--data", "shk-byte", *BASE_FLAGS.split()]),
        ("sft", ["finetune", "--init-from", "base", "--data", "count-sft", *args.sft_flags.split(), *F32]),
        ("grpo", [*GRPO, "--data", "count-prompts", *args.grpo_flags.split(), *F32]),
        ("dpo", [*DPO, "--data", "count-pairs", *args.dpo_flags.split(), *F32]),
        ("dpo-rpo", [*DPO, "--data", "count-pairs", *args.dpo_flags.split(), "--rpo-alpha", "1", *F32]),
    ]
    for name, command in steps:
        if args.reuse and (work / name / "model.safetensors").is_file():
            continue
        seconds[name] = nanogpt([*command, "--out", name, "--force"], work)
        print(f"{name} in {seconds[name]:.0f} s (load {load_avg()})", flush=True)
    heldout = [json.loads(line) for line in (work / "count-heldout.jsonl").read_text().splitlines()]
    rows, accs = [], {}
    labels = {
        "base": "base (50 updates of Tiny Shakespeare)",
        "sft": f"SFT on {args.sft_rows} conversations",
        "grpo": "GRPO from the SFT (exact reward)",
        "dpo": "DPO from the SFT (right vs wrong count)",
        "dpo-rpo": "DPO with --rpo-alpha 1, from the SFT",
    }
    for name, label in labels.items():
        accs[name], replies = accuracy(work / name, heldout)
        extra = ""
        if name == "grpo":
            extra = f"val reward {last_eval(work / name, 'val_reward'):.1%}"
        if name.startswith("dpo"):
            extra = f"val preference accuracy {last_eval(work / name, 'val_accuracy'):.1%}"
        gain = f"{(accs[name] - accs['sft']) * 100:+.1f}" if name not in ("base", "sft") else ""
        rows.append(
            [
                label,
                f"{accs[name]:.1%}",
                gain,
                f"{seconds[name]:.0f} s" if name in seconds else "",
                extra,
                " | ".join(map(repr, replies)),
            ]
        )
    table(
        f"held-out accuracy on {len(heldout)} words (greedy, exact match); load {load_avg()}",
        ["model", "accuracy", "points over SFT", "time", "training metric", "first replies"],
        rows,
    )


if __name__ == "__main__":
    main()
