"""Chat messages for the server: OpenAI's message content as text. The templates themselves are
chat_template.py's, which `prepare --format chat` and `nanogpt chat` render through too.

    template = ChatTemplate.for_meta(loaded.meta, "<|endoftext|>")
    text = template.render([{"role": "user", "content": message_text(content)}])
"""

from __future__ import annotations

from typing import Any

from nanogpt_cli.data.chat_template import PLAIN_NAME as DEFAULT_NAME
from nanogpt_cli.data.chat_template import PLAIN_STOP as DEFAULT_STOP
from nanogpt_cli.data.chat_template import PLAIN_TEMPLATE as DEFAULT_TEMPLATE
from nanogpt_cli.data.chat_template import ChatTemplate
from nanogpt_cli.errors import NanoGPTError

__all__ = ["DEFAULT_NAME", "DEFAULT_STOP", "DEFAULT_TEMPLATE", "ChatTemplate", "message_text"]


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
