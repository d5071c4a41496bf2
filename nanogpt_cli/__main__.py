"""`python -m nanogpt_cli` runs the same Typer app as the `nanogpt` console script."""

from nanogpt_cli.cli import main

main()
