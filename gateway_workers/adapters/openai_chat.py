"""OpenAI Chat Completions dialect: wire body -> TurnRequest, CapturedTurn / LiveTurn -> wire reply.

Every field has one verdict (`request_fields.CHAT`): honoured, ignored (accepted and counted), refused with
the API's own 400 (n > 1, JSON modes, logprobs, audio, the deprecated functions API, ...), or hosted
(`web_search_options`). Assistant echoes are canonicalized (arguments parsed to objects, wire ids dropped,
`reasoning_content`/`reasoning` kept as `reasoning`) so the next turn's prompt matches the stored response
message; custom (freeform) tools go through `adapters.tools`. Streams are live: chunks go out while the
engine generates. No I/O here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

from gateway_workers.adapters import request_fields
from gateway_workers.adapters.base import no_history
from gateway_workers.adapters.common import (
    OpenCalls,
    arguments_json,
    bad,
    bad_part,
    check_known,
    check_object,
    check_tool_choice,
    check_types,
    earlier_elements,
    flag,
    integer,
    invalid_type,
    missing,
    non_empty_list,
    number,
    parse_arguments,
    unsupported,
    wrong_value,
)
from gateway_workers.adapters.tools import (
    NO_TOOLS,
    ToolCollector,
    ToolSet,
    custom_arguments,
    custom_input,
    tool_list,
)
from gateway_workers.http.errors import ApiError
from gateway_workers.http.limits import DEFAULT_LIMITS, RequestLimits, check_count, check_parts, check_turn
from gateway_workers.turns.live import LiveTurn
from gateway_workers.turns.pipeline import CapturedTurn, TurnRequest, tool_call_id

HISTORY_FIELD = "messages"  # the conversation, which grows at its end (`Adapter.HISTORY_FIELD`)
_KNOWN = request_fields.known_fields("chat")
_ROLES = {"system", "developer", "user", "assistant", "tool"}
_TYPES = {"model": str, "user": str, "metadata": dict, "store": bool, "service_tier": str, "prompt_cache_key": str,
          "safety_identifier": str, "stream_options": dict, "chat_template_kwargs": dict}
_TEXT_PARTS = ("text", "input_text", "output_text")
# Ignored fields of what a request adds (messages, their parts, tools), counted by their place's name.
_MESSAGE_IGNORED = request_fields.ignored_fields("chat", "messages[assistant]")
_PART_IGNORED = request_fields.ignored_fields("chat", "messages[user].content[text]")
_FUNCTION_IGNORED = request_fields.ignored_fields("chat", "tools[function].function")

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


def _text(content: Any, where: str, limits: RequestLimits, ignored: set[str]) -> str:
    """String content, or a list of text parts joined with newlines (as vLLM does)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        check_parts(content, limits, "messages")
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "refusal" and isinstance(part.get("refusal"), str):
                texts.append(part["refusal"])
                continue
            if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
                raise bad_part(part, where, "messages", _TEXT_PARTS)
            if len(part) > 2:
                ignored.update(f"messages.content.{key}" for key in part if key in _PART_IGNORED)
            texts.append(part["text"])
        return "\n".join(texts)
    raise invalid_type(f"{where}.content", "a string or an array of parts", content, "messages")


