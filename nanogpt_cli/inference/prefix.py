"""The prefix cache: keys and values of token sequences the engine has run, so that a prompt which starts with
one of them (a conversation's next turn starts with the last turn's prompt and answer) prefills only the rest.

    prefix = PrefixCache(budget_bytes=512 << 20)
    engine = Engine(model, max_batch=8, prefix_cache=prefix)   # rows store their tokens' keys when they leave

Entries are kept by (adapter, tokens), the least recently used going first when the budget is full. The keys
and values are copies made by KVCache.save, in whatever shape the cache holds them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

__all__ = ["PrefixCache", "PrefixStats"]


@dataclass
class PrefixStats:
    """What the cache has done since it was made (read by the server's /metrics)."""

    lookups: int = 0  # prompts looked up
    hits: int = 0  # prompts that started from a stored prefix
    tokens: int = 0  # prompt tokens taken from the cache instead of prefilled
    stored: int = 0  # entries stored
    evicted: int = 0  # entries dropped for the budget


class PrefixCache:
    """Stored prefixes within budget_bytes of keys and values; lookup finds the longest one a prompt shares."""

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"a prefix cache's budget must be at least 0 bytes, got {budget_bytes}")
        self.budget = budget_bytes
        self.entries: OrderedDict[tuple[int, tuple[int, ...]], list[torch.Tensor]] = OrderedDict()  # oldest first
        self.bytes = 0
        self.stats = PrefixStats()

    def lookup(
        self, tokens: list[int], adapter: int = 0, ring: int | None = None
    ) -> tuple[int, list[torch.Tensor] | None]:
        """(n, saved): the most tokens of `tokens` a stored entry holds, at most all but the last (whose logits
        the prefill must compute), and that entry's keys and values; (0, None) when none shares a token. ring:
        the cache's sliding-window slots (KVCache.ring), where an entry longer than the window has overwritten
        its first tokens' keys, so it serves only a prompt that holds all of it."""
        self.stats.lookups += 1
        best, best_key, limit = 0, None, len(tokens) - 1
        for key in self.entries:
            if key[0] != adapter:
                continue
            n = shared_prefix(key[1], tokens, limit)
            if ring is not None and ring < len(key[1]) != n:
                continue
            if n > best:
                best, best_key = n, key
        if best_key is None:
            return 0, None
        self.entries.move_to_end(best_key)
        self.stats.hits += 1
        self.stats.tokens += best
        return best, self.entries[best_key]

    def store(self, tokens: list[int], saved: list[torch.Tensor], adapter: int = 0) -> None:
        """Keep the keys and values of `tokens` (KVCache.save); an entry that is a prefix of them goes, as the new
        one covers it, and one that they are a prefix of is kept instead."""
        size = sum(t.numel() * t.element_size() for t in saved)
        if not tokens or size > self.budget:
            return
        key = (adapter, tuple(tokens))
        for old in list(self.entries):
            if old[0] != adapter:
                continue
            if len(old[1]) >= len(key[1]) and old[1][: len(key[1])] == key[1]:
                self.entries.move_to_end(old)  # an entry already holds all of these tokens
                return
            if old[1] == key[1][: len(old[1])]:
                self._drop(old)
        while self.entries and self.bytes + size > self.budget:
            self._drop(next(iter(self.entries)))
            self.stats.evicted += 1
        self.entries[key] = saved
        self.bytes += size
        self.stats.stored += 1

    def _drop(self, key) -> None:
        saved = self.entries.pop(key)
        self.bytes -= sum(t.numel() * t.element_size() for t in saved)


def shared_prefix(a: tuple[int, ...], b: list[int], limit: int) -> int:
    """How many leading tokens a and b share, at most limit."""
    n = min(len(a), len(b), limit)
    if a[:n] == tuple(b[:n]):
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]: halve the gap (tuple slices compare in C)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == tuple(b[:mid]):
            lo = mid
        else:
            hi = mid
    return lo
