"""The inspect figures, drawn with matplotlib (the `plot` extra) into PNG, SVG or PDF files.

    draw_attention(maps, Path("attention.png"))            # layers x heads grid; layer=, head= for fewer, larger
    draw_heads(report, Path("heads.png")); draw_positions(views, "shk", Path("positions.png"))

size: (width, height) in pixels; the figure is laid out for it and saved at exactly that size. Without one, each
figure picks a size that keeps its labels readable.
"""

from __future__ import annotations

from pathlib import Path

import torch

from nanogpt_cli.errors import NanoGPTError, require
from nanogpt_cli.files import atomic_write
from nanogpt_cli.inspect.attention import AttentionMaps, check_selection
from nanogpt_cli.inspect.heads import (
    INDUCTION_MIN,
    LABELS,
    LOCAL_SHARE,
    PREVIOUS_MIN,
    SINK_MIN,
    HeadReport,
)
from nanogpt_cli.inspect.positions import PositionViews

DPI = 100
MAX_TOKENS = 64  # tokens drawn per axis by default: tick labels stay readable up to about this many
MAX_FIGURE_IN = 40  # a grid wider or taller than this (inches) is shrunk, its tick labels dropped
LABEL_COLOURS = {
    "previous-token": "#1f77b4",
    "induction": "#d62728",
    "sink": "#7f7f7f",
    "local": "#2ca02c",
    "mixed": "#ffffff",
}


def parse_size(text: str) -> tuple[int, int]:
    """--size WIDTHxHEIGHT in pixels -> (width, height)."""
    try:
        w, h = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise NanoGPTError(f"--size must be WIDTHxHEIGHT in pixels, such as 1600x1200, got {text!r}") from None
    if not (64 <= w <= 20000 and 64 <= h <= 20000):
        raise NanoGPTError(f"--size must be between 64 and 20000 pixels each way, got {text!r}")
    return w, h


def shown(token: str) -> str:
    """A token as a tick label: spaces as ␣, line ends as ↵, other control characters escaped."""
    out = []
    for ch in token:
        if ch == " ":
            out.append("␣")
        elif ch == "\n":
            out.append("↵")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 32 or ch == "\x7f":
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    # matplotlib reads $...$ as math: escape it
    return "".join(out).replace("$", r"\$") or "∅"


def pyplot():
    """matplotlib's pyplot drawing into files, or the one sentence on installing it (call it before slow work)."""
    matplotlib = require("matplotlib", "plot", "drawing the figures")
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path, size: tuple[int, int] | None) -> Path:
    plt = pyplot()
    out = Path(out)
    if size is not None:
        fig.set_size_inches(size[0] / DPI, size[1] / DPI)
    fmt = out.suffix.lstrip(".").lower() or "png"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out, lambda tmp: fig.savefig(tmp, format=fmt, dpi=DPI))
    except ValueError as e:  # an unknown format: matplotlib names the ones it has
        raise NanoGPTError(f"cannot write {out}: {str(e).splitlines()[0]}") from None
    finally:
        plt.close(fig)
    return out


