"""Look at what the tool made: the runs table and `info`, loss curves, and inside a model its attention maps,
what each head does, and what its positions look like.

    loaded = load_for_inference("checkpoints/shk", dtype="float32")
    maps = attention_maps(loaded, "ROMEO: But soft"); draw_attention(maps, Path("attention.png"))

- attention.py: the explicit attention path (its logits equal the model's forward) and one prompt's maps
- heads.py: the probes (previous-token, first-token, mean distance, induction) and each head's label
- positions.py: the position scheme's tables; draw.py: the figures (matplotlib, the `plot` extra)
- catalog.py: the runs table and `info` of a run, weights file or export; plot.py: loss curves of runs

May import every layer below: the top-level modules, data/, runs/, interop/. Never training/, serve/ or cli/.

A package named like the standard library's `inspect` is fine here: it is only ever imported as
nanogpt_cli.inspect, and the package folder is never on sys.path itself.
"""

from nanogpt_cli.inspect.attention import (
    AttentionMaps,
    attention_forward,
    attention_maps,
    display_name,
)
from nanogpt_cli.inspect.heads import HeadReport, HeadScores, heads_table, score_heads
from nanogpt_cli.inspect.positions import PositionViews, position_views

__all__ = [
    "AttentionMaps",
    "HeadReport",
    "HeadScores",
    "PositionViews",
    "attention_forward",
    "attention_maps",
    "display_name",
    "heads_table",
    "position_views",
    "score_heads",
]
