"""eval: scores of a model (library: inference/evaluate.py, and inference/tasks.py on lm-evaluation-harness).

nanogpt eval perplexity --checkpoint checkpoints/shk --data shakespeare-char
nanogpt eval tasks hf:gpt2 --tasks hellaswag,arc_easy --limit 100
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from nanogpt_cli.cli.common import DATA_DIR_HELP, SCORE_DTYPE, load_options, one_line_errors
from nanogpt_cli.config import DECODING_FIELDS, LoadSpec
from nanogpt_cli.errors import NanoGPTError

# scoring runs whole windows through the model's forward: no decode step, so no decode backend
# scoring runs the model's own forward over whole windows: nothing is decoded, so no backend and no draft
WINDOWS = "scoring runs the model's own forward over whole windows, never a decode step"
SCORES = dict.fromkeys(DECODING_FIELDS, WINDOWS)

eval_app = typer.Typer(
    help="Evaluate a trained model: perplexity, or scores on standard tasks.\n\n"
    "Example: nanogpt eval perplexity --checkpoint checkpoints/shk --data shakespeare-char",
    rich_markup_mode=None,
)


@eval_app.command(short_help="Score a dataset split or text files: loss, perplexity.")
@one_line_errors
@load_options(source="--checkpoint", leaves=SCORES, dtype=SCORE_DTYPE)
def perplexity(
    data: Annotated[str | None, typer.Option(help="A prepared dataset to score.")] = None,
    data_dir: Annotated[Path, typer.Option(help=DATA_DIR_HELP)] = Path("data"),
    split: Annotated[str, typer.Option(help="train or val.")] = "val",
    input: Annotated[
        list[Path] | None, typer.Option(help="Text file(s) to score instead (repeatable).", metavar="<path>")
    ] = None,
    stride: Annotated[int | None, typer.Option(help="Tokens between window starts (default half the context).")] = None,
    batch_size: Annotated[int, typer.Option(help="Windows per forward pass.")] = 32,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")] = False,
    *,
    spec: LoadSpec,  # the model and how it loads (load_options)
):
    """Score every token of a dataset split or text files once: loss, perplexity, bits per byte.

    Example: nanogpt eval perplexity --checkpoint checkpoints/shk --data shakespeare-char --split val
    """
    from nanogpt_cli import api
    from nanogpt_cli.cli.ui import console, eval_table

    if (data is None) == (not input):
        raise NanoGPTError("give either --data NAME (with --split) or --input FILE")
    if split not in ("train", "val"):
        raise NanoGPTError(f"--split must be train or val, got {split!r}")
    if batch_size < 1:
        raise NanoGPTError(f"--batch-size must be at least 1, got {batch_size}")
    model = api.load(spec)
    from nanogpt_cli.cli.common import say_kernels
    from nanogpt_cli.cli.ui import eval_progress

    say_kernels()  # scoring runs whole forwards: the note only where loading built (or failed to build) them

    with eval_progress() as progress:  # a bar on a terminal: tokens scored, rate, time left
        what = dict(data=data, split=split, data_dir=data_dir) if data is not None else dict(files=input)
        result = model.score(**what, stride=stride, batch_size=batch_size, progress=progress)
    if json_out:
        print(json.dumps(result.to_dict()))
    else:
        console.print(eval_table(result))


@eval_app.command("tasks", short_help="Score a model on lm-evaluation-harness tasks: HellaSwag, MMLU.")
@one_line_errors
@load_options(leaves=SCORES, dtype=SCORE_DTYPE)
def tasks_command(
    tasks: Annotated[
        list[str],
        typer.Option(
            "--tasks",
            help="lm-eval task, group or tag names, glob patterns or YAML files; comma-separated or repeated.",
            metavar="<names>",
        ),
    ],
    limit: Annotated[int | None, typer.Option(help="Score the first N documents of each task only.")] = None,
    num_fewshot: Annotated[
        int | None, typer.Option(help="Examples shown before each question (default: the task's own).")
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option(help="Rows per forward pass (default: as many as about 2 GB beside the weights holds, up to 32)."),
    ] = None,
    apply_chat_template: Annotated[
        bool, typer.Option("--apply-chat-template", help="Render each prompt with the model's chat template.")
    ] = False,
    include_path: Annotated[Path | None, typer.Option(help="A folder of task YAML files of your own.")] = None,
    output_path: Annotated[
        Path | None, typer.Option(help="Write lm-eval's results JSON and per-sample logs under this folder.")
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print lm-eval's results JSON instead of a table.")] = False,
    *,
    spec: LoadSpec,  # the model and how it loads (load_options)
):
    """Score a model on lm-evaluation-harness tasks (HellaSwag, ARC, MMLU, GSM8K, ... or your own YAMLs).

    Example: nanogpt eval tasks checkpoints/shk --tasks hellaswag,arc_easy --limit 100
    """
    from nanogpt_cli import api
    from nanogpt_cli.cli.common import note

    results = api.evaluate_tasks(
        spec,
        tasks,
        limit=limit,
        num_fewshot=num_fewshot,
        batch_size=batch_size,
        include_path=include_path,
        apply_chat_template=apply_chat_template,
        output_path=output_path,
        callback=lambda event: note(event.text),
    )
    if json_out:
        print(results.to_json())
        return
    from nanogpt_cli.cli.ui import console, tasks_table

    console.print(tasks_table(results, spec.source))
    if output_path is not None:
        note(f"lm-eval's results JSON and per-sample logs are under {output_path}")
