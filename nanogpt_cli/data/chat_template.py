"""Chat templates: messages -> text -> token ids (and the loss mask), rendered the way Hugging Face transformers'
`apply_chat_template` renders them, so the same messages give the same ids in both. `prepare --format chat`,
`serve` and `chat` all render through this module.

    template = ChatTemplate.for_model(loaded.meta, loaded.tokenizer, source)
    text = template.render([{"role": "user", "content": "Hello"}])   # 'User: Hello\\n\\nAssistant:'
    ids = template.tokens(messages, tokenizer)                       # end-of-text markers -> the end-of-text id
    ids, mask = template.tokens_and_mask(messages, tokenizer)         # mask 1 inside {% generation %} blocks

The environment is transformers': a sandbox with trim_blocks and lstrip_blocks, loop controls,
`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII, and the `{% generation %}` tag that marks
what the assistant says (transformers' `return_assistant_tokens_mask`).

Two built-in templates: DEFAULT_TEMPLATE is the one chat datasets are prepared with (role lines ended by the
end-of-text token, no new vocabulary entries); PLAIN_TEMPLATE is the transcript a base model that was never
fine-tuned gets, with stop texts where it would start writing the next turn itself.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.tokenizer import Tokenizer

EOT = "<|endoftext|>"  # the end-of-text marker; tokenizers without that token spell it out as text

# Role lines ended by the end-of-text token. The token that ends an assistant turn is inside the generation
# block, so a model trained on it learns to stop.
DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] + ':' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ ' ' + message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}"
    "{{ ' ' + message['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)

# "System: ...\n\nUser: ...\n\nAssistant:" -- a transcript any base model has seen the like of
PLAIN_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] | trim }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
PLAIN_NAME = "nanogpt-plain"
# where a base model, left to itself, would write the next turn of the transcript
PLAIN_STOP = ["\nUser:", "\nAssistant:", "\nSystem:"]

_START, _END = "\x00<gen>\x00", "\x00</gen>\x00"  # what a generation block is wrapped in; no template writes them


@lru_cache(maxsize=8)
def compile_template(source: str):
    """The compiled Jinja template (cached by its text); one sentence when it does not compile."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: its body, wrapped in markers that `_spans` splits on."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            return _START + caller() + _END

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise NanoGPTError(f"the chat template does not compile: {e}") from None


