"""The inference engine: a KV cache with a position per row, the one-token decode step, logits processing and
the token loop, for a batch whose rows start, finish and are replaced at different times.

    engine = Engine(model, max_batch=8)
    row = engine.add(prompt_ids, SamplingParams(temperature=0.8, top_k=200), max_new_tokens=100)
    while engine.active:
        for t in engine.step(): print(t.row, t.token, t.finish)   # one token for every row in the batch

A row joins after its own prefill (`add`), takes one token per `step`, and leaves as soon as it finishes
(its length, one of its stop tokens, the end of its grammar) or is removed (`remove`). Each row keeps its own
sampling settings, its own random generator and optionally a LogitsMask (a grammar: inference/grammar.py) that
forbids tokens before the draw, so a seeded row draws the same tokens alone or among others. The model is only
read: `model/` holds the architecture and its one forward, this module how to run it token by token, and a
decode backend (inference/backends/: the model's own forward, or our CPU kernels) how each step is computed.

Shape legend as in model/gpt.py: B rows, S tokens held in the cache, C n_embd, nh n_head, nkv key/value heads,
hs head size, V vocab.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.inference.backends import DecodeBackend, choose
from nanogpt_cli.inference.prefix import PrefixCache
from nanogpt_cli.model import GPT

if TYPE_CHECKING:
    from nanogpt_cli.lora import RowAdapters

__all__ = [
    "CacheView",
    "Engine",
    "GrammarError",
    "KVCache",
    "LogitsMask",
    "RowError",
    "SamplingParams",
    "StepToken",
    "generate",
    "process_logits",
    "prompt_logprobs",
    "token_logprobs",
]


# --- the KV cache -------------------------------------------------------------------------------------


class KVCache:
    """Keys and values for `rows` rows of block_size tokens per layer, and how many tokens each row holds
    (`pos[r]`, which is also the position of its next token). Rows are slots: the engine keeps its active
    rows in slots 0..n-1, so a step runs on the first n. It holds the model's key/value heads only: grouped-query
    attention shrinks it by n_head / n_kv_head.

    A sliding-window layer whose window is shorter than the context keeps only its window, as a ring: the key
    at position j lives in slot j % window, overwritten once j leaves every later token's window. ring=False keeps
    every position instead, so that a row's position can be set back (speculative decoding rolls back rejected
    tokens, whose keys a ring would have written over older ones)."""

    def __init__(self, model: GPT, rows: int, ring: bool = True):
        cfg, w = model.config, model.transformer.wte.weight
        # under autocast the cache holds the autocast dtype, as the attention's k and v come out in it
        dtype = torch.get_autocast_dtype(w.device.type) if torch.is_autocast_enabled(w.device.type) else w.dtype
        window = cfg.sliding_window
        self.ring = window if ring and window is not None and window < cfg.block_size else None  # ring layers' slots
        self.k, self.v, self.in_ring = [], [], []
        for layer in range(cfg.n_layer):
            ring = self.ring is not None and cfg.is_local(layer)
            held = self.ring if ring else cfg.block_size
            shape = (rows, cfg.kv_heads, held, cfg.head_size)  # (B, nkv, S, hs)
            self.k.append(torch.zeros(shape, device=w.device, dtype=dtype))
            self.v.append(torch.zeros(shape, device=w.device, dtype=dtype))
            self.in_ring.append(ring)
        self.capacity, self.dtype, self.rows = cfg.block_size, dtype, rows
        self.pos = [0] * rows

    def bytes_per_token(self) -> float:
        """The keys' and values' bytes per token of a row at the full context: a ring layer's window spread
        over the context."""
        per_row = sum(t[0].numel() * t.element_size() for t in (*self.k, *self.v))
        return per_row / self.capacity

    def view(self, start: int, stop: int) -> CacheView:
        """Rows start..stop-1, each at its own position, as GPT.forward takes a cache."""
        return CacheView(self, start, stop)

    def move(self, src: int, dst: int) -> None:
        """Copy row src (its held tokens) into slot dst."""
        n = self.pos[src]
        for k in (*self.k, *self.v):
            m = min(n, k.size(2))  # a ring past its window holds keys in every slot
            k[dst, :, :m].copy_(k[src, :, :m])
        self.pos[dst] = n

    def save(self, slot: int, n: int) -> list[torch.Tensor]:
        """Copies of the first n held tokens' keys and values of one row, every layer's k then every layer's v
        (the prefix cache's entries; load puts them back)."""
        return [t[slot, :, :n].clone() for t in (*self.k, *self.v)]

    def load(self, slot: int, saved: list[torch.Tensor], n: int) -> None:
        """Put the first n tokens of a row's saved keys and values (save) into slot, which then holds n tokens."""
        for t, s in zip((*self.k, *self.v), saved):
            t[slot, :, :n].copy_(s[:, :n])
        self.pos[slot] = n


class CacheView:
    """Rows start..stop-1 of a KVCache, each at its own position (its `pos`): what GPT.forward reads and writes
    through a cache. `pos` is one int when every row is at one position (a prefill; a decode step of rows that
    started together), which needs no mask and one slice write per layer. Writing goes straight into the cache;
    the rows' positions (the view's and the cache's) advance on `update` of the last layer."""

    def __init__(self, cache: KVCache, start: int, stop: int):
        self.cache, self.start, self.stop = cache, start, stop
        pos = cache.pos[start:stop]
        self.pos: int | list[int] = pos[0] if min(pos) == max(pos) else pos
        self.whole = start == 0 and stop == cache.rows
        self.last = len(cache.k) - 1  # the layer whose update advances the positions
        self.index: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, positions) of a per-row write

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this call's keys and values (B, nkv, T, hs) in the cache's dtype and return all the rows' held
        ones (B, nkv, S, hs); a ring layer's in the order window_keys gives."""
        T, pos, cache = k.size(2), self.pos, self.cache
        ks, vs = cache.k[layer], cache.v[layer]  # (rows, nkv, block_size, hs)
        if not self.whole:  # narrow rather than ks[a:b]: Python's tuple indexing costs a few microseconds a call
            ks, vs = ks.narrow(0, self.start, self.stop - self.start), vs.narrow(0, self.start, self.stop - self.start)
        if cache.in_ring[layer]:
            held = self.ring_update(ks, vs, k, v)
            self.advance(layer, T)
            return held
        if isinstance(pos, int):
            end = pos + T
            assert end <= cache.capacity, f"{pos} + {T} tokens overflow a cache of {cache.capacity}"
            ks.narrow(2, pos, T).copy_(k)  # copy_ casts to the cache's dtype
            vs.narrow(2, pos, T).copy_(v)
        else:  # each row's keys into its own positions, through the (B, S, nkv, hs) view
            end = max(pos) + T
            assert end <= cache.capacity, f"a row at position {end - T} overflows a cache of {cache.capacity}"
            if self.index is None:  # (B,) rows and positions for one token each, (B, 1) and (B, T) for more
                rows, at = torch.arange(len(pos), device=k.device), torch.tensor(pos, device=k.device)
                if T > 1:
                    rows, at = rows.unsqueeze(1), at.unsqueeze(1) + torch.arange(T, device=k.device)
                self.index = (rows, at)
            if k.dtype != ks.dtype:  # index_put_ does not cast
                k, v = k.to(ks.dtype), v.to(vs.dtype)
            k, v = (k.select(2, 0), v.select(2, 0)) if T == 1 else (k.transpose(1, 2), v.transpose(1, 2))
            ks.transpose(1, 2).index_put_(self.index, k)  # into the (B, S, nkv, hs) view
            vs.transpose(1, 2).index_put_(self.index, v)
        self.advance(layer, T)
        return ks.narrow(2, 0, end), vs.narrow(2, 0, end)

    def advance(self, layer: int, T: int) -> None:
        """After the last layer's update: the rows hold T more tokens."""
        if layer == self.last:
            pos, cache = self.pos, self.cache
            shared = isinstance(pos, int)
            self.pos = pos + T if shared else [p + T for p in pos]
            cache.pos[self.start : self.stop] = [self.pos] * (self.stop - self.start) if shared else self.pos
            self.index = None

    def ring_update(self, ks: torch.Tensor, vs: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """A ring layer's update. One token per row goes into its slot first, and the ring is what it sees (the
        key it overwrites left the window). More tokens see the ring as it was, then themselves; only their last
        `window` are kept. (B, nh, W, hs), or (B, nh, W + T, hs)"""
        T, W = k.size(2), ks.size(2)
        if T == 1:
            self.ring_write(ks, vs, k, v)
            return ks, vs
        held = torch.cat([ks, k.to(ks.dtype)], dim=2), torch.cat([vs, v.to(vs.dtype)], dim=2)
        keep = min(T, W)
        self.ring_write(ks, vs, k.narrow(2, T - keep, keep), v.narrow(2, T - keep, keep), T - keep)
        return held

    def ring_write(self, ks, vs, k: torch.Tensor, v: torch.Tensor, skip: int = 0) -> None:
        """Keys and values (B, nh, n, hs) of the positions pos + skip ... into their slots, position % W."""
        n, W = k.size(2), ks.size(2)
        if isinstance(self.pos, int) and n == 1:  # a decode step of rows at one position: one slot
            slot = (self.pos + skip) % W
            ks.narrow(2, slot, 1).copy_(k)
            vs.narrow(2, slot, 1).copy_(v)
            return
        pos = torch.tensor(self.pos, device=k.device)  # () or (B,)
        slots = (pos.unsqueeze(-1) + skip + torch.arange(n, device=k.device)) % W  # (n,) or (B, n)
        k, v = k.to(ks.dtype), v.to(vs.dtype)
        if slots.dim() == 1:
            ks.index_copy_(2, slots, k)
            vs.index_copy_(2, slots, v)
        else:  # a slot per row, through the (B, S, nh, hs) view
            rows = torch.arange(slots.size(0), device=k.device).unsqueeze(1)  # (B, 1)
            ks.transpose(1, 2).index_put_((rows, slots), k.transpose(1, 2))
            vs.transpose(1, 2).index_put_((rows, slots), v.transpose(1, 2))

    def window_keys(self, T: int, device: torch.device) -> torch.Tensor | None:
        """The positions of the keys a sliding-window layer's update returns for T new tokens, -1 for an empty
        slot: a ring's slots (the latest position q < held with q % W == slot), then the new tokens; without a
        ring, the cache's positions from 0. (S,) or (B, S). None: every key returned is visible (one token per
        row into full rings, whose slots then hold exactly each row's window)."""
        cache, pos = self.cache, self.pos
        if cache.ring is None:
            return torch.arange((pos if isinstance(pos, int) else max(pos)) + T, device=device)
        W = cache.ring
        if T == 1 and (pos if isinstance(pos, int) else min(pos)) + 1 >= W:
            return None
        held = torch.tensor(pos, device=device)  # () or (B,)
        after = (held + 1 if T == 1 else held).unsqueeze(-1)  # (1,) or (B, 1): tokens held once one is written
        slots = torch.arange(W, device=device)
        ring = after - 1 - (after - 1 - slots) % W  # (W,) or (B, W); negative: not written yet
        ring = ring.clamp(min=-1)
        if T == 1:
            return ring
        return torch.cat([ring, held.unsqueeze(-1) + torch.arange(T, device=device)], dim=-1)


# --- logits processing ----------------------------------------------------------------------------------


def process_logits(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next-token logits (B, V) -> filtered logits, in this order: repetition penalty on the raw logits,
    temperature, top-k, top-p, min-p. Filtered-out tokens get -inf. temperature 0 leaves the logits for an
    argmax. seen: (B, V) bool of tokens already in the sequence, for the repetition penalty."""
    logits = logits.float()
    if repetition_penalty != 1.0 and seen is not None:
        # CTRL (Keskar et al. 2019): make seen tokens less likely whatever the sign of their logit
        penalized = torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    if temperature > 0:
        logits = logits / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        # keep the smallest set of most likely tokens whose probability reaches top_p
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p  # mass before this token already reaches p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p is not None and min_p > 0.0:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return logits


NOT_FINITE = (
    "the model's next-token probabilities are not finite numbers (NaN or infinity): its weights may "
    "have diverged, or the temperature is too small or too large for them"
)


GRAMMAR_STUCK = "the row's grammar allows no token of the model's vocabulary here (or its probabilities are not finite)"


class RowError(NanoGPTError):
    """Some rows of a step cannot go on (non-finite probabilities); `rows` names them (Engine row ids, or
    indices into the logits where sample_tokens raises it). The step changed nothing: remove them and step again.
    request_fault: the rows' own requests are at fault (their grammar), not the model."""

    request_fault = False

    def __init__(self, message: str, rows: list[int]):
        super().__init__(message)
        self.rows = rows


class GrammarError(RowError):
    """Rows whose grammar failed (a limit of llguidance's hit, or a mask it could not compute): their requests'
    fault, and theirs alone."""

    request_fault = True


DRAW_BLOCK = 1024  # tokens per block of sample_tokens' two-level search


def sample_tokens(logits: torch.Tensor, temperature: float, generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row from processed logits (B, V), row r drawing from generators[r] (one generator for all
    rows when a single one is given; None: torch's global one); greedy when temperature is 0.

    A draw is one uniform number per row, looked up in the row's cumulative probabilities (inverse transform
    sampling): exactly torch.multinomial's distribution, with each row's randomness its own whatever else is
    in the batch, and far cheaper than torch.multinomial over a 50k vocabulary on a CPU. Non-finite
    probabilities raise RowError (a NanoGPTError) naming the rows: torch.multinomial on a GPU would end the
    process with a device-side assert instead."""
    if temperature == 0:
        # max over the row, not argmax: the same first index of the largest logit, cheaper over a 50k row on a
        # CPU; a NaN or +inf wins when there is one, so checking the winners checks them all
        picked, tokens = logits.max(dim=-1)  # (B,) each
        if not torch.isfinite(picked).all():
            raise RowError(NOT_FINITE, (~torch.isfinite(picked)).nonzero().view(-1).tolist())
        return tokens.tolist()
    B, V = logits.shape
    blocks = -(-V // DRAW_BLOCK)
    # each row's probabilities times a positive constant of its own (the draw scales it away): exp(logit - max);
    # the padding past V has none
    w = torch.empty(B, blocks * DRAW_BLOCK, dtype=logits.dtype, device=logits.device)
    torch.sub(logits, logits.amax(dim=-1, keepdim=True), out=w[:, :V]).exp_()
    w[:, V:] = 0
    w = w.view(B, blocks, DRAW_BLOCK)
    # a cumulative sum over a whole row is one long chain of additions: sum the blocks instead (vectorised), find
    # the draw's block in their cumulative sums, then run the chain in it only
    mass = w.sum(dim=-1).cumsum_(dim=-1)  # (B, blocks)
    total = mass[:, -1]  # NaN if any logit is NaN or +inf, or if every one is -inf
    finite = torch.isfinite(total) & (total > 0)
    if not finite.all():
        raise RowError(NOT_FINITE, (~finite).nonzero().view(-1).tolist())
    if len(generators) == 1:
        u = torch.rand(B, generator=generators[0], device=logits.device)
    else:
        u = torch.cat([torch.rand(1, generator=g, device=logits.device) for g in generators])
    zero = torch.zeros_like(total)
    # strictly below the total, so the search never lands past the last token with any probability
    x = torch.minimum(u * total, torch.nextafter(total, zero))[:, None]  # (B, 1)
    block = torch.searchsorted(mass, x, right=True)  # (B, 1): the first block whose cumulative mass passes x
    before = torch.where(block > 0, mass.gather(1, (block - 1).clamp_(min=0)), 0.0)  # the mass of the blocks before
    inner = w[torch.arange(B, device=w.device), block.view(-1)].cumsum_(dim=-1)  # (B, DRAW_BLOCK)
    x = torch.minimum(x - before, torch.nextafter(inner[:, -1:], zero[:, None]))  # the same bound, in the block
    return (block * DRAW_BLOCK + torch.searchsorted(inner, x, right=True)).view(-1).tolist()


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[tuple[float, list]]:
    """For each row of raw logits (B, V): the log-probability (natural log) of tokens[row] under the model's own
    distribution (before temperature and the filters), and the `top` most likely (token, logprob) pairs."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (B, V)
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None]).view(-1).tolist()
    if top <= 0:
        return [(c, []) for c in chosen]
    values, ids = logp.topk(min(top, logp.size(-1)), dim=-1)
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen, ids.tolist(), values.tolist())]


