"""`nanogpt serve`: an OpenAI-compatible HTTP server with continuous batching, and a chat page.

    options = ServeOptions(LoadSpec("checkpoints/shk"), port=0)
    serve(options, on_ready=print)   # blocks; Ctrl-C or SIGTERM ends in-flight streams and returns
                                     # on_ready gets a Started: the URL and the KV cache's bytes per token

Modules: scheduler (the engine thread, continuous batching), api (routes and OpenAI shapes), protocol (request
bodies and the error shape), chat (chat templates), tools (tool calls in and out of the text), page.html (the chat
page). Structured output's masks are inference/grammar.py's. FastAPI and uvicorn come from
the `serve` extra and are imported only here.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from nanogpt_cli.config import LoadSpec
from nanogpt_cli.errors import NanoGPTError, require

__all__ = ["ServeOptions", "Started", "build_server", "serve"]


@dataclass(frozen=True)
class Started:
    """What a server says once it listens."""

    url: str
    cache_bytes_per_token: float  # the engine's KV cache per token of a row (every layer's keys and values)


@dataclass
class ServeOptions:
    load: LoadSpec  # the model and how it loads
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 8  # rows decoded together
    model_name: str | None = None  # default: the run's name
    api_key: str | None = None  # default: $NANOGPT_API_KEY
    ui: bool = True
    max_body: int = 1_000_000
    max_tokens: int = 4096
    max_n: int = 8
    max_queue: int = 64
    prompt_cache_mb: int = 512  # MiB of keys and values the prefix cache keeps; 0: off
    adapters: list[str] = field(default_factory=list)  # NAME=LORA_RUN, each served as model NAME
    allow_hosts: list[str] = field(default_factory=list)  # Host names answered besides loopback's and host ("*": any)
    cors_origins: list[str] = field(default_factory=list)  # origins whose pages may call the API ("*": any); none: off
    grammar_seconds: float = 10.0  # most seconds a request's grammar may take to compile (then a 400)

    def __post_init__(self):
        for name in ("max_batch", "max_body", "max_tokens", "max_n", "max_queue"):
            if getattr(self, name) < 1:
                raise NanoGPTError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        from nanogpt_cli.serve.adapters import parse_adapter

        for spec in self.adapters:
            parse_adapter(spec)  # the form at once, before the model loads
        if self.prompt_cache_mb < 0:
            raise NanoGPTError(f"--prompt-cache-mb must be at least 0 (0: no prompt cache), got {self.prompt_cache_mb}")
        if not self.grammar_seconds > 0:
            raise NanoGPTError(f"grammar_seconds must be more than 0, got {self.grammar_seconds}")
        for name in self.allow_hosts:  # compared with the Host header's name, its port and brackets taken off
            if name != "*" and not _host_name(name):
                raise NanoGPTError(
                    f"--allow-host takes a host name or address without a scheme or port, such as myhost.lan or "
                    f"192.168.1.5 (any port is answered), got {name!r}"
                )
        for origin in self.cors_origins:
            if origin != "*" and not origin.startswith(("http://", "https://")):
                raise NanoGPTError(
                    f"--cors-origin takes an origin such as http://localhost:3000 (scheme, host and port) or *, "
                    f"got {origin!r}"
                )
        if not 0 <= self.port <= 65535:
            raise NanoGPTError(f"--port must be between 0 and 65535, got {self.port}")
        self.api_key = self.api_key or os.environ.get("NANOGPT_API_KEY") or None  # an empty key is no key

    @property
    def served_name(self) -> str:
        """The name /v1/models reports: model_name, else the run's."""
        return self.model_name or default_model_name(self.load.source)

    @property
    def reachable(self) -> bool:
        """Whether other machines can reach the server: its host is not a loopback name or address."""
        return not is_loopback(self.host)


