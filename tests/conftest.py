"""Shared fixtures: small texts written by the tests themselves, a data folder, and a machine with no network.

def test_x(text_file, data_dir, no_network): ...
"""

from __future__ import annotations

import hashlib
import random
import shutil
from pathlib import Path

import pytest


def pytest_configure(config):
    """The tests' own process takes the thread count a command would (one per core other work leaves free): on a
    busy machine torch's default of one per core waits for cores at every step. Subprocesses choose for
    themselves, as every command does."""
    import torch

    from nanogpt_cli.device import auto_threads

    torch.set_num_threads(auto_threads().threads)


WORDS = (
    "the king queen lord thou thee art hath love death night day sword crown blood heart fair sweet "
    "good noble gentle speak come go hence whence wherefore naïve café façade"
).split()


def make_text(lines: int = 200, seed: int = 0) -> str:
    """A play-like text: speaker lines, indented verse, blank lines, punctuation, digits and some non-ASCII,
    so the ways tokenizers split whitespace and line ends all occur."""
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        if i % 7 == 0:
            out.append(f"{rng.choice(WORDS).upper()}:")
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 10)))
        indent = "    " if i % 5 == 1 else ""
        end = rng.choice([".", ",", "!", "?", ";", "", " — “quoth” 🙂", f" {i}"])
        out.append(f"{indent}{words.capitalize()}{end}")
        if i % 7 == 6:
            out.append("")
    return "\n".join(out) + "\n"


@pytest.fixture
def sample_text() -> str:
    return make_text()


@pytest.fixture
def text_file(tmp_path: Path, sample_text: str) -> Path:
    path = tmp_path / "play.txt"
    path.write_text(sample_text, encoding="utf-8")
    return path


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """Where prepared datasets go; not created, so a test can check that a failure writes nothing."""
    return tmp_path / "data"


@pytest.fixture
def no_network(monkeypatch, tmp_path: Path) -> None:
    """Every HTTP(S) request goes to a closed local port and fails at once; tiktoken starts with an empty cache."""
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    cache = tmp_path / "empty-tiktoken-cache"
    cache.mkdir()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))


@pytest.fixture(scope="session")
def tiktoken_gpt2(tmp_path_factory):
    """tiktoken's own `get_encoding("gpt2")`, the reference for our offline build. Its download cache is seeded
    with the packaged files under the names tiktoken gives its URLs; tiktoken still checks their sha256."""
    import tiktoken

    from nanogpt_cli.tokenizer import ASSETS_DIR

    cache = tmp_path_factory.mktemp("tiktoken-cache")
    base = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
    for name in ("vocab.bpe", "encoder.json"):
        shutil.copy(ASSETS_DIR / name, cache / hashlib.sha1((base + name).encode()).hexdigest())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", str(cache))
        return tiktoken.get_encoding("gpt2")


@pytest.fixture(scope="session")
def char_data(tmp_path_factory) -> tuple[Path, str]:
    """A small prepared char-level dataset shared by the training, sampling and evaluation tests:
    (data_dir, name)."""
    from nanogpt_cli.data import prepare

    root = tmp_path_factory.mktemp("char-data")
    source = root / "play.txt"
    source.write_text(make_text(lines=600, seed=1), encoding="utf-8")
    prepare(str(source), "play", tokenizer="char", data_dir=root / "data")
    return root / "data", "play"


@pytest.fixture(scope="session")
def trained_run(char_data, tmp_path_factory) -> Path:
    """A tiny char model trained briefly on char_data, in float32: its run folder."""
    from nanogpt_cli.training.trainer import train

    data_dir, name = char_data
    run = tmp_path_factory.mktemp("runs") / "tiny"
    train(tiny_plan(data_dir, name, run, max_iters=60, eval_interval=60, eval_iters=8))
    return run


# the one tiny model shape the unit tests share (the `tiny` preset is its training-sized sibling)
TINY = dict(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=32)


def tiny_config(**overrides):
    """A GPTConfig small enough that a forward pass is a millisecond."""
    from nanogpt_cli.config import GPTConfig

    return GPTConfig(**{**TINY, **overrides})


def kernel_reference(q, x):
    """What our int8 and int4 kernels (backends/native.cpp) compute for a QuantizedLinear q, from first principles,
    bias left out: x's blocks of 32 rounded to int8 at max |x| / 127 (xq), the weight against xq, and int4's zeros
    against the rest of x: xq @ W.T (+ (x - xq) @ Z.T, Z being each group's zero over its inputs)."""
    import torch

    from nanogpt_cli.inference.backends import native

    rows = x.size(0)
    blocks = x.float().view(rows, -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    xq = (torch.round(blocks * (127 / amax)) * (amax / 127)).view(rows, -1)
    y = xq @ q.dequantize(torch.float32).T
    if q.kind == "int8":
        return y
    zeros = native.untile(q.zeros.view(torch.float16).unsqueeze(-1), q.out_features).float()  # (N, G)
    Z = zeros.repeat_interleave(q.group_size, dim=1)
    return y + (x.float() - xq) @ Z.T


def tiny_plan(data_dir: Path, name: str, run_dir: Path, **overrides):
    """A run plan of the `tiny` preset on a prepared dataset, in float32 on the CPU (deterministic)."""
    from nanogpt_cli.training.plan import plan_run
    from nanogpt_cli.training.request import RunRequest

    flags = {
        "preset": "tiny",
        "data": name,
        "data_dir": str(data_dir),
        "dtype": "float32",
        "device": "cpu",
        **overrides,
    }
    return plan_run(RunRequest(flags, out=run_dir))


def check_rows_apart(model, steps: int, chunk: tuple[int, int] | None = None):
    """Rows of 3, 7 and 1 tokens in one KV cache (one slot spare) decode `steps` tokens together, each at its own
    position, and each step's logits equal the full forward of that row alone; with chunk (start, stop), the rows
    then take those columns of their tokens as one chunk each, with the same check. Returns the cache."""
    import torch

    from nanogpt_cli.inference.backends.cpu import decode_plan, decode_step
    from nanogpt_cli.inference.engine import KVCache

    lengths = [3, 7, 1]
    idx = torch.randint(0, 61, (3, 16))
    with torch.inference_mode():
        cache = KVCache(model, 4)  # one slot more than used: the step runs on the first three
        for r, n in enumerate(lengths):
            model(idx[r : r + 1, :n], cache=cache.view(r, r + 1))
        plan = decode_plan(model)
        for step in range(steps):
            cols = [n + step for n in lengths]
            got = decode_step(plan, idx[torch.arange(3), cols], cache, 3)
            for r, c in enumerate(cols):
                expected, _ = model(idx[r : r + 1, : c + 1])
                torch.testing.assert_close(got[r], expected[0, -1], atol=1e-5, rtol=0)
        if chunk is not None:
            a, b = chunk
            got, _ = model(idx[:, a:b], cache=cache.view(0, 3))  # several tokens per row, each at its own position
            for r, c in enumerate(cols):
                expected, _ = model(torch.cat([idx[r : r + 1, : c + 1], idx[r : r + 1, a:b]], dim=1))
                torch.testing.assert_close(got[r], expected[0, -(b - a) :], atol=1e-5, rtol=0)
    return cache