def draw_attention(
    maps: AttentionMaps,
    out: Path,
    layer: int | None = None,
    head: int | None = None,
    size: tuple[int, int] | None = None,
    max_tokens: int = MAX_TOKENS,
) -> Path:
    """Heatmaps of the attention: every layer (rows) x head (columns), or only the layer and/or head given.
    Each row of a heatmap is one token's attention over the tokens before it; the last max_tokens are drawn."""
    plt = pyplot()
    from matplotlib.colors import PowerNorm

    L, nh, T, _ = maps.probs.shape
    check_selection(L, nh, layer, head)
    layers = [layer] if layer is not None else list(range(L))
    heads = [head] if head is not None else list(range(nh))
    start = max(0, T - max_tokens)
    n = T - start
    labels = [shown(t) for t in maps.tokens[start:]]
    single = len(layers) * len(heads) == 1
    panel = max(5.0, 0.16 * n) if single else min(7.5, max(2.2, 0.125 * n))  # inches
    scale = min(1.0, MAX_FIGURE_IN / (panel * max(len(layers), len(heads))))
    panel *= scale
    font = min(9.0, 0.8 * panel * 72 / n)  # points: a label as tall as most of its row
    ticks = font >= 4.0  # a grid shrunk below that has no room for token labels: --layer/--head show them
    fig, axes = plt.subplots(
        len(layers),
        len(heads),
        squeeze=False,
        dpi=DPI,
        layout="constrained",
        figsize=(panel * len(heads) + 1.5, panel * len(layers) + 1.0),
    )
    norm = PowerNorm(gamma=0.5, vmin=0.0, vmax=1.0)  # square-root colours: weak weights stay visible
    cmap = plt.get_cmap("viridis").with_extremes(bad="#f0f0f0")  # bad: the future, which no token sees
    future = torch.ones(n, n, dtype=torch.bool).triu(diagonal=1)
    image = None
    for r, li in enumerate(layers):
        for c, hi in enumerate(heads):
            ax = axes[r][c]
            grid = maps.probs[li, hi, start:, start:].masked_fill(future, float("nan"))  # (n, n)
            image = ax.imshow(grid.numpy(), cmap=cmap, norm=norm, interpolation="nearest")
            ax.set_title(f"layer {li} head {hi}", fontsize=11 if single else 9)
            # tokens along the left column and the bottom row: every panel shares them
            bottom, left = r == len(layers) - 1, c == 0
            ax.set_xticks(range(n) if ticks and bottom else [])
            ax.set_yticks(range(n) if ticks and left else [])
            if ticks and bottom:
                ax.set_xticklabels(labels, rotation=90, fontsize=font)
            if ticks and left:
                ax.set_yticklabels(labels, fontsize=font)
            ax.tick_params(length=0, pad=1)
            if bottom:
                ax.set_xlabel("attended token (key)", fontsize=9)
            if left:
                ax.set_ylabel("attending token (query)", fontsize=9)
    fig.colorbar(image, ax=axes, shrink=0.6 if single else 0.3, label="attention weight")
    note = f"; the last {n} of {T} tokens shown" if start else ""
    cut = f"; the prompt's first {maps.cut:,} tokens cut to fit the context" if maps.cut else ""
    marks = "; ␣ is a space, ↵ a line end" if ticks and any(c in "".join(labels) for c in "␣↵") else ""
    fig.suptitle(f"attention of {maps.name}{note}{cut}{marks}", fontsize=12)
    return _save(fig, out, size)


SCORES = (
    ("previous_token", "previous-token score", "Blues"),
    ("induction", "induction score", "Reds"),
    ("first_token", "first-token (sink) score", "Greys"),
    ("mean_distance", "mean distance (tokens)", "Greens_r"),
)


def draw_heads(report: HeadReport, out: Path, size: tuple[int, int] | None = None) -> Path:
    """The four scores as layers x heads grids with each cell's value written in it, the labels as a fifth grid,
    and what the labels mean."""
    plt = pyplot()
    from matplotlib.colors import ListedColormap

    L, nh = report.n_layer, report.n_head
    cell = max(0.4, min(0.9, 6.0 / max(L, nh)))  # inches per head
    fig, axes = plt.subplots(2, 3, dpi=DPI, layout="constrained", figsize=(3 * (cell * nh + 0.9), 2 * (cell * L + 1.1)))
    axes = axes.flatten()
    font = max(5.0, min(10.0, cell * 13))
    for ax, (key, title, cmap) in zip(axes, SCORES):
        grid = torch.tensor(report.grid(key))  # (L, nh)
        base = getattr(report.baseline, key)
        top = 1.0 if key != "mean_distance" else max(float(grid.max()), 2 * base, 1.0)
        ax.imshow(grid.numpy(), cmap=cmap, vmin=0.0, vmax=top, aspect="auto")
        for i in range(L):
            for j in range(nh):
                v = float(grid[i, j])
                dark = v / top > 0.55 if key != "mean_distance" else v / top < 0.45
                ax.text(
                    j,
                    i,
                    f"{v:.1f}" if key == "mean_distance" else f"{v:.2f}",
                    ha="center",
                    va="center",
                    fontsize=font,
                    color="white" if dark else "black",
                )
        ax.set_title(
            f"{title}\n(uniform attention: {base:.1f})"
            if key == "mean_distance"
            else f"{title}\n(uniform attention: {base:.2f})",
            fontsize=10,
        )
    ax = axes[len(SCORES)]
    index = {name: i for i, name in enumerate(LABELS)}
    grid = torch.zeros(L, nh)
    for h in report.heads:
        grid[h.layer, h.head] = index[h.label]
    ax.imshow(
        grid.numpy(),
        cmap=ListedColormap([LABEL_COLOURS[name] for name in LABELS]),
        vmin=-0.5,
        vmax=len(LABELS) - 0.5,
        aspect="auto",
    )
    for h in report.heads:
        ax.text(
            h.head,
            h.layer,
            h.label.replace("previous-token", "prev-\ntoken"),
            ha="center",
            va="center",
            fontsize=font * 0.8,
            color="white" if h.label in ("previous-token", "induction", "sink") else "black",
        )
    ax.set_title("label", fontsize=10)
    for ax in axes[: len(SCORES) + 1]:
        ax.set_xticks(range(nh))
        ax.set_yticks(range(L))
        ax.set_xlabel("head", fontsize=9)
        ax.set_ylabel("layer", fontsize=9)
        ax.tick_params(labelsize=8)
    axes[-1].axis("off")
    axes[-1].text(0.0, 1.0, LABEL_LEGEND, va="top", ha="left", fontsize=9, transform=axes[-1].transAxes, wrap=True)
    probe = report.probe
    how = f"{probe['rows']} random sequences of {probe['length']} tokens, each repeated (seed {probe['seed']})"
    if probe.get("prompt_tokens"):
        how += f"; previous-token, first-token and distance on a {probe['prompt_tokens']}-token prompt"
    fig.suptitle(f"attention heads of {report.name}\n{how}", fontsize=11)
    return _save(fig, out, size)


