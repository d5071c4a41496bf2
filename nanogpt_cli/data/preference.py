"""Preference and prompt datasets: the rows DPO and GRPO train on, tokenised once by `prepare`.

    prepare_rows("pairs.jsonl", "pairs", kind="preference", tokenizer="byte")   # DPO: prompt, chosen, rejected
    prepare_rows("count.jsonl", "count-prompts", kind="prompts", tokenizer="byte")  # GRPO: prompts and answers

A preference row takes TRL's shapes: {"prompt", "chosen", "rejected"} as strings (the texts are joined as they
are, prompt then completion), or as message lists rendered with the chat template ("prompt" the conversation so
far, "chosen"/"rejected" the assistant's turn(s)); without "prompt", two message lists share theirs (TRL's
implicit prompt). Each completion gets a loss mask: 1 on its own tokens only, never on the prompt's.

A prompt row is {"prompt": str or messages, ...} or a chat row {"messages": [...]} whose last assistant turn
is taken as the row's "answer"; every other field is kept for the reward function.

DATA_DIR/NAME holds meta.json (format "preference" or "prompts", tokenizer, template) and SPLIT.rows.jsonl, one
tokenised row per line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import NanoGPTError
from .chat import BadRow, conversation, read_json_lines
from .chat_template import DEFAULT_TEMPLATE, EOT, ChatTemplate

KINDS = ("preference", "prompts")
ROWS_FILE = "{split}.rows.jsonl"


def _messages(value: Any, what: str) -> list[dict[str, str]]:
    """A message list checked as chat rows are."""
    if not isinstance(value, list) or not value:
        raise BadRow(f"'{what}' is neither a string nor a non-empty list of messages")
    for m in value:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise BadRow(f"'{what}' holds a message with an unknown role")
        if not isinstance(m.get("content"), str):
            raise BadRow(f"'{what}' holds a message whose content is not a string")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def preference_pair(row: Any) -> dict[str, Any]:
    """One TRL preference row normalised: {"prompt", "chosen", "rejected"}, all strings or all message lists
    (the implicit prompt split off)."""
    if not isinstance(row, dict) or "chosen" not in row or "rejected" not in row:
        raise BadRow("the row needs 'chosen' and 'rejected' (and usually 'prompt')")
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
    if isinstance(chosen, str) and isinstance(rejected, str):
        if prompt is not None and not isinstance(prompt, str):
            raise BadRow("'prompt' is not a string while 'chosen' and 'rejected' are")
        return {"prompt": prompt or "", "chosen": chosen, "rejected": rejected}
    chosen, rejected = _messages(chosen, "chosen"), _messages(rejected, "rejected")
    if prompt is None:  # implicit prompt: the messages both share
        n = 0
        while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
            n += 1
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    elif isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    else:
        prompt = _messages(prompt, "prompt")
    if not prompt:
        raise BadRow("the conversation has no prompt before the completions")
    for name, turns in (("chosen", chosen), ("rejected", rejected)):
        if not any(m["role"] == "assistant" for m in turns):
            raise BadRow(f"'{name}' has no assistant message")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def prompt_row(row: Any) -> dict[str, Any]:
    """One GRPO row normalised: {"prompt": str or messages, ...the other fields}; a chat row's last assistant
    turn becomes its "answer"."""
    if not isinstance(row, dict):
        raise BadRow("the row is not a JSON object")
    if "prompt" in row:
        prompt = row["prompt"] if isinstance(row["prompt"], str) else _messages(row["prompt"], "prompt")
        return {**row, "prompt": prompt}
    if "messages" in row:
        messages = conversation(row)
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        if last == 0:
            raise BadRow("the conversation has no prompt before its assistant turn")
        rest = {k: v for k, v in row.items() if k != "messages"}
        return {"answer": messages[last]["content"], **rest, "prompt": messages[:last]}
    raise BadRow("the row has neither 'prompt' nor 'messages'")


def encode_pair(pair: dict[str, Any], template: ChatTemplate, tok) -> dict[str, list[int]]:
    """Token ids of prompt + chosen and prompt + rejected, with each completion's mask (1 on its own tokens)."""
    out: dict[str, list[int]] = {}
    if isinstance(pair["chosen"], str):
        prompt_ids = tok.encode(pair["prompt"]) if pair["prompt"] else []
        for name in ("chosen", "rejected"):
            done = tok.encode(pair[name]) + ([tok.eot_id] if tok.eot_id is not None else [])
            out[name], out[f"{name}_mask"] = prompt_ids + done, [0] * len(prompt_ids) + [1] * len(done)
        return out
    n_prompt = len(template.tokens_and_mask(pair["prompt"], tok)[0])
    for name in ("chosen", "rejected"):
        ids, mask = template.tokens_and_mask(pair["prompt"] + pair[name], tok)
        mask[:n_prompt] = 0  # the prompt's own assistant turns are context, not this completion
        if not mask.any():
            raise BadRow(f"the chat template puts none of '{name}' inside a generation block")
        out[name], out[f"{name}_mask"] = ids.tolist(), mask.tolist()
    return out


