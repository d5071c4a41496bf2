"""What a training invocation asks for, declared once: the config values given, the config file, the run folder,
resume or start over, and the weights to start from. `train` and `finetune` generate their options from these
fields (cli/common.py `run_options`), the Python API builds one from its keywords, and the planners take it whole.

    plan_run(RunRequest({"preset": "tiny", "data": "shk"}, out=Path("checkpoints/tiny")))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def option(default: Any, help: str, **cli: Any) -> Any:
    """A request field with its CLI option's help (and any other typer.Option setting) declared beside it."""
    factory = {"default_factory": dict} if default == {} else {"default": default}
    return field(**factory, metadata={"help": help, "cli": cli})


@dataclass
class RunRequest:
    """One run's choices, as given (nothing filled in yet). The dataset is a config value (`data` in flags),
    declared with its resume rule in config.py like every other."""

    # the config fields given, by field name ("preset" and "data" among them); not an option of its own: each
    # field is one (cli/common.py config_options)
    flags: dict[str, Any] = option({}, "")
    config: Path | None = option(None, "TOML file of config keys; flags override it.")
    out: Path | None = option(None, "Run folder (default checkpoints/DATA-TIMESTAMP).")
    resume: bool = option(False, "Continue the run in --out where it stopped.")
    force: bool = option(False, "Start over in an --out that holds a run (deletes it).")
    init_from: str | None = option(
        None,
        "The weights to start from, with a fresh optimizer: a run folder or a run's name in checkpoints/ (a LoRA run "
        "merged on its base), a .safetensors file, a .gguf file (ours or llama.cpp's), a Hugging Face folder or "
        "hf:NAME (not needed with --resume).",
        show_default=False,
    )
    last: bool = option(False, "With --init-from RUN: its last weights, not its best.")

    def values(self) -> dict[str, Any]:
        """The config file's values with the flags over them (the preset and out may be among them)."""
        from nanogpt_cli.config import load_toml

        return {**(load_toml(Path(self.config)) if self.config is not None else {}), **self.flags}

    def but(self, **changes: Any) -> RunRequest:
        """The same request with some choices changed (more flags merged into its own)."""
        if "flags" in changes:
            changes["flags"] = {**self.flags, **changes["flags"]}
        return dataclasses.replace(self, **changes)


OPTIONS = [f for f in dataclasses.fields(RunRequest) if f.name != "flags"]  # what the CLI generates
