"""The files in examples/ stay true to the code: the run config parses and names what exists."""

import re
from pathlib import Path

from nanogpt_cli.config import PRESETS, Choice, GPTConfig, TrainConfig, build_configs, field_types, load_toml

RUN_TOML = Path(__file__).resolve().parent.parent / "examples" / "run.toml"


def comments() -> dict[str, str]:
    """key -> the comment on its line."""
    found = {}
    for line in RUN_TOML.read_text().splitlines():
        m = re.match(r"^(\w+)\s*=\s*[^#]*#\s*(.*)$", line)
        if m:
            found[m.group(1)] = m.group(2)
    return found


def test_every_key_of_the_example_run_config_parses_into_the_configs():
    values = load_toml(RUN_TOML)
    preset = values.pop("preset")
    values.pop("out")
    model, train = build_configs({**PRESETS[preset], **values})
    for key, value in values.items():
        assert getattr(model if hasattr(model, key) else train, key) == value, key


def test_the_example_run_config_lists_every_preset():
    listed = comments()["preset"]
    assert all(re.search(rf"\b{re.escape(name)}\b", listed) for name in PRESETS), listed


def test_the_choices_a_comment_lists_are_the_fields_own():
    types = {**field_types(GPTConfig), **field_types(TrainConfig)}
    checked = 0
    for key, comment in comments().items():
        if key in types and issubclass(types[key][0], Choice) and "|" in comment:
            listed = [c.strip().split()[0] for c in comment.split("(")[0].split("|")]
            assert listed == [c.value for c in types[key][0]], (key, listed)
            checked += 1
    assert checked >= 4
