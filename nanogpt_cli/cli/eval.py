"""eval: scores of a model (library: inference/evaluate.py).

nanogpt eval perplexity --checkpoint checkpoints/shk --data shakespeare-char
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from nanogpt_cli.cli.common import DATA_DIR_HELP, Checkpoint, Device, Last, ScoreDtype, Threads, one_line_errors
from nanogpt_cli.config import Dtype
from nanogpt_cli.errors import NanoGPTError

eval_app = typer.Typer(
    help="Evaluate a trained model.\n\n"
    "Example: nanogpt eval perplexity --checkpoint checkpoints/shk --data shakespeare-char",
    rich_markup_mode=None,
)


@eval_app.command(short_help="Score a dataset split or text files: loss, perplexity.")
@one_line_errors
def perplexity(
    checkpoint: Checkpoint,
    data: Annotated[str | None, typer.Option(help="A prepared dataset to score.")] = None,
    data_dir: Annotated[Path, typer.Option(help=DATA_DIR_HELP)] = Path("data"),
    split: Annotated[str, typer.Option(help="train or val.")] = "val",
    input: Annotated[
        list[Path] | None, typer.Option(help="Text file(s) to score instead (repeatable).", metavar="<path>")
    ] = None,
    stride: Annotated[int | None, typer.Option(help="Tokens between window starts (default half the context).")] = None,
    batch_size: Annotated[int, typer.Option(help="Windows per forward pass.")] = 32,
    last: Last = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")] = False,
    device: Device = "auto",
    dtype: ScoreDtype = Dtype.float32,
    threads: Threads = None,
):
    """Score every token of a dataset split or text files once: loss, perplexity, bits per byte.

    Example: nanogpt eval perplexity --checkpoint checkpoints/shk --data shakespeare-char --split val
    """
    from nanogpt_cli.cli.ui import console, eval_table
    from nanogpt_cli.inference.evaluate import perplexity_of_files, perplexity_of_split
    from nanogpt_cli.interop.loading import load_for_inference

    if (data is None) == (not input):
        raise NanoGPTError("give either --data NAME (with --split) or --input FILE")
    if split not in ("train", "val"):
        raise NanoGPTError(f"--split must be train or val, got {split!r}")
    if batch_size < 1:
        raise NanoGPTError(f"--batch-size must be at least 1, got {batch_size}")
    from nanogpt_cli.device import set_threads

    set_threads(threads)
    loaded = load_for_inference(checkpoint, last=last, device=device, dtype=dtype)
    from nanogpt_cli.cli.ui import eval_progress

    with eval_progress() as progress:  # a bar on a terminal: tokens scored, rate, time left
        if data is not None:
            result = perplexity_of_split(
                loaded.model, loaded.tokenizer, data_dir, data, split, stride, batch_size, progress
            )
        else:
            result = perplexity_of_files(loaded.model, loaded.tokenizer, input, stride, batch_size, progress)
    if json_out:
        print(json.dumps(result.to_dict()))
    else:
        console.print(eval_table(result))
