"""serve: the OpenAI-compatible HTTP server and chat page (library: serve/).

nanogpt serve checkpoints/shk --port 8000
"""

from __future__ import annotations

from typing import Annotated

import typer

from nanogpt_cli.cli.common import (
    SOURCE_HELP,
    Backend,
    Device,
    DtypeOption,
    GroupSize,
    Last,
    Quantize,
    Threads,
    note,
    one_line_errors,
)
from nanogpt_cli.config import Dtype


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
    no_ui: Annotated[bool, typer.Option("--no-ui", help="Do not serve the chat page at /.")] = False,
    last: Last = False,
    device: Device = "auto",
    dtype: DtypeOption = Dtype.auto,
    quantize: Quantize = None,
    group_size: GroupSize = 32,
    backend: Backend = None,
    threads: Threads = None,
):
    """Serve a model over the OpenAI API (completions, chat, streaming) with a chat page at /.

    Example: nanogpt serve checkpoints/shk --port 8000
    """
    from nanogpt_cli.device import set_threads
    from nanogpt_cli.serve import ServeOptions, default_model_name, is_loopback
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
    )
    set_threads(threads)
    if not is_loopback(host) and options.api_key is None:
        note(
            f"--host {host} is reachable from other machines and no --api-key is set: anyone who can reach it "
            "can use the model"
        )
    name = options.model_name or default_model_name(source)
    run_server(
        options,
        on_ready=lambda started: print(
            f"serving {name} at {started.url} with a KV cache of {started.cache_bytes_per_token:,.0f} bytes per token "
            "(Ctrl-C to stop)",
            flush=True,
        ),
    )
