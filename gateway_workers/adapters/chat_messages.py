"""Chat Completions messages -> canonical messages, one each: roles, text parts, echoed tool calls, tool results.

developer -> system; an assistant's `reasoning_content` (or `reasoning`) is kept as `reasoning`, its calls'
arguments parsed to objects and their ids dropped (a custom tool's call keeps its input as the one argument,
as `adapters.tools` declares it); each tool message answers an open call by its id and is named after it.
Used by `openai_chat`. Pure translation; errors are 400s with OpenAI's codes.
"""

from __future__ import annotations

from typing import Any

from gateway_workers.adapters import request_fields
from gateway_workers.adapters.common import (
    OpenCalls,
    bad,
    invalid_type,
    join_text_parts,
    missing,
    parse_arguments,
    unsupported,
    wrong_value,
)
from gateway_workers.adapters.tools import custom_arguments
from gateway_workers.http.errors import ApiError
from gateway_workers.http.limits import RequestLimits, check_parts

_ROLES = {"system", "developer", "user", "assistant", "tool"}
_TEXT_PARTS = ("text", "input_text", "output_text")
# Ignored fields of the messages a request adds and their parts, counted by their place's name.
_MESSAGE_IGNORED = {role: request_fields.ignored_fields("chat", f"messages[{role}]") for role in _ROLES}
_PART_IGNORED = request_fields.ignored_fields("chat", "messages[user].content[text]")


def _text(content: Any, where: str, limits: RequestLimits, ignored: set[str]) -> str:
    """String content, or a list of text parts joined with newlines (as vLLM does)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        check_parts(content, limits, "messages")
        return join_text_parts(content, where, "messages", _TEXT_PARTS, _PART_IGNORED, ignored, "messages.content")
    raise invalid_type(f"{where}.content", "a string or an array of parts", content, "messages")


def canonical_message(
    raw: Any, index: int, pending: OpenCalls, limits: RequestLimits, ignored: set[str]
) -> dict[str, Any]:
    """messages[index] -> its canonical message; `pending`: the calls left open before it (answered here by a
    tool message, opened by an assistant's); `ignored` collects the ignored fields it carries, by name."""
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
    if len(raw) > 2 and not (role_ignored := _MESSAGE_IGNORED[role]).isdisjoint(raw):
        ignored.update(f"messages.{key}" for key in raw if key in role_ignored)
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
