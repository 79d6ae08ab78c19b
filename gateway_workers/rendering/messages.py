"""Canonical messages and tools -> what HF chat templates read, with the shape checks behind a 400.

Canonical messages (`broker.protocol.CommitTurn`'s shape: role, content, reasoning, tool calls
as {"name", "arguments"}) become the dicts chat templates expect (`reasoning_content`, calls
wrapped as OpenAI functions); anything malformed raises `RenderError`, which the HTTP edge turns
into a 400. The renderer calls it before every render, as do tests that render with Jinja
directly. Imports only the stdlib; must not import the renderer, the app, adapters or engines.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

CANONICAL_ROLES = frozenset({"system", "user", "assistant", "tool"})


class RenderError(ValueError):
    """The conversation cannot be rendered with this chat template (bad shape or a template refusal): a 400."""


def message_chars(messages: Sequence[Mapping[str, Any]]) -> int:
    """The characters of the messages' text contents: what a render of them mostly costs in proportion to."""
    return sum(len(content) for m in messages if type(content := m.get("content")) is str)


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Canonical messages -> the dicts HF chat templates read (reasoning_content/thinking, function-wrapped calls)."""
    # `type(...) is` first: an isinstance check against an ABC is a Python-level call (cost: docs/performance.md).
    if not messages or (
        type(messages) is not list and (not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)))
    ):
        raise RenderError("messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if type(message) is not dict and not isinstance(message, Mapping):
            raise RenderError(f"messages[{i}] must be an object")
        role = message.get("role")
        if role not in CANONICAL_ROLES:
            raise RenderError(f"messages[{i}].role must be one of {sorted(CANONICAL_ROLES)}, got {role!r}")
        content = message.get("content", "")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise RenderError(f"messages[{i}].content must be a string")
        item: dict[str, Any] = {"role": role, "content": content}
        reasoning = message.get("reasoning")
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise RenderError(f"messages[{i}].reasoning must be a string")
            # Templates read it as `reasoning_content` or `thinking` (GPT-OSS, LFM2.5); transformers >= 5.13 fills
            # both itself, older ones do not, so both are written here for every transformers alike.
            item["reasoning_content"] = item["thinking"] = reasoning
        calls = message.get("tool_calls")
        if calls:
            item["tool_calls"] = [_template_call(i, j, call) for j, call in enumerate(_as_list(i, calls))]
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise RenderError(f"messages[{i}].name must be a string")
            item["name"] = name
        out.append(item)
    return out


def _as_list(i: int, calls: object) -> list[Any]:
    if not isinstance(calls, list):
        raise RenderError(f"messages[{i}].tool_calls must be a list")
    return calls


def _template_call(i: int, j: int, call: object) -> dict[str, Any]:
    if not isinstance(call, Mapping):
        raise RenderError(f"messages[{i}].tool_calls[{j}] must be an object")
    name, arguments = call.get("name"), call.get("arguments", {})
    if not isinstance(name, str) or not name:
        raise RenderError(f"messages[{i}].tool_calls[{j}].name must be a non-empty string")
    # Arguments are an object canonically; a string is passed through verbatim (templates print it as is).
    if not isinstance(arguments, (Mapping, str)):
        raise RenderError(f"messages[{i}].tool_calls[{j}].arguments must be an object")
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def check_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise RenderError("tools must be a list")
    out = []
    for k, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise RenderError(f"tools[{k}] must be an object")
        fn = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(fn, Mapping):
            raise RenderError(f"tools[{k}] must be a function tool: {{'type': 'function', 'function': {{...}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RenderError(f"tools[{k}].function.name must be a non-empty string")
        out.append(dict(tool))
    return out
