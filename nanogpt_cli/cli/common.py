"""What every command shares: one-line errors and notes, the options generated from the config dataclasses, and
the options several families declare alike (the weights to load, device, dtype, threads).

    @one_line_errors
    def sample(checkpoint: Checkpoint, last: Last = False, device: Device = "auto"): ...
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Annotated

import typer

from nanogpt_cli.config import Dtype, TrainConfig, field_help, flag
from nanogpt_cli.errors import NanoGPTError


def fail(message: str) -> typer.Exit:
    """Print one styled error line on stderr and return the exit to raise."""
    from rich.markup import escape

    from nanogpt_cli.cli.ui import err_console

    # escaped: a message may hold brackets that are text, not styles (pip install -e ".[hf]")
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(1)


def one_line_errors(command):
    """Every command's library errors become one styled line on stderr and exit code 1."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except NanoGPTError as e:
            from nanogpt_cli.training.launch import record_error

            record_error(str(e))  # under a torch launcher: the sentence its report of the failure shows
            raise (fail(str(e)) if prints() else typer.Exit(1)) from None

    return run


def stopped(message: str) -> typer.Exit:
    """Ctrl-C: what was kept (on stderr), and the shell's exit code for it."""
    from nanogpt_cli.cli.ui import err_console

    err_console.print(message, highlight=False, soft_wrap=True)
    return typer.Exit(130)


def prints() -> bool:
    """Whether this process prints: always, except under torchrun, where rank 0 speaks for all (they meet the
    same errors, as they read the same files and agree on losses and stop signals)."""
    return os.environ.get("RANK", "0") == "0"


def config_options(command):
    """`command`'s own options plus one option per field of GPTConfig and TrainConfig, generated from each
    field's type (a Choice offers its choices), help text, panel and default, as config.py declares them. The
    options given reach `command` as one dict, `flags`; the others stay unset, so a preset or config file can
    fill them, and their help shows the value they stand for when nothing does."""
    import dataclasses
    import inspect
    import typing

    from nanogpt_cli.config import MAIN, GPTConfig, TrainConfig

    hints = typing.get_type_hints(command, include_extras=True)
    own = [
        p.replace(annotation=hints[p.name], kind=inspect.Parameter.KEYWORD_ONLY)
        for p in inspect.signature(command).parameters.values()
        if p.name != "flags"
    ]
    generated = [(cls, f) for cls in (GPTConfig, TrainConfig) for f in dataclasses.fields(cls)]
    options = {f.name: config_option(cls, f) for cls, f in generated}
    first = [options[f.name] for cls, f in generated if f.metadata.get("panel") == MAIN]  # beside the command's own

    @functools.wraps(command)
    def run(**kwargs):
        given = {name: kwargs.pop(name) for name in options}
        return command(**kwargs, flags={k: v for k, v in given.items() if v is not None})

    params = first + own + [p for p in options.values() if p not in first]
    run.__signature__ = inspect.Signature(params)
    run.__annotations__ = {p.name: p.annotation for p in params}
    return run


# what a field's declaration cannot say: --data has no default, yet training needs it unless a resumed run or a
# --config file gives it
REQUIRED_UNLESS = {"data": "[required unless --resume or --config gives it]"}


def config_option(cls, field):
    """The CLI option of one config field: --name (--name/--no-name for a bool), of the field's type. The default
    its help shows is the field's, written into the help text: the option's own default is None (unset)."""
    import inspect

    from nanogpt_cli.config import field_types

    kind, _ = field_types(cls)[field.name]
    name, default = flag(field.name), field.default
    help = field.metadata["help"]
    if field.name in REQUIRED_UNLESS:
        help += f"  {REQUIRED_UNLESS[field.name]}"
    elif default not in (None, "") and field.metadata.get("default_shown", True):
        # in the text, not show_default=: Click prints a string given there in parentheses, "[default: (256)]"
        shown = (name if default else f"no-{name}") if kind is bool else default
        help += f"  [default: {shown}]"
    option = typer.Option(
        *([f"--{name}/--no-{name}"] if kind is bool else []),
        help=help,
        show_default=False,
        rich_help_panel=field.metadata.get("panel", cls.PANEL) or None,
        **({"parser": _duration, "metavar": "TIME"} if field.name == "max_time" else {}),
    )
    return inspect.Parameter(
        field.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[kind | None, option]
    )


