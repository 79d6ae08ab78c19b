"""What the three wire adapters share: validation errors, canonical tools and arguments, SSE framing, reply blocks.

Canonical tools are `{"type": "function", "function": {"name", "description"?, "parameters"?}}`
whatever dialect declared them, so one session can mix dialects and still render the same
prompt. A reply is a sequence of blocks (reasoning, text, tool calls), built from the final
parse for a whole reply or from live deltas for a stream (`block_events`). No I/O here; must
not import the app.
"""

from __future__ import annotations

import operator
import re
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from gateway_workers.formats.live_split import DeltaKind, LiveDelta
from gateway_workers.http.errors import ApiError
from gateway_workers.http.limits import RequestLimits, check_depth

# The tool names both APIs accept: OpenAI up to 64 characters, Anthropic up to 128 (`canonical_tools(max_name=)`).
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]+")
_TYPE_NAMES = {str: "a string", bool: "a boolean", dict: "an object", list: "a list"}


def bad(message: str, param: str | None = None, code: str = "invalid_request") -> ApiError:
    """A 400 for a request the agent must fix (the SDKs never retry a 400)."""
    return ApiError(400, "invalid_request", message, code=code, param=param)


def earlier_elements(earlier: list[Any] | None, elements: list[Any]) -> int:
    """How many leading `elements` a parse of the session's previous request converted already: all of that
    request's (`earlier`, its conversation's elements), when `elements` begins with those very objects
    (`http.bodies` shares them between a session's consecutive bodies), else 0. Only a whole valid request
    counts: it leaves no tool call open, so the elements after it convert as they would after its own."""
    if earlier is None or len(earlier) > len(elements) or not all(map(operator.is_, elements, earlier)):
        return 0
    return len(earlier)


def check_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    return body


def check_types(body: Mapping[str, Any], types: Mapping[str, type]) -> None:
    """Parameters we accept without using them still have the type their API requires (null: left out)."""
    for name, kind in types.items():
        value = body.get(name)
        if value is not None and not isinstance(value, kind):
            raise bad(f"'{name}' must be {_TYPE_NAMES[kind]}", name)


def check_known(body: Mapping[str, Any], handled: set[str], ignored: set[str]) -> None:
    """A parameter we cannot honour gets a 400 that names it, never silent ignoring."""
    unknown = sorted(set(body) - handled - ignored)
    if unknown:
        raise bad(f"unsupported parameter(s): {', '.join(unknown)}", unknown[0])


def number(body: Mapping[str, Any], name: str, lo: float, hi: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise bad(f"'{name}' must be a number between {lo} and {hi}", name)
    return float(value)


def integer(body: Mapping[str, Any], name: str, lo: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise bad(f"'{name}' must be an integer >= {lo}", name)
    return value


def flag(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be a boolean", name)
    return value


# The order rule for tool calls that every dialect enforces, as one dict per request: an assistant
# message's calls open (call id -> tool name, in call order), each result closes one by its id, and a
# dialect decides when calls left open are an error (Chat Completions and Messages: at the next
# message that is not a result). A plain dict: its `in`, `pop` and assignment run per call.
OpenCalls = dict[str, str]


def canonical_tool(
    name: Any, description: Any, parameters: Any, where: str, param: str = "tools", max_name: int = 64
) -> dict[str, Any]:
    """One function tool in the canonical (Chat Completions) shape the chat template receives."""
    if not isinstance(name, str) or not name:
        raise bad(f"{where} needs a name", param)
    if len(name) > max_name or not _TOOL_NAME.fullmatch(name):
        raise bad(f"{where}: the name {name[:max_name]!r} must be 1 to {max_name} of a-z, A-Z, 0-9, '_' and '-'", param)
    if description is not None and not isinstance(description, str):
        raise bad(f"{where}: 'description' must be a string", param)
    # the schema of a function's arguments: an object schema (as both APIs require)
    if parameters is not None and (not isinstance(parameters, dict) or parameters.get("type", "object") != "object"):
        raise bad(f"{where}: the parameters schema must be an object schema (type 'object')", param)
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def canonical_tools(
    raw: Any,
    kind: str,
    fields: Callable[[dict[str, Any]], tuple[Any, Any, Any]],
    *,
    default_kind: str | None = None,
    max_name: int = 64,
) -> list[dict[str, Any]] | None:
    """A dialect's `tools` list -> canonical tools; `fields(tool)` gives (name, description, schema).

    Only tools whose `type` is `kind` are supported (`default_kind` stands in for a missing type).
    """
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise bad("'tools' must be a list", "tools")
    tools = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type", default_kind) != kind:
            raise bad(f"tools[{i}]: only {kind} tools are supported", "tools")
        tools.append(canonical_tool(*fields(tool), f"tools[{i}]", max_name=max_name))
    return tools


def parse_arguments(raw: Any, limits: RequestLimits | None, param: str) -> Any:
    """Wire arguments (a JSON string) -> canonical (an object); text that is not a JSON object stays text.

    `limits` bounds the object's nesting (None: the arguments were checked when first parsed).
    """
    if isinstance(raw, str):
        try:
            value = orjson.loads(raw) if raw.strip() else {}
        except orjson.JSONDecodeError:
            return raw
        if not isinstance(value, dict):
            return raw  # the APIs take any string; a template renders text, but iterates an object's items
        if limits is not None and raw.count("{") + raw.count("[") > limits.max_json_depth:
            check_depth(value, limits, param, raw)  # more brackets than the limit: walk it
        return value
    return raw if raw is not None else {}


def arguments_json(arguments: Any) -> str:
    """Canonical arguments as the JSON string the OpenAI dialects carry."""
    return arguments if isinstance(arguments, str) else orjson.dumps(arguments).decode()


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event; `event:` is named for the dialects that name their events."""
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"


@dataclass(frozen=True, slots=True)
class BlockEvent:
    """A block boundary or a piece of a block: what the Anthropic and Responses streams are made of."""

    action: Literal["open", "delta", "close"]
    index: int  # the block's position in the reply (an Anthropic content index, a Responses output index)
    kind: DeltaKind
    text: str = ""
    call: dict[str, Any] | None = None
    call_index: int = 0  # a tool call's position among the reply's tool calls (its wire id)


async def block_events(deltas: AsyncIterator[LiveDelta]) -> AsyncIterator[BlockEvent]:
    """Group deltas into blocks: consecutive text of one kind is one block; each tool call is its own."""
    index, calls = -1, 0
    open_kind: DeltaKind | None = None
    async for delta in deltas:
        if open_kind is not None and (delta.kind == "tool_call" or delta.kind != open_kind):
            yield BlockEvent("close", index, open_kind)
            open_kind = None
        if delta.kind == "tool_call":
            index += 1
            yield BlockEvent("open", index, "tool_call", call=delta.call, call_index=calls)
            yield BlockEvent("close", index, "tool_call", call=delta.call, call_index=calls)
            calls += 1
            continue
        if open_kind is None:
            index += 1
            open_kind = delta.kind
            yield BlockEvent("open", index, delta.kind)
        yield BlockEvent("delta", index, delta.kind, text=delta.text)
    if open_kind is not None:
        yield BlockEvent("close", index, open_kind)


async def from_list(deltas: list[LiveDelta]) -> AsyncIterator[LiveDelta]:
    for delta in deltas:
        yield delta