@dataclass
class ChatTemplate:
    source: str = DEFAULT_TEMPLATE
    name: str = "checkpoint"  # what serve's /v1/models reports: PLAIN_NAME or "checkpoint"
    stop: list[str] = field(default_factory=list)  # stop texts every reply gets
    special: dict[str, str] = field(default_factory=lambda: {"bos_token": EOT, "eos_token": EOT})

    def __post_init__(self):
        compile_template(self.source)  # a template that does not compile is refused when it is given

    @classmethod
    def for_meta(
        cls,
        meta: dict[str, Any],
        eos_token: str | None = None,
        folder: Path | None = None,
        special: dict[str, str] | None = None,
    ) -> ChatTemplate:
        """The checkpoint's own template when its metadata has one (or, for a Hugging Face folder, its
        chat_template.jinja or tokenizer_config.json), else the plain one. eos_token is the tokenizer's end-of-text
        marker, None when it has none: then the marker is written out as text, as `prepare --format chat` wrote
        it, and ends a reply when the model writes it. special: the token strings the template sees instead (a
        Hugging Face tokenizer's own bos_token, eos_token, ...)."""
        spelled = [] if eos_token or special else [EOT]  # written as text: only a stop text ends a reply there
        special = special or {"bos_token": eos_token or EOT, "eos_token": eos_token or EOT}
        source = meta.get("chat_template")
        if not isinstance(source, str) and folder is not None:
            source = _folder_template(folder)
        if isinstance(source, str) and source.strip():
            template = cls(source, "checkpoint", [], special)
            try:  # the text the template ends an assistant turn with, when it marks one: it ends a reply too
                end = turn_end(source, special).strip()
            except NanoGPTError:  # a template that cannot render a plain user/assistant exchange
                end = ""
            template.stop = ([end] if end else []) + [s for s in spelled if s != end]
            return template
        return cls(PLAIN_TEMPLATE, PLAIN_NAME, PLAIN_STOP + spelled, special)

    @classmethod
    def for_model(cls, meta: dict[str, Any], tokenizer: Tokenizer, source: str | Path) -> ChatTemplate:
        """for_meta for a model loaded from `source` (a run, a file, a Hugging Face folder or hf:NAME)."""
        folder = Path(source) if not str(source).startswith("hf:") and Path(source).is_dir() else None
        return cls.for_meta(meta, EOT if tokenizer.eot_id is not None else None, folder, specials(tokenizer) or None)

    @property
    def plain(self) -> bool:
        """Whether this is the plain transcript of a model without a template of its own."""
        return self.name == PLAIN_NAME

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list | None = None
    ) -> str:
        """The messages as text; tools (OpenAI's tool objects) go to a template that reads `tools`."""
        return "".join(text for text, _ in self._spans(messages, add_generation_prompt, tools))

    @property
    def takes_tools(self) -> bool:
        """Whether the template renders the `tools` it is given (as Hermes, Qwen and Llama 3 templates do)."""
        import re

        return re.search(r"\btools\b", self.source) is not None

    def tokens(self, messages: list[dict[str, Any]], tokenizer: Tokenizer, add_generation_prompt: bool = True):
        """The rendered messages as token ids: what a model is given to continue."""
        return encode(self.render(messages, add_generation_prompt), tokenizer)

    def tokens_and_mask(self, messages: list[dict[str, Any]], tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of a whole conversation and its loss mask (uint8: 1 inside generation blocks). Each part is
        encoded on its own, so no token straddles the mask's edge."""
        ids: list[int] = []
        mask: list[int] = []
        has_blocks = re.search(r"{%-?\s*generation\s*-?%}", self.source) is not None
        for text, trained in self._spans(messages, False) if has_blocks else self._reply_spans(messages):
            new = encode(text, tokenizer)
            ids += new
            mask += [int(trained)] * len(new)
        return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8)

    def _reply_spans(self, messages: list[dict[str, Any]]) -> list[tuple[str, bool]]:
        """The parts of a conversation rendered by a template without generation blocks (most models' own): an
        assistant turn is what rendering up to it adds after rendering up to the turn before it with the
        generation prompt, as each such rendering must start the whole one."""
        whole = self.render(messages, False)
        parts, done = [], 0
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before, turn = self.render(messages[:i], True), self.render(messages[: i + 1], False)
            start, end = len(before), len(turn)
            if not (whole.startswith(turn) and turn.startswith(before)) or start < done:
                raise NanoGPTError(
                    "this chat template renders a conversation's first turns differently from the whole, so the "
                    "assistant's tokens cannot be told apart; give it {% generation %} blocks, or pass another "
                    "--chat-template"
                )
            parts += [(whole[done:start], False), (whole[start:end], True)]
            done = end
        parts.append((whole[done:], False))
        return [(t, trained) for t, trained in parts if t]

    def _spans(self, messages, add_generation_prompt: bool, tools: list | None = None) -> list[tuple[str, bool]]:
        """The rendered text in parts, each with whether it is inside a generation block."""
        import jinja2

        try:
            text = compile_template(self.source).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **({"tools": tools} if tools else {}),
                **self.special,
            )
        except jinja2.exceptions.TemplateError as e:
            raise NanoGPTError(f"the chat template failed on these messages: {e}") from None
        parts = []
        for i, part in enumerate(text.split(_START)):
            trained, _, rest = part.partition(_END) if i else ("", "", part)
            parts += [(trained, True), (rest, False)]
        return [(t, trained) for t, trained in parts if t]


def specials(tokenizer: Tokenizer) -> dict[str, str]:
    """The token strings a Hugging Face tokenizer gives a template (bos_token, eos_token, ...), as transformers'
    apply_chat_template does; empty for our own kinds, whose templates see the end-of-text marker."""
    return dict(getattr(tokenizer, "special_strings", {}))


def _folder_template(folder: Path) -> str | None:
    """The chat template a Hugging Face folder keeps (chat_template.jinja or tokenizer_config.json), if any."""
    from nanogpt_cli.hf_tokenizer import chat_template_of

    try:
        return chat_template_of(folder)
    except (OSError, NanoGPTError):
        return None


def turn_end(source: str, special: dict[str, str] | None = None) -> str:
    """The text a template puts after the assistant's words inside its generation block: what ends a reply
    (the built-in template's end-of-text marker). Empty when the template marks no such text."""
    sentinel = "\x01reply\x01"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": sentinel}]
    template = ChatTemplate(source, special=special or {"bos_token": EOT, "eos_token": EOT})
    for text, trained in template._spans(messages, False):
        if trained and sentinel in text:
            return text.partition(sentinel)[2]
    return ""


def encode(text: str, tokenizer: Tokenizer) -> list[int]:
    """Encode rendered text in which the end-of-text marker means the end-of-text token, as transformers encodes a
    template's special tokens; a tokenizer without that token (byte, char) spells the marker out as text. A
    Hugging Face tokenizer makes every added token written in the text its id, as apply_chat_template does."""
    if getattr(tokenizer, "kind", None) == "hf":
        return tokenizer.encode_special(text) if text else []
    if tokenizer.eot_id is None:
        return tokenizer.encode(text) if text else []
    out: list[int] = []
    for j, chunk in enumerate(text.split(EOT)):
        if j:
            out.append(tokenizer.eot_id)
        if chunk:
            out += tokenizer.encode(chunk)
    return out
