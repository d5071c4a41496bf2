"""The `nanogpt` command line: thin typed commands over the library. Nothing imports this module.

    nanogpt prepare examples/tinyshakespeare.txt --name shakespeare-char --tokenizer char
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from nanogpt_cli.errors import NanoGPTError

app = typer.Typer(
    help="Prepare text, train a small GPT, sample from it and evaluate it.\n\n"
    "Example: nanogpt prepare examples/tinyshakespeare.txt --name shk --tokenizer char",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
eval_app = typer.Typer(help="Evaluate a trained model.\n\nExample: nanogpt eval perplexity --checkpoint checkpoints/shk",
                       no_args_is_help=True)
app.add_typer(eval_app, name="eval")


def fail(message: str) -> typer.Exit:
    """Print one styled error line on stderr and return the exit to raise."""
    from nanogpt_cli.ui import err_console

    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    return typer.Exit(1)


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False):
    if version:
        from nanogpt_cli import __version__

        print(f"nanogpt {__version__}")
        raise typer.Exit(0)


# --- commands go below; each one catches NanoGPTError and turns it into fail(...) ---


def main():
    try:
        app()
    except NanoGPTError as e:  # a library error that escaped a command
        raise SystemExit(fail(str(e)).exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130)
