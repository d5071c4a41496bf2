"""A property-based fuzz of `nanogpt serve`'s whole HTTP surface: hypothesis makes request bodies for every route
(JSON of the wrong types, huge and negative numbers, unknown fields, bad schemas, grammars, tools and messages, and
bodies that are not JSON at all), sent with http.client to a live random-weight server on 127.0.0.1 (port 0).
Every answer is a 2xx or a 4xx in OpenAI's error shape, never a 5xx, and the server still answers /health after.
Bounded: a fixed number of derandomized examples per route, a server limit of 4 tokens a choice (40 for forced
tool calls), 30 s a request."""

from __future__ import annotations

import http.client
import json

import pytest
import torch

pytest.importorskip("fastapi", reason="nanogpt serve needs the serve extra")
pytest.importorskip("llguidance", reason="structured output needs llguidance (the serve extra)")
hypothesis = pytest.importorskip("hypothesis", reason="the fuzz needs hypothesis (the dev extra)")

from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_serve import Live, get_json  # noqa: E402

from nanogpt_cli.config import GPTConfig, LoadSpec  # noqa: E402
from nanogpt_cli.model import GPT  # noqa: E402
from nanogpt_cli.runs import checkpoint as ckpt  # noqa: E402
from nanogpt_cli.serve import ServeOptions  # noqa: E402
from nanogpt_cli.tokenizer import build_tokenizer  # noqa: E402

MODEL = "fuzz"
FUZZ = settings(
    max_examples=200,
    deadline=None,  # each request is bounded by the client's 30 s timeout instead: a busy machine is not a failure
    derandomize=True,  # the same examples on every run, so CI never meets a new one by chance
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """A random-weights model on the gpt2 tokenizer, context 512 (the default tool prompt alone is ~270 tokens)."""
    torch.manual_seed(0)
    tok = build_tokenizer("gpt2")
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=512, n_layer=1, n_head=2, n_embd=16))
    path = tmp_path_factory.mktemp("fuzz") / f"{MODEL}.safetensors"
    ckpt.save_model(path, model, {"tokenizer": tok.describe(), "step": 0})
    return path


@pytest.fixture(scope="module")
def live(model_path):
    options = ServeOptions(
        LoadSpec(str(model_path), device="cpu", dtype="float32"),
        port=0,
        max_batch=4,
        max_tokens=4,
        max_n=2,
        max_body=20_000,
    )
    server = Live(options)
    yield server
    assert server.health()["status"] == "ok"
    server.stop()


def send(live, method: str, path: str, body: bytes | None = None, content_type: str = "application/json"):
    """One raw request: (status, content-type, body bytes); a hang is the 30 s timeout's error."""
    host, port = live.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": content_type} if body is not None else {})
        response = conn.getresponse()
        return response.status, response.getheader("content-type") or "", response.read()
    finally:
        conn.close()


