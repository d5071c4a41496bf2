"""A synthetic chat dataset for a task a base model cannot do: count the letters of a word.

    python examples/count_letters.py            # writes count-train.jsonl and count-heldout.jsonl

    python examples/count_letters.py --train 2000 --sft 200 --pairs 2000   # also count-sft.jsonl (the first 200
                                                    # training conversations) and count-pairs.jsonl (for DPO)

Each line is one conversation, {"messages": [{"role": "user", "content": "count castle"},
{"role": "assistant", "content": "6"}]}, ready for `nanogpt prepare --format chat`. The words are random
lowercase letters (3 to 9 of them), so the model cannot have seen the answers in its pre-training text, and no
held-out word appears in the training file: a model that gets them right has learnt to count, not to recall.
"""

import argparse
import json
import random
import string
from pathlib import Path


def conversation(word: str) -> dict:
    return {
        "messages": [{"role": "user", "content": f"count {word}"}, {"role": "assistant", "content": str(len(word))}]
    }


def pair(word: str, rng: random.Random) -> dict:
    """A preference pair in TRL's conversational shape: the right count chosen, a wrong one (off by 1 to 3)
    rejected."""
    wrong = len(word) + rng.choice([-3, -2, -1, 1, 2, 3])
    prompt = [{"role": "user", "content": f"count {word}"}]
    reply = [{"role": "assistant", "content": str(len(word))}]
    return {"prompt": prompt, "chosen": reply, "rejected": [{"role": "assistant", "content": str(max(wrong, 0))}]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=20_000, help="training conversations (default 20,000)")
    parser.add_argument("--heldout", type=int, default=200, help="held-out conversations (default 200)")
    parser.add_argument("--min-letters", type=int, default=3)
    parser.add_argument("--max-letters", type=int, default=9)
    parser.add_argument("--sft", type=int, default=0, help="also write the first N training conversations apart")
    parser.add_argument("--pairs", type=int, default=0, help="also write this many preference pairs (default 0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for the two files (default: here)")
    args = parser.parse_args()
    rng = random.Random(args.seed)

    def word() -> str:
        return "".join(rng.choices(string.ascii_lowercase, k=rng.randint(args.min_letters, args.max_letters)))

    heldout: set[str] = set()
    while len(heldout) < args.heldout:
        heldout.add(word())
    train = []
    while len(train) < args.train:
        w = word()
        if w not in heldout:
            train.append(w)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, words in (("count-train.jsonl", train), ("count-heldout.jsonl", sorted(heldout))):
        with open(args.out / name, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(conversation(w)) + "\n" for w in words)
        print(f"wrote {args.out / name} ({len(words):,} conversations)")
    if args.sft:  # a small subset for an SFT that learns the format but not yet the skill
        with open(args.out / "count-sft.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(conversation(w)) + "\n" for w in train[: args.sft])
        print(f"wrote {args.out / 'count-sft.jsonl'} ({min(args.sft, len(train)):,} conversations)")
    if args.pairs:  # words of the training side: the held-out words stay unseen
        with open(args.out / "count-pairs.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(pair(train[i % len(train)], rng)) + "\n" for i in range(args.pairs))
        print(f"wrote {args.out / 'count-pairs.jsonl'} ({args.pairs:,} pairs)")


if __name__ == "__main__":
    main()
