"""OpenAI Chat Completions dialect: wire body -> TurnRequest, CapturedTurn / LiveReply -> wire reply.

Every field has one verdict (`request_fields.CHAT`): honoured, ignored (accepted and counted), refused with
the API's own 400 (n > 1, JSON modes, logprobs, audio, the deprecated functions API, ...), or hosted
(`web_search_options`). Messages convert in `chat_messages`, so that an echoed reply matches the stored
response message; custom (freeform) tools go through `adapters.tools`. Streams are live: chunks go out while
the engine generates. No I/O here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson

from gateway_workers.adapters import request_fields
from gateway_workers.adapters.base import no_history
from gateway_workers.adapters.chat_messages import canonical_message
from gateway_workers.adapters.common import (
    KEEPALIVE,
    OpenCalls,
    arguments_json,
    bad,
    check_known,
    check_object,
    check_tool_choice,
    check_types,
    earlier_elements,
    flag,
    integer,
    invalid_type,
    non_empty_list,
    number,
    unsupported,
    wrong_value,
)
from gateway_workers.adapters.tool_readers import chat_tools
from gateway_workers.adapters.tools import (
    NO_TOOLS,
    ToolSet,
    custom_input,
)
from gateway_workers.engines.base import SHARED_SAMPLING
from gateway_workers.http.errors import ApiError
from gateway_workers.http.limits import DEFAULT_LIMITS, RequestLimits, check_count, check_turn
from gateway_workers.turns.captured import CapturedTurn, LiveReply, TurnRequest, tool_call_id

HISTORY_FIELD = "messages"  # the conversation, which grows at its end (`Adapter.HISTORY_FIELD`)
_KNOWN = request_fields.known_fields("chat")
# Fields few requests carry: refused unless harmless (`_refuse_unserved`), or more of the sampling.
_RARE = SHARED_SAMPLING | {"n", "audio", "functions", "function_call", "logprobs", "top_logprobs",
                           "response_format", "modalities"}
_TYPES = {"model": str, "user": str, "metadata": dict, "store": bool, "service_tier": str, "prompt_cache_key": str,
          "safety_identifier": str, "stream_options": dict, "chat_template_kwargs": dict}

_ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "rate_limit": "rate_limit_error",
    "engine": "api_error",
    "timeout": "api_error",
    "unavailable": "api_error",
    "internal": "api_error",
    "too_large": "invalid_request_error",
    "headers_too_large": "invalid_request_error",
}


def error_body(error: ApiError) -> dict[str, Any]:
    return {
        "error": {
            "message": error.message,
            "type": _ERROR_TYPES.get(error.kind, "api_error"),
            "param": error.param,
            "code": error.code,
        }
    }


def _refuse_unserved(body: dict[str, Any]) -> None:
    """The fields whose meaning this gateway cannot give (`request_fields`: refused), when they ask for it."""
    if integer(body, "n", 1) not in (1, None):
        raise unsupported("n", "above 1 is not served: one choice per request")
    for name in ("audio", "functions", "function_call"):
        if body.get(name) is not None:
            raise unsupported(name, "is not served (audio output; the deprecated functions API: use tools)", False)
    if flag(body, "logprobs"):
        raise unsupported("logprobs", "is not served: the sampled logprobs are recorded for training, not returned")
    if integer(body, "top_logprobs", 0):
        raise unsupported("top_logprobs", "is not served: the sampled logprobs are recorded, not returned")
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind in ("json_object", "json_schema"):
            raise unsupported("response_format", f"{kind!r} needs constrained decoding, which is not served")
        if kind != "text":
            raise wrong_value("response_format.type", kind, ("text", "json_object", "json_schema"), "response_format")
    modalities = body.get("modalities")
    if modalities is not None:
        if not isinstance(modalities, list) or not all(isinstance(m, str) for m in modalities):
            raise invalid_type("modalities", "an array of strings", modalities)
        if any(m != "text" for m in modalities):
            raise unsupported("modalities", "only text output is served")


def _more_sampling(body: dict[str, Any]) -> dict[str, Any] | None:
    """Penalties, min_p and logit_bias, as the engines take them (`engines.base.SHARED_SAMPLING`)."""
    more: dict[str, Any] = {}
    for name, lo, hi in (("frequency_penalty", -2.0, 2.0), ("presence_penalty", -2.0, 2.0),
                         ("repetition_penalty", 0.0, 2.0), ("min_p", 0.0, 1.0)):
        value = number(body, name, lo, hi)
        if value is not None:
            more[name] = value
    raw = body.get("logit_bias")
    if raw is not None and not isinstance(raw, dict):
        raise invalid_type("logit_bias", "an object", raw)
    for token, value in (raw or {}).items():
        if not token.isdigit() or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("Invalid 'logit_bias': keys must be token ids and values numbers between -100 and 100.",
                      "logit_bias", "invalid_value")
        if not -100 <= value <= 100:
            raise bad(f"Invalid 'logit_bias': the bias of token {token} must be between -100 and 100.", "logit_bias",
                      "invalid_value")
        more.setdefault("logit_bias", {})[str(int(token))] = float(value)
    return more or None


@dataclass(slots=True, eq=False)
class ChatRequest:
    """A validated Chat Completions body; `raw_messages`, its messages as sent, which the next request's parse
    compares its own with (`Adapter.parse_request`'s `earlier`); `toolset` maps calls back to the wire."""

    turn: TurnRequest
    stream: bool
    include_usage: bool
    raw_messages: list[Any]
    toolset: ToolSet = NO_TOOLS
    ignored: tuple[str, ...] = ()

    @property
    def hosted(self) -> tuple[tuple[str, str], ...]:
        return self.toolset.hosted


load_history = no_history  # a request carries its whole conversation


def parse_request(body: Any, limits: RequestLimits = DEFAULT_LIMITS, earlier: ChatRequest | None = None) -> ChatRequest:
    body = check_object(body)
    top_ignored = check_known(body, _KNOWN)
    raw_messages = non_empty_list(body.get("messages"), "messages", "an array")
    check_count(len(raw_messages), limits.max_messages, "messages", "messages")
    check_types(body, _TYPES)
    more = None
    if not _RARE.isdisjoint(body):  # a few requests carry any of them: the rest skip their checks
        _refuse_unserved(body)
        more = _more_sampling(body)
    flag(body, "parallel_tool_calls")  # a boolean, whichever: a reply's calls are all kept
    check_tool_choice(body)
    pending: OpenCalls = {}
    ignored: set[str] = set()
    # A message converts to one canonical message, whatever comes before it but open calls
    start = earlier_elements(earlier.raw_messages, raw_messages) if earlier is not None else 0
    messages = earlier.turn.messages[:start] if earlier is not None else []
    messages += [canonical_message(m, i, pending, limits, ignored) for i, m in enumerate(raw_messages[start:], start)]
    if pending:
        raise bad(
            "an assistant message with 'tool_calls' must be followed by tool messages responding to each "
            f"'tool_call_id'; these did not have response messages: {', '.join(pending)}",
            f"messages.[{len(raw_messages) - 1}].tool_calls",
        )
    stop = body.get("stop")
    if isinstance(stop, str):
        if not stop:
            raise bad("Invalid 'stop': empty string.", "stop", "invalid_value")
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise invalid_type("stop", "a string or an array of non-empty strings", stop)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid_type("stream", "a boolean", stream)
    options = body.get("stream_options") or {}
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise invalid_type("stream_options.include_usage", "a boolean", include_usage)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise invalid_type("seed", "an integer", seed)
    max_tokens = integer(body, "max_completion_tokens", 1) or integer(body, "max_tokens", 1)
    toolset = chat_tools(body.get("tools"), body.get("web_search_options"))
    check_turn(toolset.tools, limits)
    turn = TurnRequest(
        messages=messages,
        tools=toolset.tools,
        max_tokens=max_tokens,
        temperature=number(body, "temperature", 0.0, 2.0),
        top_p=number(body, "top_p", 0.0, 1.0),
        top_k=integer(body, "top_k", -1),
        stop=tuple(stop or ()),
        seed=seed,
        sampling=more,
    )
    if ignored or toolset.ignored:
        top_ignored = (*top_ignored, *sorted(ignored | toolset.ignored))
    return ChatRequest(turn, stream, bool(include_usage), raw_messages, toolset, top_ignored)


def _wire_call(turn_id: str, index: int, call: dict[str, Any], toolset: ToolSet) -> dict[str, Any]:
    call_id = tool_call_id("call_", turn_id, index)
    if call["name"] in toolset.custom:
        return {"id": call_id, "type": "custom", "custom": {"name": call["name"],
                                                             "input": custom_input(call["arguments"])}}
    return {"id": call_id, "type": "function",
            "function": {"name": call["name"], "arguments": arguments_json(call["arguments"])}}


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def response_body(turn: CapturedTurn, chat: ChatRequest, model: str) -> bytes:
    message: dict[str, Any] = {"role": "assistant", "content": turn.parsed.content}
    if turn.parsed.reasoning:
        message["reasoning_content"] = turn.parsed.reasoning
    if turn.parsed.tool_calls:
        message["tool_calls"] = [_wire_call(turn.turn_id, i, c, chat.toolset)
                                 for i, c in enumerate(turn.parsed.tool_calls)]
        message["content"] = turn.parsed.content or None
    return orjson.dumps(
        {
            "id": f"chatcmpl-{turn.turn_id}",
            "object": "chat.completion",
            "created": turn.created,
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": turn.finish_reason, "logprobs": None}],
            "usage": _usage(len(turn.prompt_ids), len(turn.result.output_ids)),
        }
    )


async def stream_events(live: LiveReply, chat: ChatRequest, model: str) -> AsyncIterator[bytes]:
    """The SSE chunks of a live turn as it is generated, ending with `data: [DONE]`."""
    head = {
        "id": f"chatcmpl-{live.turn_id}",
        "object": "chat.completion.chunk",
        "created": live.created,
        "model": model,
    }

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        body = {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
        return b"data: " + orjson.dumps(body) + b"\n\n"

    yield chunk({"role": "assistant", "content": ""})
    calls = 0
    try:
        async for delta in live.deltas():
            if delta.kind == "reasoning":
                yield chunk({"reasoning_content": delta.text})
            elif delta.kind == "content":
                yield chunk({"content": delta.text})
            elif delta.kind == "keepalive":
                yield KEEPALIVE
            else:
                assert delta.call is not None
                wire = _wire_call(live.turn_id, calls, delta.call, chat.toolset)
                yield chunk({"tool_calls": [{"index": calls, **wire}]})
                calls += 1
    except ApiError as e:
        yield b"data: " + orjson.dumps(error_body(e)) + b"\n\n"  # the SDKs raise on an `error` chunk
        raise
    turn = live.turn
    assert turn is not None
    yield chunk({}, turn.finish_reason)
    if chat.include_usage:
        usage = _usage(len(turn.prompt_ids), len(turn.result.output_ids))
        yield b"data: " + orjson.dumps({**head, "choices": [], "usage": usage}) + b"\n\n"
    yield b"data: [DONE]\n\n"
