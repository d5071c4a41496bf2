"""The HTTP routes: OpenAI's completions, chat completions and models, a health check and the chat page.

    app = create_app(state)   # a FastAPI app; uvicorn serves it (serve/__init__.py)

Every request becomes one scheduler job per choice (`n`), so its choices are rows of the running batch.
Answers and errors have OpenAI's shapes; streams are server-sent events ending with `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import html
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanogpt_cli.errors import NanoGPTError
from nanogpt_cli.inference.engine import SamplingParams, prompt_logprobs
from nanogpt_cli.serve import tools as tool_calls
from nanogpt_cli.serve.chat import ChatTemplate
from nanogpt_cli.serve.metrics import Metrics
from nanogpt_cli.serve.protocol import APIError, ChatRequest, CompletionRequest, GrammarSpec, parse
from nanogpt_cli.serve.scheduler import Done, Failed, Job, QueueFull, Scheduler

log = logging.getLogger("nanogpt.serve")


@dataclass
class Limits:
    max_body: int = 1_000_000  # bytes of a request body
    max_tokens: int = 4096  # tokens a request may ask for, per choice
    max_n: int = 8  # choices per request
    grammar_seconds: float = 10.0  # a grammar's compile (and its first mask) past this is a 400


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")  # the Host names a server always answers to


@dataclass
class ServerState:
    scheduler: Scheduler
    model: Any  # the GPT
    tokenizer: Any
    model_name: str
    template: ChatTemplate
    adapter_names: list[str] = field(default_factory=list)  # --adapter names: model names besides model_name
    metrics: Metrics | None = None
    api_key: str | None = None
    limits: Limits = field(default_factory=Limits)
    ui: bool = True
    hosts: list[str] = field(default_factory=list)  # Host names answered besides LOOPBACK_NAMES ("*": any)
    cors_origins: list[str] = field(default_factory=list)  # origins a browser page may call from ("*": any)
    created: int = field(default_factory=lambda: int(time.time()))
    handoff: _Handoff | None = None  # made by the first request, in the event loop's thread

    @property
    def block_size(self) -> int:
        return self.model.config.block_size

    @property
    def model_names(self) -> list[str]:
        """The base first, then each adapter: a request's `model` picks one, its index is the engine's adapter."""
        return [self.model_name, *self.adapter_names]


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="nanogpt", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.nanogpt = state
    _install_error_handlers(app)
    if state.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=state.cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    app.add_middleware(_CheckHost, hosts=state.hosts)  # outside CORS: a preflight to a foreign Host is refused too
    if state.metrics is not None:
        app.add_middleware(_CountRequests, metrics=state.metrics)

    @app.get("/health")
    async def health():
        s = state.scheduler
        return {
            "status": "ok",
            "model": state.model_name,
            "models": state.model_names,
            "active_rows": s.active,
            "waiting": s.waiting,
            "max_batch": s.engine.max_batch,
            "backend": s.engine.backend.describe(s.engine.plan),
        }

    @app.get("/metrics")
    async def metrics(request: Request):
        _authorize(state, request)
        if state.metrics is None:
            raise APIError(404, "this server keeps no metrics", code="not_found")
        text, content_type = state.metrics.render()
        return Response(text, media_type=content_type)

    @app.get("/v1/models")
    async def models(request: Request):
        _authorize(state, request)
        data = [
            {
                "id": name,
                "object": "model",
                "created": state.created,
                "owned_by": "nanogpt",
                "context_length": state.block_size,
                "chat_template": state.template.name,
                **({"parent": state.model_name} if i else {}),
            }
            for i, name in enumerate(state.model_names)
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(request: Request):
        _authorize(state, request)
        body = parse(CompletionRequest, await _read_json(request, state.limits.max_body))
        return await _completions(state, request, body)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        _authorize(state, request)
        body = parse(ChatRequest, await _read_json(request, state.limits.max_body))
        return await _chat(state, request, body)

    @app.get("/", response_class=HTMLResponse)
    async def page():
        if not state.ui:
            raise APIError(404, "the chat page is off on this server (--no-ui)", code="not_found")
        text = resources.files("nanogpt_cli.serve").joinpath("page.html").read_text(encoding="utf-8")
        return HTMLResponse(text.replace("{{MODEL_NAME}}", html.escape(state.model_name)))

    return app


class _CountRequests:
    """ASGI middleware: count each HTTP response by its route (the matched path, or "other") and status, without
    wrapping the body, so a stream's chunks pass as they are."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]  # no response started: the server's own error page

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            route = scope.get("route")
            self.metrics.requests.labels(getattr(route, "path", "other"), str(status[0])).inc()