@torch.inference_mode()
def prompt_logprobs(model: GPT, ids: Sequence[int], top: int = 0, vocab_size: int | None = None) -> list:
    """token_logprobs of each prompt token after the ones before it (one forward over at most block_size
    tokens); the first token has no context and gets None."""
    if not 1 <= len(ids) <= model.config.block_size:
        raise NanoGPTError(f"a prompt to score must have 1 to {model.config.block_size:,} tokens, got {len(ids):,}")
    idx = torch.tensor([list(ids)], dtype=torch.long, device=model.transformer.wte.weight.device)
    logits, _ = model(idx)  # (1, T, V)
    logits = logits[0, :-1, : vocab_size or logits.size(-1)]
    return [None, *token_logprobs(logits, ids[1:], top)] if len(ids) > 1 else [None]


# --- the engine -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingParams:
    """How one row picks its tokens (process_logits gives the order); temperature 0 is greedy."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: none; 0: the picked token's log-probability; N: also the N most likely


@dataclass
class StepToken:
    """One row's new token from Engine.step; finish is "length" or "stop" (a stop token) when it ended the row,
    which has then left the batch, or "error" when its mask refused the token or failed (error says why; the
    row has left too). With SamplingParams.logprobs: the token's log-probability under the model and the most
    likely (token, logprob) pairs (token_logprobs)."""

    row: int
    token: int
    finish: str | None = None
    error: str | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class LogitsMask(Protocol):
    """A row's constraint on its tokens (inference/grammar.py's Constraint): which it may take next, the one it
    took, and whether it has ended."""

    done: bool

    def allowed(self) -> torch.Tensor: ...  # (V,) bool

    def accept(self, token: int) -> None: ...


@dataclass
class _Row:
    id: int
    tokens: list[int]  # prompt and generated tokens (a restart past the context and the no-cache path read them)
    params: SamplingParams
    generator: torch.Generator | None
    max_new_tokens: int
    stop_ids: frozenset[int]
    generated: int = 0
    adapter: int = 0  # which adapter of the engine's RowAdapters (0: the base alone)
    cache_prompt: bool = True  # look its prompt up in the prefix cache, and store its tokens there when it leaves
    restarted: bool = False  # its cache restarted past the context: it no longer holds its tokens from the first
    mask: LogitsMask | None = None  # its tokens are only those the mask allows; it ends when the mask is done


class Engine:
    """Rows of one batch decoded together through one KV cache, each with its own prompt length, position,
    sampling settings and generator. Rows live in the cache's first `active` slots: one that leaves is
    replaced by the last, so a step always runs on a contiguous block.

    Past the context a row's cache restarts from the last half of its window (one prefill of that row), so a
    token costs the same however many came before; use_cache=False recomputes each row's last block_size
    tokens every step instead (nanoGPT's way). vocab_size: never pick a token at or above it (a padded head
    has rows the tokenizer lacks). prefix_cache: where rows leave their keys and values and new prompts start
    from the longest stored prefix they share (inference/prefix.py). adapters: the model's per-row LoRA
    adapters (lora.RowAdapters), which the engine tells each forward which rows it runs. backend: the decode
    backend's name (inference/backends/), else the first that supports the model."""

    ring_cache = True  # sliding-window layers keep their window only (KVCache); a speculative engine keeps them all

    def __init__(
        self,
        model: GPT,
        max_batch: int = 1,
        vocab_size: int | None = None,
        use_cache: bool = True,
        prefix_cache: PrefixCache | None = None,
        adapters: RowAdapters | None = None,
        backend: str | None = None,
    ):
        if max_batch < 1:
            raise NanoGPTError(f"an engine needs at least one row, got max_batch={max_batch}")
        self.model, self.max_batch = model, max_batch
        self.block_size = model.config.block_size
        self.vocab_size = min(vocab_size or model.config.vocab_size, model.config.vocab_size)
        self.device = model.transformer.wte.weight.device
        with torch.inference_mode():
            self.cache = KVCache(model, max_batch, ring=self.ring_cache) if use_cache else None
        # --backend's choice, or the one the loader was given (load_for_inference), else the first that fits
        self.backend: DecodeBackend = choose(model, backend or getattr(model, "decode_backend", None))
        self.plan = self.backend.prepare(model, self.vocab_size)  # the backend's own forms of the weights
        self.rows: list[_Row] = []  # slot order
        self.logits: torch.Tensor | None = None  # (active, vocab_size): each row's next-token logits
        self.behind = False  # pick() handed out tokens that advance() has not fed yet
        self.seen: torch.Tensor | None = None  # (max_batch, V) bool, once a row uses a repetition penalty
        self.prefix_cache = prefix_cache if use_cache else None
        self.adapters = adapters
        self._next_id = 0

    @property
    def active(self) -> int:
        """Rows in the batch now."""
        return len(self.rows)

    @property
    def free(self) -> int:
        return self.max_batch - len(self.rows)

    @property
    def cache_bytes_per_token(self) -> float:
        """Bytes the KV cache holds per token of a row (every layer's keys and values, KVCache.bytes_per_token);
        0 without a cache."""
        return self.cache.bytes_per_token() if self.cache is not None else 0

    def add(
        self,
        prompt: Sequence[int],
        params: SamplingParams = SamplingParams(),
        max_new_tokens: int = 256,
        generator: torch.Generator | None = None,
        stop_ids: Sequence[int] = (),
        mask: LogitsMask | None = None,
    ) -> int:
        """Prefill one prompt into a free row and return the row's id; it takes its first token at the next
        step."""
        return self.add_many([prompt], params, max_new_tokens, [generator], stop_ids, masks=[mask])[0]

    @torch.inference_mode()
    def add_many(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        max_new_tokens: int | Sequence[int] = 256,
        generators: Sequence[torch.Generator | None] | None = None,
        stop_ids: Sequence[int] = (),
        adapters: int | Sequence[int] = 0,
        cache_prompt: bool | Sequence[bool] = True,
        masks: Sequence[LogitsMask | None] | None = None,
    ) -> list[int]:
        """add for several prompts at once (params, max_new_tokens, adapters and cache_prompt: one for all, or
        one per prompt; masks: one per prompt or None); runs of prompts of one length are prefilled together, as
        one forward, and a prompt that starts with a stored prefix prefills only the rest of its tokens."""
        n = len(prompts)
        params = [params] * n if isinstance(params, SamplingParams) else list(params)
        limits = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
        adapters = [adapters] * n if isinstance(adapters, int) else list(adapters)
        cache_prompt = [cache_prompt] * n if isinstance(cache_prompt, bool) else list(cache_prompt)
        count = 0 if self.adapters is None else self.adapters.count
        for a in adapters:
            if not 0 <= a <= count:
                raise NanoGPTError(f"adapter {a} is not one of this engine's {count} adapters")
        for prompt, limit in zip(prompts, limits):
            if not 1 <= len(prompt) <= self.block_size:
                raise NanoGPTError(
                    f"a prompt must have 1 to {self.block_size:,} tokens (the model's context), got {len(prompt):,}"
                )
            if limit < 1:
                raise NanoGPTError(f"a row must generate at least one token, got max_new_tokens={limit}")
        if n > self.free:
            raise NanoGPTError(f"{n} new rows do not fit: {self.free} of {self.max_batch} are free")
        self.advance()  # the rows already here take their picked tokens first: the logits stay one per row
        generators = generators or [None] * n
        masks = masks or [None] * n
        start = len(self.rows)
        rows = zip(prompts, params, limits, generators, adapters, cache_prompt, masks)
        for prompt, p, limit, generator, a, c, mask in rows:
            stops = frozenset(stop_ids)
            self.rows.append(
                _Row(self._next_id, list(prompt), p, generator, limit, stops, adapter=a, cache_prompt=c, mask=mask)
            )
            self._next_id += 1
        for slot in range(start, len(self.rows)):
            if self.rows[slot].params.repetition_penalty != 1.0:
                if self.seen is None:
                    self.seen = torch.zeros(
                        self.max_batch, self.model.config.vocab_size, dtype=torch.bool, device=self.device
                    )
                self.seen[slot] = False
                self.seen[slot, torch.tensor(self.rows[slot].tokens, device=self.device)] = True
        try:
            new = self._prefill(start, len(self.rows))
        except Exception:
            del self.rows[start:]  # the batch stays as it was
            raise
        self.logits = new if self.logits is None or start == 0 else torch.cat([self.logits, new])
        return [r.id for r in self.rows[start:]]

    def _prefill(self, start: int, stop: int) -> torch.Tensor:
        """Next-token logits (stop - start, V) for the rows in slots start..stop-1, filling their cache."""
        if self.cache is None:
            return self._full_forward(self.rows[start:stop])
        held = [self._load_prefix(slot) for slot in range(start, stop)]  # tokens each row took from the cache
        out, slot = [], start
        while slot < stop:  # runs of equal length share one forward; a row with a stored prefix runs alone
            n, h = len(self.rows[slot].tokens), held[slot - start]
            end = slot + 1
            while not h and end < stop and not held[end - start] and len(self.rows[end].tokens) == n:
                end += 1
            self.cache.pos[slot:end] = [h] * (end - slot)
            idx = torch.tensor([r.tokens[h:] for r in self.rows[slot:end]], dtype=torch.long, device=self.device)
            self._select(slot, end)
            out.append(self.backend.prefill(self.plan, idx, self.cache.view(slot, end)).float())  # (b, V)
            slot = end
        return out[0] if len(out) == 1 else torch.cat(out)

    def _load_prefix(self, slot: int) -> int:
        """Load the longest stored prefix of the row's prompt into its slot: how many tokens it holds then."""
        row = self.rows[slot]
        if self.prefix_cache is None or not row.cache_prompt:
            return 0
        n, saved = self.prefix_cache.lookup(row.tokens, row.adapter, self.cache.ring)
        if n:
            self.cache.load(slot, saved, n)
        return n

    def _select(self, start: int, stop: int) -> None:
        """Tell the adapters which rows the next forward runs (slots start..stop-1)."""
        if self.adapters is not None:
            self.adapters.select([r.adapter for r in self.rows[start:stop]])

    def _full_forward(self, rows: list[_Row]) -> torch.Tensor:
        """Logits (len(rows), V) from a forward over each row's last block_size tokens (no cache)."""
        windows = [r.tokens[-self.block_size :] for r in rows]
        if all(len(w) == len(windows[0]) for w in windows):
            idx = torch.tensor(windows, dtype=torch.long, device=self.device)
            if self.adapters is not None:
                self.adapters.select([r.adapter for r in rows])
            return self.backend.prefill(self.plan, idx, None).float()
        return torch.cat([self._full_forward([r]) for r in rows])

    @torch.inference_mode()
    def remove(self, row: int) -> None:
        """Take a row out of the batch at once (finished by its caller, or cancelled); unknown ids are ignored."""
        slot = next((s for s, r in enumerate(self.rows) if r.id == row), None)
        if slot is None:
            return
        last = len(self.rows) - 1
        self._store_prefix(slot)
        if slot != last:  # the last row moves into the hole: the active rows stay slots 0..n-1
            self.rows[slot] = self.rows[last]
            if self.cache is not None:
                self.cache.move(last, slot)
            if self.seen is not None:
                self.seen[slot] = self.seen[last]
            self.logits[slot] = self.logits[last]
        self.rows.pop()
        self.logits = self.logits[:last] if last else None

    def _store_prefix(self, slot: int) -> None:
        """Keep a leaving row's keys and values in the prefix cache: the tokens its slot holds (all but a picked
        token not yet fed), from its first."""
        row = self.rows[slot]
        if self.prefix_cache is None or not row.cache_prompt or row.restarted:
            return
        n = self.cache.pos[slot]
        if n > 0:
            self.prefix_cache.store(row.tokens[:n], self.cache.save(slot, n), row.adapter)

    def step(self) -> list[StepToken]:
        """One token for every active row: pick() then advance(). A RowError (rows whose probabilities are not
        finite) leaves every row as it was."""
        out = self.pick()
        self.advance()
        return out

    @torch.inference_mode()
    def pick(self) -> list[StepToken]:
        """Sample every active row's next token from its logits with its own settings and generator, and end the
        rows that reached their length or a stop token; advance() then feeds the tokens to the model. A server
        hands the tokens out in between, so a new row's first token goes out right after its prefill, and a row
        that its caller removes (a stop text) costs no decode step. A RowError leaves every row as it was."""
        with self.backend.decoding(self.plan):  # our CPU kernels' threads apart from torch's (native.torch_alone)
            return self._pick()

    def _pick(self) -> list[StepToken]:
        self.advance()  # a pick not fed yet is fed first
        if not self.rows:
            return []
        logits = self.logits
        masked = self._masked(logits)  # GrammarError: rows whose grammar failed
        try:
            tokens = self._sample(masked)
        except RowError as e:  # a row whose grammar allows no token of the vocabulary: say so
            stuck = {r.id for r in self.rows if r.mask is not None} & set(e.rows)
            raise RowError(GRAMMAR_STUCK if stuck else str(e), e.rows) from None
        out = []
        for slot, (row, token) in enumerate(zip(self.rows, tokens)):
            row.tokens.append(token)
            row.generated += 1
            error = self._accept(row, token) if row.mask is not None else None
            done = error is None and (token in row.stop_ids or (row.mask is not None and row.mask.done))
            finish = "error" if error else "stop" if done else "length" if row.generated >= row.max_new_tokens else None
            out.append(StepToken(row.id, token, finish, error))
            if row.params.logprobs is not None:
                ((out[-1].logprob, out[-1].top_logprobs),) = token_logprobs(
                    logits[slot : slot + 1], [token], row.params.logprobs
                )
        if self.seen is not None:
            self.seen[torch.arange(len(tokens)), torch.tensor(tokens)] = True
        self.behind = True
        for t in out:
            if t.finish is not None:
                self.remove(t.row)
        return out

    @torch.inference_mode()
    def advance(self) -> None:
        """Run every row one token on, with the token pick() gave it (nothing to do when pick() has not run)."""
        if self.behind and self.rows:
            with self.backend.decoding(self.plan):
                self.logits = self._advance()
        self.behind = False

    def _advance(self) -> torch.Tensor:
        """Feed every row its newest token: next-token logits (active, V)."""
        if self.cache is None:
            return self._full_forward(self.rows)
        keep = max(1, self.block_size // 2)
        for slot, row in enumerate(self.rows):
            if self.cache.pos[slot] >= self.block_size:  # full: restart from the last `keep` tokens
                self.cache.pos[slot], row.restarted = 0, True
                if keep > 1:
                    idx = torch.tensor([row.tokens[-keep:-1]], dtype=torch.long, device=self.device)
                    self._select(slot, slot + 1)
                    self.backend.prefill(self.plan, idx, self.cache.view(slot, slot + 1))  # fills the cache
        idx = torch.tensor([r.tokens[-1] for r in self.rows], dtype=torch.long, device=self.device)
        self._select(0, len(self.rows))
        return self.backend.step(self.plan, idx, self.cache, len(self.rows)).float()

    @staticmethod
    def _accept(row: _Row, token: int) -> str | None:
        """Hand the row's mask its token: None, or why the mask failed (that row ends, no other)."""
        try:
            row.mask.accept(token)
            row.mask.done  # noqa: B018 (a property that asks the grammar, which may fail too)
        except Exception as e:  # a grammar's own failure (a limit hit): its row's, never the batch's
            return str(e) or type(e).__name__
        return None

    def _masked(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits with -inf for every token a row's mask forbids; rows without a mask are left as they are
        (and the logits themselves too: logprobs report the model's own). A mask that fails raises GrammarError
        naming its rows, before anything changed."""
        slots = [s for s, r in enumerate(self.rows) if r.mask is not None]
        if not slots:
            return logits
        masks, failed, why = [], [], ""
        for s in slots:
            try:
                masks.append(self.rows[s].mask.allowed()[: logits.size(1)])
            except Exception as e:  # a grammar's own failure: its row's, never the batch's
                failed.append(self.rows[s].id)
                why = str(e) or type(e).__name__
        if failed:
            raise GrammarError(why, failed)
        allowed = torch.stack(masks)  # (m, V)
        allowed = allowed.to(logits.device)
        if len(slots) == len(self.rows):  # one pass that writes a new tensor: cheaper than a clone and a fill
            return torch.where(allowed, logits, float("-inf"))
        masked = logits.clone()
        index = torch.tensor(slots, device=logits.device)
        masked[index] = torch.where(allowed, logits[index], float("-inf"))
        return masked

    def _sample(self, logits: torch.Tensor) -> list[int]:
        """Each row's next token: rows with the same settings are processed together."""
        rows = self.rows
        first = rows[0].params
        if all(r.params is first or r.params == first for r in rows):
            return self._sample_group(logits, first, rows, None)
        groups: dict[SamplingParams, list[int]] = {}
        for slot, r in enumerate(rows):
            groups.setdefault(r.params, []).append(slot)
        tokens = [0] * len(rows)
        for params, slots in groups.items():
            index = torch.tensor(slots, device=logits.device)
            picked = self._sample_group(logits[index], params, [rows[s] for s in slots], index)
            for s, t in zip(slots, picked):
                tokens[s] = t
        return tokens

    def _sample_group(
        self, logits: torch.Tensor, p: SamplingParams, rows: list[_Row], index: torch.Tensor | None
    ) -> list[int]:
        seen = None
        if p.repetition_penalty != 1.0:
            seen = self.seen[: len(self.rows)] if index is None else self.seen[index]
            seen = seen[:, : logits.size(-1)]
        filtered = process_logits(logits, p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, seen)
        generators = [r.generator for r in rows]
        if all(g is generators[0] for g in generators) and generators[0] is None:
            generators = [None]  # one draw for the batch from torch's global generator
        try:
            return sample_tokens(filtered, p.temperature, generators)
        except RowError as e:
            raise RowError(str(e), [rows[i].id for i in e.rows]) from None

    def run(self) -> Iterator[StepToken]:
        """Step until every row has finished; yields each token as it comes."""
        while self.rows:
            yield from self.step()


@torch.inference_mode()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Continue idx (B, T) by max_new_tokens tokens per row, every row drawing from `generator` (or torch's
    global one); temperature 0 is greedy. Returns (B, T + max_new_tokens). The prompt's last block_size tokens
    are what the model sees."""
    if max_new_tokens <= 0:
        return idx
    B = idx.size(0)
    engine = Engine(model, max_batch=B, use_cache=use_cache)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=1.0 if top_p is None else top_p)
    prompts = [row[-model.config.block_size :] for row in idx.tolist()]
    ids = engine.add_many(prompts, params, max_new_tokens, [generator] * B)
    new: dict[int, list[int]] = {i: [] for i in ids}
    for t in engine.run():
        new[t.row].append(t.token)
    out = torch.tensor([new[i] for i in ids], dtype=torch.long, device=idx.device)
    return torch.cat([idx, out], dim=1)
