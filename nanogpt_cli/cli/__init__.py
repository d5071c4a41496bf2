"""The `nanogpt` command line: thin typed commands over the library. Nothing in the library imports it.

    nanogpt prepare examples/tinyshakespeare.txt --name shakespeare-char --tokenizer char

- app.py: the Typer app, each family registered in one place, and `main` (the console script)
- common.py: one-line errors, notes, the generated config options, and the options several families share
- data.py: prepare, tokenizer; train.py: train, finetune; generate.py: sample, chat; eval.py: eval;
  serve.py: serve; export.py: export; runs.py: runs, info, plot; inspect.py: inspect
- ui.py: rich output (tables, the training display), on stdout only when it is a terminal
"""

from nanogpt_cli.cli.app import app, main

__all__ = ["app", "main"]