class _ErrorResponse(JSONResponse):
    """An error body as ASCII JSON (non-ASCII escaped): a message that quotes a request's text can always be
    sent, whatever that text holds."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def _error(e: APIError) -> _ErrorResponse:
    return _ErrorResponse(e.body(), status_code=e.status)


class _CheckHost:
    """ASGI middleware: answer only requests whose Host header names this server (LOOPBACK_NAMES and `hosts`), so
    a web page on another name that resolves to this machine (DNS rebinding) cannot read it. A request without
    a Host header (HTTP/1.0) is no browser's and passes."""

    def __init__(self, app, hosts: list[str]):
        self.app = app
        self.any = "*" in hosts
        self.hosts = {h.lower().strip("[]") for h in [*LOOPBACK_NAMES, *hosts]}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.any:
            return await self.app(scope, receive, send)
        raw = next((v for k, v in scope["headers"] if k == b"host"), None)
        if raw is None:
            return await self.app(scope, receive, send)
        host = raw.decode("latin-1").lower()
        name = host[1 : host.index("]")] if host.startswith("[") and "]" in host else host.rsplit(":", 1)[0]
        if name in self.hosts:
            return await self.app(scope, receive, send)
        message = (
            f"this server does not answer to the host name {name!r}; to serve it under that name, start it "
            f"with --allow-host {name}"
        )
        await _error(APIError(400, message, code="invalid_host"))(scope, receive, send)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return _error(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        message = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return _error(APIError(e.status_code, message, code="not_found"))

    @app.exception_handler(RequestValidationError)  # FastAPI's 422 body never reaches a client
    async def validation_error(request: Request, e: RequestValidationError):
        return _error(APIError(400, f"invalid request: {e.errors()[0].get('msg', '')}"))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("unexpected error")
        return _error(APIError(500, f"internal error: {e}"))


def _authorize(state: ServerState, request: Request) -> None:
    if state.api_key is None:
        return
    header = request.headers.get("authorization", "")
    if not header.startswith("Bearer "):
        raise APIError(401, "this server needs an API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
    # in constant time, so the time of a refusal tells nothing of how much of the key was right; headers are
    # latin-1 text of the bytes sent, the key is UTF-8
    given = header[len("Bearer ") :].strip().encode("latin-1")
    if not hmac.compare_digest(given, state.api_key.encode("utf-8")):
        raise APIError(401, "incorrect API key", code="invalid_api_key")


async def _read_json(request: Request, limit: int) -> Any:
    """The body as JSON, refused with 415 unless it is sent as application/json (a web page can post text/plain
    to any server without the browser asking it first), 413 past `limit` bytes (read no further), and 400 when
    it is not JSON or holds text that is not Unicode."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        shown = f"'{media}'" if media else "none"
        raise APIError(
            415,
            f"send the request body as JSON with 'Content-Type: application/json' (this one has {shown})",
            code="unsupported_media_type",
        )
    too_large = APIError(
        413, f"the request body is larger than this server's limit of {limit:,} bytes", code="body_too_large"
    )
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    try:
        data = json.loads(body)
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # json's C decoder recurses once per level of nesting
        raise APIError(400, "the request body is JSON nested too deeply") from None
    _check_unicode(data)
    return data


def _check_unicode(data: Any) -> None:
    """APIError(400) naming the first text in a JSON body that is not Unicode: JSON's escapes can write a lone
    surrogate ("\\ud800"), which no tokenizer, template or reply can encode."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:  # not recursive: the body may be nested as deep as json's decoder goes
        where, value = stack.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                _check_text(k, where or None)
                stack.append((f"{where}.{k}" if where else k, v))
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, str):
            _check_text(value, where or None)


def _check_text(text: str, param: str | None) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        raise APIError(
            400,
            f"{param or 'the request body'} holds a lone surrogate ({ascii(bad)}), which is not text that can be "
            "encoded; send each character whole (a pair of surrogates, or the character itself)",
            param=param,
        ) from None


# --- shared by both routes ---------------------------------------------------------------------------


def _check_model(state: ServerState, name: str | None) -> int:
    """The engine's adapter for a request's `model` (0: the base; no name is the base)."""
    if name in (None, ""):
        return 0
    if name not in state.model_names:
        have = ", ".join(f"'{n}'" for n in state.model_names)
        raise APIError(400, f"no model '{name}' here; this server has {have}", param="model", code="model_not_found")
    return state.model_names.index(name)


def _encode(state: ServerState, text: str, param: str) -> list[int]:
    try:
        ids = state.tokenizer.encode(text) if text else _empty_prompt(state.tokenizer)
        if text and state.tokenizer.bos_id is not None:  # a model that expects BOS (Llama's <s>) was trained with it
            ids = [state.tokenizer.bos_id, *ids]
    except NanoGPTError as e:
        raise APIError(400, str(e), param=param) from None
    return _check_length(state, ids, param)


def _empty_prompt(tokenizer) -> list[int]:
    """What an empty prompt starts from: end-of-text, or a newline (as `nanogpt sample` does)."""
    if tokenizer.eot_id is not None:
        return [tokenizer.eot_id]
    try:
        return tokenizer.encode("\n")
    except NanoGPTError:
        return [0]


def _check_length(state: ServerState, ids: list[int], param: str) -> list[int]:
    if len(ids) > state.block_size:
        raise APIError(
            400,
            f"the prompt is {len(ids):,} tokens, more than the model's context of {state.block_size:,} tokens",
            param=param,
            code="context_length_exceeded",
        )
    if any(not 0 <= i < state.tokenizer.vocab_size for i in ids):
        raise APIError(400, f"token ids must be in [0, {state.tokenizer.vocab_size})", param=param)
    return ids


def _max_tokens(state: ServerState, value: int | None, default: int, param: str) -> int:
    limit = state.limits.max_tokens
    if value is None:
        return min(default, limit)
    if not 0 <= value <= limit:
        raise APIError(400, f"{param} must be between 0 and {limit:,} (this server's limit), got {value}", param=param)
    return value


def _params(body, logprobs: int | None) -> SamplingParams:
    return SamplingParams(
        temperature=body.temperature,
        top_k=body.top_k or None,
        top_p=body.top_p,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        logprobs=logprobs,
    )


class _Handoff:
    """Events from the engine's thread to the event loop, with one wake-up of the loop per burst instead of one
    per event: a wake-up writes to the loop's self-pipe, and with 16 streams doing it for every token took ~14%
    of the engine thread's time. The loop then puts each event on its request's queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.lock = loop, threading.Lock()
        self.items: list[tuple[asyncio.Queue, Any]] = []

    def put(self, queue: asyncio.Queue, item: Any) -> None:
        """Called from the engine's thread."""
        with self.lock:
            self.items.append((queue, item))
            if len(self.items) > 1:  # a drain is already on its way
                return
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop has closed: the server is stopping, no one is listening
            pass

    def _drain(self) -> None:
        with self.lock:
            items, self.items = self.items, []
        for queue, item in items:
            queue.put_nowait(item)


class _Run:
    """The jobs of one request and the queue their events arrive on (in the event loop's thread)."""

    def __init__(
        self,
        state: ServerState,
        prompts: list[list[int]],
        body,
        params: SamplingParams,
        max_tokens: int,
        stop: list[str],
        adapter: int = 0,
        constraint=None,
    ):
        self.state, self.queue = state, asyncio.Queue()
        loop = asyncio.get_running_loop()
        if state.handoff is None or state.handoff.loop is not loop:
            state.handoff = _Handoff(loop)
        self.handoff = state.handoff
        self.jobs = []
        for p, ids in enumerate(prompts):
            for j in range(body.n):
                seed = None if body.seed is None else body.seed + j  # choice j: its own seed, as a row alone
                index = p * body.n + j
                sink = functools.partial(self._deliver, index)
                mask = None if constraint is None else constraint.copy()  # each choice follows its own
                job = Job(ids, params, max_tokens, stop, sink, seed, body.ignore_eos, adapter, body.cache_prompt, mask)
                self.jobs.append(job)
        self.open = set(range(len(self.jobs)))

    def _deliver(self, index: int, event) -> None:
        """Called from the engine's thread: hand one choice's event to the event loop."""
        self.handoff.put(self.queue, (index, event))

    def submit(self) -> None:
        queue = self.state.scheduler.max_queue
        if len(self.jobs) > queue:  # it would never fit: not a 503 to retry
            raise APIError(
                400,
                f"this request makes {len(self.jobs)} choices (prompts times n), more than this server's "
                f"queue of {queue}",
                param="n",
            )
        try:
            self.state.scheduler.submit(self.jobs)
        except QueueFull as e:
            raise APIError(503, str(e), code="queue_full") from None

    def cancel(self) -> None:
        if self.open:
            self.state.scheduler.cancel([self.jobs[i] for i in self.open])
            self.open.clear()

    async def events(self, request: Request | None = None):
        """(choice index, Delta | Done | Failed) until every choice has ended; with request, a client that went
        away cancels the rest (checked every 0.1 s; a stream's generator is cancelled by Starlette at once)."""
        checked = time.monotonic()
        while self.open:
            if request is None:  # a stream: Starlette cancels this generator when its client goes away
                index, event = await self.queue.get()
            else:
                try:
                    index, event = await asyncio.wait_for(self.queue.get(), timeout=0.1)
                except asyncio.TimeoutError:
                    index = event = None
                if time.monotonic() - checked >= 0.1:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        self.cancel()
                        return
                if event is None:
                    continue
            if isinstance(event, (Done, Failed)):
                self.open.discard(index)
            yield index, event


async def _constraint(state: ServerState, body, forced: str | None = None):
    """The grammar a request's rows follow (a Constraint), from response_format, grammar, or `forced` (a Lark
    grammar of a tool call); None when there is none. Compiled off the event loop: the first one compiles the
    tokenizer's vocabulary (cached), and a large schema takes milliseconds."""
    from nanogpt_cli.inference.grammar import Constraint, compile_grammar

    fmt, grammar = body.response_format, body.grammar
    if fmt is not None and fmt.type != "text" and grammar is not None:
        raise APIError(400, "give response_format or grammar, not both", param="grammar")
    if forced is not None and (grammar is not None or (fmt is not None and fmt.type != "text")):
        raise APIError(400, "a forced tool call cannot also follow response_format or grammar", param="tool_choice")
    if forced is not None:
        kind, value, param = "lark", forced, "tools"
    elif grammar is not None:
        spec = grammar if isinstance(grammar, GrammarSpec) else GrammarSpec(type="gbnf", value=grammar)
        kind, value, param = spec.type, spec.value, "grammar"
    elif fmt is not None and fmt.type == "json_object":
        kind, value, param = "json_schema", {"type": "object"}, "response_format"
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError(400, "response_format json_schema needs its json_schema object", param="response_format")
        schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {"type": "object"}
        kind, value, param = "json_schema", schema, "response_format.json_schema.schema"
    else:
        return None
    if body.ignore_eos:
        raise APIError(400, "ignore_eos cannot be combined with a grammar: the grammar decides the end", param=param)

    def build():
        return Constraint(state.tokenizer, compile_grammar(kind, value, state.tokenizer))

    seconds = state.limits.grammar_seconds
    try:  # a thread left behind by the time limit ends within llguidance's budgets (inference/grammar.py)
        return await asyncio.wait_for(asyncio.to_thread(build), seconds)
    except NanoGPTError as e:
        raise APIError(400, f"invalid {param}: {e}", param=param, code="invalid_grammar") from None
    except asyncio.TimeoutError:
        raise APIError(
            400,
            f"the {param} took longer than {seconds:g} s to compile; simplify it",
            param=param,
            code="invalid_grammar",
        ) from None


def _usage(prompts: list[list[int]], completion: int) -> dict[str, int]:
    prompt = sum(len(p) for p in prompts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _failure(event: Failed) -> APIError:
    return APIError(
        event.status if event.status in (400, 503) else 500,
        event.message,
        code="server_stopping" if event.status == 503 else None,
    )


async def _guarded(chunks):
    """A stream's chunks; a failure while making them (its text, its tool calls) ends this stream with an error
    event and [DONE], as a failed row does, and the connection stays usable."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as e:
        log.exception("a stream failed")
        yield _sse(APIError(500, f"the request failed while its reply was made: {e}").body())
        yield _sse("[DONE]")
    finally:
        await chunks.aclose()


def _sse(data: Any) -> bytes:
    return format_sse_event(data_str=data if isinstance(data, str) else json.dumps(data, ensure_ascii=False))


# --- /v1/completions ---------------------------------------------------------------------------------


async def _completions(state: ServerState, request: Request, body: CompletionRequest):
    body.check(state.limits.max_n)
    adapter = _check_model(state, body.model)
    prompts, texts = _completion_prompts(state, body.prompt)
    max_tokens = _max_tokens(state, body.max_tokens, 16, "max_tokens")
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    logs = [
        _CompletionLogprobs(state, body.logprobs) if body.logprobs is not None else None
        for _ in range(len(prompts) * body.n)
    ]
    if body.echo and body.logprobs is not None:
        for i, log_ in enumerate(logs):
            ids = prompts[i // body.n]
            scored = await asyncio.wrap_future(state.scheduler.call(lambda ids=ids: _score(state, ids, body, adapter)))
            log_.add_prompt(ids, scored)
    echo = [texts[i // body.n] if body.echo else "" for i in range(len(logs))]
    if max_tokens == 0:  # nothing to generate: the prompt's own logprobs, with echo
        choices = [
            {"index": i, "text": echo[i], "logprobs": logs[i] and logs[i].body(), "finish_reason": "length"}
            for i in range(len(logs))
        ]
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": state.model_names[adapter],
            "choices": choices,
            "usage": _usage(prompts, 0),
        }
    constraint = await _constraint(state, body)
    run = _Run(state, prompts, body, _params(body, body.logprobs), max_tokens, body.stops, adapter, constraint)
    run.submit()
    head = {"id": rid, "object": "text_completion", "created": created, "model": state.model_names[adapter]}
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return EventSourceResponse(_guarded(_completion_stream(run, head, prompts, echo, logs, include_usage)))
    return await _completion_whole(run, request, head, prompts, echo, logs)


def _score(state: ServerState, ids: list[int], body, adapter: int) -> list:
    """The prompt's own logprobs (echo), under the request's adapter; run in the engine's thread."""
    adapters = state.scheduler.engine.adapters
    if adapters is not None:
        adapters.select([adapter])
    return prompt_logprobs(state.model, ids, body.logprobs, state.tokenizer.vocab_size)


def _completion_prompts(state: ServerState, prompt) -> tuple[list[list[int]], list[str]]:
    """OpenAI's four prompt forms -> token ids and texts: a string, strings, token ids, lists of token ids."""
    if isinstance(prompt, str):
        return [_encode(state, prompt, "prompt")], [prompt]
    if all(isinstance(p, str) for p in prompt):
        return [_encode(state, p, "prompt") for p in prompt], list(prompt)
    lists = [prompt] if all(isinstance(p, int) for p in prompt) else prompt
    ids = [_check_length(state, list(p), "prompt") if p else _empty_prompt(state.tokenizer) for p in lists]
    return ids, [state.tokenizer.decode(p) for p in lists]


class _CompletionLogprobs:
    """The legacy completions logprobs object of one choice, built token by token."""

    def __init__(self, state: ServerState, top: int):
        self.tokenizer, self.top = state.tokenizer, top
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        self.offset = 0

    def _add(self, token: int, logprob: float | None, top: list | None) -> None:
        text = self.tokenizer.decode([token])
        self.tokens.append(text)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(None if top is None else {self.tokenizer.decode([i]): lp for i, lp in top})
        self.text_offset.append(self.offset)
        self.offset += len(text)

    def add_prompt(self, ids: list[int], scored: list) -> None:
        for token, s in zip(ids, scored):
            self._add(token, None if s is None else s[0], None if s is None else s[1])

    def add(self, steps) -> dict[str, list] | None:
        start = len(self.tokens)
        for t in steps:
            self._add(t.token, t.logprob, t.top_logprobs)
        return self.body(start)

    def body(self, start: int = 0) -> dict[str, list]:
        return {
            "tokens": self.tokens[start:],
            "token_logprobs": self.token_logprobs[start:],
            "top_logprobs": self.top_logprobs[start:],
            "text_offset": self.text_offset[start:],
        }


async def _completion_stream(run: _Run, head: dict, prompts, echo: list[str], logs: list, include_usage: bool):
    completion = 0
    try:
        for i, text in enumerate(echo):
            if text:
                lp = logs[i] and logs[i].body()
                yield _sse({**head, "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": None}]})
        async for i, event in run.events():
            if isinstance(event, Failed):
                yield _sse(_failure(event).body())
                run.cancel()
                break
            lp = logs[i] and logs[i].add(event.logprobs)
            done = isinstance(event, Done)
            completion += event.completion_tokens if done else 0
            choice = {
                "index": i,
                "text": event.text,
                "logprobs": lp,
                "finish_reason": event.finish_reason if done else None,
            }
            yield _sse({**head, "choices": [choice], **({"usage": None} if include_usage else {})})
        if include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(prompts, completion)})
        yield _sse("[DONE]")
    finally:
        run.cancel()  # a client that went away: its rows leave the batch


