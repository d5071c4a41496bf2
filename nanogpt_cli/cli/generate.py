"""sample and chat: text from a model, streamed to the terminal (library: inference/).

nanogpt sample --checkpoint checkpoints/shk --prompt "ROMEO:" --max-new-tokens 200
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Annotated

import typer

from nanogpt_cli.cli.common import PromptFile, fail, load_options, note, one_line_errors, say_kernels
from nanogpt_cli.config import LoadSpec
from nanogpt_cli.errors import NanoGPTError

STOP_WORDS = {"eot": "end of text", "stop": "stop text", "length": "--max-new-tokens reached"}  # why a sample ended


def print_samples(sampler, text: str, settings, num_samples: int, stream: bool, json_out: bool = False) -> None:
    """Continue one prompt: the samples printed after it, streamed when asked (or one JSON object each)."""
    from nanogpt_cli.cli.ui import err_console

    ids, cut = sampler.encode_prompt(text)
    if cut:
        err_console.print(
            f"note: the prompt is {len(ids) + cut:,} tokens; its first {cut:,} are cut to fit "
            f"the context of {sampler.block_size:,}",
            soft_wrap=True,
        )
    if json_out:  # one object per sample, for scripts
        for i, r in enumerate(sampler.generate_many([text] * num_samples, settings)):
            record = {"sample": i + 1, "prompt": text, "text": r.text, "tokens": r.tokens}
            record.update(stop_reason=r.stop_reason, tokens_per_s=round(r.tokens_per_s, 1))
            if r.draft_acceptance is not None:  # --draft: the share of the draft's tokens the model kept
                record["draft_acceptance"] = round(r.draft_acceptance, 3)
            print(json.dumps(record, ensure_ascii=False), flush=True)
        return
    results: list = [None] * num_samples
    for i, pieces in enumerate(sampler.samples(text, settings, num_samples, results)):
        if num_samples > 1:  # on stderr: stdout holds the samples' text only
            sys.stdout.flush()
            err_console.rule(f"sample {i + 1} of {num_samples}")
        sys.stdout.write(text)
        for piece in pieces:
            sys.stdout.write(piece)
            if stream:
                sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        if sys.stdout.isatty() and results[i] is not None:  # a terminal: the speed too (--json has it for scripts)
            show_speed(results[i].tokens, results[i].tokens_per_s, STOP_WORDS.get(results[i].stop_reason))


def show_speed(tokens: int, tokens_per_s: float, why: str | None = None) -> None:
    """On a terminal, after a reply or a sample: its tokens and speed, dimmed, on stderr (pipes get the text only;
    sample --json has the same figures)."""
    from nanogpt_cli.cli.ui import err_console

    if tokens and err_console.is_terminal:
        ended = f", {why}" if why else ""
        err_console.print(f"({tokens:,} tokens, {tokens_per_s:,.1f} tok/s{ended})", style="dim", highlight=False)


# the sampling options that sample and chat share
Temperature = Annotated[float, typer.Option(help="0 is greedy; lower is more conservative.")]
TopK = Annotated[int, typer.Option(help="Keep only the K most likely tokens (0: off).")]
TopP = Annotated[float, typer.Option(help="Keep the fewest tokens whose probability reaches P (1: off).")]
MinP = Annotated[float, typer.Option(help="Drop tokens below P x the top token's probability (0: off).")]
RepetitionPenalty = Annotated[float, typer.Option(help="Above 1 discourages tokens already present.")]
Seed = Annotated[int, typer.Option(help="Random seed: the same seed gives the same text.")]
Stop = Annotated[list[str] | None, typer.Option(help="End a sample at this text (repeatable).", metavar="<text>")]


@one_line_errors
@load_options(source="--checkpoint")
def sample(
    prompt: Annotated[str | None, typer.Option(help="Text to continue (empty: start a new text).")] = None,
    prompt_file: PromptFile = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate per sample.")] = 256,
    temperature: Temperature = 0.8,
    top_k: TopK = 200,
    top_p: TopP = 1.0,
    min_p: MinP = 0.0,
    repetition_penalty: RepetitionPenalty = 1.0,
    num_samples: Annotated[int, typer.Option(help="How many samples (decoded together as one batch).")] = 1,
    seed: Seed = 1337,
    stop: Stop = None,
    ignore_eot: Annotated[bool, typer.Option("--ignore-eot", help="Keep going past the end-of-text token.")] = False,
    stream: Annotated[bool, typer.Option("--stream/--no-stream", help="Print text as it is generated.")] = True,
    json_out: Annotated[
        bool,
        typer.Option(
            "--json",
            help="One JSON object per sample: text, tokens, stop_reason, tokens_per_s (and draft_acceptance with "
            "--draft).",
        ),
    ] = False,
    interactive: Annotated[
        bool, typer.Option("--interactive", "-i", help="Ask for prompts in a loop (--prompt is the first).")
    ] = False,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Recompute the whole context every token.")] = False,
    *,
    spec: LoadSpec,  # the model and how it loads (load_options)
):
    """Generate text from a trained model, streamed as it is written.

    Example: nanogpt sample --checkpoint checkpoints/shk --prompt "ROMEO:" --max-new-tokens 200
    """
    from nanogpt_cli import api

    if prompt is not None and prompt_file is not None:
        raise NanoGPTError("give --prompt or --prompt-file, not both")
    if prompt_file is not None:
        from nanogpt_cli.files import read_text_file

        prompt = read_text_file(prompt_file, "--prompt-file")
    settings = api.sample_settings(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k or None,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        seed=seed,
        stop=stop or [],
        ignore_eot=ignore_eot,
        use_cache=not no_cache,
    )
    model = api.load(spec)
    say_kernels(model)
    sampler = model.sampler
    run = functools.partial(
        print_samples, sampler, settings=settings, num_samples=num_samples, stream=stream, json_out=json_out
    )
    if not interactive:
        return run(prompt or "")
    interactive_loop(run, prompt)


def interactive_loop(run, first: str | None) -> None:
    """sample -i: a prompt at a time until Ctrl-D (or Ctrl-C at the prompt); Ctrl-C while a sample is written
    stops that sample. The shell's prompt comes back on a line of its own."""
    from nanogpt_cli.cli.ui import err_console

    err_console.print("type a prompt and press Enter; Ctrl-D (or Ctrl-C) leaves", highlight=False)
    while True:
        if first is not None:  # --prompt (or --prompt-file) with --interactive is the first prompt
            text, first = first, None
            print(f"prompt> {text}")
        else:
            try:
                text = input("prompt> ")
            except (EOFError, KeyboardInterrupt):
                print(flush=True)  # the shell's prompt on a new line, not after ours
                return
        try:
            run(text)
        except NanoGPTError as e:  # a bad prompt should not end the session
            fail(str(e))
        except KeyboardInterrupt:  # stops this sample, not the session
            print(flush=True)


