"""A conversation with a model: the turns so far, rendered with the model's chat template, and each reply
streamed from the engine. `nanogpt chat` is a terminal loop over it; this module never prints.

    session = ChatSession.load("checkpoints/count", SampleSettings(temperature=0), system=None)
    reply = session.ask("count castle")       # reply.dropped: oldest turns cut to fit the context
    for piece in reply: print(piece, end="")  # the reply joins the history when it ends (or is closed early)

The history is cut from the oldest turn when the rendered conversation, plus room for a reply, outgrows the
model's context: room for min(--max-new-tokens, half the context) tokens, or a quarter of the context when
--max-new-tokens is not given. A reply never runs past the context: past it the model would no longer see the
start of the conversation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import torch

from nanogpt_cli.data.chat_template import ChatTemplate
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.inference.sample import Sampler, SampleSettings
from nanogpt_cli.interop.loading import InferenceModel, load_for_inference


class ChatSession:
    """The model, its template, the sampling settings and the conversation so far."""

    def __init__(
        self,
        loaded: InferenceModel,
        template: ChatTemplate,
        settings: SampleSettings,
        system: str | None = None,
        max_new_tokens: int | None = None,
        draft=None,
    ):
        self.sampler = Sampler(loaded, draft)  # draft: speculative decoding's (inference/speculative.py)
        self.tokenizer = loaded.tokenizer
        self.template = template
        self.settings = dataclasses.replace(settings, stop=list(settings.stop) + template.stop, ignore_eot=False)
        self.max_new_tokens = max_new_tokens  # None: up to the end of the context
        self.system = system
        # one generator for the whole conversation: the same seed gives the same conversation
        self.generator = torch.Generator(device=loaded.device).manual_seed(settings.seed)
        self.messages: list[dict[str, str]] = []
        self.cut = False  # whether the history has been cut yet

    @classmethod
    def load(
        cls,
        source: str | Path,
        settings: SampleSettings,
        system: str | None = None,
        max_new_tokens: int | None = None,
        last: bool = False,
        device: str = "auto",
        dtype: str = "auto",
    ) -> ChatSession:
        loaded = load_for_inference(source, last=last, device=device, dtype=dtype)
        template = ChatTemplate.for_model(loaded.meta, loaded.tokenizer, loaded.source.location)
        return cls(loaded, template, settings, system, max_new_tokens)

    @property
    def block_size(self) -> int:
        return self.sampler.block_size

    @property
    def room(self) -> int:
        """Tokens kept free for the reply when the history is cut."""
        cap = self.block_size // 2
        return max(1, min(self.max_new_tokens, cap) if self.max_new_tokens else self.block_size // 4)

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays)."""
        self.messages = []

    def ask(self, text: str) -> Reply:
        """Add the user's message and start the reply. The oldest turns are dropped while the conversation does
        not fit (Reply.dropped says how many messages); a message that cannot fit alone is refused, and the
        conversation stays as it was."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        turns = [*self.messages, {"role": "user", "content": text}]
        ids = self.template.tokens(head + turns, self.tokenizer)
        dropped = 0
        while len(ids) > self.block_size - self.room and len(turns) > 1:
            cut = next((i for i in range(1, len(turns)) if turns[i]["role"] == "user"), len(turns) - 1)
            turns, dropped = turns[cut:], dropped + cut
            ids = self.template.tokens(head + turns, self.tokenizer)
        if len(ids) >= self.block_size:
            what = "the system prompt and this message take" if head else "this message takes"
            raise NanoGPTError(
                f"{what} {len(ids):,} tokens with the chat template, and the model's context is "
                f"{self.block_size:,}: write a shorter one" + (" or give a shorter --system" if head else "")
            )
        limit = self.block_size - len(ids)
        if self.max_new_tokens is not None:
            limit = min(limit, self.max_new_tokens)
        first_cut = dropped > 0 and not self.cut
        self.cut = self.cut or dropped > 0
        self.messages = turns
        settings = dataclasses.replace(self.settings, max_new_tokens=limit)
        return Reply(self, ids, settings, dropped, first_cut)


class Reply:
    """One reply, streamed: iterate for its text. When it ends, or is closed early (Ctrl-C), the text shown so far
    becomes the assistant's turn."""

    def __init__(self, session: ChatSession, ids: list[int], settings: SampleSettings, dropped: int, first_cut: bool):
        self.session, self.ids, self.settings = session, ids, settings
        self.dropped = dropped  # messages cut from the start of the history for this reply
        self.first_cut = first_cut  # the first time this conversation was cut: say so
        self.text = ""
        self.stop_reason: str | None = None  # "eot", "stop", "length"; None while running or when stopped early
        self.tokens = 0  # tokens generated, once the reply has ended by itself
        self.elapsed_s = 0.0  # the time they took (prompt included)
        self._pieces: Iterator[str] | None = None
        self._done = False

    def __iter__(self) -> Iterator[str]:
        if self._pieces is None:
            self._pieces = self._stream()
        return self._pieces

    def _stream(self) -> Iterator[str]:
        result: dict = {}
        try:
            leading = True
            for piece in self.session.sampler.stream(self.ids, self.settings, self.session.generator, result):
                if leading:  # the template puts the space after "assistant:" itself; the reply starts at its text
                    piece = piece.lstrip()
                    leading = not piece
                if piece:
                    self.text += piece
                    yield piece
            self.stop_reason = result.get("stop_reason")
            self.tokens, self.elapsed_s = result.get("tokens", 0), result.get("elapsed_s", 0.0)
        finally:
            self._finish()

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def close(self) -> None:
        """End the reply where it is (idempotent); what was shown stays in the history."""
        if self._pieces is not None:
            self._pieces.close()
        self._finish()

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self.text = self.text.rstrip()
            self.session.messages.append({"role": "assistant", "content": self.text})
