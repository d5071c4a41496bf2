"""The Typer app: every command family's module registered in one place, and the console script.

nanogpt --help
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from nanogpt_cli.cli import data, eval, export, generate, inspect, runs, serve, train
from nanogpt_cli.cli.common import fail

app = typer.Typer(
    help="Prepare text, train a small GPT, sample from it and evaluate it.\n\n"
    "Example: nanogpt prepare examples/tinyshakespeare.txt --name shk --tokenizer char",
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish and PowerShell
    pretty_exceptions_enable=False,
    # click's plain help: wraps to the terminal (80 columns included) without cutting flag names or showing
    # <bool> after flags; usage errors become one line in main()
    rich_markup_mode=None,
)


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context, version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False
):
    if version:
        from nanogpt_cli import __version__

        print(f"nanogpt {__version__}")
        raise typer.Exit(0)
    if ctx.invoked_subcommand is None:
        print(ctx.get_help())
        raise typer.Exit(0)


def show_help_without_command(ctx: typer.Context) -> None:
    """A command family called alone (`nanogpt eval`) prints its help, as the top level does."""
    if ctx.invoked_subcommand is None:
        print(ctx.get_help())
        raise typer.Exit(0)


# the commands in the order `nanogpt --help` lists them: data, training, using a model, looking at runs. Each has a
# one-sentence summary for that list that fits 80 columns (click cuts a longer first line of the help with "...")
app.command(short_help="Tokenize text into a dataset of shards that training reads.")(data.prepare)
app.add_typer(
    data.tokenizer_app,
    name="tokenizer",
    short_help="Train a BPE tokenizer, or see how a tokenizer splits text.",
    callback=show_help_without_command,
    invoke_without_command=True,
)
app.command(short_help="Train a GPT on a prepared dataset, with resumable checkpoints.")(train.train)
app.command(short_help="Fine-tune trained weights (SFT, DPO or GRPO), in full or with LoRA.")(train.finetune)
app.command(short_help="Generate text from a trained model.")(generate.sample)
app.command(short_help="Talk to a model in the terminal.")(generate.chat)
app.add_typer(
    eval.eval_app,
    name="eval",
    short_help="Evaluate a trained model.",
    callback=show_help_without_command,
    invoke_without_command=True,
)
app.command(short_help="Serve a model over the OpenAI API, with a chat page.")(serve.serve)
app.command(short_help="Write a run as a Hugging Face folder or a GGUF file.")(export.export)
app.command(short_help="List the runs in a folder, with their progress and status.")(runs.runs)
app.command(short_help="Describe a run or weights file: config, size, losses, files.")(runs.info)
app.command(short_help="Draw the loss curves of one run or several.")(runs.plot)
app.command(short_help="Print a run's report card, or compare runs side by side.")(runs.report)
app.add_typer(
    inspect.inspect_app,
    name="inspect",
    short_help="Look inside a model: attention maps, heads, positions.",
    callback=show_help_without_command,
    invoke_without_command=True,
)


def main():
    """The console script. Typer runs in click's non-standalone mode so that a usage error (unknown option, bad
    value, missing argument) becomes the same one line and exit code 1 as every other error, not a panel and 2."""
    try:
        code = app(standalone_mode=False)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except typer.Abort:
        print("aborted", file=sys.stderr)
        raise SystemExit(1) from None
    except Exception as e:
        if not (callable(getattr(e, "format_message", None)) and hasattr(e, "exit_code")):
            raise  # not a usage error: a bug, shown as a traceback
        ctx = getattr(e, "ctx", None)
        hint = f"; see {ctx.command_path} --help" if ctx is not None else ""
        message = " ".join(e.format_message().split()).rstrip(".")
        fail(f"{message[:1].lower()}{message[1:]}{hint}")
        raise SystemExit(1) from None
    raise SystemExit(code if isinstance(code, int) else 0)