def _message(raw: Any, index: int, pending: OpenCalls, limits: RequestLimits, ignored: set[str]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise invalid_type(f"messages[{index}]", "an object", raw, "messages")
    role = raw.get("role")
    if type(role) is not str or role not in _ROLES:
        if role == "function":
            raise unsupported(f"messages[{index}].role", "'function' belongs to the deprecated functions API, which "
                              "is not served: use tools and 'tool' messages", param="messages")
        if role is None:
            raise missing(f"messages[{index}].role", "messages")
        if not isinstance(role, str):
            raise invalid_type(f"messages[{index}].role", "a string", role, "messages")
        raise wrong_value(f"messages[{index}].role", role, ("system", "developer", "user", "assistant", "tool"),
                          "messages")
    if role != "tool" and pending:
        raise bad(
            "an assistant message with 'tool_calls' must be followed by tool messages responding to each "
            f"'tool_call_id'; these did not have response messages: {', '.join(pending)}",
            f"messages.[{index}].role",
        )
    content = raw.get("content")
    if content is None and role != "assistant":  # only an assistant message may leave it out (or null)
        raise missing(f"messages[{index}].content", f"messages.[{index}].content")
    if len(raw) > 2:
        ignored.update(f"messages.{key}" for key in raw if key in _MESSAGE_IGNORED)
    message: dict[str, Any] = {
        "role": "system" if role == "developer" else role,
        # plain text (nearly every message) skips the call; `where` is formatted only for an error
        "content": content if type(content) is str else _text(content, f"messages[{index}]", limits, ignored),
    }
    if role == "assistant":
        if raw.get("audio") is not None or raw.get("function_call") is not None:
            field = "audio" if raw.get("audio") is not None else "function_call"
            raise unsupported(f"messages[{index}].{field}", "is not served (audio, and the deprecated functions API)",
                              value=False, param="messages")
        reasoning = raw.get("reasoning_content", raw.get("reasoning"))
        if reasoning is not None and not isinstance(reasoning, str):
            raise invalid_type(f"messages[{index}].reasoning_content", "a string", reasoning, "messages")
        if reasoning:
            message["reasoning"] = reasoning
        calls = raw.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise invalid_type(f"messages[{index}].tool_calls", "an array", calls, f"messages.[{index}].tool_calls")
        if calls:
            message["tool_calls"] = [_call(call, index, j, pending, limits) for j, call in enumerate(calls)]
    elif role == "tool":
        call_id = raw.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise missing(f"messages[{index}].tool_call_id", f"messages.[{index}].tool_call_id")
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
    if type(fn) is not dict or call.get("type") == "custom":
        if type(call) is dict and call.get("type") == "custom":
            return _custom_call(call, index, j, pending)
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


def _custom_call(call: dict[str, Any], index: int, j: int, pending: OpenCalls) -> dict[str, Any]:
    """An echoed call of a custom tool: its input is the canonical call's one argument (`adapters.tools`)."""
    where, param = f"messages[{index}].tool_calls[{j}]", f"messages.[{index}].tool_calls.[{j}]"
    custom, call_id = call.get("custom"), call.get("id")
    custom = custom if isinstance(custom, dict) else {}
    name = custom.get("name")
    if not isinstance(name, str) or not name:
        raise missing(f"{where}.custom.name", f"{param}.custom.name")
    if not isinstance(call_id, str) or not call_id:
        raise missing(f"{where}.id", f"{param}.id")
    if call_id in pending:
        raise bad(f"{where}: duplicate tool call id {call_id!r}", f"{param}.id")
    pending[call_id] = name
    arguments = custom_arguments(custom.get("input"), f"{where}.custom", f"{param}.custom.input")
    return {"name": name, "arguments": arguments}


def _bad_call(call: Any, index: int, j: int) -> ApiError:
    """What is wrong with an echoed tool call, naming the field (the error path only: `_call` checks in one go)."""
    where, param = f"messages[{index}].tool_calls[{j}]", f"messages.[{index}].tool_calls.[{j}]"
    if not isinstance(call, dict):
        return invalid_type(where, "an object", call, param)
    fn = call.get("function")
    if fn is not None and not isinstance(fn, dict):
        return invalid_type(f"{where}.function", "an object", fn, f"{param}.function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        name = fn.get("name") if isinstance(fn, dict) else None
        if name == "":
            return bad(f"Invalid '{where}.function.name': empty string.", f"{param}.function.name", "empty_string")
        if name is not None:
            return invalid_type(f"{where}.function.name", "a string", name, f"{param}.function.name")
        return missing(f"{where}.function.name", f"{param}.function.name")
    if call.get("type", "function") != "function":
        return wrong_value(f"{where}.type", call.get("type"), ("function", "custom"), f"{param}.type")
    if not isinstance(call.get("id"), str) or not call["id"]:
        return missing(f"{where}.id", f"{param}.id")
    arguments = fn.get("arguments")
    if arguments is None:
        return missing(f"{where}.function.arguments", f"{param}.function.arguments")
    return invalid_type(f"{where}.function.arguments", "a string (of JSON)", arguments, f"{param}.function.arguments")


def _tools(raw: Any, web_search: Any) -> ToolSet:
    if web_search is None and (raw is None or raw == []):
        return NO_TOOLS
    collector = ToolCollector()
    if web_search is not None:
        collector.hosted_tool("web_search_options", "web_search")
    for i, tool in enumerate(tool_list(raw)):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind is None and isinstance(tool, dict):
            raise missing(f"{where}.type", "tools")
        if kind == "function":
            fn = tool.get("function")
            if not isinstance(fn, dict):
                raise missing(f"{where}.function", "tools") if fn is None else invalid_type(
                    f"{where}.function", "an object", fn, "tools")
            collector.notice(fn, _FUNCTION_IGNORED, "tools.function")
            collector.function(fn.get("name"), fn.get("description"), fn.get("parameters"), where)
        elif kind == "custom":
            custom = tool.get("custom")
            if not isinstance(custom, dict):
                raise missing(f"{where}.custom", "tools") if custom is None else invalid_type(
                    f"{where}.custom", "an object", custom, "tools")
            collector.custom_tool(custom.get("name"), custom.get("description"), custom.get("format"), where)
        elif not isinstance(tool, dict):
            raise invalid_type(where, "an object", tool, "tools")
        else:
            raise wrong_value(f"{where}.type", kind, ("function", "custom"), "tools")
    return collector.result()


def _refuse_unserved(body: dict[str, Any]) -> None:
    """The fields whose meaning this gateway cannot give (`request_fields`: refused), when they ask for it."""
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


def _logit_bias(raw: Any) -> dict[int, float] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise invalid_type("logit_bias", "an object", raw)
    bias = {}
    for token, value in raw.items():
        if not token.isdigit() or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("Invalid 'logit_bias': keys must be token ids and values numbers between -100 and 100.",
                      "logit_bias", "invalid_value")
        if not -100 <= value <= 100:
            raise bad(f"Invalid 'logit_bias': the bias of token {token} must be between -100 and 100.", "logit_bias",
                      "invalid_value")
        bias[int(token)] = float(value)
    return bias or None


class ChatRequest:
    """A validated Chat Completions body; `raw_messages`, its messages as sent, which the next request's parse
    compares its own with (`Adapter.parse_request`'s `earlier`); `toolset` maps calls back to the wire."""

    __slots__ = ("turn", "stream", "include_usage", "raw_messages", "toolset", "ignored")

    def __init__(self, turn: TurnRequest, stream: bool, include_usage: bool, raw_messages: list[Any],
                 toolset: ToolSet = NO_TOOLS, ignored: tuple[str, ...] = ()) -> None:
        self.turn = turn
        self.stream = stream
        self.include_usage = include_usage
        self.raw_messages = raw_messages
        self.toolset = toolset
        self.ignored = ignored

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
    if integer(body, "n", 1) not in (1, None):
        raise unsupported("n", "above 1 is not served: one choice per request")
    _refuse_unserved(body)
    flag(body, "parallel_tool_calls")  # a boolean, whichever: a reply's calls are all kept
    check_tool_choice(body)
    pending: OpenCalls = {}
    ignored: set[str] = set()
    # A message converts to one canonical message, whatever comes before it but open calls
    start = earlier_elements(earlier.raw_messages, raw_messages) if earlier is not None else 0
    messages = earlier.turn.messages[:start] if earlier is not None else []
    messages += [_message(m, i, pending, limits, ignored) for i, m in enumerate(raw_messages[start:], start)]
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
    toolset = _tools(body.get("tools"), body.get("web_search_options"))
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
        frequency_penalty=number(body, "frequency_penalty", -2.0, 2.0),
        presence_penalty=number(body, "presence_penalty", -2.0, 2.0),
        repetition_penalty=number(body, "repetition_penalty", 0.0, 2.0),
        min_p=number(body, "min_p", 0.0, 1.0),
        logit_bias=_logit_bias(body.get("logit_bias")),
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