async def _completion_whole(run: _Run, request: Request, head: dict, prompts, echo: list[str], logs: list):
    texts, reasons, completion = list(echo), [None] * len(echo), 0
    try:
        async for i, event in run.events(request):
            if isinstance(event, Failed):
                raise _failure(event)
            texts[i] += event.text
            if logs[i] is not None:
                logs[i].add(event.logprobs)
            if isinstance(event, Done):
                reasons[i], completion = event.finish_reason, completion + event.completion_tokens
    finally:
        run.cancel()
    choices = [
        {"index": i, "text": texts[i], "logprobs": logs[i] and logs[i].body(), "finish_reason": reasons[i]}
        for i in range(len(texts))
    ]
    return {**head, "choices": choices, "usage": _usage(prompts, completion)}


# --- /v1/chat/completions ----------------------------------------------------------------------------


async def _chat(state: ServerState, request: Request, body: ChatRequest):
    body.check(state.limits.max_n)
    adapter = _check_model(state, body.model)
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise APIError(400, "give max_tokens or max_completion_tokens, not both", param="max_completion_tokens")
    tools = tool_calls.tool_dicts(body.tools)
    try:
        messages = tool_calls.template_messages(body.messages, state.template, tools)
        text = state.template.render(messages, tools=tools if state.template.takes_tools else None)
    except NanoGPTError as e:
        raise APIError(400, str(e), param="messages") from None
    ids = _chat_tokens(state, text)
    choice = body.tool_choice or ("auto" if tools else "none")
    named = None if isinstance(choice, str) else choice.function.name
    forced = tool_calls.call_grammar(tools, named) if choice == "required" or named else None
    constraint = await _constraint(state, body, forced)
    names = {t["function"]["name"] for t in tools} if choice != "none" else set()
    given, param = (
        (body.max_completion_tokens, "max_completion_tokens")
        if body.max_completion_tokens is not None
        else (body.max_tokens, "max_tokens")
    )
    max_tokens = _max_tokens(state, given, max(1, state.block_size - len(ids)), param)  # default: fill the context
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": state.model_names[adapter]}
    if max_tokens == 0:
        choices = [
            {"index": i, "message": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": "length"}
            for i in range(body.n)
        ]
        return {**head, "object": "chat.completion", "choices": choices, "usage": _usage([ids], 0)}
    stop = state.template.stop + body.stops
    run = _Run(state, [ids], body, _params(body, logprobs), max_tokens, stop, adapter, constraint)
    run.submit()
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        chunks = _chat_stream(run, {**head, "object": "chat.completion.chunk"}, ids, include_usage, names)
        return EventSourceResponse(_guarded(chunks))
    return await _chat_whole(run, request, {**head, "object": "chat.completion"}, ids, names)


def _chat_tokens(state: ServerState, text: str) -> list[int]:
    """The rendered template's tokens; its end-of-text markers become the end-of-text token, as transformers
    encodes a template's special tokens."""
    eot, tokenizer = state.tokenizer.eot_id, state.tokenizer
    marker = state.template.special.get("eos_token") if eot is not None else None
    if getattr(tokenizer, "kind", None) == "hf":  # every added token the template writes is its id
        return _check_length(state, tokenizer.encode_special(text) or _empty_prompt(tokenizer), "messages")
    if not marker:
        return _encode(state, text, "messages")
    ids: list[int] = []
    for k, part in enumerate(text.split(marker)):
        if k:
            ids.append(eot)
        try:
            ids += tokenizer.encode(part) if part else []
        except NanoGPTError as e:
            raise APIError(400, str(e), param="messages") from None
    return _check_length(state, ids or _empty_prompt(tokenizer), "messages")


def _chat_logprobs(state: ServerState, steps) -> list[dict] | None:
    def entry(token: int, logprob: float) -> dict:
        text = state.tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(state.tokenizer.decode_bytes([token]))}

    return [
        {**entry(t.token, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top_logprobs or []]} for t in steps
    ]


