"""serve: the OpenAI-compatible HTTP server and chat page (library: serve/).

nanogpt serve checkpoints/shk --port 8000
"""

from __future__ import annotations

import functools
from typing import Annotated

import typer

from nanogpt_cli.cli.common import (
    SOURCE_HELP,
    Backend,
    Device,
    DraftSource,
    DraftTokens,
    DtypeOption,
    GroupSize,
    Last,
    Quantize,
    Threads,
    note,
    one_line_errors,
    say_kernels,
)
from nanogpt_cli.config import Dtype

AllowHost = Annotated[
    list[str] | None,
    typer.Option(
        metavar="NAME",
        help="Also answer requests whose Host header is NAME (repeatable; * for any). Loopback names and --host "
        "are always answered.",
        show_default=False,
    ),
]
CorsOrigin = Annotated[
    list[str] | None,
    typer.Option(
        metavar="ORIGIN",
        help="Let web pages from ORIGIN (e.g. http://localhost:3000; * for any) call the API from a browser "
        "(repeatable; default: none).",
        show_default=False,
    ),
]


def note_exposure(options) -> None:
    """The notes for a server other machines can reach: no key, or host names it will not answer under."""
    from nanogpt_cli.serve import is_loopback

    host = options.host
    if not is_loopback(host) and options.api_key is None:
        note(
            f"--host {host} is reachable from other machines and no --api-key is set: anyone who can reach it "
            "can use the model"
        )
    if host in ("0.0.0.0", "::") and not options.allow_hosts:
        note(
            f"--host {host} listens on every address, but requests are answered only under loopback names: give "
            "--allow-host with each name or address other machines use to reach this one"
        )


def say_ready(name: str, started) -> None:
    """The line that says the server listens, once it does."""
    say_kernels()  # where loading built our decode kernels (or failed to), once
    print(
        f"serving {name} at {started.url} with a KV cache of {started.cache_bytes_per_token:,.0f} bytes per token "
        "(Ctrl-C to stop)",
        flush=True,
    )


@one_line_errors
def serve(
    source: Annotated[str, typer.Argument(help=SOURCE_HELP)],
    host: Annotated[
        str, typer.Option(help="Address to listen on; anything but loopback wants --api-key.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: a free one, printed).")] = 8000,
    max_batch: Annotated[int, typer.Option(help="Rows decoded together (requests and their choices).")] = 8,
    model_name: Annotated[
        str | None, typer.Option(help="The name /v1/models reports (default: the run's).", show_default=False)
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(help="Require 'Authorization: Bearer KEY'.", envvar="NANOGPT_API_KEY", show_default=False),
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="Most tokens one request may ask for, per choice.")] = 4096,
    max_n: Annotated[int, typer.Option(help="Most choices (n) per request.")] = 8,
    max_queue: Annotated[int, typer.Option(help="Most rows waiting for a free row; beyond it, 503.")] = 64,
    max_body: Annotated[int, typer.Option(help="Most bytes in a request body; beyond it, 413.")] = 1_000_000,
    prompt_cache_mb: Annotated[
        int, typer.Option(help="MiB of keys and values kept for reuse by prompts that share a prefix (0: off).")
    ] = 512,
    adapter: Annotated[
        list[str] | None,
        typer.Option(
            help="NAME=LORA_RUN: also serve a LoRA run of this base as model NAME (repeatable).", show_default=False
        ),
    ] = None,
    allow_host: AllowHost = None,
    cors_origin: CorsOrigin = None,
    no_ui: Annotated[bool, typer.Option("--no-ui", help="Do not serve the chat page at /.")] = False,
    last: Last = False,
    device: Device = "auto",
    dtype: DtypeOption = Dtype.auto,
    quantize: Quantize = None,
    group_size: GroupSize = 32,
    backend: Backend = None,
    threads: Threads = None,
    draft: DraftSource = None,
    draft_tokens: DraftTokens = None,
):
    """Serve a model over the OpenAI API (completions, chat, streaming) with a chat page at /.

    Example: nanogpt serve checkpoints/shk --port 8000
    """
    from nanogpt_cli.device import set_threads
    from nanogpt_cli.serve import ServeOptions, default_model_name
    from nanogpt_cli.serve import serve as run_server

    options = ServeOptions(
        source=source,
        host=host,
        port=port,
        max_batch=max_batch,
        model_name=model_name,
        api_key=api_key,
        device=device,
        dtype=dtype,
        quantize=quantize,
        group_size=group_size,
        backend=backend,
        last=last,
        ui=not no_ui,
        max_body=max_body,
        max_tokens=max_tokens,
        max_n=max_n,
        max_queue=max_queue,
        prompt_cache_mb=prompt_cache_mb,
        adapters=adapter or [],
        allow_hosts=allow_host or [],
        cors_origins=cors_origin or [],
        draft=draft,
        draft_tokens=draft_tokens,
    )
    set_threads(threads)
    note_exposure(options)
    run_server(options, on_ready=functools.partial(say_ready, options.model_name or default_model_name(source)))
