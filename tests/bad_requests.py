"""A corpus of hand-written bad requests over the three dialects, each with the answer it must get.

Every entry is a JSON body that a buggy or hostile agent could send, the HTTP status and error code
the gateway must answer with (OpenAI shapes: `error.code`; Anthropic: `error.type`), and the field
the error must name (OpenAI shapes: exactly `error.param`; Anthropic, which has no param: a part of
`error.message`). `tests/unit/gateway_workers/adapters/test_bad_requests.py` runs them through each
adapter's `parse_request` under `LIMITS`; `tests/process/test_bad_requests_served.py` sends them to a
real `serve` started with `LIMIT_FLAGS`. Data only: imports nothing of the gateway but `RequestLimits`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from gateway_workers.http.limits import RequestLimits

Dialect = Literal["chat", "messages", "responses"]
PATHS: dict[Dialect, str] = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}

# Small limits, so the limit entries stay small bodies.
LIMITS = RequestLimits(max_body_bytes=1 << 20, max_header_bytes=16 << 10, max_messages=16, max_tools=4,
                       max_content_parts=8, max_string_chars=4096, max_json_depth=8)
LIMIT_FLAGS = [f"--{name.replace('_', '-')}={getattr(LIMITS, name)}" for name in LIMITS.__slots__]

# The OpenAI dialects' `error.code`s, the real API's own, which harnesses read to decide whether to retry.
TYPE = "invalid_type"
VALUE = "invalid_value"
MISSING = "missing_required_parameter"
UNKNOWN = "unknown_parameter"
EMPTY = "empty_array"
EMPTY_STRING = "empty_string"
BELOW_MIN = "integer_below_min_value"
DECIMAL_BELOW_MIN = "decimal_below_min_value"
DECIMAL_ABOVE_MAX = "decimal_above_max_value"
UNSUPPORTED = "unsupported_value"  # a valid request this gateway cannot serve (`request_fields`: refused)
UNSUPPORTED_PARAMETER = "unsupported_parameter"
PAIRING = None  # null, as OpenAI's, for a conversation whose tool calls and results do not pair up
TOO_MANY = "array_above_max_length"
TOO_LONG = "string_above_max_length"
TOO_DEEP = "nested_too_deep"
ANTHROPIC_INVALID = "invalid_request_error"  # Anthropic's error.type for every 400


@dataclass(frozen=True, slots=True)
class BadRequest:
    """One bad body and the answer it must get."""

    dialect: Dialect
    id: str
    body: Any
    field: str | None  # OpenAI shapes: error.param, exactly; Anthropic: a substring of error.message
    code: str | None
    status: int = 400
    # A string over max_string_chars is found by the adapter (naming `field`) or on the decoded body at the
    # HTTP edge, whose error names the string's path (e.g. "messages.[0].content"): `edge` is where that
    # path starts (OpenAI shapes; Anthropic's message names the limit either way).
    edge: str | None = None

    @property
    def name(self) -> str:
        return f"{self.dialect}-{self.id}"


DROP = object()  # an override that removes the key


def _with(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    body = {**base, **over}
    return {k: v for k, v in body.items() if v is not DROP}


def _long(value: Any) -> bool:
    """Whether a JSON value holds a string over the limit."""
    if isinstance(value, str):
        return len(value) > LIMITS.max_string_chars
    if isinstance(value, dict):
        return any(_long(k) or _long(v) for k, v in value.items())
    return isinstance(value, list) and any(_long(v) for v in value)


def deep_schema(levels: int) -> dict[str, Any]:
    """An object schema nesting `levels` objects (two JSON levels each)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def deep_value(levels: int) -> Any:
    value: Any = "leaf"
    for _ in range(levels):
        value = {"x": value}
    return value


LONG = "x" * (LIMITS.max_string_chars + 1)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ARGS = '{"city": "Oslo"}'
BAD_NAMES = {"name-space": "get weather", "name-dot": "get.weather", "name-nul": "get\u0000weather",
             "name-newline": "get_weather\n<tool_call>", "name-unicode": "wetter_\u00fcber"}

# --- OpenAI Chat Completions ------------------------------------------------------------------

USER = {"role": "user", "content": "What is the weather in Oslo?"}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": SCHEMA}}


def _chat(**over: Any) -> dict[str, Any]:
    return _with({"model": "m", "messages": [USER], "max_tokens": 16}, over)


def _msgs(*messages: Any, **over: Any) -> dict[str, Any]:
    return _chat(messages=list(messages), **over)


def _call(call_id: Any = "call_1", name: Any = "get_weather", arguments: Any = ARGS, **over: Any) -> dict[str, Any]:
    return _with({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}, over)


def _asst(*calls: Any, **over: Any) -> dict[str, Any]:
    return _with({"role": "assistant", "content": None, "tool_calls": list(calls)}, over)


def _tool(call_id: Any = "call_1", content: Any = "rainy", **over: Any) -> dict[str, Any]:
    return _with({"role": "tool", "tool_call_id": call_id, "content": content}, over)


def _fn(**over: Any) -> dict[str, Any]:
    """A Chat Completions tool with its function's fields overridden."""
    return {"type": "function", "function": _with(CHAT_TOOL["function"], over)}


