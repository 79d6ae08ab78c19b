"""OpenAI Chat Completions dialect: wire body -> TurnRequest, CapturedTurn -> wire reply.

Validation is strict on purpose: a parameter we cannot honour (n > 1, logit_bias,
response_format, penalties, ...) gets a 400 that names it, never silent ignoring.
Assistant echoes are canonicalized (arguments parsed to objects, wire ids dropped,
`reasoning_content`/`reasoning` kept as `reasoning`) so the next turn's prompt matches
the stored response message. No I/O here.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from gateway_workers.turns import ApiError, CapturedTurn, TurnRequest

# Accepted and without effect on a token-in/token-out turn.
_IGNORED = {"model", "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
_HANDLED = {
    "messages", "tools", "tool_choice", "parallel_tool_calls", "max_tokens", "max_completion_tokens",
    "temperature", "top_p", "top_k", "stop", "seed", "n", "stream", "stream_options",
}
_ROLES = {"system", "developer", "user", "assistant", "tool"}

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


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, "invalid_request", message, code="invalid_request", param=param)


def _number(body: dict[str, Any], name: str, lo: float, hi: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise _bad(f"'{name}' must be a number between {lo} and {hi}", name)
    return float(value)


def _integer(body: dict[str, Any], name: str, lo: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise _bad(f"'{name}' must be an integer >= {lo}", name)
    return value


def _text(content: Any, where: str) -> str:
    """String content, or a list of text parts joined with newlines (as vLLM does)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _bad(f"{where}: content part of type {kind!r} is not supported (text only)", "messages")
            if not isinstance(part.get("text"), str):
                raise _bad(f"{where}: a text part needs a string 'text'", "messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise _bad(f"{where}: 'content' must be a string or a list of parts", "messages")


def _arguments(raw: Any) -> Any:
    """Wire arguments (a JSON string) -> canonical (an object); unparseable text stays text."""
    if isinstance(raw, str):
        try:
            return orjson.loads(raw) if raw.strip() else {}
        except orjson.JSONDecodeError:
            return raw
    return raw if raw is not None else {}


def _message(raw: Any, index: int, call_names: dict[str, str]) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(raw, dict):
        raise _bad(f"{where} must be an object", "messages")
    role = raw.get("role")
    if role not in _ROLES:
        raise _bad(f"{where}: unknown role {role!r}", "messages")
    message: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": _text(raw.get("content"), where)}
    if role == "assistant":
        reasoning = raw.get("reasoning_content", raw.get("reasoning"))
        if reasoning:
            if not isinstance(reasoning, str):
                raise _bad(f"{where}: 'reasoning_content' must be a string", "messages")
            message["reasoning"] = reasoning
        calls = raw.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise _bad(f"{where}: 'tool_calls' must be a list", "messages")
            canonical = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise _bad(f"{where}.tool_calls[{j}] needs function.name", "messages")
                if isinstance(call.get("id"), str):
                    call_names[call["id"]] = fn["name"]
                canonical.append({"name": fn["name"], "arguments": _arguments(fn.get("arguments"))})
            message["tool_calls"] = canonical
    elif role == "tool":
        name = raw.get("name") or call_names.get(raw.get("tool_call_id") or "")
        if name:
            message["name"] = name
    return message


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise _bad("'tools' must be a list", "tools")
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _bad(f"tools[{i}]: only function tools are supported", "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"tools[{i}] needs function.name", "tools")
    return raw


class ChatRequest:
    """A validated Chat Completions body."""

    __slots__ = ("turn", "stream", "include_usage")

    def __init__(self, turn: TurnRequest, stream: bool, include_usage: bool) -> None:
        self.turn = turn
        self.stream = stream
        self.include_usage = include_usage


def parse_request(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    unknown = sorted(set(body) - _HANDLED - _IGNORED)
    if unknown:
        raise _bad(f"unsupported parameter(s): {', '.join(unknown)}", unknown[0])
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    if body.get("n", 1) != 1:
        raise _bad("only n=1 is supported", "n")
    tool_choice = body.get("tool_choice", "auto")
    if tool_choice not in ("auto", None):
        raise _bad("only tool_choice='auto' is supported", "tool_choice")
    call_names: dict[str, str] = {}
    messages = [_message(m, i, call_names) for i, m in enumerate(raw_messages)]
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise _bad("'stop' must be a string or a list of non-empty strings", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _bad("'seed' must be an integer", "seed")
    max_tokens = _integer(body, "max_completion_tokens", 1) or _integer(body, "max_tokens", 1)
    turn = TurnRequest(
        messages=messages,
        tools=_tools(body.get("tools")),
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0),
        top_k=_integer(body, "top_k", -1),
        stop=tuple(stop or ()),
        seed=seed,
    )
    return ChatRequest(turn, stream, bool(options.get("include_usage")))


def _wire_tool_calls(turn: CapturedTurn) -> list[dict[str, Any]]:
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {
                "name": call["name"],
                "arguments": call["arguments"] if isinstance(call["arguments"], str)
                else orjson.dumps(call["arguments"]).decode(),
            },
        }
        for call in turn.parsed.tool_calls
    ]


def _usage(turn: CapturedTurn) -> dict[str, int]:
    prompt, completion = len(turn.prompt_ids), len(turn.result.output_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def response_body(turn: CapturedTurn, model: str) -> bytes:
    message: dict[str, Any] = {"role": "assistant", "content": turn.parsed.content}
    if turn.parsed.reasoning:
        message["reasoning_content"] = turn.parsed.reasoning
    if turn.parsed.tool_calls:
        message["tool_calls"] = _wire_tool_calls(turn)
        message["content"] = turn.parsed.content or None
    return orjson.dumps({
        "id": f"chatcmpl-{turn.turn_id}",
        "object": "chat.completion",
        "created": turn.created,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": turn.finish_reason, "logprobs": None}],
        "usage": _usage(turn),
    })


def stream_events(turn: CapturedTurn, model: str, include_usage: bool) -> list[bytes]:
    """The SSE events of a finished turn, ending with `data: [DONE]`."""
    head = {"id": f"chatcmpl-{turn.turn_id}", "object": "chat.completion.chunk", "created": turn.created,
            "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        body = {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
                **extra}
        return b"data: " + orjson.dumps(body) + b"\n\n"

    events = [chunk({"role": "assistant", "content": ""})]
    if turn.parsed.reasoning:
        events.append(chunk({"reasoning_content": turn.parsed.reasoning}))
    if turn.parsed.content:
        events.append(chunk({"content": turn.parsed.content}))
    for i, call in enumerate(_wire_tool_calls(turn)):
        events.append(chunk({"tool_calls": [{"index": i, **call}]}))
    events.append(chunk({}, turn.finish_reason))
    if include_usage:
        events.append(b"data: " + orjson.dumps({**head, "choices": [], "usage": _usage(turn)}) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events
