"""`nanogpt serve` under hostile input: a request that fails (its grammar, its text) ends alone and a stream beside
it gets the text it gets alone; text no tokenizer can take is a 400 on a connection that stays usable; the server
answers only its own host names, JSON sent as JSON, and origins it was told. A byte-vocabulary model on 127.0.0.1
(port 0): its grammars compile in a fraction of a second. Every wait is bounded."""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest
import torch

openai = pytest.importorskip("openai", reason="the serve tests need the openai package (the dev extra)")
pytest.importorskip("fastapi", reason="nanogpt serve needs the serve extra")
pytest.importorskip("llguidance", reason="structured output needs llguidance (the serve extra)")

from test_serve import Live  # noqa: E402

from nanogpt_cli.config import GPTConfig, LoadSpec  # noqa: E402
from nanogpt_cli.errors import NanoGPTError  # noqa: E402
from nanogpt_cli.inference.engine import Engine, SamplingParams  # noqa: E402
from nanogpt_cli.inference.grammar import Constraint, compile_grammar  # noqa: E402
from nanogpt_cli.model import GPT  # noqa: E402
from nanogpt_cli.runs import checkpoint as ckpt  # noqa: E402
from nanogpt_cli.serve import ServeOptions  # noqa: E402
from nanogpt_cli.serve.tools import ToolCallText, parse_call  # noqa: E402
from nanogpt_cli.tokenizer import ByteTokenizer  # noqa: E402

KEY = "sk-hostile"
EXPLODES = "(a{1000}){1000}"  # compiles, then its lexer runs out of budget at the first token


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.manual_seed(0)
    tok = ByteTokenizer()
    # context 8,192: the tools' prompt alone is ~700 bytes, and a stream beside a failing request must outlast it on
    # busy cores (a grammar's compile can take seconds there)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=8192, n_layer=1, n_head=2, n_embd=32))
    path = tmp_path_factory.mktemp("hostile") / "tiny.safetensors"
    ckpt.save_model(path, model, {"tokenizer": tok.describe(), "step": 0})
    return path


