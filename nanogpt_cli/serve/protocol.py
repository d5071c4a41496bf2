"""The OpenAI request bodies the server takes, and its error shape.

    body = parse(CompletionRequest, json.loads(raw))   # APIError(400, ..., param="max_tokens") when invalid

Unknown fields are refused (a 400 naming them), so a typo is never silently ignored; OpenAI fields the server
cannot honour are accepted only at their neutral value (frequency_penalty 0, ...).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class APIError(Exception):
    """An error response in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES: ClassVar[dict[int, str]] = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "invalid_request_error",
        413: "invalid_request_error",
        415: "invalid_request_error",
        500: "server_error",
        503: "server_error",
    }

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }


# the smallest temperature, top_p and repetition_penalty taken (and 1/TINY the largest penalty): the engine divides
# float32 logits by them, and a value near float32's smallest (1.2e-38) makes them infinite, which fails the row
TINY = 1e-6
MAX_STOP_CHARS = 1_000  # one stop text's length: every token is checked against its beginnings


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    """response_format's json_schema: OpenAI's {"name", "schema", "description", "strict"}."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # None: any JSON object
    description: str | None = None
    strict: bool | None = None  # the output always follows the schema, strict or not


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class GrammarSpec(BaseModel):
    """Our `grammar` field in its object form: {"type": "gbnf" | "lark" | "regex", "value": "..."}."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["gbnf", "lark", "regex"]
    value: str


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    # extras beyond OpenAI's fields, as vLLM and llama.cpp's server take them
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False  # go on past the end-of-text token
    cache_prompt: bool = True  # start from the longest stored prefix (llama.cpp's name); false: prefill it all
    # structured output: OpenAI's response_format, or our grammar (a GBNF/Lark text, as llama.cpp's, or GrammarSpec)
    response_format: ResponseFormat | None = None
    grammar: str | GrammarSpec | None = None
    # OpenAI fields accepted at their neutral value only
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    @field_validator("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    def check(self, max_n: int) -> None:
        """The value checks pydantic's types do not make; APIError(400) naming the field."""
        checks = [
            ("temperature", self.temperature == 0 or self.temperature >= TINY, f"must be 0 (greedy) or >= {TINY}"),
            ("top_p", TINY <= self.top_p <= 1, f"must be in [{TINY}, 1]"),
            ("n", 1 <= self.n <= max_n, f"must be between 1 and {max_n} (this server's limit)"),
            ("top_k", self.top_k is None or self.top_k >= 0, "must be >= 0 (0: off)"),
            ("min_p", 0 <= self.min_p < 1, "must be in [0, 1)"),
            ("repetition_penalty", TINY <= self.repetition_penalty <= 1 / TINY, f"must be in [{TINY}, {1 / TINY:g}]"),
            ("frequency_penalty", self.frequency_penalty == 0, "is not supported (only 0)"),
            ("presence_penalty", self.presence_penalty == 0, "is not supported (only 0)"),
            ("stop", all(s != "" for s in self.stops), "must be non-empty texts"),
            ("stop", len(self.stops) <= 16, "takes at most 16 texts"),
            # each token is checked against every stop text's beginnings: a long one would slow every row
            (
                "stop",
                all(len(s) <= MAX_STOP_CHARS for s in self.stops),
                f"texts are at most {MAX_STOP_CHARS:,} characters",
            ),
            # a 64-bit seed, as OpenAI's: torch's generator refuses more, and that in the engine's thread
            ("seed", self.seed is None or -(2**63) <= self.seed < 2**63, "must be a 64-bit integer"),
        ]
        for name, ok, what in checks:
            if not ok:
                raise APIError(400, f"{name} {what}, got {getattr(self, name)!r}", param=name)

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None  # None: 16, as OpenAI's, or the server's --max-tokens when that is less
    logprobs: int | None = None
    echo: bool = False
    suffix: None = None
    best_of: int | None = None

    def check(self, max_n: int) -> None:
        super().check(max_n)
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise APIError(400, f"logprobs must be between 0 and 20, got {self.logprobs}", param="logprobs")
        if self.best_of not in (None, self.n):
            raise APIError(400, "best_of is not supported (only equal to n)", param="best_of")
        if isinstance(self.prompt, list) and not self.prompt:
            raise APIError(400, "prompt must not be an empty list", param="prompt")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls, given back
    tool_call_id: str | None = None  # a tool message: the call it answers


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Common):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; a forced call is one call, auto may make several

    def check(self, max_n: int) -> None:
        super().check(max_n)
        if not self.messages:
            raise APIError(400, "messages must hold at least one message", param="messages")
        if self.top_logprobs is not None and not (self.logprobs and 0 <= self.top_logprobs <= 20):
            raise APIError(400, "top_logprobs takes 0 to 20 and needs logprobs: true", param="top_logprobs")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise APIError(400, "tools must have distinct function names", param="tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise APIError(
                400,
                f"tool_choice names the function '{self.tool_choice.function.name}', which is not in tools "
                f"({', '.join(names) or 'none given'})",
                param="tool_choice",
            )
        if self.tool_choice == "required" and not names:
            raise APIError(400, "tool_choice 'required' needs at least one tool in tools", param="tool_choice")


def parse(model: type[BaseModel], data: Any) -> Any:
    """A request body -> its model, or APIError(400) with the first problem and the field it is in."""
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("function-", "list[", "str")))
        if err["type"] == "extra_forbidden":
            raise APIError(400, f"unknown parameter: {param}", param=param, code="unknown_parameter") from None
        if err["type"] == "missing":
            raise APIError(400, f"missing required parameter: {param}", param=param) from None
        raise APIError(400, f"invalid value for {param or 'the body'}: {err['msg']}", param=param or None) from None
