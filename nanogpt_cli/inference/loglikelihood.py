"""Log-likelihoods of continuations after contexts, as multiple-choice tasks ask for them: each context is run through
the model once, whatever the number of its choices, and no token is decoded one at a time.

    scores = score_continuations(model, [(context_ids, choice_ids), ...], batch_size=32)   # [(logprob, greedy)]

Two passes of batched prefill. The contexts go first, many per forward (sorted by length, right-padded: a causal
model's real positions never see the padding after them); the last context position gives every choice's first
token, and the pass keeps each context's keys and values. Then the choices' remaining tokens run after their
context's keys and values, all the choices of the contexts of one length in one forward (a forward's rows share
their position). One-token choices (" A", " B", ...) need no second pass at all. The head runs only where a
continuation token is predicted, not over every context token.

A pair longer than the context keeps its last block_size + 1 tokens (the last is predicted, never fed), as
lm-evaluation-harness's `hf` backend cuts them. Log-probabilities are natural logs, over the tokenizer's
vocabulary (a padded head's extra rows take no probability).

Shape legend as in model.py: B rows, T tokens in this call, S tokens held, C n_embd, nh n_head, hs head size, V vocab.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn import functional as F

from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.model import GPT, softcap

Pair = tuple[Sequence[int], Sequence[int]]  # (context ids, continuation ids)


class _ContextCache:
    """The model's `Cache` for both passes. Recording (the contexts): each layer's keys and values are kept as the
    forward makes them. Replaying (the choices): row r's new keys and values follow the first `pos` of context
    owner[r]'s (a forward reads `pos` once and advances it after its last layer)."""

    def __init__(self, dtype: torch.dtype):
        self.pos, self.dtype = 0, dtype
        self.k: list[torch.Tensor] = []  # per layer (contexts, nh, S, hs)
        self.v: list[torch.Tensor] = []
        self.owner: torch.Tensor | None = None  # (B,) context row of each replayed row; None while recording

    def replay(self, owner: torch.Tensor, held: int) -> _ContextCache:
        self.owner, self.pos = owner, held
        return self

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.owner is None:
            self.k.append(k)
            self.v.append(v)
            return k, v
        ks = self.k[layer].index_select(0, self.owner)[:, :, : self.pos]  # (B, nh, held, hs)
        vs = self.v[layer].index_select(0, self.owner)[:, :, : self.pos]
        return torch.cat([ks, k], dim=2), torch.cat([vs, v], dim=2)  # (B, nh, held + T, hs)

    def window_keys(self, T: int, device: torch.device) -> torch.Tensor:
        """Every layer is kept in full: the keys are positions 0 .. held + T - 1."""
        return torch.arange(self.pos + T, device=device)


def _log_probs(model: GPT, h: torch.Tensor, vocab_size: int | None) -> torch.Tensor:
    """Log-softmax (N, V) of the head on hidden states h (N, C), over the first vocab_size tokens."""
    logits = softcap(model.lm_head(h), model.config.logit_softcap)
    return F.log_softmax(logits[:, : vocab_size or logits.size(-1)].float(), dim=-1)


def _window(context: Sequence[int], continuation: Sequence[int], block_size: int) -> tuple[tuple[int, ...], list[int]]:
    """The pair cut to the model's window: the context keeps what fits before the continuation."""
    if not continuation:
        raise NanoGPTError("a continuation to score has no tokens")
    if not context:
        raise NanoGPTError("a continuation to score needs at least one token of context before it")
    if len(continuation) > block_size:
        raise NanoGPTError(
            f"a continuation of {len(continuation):,} tokens does not fit the model's context of {block_size:,}"
        )
    keep = block_size + 1 - len(continuation)
    return tuple(context[-keep:]), list(continuation)