@pytest.fixture(scope="module")
def live(model_path):
    server = Live(
        ServeOptions(
            LoadSpec(str(model_path), device="cpu", dtype="float32"),
            port=0,
            max_batch=4,
            max_tokens=8000,
            api_key=KEY,
            allow_hosts=["nanogpt.test"],
            cors_origins=["http://localhost:3000"],
        )
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _stream(client, max_tokens: int):
    return client.completions.create(
        model="tiny", prompt="The stream", max_tokens=max_tokens, temperature=0, stream=True
    )


def _beside(client, failing, live, streams: int = 1, length: int = 300) -> tuple[str, list[str], object]:
    """The stream's first `length` tokens of text alone, and the text of `streams` streams of the same prompt
    that go on far longer, so that `failing()` runs from start to end while they decode (then they are closed),
    and what failing raised. Compare with `same`."""
    alone = "".join(c.choices[0].text for c in _stream(client, length))
    running = [_stream(client, 8000) for _ in range(streams)]
    texts = [next(iter(s)).choices[0].text for s in running]  # each is decoding now
    try:
        failing()
        raised = None
    except openai.APIError as e:
        raised = e
    assert live.health()["active_rows"] == streams, "a stream ended before the failing request did"
    for i, s in enumerate(running):
        for chunk in s:
            texts[i] += chunk.choices[0].text
            if len(texts[i]) > len(alone):
                break
        s.close()  # its row leaves the batch
    return alone, texts, raised


def same(alone: str, beside: str) -> bool:
    """The text alone is where the longer stream's starts (but for a last character that the cut after `length`
    tokens may have left incomplete)."""
    return beside.startswith(alone[:-1])


def test_a_grammar_that_fails_mid_decode_ends_its_request_with_a_400_alone(client, live):
    # the reported case: this regex compiles, then fails at its first token; the other rows went with it
    alone, (beside,), e = _beside(
        client,
        lambda: client.completions.create(
            model="tiny", prompt="a", max_tokens=20, extra_body={"grammar": {"type": "regex", "value": EXPLODES}}
        ),
        live,
    )
    assert isinstance(e, openai.BadRequestError) and "grammar failed" in e.message, e
    assert "\n" not in e.message  # one line: no parser state
    assert same(alone, beside)
    # streamed, it is an error event (which the openai package raises), and the server goes on
    stream = client.completions.create(
        model="tiny",
        prompt="a",
        max_tokens=20,
        stream=True,
        extra_body={"grammar": {"type": "regex", "value": EXPLODES}},
    )
    with pytest.raises(openai.APIError, match="grammar failed"):
        list(stream)
    assert live.health()["active_rows"] == 0


def test_a_grammar_past_the_compile_time_limit_is_a_400_and_the_stream_goes_on(client, live):
    limits = live.server.state.limits
    saved, limits.grammar_seconds = limits.grammar_seconds, 0.001
    try:
        alone, (beside,), e = _beside(
            client,
            lambda: client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "x"}],
                max_tokens=5,
                extra_body={"grammar": {"type": "regex", "value": "(a{300}){300}"}},
            ),
            live,
        )
    finally:
        limits.grammar_seconds = saved
    assert isinstance(e, openai.BadRequestError) and "took longer than" in e.message and e.body["param"] == "grammar"
    assert same(alone, beside)


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "\udfff"]}, "prompt[1]"),
        ("/v1/completions", {"prompt": "a", "model": "tiny\ud800"}, "model"),
        ("/v1/completions", {"prompt": "a", "stop": ["\ud800"]}, "stop[0]"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud83d"}]}, "messages[0].content"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "\ud800": 1}]}, "messages[0]"),
    ],
)
def test_a_lone_surrogate_anywhere_is_a_400_and_the_connection_stays_usable(live, route, body, param):
    host, port = live.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    try:
        conn.request("POST", route, json.dumps({"max_tokens": 2, **body}), headers)  # \ud800 escaped, as JSON allows
        response = conn.getresponse()
        error = json.loads(response.read())["error"]
        assert response.status == 400 and error["type"] == "invalid_request_error" and error["param"] == param
        assert "surrogate" in error["message"]
        sock = conn.sock
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "a", "max_tokens": 2}), headers)
        response = conn.getresponse()
        assert response.status == 200 and len(json.loads(response.read())["choices"]) == 1
        assert conn.sock is sock  # the same connection answered
    finally:
        conn.close()


def _post(live, route: str, body: dict) -> int:
    """A raw POST: the openai package cannot send a lone surrogate (it writes UTF-8), a browser's JSON.stringify
    sends one escaped, as here."""
    host, port = live.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        conn.request("POST", route, json.dumps(body), headers)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_a_surrogate_request_beside_a_stream_leaves_it_alone(client, live):
    status = []
    body = {"messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 5}
    alone, (beside,), _ = _beside(client, lambda: status.append(_post(live, "/v1/chat/completions", body)), live)
    assert status == [400] and same(alone, beside)


def test_a_stop_text_too_long_to_check_each_token_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="a", max_tokens=2, stop=["ab" * 501])
    assert e.value.body["param"] == "stop" and "1,000 characters" in e.value.body["message"]


@pytest.mark.slow
def test_a_tool_call_nested_too_deeply_to_parse_stays_text_beside_a_stream(client, live):
    # json's decoder gives up at the interpreter's recursion limit (1,000): the block is text, not a failure
    deep = "[" * 1100
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    replies = []

    def failing():
        replies.append(
            client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "x"}],
                tools=[tool],
                max_tokens=1200,
                extra_body={"grammar": {"type": "regex", "value": rf"<tool_call>\[{{{len(deep)}}}</tool_call>"}},
            )
        )

    alone, (beside,), e = _beside(client, failing, live)
    assert e is None and same(alone, beside)
    message = replies[0].choices[0].message
    assert message.tool_calls is None and message.content == f"<tool_call>{deep}</tool_call>"