def default_model_name(source: str) -> str:
    """The run's name: a run folder's or a file's name, or hf:NAME's NAME."""
    if source.startswith("hf:"):
        return source[3:]
    path = Path(source)
    return path.stem if path.suffix == ".safetensors" else path.resolve().name


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_server(options: ServeOptions, on_ready: Callable[[Started], None] | None = None):
    """Load the model, start the engine thread and return an uvicorn Server for the app (not yet running)."""
    require("fastapi", "serve", "nanogpt serve")
    uvicorn = require("uvicorn", "serve", "nanogpt serve")
    require("prometheus_client", "serve", "nanogpt serve")
    from nanogpt_cli.inference.prefix import PrefixCache
    from nanogpt_cli.inference.speculative import load_draft
    from nanogpt_cli.interop.loading import load_parsed, parse_spec
    from nanogpt_cli.serve.api import Limits, ServerState, create_app
    from nanogpt_cli.serve.chat import ChatTemplate
    from nanogpt_cli.serve.metrics import Metrics
    from nanogpt_cli.serve.scheduler import Scheduler

    if options.adapters and options.load.quantize is not None:
        raise NanoGPTError("--adapter adds LoRA to full-precision weights; drop --quantize to serve adapters")
    source = parse_spec(options.load)
    loaded = load_parsed(source, options.load)
    model_name = options.served_name
    adapters = _adapters(options, source, loaded, model_name)
    prefix = PrefixCache(options.prompt_cache_mb << 20) if options.prompt_cache_mb else None
    metrics = Metrics()
    scheduler = Scheduler(
        loaded.model,
        loaded.tokenizer,
        loaded.device,
        options.max_batch,
        options.max_queue,
        prefix_cache=prefix,
        adapters=adapters,
        metrics=metrics,
        draft=load_draft(options.load, loaded.tokenizer, loaded.dtype),
    )
    metrics.watch(scheduler)
    state = ServerState(
        scheduler=scheduler,
        model=loaded.model,
        tokenizer=loaded.tokenizer,
        model_name=model_name,
        adapter_names=[] if adapters is None else adapters.names,
        metrics=metrics,
        template=ChatTemplate.for_model(loaded.meta, loaded.tokenizer, source.location),
        api_key=options.api_key,
        limits=Limits(options.max_body, options.max_tokens, options.max_n, options.grammar_seconds),
        ui=options.ui,
        hosts=[options.host, *options.allow_hosts],
        cors_origins=[o.rstrip("/") for o in options.cors_origins],
    )
    config = uvicorn.Config(
        create_app(state),
        host=options.host,
        port=options.port,
        log_level="warning",
        timeout_graceful_shutdown=5,
        lifespan="off",
    )
    return _server_class(uvicorn)(config, state, on_ready)


def _adapters(options: ServeOptions, source, loaded, model_name: str):
    """The --adapter runs on the served weights (lora.RowAdapters), or None. The base's hash is taken of the
    weights as stored: a model cast for inference (bfloat16) hashes differently."""
    if not options.adapters:
        return None
    import torch

    from nanogpt_cli.interop.loading import build_model
    from nanogpt_cli.lora import weights_hash
    from nanogpt_cli.serve.adapters import load_adapters

    stored = loaded.model if loaded.dtype == torch.float32 else build_model(source)[0]
    return load_adapters(loaded.model, options.adapters, weights_hash(stored), model_name)


def _server_class(uvicorn):
    class Server(uvicorn.Server):
        """uvicorn's server, which also ends the engine's work first when it stops (so open streams finish
        and their connections close), says its URL once listening, and exits normally on a signal."""

        def __init__(self, config, state, on_ready):
            super().__init__(config)
            self.state, self.on_ready, self.url = state, on_ready, None

        async def startup(self, sockets=None):
            self.state.scheduler.start()
            await super().startup(sockets)
            if self.started and self.servers:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                shown = f"[{host}]" if ":" in host else host
                self.url = f"http://{shown}:{port}"
                if self.on_ready is not None:
                    self.on_ready(Started(self.url, self.state.scheduler.engine.cache_bytes_per_token))

        async def shutdown(self, sockets=None):
            self.state.scheduler.stop()  # every open stream gets its end, so its connection can close
            if self.state.grammars is not None:  # compiles not started never start; those running end by budget
                self.state.grammars.shutdown(wait=False, cancel_futures=True)
            await super().shutdown(sockets)

        def handle_exit(self, sig, frame):
            # a signal asks for a clean stop, exit code 0: do not re-raise it afterwards as uvicorn would
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    return Server


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads, so that a port in use is one clear error at once."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        raise NanoGPTError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def serve(options: ServeOptions, on_ready: Callable[[Started], None] | None = None) -> None:
    """Run the server until Ctrl-C or SIGTERM."""
    sock = listen(options.host, options.port)
    try:
        server = build_server(options, on_ready)
        try:
            server.run(sockets=[sock])
        finally:
            server.state.scheduler.stop()
    finally:
        sock.close()


def _host_name(name: str) -> bool:
    """Whether --allow-host's value is a bare host name or address (an IPv6 one with or without brackets)."""
    import ipaddress

    bare = name[1:-1] if name.startswith("[") and name.endswith("]") else name
    if ":" in bare:
        try:
            ipaddress.IPv6Address(bare)
        except ValueError:
            return False
        return True
    return bool(bare) and not any(c in bare for c in "/@[] ")
