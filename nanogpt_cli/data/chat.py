"""Chat datasets: rows of conversations -> token ids plus a loss mask (1 where the model is trained).

A conversation is rendered with a Jinja chat template. The parts of the template inside
`{% generation %} ... {% endgeneration %}` are what the assistant says: those tokens get mask 1, the rest 0.
This is the same convention transformers' `apply_chat_template(..., return_assistant_tokens_mask=True)`
uses, so the template stored with a dataset renders the same ids and mask there. The rendering itself is
chat_template.py's, which serve and chat use too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import NanoGPTError
from .chat_template import DEFAULT_TEMPLATE, EOT, ChatTemplate, specials, turn_end

ROLES = ("system", "user", "assistant")
__all__ = ["turn_end"]  # exports read it from here


class BadRow(NanoGPTError):
    """A row that is not a usable conversation; the message says why."""


def conversation(row: Any) -> list[dict[str, str]]:
    """Normalize one row ({"messages": [...]}, {"prompt", "completion"} or Alpaca) to a list of messages."""
    if not isinstance(row, dict):
        raise BadRow("the row is not a JSON object")
    if "messages" in row:
        messages = row["messages"]
    elif "prompt" in row and "completion" in row:
        messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]
    elif "instruction" in row and "output" in row:
        extra = row.get("input") or ""
        if not isinstance(extra, str):
            raise BadRow("'input' is not a string")
        prompt = row["instruction"] + ("\n\n" + extra if extra and isinstance(row["instruction"], str) else "")
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]
    else:
        raise BadRow("the row has none of 'messages', 'prompt'/'completion', 'instruction'/'output'")
    if not isinstance(messages, list) or not messages:
        raise BadRow("the conversation is empty")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else m
            raise BadRow(f"unknown role {role!r} (expected one of {', '.join(ROLES)})")
        if not isinstance(m.get("content"), str):
            raise BadRow(f"the content of a {m['role']} message is not a string")
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRow("the conversation has no assistant turn")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def checkpoint_template(dataset: dict[str, Any]) -> str | None:
    """The chat template a run on this dataset records, made to render alone: prepare gives the template the
    end-of-text text as eos_token, which char and byte tokenizers have no token for, so there it is set inside."""
    template = dataset.get("chat_template")
    if not isinstance(template, str):
        return None
    if dataset.get("eot_id") is None and (dataset.get("tokenizer") or {}).get("kind") != "hf":
        return f"{{% set eos_token = {EOT!r} %}}" + template
    return template


def strip_generation_tags(template: str) -> str:
    """The template without its `{% generation %}` / `{% endgeneration %}` tags (the same text rendered), for
    engines that do not know them (llama.cpp)."""
    import re

    return re.sub(r"{%-?\s*(end)?generation\s*-?%}", "", template)


@dataclass
class ChatRows:
    """What reading a chat file gave: the conversations and the bad rows (line number, reason)."""

    conversations: list[list[dict[str, str]]]
    bad: list[tuple[int, str]]


def read_json_lines(lines, normalise, strict: bool = False) -> tuple[list[tuple[Any, int]], list[tuple[int, str]]]:
    """(normalise(row), line number) for each usable JSON line, and the bad ones (line number, reason): a row
    normalise refuses with BadRow is counted, or with strict raises naming its line. Blank lines are skipped."""
    good, bad = [], []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise BadRow(f"not valid JSON ({e.msg})") from None
            good.append((normalise(row), n))
        except BadRow as e:
            if strict:
                raise NanoGPTError(f"line {n}: {e}") from None
            bad.append((n, str(e)))
    return good, bad


def read_chat_lines(lines, strict: bool = False) -> ChatRows:
    """Parse JSON lines into conversations; a bad row is counted (or, with strict, raises naming its line)."""
    good, bad = read_json_lines(lines, conversation, strict)
    return ChatRows([c for c, _ in good], bad)


@dataclass
class ChatPrepareResult:
    path: Any
    conversations: int
    bad: list[tuple[int, str]]
    train_tokens: int
    val_tokens: int
    trained_tokens: int  # mask 1, both splits


def prepare_chat(
    source: str,
    name: str,
    *,
    tokenizer: str = "gpt2",
    data_dir: str = "data",
    chat_template: str | None = None,
    val_fraction: float = 0.1,
    strict: bool = False,
    shard_tokens: int = 100_000_000,
) -> ChatPrepareResult:
    """Render a .jsonl of conversations into DATA_DIR/NAME: token shards, a mask shard beside each
    (SPLIT-00000.mask.bin, uint8) and meta.json listing both plus the template text. The last conversations
    (val_fraction of them, at least one) validate. Replaces an earlier NAME only on success."""
    import shutil
    import tempfile
    from datetime import datetime, timezone
    from pathlib import Path

    from .. import __version__
    from ..tokenizer import build_tokenizer
    from .shards import token_dtype

    rows = _read_conversations(source, strict)
    char = tokenizer == "char"
    given = Path(chat_template).read_text(encoding="utf-8") if chat_template else None
    texts = [ChatTemplate(given or DEFAULT_TEMPLATE).render(m, False) for m in rows.conversations] if char else None
    tok = build_tokenizer(tokenizer, texts=texts)
    # a Hugging Face tokenizer brings its model's template, and the token strings that template writes
    template = ChatTemplate(given or getattr(tok, "chat_template", None) or DEFAULT_TEMPLATE)
    template.special = specials(tok) or template.special
    dtype = token_dtype(tok.vocab_size)
    n_val = max(1, int(round(len(rows.conversations) * val_fraction)))
    final = Path(data_dir) / name
    if final.exists() and not (final / "meta.json").is_file():
        raise NanoGPTError(f"{final} exists and is not a prepared dataset; pick another --name or --data-dir")
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=data_dir))
    shards, trained, lengths = {}, 0, {}
    try:
        tok.save_files(stage)  # a Hugging Face tokenizer.json goes beside meta.json
        for split, convs in (("train", rows.conversations[:-n_val]), ("val", rows.conversations[-n_val:])):
            shards[split], n, lengths[split] = _write_split(stage, split, convs, template, tok, dtype, shard_tokens)
            trained += n
        meta = {
            "version": __version__,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "source": source,
            "format": "chat",
            "tokenizer": tok.describe(),
            "vocab_size": tok.vocab_size,
            "eot_id": tok.eot_id,
            "dtype": dtype,
            "documents": len(rows.conversations),
            "val_documents": n_val,
            "bad_rows": len(rows.bad),
            "train_tokens": sum(s["tokens"] for s in shards["train"]),
            "val_tokens": sum(s["tokens"] for s in shards["val"]),
            "trained_tokens": trained,
            "shard_tokens": shard_tokens,
            "shards": shards,
            "masks": True,
            # each conversation's length in tokens, in order: training packs whole conversations into windows
            "conversations": lengths,
            "chat_template": template.source,
        }
        (stage / "meta.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
        if final.exists():
            shutil.rmtree(final)
        stage.rename(final)
    finally:
        if stage.exists():
            shutil.rmtree(stage, ignore_errors=True)
    return ChatPrepareResult(
        final, len(rows.conversations), rows.bad, meta["train_tokens"], meta["val_tokens"], trained
    )


def _read_conversations(source: str, strict: bool) -> ChatRows:
    """The file's conversations (and its bad rows), at least two: one to train on, one to validate."""
    from pathlib import Path

    if not Path(source).is_file():
        raise NanoGPTError(f"no chat file {source}; give a .jsonl file of conversations")
    with open(source, encoding="utf-8") as f:
        rows = read_chat_lines(f, strict=strict)
    if len(rows.conversations) < 2:
        raise NanoGPTError(
            f"{source} has {len(rows.conversations)} usable conversations; at least 2 are needed "
            "(one to train on, one to validate)"
        )
    return rows


