"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a small draft model proposes K tokens for each
row, the model checks them all in one forward through its KV cache, and each row keeps the drafted tokens the model
agrees with plus one token of the model's own. Greedy text is the model's own (up to float rounding: the check
computes K + 1 positions in one forward); sampled text keeps the model's distribution (the acceptance rule in
_accept). Rows of one batch keep different numbers of tokens per round.

    draft = load_draft(spec, tokenizer)          # spec.draft loaded as spec says; spec.draft_tokens None: K adapts
    engine = SpeculativeEngine(model, draft, max_batch=4)                    # then used as any Engine
    draft.stats.rate                                                         # drafted tokens kept / proposed

With lookup (Draft(..., lookup=True), --draft-lookup), a row whose last 3 tokens occurred before in its own text
proposes the tokens that followed them there (prompt lookup: Saxena 2023; llama.cpp's lookup decoding), at no
draft cost, drawn with probability 1 as far as the acceptance rule is concerned; a round where every row does runs
no draft model. Draft(None, K, lookup=True) is lookup alone: a row with no match takes a plain step.

Both caches hold every position (no sliding-window ring), so a rejection rolls a row back by setting its position.
Rows with a grammar or a repetition penalty, and rounds with no room left in the context, take plain steps.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import deque
from dataclasses import dataclass

import torch

from nanogpt_cli.config import LoadSpec, check_draft_tokens
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.inference.backends import choose
from nanogpt_cli.inference.engine import (
    NOT_FINITE,
    Engine,
    KVCache,
    RowError,
    SamplingParams,
    StepToken,
    process_logits,
    sample_tokens,
    token_logprobs,
)
from nanogpt_cli.model import GPT
from nanogpt_cli.tokenizer import Tokenizer

# The adaptive K (Leviathan et al. 2023, section 3.5): the K that maximises the expected tokens per round,
# 1 + a + ... + a^K for an acceptance rate a, over the round's cost in steps of the model, 1 + K * (DRAFT_COST +
# CHECK_COST). Those two are priors, this CPU's at batch 1 in bf16 (benchmarks/README.md, speculative decoding): a
# draft of a tenth of the model's size steps in 0.1-0.3 of its step, and the fused step checks K + 1 tokens of a row
# at about 1 + K / 4 steps. While every row is greedy, the ratios the engine timed replace them (Costs): a check's
# cost differs by precision and machine (int8's check of 5 tokens took 2.6-2.9 of its steps, bf16's 1.6-1.9).
# Rows that sample keep the priors: K then depends on nothing but the tokens kept, so a seed still repeats a text.
# `a` is counted from the rounds (kept and refused tokens, decaying by DECAY a round) from a prior of PRIOR; where
# even K = 1 would be slower than plain steps (a below ~40 % at the priors' costs) the draft rests for REST steps.
DRAFT_COST, CHECK_COST, K_MAX = 0.15, 0.25, 8
PRIOR, DECAY, REST = (2.0, 1.0), 0.9, 16
TIMINGS = 5  # the costs are medians of the last few timings of each: a preempted step or a collection moves none
RETIME = 64  # rounds after which a plain step is taken to time one again (the context and the batch change)
SHORT_FEED = 8  # the draft takes up to this many new tokens through backend.score, more (a prompt) as a prefill
LOOKUP_NGRAM, LOOKUP_LONGEST, LOOKUP_WINDOW = 3, 16, 1024  # prompt lookup: the tokens matched (at least, at most),
# and how far back they are searched


@dataclass
class DraftStats:
    """Drafted tokens proposed and kept (the accepted-token rate), and verifying forwards."""

    proposed: int = 0
    accepted: int = 0
    rounds: int = 0

    @property
    def rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def add(self, proposed: int, accepted: int) -> None:
        self.proposed, self.accepted, self.rounds = self.proposed + proposed, self.accepted + accepted, self.rounds + 1


class Costs:
    """What a round costs, in plain steps of the model: a drafted token's check (beyond the step the check also
    takes) and a step of the draft model. The priors CHECK_COST and DRAFT_COST until the engines that use it have
    timed both sides, then the ratio of the medians of their last TIMINGS timings (the first of each is left out:
    a first call's allocations). A plain step is timed where one is taken anyway, and where none was for RETIME
    rounds the next one is a plain step (stale). timed=False keeps the priors."""

    def __init__(self, timed: bool = True):
        self.timed = timed
        self.times: dict[str, deque[float]] = {}  # "step": a plain step; "check": per token, beyond a step; "draft"
        self.first: set[str] = set()  # the kinds whose first timing has been left out
        self.step_rows = 0  # the rows of the plain steps timed
        self.rounds = 0  # since the last plain step timed

    @property
    def stale(self) -> bool:
        return self.timed and ("step" not in self.times or self.rounds >= RETIME)

    def note(self, what: str, seconds: float) -> None:
        if not self.timed:
            return
        if what not in self.first:
            self.first.add(what)
            return
        self.times.setdefault(what, deque(maxlen=TIMINGS)).append(seconds)

    def step(self, rows: int, seconds: float) -> None:
        """A plain step of `rows` rows took `seconds` (the timings of another number of rows are dropped)."""
        if rows != self.step_rows:
            self.times.pop("step", None)
            self.first.discard("step")
        self.step_rows, self.rounds = rows, 0
        self.note("step", seconds)

    def check(self, rows: int, k: int, seconds: float) -> None:
        """A check of k drafted tokens for each of `rows` rows took `seconds`: per token, what it took beyond a
        plain step of as many rows (none counted where the steps timed had other rows)."""
        self.rounds += 1
        if rows == self.step_rows and "step" in self.times:
            self.note("check", max(0.0, seconds - statistics.median(self.times["step"])) / k)

    def of(self, what: str) -> float:
        """The cost of a "check" or a "draft" in plain steps."""
        step, times = self.times.get("step"), self.times.get(what)
        if not step or not times or statistics.median(step) <= 0:
            return CHECK_COST if what == "check" else DRAFT_COST
        return statistics.median(times) / statistics.median(step)


class Proposals:
    """How many tokens a proposer offers a round: K (tokens: fixed; None: adaptive, from the share kept and the
    round's costs), and whether it rests. modelled: a draft model proposes (its steps cost); False: lookup, free."""

    def __init__(self, tokens: int | None = None, costs: Costs | None = None, modelled: bool = True):
        check_draft_tokens(tokens)
        self.tokens, self.costs, self.modelled = tokens, costs or Costs(), modelled
        self.kept, self.refused = PRIOR  # the adaptive K's evidence
        self.k, self.rest = tokens or self.best()[1], 0
        self.stats = DraftStats()  # its tokens proposed and kept

    def best(self, timed: bool = False) -> tuple[float, int]:
        """The expected speed-up of the best K for the acceptance rate counted so far, and that K; at the costs
        timed, or the priors'."""
        a = self.kept / (self.kept + self.refused)
        check, draft = (self.costs.of("check"), self.costs.of("draft")) if timed else (CHECK_COST, DRAFT_COST)
        per_token = check + (draft if self.modelled else 0.0)
        return max((sum(a**i for i in range(k + 1)) / (1 + k * per_token), k) for k in range(1, K_MAX + 1))

    def adapt(self, accepted: list[int], k: int, timed: bool = False) -> None:
        """After a round of k drafted tokens (accepted: each row's kept): count them, and take the best K (at the
        costs timed, or the priors'); rest where even the best would be slower than plain steps. A fixed K stays."""
        if self.tokens is not None:
            return
        self.kept = DECAY * self.kept + sum(accepted)
        self.refused = DECAY * self.refused + sum(a < k for a in accepted)  # a row's round ends at its first refusal
        gain, self.k = self.best(timed)
        self.rest = REST if gain < 1 else 0

    def rested(self) -> None:
        """A plain step taken: one fewer to rest."""
        self.rest = max(0, self.rest - 1)


class Draft(Proposals):
    """The draft model, its K and its counts (every token proposed, by the model or by lookup) over every engine
    that used it. lookup: a row whose last LOOKUP_NGRAM tokens occurred before in its text proposes the tokens that
    followed them there (prompt lookup), with a K of its own, adapted at no proposing cost; where every row of a
    round does, the model is not run. model None: lookup alone (rows with no match take plain steps). costs: what
    the engines that use it time (Costs; shared by the model and the lookup)."""

    def __init__(self, model: GPT | None, tokens: int | None = None, lookup: bool = False, costs: Costs | None = None):
        if model is None and not lookup:
            raise NanoGPTError("a draft without a model proposes by lookup alone: give lookup=True")
        super().__init__(tokens, costs)
        self.model = model  # stats: every token proposed, the lookup's too (lookup.stats: those alone)
        self.lookup = Proposals(tokens, self.costs, modelled=False) if lookup else None


def lookup(tokens: list[int], k: int) -> list[int]:
    """The k tokens that followed an earlier occurrence of the last LOOKUP_NGRAM tokens, searched over the last
    LOOKUP_WINDOW: of those, the one whose match reaches furthest back (up to LOOKUP_LONGEST tokens; the latest of
    equals); [] where there is none. Where they run into the end of the text (a loop of fewer than k tokens), the
    loop is taken to go on."""
    n, end = LOOKUP_NGRAM, len(tokens)
    tail, last = tokens[-n:], tokens[-1]
    best, at = 0, None
    for i in range(end - 2, max(n - 2, end - LOOKUP_WINDOW - 1), -1):  # i: where a match's last token sits
        if tokens[i] == last and tokens[i - n + 1 : i + 1] == tail:
            length = n
            while length < LOOKUP_LONGEST and i - length >= 0 and tokens[i - length] == tokens[end - 1 - length]:
                length += 1
            if length > best:
                best, at = length, i
                if length == LOOKUP_LONGEST:
                    break
    if at is None:
        return []
    loop = tokens[at + 1 :]
    return [loop[j % len(loop)] for j in range(k)]


def check_tokenizers(draft: Tokenizer, target: Tokenizer) -> None:
    """A draft proposes token ids of the model's own vocabulary: the same size, and each id the same bytes."""
    if draft.vocab_size != target.vocab_size or any(
        draft.decode_bytes([i]) != target.decode_bytes([i]) for i in range(target.vocab_size)
    ):
        raise NanoGPTError(
            f"the draft's vocabulary ({draft.describe().get('name')}, {draft.vocab_size:,} tokens) is not the "
            f"model's ({target.describe().get('name')}, {target.vocab_size:,} tokens): a draft must share the "
            "model's tokenizer"
        )


def load_draft(spec: LoadSpec, tokenizer: Tokenizer, dtype: torch.dtype | None = None) -> Draft | None:
    """spec.draft's model (None where the spec has none), loaded by the model's own loader as the model's spec says,
    its source replaced: the same device, quantization and backend, and dtype (the model's as cast, where given:
    `auto` may pick another for smaller weights); checked against the model's tokenizer. The draft's source is read
    as given (its best weights: --last is the model's), and the threads the model's load set stay."""
    from nanogpt_cli.interop.loading import load_for_inference

    if spec.draft is None:  # lookup alone, or no draft
        return Draft(None, spec.draft_tokens, lookup=True) if spec.draft_lookup else None
    own = dataclasses.replace(
        spec, source=spec.draft, last=False, threads=None, draft=None, draft_tokens=None, draft_lookup=False
    )
    if dtype is not None:
        own = dataclasses.replace(own, dtype=dtype)
    loaded = load_for_inference(own)
    check_tokenizers(loaded.tokenizer, tokenizer)
    return Draft(loaded.model, spec.draft_tokens, spec.draft_lookup)


class NoDraft:
    """The draft cache of a draft that is lookup alone: positions the rounds set, and nothing else."""

    def __init__(self, rows: int, capacity: int):
        self.pos, self.capacity = [0] * rows, capacity

    def move(self, src: int, dst: int) -> None:
        self.pos[dst] = self.pos[src]


class SpeculativeEngine(Engine):
    """An Engine whose pick() runs a speculative round: every row gets one to K + 1 tokens per call (a StepToken
    each, in order). Between rounds a row's newest token stays unfed (advance() does nothing): the next round's
    check feeds it with the drafted ones. row_stats: each row's drafted tokens proposed and kept, by row id."""

    ring_cache = False  # a rollback sets a row's position back: every layer keeps every position

    def __init__(self, model: GPT, draft: Draft, max_batch: int = 1, use_cache: bool = True, **options):
        if not use_cache:
            raise NanoGPTError("--draft decodes through the KV cache: drop --no-cache")
        super().__init__(model, max_batch, **options)
        self.draft = draft
        if draft.model is None:  # lookup alone: nothing to cache, and no cut of a draft's context
            self.draft_cache = NoDraft(max_batch, 2 * model.config.block_size)
        elif draft.model.config.vocab_size < self.vocab_size:
            raise NanoGPTError(
                f"the draft's vocabulary has {draft.model.config.vocab_size:,} tokens and the model's "
                f"{self.vocab_size:,}: a draft must share the model's tokenizer"
            )
        else:
            with torch.inference_mode():
                self.draft_cache = KVCache(draft.model, max_batch, ring=False)
            self.draft_backend = choose(draft.model, getattr(draft.model, "decode_backend", None))
            self.draft_plan = self.draft_backend.prepare(draft.model, self.vocab_size)
        self.offset = [0] * max_batch  # slot s's draft cache holds its row's tokens from offset[s] on
        self.row_stats: dict[int, DraftStats] = {}

    def add_many(self, prompts, *args, **kwargs) -> list[int]:
        Engine.advance(self)  # the rows here take their pending tokens first: every row's logits are current
        start = len(self.rows)
        ids = super().add_many(prompts, *args, **kwargs)
        for slot in range(start, len(self.rows)):  # the draft catches up with the prompt in its first round
            self.draft_cache.pos[slot], self.offset[slot] = 0, 0
        for i in ids:
            self.row_stats[i] = DraftStats()
        return ids

    def advance(self) -> None:
        """Feed the pending tokens only where the next pick is a plain step; a round feeds them itself."""
        copied = self._lookups() if self.rows and self.draft.lookup is not None else None
        modelled = self.rows and self.draft.model is not None and self._round_tokens(self.draft) > 0
        if not self.rows or (not modelled and (copied is None or None in copied)):
            n = len(self.rows)
            timed = self.behind and n > 0 and max(self.cache.pos[:n]) < self.block_size  # no restart's prefill in it
            start = self._now()
            super().advance()
            if timed:
                self.draft.costs.step(n, self._now() - start)

    def remove(self, row: int) -> None:
        if len(self.row_stats) > 4 * self.max_batch:  # a server's rows come and go: keep the recent ones' counts
            active = {r.id for r in self.rows}
            for old in [i for i in self.row_stats if i not in active][: -2 * self.max_batch]:
                del self.row_stats[old]
        slot = next((s for s, r in enumerate(self.rows) if r.id == row), None)
        last = len(self.rows) - 1
        if slot is not None and slot != last:  # the last row moves into the hole (Engine.remove): its draft too
            with torch.inference_mode():
                self.draft_cache.move(last, slot)
            self.offset[slot] = self.offset[last]
        super().remove(row)

    def pick(self) -> list[StepToken]:
        copied = self._lookups() if self.behind else None
        if copied is not None and None not in copied:  # every row's text repeats: the draft model waits
            with self.backend.decoding(self.plan):
                return self._speculate(len(copied[0]), copied)
        if self.draft.lookup is not None:
            self.draft.lookup.rested()
        k = self._round_tokens(self.draft) if self.behind and self.draft.model is not None else 0
        if k == 0:  # right after a prefill (each row's first token comes from its logits), no room, or resting
            self.draft.rested()
            return super().pick()
        if copied is not None:  # the rows whose text repeats propose its continuation, with the draft's K
            copied = [None if c is None else lookup(r.tokens, k) for c, r in zip(copied, self.rows)]
        with self.backend.decoding(self.plan):
            return self._speculate(k, copied)

    def _round_tokens(self, proposer: Proposals) -> int:
        """How many tokens this round proposes: the proposer's K, cut so that the check fits every row's context
        and no row drafts past its last token; 0: a plain step (also while an adaptive proposer rests, or times a
        plain step)."""
        rows = self.rows
        if proposer.rest or any(r.mask is not None or r.params.repetition_penalty != 1.0 for r in rows):
            return 0
        if proposer.tokens is None and self._timed() and proposer.costs.stale:  # K plans with a step's time
            return 0
        n, dcap = len(rows), self.draft_cache.capacity
        room = self.block_size - 1 - max(self.cache.pos[:n])  # the check writes k + 1 keys from pos
        left = max(r.max_new_tokens - r.generated for r in rows) - 1  # the round gives up to k + 1 tokens
        return max(0, min(proposer.k, room, left, dcap - dcap // 2))

    def _timed(self) -> bool:
        """Whether the round plans with the costs timed: while every row is greedy (a sampling row's random draws
        depend on K, and a seed must repeat its text)."""
        return all(r.params.temperature == 0 for r in self.rows)

    def _now(self) -> float:
        """The time, once the device has done what was asked of it (a GPU's calls return before they run)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _lookups(self) -> list[list[int] | None] | None:
        """Prompt lookup's K tokens for each row (None for a row whose last tokens occurred nowhere before), or
        None where the draft has no lookup or it rests."""
        proposer = self.draft.lookup
        k = self._round_tokens(proposer) if proposer is not None else 0
        if k == 0:
            return None
        return [lookup(r.tokens, k) or None for r in self.rows]

    @torch.inference_mode()
    def _speculate(self, k: int, copied: list[list[int] | None] | None = None) -> list[StepToken]:
        """One round: the draft proposes k tokens per row, or a row's lookup its copied ones (drawn with
        probability 1; where every row has them the draft model is not run), one forward of the model checks them
        after the pending token, each row keeps what _accept says, and both caches are set back to what the rows
        hold. A RowError (probabilities that are not finite numbers) leaves every row as it was."""
        n = len(self.rows)
        looked = [c is not None for c in copied] if copied is not None else [False] * n
        held = list(self.cache.pos[:n]), list(self.draft_cache.pos[:n]), list(self.offset[:n])
        try:
            if all(looked):
                drafted = torch.tensor(copied, dtype=torch.long, device=self.device)
                sampled = any(r.params.temperature > 0 for r in self.rows)  # greedy rows read no q
                q = torch.nn.functional.one_hot(drafted, self.vocab_size).float() if sampled else None
            else:
                drafted, q = self._propose(k)  # (n, k), (n, k, V)
                for slot in (s for s in range(n) if looked[s]):
                    drafted[slot] = torch.tensor(copied[slot], device=self.device)
                    q[slot] = torch.nn.functional.one_hot(drafted[slot], self.vocab_size).float()
            idx = torch.cat([torch.tensor([[r.tokens[-1]] for r in self.rows], device=self.device), drafted], dim=1)
            self._select(0, n)
            start = self._now()
            raw = self.backend.score(self.plan, idx, self.cache.view(0, n)).float()  # (n, k + 1, V)
            self.draft.costs.check(n, k, self._now() - start)
            accepted, final = self._accept(raw, drafted, q)
        except RowError:
            self.cache.pos[:n], self.draft_cache.pos[:n], self.offset[:n] = held
            raise
        by_lookup = [a for a, copy in zip(accepted, looked) if copy]
        if by_lookup:
            self.draft.lookup.adapt(by_lookup, k, self._timed())
            self.draft.lookup.stats.add(len(by_lookup) * k, sum(by_lookup))
        if len(by_lookup) < n:
            self.draft.adapt([a for a, copy in zip(accepted, looked) if not copy], k, self._timed())
        return self._emit(raw, drafted.tolist(), accepted, final, held[0], looked)

    def _propose(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's k tokens per row (n, k) and the probabilities it drew each from (n, k, V; zeros for greedy
        rows, which take its most likely token)."""
        n, V = len(self.rows), self.vocab_size
        start = self._now()
        logits, fed = self._catch_up(k)  # (n, V), the most tokens a row was fed
        drafted = torch.empty(n, k, dtype=torch.long, device=self.device)
        q = torch.zeros(n, k, V, device=self.device)
        for i in range(k):
            for params, slots, index in self._groups():
                filtered = self._filter(logits[:, :V] if index is None else logits[index, :V], params)
                tokens = self._draw(filtered, params, slots)
                where = slice(None) if index is None else index
                drafted[where, i] = torch.tensor(tokens, device=self.device)
                if params.temperature > 0:
                    q[where, i] = filtered.softmax(dim=-1)
            if i < k - 1:
                logits = self.draft_backend.step(self.draft_plan, drafted[:, i], self.draft_cache, n).float()
        if fed <= 2:  # a round's own catch-up (the pending token, the last round's), not a prompt's prefill
            self.draft.costs.note("draft", (self._now() - start) / k)  # a step of the draft, its pick included
        return drafted, q

    def _catch_up(self, k: int) -> tuple[torch.Tensor, int]:
        """Feed the draft each row's tokens it has not seen (the pending one at least): its next-token logits (n, V),
        and the most tokens a row was fed. Rows that need fewer tokens than the most needed re-feed some they hold,
        so that one forward serves all. A row whose window would overflow the draft's context restarts from its
        last half."""
        n, cap, pos = len(self.rows), self.draft_cache.capacity, self.draft_cache.pos
        need = []
        for slot, row in enumerate(self.rows):
            if len(row.tokens) - self.offset[slot] + k - 1 > cap:
                self.offset[slot], pos[slot] = max(0, len(row.tokens) - max(1, cap // 2)), 0
            need.append(len(row.tokens) - self.offset[slot] - pos[slot])
        T = max(need)
        if any(pos[s] < T - need[s] for s in range(n)):  # too few held to re-feed: each row on its own
            return torch.cat([self._feed_draft(s, s + 1, need[s]) for s in range(n)]), T
        for s in range(n):
            pos[s] -= T - need[s]
        return self._feed_draft(0, n, T), T

    def _feed_draft(self, start: int, stop: int, T: int) -> torch.Tensor:
        """The next T tokens of rows start..stop-1 into the draft's cache: its next-token logits (rows, V)."""
        pos = self.draft_cache.pos
        windows = [r.tokens[self.offset[s] + pos[s] :][:T] for s, r in enumerate(self.rows[start:stop], start)]
        idx = torch.tensor(windows, dtype=torch.long, device=self.device)
        view = self.draft_cache.view(start, stop)
        if T <= SHORT_FEED:  # a round's usual one or two tokens: score's decoding form, cheaper than a prefill's
            return self.draft_backend.score(self.draft_plan, idx, view)[:, -1].float()
        return self.draft_backend.prefill(self.draft_plan, idx, view).float()

    def _groups(self):
        """(params, slots, index) for each group of rows with the same settings; index None: every row."""
        first = self.rows[0].params
        if all(r.params is first or r.params == first for r in self.rows):
            yield first, list(range(len(self.rows))), None
            return
        groups: dict[SamplingParams, list[int]] = {}
        for slot, r in enumerate(self.rows):
            groups.setdefault(r.params, []).append(slot)
        for params, slots in groups.items():
            yield params, slots, torch.tensor(slots, device=self.device)

    @staticmethod
    def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        return process_logits(logits, p.temperature, p.top_k, p.top_p, p.min_p)

    def _draw(self, filtered: torch.Tensor, p: SamplingParams, slots: list[int]) -> list[int]:
        """One token per row of filtered logits, each row from its own generator (sample_tokens)."""
        try:
            return sample_tokens(filtered, p.temperature, self._generators(slots))
        except RowError as e:
            raise RowError(str(e), [self.rows[slots[i]].id for i in e.rows]) from None

    def _generators(self, slots: list[int]) -> list[torch.Generator | None]:
        """The rows' generators, or one for all where they share one (one draw for the batch)."""
        gens = [self.rows[s].generator for s in slots]
        return gens[:1] if all(g is gens[0] for g in gens) else gens

    def _accept(self, raw: torch.Tensor, drafted: torch.Tensor, q: torch.Tensor) -> tuple[list[int], list[int]]:
        """How many drafted tokens each row keeps, and its next token. Greedy rows keep drafted tokens while each
        is the model's most likely, then take the model's. Sampling rows (Leviathan et al. 2023, algorithm 1) keep
        drafted token x with probability min(1, p(x) / q(x)), p the model's filtered distribution and q the
        draft's; at the first one refused they draw from norm(max(0, p - q)), and after keeping all k they draw
        one more from p. Every token then follows p exactly, whatever q is."""
        n, k = drafted.shape
        accepted, final = [0] * n, [0] * n
        for params, slots, index in self._groups():
            g = len(slots)
            logits = raw if index is None else raw[index]
            d = drafted if index is None else drafted[index]  # (g, k)
            if params.temperature == 0:
                # sample_tokens' greedy pick at every position (g, k + 1), on the logits as they are: top-k, top-p
                # and min-p never drop the most likely token, so filtering first would pick the same
                best, model = logits.max(dim=-1)
                if not torch.isfinite(best).all():
                    bad = (~torch.isfinite(best)).any(dim=1).nonzero().view(-1).tolist()
                    raise RowError(NOT_FINITE, [self.rows[slots[i]].id for i in bad])
                kept = (model[:, :k] == d).long().cumprod(dim=1).sum(dim=1)  # (g,): the leading matches
                nxt = model.gather(1, kept.unsqueeze(1)).view(-1).tolist()
            else:
                filtered = self._filter(logits.reshape(g * (k + 1), -1), params).view(g, k + 1, -1)  # (g, k + 1, V)
                kept, nxt = self._accept_sampled(filtered, d, q if index is None else q[index], slots)
            for i, s in enumerate(slots):
                accepted[s], final[s] = int(kept[i]), nxt[i]
        return accepted, final

    def _accept_sampled(self, filtered: torch.Tensor, d: torch.Tensor, q: torch.Tensor, slots: list[int]):
        """The rejection sampling step of _accept for rows that sample: (kept (g,), next tokens)."""
        g, k = d.shape
        p = filtered.softmax(dim=-1)  # (g, k + 1, V)
        p_d = p[:, :k].gather(2, d.unsqueeze(2)).squeeze(2)  # (g, k): p and q of each drafted token
        q_d = q.gather(2, d.unsqueeze(2)).squeeze(2)
        generators = self._generators(slots)
        if len(generators) == 1:
            u = torch.rand(g, k, generator=generators[0], device=self.device)
        else:
            u = torch.stack([torch.rand(k, generator=gen, device=self.device) for gen in generators])
        kept = (u * q_d < p_d).long().cumprod(dim=1).sum(dim=1)  # u < p / q, without the division; (g,)
        rows = torch.arange(g, device=self.device)
        q_next = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[rows, kept]  # (g, V): 0 after all k kept
        p_next = p[rows, kept]
        residual = (p_next - q_next).clamp_(min=0)
        # p <= q everywhere only where p = q up to rounding, where no token is refused: p then
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        residual = torch.where(empty, p_next, residual)
        return kept.tolist(), self._draw(residual.log(), SamplingParams(temperature=1.0), slots)

    def _emit(self, raw, drafted: list[list[int]], accepted: list[int], final: list[int], pos: list[int], looked):
        """Hand out each row's kept tokens and its next one (a StepToken each) up to its end, then set both caches
        to what the rows hold: the model's, from its positions before the check (pos), every new token but the
        newest (fed by the next round); the draft's, the tokens it fed that were kept (none of a row whose tokens
        a lookup proposed: the draft fed its own)."""
        out = []
        for slot, row in enumerate(self.rows):
            kept = accepted[slot]
            start = len(row.tokens)
            self.row_stats[row.id].add(len(drafted[slot]), kept)
            self.draft.stats.add(len(drafted[slot]), kept)
            for j, token in enumerate([*drafted[slot][:kept], final[slot]]):
                row.tokens.append(token)
                row.generated += 1
                done = token in row.stop_ids
                finish = "stop" if done else "length" if row.generated >= row.max_new_tokens else None
                out.append(StepToken(row.id, token, finish))
                if row.params.logprobs is not None:
                    ((out[-1].logprob, out[-1].top_logprobs),) = token_logprobs(
                        raw[slot, j : j + 1], [token], row.params.logprobs
                    )
                if finish is not None:
                    break
            self.cache.pos[slot] = pos[slot] + len(row.tokens) - start  # the pending token and the kept ones
            fed = 0 if looked[slot] else kept
            self.draft_cache.pos[slot] = min(self.draft_cache.pos[slot], start + fed - self.offset[slot])
        for t in out:
            if t.finish is not None:
                self.remove(t.row)
        return out
