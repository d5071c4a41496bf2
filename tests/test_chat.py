"""`nanogpt chat`: the conversation (chat.py) and the terminal loop, driven through stdin and a pseudo-terminal."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nanogpt_cli.config import GPTConfig
from nanogpt_cli.data.chat_template import DEFAULT_TEMPLATE, EOT, PLAIN_NAME, ChatTemplate
from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.inference.chat import ChatSession
from nanogpt_cli.inference.sample import Sampler, SampleSettings
from nanogpt_cli.model import GPT
from nanogpt_cli.runs import checkpoint as ckpt
from nanogpt_cli.tokenizer import build_tokenizer

ROOT = Path(__file__).resolve().parent.parent
GREEDY = SampleSettings(temperature=0.0)


def save_model(path: Path, block_size: int, chat_template: str | None) -> Path:
    """A random byte-level model that writes only lowercase letters (its head scores nothing else), so its
    replies are plain text that never holds a stop text: they end at the length limit."""
    torch.manual_seed(0)
    tok = build_tokenizer("byte")
    config = GPTConfig(
        vocab_size=tok.vocab_size, block_size=block_size, n_layer=1, n_head=2, n_embd=16, tie_embeddings=False
    )
    model = GPT(config)
    with torch.no_grad():
        letters = torch.zeros(tok.vocab_size, dtype=torch.bool)
        letters[ord("a") : ord("z") + 1] = True
        model.lm_head.weight[~letters] = 0.0
        model.lm_head.weight[letters] *= 300.0  # letters' logits far above the others' 0
    meta = {"tokenizer": tok.describe(), "step": 0}
    if chat_template is not None:
        meta["chat_template"] = chat_template
    ckpt.save_model(path, model, meta)
    return path


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return save_model(tmp_path_factory.mktemp("chat") / "chat.safetensors", 128, DEFAULT_TEMPLATE)


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    return save_model(tmp_path_factory.mktemp("base") / "base.safetensors", 128, None)


def greedy_reply(path: Path, messages: list[dict], max_new_tokens: int) -> str:
    """What the model continues the rendered conversation with, computed without chat.py."""
    sampler = Sampler.load(path, device="cpu")
    ids = ChatTemplate(DEFAULT_TEMPLATE).tokens(messages, sampler.tokenizer)
    settings = SampleSettings(temperature=0.0, max_new_tokens=max_new_tokens, stop=[EOT])
    return sampler.generate(ids, settings).text.strip()


def test_each_reply_continues_the_whole_conversation_in_the_models_template(chat_model):
    session = ChatSession.load(chat_model, GREEDY, system="Be brief.", max_new_tokens=6, device="cpu")
    assert session.template.source == DEFAULT_TEMPLATE and EOT in session.settings.stop  # byte: EOT is text
    first = "".join(session.ask("hello"))
    assert first == greedy_reply(chat_model, [{"role": "system", "content": "Be brief."}, *session.messages[:1]], 6)
    second = session.ask("and again")
    assert "".join(second) == second.text and second.stop_reason == "length" and second.dropped == 0
    turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "and again"},
    ]
    assert second.text == greedy_reply(chat_model, turns, 6)
    assert session.messages == [*turns[1:], {"role": "assistant", "content": second.text}]
    session.reset()
    assert session.messages == [] and "".join(session.ask("hello")) == first  # a fresh start, same reply


def test_a_base_model_gets_the_plain_transcript(base_model):
    session = ChatSession.load(base_model, GREEDY, max_new_tokens=4, device="cpu")
    assert session.template.name == PLAIN_NAME and session.template.plain
    reply = session.ask("hi")
    prompt = session.template.render([{"role": "user", "content": "hi"}])
    assert prompt == "User: hi\n\nAssistant:" and bytes(reply.ids) == prompt.encode()
    assert "\nUser:" in session.settings.stop


def test_history_is_cut_from_the_oldest_turn_and_said_once(tmp_path):
    path = save_model(tmp_path / "short.safetensors", 64, DEFAULT_TEMPLATE)
    session = ChatSession.load(path, GREEDY, max_new_tokens=4, device="cpu")
    dropped, first_cuts = [], []
    for i in range(4):
        reply = session.ask(f"q{i}")  # each turn is ~40 bytes of template: the context holds one
        list(reply)
        dropped.append(reply.dropped)
        first_cuts.append(reply.first_cut)
        ids = session.template.tokens(session.messages[:-1], session.tokenizer)
        assert len(ids) + 4 <= 64 and session.messages[-2]["content"] == f"q{i}"
    assert dropped[0] == 0 and all(d > 0 for d in dropped[1:])
    assert first_cuts == [False, True, False, False]
    with pytest.raises(NanoGPTError, match="context is 64"):
        session.ask("x" * 80)
    assert session.messages[-2]["content"] == "q3"  # a refused message leaves the conversation as it was


def test_a_reply_closed_early_keeps_what_was_shown(chat_model):
    session = ChatSession.load(chat_model, SampleSettings(temperature=1.0), max_new_tokens=50, device="cpu")
    reply = session.ask("hello")
    pieces = iter(reply)
    shown = next(pieces)
    reply.close()
    reply.close()
    assert session.messages[-1] == {"role": "assistant", "content": shown.rstrip()} and len(session.messages) == 2


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "nanogpt_cli", "chat", *args, "--device", "cpu", "--threads", "1"]


ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TERM="dumb")


@pytest.mark.slow  # the CLI as a subprocess
def test_chat_through_stdin_two_turns_reset_and_exit(chat_model):
    lines = "hello\nand again\n/reset\nhello\n/exit\nnever sent\n"
    proc = subprocess.run(
        cli(str(chat_model), "--temperature", "0", "--max-new-tokens", "6"),
        input=lines,
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    session = ChatSession.load(chat_model, GREEDY, max_new_tokens=6, device="cpu")
    expected = ["".join(session.ask("hello")), "".join(session.ask("and again"))]
    assert proc.stdout.splitlines() == [*expected, expected[0]]  # after /reset the first reply again; no 4th
    assert "the conversation is cleared" in proc.stderr and "has no chat template" not in proc.stderr


@pytest.mark.slow  # the CLI as a subprocess
def test_a_base_model_is_told_in_one_line(base_model):
    proc = subprocess.run(cli(str(base_model)), input="", capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 0 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "has no chat template" in proc.stderr


# Ctrl-C's default handling, which a program in a terminal's foreground starts with: a test run itself started
# with SIGINT ignored (a script's background job) passes that on, and Python then installs no KeyboardInterrupt.
# Set in the child before the module runs (a preexec_fn is unsafe in a process with threads, as torch's).
FOREGROUND = (
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT]); "
    "runpy.run_module('nanogpt_cli', run_name='__main__', alter_sys=True)"
)


class Terminal:
    """`nanogpt chat` on a pseudo-terminal: what it prints, bounded waits for it, and keys typed into it."""

    def __init__(self, args: list[str]):
        assert args[1:3] == ["-m", "nanogpt_cli"], args
        self.fd, child = os.openpty()
        args = [args[0], "-c", FOREGROUND, *args[3:]]  # as `python -m nanogpt_cli`, with Ctrl-C's default handling
        self.proc = subprocess.Popen(args, stdin=child, stdout=child, stderr=child, env=ENV, start_new_session=True)
        os.close(child)
        self.out = b""
        self.seen = 0  # how much of out the waits have gone past

    def wait_for(self, text: bytes, timeout: float = 60) -> bytes:
        """Read until `text` appears after what earlier waits went past; what came before it."""
        end, start = time.monotonic() + timeout, self.seen
        while text not in self.out[start:]:
            left = end - time.monotonic()
            assert left > 0, f"no {text!r} within {timeout} s; the terminal shows:\n{self.out.decode(errors='replace')}"
            if select.select([self.fd], [], [], left)[0]:
                try:
                    self.out += os.read(self.fd, 4096)
                except OSError:  # the child is gone
                    assert text in self.out[start:], self.out.decode(errors="replace")
        i = self.out.index(text, start)
        self.seen = i + len(text)
        return self.out[start:i]

    def wait_for_more(self, timeout: float = 60) -> None:
        """Wait until something new is printed."""
        end = time.monotonic() + timeout
        while len(self.out) == self.seen:
            assert time.monotonic() < end, f"nothing printed within {timeout} s"
            if select.select([self.fd], [], [], 0.5)[0]:
                self.out += os.read(self.fd, 4096)
        self.seen = len(self.out)

    def type(self, line: str) -> None:
        os.write(self.fd, line.encode() + b"\r")

    def interrupt(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)  # what the terminal sends on Ctrl-C

    def leave(self, tries: int = 10) -> int:
        """Ctrl-C at the prompt until the program ends (at most `tries` times, 2 s apart): CPython's input() acts on
        a SIGINT that lands between its prompt and its wait for a key only at the next signal, as a person who
        presses Ctrl-C again sees; then close()."""
        for _ in range(tries):
            self.interrupt()
            try:
                self.proc.wait(timeout=2)
                break
            except subprocess.TimeoutExpired:
                continue
        return self.close()

    def close(self) -> int:
        try:
            code = self.proc.wait(timeout=60)
            while select.select([self.fd], [], [], 1)[0]:  # what it printed last
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:  # no writer is left
                    break
                if not chunk:
                    break
                self.out += chunk
            return code
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            os.close(self.fd)


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> Path:
    """Random replies up to 16,384 bytes long: a reply still running when Ctrl-C comes (a quiet machine writes
    2,000 of this model's tokens in under a second, before the signal could land)."""
    return save_model(tmp_path_factory.mktemp("long") / "long.safetensors", 16384, DEFAULT_TEMPLATE)


@pytest.mark.slow  # the CLI as a subprocess
def test_on_a_terminal_ctrl_c_stops_a_reply_and_the_session_goes_on(long_model):
    term = Terminal(cli(str(long_model), "--temperature", "1"))
    try:
        term.wait_for(b">>> ")
        term.type("tell me everything")
        term.wait_for(b"tell me everything\r\n")  # the terminal's echo
        term.wait_for_more()  # the reply has started
        term.interrupt()
        term.wait_for(b"stopped; the reply so far stays in the conversation")
        term.wait_for(b">>> ")
        term.type("/reset")
        term.wait_for(b"the conversation is cleared")
        term.wait_for(b">>> ")
        assert term.leave() == 0  # Ctrl-C at the prompt leaves
        assert term.out.endswith(b"\r\n")  # the shell's prompt starts on a new line
    finally:
        if term.proc.poll() is None:
            term.proc.kill()


@pytest.mark.slow  # the CLI as a subprocess
def test_on_a_terminal_two_turns_then_ctrl_d_leaves(chat_model):
    term = Terminal(cli(str(chat_model), "--temperature", "0", "--max-new-tokens", "6"))
    session = ChatSession.load(chat_model, GREEDY, max_new_tokens=6, device="cpu")
    try:
        assert b"/reset" in term.wait_for(b">>> ")
        for message in ("hello", "and again"):
            term.type(message)
            shown = re.sub(rb"\x1b\[[0-9;?]*[A-Za-z]", b"", term.wait_for(b">>> ")).replace(b"\r", b"")
            typed, reply, speed, rest = shown.decode().split("\n")
            assert [typed, reply, rest] == [message, "".join(session.ask(message)), ""]
            assert re.fullmatch(r"\(6 tokens, [\d,]+\.\d tok/s\)", speed), speed  # each reply's speed, quietly
        os.write(term.fd, b"\x04")  # Ctrl-D
        assert term.close() == 0 and term.out.endswith(b"\r\n")
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
