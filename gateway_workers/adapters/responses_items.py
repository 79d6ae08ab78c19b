"""Responses input items -> canonical messages: the fold of a model turn's items into one assistant message.

`message` items map by role (developer -> system); a model turn's `reasoning`, assistant `message`,
`function_call` and `custom_tool_call` items fold into one assistant message (reasoning, content, tool calls;
a namespaced call under its flattened name, a custom call with its input as the one argument, as
`adapters.tools` declares them); `function_call_output` and `custom_tool_call_output` items become tool
messages named after their call (or, when one answers no call, after the tool it names). Items of hosted
tools, stored items and compactions are refused (`request_fields.RESPONSES`). Used by `openai_responses` for
a request's input and for the history `previous_response_id` names. Pure translation; errors are 400s
naming `input`.
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
    non_empty_list,
    parse_arguments,
    unsupported,
    wrong_value,
)
from gateway_workers.adapters.tools import NAMESPACE_SEPARATOR, custom_arguments
from gateway_workers.http.limits import RequestLimits, check_parts

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")
_CALLS = ("function_call", "custom_tool_call")
_OUTPUTS = ("function_call_output", "custom_tool_call_output")
# Ignored fields of the items a request adds, counted by their place's name.
_ITEM_IGNORED = request_fields.ignored_fields("responses", "input[function_call]") | \
    request_fields.ignored_fields("responses", "input[message]") | \
    request_fields.ignored_fields("responses", "input[reasoning]")
_PART_IGNORED = request_fields.ignored_fields("responses", "input[message].content[output_text]")


def _notice(item: dict[str, Any], ignored: set[str] | None, known: frozenset[str], label: str) -> None:
    if ignored is not None and not known.isdisjoint(item):
        ignored.update(f"{label}.{key}" for key in item if key in known)


def _text(content: Any, where: str, limits: RequestLimits | None, ignored: set[str] | None = None) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        raise missing(f"{where}.content", "input")
    if not isinstance(content, list):
        raise invalid_type(f"{where}.content", "a string or an array of parts", content, "input")
    if limits is not None:
        check_parts(content, limits, "input")
    return join_text_parts(content, where, "input", _TEXT_PARTS, _PART_IGNORED, ignored, "input.content")


def _reasoning_text(item: dict[str, Any], where: str, limits: RequestLimits | None) -> str:
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        raise invalid_type(f"{where}.content", "an array", parts, "input")
    if limits is not None:
        check_parts(parts, limits, "input")
    texts = [p.get("text") if isinstance(p, dict) else None for p in parts]
    if not all(isinstance(t, str) for t in texts):
        raise bad(f"{where}: reasoning parts need a string 'text'", "input", "invalid_type")
    return "".join(t for t in texts if t)


def ends_model_turns(item: Any) -> bool:
    """Whether no model turn is left open after `item` (a call output or a message not from the assistant), so
    the items that follow it convert as they would on their own (`canonical_messages`' `start`)."""
    kind = item.get("type", "message") if type(item) is dict else None
    return kind in _OUTPUTS or (kind == "message" and item.get("role") != "assistant")


def _tool_name(item: dict[str, Any], where: str) -> str:
    """The canonical name of the tool an item names: `namespace__name` for a namespace's (as `adapters.tools`
    declares it)."""
    name, namespace = item.get("name"), item.get("namespace")
    if not isinstance(name, str) or not name:
        raise invalid_type(f"{where}.name", "a non-empty string", name, "input")
    if namespace is None:
        return name
    if not isinstance(namespace, str) or not namespace:
        raise invalid_type(f"{where}.namespace", "a non-empty string", namespace, "input")
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}"


def _call(item: dict[str, Any], kind: str, where: str, limits: RequestLimits | None) -> tuple[str, str, Any]:
    """(call id, canonical name, canonical arguments) of an echoed call item."""
    name, call_id = item.get("name"), item.get("call_id")
    if not isinstance(name, str) or not name or not isinstance(call_id, str) or not call_id:
        raise bad(f"{where}: a {kind} needs a name and a call_id", "input", "missing_required_parameter")
    name = _tool_name(item, where)
    if kind == "custom_tool_call":
        return call_id, name, custom_arguments(item.get("input"), where, "input")
    arguments = item.get("arguments")
    if not isinstance(arguments, str):
        raise missing(f"{where}.arguments", "input") if arguments is None else invalid_type(
            f"{where}.arguments", "a string (of JSON)", arguments, "input")
    return call_id, name, parse_arguments(arguments, limits, "input")


