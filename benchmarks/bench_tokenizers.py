"""Tokenizers side by side on Tiny Shakespeare: bits per byte after the same wall time of training, tokens per
byte and parameters (the `tiny` preset with gpt2, char, byte and trained BPE vocabularies of 512 / 2,048 / 8,192),
then tokenizer training speed and encode speed against tiktoken's gpt2 on the same text.

    python benchmarks/bench_tokenizers.py                  # 60 s of training per tokenizer, one thread
    python benchmarks/bench_tokenizers.py --seconds 20     # a quicker look

Bits per byte is the model's loss in bits over the UTF-8 bytes of the validation text, so it compares models
whose tokens differ in size; every run scores the same validation bytes (the text's last 10%, which neither the
models nor the trained vocabularies see). Each run gets
`--max-time` seconds (its schedule follows the clock) and `--threads` CPU threads. A loaded machine slows the
runs unequally: note `uptime` beside the figures.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import shakespeare_path, table  # noqa: E402

from nanogpt_cli.data import prepare  # noqa: E402
from nanogpt_cli.data.tokenizer_train import train_tokenizer  # noqa: E402
from nanogpt_cli.inference.evaluate import perplexity_of_files  # noqa: E402
from nanogpt_cli.inspect.catalog import model_counts  # noqa: E402
from nanogpt_cli.interop.loading import load_for_inference  # noqa: E402
from nanogpt_cli.tokenizer import build_tokenizer  # noqa: E402
from nanogpt_cli.training.events import NoDisplay  # noqa: E402
from nanogpt_cli.training.plan import plan_run  # noqa: E402
from nanogpt_cli.training.request import RunRequest  # noqa: E402
from nanogpt_cli.training.trainer import train  # noqa: E402

TRAINED = (512, 2048, 8192)


def split_text(text_path: Path, work: Path) -> tuple[Path, Path]:
    """train.txt (the first 90% of the text, cut at a line end) and val.txt (the rest): every tokenizer is scored
    on the same validation bytes, and its vocabulary (char, trained BPE) never saw them."""
    text = text_path.read_text(encoding="utf-8")
    cut = text.index("\n", int(len(text) * 0.9)) + 1
    (work / "train.txt").write_text(text[:cut], encoding="utf-8")
    (work / "val.txt").write_text(text[cut:], encoding="utf-8")
    return work / "train.txt", work / "val.txt"


def quality(train_path: Path, val_path: Path, work: Path, seconds: float, tokenizers: list[str]) -> list[list]:
    rows = []
    for name in tokenizers:
        data_dir = work / "data"
        spec = str(work / "tokenizers" / name) if name.startswith("bpe") else name
        prepared = prepare(str(train_path), name, tokenizer=spec, data_dir=data_dir)
        plan = plan_run(
            RunRequest(
                {
                    "preset": "tiny",
                    "data": name,
                    "data_dir": str(data_dir),
                    "device": "cpu",
                    "dtype": "float32",
                    "max_iters": 1_000_000,
                    "eval_interval": 1_000_000,
                    "max_time": seconds,
                },
                out=work / "runs" / name,
            )
        )
        result = train(plan, NoDisplay())
        loaded = load_for_inference(work / "runs" / name, last=True, device="cpu", dtype="float32")
        ev = perplexity_of_files(loaded.model, loaded.tokenizer, [val_path], batch_size=64)
        params, non_embedding, _ = model_counts(plan.model)
        rows.append(
            [
                name,
                f"{loaded.tokenizer.vocab_size:,}",
                f"{ev.tokens / ev.bytes:.3f}",
                f"{params:,}",
                f"{non_embedding:,}",
                f"{result.step:,}",
                f"{result.tokens / prepared.train_tokens:.2f}",
                f"{ev.loss:.3f}",
                f"{ev.bits_per_byte:.3f}",
            ]
        )
        print(f"{name}: {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def speed(text_path: Path, train_path: Path, work: Path, rounds: int) -> tuple[list[list], list[list]]:
    """Training (on train.txt, so the vocabularies never see the validation text) and encoding (of the whole
    text) speeds."""
    text = text_path.read_text(encoding="utf-8")
    mb = len(text.encode("utf-8")) / 1e6
    train_rows = []
    for size in TRAINED:
        result = train_tokenizer(str(train_path), f"bpe{size}", size, tokenizers_dir=work / "tokenizers")
        train_mb = train_path.stat().st_size / 1e6
        train_rows.append([f"bpe{size}", f"{result.elapsed_s:.2f}", f"{train_mb / result.elapsed_s:.2f}"])
    encode_rows = []
    base = None
    for name in ["gpt2", *(str(work / "tokenizers" / f"bpe{s}") for s in TRAINED)]:
        tok = build_tokenizer(name)
        tok.encode(text[:10_000])  # warm up
        t0 = time.perf_counter()
        for _ in range(rounds):
            ids = tok.encode(text)
        per_round = (time.perf_counter() - t0) / rounds
        base = base or per_round
        encode_rows.append(
            [
                Path(name).name,
                f"{len(ids):,}",
                f"{mb / per_round:.2f}",
                f"{len(ids) / per_round / 1e6:.2f}",
                f"{base / per_round:.2f}x",
            ]
        )
    return train_rows, encode_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="training wall time per tokenizer")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3, help="encodes of the whole text per tokenizer")
    parser.add_argument("--only", nargs="*", help="a subset of gpt2 char byte bpe512 bpe2048 bpe8192")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))  # the BPE trainer's threads
    text_path = shakespeare_path()
    print(
        f"load before: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} cores; {args.threads} thread(s)",
        file=sys.stderr,
    )
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        train_path, val_path = split_text(text_path, work)
        train_rows, encode_rows = speed(text_path, train_path, work, args.rounds)
        names = args.only or ["gpt2", "char", "byte", *(f"bpe{s}" for s in TRAINED)]
        rows = quality(train_path, val_path, work, args.seconds, names)
        train_mb = train_path.stat().st_size / 1e6
    table(
        f"tiny preset, {args.seconds:g} s of training each, Tiny Shakespeare val (bits per byte: lower is better)",
        [
            "tokenizer",
            "vocab",
            "tokens/byte",
            "params",
            "non-embedding",
            "steps",
            "epochs",
            "val loss/token",
            "val bpb",
        ],
        rows,
    )
    table(
        f"BPE training on the first 90% of Tiny Shakespeare ({train_mb:.2f} MB, Hugging Face tokenizers' trainer)",
        ["vocabulary", "seconds", "MB/s"],
        train_rows,
    )
    table(
        "encoding all of Tiny Shakespeare (tiktoken, one thread)",
        ["tokenizer", "tokens", "MB/s", "M tokens/s", "speed vs gpt2"],
        encode_rows,
    )
    print(f"load after: {os.getloadavg()[0]:.2f} (1 min)", file=sys.stderr)


if __name__ == "__main__":
    main()