def _chat_entries() -> list[BadRequest]:
    m0, m1, m2 = "messages.[0]", "messages.[1]", "messages.[2]"
    e: list[tuple[str, Any, str | None, str]] = [
        # the body itself
        ("body-list", [_chat()], None, TYPE),
        ("body-string", "hello", None, TYPE),
        ("body-null", None, None, TYPE),
        ("body-number", 42, None, TYPE),
        ("body-true", True, None, TYPE),
        ("body-empty-object", {}, "messages", MISSING),
        # messages
        ("messages-missing", _chat(messages=DROP), "messages", MISSING),
        ("messages-null", _chat(messages=None), "messages", MISSING),
        ("messages-empty", _chat(messages=[]), "messages", EMPTY),
        ("messages-string", _chat(messages="hi"), "messages", TYPE),
        ("messages-object", _chat(messages=USER), "messages", TYPE),
        ("message-string", _msgs("hi"), "messages", TYPE),
        ("message-null", _msgs(None), "messages", TYPE),
        ("message-list", _msgs([USER]), "messages", TYPE),
        ("role-missing", _msgs({"content": "hi"}), "messages", MISSING),
        ("role-unknown", _msgs({"role": "robot", "content": "hi"}), "messages", VALUE),
        ("role-number", _msgs({"role": 1, "content": "hi"}), "messages", TYPE),
        ("role-list", _msgs({"role": ["user"], "content": "hi"}), "messages", TYPE),
        ("role-object", _msgs({"role": {"user": True}, "content": "hi"}), "messages", TYPE),
        ("role-uppercase", _msgs({"role": "User", "content": "hi"}), "messages", VALUE),
        ("role-function", _msgs(USER, {"role": "function", "name": "f", "content": "x"}), "messages", UNSUPPORTED),
        ("user-content-missing", _msgs({"role": "user"}), f"{m0}.content", MISSING),
        ("user-content-null", _msgs({"role": "user", "content": None}), f"{m0}.content", MISSING),
        ("system-content-missing", _msgs({"role": "system"}, USER), f"{m0}.content", MISSING),
        ("content-number", _msgs({"role": "user", "content": 5}), "messages", TYPE),
        ("content-object", _msgs({"role": "user", "content": {"text": "hi"}}), "messages", TYPE),
        ("content-true", _msgs({"role": "user", "content": True}), "messages", TYPE),
        ("developer-content-number", _msgs({"role": "developer", "content": 1.5}, USER), "messages", TYPE),
        ("part-image", _msgs({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}),
         "messages", UNSUPPORTED),
        ("part-audio", _msgs({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}),
         "messages", UNSUPPORTED),
        ("part-type-missing", _msgs({"role": "user", "content": [{"text": "hi"}]}), "messages", MISSING),
        ("part-type-list", _msgs({"role": "user", "content": [{"type": ["text"], "text": "hi"}]}), "messages",
         TYPE),
        ("part-string", _msgs({"role": "user", "content": ["hi"]}), "messages", TYPE),
        ("part-null", _msgs({"role": "user", "content": [None]}), "messages", TYPE),
        ("part-text-missing", _msgs({"role": "user", "content": [{"type": "text"}]}), "messages", TYPE),
        ("part-text-number", _msgs({"role": "user", "content": [{"type": "text", "text": 5}]}), "messages", TYPE),
        ("assistant-reasoning-number", _msgs(USER, {"role": "assistant", "content": "x", "reasoning_content": 5}),
         "messages", TYPE),
        ("assistant-reasoning-false", _msgs(USER, {"role": "assistant", "content": "x", "reasoning_content": False}),
         "messages", TYPE),
        # tool calls an assistant message echoes
        ("tool_calls-string", _msgs(USER, _asst(tool_calls="call_1")), f"{m1}.tool_calls", TYPE),
        ("tool_calls-object", _msgs(USER, _asst(tool_calls={"id": "call_1"})), f"{m1}.tool_calls", TYPE),
        ("tool_calls-empty-object", _msgs(USER, _asst(tool_calls={}, content="x")), f"{m1}.tool_calls", TYPE),
        ("call-string", _msgs(USER, _asst("call_1")), f"{m1}.tool_calls.[0]", TYPE),
        ("call-function-missing", _msgs(USER, _asst({"id": "call_1", "type": "function"})),
         f"{m1}.tool_calls.[0].function.name", MISSING),
        ("call-function-string", _msgs(USER, _asst(_call(function="get_weather"))),
         f"{m1}.tool_calls.[0].function", TYPE),
        ("call-name-missing", _msgs(USER, _asst(_call(name=None))), f"{m1}.tool_calls.[0].function.name", MISSING),
        ("call-name-number", _msgs(USER, _asst(_call(name=7))), f"{m1}.tool_calls.[0].function.name", TYPE),
        ("call-name-empty", _msgs(USER, _asst(_call(name=""))), f"{m1}.tool_calls.[0].function.name", EMPTY_STRING),
        # a custom tool's call carries `custom`, not `function`
        ("call-type-custom", _msgs(USER, _asst(_call(type="custom")), _tool()), f"{m1}.tool_calls.[0].custom.name",
         MISSING),
        ("call-id-missing", _msgs(USER, _asst(_call(id=DROP))), f"{m1}.tool_calls.[0].id", MISSING),
        ("call-id-number", _msgs(USER, _asst(_call(call_id=1))), f"{m1}.tool_calls.[0].id", MISSING),
        ("call-id-empty", _msgs(USER, _asst(_call(call_id=""))), f"{m1}.tool_calls.[0].id", MISSING),
        ("call-id-duplicate", _msgs(USER, _asst(_call(), _call()), _tool()), f"{m1}.tool_calls.[1].id", PAIRING),
        ("call-arguments-missing", _msgs(USER, _asst({"id": "call_1", "type": "function",
                                                      "function": {"name": "get_weather"}}), _tool()),
         f"{m1}.tool_calls.[0].function.arguments", MISSING),
        ("call-arguments-object", _msgs(USER, _asst(_call(arguments={"city": "Oslo"})), _tool()),
         f"{m1}.tool_calls.[0].function.arguments", TYPE),
        ("call-arguments-number", _msgs(USER, _asst(_call(arguments=5)), _tool()),
         f"{m1}.tool_calls.[0].function.arguments", TYPE),
        ("call-arguments-list", _msgs(USER, _asst(_call(arguments=["Oslo"])), _tool()),
         f"{m1}.tool_calls.[0].function.arguments", TYPE),
        # tool messages answer open calls by id
        ("tool-call-id-missing", _msgs(USER, _tool(call_id=DROP)), f"{m1}.tool_call_id", MISSING),
        ("tool-call-id-missing-after-call", _msgs(USER, _asst(_call()), _tool(call_id=DROP)), f"{m2}.tool_call_id",
         MISSING),
        ("tool-call-id-number", _msgs(USER, _asst(_call()), _tool(call_id=1)), f"{m2}.tool_call_id", MISSING),
        ("tool-call-id-empty", _msgs(USER, _asst(_call()), _tool(call_id="")), f"{m2}.tool_call_id", MISSING),
        ("tool-without-call", _msgs(USER, _tool()), f"{m1}.tool_call_id", PAIRING),
        ("tool-first", _msgs(_tool(), USER), f"{m0}.tool_call_id", PAIRING),
        ("tool-unknown-call-id", _msgs(USER, _asst(_call()), _tool("call_2")), f"{m2}.tool_call_id", PAIRING),
        ("tool-answered-twice", _msgs(USER, _asst(_call()), _tool(), _tool()), "messages.[3].tool_call_id", PAIRING),
        ("tool-answers-older-call", _msgs(USER, _asst(_call()), _tool(), {"role": "assistant", "content": "ok"},
                                          _tool()), "messages.[4].tool_call_id", PAIRING),
        ("tool-after-text-assistant", _msgs(USER, {"role": "assistant", "content": "hi"}, _tool()),
         f"{m2}.tool_call_id", PAIRING),
        ("tool-content-missing", _msgs(USER, _asst(_call()), _tool(content=DROP)), f"{m2}.content", MISSING),
        ("tool-content-number", _msgs(USER, _asst(_call()), _tool(content=3)), "messages", TYPE),
        ("tool-content-image-part", _msgs(USER, _asst(_call()), _tool(content=[{"type": "image_url"}])), "messages",
         UNSUPPORTED),
        ("call-unanswered-last", _msgs(USER, _asst(_call())), f"{m1}.tool_calls", PAIRING),
        ("call-unanswered-then-user", _msgs(USER, _asst(_call()), USER), f"{m2}.role", PAIRING),
        ("call-unanswered-then-assistant", _msgs(USER, _asst(_call()), {"role": "assistant", "content": "x"}),
         f"{m2}.role", PAIRING),
        ("call-half-answered", _msgs(USER, _asst(_call(), _call("call_2")), _tool(), USER), "messages.[3].role",
         PAIRING),
        # sampling parameters
        ("temperature-string", _chat(temperature="0.7"), "temperature", TYPE),
        ("temperature-negative", _chat(temperature=-0.1), "temperature", DECIMAL_BELOW_MIN),
        ("temperature-above-2", _chat(temperature=2.5), "temperature", DECIMAL_ABOVE_MAX),
        ("temperature-true", _chat(temperature=True), "temperature", TYPE),
        ("temperature-list", _chat(temperature=[1]), "temperature", TYPE),
        ("top_p-string", _chat(top_p="1"), "top_p", TYPE),
        ("top_p-above-1", _chat(top_p=1.5), "top_p", DECIMAL_ABOVE_MAX),
        ("top_p-negative", _chat(top_p=-1), "top_p", DECIMAL_BELOW_MIN),
        ("top_p-false", _chat(top_p=False), "top_p", TYPE),
        ("top_k-string", _chat(top_k="5"), "top_k", TYPE),
        ("top_k-float", _chat(top_k=1.5), "top_k", TYPE),
        ("top_k-below-minus-1", _chat(top_k=-2), "top_k", BELOW_MIN),
        ("max_tokens-string", _chat(max_tokens="16"), "max_tokens", TYPE),
        ("max_tokens-zero", _chat(max_tokens=0), "max_tokens", BELOW_MIN),
        ("max_tokens-negative", _chat(max_tokens=-5), "max_tokens", BELOW_MIN),
        ("max_tokens-float", _chat(max_tokens=16.5), "max_tokens", TYPE),
        ("max_tokens-true", _chat(max_tokens=True), "max_tokens", TYPE),
        ("max_completion_tokens-string", _chat(max_completion_tokens="8"), "max_completion_tokens", TYPE),
        ("max_completion_tokens-zero", _chat(max_completion_tokens=0), "max_completion_tokens", BELOW_MIN),
        ("seed-string", _chat(seed="1"), "seed", TYPE),
        ("seed-float", _chat(seed=1.5), "seed", TYPE),
        ("seed-true", _chat(seed=True), "seed", TYPE),
        ("stop-number", _chat(stop=5), "stop", TYPE),
        ("stop-empty-string", _chat(stop=""), "stop", VALUE),
        ("stop-list-number", _chat(stop=["a", 1]), "stop", TYPE),
        ("stop-object", _chat(stop={"a": 1}), "stop", TYPE),
        ("stream-string", _chat(stream="true"), "stream", TYPE),
        ("stream-number", _chat(stream=1), "stream", TYPE),
        ("stream_options-string", _chat(stream_options="usage"), "stream_options", TYPE),
        ("stream_options-list", _chat(stream_options=[]), "stream_options", TYPE),
        ("include_usage-string", _chat(stream=True, stream_options={"include_usage": "yes"}),
         "stream_options.include_usage", TYPE),
        ("n-2", _chat(n=2), "n", UNSUPPORTED),
        ("n-zero", _chat(n=0), "n", BELOW_MIN),
        ("n-true", _chat(n=True), "n", TYPE),
        ("n-string", _chat(n="1"), "n", TYPE),
        ("tool_choice-required", _chat(tool_choice="required", tools=[CHAT_TOOL]), "tool_choice", UNSUPPORTED),
        ("tool_choice-named", _chat(tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                    tools=[CHAT_TOOL]), "tool_choice", UNSUPPORTED),
        ("tool_choice-number", _chat(tool_choice=1), "tool_choice", TYPE),
        ("parallel_tool_calls-string", _chat(parallel_tool_calls="yes"), "parallel_tool_calls", TYPE),
        ("parallel_tool_calls-number", _chat(parallel_tool_calls=1), "parallel_tool_calls", TYPE),
        # parameters we cannot honour, and unknown ones
        ("unknown-parameter", _chat(foo=1), "foo", UNKNOWN),
        ("logit_bias-not-token-ids", _chat(logit_bias={"a": 5}), "logit_bias", VALUE),
        ("logit_bias-above-100", _chat(logit_bias={"1": 101}), "logit_bias", VALUE),
        ("logit_bias-string", _chat(logit_bias="1:5"), "logit_bias", TYPE),
        ("logprobs", _chat(logprobs=True), "logprobs", UNSUPPORTED),
        ("response_format", _chat(response_format={"type": "json_object"}), "response_format", UNSUPPORTED),
        ("frequency_penalty-above-2", _chat(frequency_penalty=2.5), "frequency_penalty", DECIMAL_ABOVE_MAX),
        ("presence_penalty-string", _chat(presence_penalty="0.5"), "presence_penalty", TYPE),
        ("top_logprobs", _chat(top_logprobs=3), "top_logprobs", UNSUPPORTED),
        ("audio", _chat(audio={"voice": "alloy", "format": "wav"}), "audio", UNSUPPORTED_PARAMETER),
        ("modalities-audio", _chat(modalities=["text", "audio"]), "modalities", UNSUPPORTED),
        ("response_format-json_schema", _chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
         "response_format", UNSUPPORTED),
        ("functions-legacy", _chat(functions=[CHAT_TOOL["function"]]), "functions", UNSUPPORTED_PARAMETER),
        ("anthropic-max_tokens_to_sample", _chat(max_tokens_to_sample=5), "max_tokens_to_sample", UNKNOWN),
        # accepted parameters still have their types
        ("model-number", _chat(model=5), "model", TYPE),
        ("model-object", _chat(model={"id": "m"}), "model", TYPE),
        ("user-number", _chat(user=12), "user", TYPE),
        ("metadata-string", _chat(metadata="x"), "metadata", TYPE),
        ("store-string", _chat(store="no"), "store", TYPE),
        # tools
        ("tools-object", _chat(tools={"get_weather": CHAT_TOOL}), "tools", TYPE),
        ("tools-string", _chat(tools="get_weather"), "tools", TYPE),
        ("tool-string", _chat(tools=["get_weather"]), "tools", TYPE),
        ("tool-type-missing", _chat(tools=[{"function": CHAT_TOOL["function"]}]), "tools", MISSING),
        ("tool-type-unknown", _chat(tools=[{"type": "web_search"}]), "tools", VALUE),
        ("tool-custom-missing", _chat(tools=[{"type": "custom"}]), "tools", MISSING),
        ("tool-custom-name-missing", _chat(tools=[{"type": "custom", "custom": {"description": "x"}}]), "tools",
         MISSING),
        ("tool-custom-format-unknown", _chat(tools=[{"type": "custom", "custom": {"name": "x", "format": {
            "type": "regex"}}}]), "tools", VALUE),
        ("tool-custom-twice", _chat(tools=[{"type": "custom", "custom": {"name": "x"}}, _fn(name="x")]), "tools",
         VALUE),
        ("tool-function-missing", _chat(tools=[{"type": "function"}]), "tools", MISSING),
        ("tool-function-string", _chat(tools=[{"type": "function", "function": "get_weather"}]), "tools", TYPE),
        ("tool-name-missing", _chat(tools=[_fn(name=DROP)]), "tools", MISSING),
        ("tool-name-number", _chat(tools=[_fn(name=3)]), "tools", TYPE),
        ("tool-name-empty", _chat(tools=[_fn(name="")]), "tools", EMPTY_STRING),
        ("tool-name-65-chars", _chat(tools=[_fn(name="a" * 65)]), "tools", VALUE),
        *((f"tool-{key}", _chat(tools=[_fn(name=name)]), "tools", VALUE) for key, name in BAD_NAMES.items()),
        ("tool-description-number", _chat(tools=[_fn(description=5)]), "tools", TYPE),
        ("tool-parameters-string", _chat(tools=[_fn(parameters="object")]), "tools", TYPE),
        ("tool-parameters-list", _chat(tools=[_fn(parameters=[SCHEMA])]), "tools", TYPE),
        ("tool-parameters-string-schema", _chat(tools=[_fn(parameters={"type": "string"})]), "tools", VALUE),
        ("tool-parameters-array-schema", _chat(tools=[_fn(parameters={"type": "array", "items": {}})]), "tools",
         VALUE),
        # limits
        ("limit-messages", _chat(messages=[USER] * (LIMITS.max_messages + 1)), "messages", TOO_MANY),
        ("limit-tools", _chat(tools=[_fn(name=f"t{i}") for i in range(LIMITS.max_tools + 1)]), "tools", TOO_MANY),
        ("limit-parts", _msgs({"role": "user", "content": [{"type": "text", "text": "x"}] * 9}), "messages",
         TOO_MANY),
        ("limit-tool-parts", _msgs(USER, _asst(_call()), _tool(content=[{"type": "text", "text": "x"}] * 9)),
         "messages", TOO_MANY),
        ("limit-string", _msgs({"role": "user", "content": LONG}), "messages", TOO_LONG),
        ("limit-string-in-part", _msgs({"role": "user", "content": [{"type": "text", "text": LONG}]}), "messages",
         TOO_LONG),
        ("limit-system-string", _msgs({"role": "system", "content": LONG}, USER), "messages", TOO_LONG),
        ("limit-tool-result-string", _msgs(USER, _asst(_call()), _tool(content=LONG)), "messages", TOO_LONG),
        ("limit-reasoning-string", _msgs(USER, {"role": "assistant", "content": "", "reasoning_content": LONG}, USER),
         "messages", TOO_LONG),
        ("limit-argument-string", _msgs(USER, _asst(_call(arguments=json.dumps({"city": LONG}))), _tool()),
         "messages", TOO_LONG),
        ("limit-tool-description", _chat(tools=[_fn(description=LONG)]), "tools", TOO_LONG),
        ("limit-stop-string", _chat(stop=[LONG]), "stop", TOO_LONG),
        ("limit-schema-depth", _chat(tools=[_fn(parameters=deep_schema(5))]), "tools", TOO_DEEP),
        ("limit-arguments-depth", _msgs(USER, _asst(_call(arguments=json.dumps(deep_value(12)))), _tool()),
         "messages", TOO_DEEP),
    ]
    return [BadRequest("chat", id_, body, field, code, edge=field if code == TOO_LONG else None)
            for id_, body, field, code in e]


