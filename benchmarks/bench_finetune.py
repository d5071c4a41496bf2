"""Held-out accuracy of the worked example (examples/count_letters.py): a base model pre-trained briefly on Tiny
Shakespeare (bytes), the same model fine-tuned on the reversal conversations with the loss mask, and fine-tuned
the same way without it. Prints one table.

    python benchmarks/bench_finetune.py                             # the README's base and fine-tune flags
    python benchmarks/bench_finetune.py --base checkpoints/base --masked checkpoints/count   # reuse its runs

Accuracy is the exact match of the greedy reply (temperature 0, stripped) with the number of letters, over the
held-out words, none of which is in the training file. Without the mask means: the same conversations and
the same token ids, with every token in the loss, user turns and role lines included. It is prepared with a
template that renders the same text as the default one but puts the whole conversation inside
`{% generation %}`, which is an all-ones mask. Both fine-tunes run `nanogpt finetune` from the same base
weights with the same flags, seed and batches.
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

from nanogpt_cli.data import prepare  # noqa: E402
from nanogpt_cli.data.chat import prepare_chat  # noqa: E402
from nanogpt_cli.data.chat_template import DEFAULT_TEMPLATE, ChatTemplate  # noqa: E402
from nanogpt_cli.inference.chat import ChatSession  # noqa: E402
from nanogpt_cli.inference.sample import SampleSettings  # noqa: E402

# what the README runs
BASE_FLAGS = "--preset tiny --n-head 4 --n-embd 64 --block-size 128 --dtype float32"
FINETUNE_FLAGS = "--max-iters 300 --learning-rate 3e-3 --warmup-iters 30 --dtype float32"

# the default template's text, with the whole conversation in the loss
ALL_TOKENS = (
    "{% generation %}"
    + DEFAULT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    + "{% endgeneration %}"
)


def nanogpt(args: list[str], cwd: Path) -> float:
    """Run one nanogpt command in a fresh process, as the README does; the seconds it took."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "nanogpt_cli", *args, "-q"], cwd=cwd, env=env, check=True)
    return time.perf_counter() - t0


def accuracy(source: Path, heldout: list[dict], template: ChatTemplate | None = None) -> tuple[float, list[str]]:
    """Exact-match accuracy of greedy one-turn replies (stripped), all decoded as one batch; and the start of the
    first few replies as written."""
    session = ChatSession.load(source, SampleSettings(temperature=0.0), device="cpu", dtype="float32")
    template = template or session.template
    questions = [[m for m in row["messages"] if m["role"] != "assistant"] for row in heldout]
    answers = [row["messages"][-1]["content"] for row in heldout]
    prompts = [template.tokens(q, session.tokenizer) for q in questions]
    settings = SampleSettings(temperature=0.0, max_new_tokens=16, stop=session.settings.stop + template.stop)
    texts = [r.text for r in session.sampler.generate_many(prompts, settings)]
    return sum(t.strip() == a for t, a in zip(texts, answers)) / len(answers), [t[:12] for t in texts[:3]]


def load_avg() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", type=Path, help="a byte-level base run (default: train one as the README does)")
    p.add_argument("--base-flags", default=BASE_FLAGS, help=f"nanogpt train flags of the base (default: {BASE_FLAGS})")
    p.add_argument("--flags", default=FINETUNE_FLAGS, help=f"nanogpt finetune flags (default: {FINETUNE_FLAGS})")
    p.add_argument("--masked", type=Path, help="a masked fine-tune of --base with --flags already done")
    p.add_argument("--unmasked", type=Path, help="the same without the mask (on ALL_TOKENS data), already done")
    p.add_argument("--train", type=int, default=20_000, help="training conversations")
    p.add_argument("--heldout", type=int, default=200, help="held-out conversations")
    p.add_argument("--work", type=Path, help="keep the data and runs here (default: a temporary folder)")
    args = p.parse_args()
    work = (args.work or Path(tempfile.mkdtemp(prefix="bench-finetune-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    data_dir = work / "data"
    print(f"load average before: {load_avg()}", flush=True)
    base = args.base.resolve() if args.base else None
    if base is None:
        prepare(str(shakespeare_path()), "shk-byte", tokenizer="byte", data_dir=data_dir)
        base = work / "base"
        secs = nanogpt(["train", "--data", "shk-byte", *args.base_flags.split(), "--out", str(base), "--force"], work)
        print(f"base trained in {secs:.0f} s (load {load_avg()})", flush=True)
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "count_letters.py"), "--out", str(work)]
        + ["--train", str(args.train), "--heldout", str(args.heldout)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    all_tokens = work / "all-tokens.jinja"
    all_tokens.write_text(ALL_TOKENS, encoding="utf-8")
    source = str(work / "count-train.jsonl")
    masked = prepare_chat(source, "count", tokenizer="byte", data_dir=str(data_dir))
    prepare_chat(source, "count-all", tokenizer="byte", data_dir=str(data_dir), chat_template=str(all_tokens))
    heldout = [json.loads(line) for line in (work / "count-heldout.jsonl").read_text().splitlines()]
    given = {"masked": args.masked, "unmasked": args.unmasked}
    runs = {name: path.resolve() if path else work / name for name, path in given.items()}
    seconds = {}
    for name, data in (("masked", "count"), ("unmasked", "count-all")):
        if given[name]:
            continue
        flags = ["finetune", "--init-from", str(base), "--data", data, *args.flags.split()]
        seconds[name] = nanogpt([*flags, "--out", str(runs[name]), "--force"], work)
        print(f"fine-tuned {name} in {seconds[name]:.0f} s (load {load_avg()})", flush=True)
    chat_template = ChatTemplate(DEFAULT_TEMPLATE)
    rows = []
    for label, run, template, secs in (
        ("base, plain transcript (as nanogpt chat gives it)", base, None, None),
        ("base, the fine-tunes' template", base, chat_template, None),
        ("fine-tuned with the loss mask", runs["masked"], None, seconds.get("masked")),
        ("fine-tuned without the mask (every token)", runs["unmasked"], None, seconds.get("unmasked")),
    ):
        acc, replies = accuracy(run, heldout, template)
        rows.append([label, f"{acc:.1%}", f"{secs:.0f} s" if secs else "", " | ".join(map(repr, replies))])
    words = [row["messages"][0]["content"].split()[-1] for row in heldout[:3]]
    table(
        f"held-out accuracy on {len(heldout)} words (greedy, exact match); finetune {args.flags}; "
        f"{masked.trained_tokens:,} of {masked.train_tokens + masked.val_tokens:,} tokens in the mask; "
        f"load {load_avg()}",
        ["model", "accuracy", "fine-tune time", f"replies to {' | '.join(words)}"],
        rows,
    )


if __name__ == "__main__":
    main()
