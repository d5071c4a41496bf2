"""How fast `nanogpt prepare` tokenizes, how much memory and disk it uses, and where its time goes.

    python benchmarks/bench_prepare.py                # 50 MB and 200 MB corpora, --num-proc 1 and 2
    python benchmarks/bench_prepare.py --sizes 20 --procs 1,2,4

A corpus of random-word documents (jsonl, like a web dump) is generated in a temporary folder; each prepare
runs as its own `python -m nanogpt_cli prepare` process with the gpt2 tokenizer. Measured for the whole
process tree (the prepare and its workers): wall time, MB/s of source text, tokens/s, peak RSS (the sum over
the tree, sampled every 50 ms, and the largest single process from getrusage), and the bytes it sent to the
disk (write_bytes of /proc/self/io: a reaped child's I/O counts into its parent's) against the size of the
dataset it wrote. Then one in-process prepare splits the time into tokenizing (what workers parallelize) and
everything else (reading, ordering, writing, hashing: the serial part), for an Amdahl estimate at more cores.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from common import ROOT, table


def make_corpus(path: Path, megabytes: int, seed: int = 0) -> int:
    """A jsonl of documents of 100-3,000 random words (GPT-2's whole-word tokens, Zipf-distributed by their
    id, with sentences and paragraphs); returns its size in bytes."""
    rng = np.random.default_rng(seed)
    vocab = json.loads((ROOT / "nanogpt_cli" / "assets" / "gpt2" / "encoder.json").read_text(encoding="utf-8"))
    words = np.array([w[1:] for w in sorted(vocab, key=vocab.get) if w.startswith("\u0120") and w[1:].isalpha()])
    p = 1.0 / np.arange(1, len(words) + 1)
    p /= p.sum()
    target, size = megabytes * 1_000_000, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < target:
            w = words[rng.choice(len(words), size=int(rng.integers(100, 3000)), p=p)]
            step = int(rng.integers(8, 20))
            w[::step] = np.char.add(w[::step], ".")  # some sentences
            text = " ".join(w.tolist())
            text = text.replace(". ", ".\n\n", text.count(". ") // 10)  # some paragraphs
            line = json.dumps({"text": text.capitalize()}) + "\n"
            f.write(line)
            size += len(line.encode("utf-8"))
    return path.stat().st_size


def tree_rss(pid: int) -> int:
    """Resident bytes of pid and all its descendants, from /proc."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, StopIteration):
            pass
    return total


def write_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("write_bytes:"))


def run_prepare(corpus: Path, data_dir: Path, num_proc: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "nanogpt_cli",
        "prepare",
        str(corpus),
        "--name",
        "bench",
        "--data-dir",
        str(data_dir),
        "--tokenizer",
        "gpt2",
        "--num-proc",
        str(num_proc),
    ]
    written0 = write_bytes()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = 0

    def sample():
        nonlocal peak
        while proc.poll() is None:
            peak = max(peak, tree_rss(proc.pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    _, err = proc.communicate()
    seconds = time.perf_counter() - t0
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"prepare failed: {err}")
    os.sync()
    written = write_bytes() - written0
    meta = json.loads((data_dir / "bench" / "meta.json").read_text())
    output = sum(p.stat().st_size for p in (data_dir / "bench").iterdir())
    return dict(
        seconds=seconds,
        tokens=meta["train_tokens"] + meta["val_tokens"],
        peak_tree=peak,
        peak_one=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
        written=written,
        output=output,
    )


def serial_share(corpus: Path, data_dir: Path) -> tuple[float, float]:
    """(seconds tokenizing, seconds in everything else) of one in-process prepare with one process."""
    sys.path.insert(0, str(ROOT))
    from nanogpt_cli.data import prepare, tokenizing

    spent = [0.0]
    encode = tokenizing.encode_batch

    def timed(*args):
        t = time.perf_counter()
        out = encode(*args)
        spent[0] += time.perf_counter() - t
        return out

    prepare(str(corpus), "warm-up", tokenizer="gpt2", data_dir=data_dir, max_docs=10)  # imports, tokenizer
    tokenizing.encode_batch = timed
    t0 = time.perf_counter()
    prepare(str(corpus), "serial", tokenizer="gpt2", data_dir=data_dir)
    total = time.perf_counter() - t0
    tokenizing.encode_batch = encode
    return spent[0], total - spent[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="50,200", help="corpus sizes in MB, comma-separated")
    parser.add_argument("--procs", default="1,2", help="--num-proc values, comma-separated")
    parser.add_argument("--dir", default=None, help="work folder on the disk to measure (default: a temp dir)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    procs = [int(p) for p in args.procs.split(",")]

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        rows, base = [], {}
        for mb in sizes:
            corpus = tmp / f"corpus-{mb}mb.jsonl"
            t = time.perf_counter()
            corpus_bytes = make_corpus(corpus, mb)
            print(f"generated {corpus_bytes / 1e6:,.0f} MB corpus in {time.perf_counter() - t:.0f} s", flush=True)
            for n in procs:
                r = run_prepare(corpus, tmp / f"data-{mb}-{n}", n)
                base.setdefault(mb, r)
                mbs = corpus_bytes / 1e6 / r["seconds"]
                rows.append(
                    [
                        f"{mb} MB",
                        n,
                        f"{r['seconds']:.1f}",
                        f"{mbs:.2f}",
                        f"{r['tokens'] / r['seconds']:,.0f}",
                        f"{base[mb]['seconds'] / r['seconds']:.2f}x",
                        f"{r['tokens']:,}",
                        f"{r['peak_tree'] / 2**20:,.0f}",
                        f"{r['peak_one'] / 2**20:,.0f}",
                        f"{r['output'] / 1e6:,.1f}",
                        f"{r['written'] / 1e6:,.1f}",
                        f"{r['written'] / r['output']:.2f}",
                    ]
                )
                print(rows[-1], flush=True)
        table(
            "nanogpt prepare, gpt2 tokenizer, jsonl of random-word documents",
            [
                "corpus",
                "--num-proc",
                "seconds",
                "MB/s",
                "tokens/s",
                "speed-up",
                "tokens",
                "peak RSS tree MiB",
                "largest process MiB",
                "output MB",
                "written MB",
                "written / output",
            ],
            rows,
        )

        corpus = tmp / f"corpus-{sizes[0]}mb.jsonl"
        tokenize, other = serial_share(corpus, tmp / "serial")
        size_mb = corpus.stat().st_size / 1e6
        bytes_per_token = corpus.stat().st_size / base[sizes[0]]["tokens"]
        print(
            f"\none process, {sizes[0]} MB: tokenizing {tokenize:.1f} s ({tokenize / (tokenize + other):.0%}), "
            f"the rest (reading, ordering, writing, hashing) {other:.1f} s; {bytes_per_token:.2f} bytes/token. "
            "Estimate with one core for the main process and workers on the others:"
        )
        rows = []
        for cores in (1, 2, 8, 32):
            seconds = tokenize + other if cores == 1 else max(tokenize / (cores - 1), other)
            rate = size_mb / seconds
            hours = 10e9 * bytes_per_token / 1e6 / rate / 3600
            rows.append(
                [
                    cores,
                    f"{rate:.1f}",
                    f"{hours:.1f}",
                    "main process" if other >= tokenize / max(cores - 1, 1) else "tokenizing",
                ]
            )
        table("estimate", ["cores", "MB/s", "hours for 10B gpt2 tokens", "bound by"], rows)


if __name__ == "__main__":
    main()
