"""Structured output and tool calls through `nanogpt serve`: the openai client against a live server on 127.0.0.1
(port 0), a random-weight model whose every reply must still follow the schema, grammar or tool it is given.
Every wait is bounded."""

from __future__ import annotations

import json
import re
from typing import Literal

import pytest
import torch

openai = pytest.importorskip("openai", reason="the serve tests need the openai package (the dev extra)")
pytest.importorskip("fastapi", reason="nanogpt serve needs the serve extra")
pytest.importorskip("llguidance", reason="structured output needs llguidance (the serve extra)")
jsonschema = pytest.importorskip("jsonschema", reason="the schema checks need jsonschema (the dev extra)")

from pydantic import BaseModel, Field  # noqa: E402
from test_serve import Live, get_json  # noqa: E402

from nanogpt_cli.config import GPTConfig, LoadSpec  # noqa: E402
from nanogpt_cli.errors import NanoGPTError  # noqa: E402
from nanogpt_cli.inference.engine import Engine, SamplingParams  # noqa: E402
from nanogpt_cli.inference.grammar import COMPACT, Constraint, bounded, compile_grammar  # noqa: E402
from nanogpt_cli.model import GPT  # noqa: E402
from nanogpt_cli.runs import checkpoint as ckpt  # noqa: E402
from nanogpt_cli.serve import ServeOptions  # noqa: E402
from nanogpt_cli.serve.tools import ToolCallText, call_schema  # noqa: E402
from nanogpt_cli.tokenizer import ByteTokenizer, build_tokenizer  # noqa: E402