def check(status: int, content_type: str, raw: bytes) -> None:
    """2xx, or 4xx in OpenAI's error shape; a stream's events carry no server error either."""
    event(f"status {status}")  # pytest --hypothesis-show-statistics: how many of each
    assert 200 <= status < 300 or 400 <= status < 500, (status, raw[:500])
    if status >= 400:
        error = json.loads(raw)["error"]
        assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str), raw[:500]
        assert error["type"] in ("invalid_request_error", "authentication_error"), raw[:500]
    elif content_type.startswith("text/event-stream"):
        lines = [line for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" or '"error"' in lines[-1], raw[-500:]
        assert not any('"server_error"' in line for line in lines), raw[-500:]
    elif content_type.startswith("application/json"):
        json.loads(raw)


# --- the values a field may take: valid ones, the wrong type, out of range ------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
HUGE = st.sampled_from([2**31, 2**63, 2**64, 2**70, -(2**63) - 1, -(2**70), 10**30, 1e308, -1e308, 1e-320])
INT = st.integers(-3, 6) | HUGE | JSON
FLOAT = st.floats(-2, 3) | HUGE | JSON
TEXT = st.text(max_size=20) | JSON
SCHEMAS_THAT_COMPILE = [
    {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]},
    {"type": "object"},
]
SCHEMAS = st.sampled_from(
    [
        *SCHEMAS_THAT_COMPILE,
        {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
        {"type": "string", "maxLength": 3},
        {"type": "objectt"},
        {"type": "string", "minLength": 5, "maxLength": 2},
        {"$ref": "#/definitions/nope"},
        {"enum": []},
        {"type": "integer", "minimum": 10, "maximum": 1},
        {"pattern": "[", "type": "string"},
        {"not": {}},
        {"allOf": [{"type": "string"}, {"type": "integer"}]},
    ]
) | st.dictionaries(st.sampled_from(["type", "properties", "items", "enum", "required"]), JSON, max_size=3)
RESPONSE_FORMAT = (
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])})
    | st.fixed_dictionaries(
        {"type": st.just("json_schema")},
        optional={
            "json_schema": st.fixed_dictionaries(
                {}, optional={"name": TEXT, "schema": SCHEMAS | JSON, "strict": st.booleans() | JSON, "bogus": JSON}
            )
            | JSON
        },
    )
    | JSON
)
GRAMMARS = st.sampled_from(
    ['root ::= "a" | "b"', "root ::= (", 'root ::= [0-9]{1,3} "."', 'start: "x"', "", " ", 'root ::= "\\x00"', "root"]
)
GRAMMAR = (
    GRAMMARS
    | st.text(max_size=30)
    | st.fixed_dictionaries(
        {
            "type": st.sampled_from(["gbnf", "lark", "regex", "ebnf"]),
            "value": GRAMMARS
            | st.sampled_from(["[a-", "a{2,1}", "(a|b)+c", "x*", "\\", "[^\\x00-\\U0010FFFF]"])
            | JSON,
        }
    )
    | JSON
)
STOP = TEXT | st.lists(st.text(max_size=4), max_size=20)
COMMON = {
    "model": st.sampled_from([MODEL, "", "gpt-4o", "nope"]) | JSON,
    "max_tokens": INT,
    "temperature": FLOAT,
    "top_p": FLOAT,
    "top_k": INT,
    "min_p": FLOAT,
    "repetition_penalty": FLOAT,
    "frequency_penalty": FLOAT,
    "presence_penalty": FLOAT,
    "n": INT,
    "seed": INT,
    "stream": st.booleans() | JSON,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | JSON}) | JSON,
    "stop": STOP,
    "user": TEXT,
    "ignore_eos": st.booleans() | JSON,
    "cache_prompt": st.booleans() | JSON,
    "response_format": RESPONSE_FORMAT,
    "grammar": GRAMMAR,
    "logit_bias": JSON,
    "bogus_field": JSON,
}
PROMPT = (
    st.text(max_size=40)
    | st.lists(st.text(max_size=10), max_size=3)
    | st.lists(st.integers(-5, 60_000) | HUGE, max_size=8)
    | st.lists(st.lists(st.integers(0, 50_300), max_size=5), max_size=3)
    | st.just("word " * 600)  # past the context of 512
    | st.lists(st.just("a"), min_size=30, max_size=40)  # with n 2: more choices than the queue of 64 holds
    | JSON
)
COMPLETION = {
    **COMMON,
    "prompt": PROMPT,
    "logprobs": INT,
    "echo": st.booleans() | JSON,
    "suffix": TEXT,
    "best_of": INT,
}
CONTENT = st.text(max_size=30) | st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": TEXT}) | JSON, max_size=2
)
FUNCTION = st.fixed_dictionaries({"name": st.sampled_from(["get_weather", "f"]) | TEXT}, optional={"arguments": TEXT})
CALL = st.fixed_dictionaries({"function": FUNCTION}, optional={"id": TEXT, "type": st.sampled_from(["function", "x"])})
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer", "tool", "robot"]) | JSON},
    optional={
        "content": CONTENT | JSON,
        "name": TEXT,
        "tool_calls": st.lists(CALL, max_size=2) | JSON,
        "tool_call_id": TEXT,
    },
)
TOOL = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["function", "code_interpreter"]),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["get_weather", "f", "", 'a"b\\']) | TEXT},
            optional={"description": TEXT, "parameters": SCHEMAS | JSON, "strict": st.booleans()},
        )
        | JSON,
    }
)
TOOL_CHOICE = (
    st.sampled_from(["none", "auto", "required", "any"])
    | st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries({"name": st.sampled_from(["get_weather", "x"])}),
        }
    )
    | JSON
)
CHAT = {
    **COMMON,
    "messages": st.lists(MESSAGE, max_size=3) | JSON,
    "max_completion_tokens": INT,
    "logprobs": st.booleans() | JSON,
    "top_logprobs": INT,
    "tools": st.lists(TOOL, max_size=2) | JSON,
    "tool_choice": TOOL_CHOICE,
    "parallel_tool_calls": st.booleans() | JSON,
}


