"""Held-out accuracy of the worked example (examples/reverse_words.py): a base model pre-trained briefly on Tiny
Shakespeare (bytes), the same model fine-tuned on the reversal conversations with the loss mask, and fine-tuned
the same way without it. Prints one table.

    python benchmarks/bench_finetune.py                    # base: 60 s of cpu-fast; fine-tunes: 300 updates
    python benchmarks/bench_finetune.py --base checkpoints/base --iters 150

Accuracy is the exact match of the greedy reply (temperature 0, stripped) with the reversed word, over the
held-out words, none of which is in the training file. Without the mask means: the same conversations and
the same token ids, with every token in the loss, user turns and role lines included. It is prepared with a
template that renders the same text as the default one but puts the whole conversation inside
`{% generation %}`, which is an all-ones mask. Both fine-tunes start from the same base weights with the same
flags, seed and batches.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, shakespeare_path, table  # noqa: E402

from nanogpt_cli.chat import ChatSession  # noqa: E402
from nanogpt_cli.chat_template import DEFAULT_TEMPLATE, ChatTemplate  # noqa: E402
from nanogpt_cli.data import prepare  # noqa: E402
from nanogpt_cli.data.chat import prepare_chat  # noqa: E402
from nanogpt_cli.events import NoDisplay  # noqa: E402
from nanogpt_cli.plan import plan_run  # noqa: E402
from nanogpt_cli.sample import SampleSettings  # noqa: E402
from nanogpt_cli.trainer import train  # noqa: E402

# the default template's text, with the whole conversation in the loss
ALL_TOKENS = (
    "{% generation %}"
    + DEFAULT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    + "{% endgeneration %}"
)


def fine_tune(base: Path, data: str, data_dir: Path, out: Path, args) -> float:
    """Train from the base's weights on a chat dataset; the seconds it took."""
    flags = {
        "data": data,
        "data_dir": str(data_dir),
        "max_iters": args.iters,
        "batch_size": args.batch_size,
        "learning_rate": args.learning_rate,
        "min_lr": args.learning_rate / 10,
        "warmup_iters": max(1, args.iters // 10),
        "eval_interval": args.iters,
        "eval_iters": 5,
        "dtype": args.dtype,
        "device": "cpu",
        "seed": 1337,
    }
    t0 = time.perf_counter()
    train(plan_run(flags, out=out, init_from=str(base)), NoDisplay())
    return time.perf_counter() - t0


def accuracy(source: Path, heldout: list[dict], template: ChatTemplate | None = None) -> tuple[float, list[str]]:
    """Exact-match accuracy of greedy one-turn replies, all decoded as one batch; and the first few replies."""
    session = ChatSession.load(source, SampleSettings(temperature=0.0), device="cpu", dtype="float32")
    template = template or session.template
    questions = [[m for m in row["messages"] if m["role"] != "assistant"] for row in heldout]
    answers = [row["messages"][-1]["content"] for row in heldout]
    prompts = [template.tokens(q, session.tokenizer) for q in questions]
    settings = SampleSettings(temperature=0.0, max_new_tokens=16, stop=session.settings.stop + template.stop)
    replies = [r.text.strip() for r in session.sampler.generate_many(prompts, settings)]
    return sum(r == a for r, a in zip(replies, answers)) / len(answers), replies[:3]


def load_avg() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", type=Path, help="a byte-level base run to start from (default: train one)")
    p.add_argument("--base-seconds", type=float, default=60, help="pre-training time of the base (default 60)")
    p.add_argument("--iters", type=int, default=300, help="fine-tuning updates (default 300)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--learning-rate", type=float, default=2e-3)
    p.add_argument("--train", type=int, default=20_000, help="training conversations")
    p.add_argument("--heldout", type=int, default=200, help="held-out conversations")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--work", type=Path, help="keep the data and runs here (default: a temporary folder)")
    args = p.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-finetune-"))
    data_dir = work / "data"
    print(f"load average before: {load_avg()}", flush=True)
    base = args.base
    if base is None:
        prepare(str(shakespeare_path()), "shk-byte", tokenizer="byte", data_dir=data_dir)
        base = work / "base"
        flags = {"preset": "cpu-fast", "data": "shk-byte", "data_dir": str(data_dir), "max_time": args.base_seconds}
        train(plan_run({**flags, "dtype": args.dtype, "device": "cpu"}, out=base, force=True), NoDisplay())
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "reverse_words.py"), "--out", str(work)]
        + ["--train", str(args.train), "--heldout", str(args.heldout)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    all_tokens = work / "all-tokens.jinja"
    all_tokens.write_text(ALL_TOKENS, encoding="utf-8")
    source = str(work / "reverse-train.jsonl")
    masked = prepare_chat(source, "reverse", tokenizer="byte", data_dir=str(data_dir))
    prepare_chat(source, "reverse-all", tokenizer="byte", data_dir=str(data_dir), chat_template=str(all_tokens))
    heldout = [json.loads(line) for line in (work / "reverse-heldout.jsonl").read_text().splitlines()]
    seconds = {}
    for name, data in (("masked", "reverse"), ("unmasked", "reverse-all")):
        seconds[name] = fine_tune(base, data, data_dir, work / name, args)
        print(f"fine-tuned {name} in {seconds[name]:.0f} s (load {load_avg()})", flush=True)
    chat_template = ChatTemplate(DEFAULT_TEMPLATE)
    rows = []
    for label, run, template, secs in (
        ("base, plain transcript (as nanogpt chat gives it)", base, None, None),
        ("base, the fine-tunes' template", base, chat_template, None),
        ("fine-tuned with the loss mask", work / "masked", None, seconds["masked"]),
        ("fine-tuned without the mask (every token)", work / "unmasked", None, seconds["unmasked"]),
    ):
        acc, replies = accuracy(run, heldout, template)
        rows.append([label, f"{acc:.1%}", f"{secs:.0f} s" if secs else "", " | ".join(replies)])
    trained = masked.trained_tokens
    table(
        f"held-out accuracy, {len(heldout)} words, greedy exact match; {args.iters} updates x {args.batch_size} "
        f"rows; {trained:,} of {masked.train_tokens + masked.val_tokens:,} tokens in the mask; "
        f"load {load_avg()}",
        ["model", "accuracy", "fine-tune", "first replies"],
        rows,
    )
    words = [row["messages"][0]["content"].split()[-1] for row in heldout[:3]]
    print(f"first held-out words: {' | '.join(words)}")


if __name__ == "__main__":
    main()
