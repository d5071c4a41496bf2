"""What each attention head does, measured: the standard probes scored on every layer and head.

    report = score_heads(loaded)          # HeadReport: one HeadScores per head, and uniform attention's scores
    print(report.heads[0].label)          # "previous-token", "induction", "sink", "local" or "mixed"

The probe is a batch of random token sequences, each repeated once: [r1 .. rn r1 .. rn]. On the first copy,
where nothing repeats, three scores describe where a head looks (with a prompt, they are measured on it instead):
- previous-token: the mean attention from token i to token i-1;
- first-token: the mean attention to the first token (an "attention sink", Xiao et al. 2023);
- mean distance: how many tokens back the attention lands on average (i - j, weighted by the attention).
On the second copy, the induction score is the mean attention from each token to the token that followed its
first occurrence (Olsson et al. 2022), which only a head that looks up "what came after this last time" gets.
Every row of every score skips token 0, whose only choice is itself.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.inspect.attention import attention_forward
from nanogpt_cli.interop.loading import InferenceModel

PROBE_ROWS = 8  # random sequences averaged over: enough that a head's scores move by < 0.01 between seeds
# a label when one behaviour clearly dominates: its score reaches this (uniform attention scores ~0.02-0.07)
INDUCTION_MIN, PREVIOUS_MIN, SINK_MIN = 0.3, 0.4, 0.5
LOCAL_SHARE = 0.25  # "local": the mean distance is at most this share of uniform attention's
LABELS = ("previous-token", "induction", "sink", "local", "mixed")


@dataclass
class HeadScores:
    layer: int  # from 0, as in transformer.h.N
    head: int  # from 0
    previous_token: float  # mean attention to token i-1
    first_token: float  # mean attention to token 0
    mean_distance: float  # mean of i - j under the attention, in tokens
    induction: float  # mean attention to the token after the current token's first occurrence
    label: str = ""


@dataclass
class HeadReport:
    source: str
    name: str  # the run's name, for titles
    n_layer: int
    n_head: int
    heads: list[HeadScores]
    baseline: HeadScores  # the scores of uniform causal attention over the same rows (layer and head -1)
    probe: dict[str, Any] = field(default_factory=dict)  # how the scores were measured

    def grid(self, score: str) -> list[list[float]]:
        """One score as an n_layer x n_head grid."""
        rows = [[0.0] * self.n_head for _ in range(self.n_layer)]
        for h in self.heads:
            rows[h.layer][h.head] = getattr(h, score)
        return rows

    def with_label(self, label: str) -> list[HeadScores]:
        return [h for h in self.heads if h.label == label]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HeadReport:
        return cls(**{**d, "heads": [HeadScores(**h) for h in d["heads"]], "baseline": HeadScores(**d["baseline"])})


def label_head(s: HeadScores, baseline: HeadScores) -> str:
    """The behaviour that clearly dominates a head, or "mixed". Induction, previous-token and sink compete on their
    scores (each a share of the attention); a head that passes none but looks only a few tokens back is local."""
    passing = [
        (score, name)
        for score, name, least in (
            (s.induction, "induction", INDUCTION_MIN),
            (s.previous_token, "previous-token", PREVIOUS_MIN),
            (s.first_token, "sink", SINK_MIN),
        )
        if score >= least
    ]
    if passing:
        return max(passing)[1]
    if s.mean_distance <= LOCAL_SHARE * baseline.mean_distance:
        return "local"
    return "mixed"


def probe_tokens(
    vocab_size: int, length: int, rows: int = PROBE_ROWS, seed: int = 0, skip: int | None = None
) -> torch.Tensor:
    """rows random sequences of length tokens, each followed by itself: (rows, 2 * length). skip: a token never
    drawn (the end-of-text token, which resets what a model attends to)."""
    g = torch.Generator().manual_seed(seed)
    choices = torch.tensor([t for t in range(vocab_size) if t != skip])
    half = choices[torch.randint(len(choices), (rows, length), generator=g)]  # (rows, length)
    return torch.cat([half, half], dim=1)  # (rows, 2 * length)


def where_scores(probs: torch.Tensor, first: int, last: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """previous-token, first-token and mean-distance scores of probs (B, L, nh, T, T) over the query rows
    first..last (inclusive, first >= 1), averaged over the batch: three (L, nh) tensors."""
    rows = torch.arange(first, last + 1)
    sub = probs[:, :, :, rows]  # (B, L, nh, R, T)
    previous = sub[..., torch.arange(len(rows)), rows - 1].mean(dim=(0, 3))
    sink = sub[..., 0].mean(dim=(0, 3))
    back = (rows[:, None] - torch.arange(probs.size(-1))[None, :]).clamp(min=0).to(probs.dtype)  # (R, T): i - j
    distance = (sub * back).sum(-1).mean(dim=(0, 3))
    return previous, sink, distance


def induction_scores(probs: torch.Tensor, length: int) -> torch.Tensor:
    """Mean attention from token i of the second copy to token i - length + 1, the one after its first copy, over
    the probe's second half; probs (B, L, nh, 2 * length, 2 * length) -> (L, nh)."""
    rows = torch.arange(length, 2 * length)
    return probs[:, :, :, rows, rows - length + 1].mean(dim=(0, 3))


