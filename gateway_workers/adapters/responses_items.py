"""Responses input items -> canonical messages: the fold of a model turn's items into one assistant message.

`message` items map by role (developer -> system); a model turn's `reasoning`, assistant `message` and
`function_call` items fold into one assistant message (reasoning, content, tool calls);
`function_call_output` items become tool messages named after their call. Used by
`openai_responses` for a request's input and for the history `previous_response_id` names.
Pure translation; errors are 400s naming `input`.
"""

from __future__ import annotations

from typing import Any

from gateway_workers.adapters.common import OpenCalls, bad, parse_arguments
from gateway_workers.http.limits import RequestLimits, check_parts

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = {"input_text", "output_text", "text"}


def _text(content: Any, where: str, limits: RequestLimits | None) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}: content must be a string or a list of parts", "input")
    if limits is not None:
        check_parts(content, limits, "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if type(kind) is not str or kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad(f"{where}: content part of type {kind!r} is not supported (text only)", "input")
        texts.append(part["text"])
    return "\n".join(texts)


def _reasoning_text(item: dict[str, Any], where: str, limits: RequestLimits | None) -> str:
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        raise bad(f"{where}: reasoning content must be a list", "input")
    if limits is not None:
        check_parts(parts, limits, "input")
    texts = [p.get("text") if isinstance(p, dict) else None for p in parts]
    if not all(isinstance(t, str) for t in texts):
        raise bad(f"{where}: reasoning parts need a string 'text'", "input")
    return "".join(t for t in texts if t)


def ends_model_turns(item: Any) -> bool:
    """Whether no model turn is left open after `item` (a call output or a message not from the assistant), so
    the items that follow it convert as they would on their own (`canonical_messages`' `start`)."""
    kind = item.get("type", "message") if type(item) is dict else None
    return kind == "function_call_output" or (kind == "message" and item.get("role") != "assistant")


def canonical_messages(
    items: Any, earlier_calls: dict[str, str] | None, limits: RequestLimits | None, start: int = 0
) -> list[dict[str, Any]]:
    """Input items -> canonical messages, each call output answering a call by its id.

    `earlier_calls` (call id -> name) are the calls of the response this input continues, which the
    input must answer too; None while that response is not known yet (the check is then left to the
    call that knows it: `openai_responses.with_history`). `limits` bounds parts and argument nesting
    (None: the items were checked when the request was first parsed). `start`: only the items from there
    on, those before having converted already and left no call open and no model turn (`ends_model_turns`).
    """
    pending: OpenCalls = dict(earlier_calls or {})
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad("'input' must be a string or a non-empty list of items", "input")
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
            role = item.get("role")
            role = _ROLES.get(role) if type(role) is str else None
            if role is None:
                raise bad(f"{where}: unknown role {item.get('role')!r}", "input")
            text = _text(item.get("content"), where, limits)
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
            if turn is not None and (turn["content"] or turn.get("tool_calls")):
                flush()  # reasoning opens a new model turn
            turn = turn or {"role": "assistant", "content": ""}
            if text:
                turn["reasoning"] = turn.get("reasoning", "") + text
        elif kind == "function_call":
            name, call_id = item.get("name"), item.get("call_id")
            if not isinstance(name, str) or not name or not isinstance(call_id, str) or not call_id:
                raise bad(f"{where}: a function_call needs a name and a call_id", "input",
                          code="missing_required_parameter")
            if call_id in pending:
                raise bad(f"{where}: duplicate function_call call_id {call_id!r}", "input")
            pending[call_id] = name
            arguments = item.get("arguments")
            if not isinstance(arguments, str):
                raise bad(f"{where}: a function_call's arguments must be a string (of JSON)", "input",
                          code="missing_required_parameter" if arguments is None else "invalid_request")
            turn = turn or {"role": "assistant", "content": ""}
            call = {"name": name, "arguments": parse_arguments(arguments, limits, "input")}
            turn.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            flush()
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad(f"{where}: a function_call_output needs a call_id", "input",
                          code="missing_required_parameter")
            message = {"role": "tool", "content": _text(item.get("output", ""), where, limits)}
            answered = pending.pop(call_id, None)
            if answered is not None:
                message["name"] = answered
            elif earlier_calls is not None:
                raise bad(f"{where}: no tool call found for function call output with call_id {call_id}", "input")
            out.append(message)
        else:
            raise bad(
                f"{where}: item type {kind!r} is not supported (message, reasoning, function_call, "
                "function_call_output)",
                "input",
            )
    flush()
    if earlier_calls is not None and pending:
        raise bad(f"no tool output found for function call {', '.join(pending)}", "input")
    return out
