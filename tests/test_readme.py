"""The README stays true: every nanogpt command line it shows (torchrun's too) uses flags that exist, and CI runs
its test command."""

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nanogpt_cli.cli import app

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def command_lines() -> list[list[str]]:
    """Each `nanogpt ...` invocation in the README's code blocks, as argument lists without `nanogpt`."""
    blocks = re.findall(r"```(\w*)\n(.*?)```", README, flags=re.S)  # every block, so openings and closings pair up
    out = []
    for language, block in blocks:
        if language not in ("", "bash"):
            continue
        for line in block.splitlines():
            line = line.removeprefix("$ ")
            for part in line.split("&&"):
                if not part.strip().startswith("nanogpt "):  # output lines may hold unbalanced quotes
                    continue
                words = shlex.split(part.strip())
                if words[:1] == ["nanogpt"]:
                    out.append(words[1:])
                elif words[:1] == ["torchrun"] and "nanogpt_cli" in words:  # torchrun ... -m nanogpt_cli ARGS
                    out.append(words[words.index("nanogpt_cli") + 1:])
    return out


@pytest.mark.parametrize("args", command_lines(), ids=lambda a: " ".join(a[:2]))
def test_readme_commands_use_real_flags(args):
    path = [a for a in args[:2] if not a.startswith("-") and a in ("prepare", "train", "sample", "eval",
                                                                        "perplexity", "runs", "info", "plot", "export")]
    help_text = CliRunner().invoke(app, [*path, "--help"], terminal_width=200).output
    for flag in (a for a in args if a.startswith("--")):
        assert flag in help_text, f"README uses {flag} with nanogpt {' '.join(path)}, which has no such flag"


def test_the_readme_shows_every_command_and_ci_runs_its_test_command():
    shown = {tuple(a[:2]) if a[0] == "eval" else (a[0],) for a in command_lines()}
    assert {("prepare",), ("train",), ("sample",), ("eval", "perplexity")} <= shown
    test_command = 'pip install torch==2.13.0 -e ".[dev]" && pytest'
    assert test_command in README
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install torch==2.13.0 -e ".[dev]"' in ci and "\npytest" in ci
