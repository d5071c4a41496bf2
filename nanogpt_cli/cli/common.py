"""What every command shares: one-line errors and notes, and the options generated from dataclasses: the config's
(train, finetune) and LoadSpec's (every command that loads a model, which gets them as one `spec`).

    @one_line_errors
    @load_options(source="--checkpoint")
    def sample(prompt: str = "", *, spec: LoadSpec): ...
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import typing
from pathlib import Path
from typing import Annotated, Any

import typer

from nanogpt_cli.config import Dtype, LoadSpec, TrainConfig, field_help, field_types, flag
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
            from nanogpt_cli import api

            api.record_error(str(e))  # under a torch launcher: the sentence its report of the failure shows
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
    """`command`'s own options plus one option per field of GPTConfig and TrainConfig and one per field of the
    RunRequest (--config, --out, --resume, --force, --init-from, --last), generated from each field's type (a
    Choice offers its choices), help text, panel and default, as config.py and training/request.py declare them.
    They reach `command` as one RunRequest, `request` (placed where the command declares that parameter), whose
    flags are the config options given; the others stay unset, so a preset or config file can fill them, and
    their help shows the value they stand for when nothing does."""
    from nanogpt_cli.api import RunRequest
    from nanogpt_cli.config import MAIN, GPTConfig

    hints = typing.get_type_hints(command, include_extras=True)
    asked = [request_option(f) for f in dataclasses.fields(RunRequest) if f.name != "flags"]
    own = []
    for p in inspect.signature(command).parameters.values():
        own += asked if p.name == "request" else [p.replace(annotation=hints[p.name], kind=p.KEYWORD_ONLY)]
    generated = [(cls, f) for cls in (GPTConfig, TrainConfig) for f in dataclasses.fields(cls)]
    options = {f.name: config_option(cls, f) for cls, f in generated}
    first = [options[f.name] for cls, f in generated if f.metadata.get("panel") == MAIN]  # beside the command's own

    @functools.wraps(command)
    def run(**kwargs):
        given = {name: kwargs.pop(name) for name in options}
        chosen = {p.name: kwargs.pop(p.name) for p in asked}
        flags = {k: v for k, v in given.items() if v is not None}
        return command(**kwargs, request=RunRequest(flags, **chosen))

    params = first + own + [p for p in options.values() if p not in first]
    run.__signature__ = inspect.Signature(params)
    run.__annotations__ = {p.name: p.annotation for p in params}
    return run


def request_option(field):
    """The CLI option of one RunRequest field: --name, of the field's type, with the help declared beside it."""
    import inspect
    import typing

    from nanogpt_cli.api import RunRequest

    kind = typing.get_type_hints(RunRequest)[field.name]
    option = typer.Option(f"--{flag(field.name)}", help=field.metadata["help"], **field.metadata["cli"])
    return inspect.Parameter(
        field.name, inspect.Parameter.KEYWORD_ONLY, default=field.default, annotation=Annotated[kind, option]
    )


# what a field's declaration cannot say: --data has no default, yet training needs it unless a resumed run or a
# --config file gives it
REQUIRED_UNLESS = {"data": "[required unless --resume or --config gives it]"}


def config_option(cls, field):
    """The CLI option of one config field: --name (--name/--no-name for a bool), of the field's type. The default
    its help shows is the field's, written into the help text: the option's own default is None (unset)."""
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
ARGUMENT = "argument"  # load_options(source=ARGUMENT): the source is the command's argument, not an option
# eval and inspect measure: their default dtype is float32, and their help says so (LoadSpec's explains auto)
SCORE_DTYPE = (
    Dtype.float32,
    "Precision the weights are cast to; the default float32 scores in full precision, comparable between runs "
    "(auto: from the device and the weights' size).",
)


def load_options(source: str = ARGUMENT, leaves: dict[str, str] | None = None, **overrides: tuple[Any, str]):
    """A command that loads a model: its own options plus one per LoadSpec field (config.py), generated from each
    field's type, help and default; the values given reach the command as one LoadSpec, `spec`. source: ARGUMENT
    (the command's first argument) or the option that takes it ("--checkpoint"); leaves: the fields the command
    does not offer, each with why (the spec keeps their defaults); overrides: a field's (default, help) for this
    command. `tests/test_source.py` holds every load command to one option per field it does not leave."""
    leaves = leaves or {}

    def wrap(command):
        hints = typing.get_type_hints(command, include_extras=True)
        own = [
            p.replace(annotation=hints[p.name], kind=inspect.Parameter.KEYWORD_ONLY)
            for p in inspect.signature(command).parameters.values()
            if p.name != "spec"
        ]
        fields = [f for f in dataclasses.fields(LoadSpec) if f.name not in leaves]
        options = [load_option(f, source, overrides.get(f.name)) for f in fields]

        @functools.wraps(command)
        def run(**kwargs):
            given = {f.name: kwargs.pop(f.name) for f in fields}
            unset = {f.name: f.metadata["unset"] for f in fields if given[f.name] is None}
            return command(**kwargs, spec=LoadSpec(**{**given, **unset}))

        params = options[:1] + own + options[1:]
        run.__signature__ = inspect.Signature(params)
        run.__annotations__ = {p.name: p.annotation for p in params}
        run.leaves = leaves
        return run

    return wrap


def load_option(field, source: str, override: tuple[Any, str] | None) -> inspect.Parameter:
    """The CLI parameter of one LoadSpec field: the source as an argument or an option (required); a bool as a
    flag; an optional value (None) unset unless given, its help saying what applies then."""
    kind, optional = field_types(LoadSpec)[field.name]
    default, help = override or (field.default, field.metadata["help"])
    if field.name == "source":
        declared = typer.Argument(help=help) if source == ARGUMENT else typer.Option(source, help=help)
        return inspect.Parameter("source", inspect.Parameter.KEYWORD_ONLY, annotation=Annotated[str, declared])
    name = f"--{field.metadata['option'] or flag(field.name)}"
    quiet = default is None or kind is bool  # a flag, or an option whose help says what applies unset
    option = typer.Option(name, help=help, show_default=not quiet)
    annotation = Annotated[kind | None if optional else kind, option]
    return inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


DATA_DIR_HELP = field_help(TrainConfig, "data_dir")
# --threads for the commands that train (train, finetune): the help LoadSpec declares
Threads = Annotated[int | None, typer.Option(help=field_help(LoadSpec, "threads"), show_default=False)]
PromptFile = Annotated[Path | None, typer.Option(help="Read the prompt from this file.")]


def note(message: str) -> None:
    from nanogpt_cli.cli.ui import err_console

    err_console.print(f"note: {message}", highlight=False, soft_wrap=True, markup=False)


def say_kernels(model=None) -> None:
    """Our decode kernels' build in one note, once per process, where this process built them (its time and
    instruction set) or failed to (the compiler's last error). model: an api.Model about to decode; where its
    backend is our kernels' (`cpu`), the build (made on first use anyway) is made now, so that the note comes
    before the output. A model decoded by `--backend torch` builds nothing."""
    from nanogpt_cli import api

    text = api.kernel_note(model)
    if text:
        note(text)