async def _chat_stream(run: _Run, head: dict, ids: list[int], include_usage: bool, names: set[str]):
    """Chunks of every choice; with tools, text that is a tool call arrives as tool_calls deltas instead."""
    completion, state = 0, run.state
    extra = {"usage": None} if include_usage else {}
    parsers = [tool_calls.ToolCallText(names) if names else None for _ in run.jobs]
    try:
        for i in range(len(run.jobs)):  # the first chunk of each choice names the role
            delta = {"role": "assistant", "content": ""}
            yield _sse(
                {**head, "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}], **extra}
            )
        async for i, event in run.events():
            if isinstance(event, Failed):
                yield _sse(_failure(event).body())
                run.cancel()
                break
            done = isinstance(event, Done)
            completion += event.completion_tokens if done else 0
            wants = run.jobs[i].params.logprobs is not None
            lp = {"content": _chat_logprobs(state, event.logprobs)} if wants else None
            text, reason = event.text, event.finish_reason if done else None
            parser = parsers[i]
            if parser is not None:
                before = len(parser.calls)
                text, calls = parser.feed(text)
                text += parser.finish() if done else ""
                for k, call in enumerate(calls, start=before):
                    for delta in _call_deltas(k, call):
                        yield _sse({**head, "choices": [_chunk(i, {"tool_calls": [delta]})], **extra})
                if done and parser.calls and reason == "stop":
                    reason = "tool_calls"
            delta = {"content": text} if text or not done else {}
            choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}
            yield _sse({**head, "choices": [choice], **extra})
        if include_usage:
            yield _sse({**head, "choices": [], "usage": _usage([ids], completion)})
        yield _sse("[DONE]")
    finally:
        run.cancel()