def _duration(text: str) -> float:
    """--max-time's value: seconds, or 90s, 20m, 2h (a usage error, one line, where it is neither)."""
    from nanogpt_cli.config import parse_duration

    try:
        return parse_duration(text)
    except NanoGPTError as e:
        raise typer.BadParameter(str(e)) from None


# options that several commands share
# the weights a command loads (interop/loading.py, every source it takes): a bare name is a run in checkpoints/, as
# `nanogpt runs` lists it; a LoRA run's weights file holds its adapters, loaded on the base it names
SOURCE_HELP = (
    "Run folder (its best weights) or a run's name in checkpoints/ (a LoRA run loads on its base), a .safetensors "
    "file, a .gguf file (ours or llama.cpp's), a Hugging Face folder or hf:NAME."
)
Checkpoint = Annotated[str, typer.Option(help=SOURCE_HELP)]
Last = Annotated[bool, typer.Option("--last", help="Use a run's last weights instead of its best.")]
Device = Annotated[str, typer.Option(help=field_help(TrainConfig, "device"))]
DtypeOption = Annotated[
    Dtype, typer.Option(help="Precision the weights are cast to (auto: from the device and their size).")
]
# eval and inspect measure: their default is float32, and their help says so (DtypeOption's explains auto)
ScoreDtype = Annotated[
    Dtype,
    typer.Option(
        help="Precision the weights are cast to; the default float32 scores in full precision, comparable between "
        "runs (auto: from the device and the weights' size)."
    ),
]
DATA_DIR_HELP = field_help(TrainConfig, "data_dir")
Quantize = Annotated[
    str | None,
    typer.Option(
        help="Weights of the blocks in int8 (a scale per output channel) or int4 (a scale and zero per "
        "--int4-group inputs), on a CPU; the embedding and head keep --dtype.",
        show_default=False,
    ),
]
Backend = Annotated[
    str | None,
    typer.Option(
        help="How decode steps are computed: cpu (our kernels, on a CPU) or torch (the model's own forward); "
        "default: the first that supports the model.",
        show_default=False,
    ),
]
GroupSize = Annotated[
    int, typer.Option("--int4-group", help="Inputs per int4 scale with --quantize int4: 32, 64, 128 or 256.")
]
Threads = Annotated[
    int | None,
    typer.Option(
        help="CPU threads (default: one per core that other running work leaves free, adapted while a CPU run "
        "trains; OMP_NUM_THREADS, if set, is kept).",
        show_default=False,
    ),
]
PromptFile = Annotated[Path | None, typer.Option(help="Read the prompt from this file.")]

# speculative decoding (inference/speculative.py): sample, chat and serve
DraftSource = Annotated[
    str | None,
    typer.Option(
        help="A smaller model with the same tokenizer (any source --checkpoint takes) that proposes tokens for the "
        "model to check in one forward: faster decoding, the same greedy text and the same distribution.",
        show_default=False,
    ),
]
DraftTokens = Annotated[
    int | None,
    typer.Option(
        help="Tokens the --draft model proposes at a time (default: adapted to how many are kept).", show_default=False
    ),
]


def note(message: str) -> None:
    from nanogpt_cli.cli.ui import err_console

    err_console.print(f"note: {message}", highlight=False, soft_wrap=True, markup=False)


def say_kernels(model=None) -> None:
    """Our decode kernels' build in one note, once per process, where this process built them (its time and
    instruction set) or failed to (the compiler's last error). model: an api.Model about to decode; where its
    backend is our kernels' (`cpu`), the build (made on first use anyway) is made now, so that the note comes
    before the output. A model decoded by `--backend torch` builds nothing."""
    import sys

    if model is not None and model.backend == "cpu":
        from nanogpt_cli.inference.backends import native

        native.available()
    native = sys.modules.get("nanogpt_cli.inference.backends.native")
    text = native.take_note() if native is not None else None
    if text:
        note(text)
