"""The README stays true: every nanogpt command line it shows (torchrun's too) uses flags that exist, its cheap
commands run as written in a fresh folder and print what it shows, and CI runs its test command."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from typer.testing import CliRunner

from nanogpt_cli.cli import app

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
COMMANDS = (
    "prepare",
    "train",
    "sample",
    "eval",
    "perplexity",
    "runs",
    "info",
    "plot",
    "export",
    "serve",
    "tokenizer",
    "encode",
    "inspect",
    "attention",
    "heads",
    "positions",
    "finetune",
    "chat",
)
LONG_RUNNING = ("serve",)  # a server: its flags are checked, it is not run
INTERACTIVE = ("chat",)  # reads the lines the README shows after its prompt, `>>> `, as its input


class Command(NamedTuple):
    kind: str  # "nanogpt", "torchrun" or "python" (a script in examples/)
    args: list[str]  # nanogpt's arguments (torchrun's and python's: the whole command line)
    setup: bool  # part of a `pip install ... && ...` chain: installs, and trains for minutes
    shown: list[str]  # the output the README shows under it


def commands() -> list[Command]:
    """Each `nanogpt ...` and `torchrun ... -m nanogpt_cli ...` invocation in the README's code blocks, in order."""
    out = []
    for language, block in re.findall(r"```(\w*)\n(.*?)```", README, flags=re.S):  # all, so fences pair up
        if language not in ("", "bash"):
            continue
        lines = block.splitlines()
        for i, line in enumerate(lines):
            if language == "" and not line.startswith("$ "):
                continue  # an output line: it may hold unbalanced quotes
            shown = []
            for later in lines[i + 1 :]:
                if later.startswith("$ "):
                    break
                shown.append(later)
            parts = [p.strip() for p in line.removeprefix("$ ").split("&&")]
            setup = parts[0].startswith("pip install")
            for part in parts:
                words = shlex.split(part)
                if words[:1] == ["nanogpt"]:
                    out.append(Command("nanogpt", words[1:], setup, shown if language == "" else []))
                elif words[:1] == ["torchrun"] and "nanogpt_cli" in words:
                    out.append(Command("torchrun", words, setup, shown if language == "" else []))
                elif words[:1] == ["python"] and words[1:2] and words[1].startswith("examples/"):
                    out.append(Command("python", words, setup, shown if language == "" else []))
    return out


def nanogpt_args(command: Command) -> list[str]:
    words = command.args
    return words[words.index("nanogpt_cli") + 1 :] if command.kind == "torchrun" else words


@pytest.mark.parametrize(
    "command", [c for c in commands() if c.kind != "python"], ids=lambda c: " ".join(nanogpt_args(c)[:2])
)
def test_readme_commands_use_real_flags(command):
    args = nanogpt_args(command)
    path = [a for a in args[:2] if not a.startswith("-") and a in COMMANDS]
    help_text = CliRunner().invoke(app, [*path, "--help"], terminal_width=200).output
    for flag in (a for a in args if a.startswith("--")):
        assert flag in help_text, f"README uses {flag} with nanogpt {' '.join(path)}, which has no such flag"


def test_the_readme_shows_every_command_and_ci_runs_its_test_command():
    shown = {tuple(nanogpt_args(c)[:2]) if c.args[0] == "eval" else (c.args[0],) for c in commands()}
    assert {
        ("prepare",),
        ("train",),
        ("sample",),
        ("eval", "perplexity"),
        ("export",),
        ("runs",),
        ("info",),
        ("plot",),
        ("torchrun",),
        ("finetune",),
        ("chat",),
    } <= shown
    test_command = 'pip install torch==2.13.0 -e ".[dev]" && pytest'
    assert test_command in README and 'pytest -m "not slow"' in README
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install torch==2.13.0 -e ".[dev]"' in ci and "\npytest" in ci
    assert "\nruff check .\n" in ci and "\nruff format --check .\n" in ci


def test_the_command_table_names_every_command():
    table = README.split("## Commands")[1].split("\n\n")[1]
    named = {w for cell in re.findall(r"^\| ([^|]+) \|", table, re.M) for w in re.findall(r"`(?:nanogpt )?(\w+)", cell)}
    listed = CliRunner().invoke(app, ["--help"], terminal_width=200).output.split("Commands:")[1].splitlines()
    commands = {line.split()[0] for line in listed if line.startswith("  ")}
    assert len(commands) > 10 and commands <= named, sorted(commands - named)


# the README examples whose commands need an extra, and the extra (the library's `require` calls name it too)
NEEDS_EXTRA = {("tokenizer", "train"): "hf", ("export",): "hf", ("serve",): "serve", ("plot",): "plot"}


def test_each_readme_example_that_needs_an_extra_says_which():
    for section in README.split("\n### ")[1:]:
        for line in re.findall(r"^(?:\$ )?nanogpt (.+)$", section, re.M):
            words = tuple(line.split())
            for start, extra in NEEDS_EXTRA.items():
                if words[: len(start)] == start:
                    assert f'pip install -e ".[{extra}]"' in section, (section.splitlines()[0], extra)


def test_the_extras_table_in_docs_cli_lists_every_extra():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8").split("## Optional extras")[1]
    rows = set(re.findall(r"^\| `([\w-]+)` \|", text, re.M))
    assert set(extras) <= rows, sorted(set(extras) - rows)