# values the server takes, so that a good share of the requests get as far as the engine and its grammars
SANE = {
    "model": st.sampled_from([MODEL, ""]),
    "max_tokens": st.integers(0, 4),
    "temperature": st.sampled_from([0, 0.7, 1, 2.5]),
    "top_p": st.sampled_from([1e-6, 0.5, 1]),
    "top_k": st.integers(0, 60_000),
    "min_p": st.sampled_from([0, 0.5, 0.99]),
    "repetition_penalty": st.sampled_from([1e-6, 1, 1.3, 1e6]),
    "n": st.integers(1, 2),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stream": st.booleans(),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "ignore_eos": st.booleans(),
    "cache_prompt": st.booleans(),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}])
    | st.fixed_dictionaries(
        {"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries({"schema": SCHEMAS})}
    ),
    "grammar": GRAMMARS,
    "prompt": st.text(max_size=20) | st.lists(st.integers(0, 50_256), min_size=1, max_size=6),
    "logprobs": st.integers(0, 3),
    "echo": st.booleans(),
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=20)}
        ),
        min_size=1,
        max_size=2,
    ),
    "tools": st.lists(
        st.fixed_dictionaries(
            {
                "type": st.just("function"),
                "function": st.fixed_dictionaries(
                    {"name": st.sampled_from(["get_weather", "f"]), "parameters": SCHEMAS}
                ),
            }
        ),
        min_size=1,
        max_size=2,
        unique_by=lambda t: t["function"]["name"],
    ),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]),
}


def bodies(fields: dict, required: str, **sane_here):
    """Objects that usually hold the required field and a few others; sometimes only junk; often sane values."""
    some = st.fixed_dictionaries(
        {required: fields[required]}, optional={k: v for k, v in fields.items() if k != required}
    )
    anything = st.fixed_dictionaries({}, optional=fields)
    sane = st.fixed_dictionaries(
        {required: SANE[required]},
        optional={k: v for k, v in {**SANE, **sane_here}.items() if k in fields and k != required},
    )
    return (some | anything | sane | sane).map(lambda d: json.dumps(d).encode())


NOT_JSON = st.sampled_from(
    [b"", b"{", b"{not json", b"\xff\xfe\x00", b"null", b"[]", b'"text"', b"1e999", b"NaN", b"[" * 5000, b"{}" * 3]
) | st.binary(max_size=64)
TOO_DEEP = st.integers(100, 15_000).map(lambda k: (b'{"prompt":' * k) + b"1" + b"}" * k)
RAW = NOT_JSON | TOO_DEEP | st.just(b'{"prompt": "x", "max_tokens": 1, "pad": "' + b"y" * 30_000 + b'"}')


@pytest.mark.slow
@FUZZ
@given(body=bodies(COMPLETION, "prompt"))
def test_completions_answer_every_body_with_2xx_or_a_4xx_error(live, body):
    check(*send(live, "POST", "/v1/completions", body))


@pytest.mark.slow
@FUZZ
@given(body=bodies(CHAT, "messages", logprobs=st.booleans()))
def test_chat_completions_answer_every_body_with_2xx_or_a_4xx_error(live, body):
    check(*send(live, "POST", "/v1/chat/completions", body))


@pytest.mark.slow
@settings(FUZZ, max_examples=150)
@given(
    route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    body=RAW,
    content_type=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", ""]),
)
def test_bodies_that_are_not_json_objects_or_not_sent_as_json_are_4xx(live, route, body, content_type):
    check(*send(live, "POST", route, body, content_type))