@torch.inference_mode()
def score_continuations(
    model: GPT, pairs: Sequence[Pair], batch_size: int = 32, vocab_size: int | None = None
) -> list[tuple[float, bool]]:
    """For each (context, continuation) pair: the continuation's log-probability after the context (nats) and
    whether greedy decoding would write it (every token the most likely). batch_size: the most rows of a forward
    (contexts in the first pass, choices in the second)."""
    if batch_size < 1:
        raise NanoGPTError(f"--batch-size must be at least 1, got {batch_size}")
    windows = [_window(c, k, model.config.block_size) for c, k in pairs]
    groups: dict[tuple[int, ...], list[int]] = {}  # context -> the pairs continuing it
    for i, (context, _) in enumerate(windows):
        groups.setdefault(context, []).append(i)
    contexts = sorted(groups, key=len, reverse=True)  # little padding in the first pass
    out: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
    model.eval()
    for start in range(0, len(contexts), batch_size):
        chunk = contexts[start : start + batch_size]
        members = [(row, windows[i][1], i) for row, context in enumerate(chunk) for i in groups[context]]
        first, cache = _first_tokens(model, chunk, members, vocab_size)
        rest = _other_tokens(model, cache, [len(c) for c in chunk], members, batch_size, vocab_size)
        for (_, _, i), (lp0, ok0), (lp, ok) in zip(members, first, rest):
            out[i] = (lp0 + lp, ok0 and ok)
    return out


def _first_tokens(model: GPT, chunk: list[tuple[int, ...]], members: list, vocab_size: int | None):
    """One forward over the chunk's contexts, right-padded: each member's first continuation token, (log-probability,
    greedy), and the cache holding the contexts' keys and values. members: (context row, continuation, pair)."""
    device = model.transformer.wte.weight.device
    lengths = [len(c) for c in chunk]
    idx = torch.zeros(len(chunk), max(lengths), dtype=torch.long)
    for row, context in enumerate(chunk):
        idx[row, : len(context)] = torch.tensor(context)
    cache = _ContextCache(model.transformer.wte.weight.dtype)
    h = model.hidden_states(idx.to(device), cache=cache)  # (B, T, C)
    last = torch.tensor(lengths, device=device) - 1
    lp = _log_probs(model, h[torch.arange(len(chunk), device=device), last], vocab_size)  # (B, V)
    rows = torch.tensor([row for row, _, _ in members], device=device)
    tokens = torch.tensor([continuation[0] for _, continuation, _ in members], device=device)
    picked = lp[rows, tokens].tolist()
    greedy = (lp.argmax(dim=-1)[rows] == tokens).tolist()
    return list(zip(picked, greedy)), cache


def _other_tokens(model: GPT, cache: _ContextCache, lengths: list[int], members: list, batch_size: int, vocab_size):
    """Tokens 2.. of each member's continuation, fed after its context's keys and values: (log-probability, greedy)
    per member, (0.0, True) for one-token continuations. Members whose contexts have one length share a forward."""
    device = model.transformer.wte.weight.device
    out: list[tuple[float, bool]] = [(0.0, True)] * len(members)
    by_length: dict[int, list[int]] = {}
    for m, (row, continuation, _) in enumerate(members):
        if len(continuation) > 1:
            by_length.setdefault(lengths[row], []).append(m)
    for held, waiting in by_length.items():
        for start in range(0, len(waiting), batch_size):
            part = waiting[start : start + batch_size]
            feeds = [members[m][1][:-1] for m in part]  # the last token is predicted, never fed
            idx = torch.zeros(len(part), max(len(f) for f in feeds), dtype=torch.long)
            valid = torch.zeros_like(idx, dtype=torch.bool)
            for j, f in enumerate(feeds):
                idx[j, : len(f)] = torch.tensor(f)
                valid[j, : len(f)] = True
            owner = torch.tensor([members[m][0] for m in part], device=device)
            h = model.hidden_states(idx.to(device), cache=cache.replay(owner, held))  # (b, T, C)
            lp = _log_probs(model, h[valid.to(device)], vocab_size)  # (N, V): the positions that predict a token
            targets = torch.tensor([t for m in part for t in members[m][1][1:]], device=device)
            picked = lp.gather(1, targets[:, None]).squeeze(1)
            hits = lp.argmax(dim=-1) == targets
            counts = [len(f) for f in feeds]
            for m, p, g in zip(part, picked.split(counts), hits.split(counts)):
                out[m] = (p.sum().item(), bool(g.all()))
    return out