@one_line_errors
@load_options()
def chat(
    system: Annotated[
        str | None, typer.Option(help="A system prompt at the start of the conversation.", show_default=False)
    ] = None,
    max_new_tokens: Annotated[
        int | None, typer.Option(help="Most tokens per reply (default: up to the end of the context).")
    ] = None,
    temperature: Temperature = 0.8,
    top_k: TopK = 200,
    top_p: TopP = 1.0,
    min_p: MinP = 0.0,
    repetition_penalty: RepetitionPenalty = 1.0,
    seed: Seed = 1337,
    stop: Stop = None,
    *,
    spec: LoadSpec,  # the model and how it loads (load_options)
):
    """Talk to a model in the terminal, formatted with its chat template; /reset, /exit, Ctrl-C stops a reply.

    Example: nanogpt chat checkpoints/count --temperature 0
    """
    from nanogpt_cli import api

    if max_new_tokens is not None and max_new_tokens < 1:
        raise NanoGPTError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    settings = dict(
        temperature=temperature,
        top_k=top_k or None,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        seed=seed,
        stop=stop or [],
    )
    model = api.load(spec)
    say_kernels(model)
    session = model.conversation(system, max_new_tokens, **settings)
    if session.template.plain:
        note(f"{spec.source} has no chat template (a base model): it gets a plain User:/Assistant: transcript")
    converse(session)


def converse(session) -> None:
    """The terminal loop: a prompt on a terminal (none when stdin is a pipe), each reply streamed on its own line,
    /reset and /exit; Ctrl-C during a reply stops it, Ctrl-C or Ctrl-D at the prompt leaves."""
    tty = sys.stdin.isatty()
    if tty:
        import readline  # noqa: F401  (line editing and history for input())

        print(f"chatting with {session.block_size:,} tokens of context; /reset clears it, /exit or Ctrl-D leaves")
    while True:
        try:
            text = input(">>> " if tty else "")
        except (EOFError, KeyboardInterrupt):
            if tty:
                print()  # the shell's prompt on a line of its own
            return
        command = text.strip()
        if command in ("/exit", "/quit", "/bye"):
            return
        if command == "/reset":
            session.reset()
            note("the conversation is cleared")
            continue
        if command.startswith("/") and command[1:2].isalpha() and " " not in command:
            note(f"unknown command {command}; /reset clears the conversation, /exit leaves")
            continue
        if not command:
            continue
        try:
            reply = session.ask(text)
        except NanoGPTError as e:  # a message too long for the context: the session goes on
            fail(str(e))
            continue
        if reply.first_cut:
            note(
                f"the conversation outgrew the model's context of {session.block_size:,} tokens: "
                "from now on its oldest turns are left out"
            )
        try:
            for piece in reply:
                sys.stdout.write(piece)
                sys.stdout.flush()
            print()
            show_speed(reply.tokens, reply.tokens_per_s)
        except KeyboardInterrupt:
            reply.close()
            print()
            note("stopped; the reply so far stays in the conversation")
