"""A synthetic chat dataset for a task a base model cannot do: reverse a word, letter by letter.

    python examples/reverse_words.py            # writes reverse-train.jsonl and reverse-heldout.jsonl

Each line is one conversation, {"messages": [{"role": "user", "content": "reverse castle"},
{"role": "assistant", "content": "eltsac"}]}, ready for `nanogpt prepare --format chat`. The words are random
lowercase letters (3 to 6 of them), so the model cannot have seen the answers in its pre-training text, and no
held-out word appears in the training file: a model that gets them right has learnt to reverse, not to recall.

No letter appears twice in a word. Then each step of the reversal is unambiguous: find the letter just
written in the word, and write the one before it. A small model learns that in minutes. With repeated letters,
it would also have to learn to tell the occurrences apart by position, which takes much longer.
"""

import argparse
import json
import random
import string
from pathlib import Path


def conversation(word: str) -> dict:
    return {"messages": [{"role": "user", "content": f"reverse {word}"}, {"role": "assistant", "content": word[::-1]}]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=20_000, help="training conversations (default 20,000)")
    parser.add_argument("--heldout", type=int, default=200, help="held-out conversations (default 200)")
    parser.add_argument("--min-letters", type=int, default=3)
    parser.add_argument("--max-letters", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for the two files (default: here)")
    args = parser.parse_args()
    rng = random.Random(args.seed)

    def word() -> str:
        return "".join(rng.sample(string.ascii_lowercase, k=rng.randint(args.min_letters, args.max_letters)))

    heldout: set[str] = set()
    while len(heldout) < args.heldout:
        heldout.add(word())
    train = []
    while len(train) < args.train:
        w = word()
        if w not in heldout:
            train.append(w)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, words in (("reverse-train.jsonl", train), ("reverse-heldout.jsonl", sorted(heldout))):
        with open(args.out / name, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(conversation(w)) + "\n" for w in words)
        print(f"wrote {args.out / name} ({len(words):,} conversations)")


if __name__ == "__main__":
    main()