def _chunk(index: int, delta: dict) -> dict:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}


def _call_deltas(index: int, call: dict) -> list[dict]:
    """One tool call as OpenAI streams it: its id and name with empty arguments, then the arguments."""
    name, arguments = call["function"]["name"], call["function"]["arguments"]
    head = {"index": index, "id": call["id"], "type": "function", "function": {"name": name, "arguments": ""}}
    return [head, {"index": index, "function": {"arguments": arguments}}]


async def _chat_whole(run: _Run, request: Request, head: dict, ids: list[int], names: set[str]):
    n = len(run.jobs)
    texts, reasons, logs, completion = [""] * n, [None] * n, [[] for _ in range(n)], 0
    try:
        async for i, event in run.events(request):
            if isinstance(event, Failed):
                raise _failure(event)
            texts[i] += event.text
            logs[i] += event.logprobs
            if isinstance(event, Done):
                reasons[i], completion = event.finish_reason, completion + event.completion_tokens
    finally:
        run.cancel()
    with_logprobs = run.jobs[0].params.logprobs is not None
    choices = []
    for i in range(n):
        message: dict[str, Any] = {"role": "assistant", "content": texts[i]}
        if names:
            parser = tool_calls.ToolCallText(names)
            content, calls = parser.feed(texts[i])
            content += parser.finish()
            if calls:
                message = {"role": "assistant", "content": content if content.strip() else None, "tool_calls": calls}
                reasons[i] = "tool_calls" if reasons[i] == "stop" else reasons[i]
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": {"content": _chat_logprobs(run.state, logs[i])} if with_logprobs else None,
                "finish_reason": reasons[i],
            }
        )
    return {**head, "choices": choices, "usage": _usage([ids], completion)}
