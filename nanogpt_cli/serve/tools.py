"""Tool calling: OpenAI's tools rendered into the prompt, the model's Hermes/Qwen `<tool_call>{...}</tool_call>`
text parsed back into tool_calls, and the grammar that forces a valid call.

    messages = template_messages(body.messages, template, tools)   # dicts for ChatTemplate.render
    calls = ToolCallText({"get_weather"}); content, new = calls.feed(piece); rest = calls.finish()

A template that reads `tools` (Hermes, Qwen, Llama 3) gets them as they are, and the calls of earlier assistant
turns as `tool_calls` with their arguments as objects (as transformers passes them). Any other template gets the
default rendering: the tools described in the first system message in Hermes' words (TOOLS_PROMPT), earlier calls
written into the assistant's text as `<tool_call>` blocks, and tool results as `tool` messages wrapped in
`<tool_response>`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.inference.grammar import COMPACT, bounded
from nanogpt_cli.serve.chat import ChatTemplate, message_text

OPEN, CLOSE = "<tool_call>", "</tool_call>"

# Hermes 2 Pro's and Qwen 2.5's own words, so a model fine-tuned on either sees what it was trained on
TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def tool_dicts(tools) -> list[dict[str, Any]]:
    """The request's tools as plain OpenAI dicts (what templates and the prompt show)."""
    return [t.model_dump(exclude_none=True, by_alias=True) for t in tools or []]


def template_messages(messages, template: ChatTemplate, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's messages as the template takes them (NanoGPTError for content it cannot show)."""
    native = template.takes_tools
    out = []
    for m in messages:
        content = message_text(m.content)
        entry: dict[str, Any] = {"role": m.role, "content": content}
        if m.tool_calls:
            calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)} for c in m.tool_calls]
            if native:
                entry["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": call} for c, call in zip(m.tool_calls, calls)
                ]
            else:
                blocks = [f"{OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{CLOSE}" for call in calls]
                entry["content"] = "\n".join(([content] if content else []) + blocks)
        if m.role == "tool":
            if native:
                entry["tool_call_id"] = m.tool_call_id
            else:
                entry["content"] = f"<tool_response>\n{content}\n</tool_response>"
        if m.name is not None:
            entry["name"] = m.name
        out.append(entry)
    if tools and not native:
        described = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + described}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise NanoGPTError(f"a tool call's arguments must be JSON text, got {text[:40]!r}") from None


def call_schema(tools: list[dict[str, Any]], name: str | None = None) -> dict[str, Any]:
    """The JSON schema of one call {"name", "arguments"} of any tool, or of the one named. Arguments are closed
    objects unless the schema says otherwise (OpenAI's strict function calling asks for additionalProperties
    false on every object), and their numbers bounded (grammar.bounded): a model cannot run out of tokens adding
    keys or digits the tool never asked for."""
    options = []
    for t in tools:
        f = t["function"]
        if name is not None and f["name"] != name:
            continue
        arguments = bounded(f.get("parameters") or {"type": "object", "properties": {}}, closed=True)
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": COMPACT}


def call_grammar(tools: list[dict[str, Any]], name: str | None = None) -> str:
    """A Lark grammar for exactly one `<tool_call>` block, as TOOLS_PROMPT asks for it."""
    return f'start: "{OPEN}\\n" call "\\n{CLOSE}"\ncall: %json {json.dumps(call_schema(tools, name))}'


def parse_call(text: str, names: set[str]) -> dict[str, Any] | None:
    """One `<tool_call>` block's JSON as an OpenAI tool call; None when it is not a call of a known tool."""
    try:
        call = json.loads(text)
    except (ValueError, RecursionError):  # json's C decoder recurses once per level of nesting
        return None
    if not isinstance(call, dict) or call.get("name") not in names:
        return None
    arguments = call.get("arguments", {})
    try:
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        text = json.dumps(arguments, ensure_ascii=False)
    except (ValueError, RecursionError):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call["name"], "arguments": text},
    }


class ToolCallText:
    """A reply's text as it arrives, split into content and tool calls: text that could begin `<tool_call>` is
    held back until it is clear, a block is held until its `</tool_call>`, and a block that is not a valid call
    of a known tool stays text."""

    def __init__(self, names: set[str]):
        self.names, self.buffer, self.inside = names, "", False
        self.calls: list[dict[str, Any]] = []

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """New safe content, and the calls completed by this text."""
        self.buffer += text
        content, calls = "", []
        while True:
            if self.inside:
                end = self.buffer.find(CLOSE)
                if end < 0:
                    break
                raw, self.buffer, self.inside = self.buffer[:end], self.buffer[end + len(CLOSE) :], False
                call = parse_call(raw.strip(), self.names)
                if call is None:
                    content += OPEN + raw + CLOSE
                else:
                    calls.append(call)
                continue
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = next(
                    (k for k in range(min(len(OPEN) - 1, len(self.buffer)), 0, -1) if self.buffer.endswith(OPEN[:k])), 0
                )
                content += self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep :]
                break
            content += self.buffer[:start]
            self.buffer, self.inside = self.buffer[start + len(OPEN) :], True
        self.calls += calls
        return content, calls

    def finish(self) -> str:
        """The text still held at the end (an unfinished block is text)."""
        out = (OPEN if self.inside else "") + self.buffer
        self.buffer, self.inside = "", False
        return out
