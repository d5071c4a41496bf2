"""Every command's --help, read as a user reads it: an option name means one thing across the commands that take it."""

import re

import pytest
from typer.testing import CliRunner

from nanogpt_cli.cli import app

runner = CliRunner()

# names whose meaning is the command's own, each with why: the thing a command writes, reads or prints differs
PER_COMMAND = {
    "--out": "what the command writes: a run folder, an export, a picture",
    "--json": "JSON instead of the command's own table or text",
    "--force": "replace what the command would write (a run, an export, a tokenizer)",
    "--format": "prepare's input format; export's output format",
    "--name": "the name of what the command makes (a dataset, a tokenizer)",
    "--prompt": "the text the command generates from or measures",
    "--max-tokens": "a cap on the tokens of the command's own job",
    "--max-new-tokens": "tokens per sample, or per reply",
    "--batch-size": "rows per training micro-batch, or windows per scoring pass",
    "--data": "the dataset a command trains on or scores",
    "--dtype": "training's autocast precision, or the cast of the weights: auto to generate, float32 to score",
    "--seed": "training's seed, sampling's seed, the probes' random sequences",
    "--split": "a hub dataset's split to read, or the prepared split to score",
    "--preset": "train's whole config, or finetune's training config",
    "--resume": "continue an interrupted prepare, or a run",
    "--vocab-size": "a model's vocabulary, or the size of the tokenizer to train",
    "--last": "which of a run's weights: the ones a command loads, or (train, finetune) those of --init-from",
    "--system": "chat's system prompt; info's description of this machine instead of a run",
}