# --- Anthropic Messages -----------------------------------------------------------------------

A_TOOL = {"name": "get_weather", "description": "Weather", "input_schema": SCHEMA}


def _anth(**over: Any) -> dict[str, Any]:
    return _with({"model": "m", "max_tokens": 16, "messages": [USER]}, over)


def _turns(*messages: Any, **over: Any) -> dict[str, Any]:
    return _anth(messages=list(messages), **over)


def _user(*blocks: Any) -> dict[str, Any]:
    return {"role": "user", "content": list(blocks)}


def _assistant(*blocks: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": list(blocks)}


def _use(call_id: Any = "toolu_1", name: Any = "get_weather", **over: Any) -> dict[str, Any]:
    return _with({"type": "tool_use", "id": call_id, "name": name, "input": {"city": "Oslo"}}, over)


def _result(call_id: Any = "toolu_1", content: Any = "rainy", **over: Any) -> dict[str, Any]:
    return _with({"type": "tool_result", "tool_use_id": call_id, "content": content}, over)


def _text(text: Any = "hi") -> dict[str, Any]:
    return {"type": "text", "text": text}


def _atool(**over: Any) -> dict[str, Any]:
    return _with(A_TOOL, over)


def _messages_entries() -> list[BadRequest]:
    used = _assistant(_use())
    e: list[tuple[str, Any, str]] = [
        ("body-list", [_anth()], "body"),
        ("body-string", "hello", "body"),
        ("body-null", None, "body"),
        ("body-number", 7, "body"),
        ("body-empty-object", {}, "max_tokens"),
        # max_tokens is required
        ("max_tokens-missing", _anth(max_tokens=DROP), "max_tokens"),
        ("max_tokens-null", _anth(max_tokens=None), "max_tokens"),
        ("max_tokens-string", _anth(max_tokens="16"), "max_tokens"),
        ("max_tokens-zero", _anth(max_tokens=0), "max_tokens"),
        ("max_tokens-negative", _anth(max_tokens=-1), "max_tokens"),
        ("max_tokens-float", _anth(max_tokens=16.5), "max_tokens"),
        ("max_tokens-true", _anth(max_tokens=True), "max_tokens"),
        # messages and roles
        ("messages-missing", _anth(messages=DROP), "messages"),
        ("messages-empty", _anth(messages=[]), "messages"),
        ("messages-string", _anth(messages="hi"), "messages"),
        ("messages-object", _anth(messages=USER), "messages"),
        ("message-string", _turns("hi"), "messages[0]"),
        ("message-null", _turns(None), "messages[0]"),
        ("role-missing", _turns({"content": "hi"}), "messages[0]"),
        ("role-system-content-number", _turns({"role": "system", "content": 5}, USER), "messages[0]"),
        ("role-system-clear_at-unknown", _turns(USER, {"role": "system", "content": "x", "clear_at": "soon"}, USER),
         "clear_at"),
        ("role-system-between-call-and-result", _turns(USER, _assistant(_use()), {"role": "system", "content": "x"},
                                                       _user(_result())), "tool_use"),
        ("role-tool", _turns(USER, {"role": "tool", "content": "x"}), "messages[1]"),
        ("role-developer", _turns({"role": "developer", "content": "x"}), "messages[0]"),
        ("role-number", _turns({"role": 0, "content": "x"}), "messages[0]"),
        ("role-list", _turns({"role": ["user"], "content": "x"}), "messages[0]"),
        ("content-missing", _turns({"role": "user"}), "messages[0]"),
        ("content-number", _turns({"role": "user", "content": 5}), "messages[0]"),
        ("content-object", _turns({"role": "user", "content": _text()}), "messages[0]"),
        ("assistant-content-number", _turns(USER, {"role": "assistant", "content": 5}), "messages[1]"),
        # content blocks
        ("block-string", _turns(_user("hi")), "messages[0].content[0]"),
        ("block-null", _turns(_user(None)), "messages[0].content[0]"),
        ("block-type-missing", _turns(_user({"text": "hi"})), "messages[0].content[0]"),
        ("block-type-unknown", _turns(_user({"type": "video", "source": {}})), "messages[0].content[0]"),
        ("block-type-list", _turns(_user({"type": ["text"], "text": "hi"})), "messages[0].content[0]"),
        ("block-image", _turns(_user({"type": "image", "source": {"type": "base64", "data": "x"}})),
         "messages[0].content[0]"),
        ("block-document", _turns(_user({"type": "document", "source": {}})), "messages[0].content[0]"),
        ("text-missing", _turns(_user({"type": "text"})), "messages[0].content[0]"),
        ("text-number", _turns(_user(_text(5))), "messages[0].content[0]"),
        ("user-thinking-block", _turns(_user({"type": "thinking", "thinking": "x", "signature": "s"})),
         "messages[0].content[0]"),
        ("user-tool_use-block", _turns(_user(_use())), "messages[0].content[0]"),
        ("assistant-tool_result-block", _turns(USER, _assistant(_result())), "messages[1].content[0]"),
        ("assistant-image-block", _turns(USER, _assistant({"type": "image", "source": {}})), "messages[1].content[0]"),
        ("assistant-thinking-number", _turns(USER, _assistant({"type": "thinking", "thinking": 5})),
         "messages[1].content[0]"),
        ("assistant-block-string", _turns(USER, _assistant("hi")), "messages[1].content[0]"),
        # tool_use / tool_result
        ("tool_use-id-missing", _turns(USER, _assistant(_use(id=DROP)), _user(_result())), "tool_use.id"),
        ("tool_use-id-number", _turns(USER, _assistant(_use(call_id=5)), _user(_result())), "tool_use.id"),
        ("tool_use-id-empty", _turns(USER, _assistant(_use(call_id="")), _user(_result())), "tool_use.id"),
        ("tool_use-id-duplicate", _turns(USER, _assistant(_use(), _use()), _user(_result())), "unique"),
        ("tool_use-name-missing", _turns(USER, _assistant(_use(name=DROP)), _user(_result())),
         "messages[1].content[0]"),
        ("tool_use-name-number", _turns(USER, _assistant(_use(name=1)), _user(_result())), "messages[1].content[0]"),
        ("tool_use-name-empty", _turns(USER, _assistant(_use(name="")), _user(_result())), "messages[1].content[0]"),
        ("tool_use-input-missing", _turns(USER, _assistant(_use(input=DROP)), _user(_result())),
         "messages[1].content[0]"),
        ("tool_use-input-string", _turns(USER, _assistant(_use(input='{"city": "Oslo"}')), _user(_result())),
         "messages[1].content[0]"),
        ("tool_use-input-list", _turns(USER, _assistant(_use(input=["Oslo"])), _user(_result())),
         "messages[1].content[0]"),
        ("tool_result-id-missing", _turns(USER, used, _user(_result(tool_use_id=DROP))), "tool_result.tool_use_id"),
        ("tool_result-id-number", _turns(USER, used, _user(_result(call_id=1))), "tool_result.tool_use_id"),
        ("tool_result-id-empty", _turns(USER, used, _user(_result(call_id=""))), "tool_result.tool_use_id"),
        ("tool_result-unknown-id", _turns(USER, used, _user(_result("toolu_2"))), "unexpected `tool_use_id`"),
        ("tool_result-without-tool_use", _turns(_user(_result())), "unexpected `tool_use_id`"),
        ("tool_result-after-text-assistant", _turns(USER, _assistant(_text()), _user(_result())),
         "unexpected `tool_use_id`"),
        ("tool_result-twice", _turns(USER, used, _user(_result(), _result())), "unexpected `tool_use_id`"),
        ("tool_result-answers-older", _turns(USER, used, _user(_result()), _assistant(_text()), _user(_result())),
         "unexpected `tool_use_id`"),
        ("tool_result-content-number", _turns(USER, used, _user(_result(content=5))), "messages[2].content[0]"),
        ("tool_result-content-object", _turns(USER, used, _user(_result(content=_text()))), "messages[2].content[0]"),
        ("tool_result-content-image", _turns(USER, used, _user(_result(content=[{"type": "image", "source": {}}]))),
         "messages[2].content[0]"),
        ("tool_result-content-null", _turns(USER, used, _user(_result(content=None))), "messages[2].content[0]"),
        ("tool_use-unanswered-last", _turns(USER, used), "without `tool_result`"),
        ("tool_use-unanswered-then-text", _turns(USER, used, USER), "without `tool_result`"),
        ("tool_use-unanswered-then-assistant", _turns(USER, used, _assistant(_text())), "without `tool_result`"),
        ("tool_use-half-answered", _turns(USER, _assistant(_use(), _use("toolu_2")), _user(_result()), USER),
         "without `tool_result`"),
        # system
        ("system-number", _anth(system=5), "system"),
        ("system-object", _anth(system={"text": "be brief"}), "system"),
        ("system-list-of-strings", _anth(system=["be brief"]), "system"),
        ("system-image-block", _anth(system=[{"type": "image", "source": {}}]), "system"),
        ("system-text-number", _anth(system=[_text(5)]), "system"),
        # sampling parameters
        ("temperature-string", _anth(temperature="0.5"), "temperature"),
        ("temperature-above-1", _anth(temperature=1.5), "temperature"),
        ("temperature-negative", _anth(temperature=-0.5), "temperature"),
        ("temperature-true", _anth(temperature=True), "temperature"),
        ("top_p-string", _anth(top_p="0.9"), "top_p"),
        ("top_p-above-1", _anth(top_p=2), "top_p"),
        ("top_k-string", _anth(top_k="5"), "top_k"),
        ("top_k-negative", _anth(top_k=-1), "top_k"),
        ("top_k-float", _anth(top_k=2.5), "top_k"),
        ("stop_sequences-string", _anth(stop_sequences="END"), "stop_sequences"),
        ("stop_sequences-number", _anth(stop_sequences=[1]), "stop_sequences"),
        ("stop_sequences-empty-string", _anth(stop_sequences=[""]), "stop_sequences"),
        ("stop_sequences-object", _anth(stop_sequences={"END": True}), "stop_sequences"),
        ("stream-string", _anth(stream="yes"), "stream"),
        ("stream-number", _anth(stream=1), "stream"),
        ("tool_choice-string", _anth(tool_choice="auto"), "tool_choice"),
        ("tool_choice-any", _anth(tool_choice={"type": "any"}, tools=[A_TOOL]), "tool_choice"),
        ("tool_choice-tool", _anth(tool_choice={"type": "tool", "name": "get_weather"}, tools=[A_TOOL]),
         "tool_choice"),
        ("tool_choice-number", _anth(tool_choice=0), "tool_choice"),
        # thinking
        ("thinking-string", _anth(thinking="enabled"), "thinking"),
        ("thinking-type-missing", _anth(thinking={}), "thinking"),
        ("thinking-type-unknown", _anth(thinking={"type": "on", "budget_tokens": 2048}), "thinking"),
        ("thinking-budget-string", _anth(max_tokens=4096, thinking={"type": "enabled", "budget_tokens": "2048"}),
         "budget_tokens"),
        ("thinking-budget-missing", _anth(max_tokens=4096, thinking={"type": "enabled"}), "budget_tokens"),
        ("thinking-budget-float", _anth(max_tokens=4096, thinking={"type": "enabled", "budget_tokens": 2048.5}),
         "budget_tokens"),
        ("thinking-budget-true", _anth(max_tokens=4096, thinking={"type": "enabled", "budget_tokens": True}),
         "budget_tokens"),
        ("thinking-budget-below-1024", _anth(max_tokens=4096, thinking={"type": "enabled", "budget_tokens": 512}),
         "budget_tokens"),
        ("thinking-budget-over-max_tokens", _anth(max_tokens=2048, thinking={"type": "enabled",
                                                                           "budget_tokens": 4096}), "max_tokens"),
        # unknown and unsupported parameters, and the types of accepted ones
        ("unknown-parameter", _anth(foo=1), "foo"),
        ("openai-n", _anth(n=1), "n"),
        ("openai-stop", _anth(stop=["END"]), "stop"),
        ("openai-max_completion_tokens", _anth(max_completion_tokens=5), "max_completion_tokens"),
        ("openai-tools-shape", _anth(tools=[CHAT_TOOL]), "tools"),
        ("model-number", _anth(model=5), "model"),
        ("model-list", _anth(model=["m"]), "model"),
        ("metadata-string", _anth(metadata="user-1"), "metadata"),
        # tools
        ("tools-object", _anth(tools={"get_weather": A_TOOL}), "tools"),
        ("tools-string", _anth(tools="get_weather"), "tools"),
        ("tool-string", _anth(tools=["get_weather"]), "tools"),
        ("tool-input_schema-missing", _anth(tools=[_atool(input_schema=DROP)]), "input_schema"),
        ("tool-input_schema-null", _anth(tools=[_atool(input_schema=None)]), "input_schema"),
        ("tool-input_schema-string", _anth(tools=[_atool(input_schema="object")]), "input_schema"),
        ("tool-input_schema-list", _anth(tools=[_atool(input_schema=[SCHEMA])]), "input_schema"),
        ("tool-input_schema-string-schema", _anth(tools=[_atool(input_schema={"type": "string"})]), "input_schema"),
        ("tool-input_schema-type-missing", _anth(tools=[_atool(input_schema={"properties": {}})]), "input_schema"),
        ("tool-name-missing", _anth(tools=[_atool(name=DROP)]), "tools[0]"),
        ("tool-name-number", _anth(tools=[_atool(name=5)]), "tools[0]"),
        ("tool-name-empty", _anth(tools=[_atool(name="")]), "tools[0]"),
        ("tool-name-129-chars", _anth(tools=[_atool(name="a" * 129)]), "tools[0]"),
        *((f"tool-{key}", _anth(tools=[_atool(name=name)]), "tools[0]") for key, name in BAD_NAMES.items()),
        ("tool-names-duplicate", _anth(tools=[A_TOOL, A_TOOL]), "unique"),
        ("tool-description-number", _anth(tools=[_atool(description=5)]), "tools[0]"),
        ("tool-type-unknown", _anth(tools=[{"type": "shell", "name": "bash"}]), "tools[0]"),
        # limits
        ("limit-messages", _anth(messages=[USER] * (LIMITS.max_messages + 1)), "at most 16"),
        ("limit-tools", _anth(tools=[_atool(name=f"t{i}") for i in range(LIMITS.max_tools + 1)]), "at most 4"),
        ("limit-blocks", _turns(_user(*[_text()] * 9)), "at most 8"),
        ("limit-system-blocks", _anth(system=[_text()] * 9), "at most 8"),
        ("limit-tool_result-blocks", _turns(USER, used, _user(_result(content=[_text()] * 9))), "at most 8"),
        ("limit-string", _turns({"role": "user", "content": LONG}), "4096"),
        ("limit-system-string", _anth(system=LONG), "4096"),
        ("limit-tool_result-string", _turns(USER, used, _user(_result(content=LONG))), "4096"),
        ("limit-thinking-string", _turns(USER, _assistant({"type": "thinking", "thinking": LONG, "signature": "s"}),
                                         USER), "4096"),
        ("limit-input-string", _turns(USER, _assistant(_use(input={"city": LONG})), _user(_result())), "4096"),
        ("limit-stop-string", _anth(stop_sequences=[LONG]), "4096"),
        ("limit-schema-depth", _anth(tools=[_atool(input_schema=deep_schema(5))]), "nested more than 8"),
        ("limit-input-depth", _turns(USER, _assistant(_use(input=deep_value(12))), _user(_result())),
         "nested more than 8"),
    ]
    return [BadRequest("messages", id_, body, field, ANTHROPIC_INVALID, edge="messages" if _long(body) else None)
            for id_, body, field in e]


# --- OpenAI Responses -------------------------------------------------------------------------

R_TOOL = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": SCHEMA}


def _resp(**over: Any) -> dict[str, Any]:
    return _with({"model": "m", "input": "What is the weather in Oslo?", "max_output_tokens": 16}, over)


def _items(*items: Any, **over: Any) -> dict[str, Any]:
    return _resp(input=list(items), **over)


def _item(role: Any = "user", content: Any = "hi", **over: Any) -> dict[str, Any]:
    return _with({"type": "message", "role": role, "content": content}, over)


def _fc(call_id: Any = "call_1", name: Any = "get_weather", arguments: Any = ARGS, **over: Any) -> dict[str, Any]:
    return _with({"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}, over)


def _out(call_id: Any = "call_1", output: Any = "rainy", **over: Any) -> dict[str, Any]:
    return _with({"type": "function_call_output", "call_id": call_id, "output": output}, over)


def _rtool(**over: Any) -> dict[str, Any]:
    return _with(R_TOOL, over)


def _responses_entries() -> list[BadRequest]:
    q = _item()
    e: list[tuple[str, Any, str | None, str]] = [
        ("body-list", [_resp()], None, TYPE),
        ("body-string", "hello", None, TYPE),
        ("body-null", None, None, TYPE),
        ("body-number", 1.5, None, TYPE),
        ("body-empty-object", {}, "input", MISSING),
        # input
        ("input-missing", _resp(input=DROP), "input", MISSING),
        ("input-null", _resp(input=None), "input", MISSING),
        ("input-number", _resp(input=5), "input", TYPE),
        ("input-object", _resp(input=q), "input", TYPE),
        ("input-empty", _resp(input=[]), "input", EMPTY),
        ("item-string", _items("hi"), "input", TYPE),
        ("item-null", _items(None), "input", TYPE),
        ("item-list", _items([q]), "input", TYPE),
        ("item-type-unknown", _items({"type": "image", "url": "x"}), "input", VALUE),
        ("item-type-number", _items({"type": 5, "role": "user", "content": "hi"}), "input", TYPE),
        ("item-type-computer-call", _items({"type": "computer_call", "call_id": "c"}), "input", UNSUPPORTED),
        ("role-missing", _items(_item(role=DROP)), "input", MISSING),
        ("role-tool", _items(_item(role="tool")), "input", VALUE),
        ("role-number", _items(_item(role=1)), "input", TYPE),
        ("role-list", _items(_item(role=["user"])), "input", TYPE),
        ("role-object", _items(_item(role={"name": "user"})), "input", TYPE),
        ("content-missing", _items(_item(content=DROP)), "input", MISSING),
        ("content-number", _items(_item(content=5)), "input", TYPE),
        ("content-object", _items(_item(content={"type": "input_text", "text": "hi"})), "input", TYPE),
        ("part-image", _items(_item(content=[{"type": "input_image", "image_url": "x"}])), "input", UNSUPPORTED),
        ("part-file", _items(_item(content=[{"type": "input_file", "file_id": "f"}])), "input", UNSUPPORTED),
        ("part-type-missing", _items(_item(content=[{"text": "hi"}])), "input", MISSING),
        ("part-type-list", _items(_item(content=[{"type": ["input_text"], "text": "hi"}])), "input", TYPE),
        ("part-type-object", _items(_item(content=[{"type": {"t": 1}, "text": "hi"}])), "input", TYPE),
        ("part-string", _items(_item(content=["hi"])), "input", TYPE),
        ("part-text-number", _items(_item(content=[{"type": "input_text", "text": 5}])), "input", TYPE),
        # reasoning items
        ("reasoning-content-string", _items(q, {"type": "reasoning", "content": "thought"}), "input", TYPE),
        ("reasoning-part-text-number", _items(q, {"type": "reasoning", "summary": [{"type": "summary_text",
                                                                                   "text": 5}]}), "input", TYPE),
        ("reasoning-part-string", _items(q, {"type": "reasoning", "summary": ["thought"]}), "input", TYPE),
        ("reasoning-part-null", _items(q, {"type": "reasoning", "content": [None]}), "input", TYPE),
        # function calls and their outputs
        ("function_call-name-missing", _items(q, _fc(name=DROP), _out()), "input", MISSING),
        ("function_call-name-number", _items(q, _fc(name=5), _out()), "input", MISSING),
        ("function_call-call_id-missing", _items(q, _fc(call_id=DROP), _out()), "input", MISSING),
        ("function_call-call_id-number", _items(q, _fc(call_id=5), _out()), "input", MISSING),
        ("function_call-call_id-duplicate", _items(q, _fc(), _fc(), _out()), "input", PAIRING),
        ("function_call-arguments-missing", _items(q, _fc(arguments=DROP), _out()), "input", MISSING),
        ("function_call-arguments-object", _items(q, _fc(arguments={"city": "Oslo"}), _out()), "input", TYPE),
        ("function_call-arguments-number", _items(q, _fc(arguments=5), _out()), "input", TYPE),
        ("function_call-unanswered", _items(q, _fc()), "input", PAIRING),
        ("function_call-half-answered", _items(q, _fc(), _fc("call_2"), _out()), "input", PAIRING),
        ("output-call_id-missing", _items(q, _fc(), _out(call_id=DROP)), "input", MISSING),
        ("output-call_id-number", _items(q, _fc(), _out(call_id=1)), "input", MISSING),
        ("output-call_id-empty", _items(q, _fc(), _out(call_id="")), "input", MISSING),
        ("output-unknown-call_id", _items(q, _fc(), _out("call_2")), "input", PAIRING),
        ("output-without-call", _items(q, _out()), "input", PAIRING),
        ("output-twice", _items(q, _fc(), _out(), _out()), "input", PAIRING),
        ("output-number", _items(q, _fc(), _out(output=5)), "input", TYPE),
        ("output-object", _items(q, _fc(), _out(output={"text": "rainy"})), "input", TYPE),
        ("output-image-part", _items(q, _fc(), _out(output=[{"type": "input_image", "image_url": "x"}])), "input",
         UNSUPPORTED),
        # top-level parameters
        ("instructions-number", _resp(instructions=5), "instructions", TYPE),
        ("instructions-list", _resp(instructions=["be brief"]), "instructions", TYPE),
        ("previous_response_id-number", _resp(previous_response_id=5), "previous_response_id", VALUE),
        ("previous_response_id-malformed", _resp(previous_response_id="resp_123"), "previous_response_id", VALUE),
        ("previous_response_id-chat-id", _resp(previous_response_id="chatcmpl-" + "0" * 32), "previous_response_id",
         VALUE),
        ("max_output_tokens-string", _resp(max_output_tokens="16"), "max_output_tokens", TYPE),
        ("max_output_tokens-zero", _resp(max_output_tokens=0), "max_output_tokens", BELOW_MIN),
        ("max_output_tokens-negative", _resp(max_output_tokens=-16), "max_output_tokens", BELOW_MIN),
        ("max_output_tokens-float", _resp(max_output_tokens=16.5), "max_output_tokens", TYPE),
        ("max_output_tokens-true", _resp(max_output_tokens=True), "max_output_tokens", TYPE),
        ("temperature-string", _resp(temperature="1"), "temperature", TYPE),
        ("temperature-above-2", _resp(temperature=3), "temperature", DECIMAL_ABOVE_MAX),
        ("temperature-false", _resp(temperature=False), "temperature", TYPE),
        ("top_p-string", _resp(top_p="0.5"), "top_p", TYPE),
        ("top_p-above-1", _resp(top_p=1.01), "top_p", DECIMAL_ABOVE_MAX),
        ("stream-string", _resp(stream="false"), "stream", TYPE),
        ("background-true", _resp(background=True), "background", UNSUPPORTED),
        ("background-string", _resp(background="no"), "background", TYPE),
        ("tool_choice-required", _resp(tool_choice="required", tools=[R_TOOL]), "tool_choice", UNSUPPORTED),
        ("tool_choice-named", _resp(tool_choice={"type": "function", "name": "get_weather"}, tools=[R_TOOL]),
         "tool_choice", UNSUPPORTED),
        ("text-json-schema", _resp(text={"format": {"type": "json_schema", "name": "x", "schema": {}}}), "text",
         UNSUPPORTED),
        ("text-format-string", _resp(text={"format": "text"}), "text", TYPE),
        ("text-string", _resp(text="plain"), "text", TYPE),
        ("unknown-parameter", _resp(foo=1), "foo", UNKNOWN),
        ("chat-messages", _resp(messages=[USER]), "messages", UNKNOWN),
        ("chat-max_tokens", _resp(max_tokens=16), "max_tokens", UNKNOWN),
        ("top_k", _resp(top_k=5), "top_k", UNKNOWN),
        ("model-number", _resp(model=5), "model", TYPE),
        ("metadata-list", _resp(metadata=["x"]), "metadata", TYPE),
        ("store-string", _resp(store="false"), "store", TYPE),
        ("parallel_tool_calls-string", _resp(parallel_tool_calls="true"), "parallel_tool_calls", TYPE),
        ("reasoning-string", _resp(reasoning="high"), "reasoning", TYPE),
        ("include-string", _resp(include="reasoning.encrypted_content"), "include", TYPE),
        # tools
        ("tools-object", _resp(tools={"get_weather": R_TOOL}), "tools", TYPE),
        ("tools-string", _resp(tools="get_weather"), "tools", TYPE),
        ("tool-string", _resp(tools=["get_weather"]), "tools", TYPE),
        ("tool-type-missing", _resp(tools=[_rtool(type=DROP)]), "tools", MISSING),
        ("tool-type-unknown", _resp(tools=[{"type": "browser"}]), "tools", VALUE),
        ("tool-namespace-name-missing", _resp(tools=[{"type": "namespace", "tools": [R_TOOL]}]), "tools", MISSING),
        ("tool-namespace-hosted-inside", _resp(tools=[{"type": "namespace", "name": "ns", "tools": [
            {"type": "web_search"}]}]), "tools", VALUE),
        ("tool-namespace-collides", _resp(tools=[{"type": "namespace", "name": "ns", "tools": [
            {**R_TOOL, "name": "x"}]}, {**R_TOOL, "name": "ns__x"}]), "tools", VALUE),
        ("item-reference", _items(USER, {"type": "item_reference", "id": "msg_1"}), "input", UNSUPPORTED),
        ("item-compaction", _items({"type": "compaction", "encrypted_content": "x"}, USER), "input", UNSUPPORTED),
        ("conversation", _resp(conversation="conv_1"), "conversation", UNSUPPORTED_PARAMETER),
        ("top_logprobs", _resp(top_logprobs=2), "top_logprobs", UNSUPPORTED),
        ("tool-chat-shape", _resp(tools=[CHAT_TOOL]), "tools", MISSING),
        ("tool-name-missing", _resp(tools=[_rtool(name=DROP)]), "tools", MISSING),
        ("tool-name-number", _resp(tools=[_rtool(name=5)]), "tools", TYPE),
        ("tool-name-65-chars", _resp(tools=[_rtool(name="b" * 65)]), "tools", VALUE),
        *((f"tool-{key}", _resp(tools=[_rtool(name=name)]), "tools", VALUE) for key, name in BAD_NAMES.items()),
        ("tool-description-list", _resp(tools=[_rtool(description=["x"])]), "tools", TYPE),
        ("tool-parameters-string", _resp(tools=[_rtool(parameters="object")]), "tools", TYPE),
        ("tool-parameters-string-schema", _resp(tools=[_rtool(parameters={"type": "string"})]), "tools", VALUE),
        # limits
        ("limit-items", _resp(input=[q] * (LIMITS.max_messages + 1)), "input", TOO_MANY),
        ("limit-tools", _resp(tools=[_rtool(name=f"t{i}") for i in range(LIMITS.max_tools + 1)]), "tools", TOO_MANY),
        ("limit-parts", _items(_item(content=[{"type": "input_text", "text": "x"}] * 9)), "input", TOO_MANY),
        ("limit-summary-parts", _items(q, {"type": "reasoning", "summary": [{"type": "summary_text",
                                                                            "text": "x"}] * 9}), "input", TOO_MANY),
        ("limit-output-parts", _items(q, _fc(), _out(output=[{"type": "input_text", "text": "x"}] * 9)), "input",
         TOO_MANY),
        ("limit-string", _resp(input=LONG), "messages", TOO_LONG),
        ("limit-item-string", _items(_item(content=LONG)), "messages", TOO_LONG),
        ("limit-instructions-string", _resp(instructions=LONG), "messages", TOO_LONG),
        ("limit-output-string", _items(q, _fc(), _out(output=LONG)), "messages", TOO_LONG),
        ("limit-arguments-string", _items(q, _fc(arguments=json.dumps({"city": LONG})), _out()), "messages",
         TOO_LONG),
        ("limit-schema-depth", _resp(tools=[_rtool(parameters=deep_schema(5))]), "tools", TOO_DEEP),
        ("limit-arguments-depth", _items(q, _fc(arguments=json.dumps(deep_value(12))), _out()), "input", TOO_DEEP),
    ]
    return [BadRequest("responses", id_, body, field, code,
                       edge=("instructions" if "instructions" in body else "input") if code == TOO_LONG else None)
            for id_, body, field, code in e]


CORPUS: list[BadRequest] = [*_chat_entries(), *_messages_entries(), *_responses_entries()]

# Valid bodies of each dialect: the corpus entries' starting points, the fuzzer's seeds, and the
# requests that show a worker still serving. Each is within LIMITS.
GOOD: dict[Dialect, list[dict[str, Any]]] = {
    "chat": [
        _chat(),
        _chat(tools=[CHAT_TOOL], tool_choice="auto", parallel_tool_calls=True, temperature=0.5, top_p=0.9, top_k=20,
              seed=7, stop=["END"], n=1, user="agent-1", metadata={"k": "v"}, store=False,
              stream_options={"include_usage": True}),
        _msgs({"role": "system", "content": "Be brief."}, USER, _asst(_call(), content=""), _tool(),
              {"role": "assistant", "content": "Rainy.", "reasoning_content": "The tool said so."},
              {"role": "user", "content": [{"type": "text", "text": "Thanks!"}]}, tools=[CHAT_TOOL]),
    ],
    "messages": [
        _anth(),
        _anth(system=[_text("Be brief.")], tools=[A_TOOL], tool_choice={"type": "auto"}, temperature=0.5, top_p=0.9,
              top_k=20, stop_sequences=["END"], metadata={"user_id": "agent-1"}, max_tokens=4096,
              thinking={"type": "enabled", "budget_tokens": 2048}),
        _turns(USER, _assistant({"type": "thinking", "thinking": "Look it up.", "signature": "s"}, _use()),
               _user(_result(content=[_text("rainy")]), _text("Thanks!")), system="Be brief.", tools=[A_TOOL]),
    ],
    "responses": [
        _resp(),
        _resp(instructions="Be brief.", tools=[R_TOOL], tool_choice="auto", temperature=0.5, top_p=0.9,
              text={"format": {"type": "text"}}, parallel_tool_calls=True, store=False, metadata={"k": "v"},
              reasoning={"effort": "low"}, include=[]),
        _items(_item(role="developer", content="Be brief."), _item(content=[{"type": "input_text", "text": "hi"}]),
               {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Look it up."}]}, _fc(), _out(),
               _item(role="assistant", content=[{"type": "output_text", "text": "Rainy."}]),
               tools=[R_TOOL]),
    ],
}


# Bodies the real APIs accept that an earlier version of this corpus expected a 400 for (the gateway's validation
# was written from the API references, not from the SDKs' types and real clients): each is served now.
ACCEPTED: dict[Dialect, list[dict[str, Any]]] = {
    "chat": [
        _chat(logit_bias={"1": 5}),
        _chat(frequency_penalty=0.5, presence_penalty=-0.5),
        _chat(tools=[{"type": "custom", "custom": {"name": "apply_patch", "format": {"type": "text"}}}]),
        _chat(web_search_options={}),  # a hosted tool: left out of the prompt and counted
        _chat(reasoning_effort="low", verbosity="low", prompt_cache_key="k", prediction={"type": "content",
              "content": "x"}, modalities=["text"], response_format={"type": "text"}, logprobs=False),
        _msgs({"role": "user", "content": "hi"}, {"role": "system", "content": "Now be brief."}, USER),
    ],
    "messages": [
        _turns({"role": "system", "content": "be brief"}, USER),
        _turns(USER, {"role": "system", "content": [_text("env: linux")], "clear_at": "next_user_message"}, USER),
        _anth(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
        _anth(tools=[{"type": "bash_20250124", "name": "bash"}, {**A_TOOL, "defer_loading": True, "strict": True}]),
        _anth(thinking={"type": "adaptive", "display": "omitted"}, output_config={"effort": "medium"},
              context_management={"edits": []}, betas=["x"], cache_control={"type": "ephemeral"}),
    ],
    "responses": [
        _resp(tools=[{"type": "web_search"}, {"type": "local_shell"}]),
        _resp(client_metadata={"x-codex-window-id": "w"}, prompt_cache_key="k",
              include=["reasoning.encrypted_content"]),
        _resp(tools=[{"type": "namespace", "name": "multi_agent", "description": "d", "tools": [R_TOOL]},
                     {"type": "custom", "name": "apply_patch", "format": {"type": "grammar", "syntax": "lark",
                                                                           "definition": "start: /.+/"}}]),
        _items({"type": "message", "id": "msg_1", "role": "developer", "content": [{"type": "input_text",
                                                                                  "text": "Be brief."}]}, USER),
    ],
}


def mismatch(entry: BadRequest, status: int, error_json: Any) -> str | None:
    """How an answer (status and the dialect's error JSON) differs from the entry's, or None if it is the one."""
    if status != entry.status:
        return f"status {status}, expected {entry.status}: {error_json!r:.300}"
    error = error_json.get("error") if isinstance(error_json, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return f"not the dialect's error shape: {error_json!r:.300}"
    if entry.dialect == "messages":
        if error_json.get("type") != "error" or error.get("type") != entry.code:
            return f"error.type {error.get('type')!r}, expected {entry.code!r}: {error['message']}"
        if entry.field is not None and entry.field not in error["message"]:
            return f"the message does not name {entry.field!r}: {error['message']}"
        return None
    if error.get("type") != "invalid_request_error" or error.get("code") != entry.code:
        return f"error.type {error.get('type')!r} / code {error.get('code')!r}, expected {entry.code!r}: {error}"
    param, edge = error.get("param"), entry.edge
    at_edge = edge is not None and isinstance(param, str) and (param == edge or param.startswith(edge + "."))
    if param != entry.field and not at_edge:
        return f"error.param {param!r}, expected {entry.field!r}: {error['message']}"
    return None