def uniform_scores(first: int, last: int, length: int) -> HeadScores:
    """What attention spread evenly over tokens 0..i would score on the same rows: the random baseline."""
    rows = torch.arange(first, last + 1, dtype=torch.float64)
    second = torch.arange(length, 2 * length, dtype=torch.float64)
    return HeadScores(
        -1,
        -1,
        previous_token=(1 / (rows + 1)).mean().item(),
        first_token=(1 / (rows + 1)).mean().item(),
        mean_distance=(rows / 2).mean().item(),
        induction=(1 / (second + 1)).mean().item(),
        label="mixed",
    )


def score_heads(
    loaded: InferenceModel,
    source: str = "",
    name: str = "",
    length: int | None = None,
    seed: int = 0,
    prompt: str | None = None,
) -> HeadReport:
    """Every head's scores on the repeated random probe (of length tokens, default the smaller of 64 and half the
    context), the first three on prompt instead when one is given."""
    model, tok = loaded.model, loaded.tokenizer
    block = model.config.block_size
    length = min(64, block // 2) if length is None else length
    if not 2 <= length <= block // 2:
        raise NanoGPTError(f"--length must be between 2 and half the context ({block // 2}), got {length}")
    idx = probe_tokens(min(tok.vocab_size, model.config.vocab_size), length, seed=seed, skip=tok.eot_id)
    _, probs = attention_forward(model, idx.to(loaded.device))
    probs = probs.cpu()
    induction = induction_scores(probs, length)
    first, last = 1, length - 1  # the first copy
    if prompt is not None:
        ids = tok.encode(prompt)[-block:]
        if len(ids) < 2:
            raise NanoGPTError("--prompt must be at least 2 tokens long to score where heads look")
        _, probs = attention_forward(model, torch.tensor([ids], device=loaded.device))
        probs = probs.cpu()
        first, last = 1, len(ids) - 1
    previous, sink, distance = where_scores(probs, first, last)
    baseline = uniform_scores(first, last, length)
    heads = []
    for layer in range(model.config.n_layer):
        for head in range(model.config.n_head):
            s = HeadScores(
                layer,
                head,
                previous[layer, head].item(),
                sink[layer, head].item(),
                distance[layer, head].item(),
                induction[layer, head].item(),
            )
            s.label = label_head(s, baseline)
            heads.append(s)
    probe = {"length": length, "rows": PROBE_ROWS, "seed": seed, "prompt_tokens": last + 1 if prompt else None}
    return HeadReport(
        source=source,
        name=name,
        n_layer=model.config.n_layer,
        n_head=model.config.n_head,
        heads=heads,
        baseline=baseline,
        probe=probe,
    )


def heads_table(report: HeadReport):
    """The scores as a rich Table, one row per head."""
    from rich import box
    from rich.table import Table

    # a light box: the seven columns fit an 80-column terminal
    table = Table(
        title=f"attention heads of {report.name}" if report.name else None,
        box=box.SIMPLE_HEAD,
        show_edge=False,
        collapse_padding=True,
    )
    for column in ("layer", "head", "prev-token", "first-token", "distance", "induction", "label"):
        table.add_column(column, justify="left" if column == "label" else "right", no_wrap=True)
    b = report.baseline
    for h in report.heads:
        table.add_row(
            str(h.layer),
            str(h.head),
            f"{h.previous_token:.2f}",
            f"{h.first_token:.2f}",
            f"{h.mean_distance:.1f}",
            f"{h.induction:.2f}",
            h.label,
        )
    table.add_section()
    table.add_row(
        "uniform",
        "",
        f"{b.previous_token:.2f}",
        f"{b.first_token:.2f}",
        f"{b.mean_distance:.1f}",
        f"{b.induction:.2f}",
        "",
        style="dim",
    )
    return table