LABEL_LEGEND = (
    f"induction: induction score >= {INDUCTION_MIN}\n"
    f"previous-token: previous-token score >= {PREVIOUS_MIN}\n"
    f"sink: first-token score >= {SINK_MIN}\n"
    "   (the highest of these three wins)\n"
    f"local: none of those, mean distance\n   <= {LOCAL_SHARE:g} x uniform attention's\n"
    "mixed: none of the above\n\n"
    "induction: on the second copy, attention\n   to the token after this token's first copy\n"
    "others: on the first copy (or the prompt)"
)


def draw_positions(views: PositionViews, name: str, out: Path, size: tuple[int, int] | None = None) -> Path:
    """Two or three panels describing the position scheme (see positions.py)."""
    plt = pyplot()
    if views.kind == "rope":
        fig, axes = plt.subplots(1, 3, dpi=DPI, figsize=(17, 5.2), layout="constrained")
        pairs = len(views.wavelengths)
        axes[0].bar(range(pairs), views.wavelengths.numpy(), color="#1f77b4")
        axes[0].set_yscale("log")
        axes[0].axhline(views.table.size(0), color="#d62728", linestyle="--", linewidth=1, label="context length")
        axes[0].set_title("wavelength of each rotating pair")
        axes[0].set_xlabel("pair i (dimensions i and i + head size/2)")
        axes[0].set_ylabel("tokens per full turn (log)")
        axes[0].legend(fontsize=8)
        image = axes[1].imshow(
            views.table.numpy(), cmap="RdBu", vmin=-1, vmax=1, aspect="auto", interpolation="nearest"
        )
        axes[1].set_title("cos(position x frequency): fast pairs left, slow right")
        axes[1].set_xlabel("pair i")
        axes[1].set_ylabel("position")
        fig.colorbar(image, ax=axes[1], shrink=0.8)
        axes[2].plot(range(len(views.decay)), views.decay.numpy(), color="#2ca02c")
        axes[2].axhline(0, color="black", linewidth=0.6)
        axes[2].set_title("score q.k of two equal vectors, d tokens apart")
        axes[2].set_xlabel("distance d (tokens)")
        axes[2].set_ylabel("relative to d = 0")
        axes[2].grid(alpha=0.3)
    else:
        fig, axes = plt.subplots(1, 2, dpi=DPI, figsize=(13, 5.8), layout="constrained")
        image = axes[0].imshow(
            views.table.numpy(),
            cmap="RdBu",
            aspect="auto",
            interpolation="nearest",
            vmin=-float(views.table.abs().max()),
            vmax=float(views.table.abs().max()),
        )
        axes[0].set_title(f"the {views.kind} position table (added to the token embeddings)")
        axes[0].set_xlabel("embedding dimension")
        axes[0].set_ylabel("position")
        fig.colorbar(image, ax=axes[0], shrink=0.8)
        image = axes[1].imshow(views.similarity.numpy(), cmap="RdBu", vmin=-1, vmax=1, interpolation="nearest")
        axes[1].set_title("cosine similarity between positions")
        axes[1].set_xlabel("position")
        axes[1].set_ylabel("position")
        fig.colorbar(image, ax=axes[1], shrink=0.8)
    fig.suptitle(f"positions of {name}: {views.kind}", fontsize=12)
    return _save(fig, out, size)