def _refused_item(kind: Any, where: str) -> Exception:
    if not isinstance(kind, str):
        return invalid_type(f"{where}.type", "a string", kind, "input")
    rule = request_fields.rule_for("responses", f"input[{kind}]") if isinstance(kind, str) else None
    if rule is not None and rule.verdict == "refused":
        return unsupported(where, f"is an item of type {kind!r}, which is not served: {rule.note}", param="input")
    return bad(f"{where}: unknown item type {kind!r}", "input", "invalid_value")


def canonical_messages(
    items: Any, earlier_calls: dict[str, str] | None, limits: RequestLimits | None, start: int = 0,
    ignored: set[str] | None = None,
) -> list[dict[str, Any]]:
    """Input items -> canonical messages, each call output answering a call by its id.

    `earlier_calls` (call id -> name) are the calls of the response this input continues, which the
    input must answer too; None while that response is not known yet (the check is then left to the
    call that knows it: `openai_responses.with_history`). `limits` bounds parts and argument nesting
    (None: the items were checked when the request was first parsed). `start`: only the items from there
    on, those before having converted already and left no call open and no model turn (`ends_model_turns`).
    `ignored` collects the ignored fields the items carry, by name (None: not counted).
    """
    pending: OpenCalls = dict(earlier_calls or {})
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    non_empty_list(items, "input", "a string or an array of items")
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the model turn being folded together

    def flush() -> None:
        nonlocal turn
        if turn is not None:
            out.append(turn)
            turn = None

    for i, item in enumerate(items[start:], start):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            given = item.get("role")
            role = _ROLES.get(given) if type(given) is str else None
            if role is None:
                if given is None:
                    raise missing(f"{where}.role", "input")
                if not isinstance(given, str):
                    raise invalid_type(f"{where}.role", "a string", given, "input")
                raise wrong_value(f"{where}.role", given, tuple(_ROLES), "input")
            text = _text(item.get("content"), where, limits, ignored)
            if len(item) > 3:
                _notice(item, ignored, _ITEM_IGNORED, "input")
            if role != "assistant":
                flush()
                out.append({"role": role, "content": text})
                continue
            if turn is not None and turn.get("tool_calls"):
                flush()
            turn = turn or {"role": "assistant", "content": ""}
            turn["content"] += text
        elif kind == "reasoning":
            text = _reasoning_text(item, where, limits)
            _notice(item, ignored, _ITEM_IGNORED, "input")
            if turn is not None and (turn["content"] or turn.get("tool_calls")):
                flush()  # reasoning opens a new model turn
            turn = turn or {"role": "assistant", "content": ""}
            if text:
                turn["reasoning"] = turn.get("reasoning", "") + text
        elif kind in _CALLS:
            call_id, name, arguments = _call(item, kind, where, limits)
            if call_id in pending:
                raise bad(f"{where}: duplicate {kind} call_id {call_id!r}", "input")
            pending[call_id] = name
            _notice(item, ignored, _ITEM_IGNORED, "input")
            turn = turn or {"role": "assistant", "content": ""}
            turn.setdefault("tool_calls", []).append({"name": name, "arguments": arguments})
        elif kind in _OUTPUTS:
            flush()
            call_id = item.get("call_id")
            message = {"role": "tool", "content": _text(item.get("output", ""), f"{where}.output", limits, ignored)}
            if call_id is None and item.get("name") is not None:
                # an output that answers no call names its tool instead (Codex sends its goal so)
                message["name"] = _tool_name(item, where)
            elif not isinstance(call_id, str) or not call_id:
                raise missing(f"{where}.call_id", "input")
            elif (answered := pending.pop(call_id, None)) is not None:
                message["name"] = answered
            elif earlier_calls is not None:
                raise bad(f"{where}: no tool call found for {kind} with call_id {call_id}", "input")
            _notice(item, ignored, _ITEM_IGNORED, "input")
            out.append(message)
        elif not isinstance(item, dict):
            raise invalid_type(where, "an object", item, "input")
        else:
            raise _refused_item(kind, where)
    flush()
    if earlier_calls is not None and pending:
        raise bad(f"no tool output found for function call {', '.join(pending)}", "input")
    return out
