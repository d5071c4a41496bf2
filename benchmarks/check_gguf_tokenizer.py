"""llama.cpp's tokenization of GGUF files (PyPI's xllamacpp, used only here: its server's /tokenize on 127.0.0.1)
against the Hugging Face tokenizer.json they came from: fixed strings with digits, runs of spaces, tabs, newlines,
contractions, other scripts and emoji, and seeded random strings of those, each as plain text and with special
tokens parsed. The first strings llama.cpp tokenizes otherwise are shown; those already in Unicode's composed form
(NFC) are counted apart, since llama.cpp applies no normalizer (a tokenizer with NFC differs on the others).

    XLLAMACPP_PATH=/work/xllamacpp python benchmarks/check_gguf_tokenizer.py exports/smol-hf exports/smol-tuned.gguf
    python benchmarks/check_gguf_tokenizer.py --families       # each family's tokenizer as tests/test_gguf_pre.py
                                                                 # builds it, exported and checked
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import unicodedata
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXED = [
    "Hello world",
    "12345 3.14159 2024-12-07 1,000,000 x²+y³ ½ ٣٤٥ ⅷ",
    "  multiple   spaces  ",
    "\ttabs\t\tand  \t mixed",
    "newlines\n\nand\r\nCRLF\n\n\n  indented\n    code:\n\tdef f(x): return x**2  # ok",
    "café naïve façade — “quoth” 🙂 🧑\u200d🚀 日本語のテキストです。 Ω≈ç√ 中文字 한국어 עברית العربية",
    "I'm can't WE'LL you'RE they've it's",
    "   leading and trailing   ",
    "",
    " ",
    "\n",
    "a\u0301 e\u0301 (combining accents)",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<s></s><|endoftext|>",
    "12a34b567 0x1F 1e-9 ++--==!!?? ...",
    "ÀÉÎÕÜ ß ẞ ǅ ǈ",
]
PIECES = list("aZ09 \t\n\r.,'!?-_é日🙂") + ["'s", "'LL", "  ", "123", "\u0301", "ǅ", "٣", "²", "\u00a0", "\u3000"]


def strings(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return FIXED + ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def llama_cpp(path: Path):
    """xllamacpp's server on the file (127.0.0.1, a free port), and its /tokenize."""
    import xllamacpp

    p = xllamacpp.CommonParams()
    p.model.path = str(path)
    p.n_ctx, p.n_parallel, p.port = 512, 1, 0
    p.cpuparams.n_threads = p.cpuparams_batch.n_threads = 1
    server = xllamacpp.Server(p)
    address = server.listening_address
    address = address if address.startswith("http") else f"http://{address}"
    assert address.startswith(("http://127.0.0.1:", "http://localhost:")), address

    def tokenize(text: str, special: bool) -> list[int]:
        body = json.dumps({"content": text, "add_special": False, "parse_special": special}).encode()
        request = urllib.request.Request(f"{address}/tokenize", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())["tokens"]

    return server, tokenize


def check(tokenizer_json: Path, gguf: Path, texts: list[str], shown: int = 3) -> tuple[int, int, int]:
    """(strings compared, differing, differing of those already in NFC) of the file against tokenizer.json."""
    import tokenizers

    text = tokenizer_json.read_text(encoding="utf-8")
    special, plain = tokenizers.Tokenizer.from_str(text), tokenizers.Tokenizer.from_str(text)
    plain.encode_special_tokens = True  # special-token strings are text
    server, tokenize = llama_cpp(gguf)
    compared = differ = composed = 0
    try:
        for parse_special in (False, True):
            for t in texts:
                ours = (special if parse_special else plain).encode(t, add_special_tokens=False).ids
                theirs = tokenize(t, parse_special)
                compared += 1
                if ours != theirs:
                    differ += 1
                    composed += unicodedata.normalize("NFC", t) == t
                    if differ <= shown:
                        print(f"  {gguf.name}: {t!r} (special {parse_special}): ours {ours}, llama.cpp {theirs}")
    finally:
        del server
    return compared, differ, composed


def families(folder: Path) -> list[tuple[str, Path, Path]]:
    """tests/test_gguf_pre.py's tokenizer of each family, exported to GGUF in `folder`: (family, json, gguf)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import test_gguf_pre as t

    out = []
    for name in [*t.FAMILIES, *t.SENTENCEPIECE]:
        tok = t.family_tokenizer(name, folder / name)
        (folder / f"{name}.json").write_text(tok.text, encoding="utf-8")
        t.export_of(tok, folder / f"{name}.gguf")
        out.append((name, folder / f"{name}.json", folder / f"{name}.gguf"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tokenizer", nargs="?", help="a tokenizer.json, or the folder holding one")
    parser.add_argument("gguf", nargs="*", type=Path, help="GGUF files written with that tokenizer")
    parser.add_argument("--families", action="store_true", help="check each family's test tokenizer instead")
    parser.add_argument("--random", type=int, default=300, help="seeded random strings besides the fixed ones")
    args = parser.parse_args()
    if os.environ.get("XLLAMACPP_PATH"):
        sys.path.insert(0, os.environ["XLLAMACPP_PATH"])
    texts = strings(args.random, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        if args.families:
            cases = families(Path(tmp))
        else:
            json_path = Path(args.tokenizer)
            json_path = json_path / "tokenizer.json" if json_path.is_dir() else json_path
            cases = [(g.name, json_path, g) for g in args.gguf]
        rows = [
            "| file | strings | the same in llama.cpp | other ids | other ids, the text in NFC |",
            "|---|---|---|---|---|",
        ]
        for name, json_path, gguf in cases:
            compared, differ, nfc = check(json_path, gguf, texts)
            rows.append(f"| {name} | {compared} | {compared - differ} | {differ} | {nfc} |")
        print("\n".join(rows))


if __name__ == "__main__":
    main()
