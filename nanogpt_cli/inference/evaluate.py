"""Deterministic perplexity: every token of a split or file scored exactly once with a sliding window.

    result = perplexity_of_split(model, tokenizer, Path("data"), "shk", "val", stride=128)
    result = perplexity_of_texts(model, tokenizer, ["To be, or not to be", "ROMEO:"])

Units: `loss` is the mean negative log-likelihood per token in nats; `bits_per_byte` is the total NLL in
bits over the UTF-8 bytes of the scored text, so models with different tokenizers can be compared.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from nanogpt_cli.data import load_meta, open_split
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.files import read_text_file
from nanogpt_cli.model import GPT
from nanogpt_cli.tokenizer import Tokenizer, describe_difference

Progress = Callable[[str, int, int], None]  # (what is scored, targets scored so far, all targets)


@dataclass
class EvalResult:
    loss: float  # mean NLL per scored token, nats
    perplexity: float  # exp(loss)
    bits_per_byte: float  # total NLL in bits / UTF-8 bytes of the scored tokens
    tokens: int  # tokens scored (every token but the first of each text)
    bytes: int
    elapsed_s: float
    tokens_per_s: float
    stride: int
    source: str

    def to_dict(self) -> dict:
        return asdict(self)


def default_stride(block_size: int) -> int:
    """Half the context: every token but the first half-window sees at least block_size / 2 tokens."""
    return max(1, block_size // 2)


@torch.no_grad()
def score_tokens(
    model: GPT,
    tokens: np.ndarray | torch.Tensor | list[int],
    stride: int | None,
    batch_size: int,
    progress: Progress | None = None,
    label: str = "scoring",
    vocab_size: int | None = None,
) -> tuple[float, int]:
    """Sum of NLL (nats) and count over tokens[1:], each predicted once. Windows of block_size tokens start
    every `stride` tokens; a window scores only the targets the previous one did not, so each token sees at
    least block_size - stride tokens of context (fewer only at the very start). stride None: default_stride.
    progress(label, targets scored, all targets) is called after each batch. vocab_size: the tokenizer's, below
    a padded head's; the padding takes no probability (the softmax runs over the real tokens only)."""
    block_size = model.config.block_size
    stride = default_stride(block_size) if stride is None else stride
    if not 1 <= stride <= block_size:
        raise NanoGPTError(f"--stride must be between 1 and the context length {block_size}, got {stride}")
    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    n_targets = len(ids) - 1
    if n_targets < 1:
        return 0.0, 0
    device = next(model.parameters()).device
    # (start, length, first target offset within the window) for each window
    windows, scored = [], 0
    begin = 0
    while scored < n_targets:
        length = min(block_size, n_targets - begin)
        first = scored - begin  # targets before this offset were scored by an earlier window
        windows.append((begin, length, first))
        scored = begin + length
        begin += stride
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    for i in range(0, len(windows), batch_size):
        group = windows[i : i + batch_size]
        T = max(length for _, length, _ in group)
        x = torch.zeros(len(group), T, dtype=torch.long)
        y = torch.full((len(group), T), -1, dtype=torch.long)  # -1: not scored here
        for row, (begin, length, first) in enumerate(group):
            x[row, :length] = ids[begin : begin + length]
            y[row, first:length] = ids[begin + 1 + first : begin + 1 + length]
        logits, _ = model(x.to(device))
        logits = logits[..., : vocab_size or logits.size(-1)]
        nll = F.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)), y.to(device).reshape(-1), ignore_index=-1, reduction="sum"
        )
        total += nll.cpu().double()  # float64 on the CPU: MPS has none
        if progress is not None:
            progress(label, min(group[-1][0] + group[-1][1], n_targets), n_targets)
    return total.item(), n_targets


def _result(nll: float, n: int, n_bytes: int, elapsed_s: float, stride: int, source: str) -> EvalResult:
    if n == 0:
        raise NanoGPTError(f"{source} has fewer than two tokens: nothing to score")
    loss = nll / n
    return EvalResult(
        loss=loss,
        perplexity=math.exp(loss),
        bits_per_byte=nll / math.log(2) / max(n_bytes, 1),
        tokens=n,
        bytes=n_bytes,
        elapsed_s=elapsed_s,
        tokens_per_s=n / elapsed_s if elapsed_s else 0.0,
        stride=stride,
        source=source,
    )


