"""Chat messages -> prompt text, through a Jinja chat template rendered the way Hugging Face transformers'
`apply_chat_template` renders it (a sandboxed environment with trim_blocks and lstrip_blocks, loop controls,
`raise_exception`, a `tojson` that keeps non-ASCII), so the same messages give the same token ids in both.

    template = ChatTemplate.for_meta(loaded.meta)
    text = template.render([{"role": "user", "content": "Hello"}])   # 'User: Hello\\n\\nAssistant:'

A checkpoint whose metadata carries a `chat_template` string (or a Hugging Face folder whose
tokenizer_config.json does) is formatted with it; a base model gets
DEFAULT_TEMPLATE, a plain transcript, plus stop texts that end the reply where the model starts a next turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from nanogpt_cli.errors import NanoGPTError

# "System: ...\n\nUser: ...\n\nAssistant:" -- a transcript any base model has seen the like of
DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] | trim }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
DEFAULT_NAME = "nanogpt-plain"
# where a base model, left to itself, would write the next turn of the transcript
DEFAULT_STOP = ["\nUser:", "\nAssistant:", "\nSystem:"]
ROLES = ("system", "user", "assistant", "developer", "tool")


@lru_cache(maxsize=8)
def _compile(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (the assistant's part, for training masks) renders its body,
        as in transformers: templates that fine-tuning stored in a checkpoint use it."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, Generation]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


@dataclass
class ChatTemplate:
    source: str
    name: str  # what /v1/models reports: DEFAULT_NAME or "checkpoint"
    stop: list[str] = field(default_factory=list)  # stop texts every chat request gets
    special: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token for the template

    @classmethod
    def for_meta(cls, meta: dict[str, Any], eos_token: str | None = None, folder: Path | None = None) -> ChatTemplate:
        """The checkpoint's own template when its metadata has one (or, for a Hugging Face folder, its
        tokenizer_config.json), else the plain default."""
        special = {"bos_token": eos_token or "", "eos_token": eos_token or ""}
        source = meta.get("chat_template")
        config = folder / "tokenizer_config.json" if folder is not None else None
        if not isinstance(source, str) and config is not None and config.is_file():
            try:
                source = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
            except (OSError, ValueError):
                source = None
        if isinstance(source, str) and source.strip():
            return cls(source, "checkpoint", _reply_end(source), special)
        return cls(DEFAULT_TEMPLATE, DEFAULT_NAME, list(DEFAULT_STOP), special)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        import jinja2

        try:
            return _compile(self.source).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special
            )
        except jinja2.exceptions.TemplateError as e:
            raise NanoGPTError(f"the chat template failed on these messages: {e}") from None


def _reply_end(source: str) -> list[str]:
    """A stop text where the template ends an assistant turn, from its `{% generation %}` block (fine-tuned runs
    record such templates): char and byte models write the end-of-text marker as text, which only a stop text
    ends. None for a template without the block."""
    from nanogpt_cli.data.chat import turn_end

    try:
        end = turn_end(source).strip()
    except Exception:  # a template that cannot render a plain user/assistant exchange: no stop text from it
        return []
    return [end] if end else []


def message_text(content: Any) -> str:
    """A message's content as text: a string, or OpenAI's list of parts of which only text parts are taken."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise NanoGPTError("only text content parts are supported ({'type': 'text', 'text': ...})")
        parts.append(part["text"])
    return "".join(parts)