@pytest.mark.slow
@settings(FUZZ, max_examples=150)
@given(
    route=st.sampled_from(["/health", "/metrics", "/v1/models", "/", "/v1/models/fuzz", "/v1/embeddings", "/x"]),
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS"]),
    query=st.sampled_from(["", "?a=1", "?model=x&stream=true", "?%ff"]),
    body=st.none() | NOT_JSON | bodies(COMPLETION, "prompt"),
)
def test_every_other_route_and_method_answers_2xx_or_a_4xx_error(live, route, method, query, body):
    status, content_type, raw = send(live, method, route + query, body)
    if method == "HEAD":  # no body to read an error from
        event(f"status {status}")
        assert status < 500
        return
    check(status, content_type, raw)


VALID_TOOL = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["get_weather", "f"]), "parameters": st.sampled_from(SCHEMAS_THAT_COMPILE)}
        ),
    }
)
FORCED = st.fixed_dictionaries(
    {
        "messages": SANE["messages"],
        "tools": st.lists(VALID_TOOL, min_size=1, max_size=2, unique_by=lambda t: t["function"]["name"]),
        "tool_choice": st.just("required"),
        "max_tokens": st.just(40),
        "stream": st.booleans(),
        "seed": st.integers(0, 2**16),
    }
)


@pytest.fixture(scope="module")
def roomy(model_path):
    """The same model with room for a whole tool call (40 tokens a choice)."""
    options = ServeOptions(LoadSpec(str(model_path), device="cpu", dtype="float32"), port=0, max_batch=4, max_tokens=40)
    server = Live(options)
    yield server
    server.stop()


@pytest.mark.slow
@settings(FUZZ, max_examples=30)
@given(body=FORCED)
def test_forced_tool_calls_of_generated_tools_are_2xx_with_json_arguments(roomy, body):
    status, content_type, raw = send(roomy, "POST", "/v1/chat/completions", json.dumps(body).encode())
    check(status, content_type, raw)
    if status == 200 and not body["stream"]:
        choice = json.loads(raw)["choices"][0]
        event(f"finish_reason {choice['finish_reason']}")
        if choice["finish_reason"] == "tool_calls":
            call = choice["message"]["tool_calls"][0]["function"]
            assert call["name"] in {t["function"]["name"] for t in body["tools"]}
            json.loads(call["arguments"])


@pytest.mark.slow
def test_the_server_is_alive_after_the_fuzz(live):
    status, health = get_json(live.url, "/health")
    assert status == 200 and health["status"] == "ok" and health["active_rows"] == 0


# --- what the fuzz found, kept as plain tests ---------------------------------------------------------------


def post(live, route: str, body: dict) -> tuple[int, dict]:
    status, _, raw = send(live, "POST", route, json.dumps(body).encode())
    return status, json.loads(raw)


def test_json_nested_past_the_decoders_depth_is_400_not_500(live):
    body = b"[" * 3000  # 3 kB, far under the body limit
    status, _, raw = send(live, "POST", "/v1/completions", body)
    assert status == 400 and "nested too deeply" in json.loads(raw)["error"]["message"]


def test_a_seed_past_64_bits_is_400_and_the_engine_thread_lives_on(live):
    for seed in (2**64, -(2**63) - 1):  # torch's generator refused these inside the engine thread, which died
        status, body = post(live, "/v1/completions", {"prompt": "x", "max_tokens": 2, "seed": seed})
        assert status == 400 and body["error"]["param"] == "seed"
    status, body = post(live, "/v1/completions", {"prompt": "x", "max_tokens": 2, "seed": 2**63 - 1, "n": 2})
    assert status == 200 and len(body["choices"]) == 2


@pytest.mark.parametrize("name", ["temperature", "top_p", "repetition_penalty"])
def test_a_sampling_value_too_small_for_float32_is_400_not_a_failed_row(live, name):
    status, body = post(live, "/v1/completions", {"prompt": "x", "max_tokens": 2, name: 1e-320})
    assert status == 400 and body["error"]["param"] == name, body


def test_more_choices_than_the_queue_holds_is_400_not_503(live):
    status, body = post(live, "/v1/completions", {"prompt": ["a"] * 33, "max_tokens": 1, "n": 2})  # 66 > 64
    assert status == 400 and "queue of 64" in body["error"]["message"]


def test_a_completion_without_max_tokens_takes_the_servers_lower_limit(live):
    status, body = post(live, "/v1/completions", {"prompt": "x", "temperature": 0})  # OpenAI's default 16 > 4
    assert status == 200 and body["usage"]["completion_tokens"] <= 4