def test_a_tool_call_too_deeply_nested_to_parse_stays_text():
    deep = '{"name": "f", "arguments": ' + "[" * 5000 + "]" * 5000 + "}"
    assert parse_call(deep, {"f"}) is None
    parser = ToolCallText({"f"})
    content, calls = parser.feed(f"<tool_call>{deep}</tool_call>")
    assert calls == [] and content == f"<tool_call>{deep}</tool_call>"


def test_an_engine_row_whose_grammar_fails_ends_alone_and_the_others_tokens_are_unchanged(model_path):
    from nanogpt_cli.interop.loading import load_for_inference

    loaded = load_for_inference(str(model_path), device="cpu", dtype="float32")
    tok, greedy = loaded.tokenizer, SamplingParams(temperature=0.0)

    def tokens(with_failing: bool) -> tuple[list[int], list]:
        engine = Engine(loaded.model, max_batch=2, vocab_size=tok.vocab_size)
        row = engine.add(tok.encode("The stream"), greedy, 30)
        if with_failing:
            engine.add(tok.encode("a"), greedy, 30, mask=Constraint(tok, compile_grammar("regex", EXPLODES, tok)))
        steps = list(engine.run())
        return [t.token for t in steps if t.row == row], [t for t in steps if t.row != row]

    alone, _ = tokens(False)
    beside, failed = tokens(True)
    assert beside == alone and len(alone) == 30
    assert [t.finish for t in failed] == ["error"] and "too many expressions" in failed[0].error


# --- a local server is local ----------------------------------------------------------------------------------


def _raw(live, method: str, path: str, headers: dict, body: bytes | None = None):
    host, port = live.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders(body)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def test_only_the_servers_own_host_names_are_answered(live):
    port = live.url.rsplit(":", 1)[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "LOCALHOST", f"nanogpt.test:{port}"):
        status, _, raw = _raw(live, "GET", "/health", {"Host": host})
        assert status == 200, (host, raw)
    for host in (f"evil.example:{port}", "127.0.0.1.nip.io", f"192.168.1.5:{port}"):  # a rebinding page's names
        status, _, raw = _raw(live, "GET", "/v1/models", {"Host": host, "Authorization": f"Bearer {KEY}"})
        error = json.loads(raw)["error"]
        assert status == 400 and error["code"] == "invalid_host" and "--allow-host" in error["message"], host


def test_a_body_not_sent_as_json_is_415(live):
    body = json.dumps({"prompt": "a", "max_tokens": 1}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"Host": "127.0.0.1", "Authorization": f"Bearer {KEY}"}
        if content_type:
            headers["Content-Type"] = content_type
        status, _, raw = _raw(live, "POST", "/v1/completions", {**headers, "Content-Length": str(len(body))}, body)
        assert status == 415 and json.loads(raw)["error"]["code"] == "unsupported_media_type", content_type
    headers = {"Host": "127.0.0.1", "Authorization": f"Bearer {KEY}", "Content-Type": "application/json; charset=utf-8"}
    status, _, _ = _raw(live, "POST", "/v1/completions", {**headers, "Content-Length": str(len(body))}, body)
    assert status == 200


