"""Datasets: prepare text into token shards, and read them back for training and evaluation.

    result = prepare("examples/tinyshakespeare.txt", "shk", tokenizer="char", data_dir=Path("data"))
    train = open_split(Path("data"), "shk", "train"); x = train.windows(8, 257, torch.Generator())

- `sources`: where text comes from (text files, folders and globs, .jsonl/.json/.parquet/.csv through
  `datasets`, hf:OWNER/NAME, the Tiny Shakespeare download), as one stream of document pieces;
- `tokenizing`: pieces -> token ids, in order, in this process or in worker processes;
- `shards`: the shard writer, the train/val split and progress.json (the point a resumed prepare continues from);
- `pipeline`: `prepare`, its options and the staging folder DATA_DIR/.NAME.partial;
- `reader`: meta.json and the shards of a split, all that training and evaluation need (numpy only).

The reader is imported here at once; the writer side loads when `prepare` is first used, and `datasets` only
when a source needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nanogpt_cli.data.reader import (
    SPLITS,
    TokenShards,
    list_datasets,
    load_meta,
    open_split,
)

if TYPE_CHECKING:
    from nanogpt_cli.data.pipeline import (
        PrepareOptions,
        PrepareProgress,
        PrepareResult,
        Progress,
        interrupted_prepare,
        prepare,
        prepare_with,
    )
    from nanogpt_cli.data.shards import SHARD_TOKENS, token_dtype
    from nanogpt_cli.data.sources import cache_dir, download_shakespeare

_LAZY = {
    "pipeline": (
        "PrepareOptions",
        "PrepareProgress",
        "PrepareResult",
        "Progress",
        "interrupted_prepare",
        "prepare",
        "prepare_with",
    ),
    "shards": ("SHARD_TOKENS", "token_dtype"),
    "sources": ("cache_dir", "download_shakespeare", "open_source"),
}

__all__ = [
    "SHARD_TOKENS",
    "SPLITS",
    "PrepareOptions",
    "PrepareProgress",
    "PrepareResult",
    "Progress",
    "TokenShards",
    "cache_dir",
    "download_shakespeare",
    "interrupted_prepare",
    "open_source",
    "list_datasets",
    "load_meta",
    "open_split",
    "prepare",
    "prepare_with",
    "token_dtype",
]


def __getattr__(name: str):
    """The writer's names, imported on first use: training imports this package and needs only the reader."""
    import importlib

    for module, names in _LAZY.items():
        if name in names:
            return getattr(importlib.import_module(f"nanogpt_cli.data.{module}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