def text_bytes(tokenizer: Tokenizer, tokens, chunk: int = 1 << 20) -> int:
    """UTF-8 bytes of the text the tokens stand for; end-of-text separators are not text and count 0."""
    ids = np.asarray(tokens)
    if tokenizer.eot_id is not None:
        ids = ids[ids != tokenizer.eot_id]
    return sum(len(tokenizer.decode_bytes(ids[i : i + chunk].tolist())) for i in range(0, len(ids), chunk))


def perplexity_of_split(
    model: GPT,
    tokenizer: Tokenizer,
    data_dir: Path,
    name: str,
    split: str,
    stride: int | None = None,
    batch_size: int = 8,
    progress: Progress | None = None,
) -> EvalResult:
    meta = load_meta(data_dir, name)
    differ = describe_difference(meta["tokenizer"], tokenizer.describe(), f"dataset '{name}'", "the checkpoint")
    if differ:
        raise NanoGPTError(
            f"dataset '{name}' was prepared with another tokenizer than the checkpoint's ({differ}); "
            "score data prepared with the checkpoint's tokenizer, or use --input FILE"
        )
    stride = default_stride(model.config.block_size) if stride is None else stride
    t0 = time.perf_counter()
    nll, n, n_bytes = 0.0, 0, 0
    shards = open_split(data_dir, name, split)
    for i, tokens in enumerate(shards):  # each shard on its own, like files; sums are pooled
        label = f"{name}/{split}" + (f" ({i + 1}/{len(shards.paths)})" if len(shards.paths) > 1 else "")
        shard_nll, shard_n = score_tokens(model, tokens, stride, batch_size, progress, label, tokenizer.vocab_size)
        nll, n, n_bytes = nll + shard_nll, n + shard_n, n_bytes + text_bytes(tokenizer, tokens[1:])
    return _result(nll, n, n_bytes, time.perf_counter() - t0, stride, f"{name}/{split}")


def perplexity_of_files(
    model: GPT,
    tokenizer: Tokenizer,
    paths: list[Path],
    stride: int | None = None,
    batch_size: int = 8,
    progress: Progress | None = None,
) -> EvalResult:
    """Each file is scored on its own (its first token has no context and is not scored); sums are pooled."""
    texts = ((str(path), read_text_file(path, "--input")) for path in paths)  # read one at a time
    source = ", ".join(str(p) for p in paths)
    return _pooled(model, tokenizer, texts, stride, batch_size, progress, source)


def perplexity_of_texts(
    model: GPT,
    tokenizer: Tokenizer,
    texts: list[str],
    stride: int | None = None,
    batch_size: int = 8,
    progress: Progress | None = None,
) -> EvalResult:
    """perplexity_of_files for texts in memory: each scored on its own, sums pooled."""
    labelled = ((f"text {i + 1}", text) for i, text in enumerate(texts))
    source = f"{len(texts)} text" + ("" if len(texts) == 1 else "s")
    return _pooled(model, tokenizer, labelled, stride, batch_size, progress, source)


def _pooled(model, tokenizer, labelled, stride, batch_size, progress, source: str) -> EvalResult:
    """Score each (label, text) on its own and pool the sums."""
    nll_total, n_total, bytes_total = 0.0, 0, 0
    stride = default_stride(model.config.block_size) if stride is None else stride
    t0 = time.perf_counter()
    for label, text in labelled:
        tokens = tokenizer.encode(text)  # a char tokenizer names the characters it does not know
        nll, n = score_tokens(model, tokens, stride, batch_size, progress, label, tokenizer.vocab_size)
        nll_total, n_total = nll_total + nll, n_total + n
        bytes_total += text_bytes(tokenizer, tokens[1:])
    return _result(nll_total, n_total, bytes_total, time.perf_counter() - t0, stride, source)