# nested objects, an array, enums, required fields; strings and arrays bounded, so a random model ends them
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"city": {"enum": ["Oslo", "Lima"]}, "verified": {"type": "boolean"}},
            "required": ["city", "verified"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "age", "owner"],
    "additionalProperties": False,
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Oslo", "Lima", "Pune"]}, "days": {"type": "integer", "minimum": 1}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    torch.manual_seed(0)
    tok = build_tokenizer("gpt2")
    # context 512: the default tool prompt alone is ~270 tokens
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=512, n_layer=2, n_head=2, n_embd=32))
    path = tmp_path_factory.mktemp("structured") / "tiny.safetensors"
    ckpt.save_model(path, model, {"tokenizer": tok.describe(), "step": 0})
    server = Live(ServeOptions(LoadSpec(str(path), device="cpu", dtype="float32"), port=0, max_batch=16))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_twenty_seeded_schema_constrained_replies_validate(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    for seed in range(20):
        r = client.chat.completions.create(
            model="tiny", messages=ASK, response_format=fmt, seed=seed, max_tokens=300, temperature=1.0
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (seed, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_completions_take_a_schema_and_json_object(client):
    r = client.completions.create(
        model="tiny",
        prompt="A pet:",
        max_tokens=300,
        seed=3,
        n=2,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}},
    )
    assert len(r.choices) == 2
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    r = client.completions.create(
        model="tiny", prompt="{", max_tokens=5, seed=1, extra_body={"response_format": {"type": "json_object"}}
    )
    assert r.choices[0].text.startswith("{")  # an object begins, whatever the model would have written


class Owner(BaseModel):
    city: Literal["Oslo", "Lima"]
    verified: bool


class Pet(BaseModel):
    name: str = Field(max_length=6)
    kind: Literal["cat", "dog"]
    age: int = Field(ge=0, le=20)
    owner: Owner


def test_parse_returns_the_pydantic_object(client):
    r = client.chat.completions.parse(model="tiny", messages=ASK, response_format=Pet, seed=5, max_tokens=300)
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and isinstance(pet.owner, Owner)
    assert pet == Pet.model_validate_json(r.choices[0].message.content)


def test_a_grammar_constrained_completion_matches_its_regex_and_gbnf(client):
    pattern = r"[a-c]{2,4}-[0-9]{3}"
    for seed in range(5):
        r = client.completions.create(
            model="tiny",
            prompt="Code:",
            max_tokens=40,
            seed=seed,
            extra_body={"grammar": {"type": "regex", "value": pattern}},
        )
        assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text
        assert r.choices[0].finish_reason == "stop"
    r = client.completions.create(
        model="tiny", prompt="Answer:", max_tokens=20, seed=1, extra_body={"grammar": 'root ::= "yes" | "no"'}
    )
    assert r.choices[0].text in ("yes", "no")


def test_constrained_and_free_rows_share_one_batch(client, live):
    """Requests with and without a schema at once: each follows its own rules, the free ones as they would alone."""
    import concurrent.futures

    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}

    def free(seed):
        return client.completions.create(model="tiny", prompt="Once", max_tokens=30, seed=seed).choices[0].text

    def pet(seed):
        r = client.completions.create(
            model="tiny", prompt="Once", max_tokens=300, seed=seed, extra_body={"response_format": fmt}
        )
        return r.choices[0].text

    alone = [free(s) for s in range(4)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        frees = [pool.submit(free, s) for s in range(4)]
        pets = [pool.submit(pet, s) for s in range(4)]
        together = [f.result(timeout=120) for f in frees]
        for p in pets:
            jsonschema.validate(json.loads(p.result(timeout=120)), SCHEMA)
    assert together == alone
    assert live.health()["active_rows"] == 0


def test_tool_choice_required_yields_a_valid_call_and_the_result_is_accepted(client):
    tools = [WEATHER, TIME]
    for seed in range(3):
        r = client.chat.completions.create(
            model="tiny", messages=ASK, tools=tools, tool_choice="required", seed=seed, max_tokens=200
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        schema = {t["function"]["name"]: t["function"]["parameters"] for t in tools}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    messages = [
        *ASK,
        choice.message,  # as the openai package hands it back
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 3}'},
    ]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=tools, seed=1, max_tokens=10)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_named_function_is_the_one_called(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, seed=2, max_tokens=200
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")


def test_a_streamed_call_arrives_as_tool_calls_deltas(client):
    stream = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required", seed=4, max_tokens=200, stream=True
    )
    deltas, reasons, content = [], [], ""
    for chunk in stream:
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            content += c.delta.content or ""
            reasons.append(c.finish_reason)
    assert reasons[-1] == "tool_calls" and content == ""
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectt"}}}},
            "response_format.json_schema.schema",
        ),
        ({"grammar": "root ::= ("}, "grammar"),
        ({"grammar": {"type": "regex", "value": "[a-"}}, "grammar"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "grammar"),
    ],
)
def test_bad_schemas_grammars_and_tool_choices_are_400_naming_the_field(live, body, param):
    status, answer = get_json(
        live.url,
        "/v1/chat/completions",
        "POST",
        json.dumps({"messages": ASK, "max_tokens": 4, **body}).encode(),
        {"content-type": "application/json"},
    )
    assert status == 400, answer
    assert answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error"
    assert live.health()["status"] == "ok"


def test_tool_call_text_is_parsed_as_it_streams():
    parser = ToolCallText({"f"})
    pieces = ["Sure. <tool", '_call>\n{"name": "f", "argu', 'ments": {"x": 1}}\n</tool_call>', " <tool_call>bad"]
    out, calls = "", []
    for piece in pieces:
        text, new = parser.feed(piece)
        out, calls = out + text, calls + new
    out += parser.finish()
    assert out == "Sure.  <tool_call>bad"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("f", {"x": 1})]


def test_a_byte_vocabulary_row_is_masked_and_ends_with_its_grammar():
    """A tokenizer without an end-of-text token: the row ends when the grammar can go no further."""
    torch.manual_seed(0)
    tok = ByteTokenizer()
    model = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=1, n_head=2, n_embd=16))
    engine = Engine(model, max_batch=2, vocab_size=256)
    constraint = Constraint(tok, compile_grammar("regex", "(yes|no)!", tok))
    gen = torch.Generator().manual_seed(0)
    masked = engine.add([65], SamplingParams(), 50, gen, mask=constraint)
    free = engine.add([65], SamplingParams(), 5, torch.Generator().manual_seed(0))
    out = {masked: [], free: []}
    for t in engine.run():
        out[t.row].append(t.token)
    assert bytes(out[masked]).decode() in ("yes!", "no!")
    assert len(out[free]) == 5