def help_of(args: list[str]) -> str:
    result = runner.invoke(app, [*args, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    return result.output


def commands(args: tuple[str, ...] = ()) -> list[list[str]]:
    """Every command, subcommands included, as `nanogpt --help` lists them."""
    out = help_of(list(args))
    if "Commands:" not in out:
        return [list(args)]
    listed = [line.split()[0] for line in out.split("Commands:")[1].splitlines() if line.startswith("  ")]
    return [command for name in listed for command in commands((*args, name))]


def options(out: str) -> dict[str, str]:
    """--name -> its help text, defaults left out, wrapped lines joined."""
    found, current = {}, None
    for line in out.split("Options:")[1].splitlines():
        m = re.match(r"^  (-\S.*?)(?:\s{2,}(.*))?$", line)
        if m:
            current = re.findall(r"--[a-z0-9-]+", m.group(1))[0]
            found[current] = m.group(2) or ""
        elif current and line.strip():
            found[current] += " " + line.strip()
    return {name: re.sub(r"\s*\[(default|required).*?\]", "", text).strip() for name, text in found.items()}


def raw_help(out: str, name: str) -> str:
    """One option's help as printed, its [default: ...] or [required ...] mark included, wrapped lines joined."""
    text = out.split("Options:")[1]
    start = re.search(rf"^  (-\S+, )?{name}(?=[\s/]).*$", text, re.M).start()
    end = re.search(r"^  -", text[start + 3 :], re.M)
    return " ".join(text[start : start + 3 + end.start() if end else None].split())


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    """Every command's --help, by the command's words ("eval perplexity")."""
    return {" ".join(command): help_of(command) for command in commands()}


@pytest.fixture(scope="module")
def table(helps) -> dict[str, dict[str, list[str]]]:
    """option name -> help text -> the commands that show it."""
    seen: dict[str, dict[str, list[str]]] = {}
    for command, out in helps.items():
        for name, text in options(out).items():
            seen.setdefault(name, {}).setdefault(text, []).append(command)
    return seen


def test_every_command_and_family_renders_its_help():
    names = {" ".join(c) for c in commands()}
    assert {"train", "sample", "eval perplexity", "tokenizer train", "inspect heads", "serve", "export"} <= names


def test_an_option_name_shared_by_commands_has_one_help_text_unless_its_meaning_is_the_commands_own(table):
    split = {name: texts for name, texts in table.items() if len(texts) > 1 and name not in PER_COMMAND}
    assert not split, f"one option name, several meanings (declare it once in cli/common.py, or list why): {split}"


def test_last_on_the_commands_that_load_weights_describes_those_weights(table):
    texts = table["--last"]
    loading = {"sample", "chat", "serve", "export", "eval perplexity", "inspect attention", "inspect heads"}
    for text, where in texts.items():
        if loading & set(where):
            assert loading <= set(where) and "--init-from" not in text and "last weights" in text, (text, where)
    assert any("--init-from" in text and set(where) == {"train", "finetune"} for text, where in texts.items())


def test_every_command_that_draws_a_picture_takes_it_with_out(helps):
    for command in ("plot", "inspect attention", "inspect heads", "inspect positions"):
        names = options(helps[command])
        assert "--out" in names and "--plot" not in names, (command, sorted(names))


def test_defaults_are_shown_as_values_not_in_parentheses(helps):
    shown = {command: re.findall(r"\[default: \(.*?\)\]", out) for command, out in helps.items()}
    assert not {c: found for c, found in shown.items() if found}


def test_data_is_marked_required_where_training_needs_it(helps):
    for command in ("train", "finetune"):
        assert "[required unless --resume or --config gives it]" in raw_help(helps[command], "--data")


def test_a_dtype_defaulting_to_float32_says_so_in_its_help(helps):
    for command, out in helps.items():
        if "--dtype" not in out:
            continue
        raw = raw_help(out, "--dtype")
        if "[default: float32]" in raw:
            assert "float32" in options(out)["--dtype"], (command, raw)


@pytest.mark.parametrize("group", [[], ["tokenizer"], ["eval"], ["inspect"]])
def test_the_command_lists_show_whole_summaries_at_80_columns(group):
    out = runner.invoke(app, [*group, "--help"], terminal_width=80).output
    listed = [line for line in out.split("Commands:")[1].splitlines() if line.startswith("  ")]
    assert listed and all(len(line) <= 80 and line.endswith(".") and not line.endswith("...") for line in listed), out


def test_the_preset_list_in_train_help_is_every_preset():
    from nanogpt_cli.config import PRESETS

    text = options(help_of(["train"]))["--preset"]
    assert all(name in text for name in PRESETS), text


def source_help(out: str) -> str:
    """The help of what a command loads: its argument's (Arguments section), or its --checkpoint / --init-from."""
    if "Arguments" in out:
        text = out.split("Arguments")[1].split("Options")[0]
        return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())
    found = options(out)
    return found.get("--checkpoint") or found["--init-from"]


def test_every_command_that_loads_a_model_lists_every_source_the_loader_takes(helps):
    # the commands that load weights take --last (which of a run's weights); what interop/loading.py reads
    loading = [command for command, out in helps.items() if "--last" in options(out)]
    assert {"sample", "chat", "serve", "export", "eval perplexity", "eval tasks", "train", "finetune"} <= set(loading)
    kinds = ("run folder", "checkpoints/", "LoRA run", ".safetensors file", ".gguf file", "Hugging Face folder")
    for command in loading:
        text = source_help(helps[command])
        assert all(k.lower() in text.lower() for k in kinds) and "hf:NAME" in text, (command, text)


def test_train_and_finetune_take_every_run_request_field_as_its_declared_option(helps):
    """--out, --resume, --init-from, ... are generated from RunRequest: a field added there is an option of both,
    with the help declared beside it."""
    import dataclasses

    from nanogpt_cli.api import RunRequest

    fields = [f for f in dataclasses.fields(RunRequest) if f.name != "flags"]
    assert {f.name for f in fields} >= {"config", "out", "resume", "force", "init_from", "last"}
    for command in ("train", "finetune"):
        shown = options(helps[command])
        for f in fields:
            name = "--" + f.name.replace("_", "-")
            assert shown.get(name) == " ".join(f.metadata["help"].split()), (command, name)