def encode_prompt(row: dict[str, Any], template: ChatTemplate, tok) -> list[int]:
    """A GRPO prompt's ids: a string as it is, messages rendered up to the assistant's turn."""
    if isinstance(row["prompt"], str):
        return tok.encode(row["prompt"])
    return list(template.tokens(row["prompt"], tok, add_generation_prompt=True))


@dataclass
class RowsPrepareResult:
    path: Path
    rows: int  # usable rows, both splits
    bad: list[tuple[int, str]]  # (line number, reason)
    train_rows: int
    val_rows: int


def read_rows(lines, kind: str, strict: bool = False) -> tuple[list[tuple[dict, Any]], list[tuple[int, str]]]:
    """(normalised row, line number) for each usable line, and the bad ones (line number, reason)."""
    return read_json_lines(lines, preference_pair if kind == "preference" else prompt_row, strict)


def prepare_rows(
    source: str,
    name: str,
    *,
    kind: str,
    tokenizer: str = "gpt2",
    data_dir: str = "data",
    chat_template: str | None = None,
    val_fraction: float = 0.1,
    strict: bool = False,
) -> RowsPrepareResult:
    """Tokenise a .jsonl of preference pairs or prompts into DATA_DIR/NAME (see the module's docstring); the last
    val_fraction of the rows (at least one) validate."""
    import shutil

    from .. import __version__
    from ..tokenizer import build_tokenizer

    if kind not in KINDS:
        raise NanoGPTError(f"unknown --format {kind!r}; use text, chat, preference or prompts")
    if not Path(source).is_file():
        raise NanoGPTError(f"no {kind} file {source}; give a .jsonl file of rows")
    template = ChatTemplate(Path(chat_template).read_text(encoding="utf-8") if chat_template else DEFAULT_TEMPLATE)
    with open(source, encoding="utf-8") as f:
        rows, bad = read_rows(f, kind, strict)
    texts = [json.dumps(r) for r, _ in rows] + [template.render([{"role": "user", "content": ""}])]
    tok = build_tokenizer(tokenizer, texts=texts if tokenizer == "char" else None)
    encoded = []
    for row, line in rows:
        try:
            tokens = (
                encode_pair(row, template, tok) if kind == "preference" else {"ids": encode_prompt(row, template, tok)}
            )
        except BadRow as e:
            if strict:
                raise NanoGPTError(f"line {line}: {e}") from None
            bad.append((line, str(e)))
            continue
        encoded.append({**tokens, "row": row} if kind == "prompts" else tokens)
    if len(encoded) < 2:
        raise NanoGPTError(f"{source} has {len(encoded)} usable rows; at least 2 are needed (train and val)")
    n_val = max(1, int(round(len(encoded) * val_fraction)))
    final = Path(data_dir) / name
    if final.exists() and not (final / "meta.json").is_file():
        raise NanoGPTError(f"{final} exists and is not a prepared dataset; pick another --name or --data-dir")
    stage = Path(data_dir) / f".{name}.staging"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    splits = {"train": encoded[:-n_val], "val": encoded[-n_val:]}
    for split, items in splits.items():
        with open(stage / ROWS_FILE.format(split=split), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(item) + "\n" for item in items)
    meta = {
        "version": __version__,
        "source": source,
        "format": kind,
        "tokenizer": tok.describe(),
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "rows": {split: len(items) for split, items in splits.items()},
        "bad_rows": len(bad),
        "chat_template": template.source,
        # the texts that end a reply (a rollout stops at the first): the template's turn end, or the marker
        "stop": ChatTemplate.for_meta({"chat_template": template.source}, EOT if tok.eot_id is not None else None).stop,
    }
    (stage / "meta.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
    if final.exists():
        shutil.rmtree(final)
    stage.rename(final)
    return RowsPrepareResult(final, len(encoded), sorted(bad), len(splits["train"]), len(splits["val"]))


def read_split(data_dir: str | Path, name: str, split: str) -> list[dict[str, Any]]:
    """A prepared preference or prompts split's rows, as prepare_rows wrote them."""
    path = Path(data_dir) / name / ROWS_FILE.format(split=split)
    if not path.is_file():
        raise NanoGPTError(f"{path.parent} holds no {split} rows; prepare it with --format preference or prompts")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
