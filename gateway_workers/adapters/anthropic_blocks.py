"""Anthropic Messages content -> canonical messages: the system prompt, and each message's blocks in order.

`thinking` -> reasoning, `text` -> content, `tool_use` -> tool calls (ids are wire-only), each `tool_result`
-> a tool message named after its call; `redacted_thinking` carries nothing we can render and is dropped. A
`system` message inside `messages` stays where it stands (the chat template renders it there), unless its
`clear_at` is `next_user_message` and a later user message exists. A tool_use's results must come in the very
next message. Blocks of hosted tools, images and documents get the API's 400 (`request_fields.MESSAGES`).
Used by `anthropic_messages`. Pure translation; errors are 400s naming `messages`.
"""

from __future__ import annotations

from typing import Any

from gateway_workers.adapters import request_fields
from gateway_workers.adapters.common import OpenCalls, bad, invalid_type, missing, unsupported
from gateway_workers.http.limits import RequestLimits, check_depth, check_parts

# Ignored fields of the blocks a request adds, counted by their place's name.
_BLOCK_IGNORED = request_fields.ignored_fields("messages", "messages[user].content[tool_use]") | \
    request_fields.ignored_fields("messages", "messages[user].content[text]")
_RESULT_LABEL = "messages.content.content"  # a tool result's blocks, as their ignored fields are counted
_CLEARED = "next_user_message"  # a system message's `clear_at` that hides it once a later user message exists


def _notice(block: dict[str, Any], ignored: set[str], label: str = "messages.content") -> None:
    if not _BLOCK_IGNORED.isdisjoint(block):
        ignored.update(f"{label}.{key}" for key in block if key in _BLOCK_IGNORED)


def _refused_block(kind: Any, where: str) -> Exception:
    """The 400 for a block this gateway does not take, saying why (`request_fields`)."""
    place = f"messages[user].content[{kind}]" if isinstance(kind, str) and kind.isidentifier() else ""
    rule = request_fields.rule_for("messages", place) if place else None
    if rule is not None and rule.verdict == "refused":
        return unsupported(f"{where}", f"is a block of type {kind!r}, which is not served: {rule.note}",
                           param="messages")
    return bad(f"{where}: unknown block type {kind!r}", "messages", "invalid_value")