def _write_split(stage, split: str, convs, template, tok, dtype: str, shard_tokens: int) -> tuple[list, int, dict]:
    """One split's token shards and mask shards (listed together), how many tokens the mask trains on, and the
    file of its conversations' lengths (SPLIT.conversations.bin, uint32, listed in meta.json)."""
    from .shards import ShardWriter

    ids_w = ShardWriter(stage, split, dtype, shard_tokens, [], 0)
    mask_w = _MaskWriter(stage, split, "uint8", shard_tokens, [], 0)
    trained, lengths = 0, []
    for messages in convs:
        ids, mask = template.tokens_and_mask(messages, tok)
        ids_w.write(ids.astype(dtype))
        mask_w.write(mask)
        trained += int(mask.sum())
        lengths.append(len(ids))
    ids_w.finish()
    mask_w.finish()
    shards = [dict(s, mask=m["file"], mask_sha256=m["sha256"]) for s, m in zip(ids_w.shards, mask_w.shards)]
    name = f"{split}.conversations.bin"
    np.asarray(lengths, dtype=np.uint32).tofile(stage / name)
    return shards, trained, {"file": name, "count": len(lengths)}


class _MaskWriter:
    """Lazily built: a ShardWriter whose files are SPLIT-00000.mask.bin."""

    def __new__(cls, *args):
        from .shards import ShardWriter

        class MaskWriter(ShardWriter):
            def _name(self, i: int) -> str:
                return f"{self.split}-{i:05d}.mask.bin"

        return MaskWriter(*args)