def test_a_char_vocabulary_ends_an_open_grammar_at_its_end_and_refuses_what_it_cannot_spell():
    tok = build_tokenizer("char", ["ab01"])
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=16))
    engine = Engine(model, max_batch=1, vocab_size=tok.vocab_size)
    constraint = Constraint(tok, compile_grammar("regex", "a[01]{1,3}", tok))
    row = engine.add(tok.encode("b"), SamplingParams(), 50, torch.Generator().manual_seed(1), mask=constraint)
    tokens = [t.token for t in engine.run() if t.row == row]
    assert re.fullmatch("a[01]{1,3}", tok.decode(tokens))
    with pytest.raises(NanoGPTError, match="cannot begin"):
        Constraint(tok, compile_grammar("regex", "x+", tok))


def test_auto_parses_a_call_the_model_writes_and_leaves_other_text(client):
    """tool_choice auto: a `<tool_call>` block in the text (written here under a grammar) becomes tool_calls."""
    call = r'Sure\.\n<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}\n</tool_call>'
    r = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[WEATHER, TIME],
        seed=1,
        max_tokens=100,
        extra_body={"grammar": {"type": "regex", "value": call}},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure.\n"
    (made,) = choice.message.tool_calls
    assert made.function.name == "get_time" and json.loads(made.function.arguments)["zone"] in ("UTC", "CET")
    r = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="none",
        seed=1,
        max_tokens=100,
        extra_body={"grammar": {"type": "regex", "value": call}},
    )
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content


def test_a_template_that_takes_tools_gets_them_and_earlier_calls_as_objects():
    from nanogpt_cli.serve.chat import ChatTemplate
    from nanogpt_cli.serve.protocol import ChatMessage
    from nanogpt_cli.serve.tools import template_messages

    source = (
        "{% for t in tools %}TOOL {{ t.function.name }};{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.zone }};{% endfor %}"
        "{% endfor %}"
    )
    template = ChatTemplate(source)
    assert template.takes_tools and not ChatTemplate().takes_tools
    messages = [
        ChatMessage(role="user", content="time?"),
        ChatMessage.model_validate(
            {
                "role": "assistant",
                "tool_calls": [{"id": "c1", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}],
            }
        ),
        ChatMessage(role="tool", content="12:00", tool_call_id="c1"),
    ]
    text = template.render(template_messages(messages, template, [TIME]), tools=[TIME])
    assert text == "TOOL get_time;user:time?assistant:CALL get_time UTC;tool:12:00"
    plain = ChatTemplate()  # no tools in it: the default rendering
    text = plain.render(template_messages(messages, plain, [TIME]))
    assert '"name": "get_time"' in text and "<tools>" in text and "<tool_response>\n12:00\n</tool_response>" in text
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>' in text


# --- bounds a weak model cannot run past ---------------------------------------------------------------------------

NUMBERS = {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "x": {"type": "number"}},
    "required": ["n", "x"],
    "additionalProperties": False,
}


@pytest.mark.slow
def test_numbers_a_schema_leaves_unbounded_are_held_to_16_digits_and_the_reply_ends(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "numbers", "schema": NUMBERS}}
    # the same schema through a Lark grammar's %json, which is taken as written: the random model writes digits
    # until max_tokens runs out
    raw = {"grammar": {"type": "lark", "value": "start: %json " + json.dumps({**NUMBERS, "x-guidance": COMPACT})}}
    unbounded = [
        client.chat.completions.create(model="tiny", messages=ASK, seed=s, max_tokens=48, extra_body=raw)
        for s in range(4)
    ]
    assert sum(r.choices[0].finish_reason == "length" for r in unbounded) >= 3
    for seed in range(4):
        r = client.chat.completions.create(model="tiny", messages=ASK, response_format=fmt, seed=seed, max_tokens=48)
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        value = json.loads(choice.message.content)
        jsonschema.validate(value, NUMBERS)
        n, x = re.fullmatch(r'\{"n":(-?\d+),"x":(-?[0-9.]+)\}', choice.message.content).groups()
        whole, _, fraction = x.lstrip("-").partition(".")
        assert abs(int(n)) <= 10**16 and len(whole) <= 16 and len(fraction) <= 10