def test_cors_answers_only_the_origins_given(live, model_path):
    preflight = {
        "Host": "127.0.0.1",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    status, headers, _ = _raw(live, "OPTIONS", "/v1/chat/completions", {**preflight, "Origin": "http://localhost:3000"})
    assert status == 200 and headers.get("access-control-allow-origin") == "http://localhost:3000"
    status, headers, _ = _raw(live, "OPTIONS", "/v1/chat/completions", {**preflight, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in {k.lower() for k in headers}
    plain = Live(ServeOptions(LoadSpec(str(model_path), device="cpu", dtype="float32"), port=0))  # the default: off
    try:
        status, headers, _ = _raw(plain, "GET", "/health", {"Host": "127.0.0.1", "Origin": "http://localhost:3000"})
        assert status == 200 and "access-control-allow-origin" not in {k.lower() for k in headers}
    finally:
        plain.stop()


def test_the_key_is_checked_whatever_bytes_are_sent(live):
    for given in (f"Bearer {KEY[:-1]}", f"Bearer {KEY}x", "Bearer \xe9\xe9", "Bearer "):
        status, _, raw = _raw(live, "GET", "/v1/models", {"Host": "127.0.0.1", "Authorization": given})
        assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key", given
    status, _, _ = _raw(live, "GET", "/v1/models", {"Host": "127.0.0.1", "Authorization": f"Bearer {KEY}"})
    assert status == 200


def test_a_bad_cors_origin_is_one_clear_error(tmp_path):
    from typer.testing import CliRunner

    from nanogpt_cli.cli import app

    out = CliRunner().invoke(app, ["serve", str(tmp_path / "m.safetensors"), "--cors-origin", "localhost:3000"])
    assert out.exit_code == 1 and "error: --cors-origin takes an origin such as http://localhost:3000" in out.output


def test_streams_keep_their_text_while_many_requests_fail_beside_them(client, live):
    """Requests of every failing kind at once, beside two streams."""
    failing = [
        {"prompt": "a", "grammar": {"type": "regex", "value": EXPLODES}},
        {"prompt": "\ud800"},
        {"prompt": "a", "stop": ["\udc00"]},
        {"prompt": "a", "model": "tiny\ud800"},
    ]
    errors: list = []

    def run(body):
        errors.append(_post(live, "/v1/completions", {**body, "max_tokens": 9}))

    def all_at_once():
        threads = [threading.Thread(target=run, args=(body,), daemon=True) for body in failing]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))

    alone, texts, _ = _beside(client, all_at_once, live, streams=2)
    assert sorted(errors) == [400] * 4
    assert all(same(alone, text) for text in texts)
    assert _idle(live)  # the closed streams have left the batch


def _idle(live) -> bool:
    deadline = time.monotonic() + 20
    while live.health()["active_rows"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return live.health()["active_rows"] == 0


def test_grammars_given_up_on_do_not_make_the_next_request_past_its_time_limit(client, live):
    """A compile the time limit gave up on goes on in its thread for a while: many at once must not make an easy
    grammar that waits behind them a 400 of its own (its limit counts from its own start)."""
    limits = live.server.state.limits
    saved, limits.grammar_seconds = limits.grammar_seconds, 0.1
    statuses: list = []

    def slow():
        body = {"prompt": "a", "max_tokens": 1, "grammar": {"type": "regex", "value": "(a{1500}){1500}"}}
        statuses.append(_post(live, "/v1/completions", body))

    threads = [threading.Thread(target=slow, daemon=True) for _ in range(16)]
    try:
        for t in threads:
            t.start()
        time.sleep(0.2)  # most are compiling or waiting for a thread now
        easy = client.completions.create(
            model="tiny", prompt="a", max_tokens=2, extra_body={"grammar": {"type": "regex", "value": "ab"}}
        )
        assert easy.choices[0].text == "ab"
        deadline = time.monotonic() + 60
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
    finally:
        limits.grammar_seconds = saved
    assert len(statuses) == 16 and set(statuses) <= {200, 400}


@pytest.mark.parametrize("name", ["myhost:8000", "http://myhost", "[::1]:8000", ""])
def test_an_allow_host_with_a_port_or_scheme_is_one_clear_error(tmp_path, name):
    # the Host header's port is taken off before the names are compared: such a name could never match
    with pytest.raises(NanoGPTError, match="--allow-host takes a host name or address without a scheme or port"):
        ServeOptions(LoadSpec(str(tmp_path / "m.safetensors")), allow_hosts=[name])
    for fine in ("myhost.lan", "192.168.1.5", "fe80::1", "[fe80::1]", "*"):
        ServeOptions(LoadSpec(str(tmp_path / "m.safetensors")), allow_hosts=[fine])
