"""What the three wire adapters share: validation errors, canonical arguments, SSE framing, reply blocks.

Errors carry the OpenAI API's own codes (`invalid_type`, `invalid_value`, `missing_required_parameter`,
`unknown_parameter`, ...), which the OpenAI dialects send and every dialect logs and counts. A reply is a
sequence of blocks (reasoning, text, tool calls), built from the final parse for a whole reply or from live
deltas for a stream (`block_events`). No I/O here; must not import the app.
"""

from __future__ import annotations

import operator
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from gateway_workers.formats.parsed import DeltaKind, LiveDelta
from gateway_workers.http.errors import ApiError
from gateway_workers.http.limits import RequestLimits, check_depth

_JSON_TYPES = {str: "a string", bool: "a boolean", dict: "an object", list: "an array", int: "an integer",
               float: "a decimal", type(None): "null"}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 for a request the agent must fix (the SDKs never retry a 400). `code`: OpenAI's error code (None where
    OpenAI's is null, as for a conversation whose tool calls and results do not pair up)."""
    return ApiError(400, "invalid_request", message, code=code, param=param)


def _json_type(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def invalid_type(name: str, expected: str, value: Any, param: str | None = None) -> ApiError:
    return bad(f"Invalid type for '{name}': expected {expected}, but got {_json_type(value)} instead.",
               param or name, "invalid_type")


def wrong_value(name: str, value: Any, supported: tuple[str, ...], param: str | None = None) -> ApiError:
    values = ", ".join(repr(v) for v in supported)
    return bad(f"Invalid value for '{name}': {value!r}. Supported values are: {values}.", param or name,
               "invalid_value")


def missing(name: str, param: str | None = None) -> ApiError:
    return bad(f"Missing required parameter: '{name}'.", param or name, "missing_required_parameter")


def unsupported(name: str, why: str, value: bool = True, param: str | None = None) -> ApiError:
    """A valid request this gateway cannot serve (`value`: the value is refused, not the parameter)."""
    return bad(f"Unsupported {'value' if value else 'parameter'}: '{name}' {why}", param or name,
               "unsupported_value" if value else "unsupported_parameter")


def bad_part(part: Any, where: str, param: str, text_kinds: tuple[str, ...]) -> ApiError:
    """What is wrong with a content part that is not a text part (the error path only)."""
    if not isinstance(part, dict):
        return invalid_type(f"{where}.content[]", "an object", part, param)
    kind = part.get("type")
    if kind is None:
        return missing(f"{where}.content[].type", param)
    if not isinstance(kind, str):
        return invalid_type(f"{where}.content[].type", "a string", kind, param)
    if kind in text_kinds or kind == "refusal":
        field = "refusal" if kind == "refusal" else "text"
        return invalid_type(f"{where}.content[].{field}", "a string", part.get(field), param)
    if kind in ("image_url", "input_audio", "file", "input_image", "input_file"):
        return unsupported(f"{where}.content", f"holds a part of type {kind!r}: images, audio and files are not "
                           "served (text only)", param=param)
    return wrong_value(f"{where}.content[].type", kind, text_kinds, param)


def join_text_parts(parts: list[Any], where: str, param: str, text_kinds: tuple[str, ...],
                    ignored_keys: frozenset[str], ignored: set[str] | None, label: str) -> str:
    """An OpenAI message's content parts, text (or a refusal's text) only, joined with newlines (as vLLM does);
    the parts' ignored fields go into `ignored` as `label.key` (None: not counted)."""
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        if type(kind) is not str or kind not in text_kinds or not isinstance(part.get("text"), str):
            raise bad_part(part, where, param, text_kinds)
        if ignored is not None and len(part) > 2 and not ignored_keys.isdisjoint(part):
            ignored.update(f"{label}.{key}" for key in part if key in ignored_keys)
        texts.append(part["text"])
    return "\n".join(texts)


def earlier_elements(earlier: list[Any] | None, elements: list[Any]) -> int:
    """How many leading `elements` a parse of the session's previous request converted already: all of that
    request's (`earlier`, its conversation's elements), when `elements` begins with those very objects
    (`http.bodies` shares them between a session's consecutive bodies), else 0. Only a whole valid request
    counts: it leaves no tool call open, so the elements after it convert as they would after its own."""
    if earlier is None or len(earlier) > len(elements) or not all(map(operator.is_, elements, earlier)):
        return 0
    return len(earlier)


def non_empty_list(value: Any, name: str, expected: str) -> list[Any]:
    """A required array of at least one element (`expected`: what else the field may be, for the message)."""
    if not isinstance(value, list) or not value:
        if value is None:
            raise missing(name)
        if isinstance(value, list):
            raise bad(f"Invalid '{name}': empty array. Expected an array with minimum length 1, but got an empty "
                      "array instead.", name, "empty_array")
        raise invalid_type(name, expected, value)
    return value


def check_tool_choice(body: Mapping[str, Any]) -> None:
    """The OpenAI dialects' tool_choice: `auto` (or null); any other choice needs constrained decoding."""
    choice = body.get("tool_choice", "auto")
    if choice in ("auto", None):
        return
    if choice in ("none", "required") or isinstance(choice, dict):
        raise unsupported("tool_choice", "other than 'auto' is not served: without constrained decoding the model's "
                          "choice cannot be forced")
    if not isinstance(choice, str):
        raise invalid_type("tool_choice", "a string or an object", choice)
    raise wrong_value("tool_choice", choice, ("auto", "none", "required"))


def check_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad(f"Invalid type for the body: expected an object, but got {_json_type(body)} instead.", None,
                  "invalid_type")
    return body


def check_types(body: Mapping[str, Any], types: Mapping[str, type]) -> None:
    """Parameters we accept without using them still have the type their API requires (null: left out)."""
    for name, kind in types.items():
        value = body.get(name)
        if value is not None and not isinstance(value, kind):
            raise invalid_type(name, _JSON_TYPES[kind], value)


def check_known(body: Mapping[str, Any], known: Mapping[str, str]) -> tuple[str, ...]:
    """The body's ignored fields (`known`: each field with a rule of its own, and its verdict). A field without one
    gets the real APIs' 400 naming it; a refused one is refused by the adapter, which knows what values it takes."""
    ignored: list[str] = []
    for name in body:
        verdict = known.get(name)
        if verdict is None:
            raise bad(f"Unknown parameter: '{name}'.", name, "unknown_parameter")
        if verdict == "ignored":
            ignored.append(name)
    return tuple(ignored)


def number(body: Mapping[str, Any], name: str, lo: float, hi: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid_type(name, "a decimal", value)
    if not lo <= value <= hi:
        side, bound = ("below_min", f">= {lo}") if value < lo else ("above_max", f"<= {hi}")
        raise bad(f"Invalid '{name}': decimal {side.replace('_', ' ')}imum value. Expected a value {bound}, but got "
                  f"{value} instead.", name, f"decimal_{side}_value")
    return float(value)


def integer(body: Mapping[str, Any], name: str, lo: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_type(name, "an integer", value)
    if value < lo:
        raise bad(f"Invalid '{name}': integer below minimum value. Expected a value >= {lo}, but got {value} "
                  "instead.", name, "integer_below_min_value")
    return value


def flag(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid_type(name, "a boolean", value)
    return value


# The order rule for tool calls that every dialect enforces, as one dict per request: an assistant
# message's calls open (call id -> tool name, in call order), each result closes one by its id, and a
# dialect decides when calls left open are an error (Chat Completions and Messages: at the next
# message that is not a result). A plain dict: its `in`, `pop` and assignment run per call.
OpenCalls = dict[str, str]


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

    action: Literal["open", "delta", "close", "keepalive"]
    index: int  # the block's position in the reply (an Anthropic content index, a Responses output index)
    kind: DeltaKind
    text: str = ""
    call: dict[str, Any] | None = None
    call_index: int = 0  # a tool call's position among the reply's tool calls (its wire id)


# What a stream sends while it waits: an SSE comment, which the official SDKs skip.
KEEPALIVE = b": keep-alive\n\n"


async def block_events(deltas: AsyncIterator[LiveDelta]) -> AsyncIterator[BlockEvent]:
    """Group deltas into blocks: consecutive text of one kind is one block; each tool call is its own."""
    index, calls = -1, 0
    open_kind: DeltaKind | None = None
    async for delta in deltas:
        if delta.kind == "keepalive":
            yield BlockEvent("keepalive", index, "keepalive")
            continue
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
