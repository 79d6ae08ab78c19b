"""Responses input items -> canonical messages: the fold of a model turn's items into one assistant message.

`message` items map by role (developer -> system); a model turn's `reasoning`, assistant `message` and
`function_call` items fold into one assistant message (reasoning, content, tool calls);
`function_call_output` items become tool messages named after their call. Used by
`openai_responses` for a request's input and for the history `previous_response_id` names.
Pure translation; errors are 400s naming `input`.
"""

from __future__ import annotations

from typing import Any

from gateway_workers.adapters.common import bad, parse_arguments

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = {"input_text", "output_text", "text"}


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}: content must be a string or a list of parts", "input")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad(f"{where}: content part of type {kind!r} is not supported (text only)", "input")
        texts.append(part["text"])
    return "\n".join(texts)


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        raise bad(f"{where}: reasoning content must be a list", "input")
    texts = [p.get("text") for p in parts if isinstance(p, dict)]
    if not all(isinstance(t, str) for t in texts):
        raise bad(f"{where}: reasoning parts need a string 'text'", "input")
    return "".join(t for t in texts if t)


def canonical_messages(items: Any, call_names: dict[str, str]) -> list[dict[str, Any]]:
    """Input items -> canonical messages; `call_names` (call id -> name) is read and extended."""
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

    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = _ROLES.get(item.get("role"))
            if role is None:
                raise bad(f"{where}: unknown role {item.get('role')!r}", "input")
            text = _text(item.get("content"), where)
            if role != "assistant":
                flush()
                out.append({"role": role, "content": text})
                continue
            if turn is not None and turn.get("tool_calls"):
                flush()
            turn = turn or {"role": "assistant", "content": ""}
            turn["content"] += text
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            if turn is not None and (turn["content"] or turn.get("tool_calls")):
                flush()  # reasoning opens a new model turn
            turn = turn or {"role": "assistant", "content": ""}
            if text:
                turn["reasoning"] = turn.get("reasoning", "") + text
        elif kind == "function_call":
            name = item.get("name")
            if not isinstance(name, str) or not name or not isinstance(item.get("call_id"), str):
                raise bad(f"{where}: a function_call needs a name and a call_id", "input")
            call_names[item["call_id"]] = name
            turn = turn or {"role": "assistant", "content": ""}
            turn.setdefault("tool_calls", []).append(
                {"name": name, "arguments": parse_arguments(item.get("arguments"))}
            )
        elif kind == "function_call_output":
            flush()
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise bad(f"{where}: a function_call_output needs a call_id", "input")
            message = {"role": "tool", "content": _text(item.get("output", ""), where)}
            if call_id in call_names:
                message["name"] = call_names[call_id]
            out.append(message)
        else:
            raise bad(
                f"{where}: item type {kind!r} is not supported (message, reasoning, function_call, "
                "function_call_output)",
                "input",
            )
    flush()
    return out