def text_blocks(content: Any, where: str, joiner: str, limits: RequestLimits, ignored: set[str],
                label: str = "messages.content") -> str:
    """A string, or a list of text blocks joined (other block types are refused; in a tool result, a
    `tool_reference` stands for its tool's name: every tool is declared up front)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_type(where, "a string or an array of text blocks", content, "messages")
    check_parts(content, limits, "messages")
    texts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_reference" and label == _RESULT_LABEL:
            name = block.get("tool_name")
            if not isinstance(name, str) or not name:
                raise missing(f"{where}[{j}].tool_name", "messages")
            texts.append(name)
            continue
        if kind != "text":
            if not isinstance(block, dict):
                raise invalid_type(f"{where}[{j}]", "an object", block, "messages")
            raise _refused_block(kind, f"{where}[{j}]") if kind is not None else missing(f"{where}[{j}].type",
                                                                                         "messages")
        if not isinstance(block.get("text"), str):
            raise invalid_type(f"{where}[{j}].text", "a string", block.get("text"), "messages")
        if len(block) > 2:
            _notice(block, ignored, label)
        texts.append(block["text"])
    return joiner.join(texts)


def _assistant(content: Any, where: str, pending: OpenCalls, limits: RequestLimits,
               ignored: set[str]) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise invalid_type(f"{where}.content", "a string or an array of blocks", content, "messages")
    check_parts(content, limits, "messages")
    text, reasoning, calls = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            ignored.add("messages.content.redacted_thinking")  # encrypted elsewhere; nothing of it can be rendered
            continue
        elif kind == "tool_use":
            name, arguments = block.get("name"), block.get("input")
            if not isinstance(name, str) or not name or not isinstance(arguments, dict):
                raise bad(f"{where}.content[{j}]: tool_use needs a name and an object input", "messages",
                          "invalid_type" if name is not None and arguments is not None else
                          "missing_required_parameter")
            call_id = block.get("id")
            if not isinstance(call_id, str) or not call_id:
                raise missing(f"{where}.content.{j}.tool_use.id", "messages")
            if call_id in pending:
                raise bad(f"{where}.content.{j}: `tool_use` ids must be unique: {call_id!r}", "messages")
            pending[call_id] = name
            check_depth(arguments, limits, "messages")
            calls.append({"name": name, "arguments": arguments})
        elif kind in ("text", "thinking"):
            field = "text" if kind == "text" else "thinking"
            raise invalid_type(f"{where}.content[{j}].{field}", "a string", block.get(field), "messages")
        elif kind == "tool_result":
            raise bad(f"{where}.content[{j}]: tool_result blocks belong in user messages", "messages",
                      "invalid_value")
        elif not isinstance(block, dict):
            raise invalid_type(f"{where}.content[{j}]", "an object", block, "messages")
        else:
            raise _refused_block(kind, f"{where}.content[{j}]")
        _notice(block, ignored)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if reasoning and "".join(reasoning):
        message["reasoning"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _user(content: Any, where: str, pending: OpenCalls, limits: RequestLimits,
          ignored: set[str]) -> list[dict[str, Any]]:
    """A user turn: its tool results become tool messages and its text a user message, in order."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise invalid_type(f"{where}.content", "a string or an array of blocks", content, "messages")
    check_parts(content, limits, "messages")
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
            if len(block) > 2:
                _notice(block, ignored)
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            result = block.get("content", "")
            tool: dict[str, Any] = {
                "role": "tool",
                "content": text_blocks(result, f"{where}.content[{j}].content", "\n", limits, ignored,
                                       _RESULT_LABEL),
            }
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise missing(f"{where}.content.{j}.tool_result.tool_use_id", "messages")
            name = pending.pop(call_id, None)
            if name is None:
                raise bad(f"{where}.content.{j}: unexpected `tool_use_id` found in `tool_result` blocks: {call_id}. "
                          "Each `tool_result` block must have a corresponding `tool_use` block in the previous "
                          "message.", "messages")
            if len(block) > 3:
                _notice(block, ignored)
            tool["name"] = name
            out.append(tool)
        elif kind == "text":
            raise invalid_type(f"{where}.content[{j}].text", "a string", block.get("text"), "messages")
        elif not isinstance(block, dict):
            raise invalid_type(f"{where}.content[{j}]", "an object", block, "messages")
        elif kind == "tool_use":
            raise bad(f"{where}.content[{j}]: tool_use blocks belong in assistant messages", "messages",
                      "invalid_value")
        else:
            raise _refused_block(kind, f"{where}.content[{j}]")
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _system(message: dict[str, Any], where: str, limits: RequestLimits, ignored: set[str]) -> dict[str, Any]:
    content = message.get("content")
    if content is None:
        raise missing(f"{where}.content", "messages")
    return {"role": "system", "content": text_blocks(content, f"{where}.content", "\n", limits, ignored)}


def unanswered(open_calls: dict[str, str], index: int) -> None:
    if open_calls:
        raise bad(f"messages.{index}: `tool_use` ids were found without `tool_result` blocks immediately after: "
                  f"{', '.join(open_calls)}. Each `tool_use` block must have a corresponding `tool_result` block "
                  "in the next message.", "messages")


def clears(message: Any) -> bool:
    """Whether `message` is a system message that a later user message hides (`clear_at`)."""
    return type(message) is dict and message.get("role") == "system" and message.get("clear_at") == _CLEARED


def canonical_messages(raw: list[Any], start: int, limits: RequestLimits, ignored: set[str]) -> list[dict[str, Any]]:
    """`raw[start:]` -> canonical messages (those before converted already, leaving no call open)."""
    messages: list[dict[str, Any]] = []
    pending: OpenCalls = {}
    last_user = -1
    if any(map(clears, raw)):
        last_user = max((i for i, m in enumerate(raw) if type(m) is dict and m.get("role") == "user"), default=-1)
    for i, message in enumerate(raw[start:], start):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant", "system"):
            if not isinstance(message, dict):
                raise invalid_type(where, "an object", message, "messages")
            raise bad(f"{where}.role: must be 'user', 'assistant' or 'system', not {role!r}", "messages",
                      "invalid_value")
        # a tool_use's result must come in the very next message, which must then answer all of them
        opened = dict(pending)
        if role == "assistant":
            unanswered(opened, i)
            messages.append(_assistant(message.get("content"), where, pending, limits, ignored))
        elif role == "system":
            unanswered(opened, i)
            clear_at = message.get("clear_at")
            if clear_at not in (None, "never", _CLEARED):
                raise bad(f"{where}.clear_at: must be 'never' or '{_CLEARED}', not {clear_at!r}", "messages",
                          "invalid_value")
            if message.get("output_config") is not None:
                ignored.add("messages.output_config")
            system = _system(message, where, limits, ignored)
            if clear_at != _CLEARED or last_user < i:
                messages.append(system)
        else:
            messages.extend(_user(message.get("content"), where, pending, limits, ignored))
            unanswered(pending, i - 1)
            pending.clear()
    unanswered(pending, len(raw) - 1)
    return messages