def written_by_readme() -> set[str]:
    """The files and folders the README's commands write where they run: every --out, every "wrote X" they show,
    and the folders of the datasets and tokenizers they make."""
    written = {"data/x"}  # prepare writes DATA_DIR/NAME
    for command in commands():
        args = nanogpt_args(command)
        written |= {args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--out", "-o")}
        written |= {m.group(1) for line in command.shown if (m := re.match(r"wrote (\S+)", line))}
        if args[:2] == ["tokenizer", "train"]:
            written.add(f"tokenizers/{args[args.index('--name') + 1]}")
    return written


def test_what_the_readme_writes_is_ignored_by_git_and_the_docs_pictures_are_not():
    import shutil

    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout (or no git), so .gitignore is not in use")
    written = written_by_readme()
    assert {"exports/shk", "loss.png", "shk.gguf", "count-train.jsonl"} <= written  # the parse found them
    check = ["git", "-C", str(ROOT), "check-ignore", "--no-index", "--verbose", "--non-matching", *sorted(written)]
    kept = [
        line.split("\t")[1]
        for line in subprocess.run(check, capture_output=True, text=True).stdout.splitlines()
        if line.startswith("::")
    ]
    assert not kept, f"the README's commands write these, and git would offer to commit them: {kept}"
    pictures = [str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.png")]
    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", *pictures], capture_output=True)
    assert pictures and not ignored.stdout, ignored.stdout


def tiny(args: list[str]) -> list[str]:
    """A train command with the tiny preset in place of its own: the README's flags, a model that trains in
    seconds."""
    if "--preset" in args:
        i = args.index("--preset")
        return [*args[:i], "--preset", "tiny", *args[i + 2 :]]
    return [*args, "--preset", "tiny"]


def box_rows(lines: list[str]) -> dict[str, str]:
    """The rows of the first box table in lines (label -> value; a value wrapped over lines joined)."""
    rows, label = {}, None
    for line in lines:
        if line.startswith("└"):
            break
        if line.startswith("│"):
            first, value = (cell.strip() for cell in line.strip("│").split("│"))
            label = first or label
            rows[label] = f"{rows[label]} {value}" if not first else value
    return rows


def digits(line: str) -> str:
    return re.sub(r"[\d,.]+", "#", line.rstrip())


@pytest.mark.slow
def test_the_readme_examples_run_as_written_and_print_what_it_shows(tmp_path):
    """The examples run one after another in a fresh folder: every nanogpt command as written (train with the
    tiny preset), torchrun's on the CPU. The set-up chain is left out (it installs, then trains for minutes).
    Each command must succeed and print the first line the README shows (numbers aside)."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1"
    )
    runner = CliRunner()
    ran = []
    cwd, threads = os.getcwd(), torch.get_num_threads()
    os.chdir(tmp_path)
    torch.set_num_threads(1)  # tiny models: more threads only wait on each other, badly so on a busy machine
    try:
        for command in (c for c in commands() if not c.setup and c.args[0] not in LONG_RUNNING):
            if command.kind == "torchrun":
                if "--device" not in command.args or "cpu" not in command.args:
                    continue  # GPUs only: its flags are checked above
                args = command.args[command.args.index("torchrun") + 1 :]
                proc = subprocess.run(
                    [sys.executable, "-m", "torch.distributed.run", *args],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                assert proc.returncode == 0, proc.stderr[-3000:]
                output = proc.stdout
            elif "--nproc" in command.args:  # the launcher starts processes that print to the real stdout
                proc = subprocess.run(
                    [sys.executable, "-m", "nanogpt_cli", *tiny(command.args)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,  # as a terminal shows them: the note among the lines
                    text=True,
                    timeout=300,
                )
                assert proc.returncode == 0, proc.stdout[-3000:]
                output = proc.stdout
            elif command.kind == "python":
                proc = subprocess.run(
                    [sys.executable, *command.args[1:]], env=env, capture_output=True, text=True, timeout=300
                )
                assert proc.returncode == 0, proc.stderr[-3000:]
                output = proc.stdout
            else:
                args = tiny(command.args) if command.args[0] == "train" else command.args
                typed = [line.removeprefix(">>> ") for line in command.shown if line.startswith(">>> ")]
                stdin = "".join(line + "\n" for line in typed) if command.args[0] in INTERACTIVE else None
                result = runner.invoke(app, args, terminal_width=100, input=stdin)
                assert result.exit_code == 0, f"nanogpt {shlex.join(args)}:\n{result.output}"
                output = result.stdout
                if command.args[0] in INTERACTIVE:  # the replies of a tiny model are not the README's
                    ran.append(command.args[0])
                    continue
            if command.args[0] == "info":  # the rows it shows, and the model in words (numbers aside)
                shown, printed = box_rows(command.shown), box_rows(output.splitlines())
                assert list(shown) == list(printed) and digits(shown["model"]) == digits(printed["model"]), output
            first_shown = next((line for line in command.shown if line.strip()), None)
            if first_shown is not None and "..." not in first_shown:
                first = next((line for line in output.splitlines() if line.strip()), "")
                assert digits(first).startswith(digits(first_shown)), f"{shlex.join(command.args)} printed:\n{output}"
            ran.append(command.args[0])
    finally:
        os.chdir(cwd)
        torch.set_num_threads(threads)
    assert {"prepare", "train", "sample", "eval", "export", "runs", "info", "plot", "torchrun"} <= set(ran)
    assert {"python", "finetune", "chat"} <= set(ran)  # the fine-tuning example, end to end