def test_a_forced_call_of_a_tool_whose_schema_is_open_returns_tool_calls_with_its_keys_only(client):
    tool = {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {  # no additionalProperties: taken as closed, as OpenAI's strict function calling does
                "type": "object",
                "properties": {"city": {"enum": ["Oslo", "Lima"]}, "where": {"type": "object", "properties": {}}},
                "required": ["city"],
            },
        },
    }
    for seed in range(4):
        r = client.chat.completions.create(
            model="tiny", messages=ASK, tools=[tool], tool_choice="required", seed=seed, max_tokens=150
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message.content
        (call,) = choice.message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert set(arguments) <= {"city", "where"} and arguments.get("where", {}) == {}
        jsonschema.validate(arguments, tool["function"]["parameters"])


def test_bounded_keeps_what_a_schema_says_and_bounds_only_what_it_leaves_open():
    schema = {
        "type": "object",
        "properties": {
            "type": {"type": "integer", "minimum": 3},  # a property named like a keyword
            "price": {"type": "number", "exclusiveMinimum": 0, "multipleOf": 0.01},
            "tags": {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"}}}},
            "kind": {"const": {"type": "integer"}},  # a value, not a schema
        },
        "$defs": {"open": {"type": "object", "additionalProperties": True}},
    }
    out = bounded(schema, closed=True)
    assert out["additionalProperties"] is False and out["$defs"]["open"]["additionalProperties"] is True
    assert out["properties"]["type"] == {"type": "integer", "minimum": 3, "maximum": 10**16}
    assert out["properties"]["price"] == {
        "type": "number",
        "exclusiveMinimum": 0,
        "multipleOf": 0.01,
        "exclusiveMaximum": 10**16,
    }
    item = out["properties"]["tags"]["items"]
    assert item["additionalProperties"] is False and item["properties"]["id"]["minimum"] == -(10**16)
    assert out["properties"]["kind"] == {"const": {"type": "integer"}}
    assert "additionalProperties" not in bounded(schema)  # open unless asked (response_format)
    assert schema["properties"]["type"] == {"type": "integer", "minimum": 3}  # a copy: the request's is unchanged


def test_bounded_keeps_a_schema_that_bounds_past_16_digits_and_composed_objects_satisfiable():
    tok = ByteTokenizer()
    for schema in (
        {"type": "integer", "minimum": 10**17},
        {"type": "integer", "maximum": -(10**17)},
        {"type": "number", "exclusiveMinimum": 1e17},
    ):
        out = bounded(schema)
        assert all(out[k] == v for k, v in schema.items())  # the bound given is as given
        Constraint(tok, compile_grammar("json_schema", schema, tok))  # satisfiable: it compiles
    assert bounded({"type": "integer", "minimum": 10**17})["maximum"] == 2 * 10**17
    # an object whose keys are in parts (allOf beside its own properties): no part may close it
    parts = {
        "type": "object",
        "allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}],
        "properties": {"b": {"type": "object", "properties": {"c": {"type": "integer"}}}},
    }
    out = bounded(parts, closed=True)
    assert "additionalProperties" not in out and "additionalProperties" not in out["allOf"][0]
    assert out["properties"]["b"]["additionalProperties"] is False  # a whole object inside is closed
    tool = {"type": "function", "function": {"name": "f", "parameters": parts}}
    Constraint(tok, compile_grammar("json_schema", call_schema([tool], "f"), tok))
