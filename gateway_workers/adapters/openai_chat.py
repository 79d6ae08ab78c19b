"""OpenAI Chat Completions dialect: wire body -> TurnRequest, CapturedTurn / LiveTurn -> wire reply.

Validation is strict on purpose: a parameter we cannot honour (n > 1, logit_bias,
response_format, penalties, ...) gets a 400 that names it, never silent ignoring.
Assistant echoes are canonicalized (arguments parsed to objects, wire ids dropped,
`reasoning_content`/`reasoning` kept as `reasoning`) so the next turn's prompt matches
the stored response message. Streams are live: chunks go out while the engine generates.
No I/O here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

from gateway_workers.adapters.base import no_history
from gateway_workers.adapters.common import (
    OpenCalls,
    arguments_json,
    bad,
    canonical_tools,
    check_types,
    earlier_elements,
    flag,
    integer,
    number,
    parse_arguments,
)
from gateway_workers.http.errors import ApiError
from gateway_workers.http.limits import DEFAULT_LIMITS, RequestLimits, check_count, check_parts, check_turn
from gateway_workers.turns.live import LiveTurn
from gateway_workers.turns.pipeline import CapturedTurn, TurnRequest, tool_call_id

# Accepted and without effect on a token-in/token-out turn.
HISTORY_FIELD = "messages"  # the conversation, which grows at its end (`Adapter.HISTORY_FIELD`)
_IGNORED = {"model", "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
_HANDLED = {
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "seed",
    "n",
    "stream",
    "stream_options",
}
_ROLES = {"system", "developer", "user", "assistant", "tool"}
_TYPES = {"model": str, "user": str, "metadata": dict, "store": bool, "service_tier": str, "prompt_cache_key": str,
          "safety_identifier": str, "stream_options": dict}

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


def _text(content: Any, where: str, limits: RequestLimits) -> str:
    """String content, or a list of text parts joined with newlines (as vLLM does)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        check_parts(content, limits, "messages")
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(f"{where}: content part of type {kind!r} is not supported (text only)", "messages")
            if not isinstance(part.get("text"), str):
                raise bad(f"{where}: a text part needs a string 'text'", "messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad(f"{where}: 'content' must be a string or a list of parts", "messages")


def _message(raw: Any, index: int, pending: OpenCalls, limits: RequestLimits) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise bad(f"messages[{index}] must be an object", "messages")
    role = raw.get("role")
    if type(role) is not str or role not in _ROLES:
        raise bad(f"messages[{index}]: unknown role {role!r}", "messages")
    if role != "tool" and pending:
        raise bad(
            "an assistant message with 'tool_calls' must be followed by tool messages responding to each "
            f"'tool_call_id'; these did not have response messages: {', '.join(pending)}",
            f"messages.[{index}].role",
        )
    content = raw.get("content")
    if content is None and role != "assistant":  # only an assistant message may leave it out (or null)
        raise bad(f"missing required parameter: 'messages[{index}].content'", f"messages.[{index}].content",
                  code="missing_required_parameter")
    message: dict[str, Any] = {
        "role": "system" if role == "developer" else role,
        # plain text (nearly every message) skips the call; `where` is formatted only for an error
        "content": content if type(content) is str else _text(content, f"messages[{index}]", limits),
    }
    if role == "assistant":
        reasoning = raw.get("reasoning_content", raw.get("reasoning"))
        if reasoning is not None and not isinstance(reasoning, str):
            raise bad(f"messages[{index}]: 'reasoning_content' must be a string", "messages")
        if reasoning:
            message["reasoning"] = reasoning
        calls = raw.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise bad(f"messages[{index}]: 'tool_calls' must be a list", f"messages.[{index}].tool_calls")
        if calls:
            message["tool_calls"] = [_call(call, index, j, pending, limits) for j, call in enumerate(calls)]
    elif role == "tool":
        call_id = raw.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad(f"missing required parameter: 'messages[{index}].tool_call_id' (a string)",
                      f"messages.[{index}].tool_call_id", code="missing_required_parameter")
        name = pending.pop(call_id, None)
        if name is None:
            raise bad(f"messages[{index}]: a message with role 'tool' must be a response to a preceding message "
                      f"with 'tool_calls' (no open call has id {call_id!r})", f"messages.[{index}].tool_call_id")
        given = raw.get("name")
        message["name"] = given if isinstance(given, str) and given else name
    return message


def _call(call: Any, index: int, j: int, pending: OpenCalls, limits: RequestLimits) -> dict[str, Any]:
    """An echoed tool call -> canonical (name + parsed arguments); its id opens a call the tool messages answer."""
    fn = call.get("function") if type(call) is dict else None
    if type(fn) is not dict:
        raise _bad_call(call, index, j)
    name, call_id, arguments = fn.get("name"), call.get("id"), fn.get("arguments")
    if (type(name) is not str or not name or type(call_id) is not str or not call_id or type(arguments) is not str
            or call.get("type", "function") != "function"):
        raise _bad_call(call, index, j)
    if call_id in pending:
        raise bad(f"messages[{index}].tool_calls[{j}]: duplicate tool call id {call_id!r}",
                  f"messages.[{index}].tool_calls.[{j}].id")
    pending[call_id] = name
    return {"name": name, "arguments": parse_arguments(arguments, limits, "messages")}


def _bad_call(call: Any, index: int, j: int) -> ApiError:
    """What is wrong with an echoed tool call, naming the field (the error path only: `_call` checks in one go)."""
    where, param = f"messages[{index}].tool_calls[{j}]", f"messages.[{index}].tool_calls.[{j}]"
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        return bad(f"{where} needs function.name", f"{param}.function.name")
    if call.get("type", "function") != "function":
        return bad(f"{where}: only function tool calls are supported", f"{param}.type")
    if not isinstance(call.get("id"), str) or not call["id"]:
        return bad(f"missing required parameter: '{where}.id' (a string)", f"{param}.id",
                   code="missing_required_parameter")
    arguments = fn.get("arguments")
    return bad(f"{where}.function.arguments must be a string (of JSON)", f"{param}.function.arguments",
               code="missing_required_parameter" if arguments is None else "invalid_request")


def _function_fields(tool: dict[str, Any]) -> tuple[Any, Any, Any]:
    fn = tool.get("function")
    fn = fn if isinstance(fn, dict) else {}
    return fn.get("name"), fn.get("description"), fn.get("parameters")


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    return canonical_tools(raw, "function", _function_fields)


class ChatRequest:
    """A validated Chat Completions body; `raw_messages`, its messages as sent, which the next request's parse
    compares its own with (`Adapter.parse_request`'s `earlier`)."""

    __slots__ = ("turn", "stream", "include_usage", "raw_messages")

    def __init__(self, turn: TurnRequest, stream: bool, include_usage: bool, raw_messages: list[Any]) -> None:
        self.turn = turn
        self.stream = stream
        self.include_usage = include_usage
        self.raw_messages = raw_messages


load_history = no_history  # a request carries its whole conversation


def parse_request(body: Any, limits: RequestLimits = DEFAULT_LIMITS, earlier: ChatRequest | None = None) -> ChatRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    unknown = sorted(set(body) - _HANDLED - _IGNORED)
    if unknown:
        raise bad(f"unsupported parameter(s): {', '.join(unknown)}", unknown[0])
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise bad("'messages' must be a non-empty list", "messages")
    check_count(len(raw_messages), limits.max_messages, "messages", "messages")
    check_types(body, _TYPES)
    if integer(body, "n", 1) not in (1, None):
        raise bad("only n=1 is supported", "n")
    flag(body, "parallel_tool_calls")  # a boolean, whichever: a reply's calls are all kept
    tool_choice = body.get("tool_choice", "auto")
    if tool_choice not in ("auto", None):
        raise bad("only tool_choice='auto' is supported", "tool_choice")
    pending: OpenCalls = {}
    # A message converts to one canonical message, whatever comes before it but open calls
    start = earlier_elements(earlier.raw_messages, raw_messages) if earlier is not None else 0
    messages = earlier.turn.messages[:start] if earlier is not None else []
    messages += [_message(m, i, pending, limits) for i, m in enumerate(raw_messages[start:], start)]
    if pending:
        raise bad(
            "an assistant message with 'tool_calls' must be followed by tool messages responding to each "
            f"'tool_call_id'; these did not have response messages: {', '.join(pending)}",
            f"messages.[{len(raw_messages) - 1}].tool_calls",
        )
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise bad("'stop' must be a string or a list of non-empty strings", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise bad("'stream_options.include_usage' must be a boolean", "stream_options.include_usage")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad("'seed' must be an integer", "seed")
    max_tokens = integer(body, "max_completion_tokens", 1) or integer(body, "max_tokens", 1)
    tools = _tools(body.get("tools"))
    check_turn(tools, limits)
    turn = TurnRequest(
        messages=messages,
        tools=tools,
        max_tokens=max_tokens,
        temperature=number(body, "temperature", 0.0, 2.0),
        top_p=number(body, "top_p", 0.0, 1.0),
        top_k=integer(body, "top_k", -1),
        stop=tuple(stop or ()),
        seed=seed,
    )
    return ChatRequest(turn, stream, bool(include_usage), raw_messages)


def _wire_call(turn_id: str, index: int, call: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": tool_call_id("call_", turn_id, index),
        "type": "function",
        "function": {"name": call["name"], "arguments": arguments_json(call["arguments"])},
    }


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def response_body(turn: CapturedTurn, chat: ChatRequest, model: str) -> bytes:
    message: dict[str, Any] = {"role": "assistant", "content": turn.parsed.content}
    if turn.parsed.reasoning:
        message["reasoning_content"] = turn.parsed.reasoning
    if turn.parsed.tool_calls:
        message["tool_calls"] = [_wire_call(turn.turn_id, i, c) for i, c in enumerate(turn.parsed.tool_calls)]
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


async def stream_events(live: LiveTurn, chat: ChatRequest, model: str) -> AsyncIterator[bytes]:
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
            else:
                assert delta.call is not None
                yield chunk({"tool_calls": [{"index": calls, **_wire_call(live.turn_id, calls, delta.call)}]})
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
