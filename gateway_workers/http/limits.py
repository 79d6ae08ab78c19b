"""Request limits: how big a request may be, checked at the edge before it costs the worker real time.

`RequestLimits` is one picklable record in `WorkerConfig` (its settings: `broker.settings`).
The body and header bounds are checked by the app before the body is read or parsed (413 / 431, and
the connection is closed so an unread body is never buffered), and string lengths by the app on bodies
long enough to hold an over-long string (`check_strings`); the shape bounds (messages, tools, content
parts, JSON nesting) by the adapters where they walk what they bound (`check_parts`, `check_depth`,
`check_turn`), so a request within the limits pays next to nothing for them.
Imports nothing of the gateway but `http.errors`, and `broker.settings`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson

from broker.settings import check, setting
from gateway_workers.http.errors import ApiError

# Anthropic's own API refuses bodies over 32 MB; a 1M-token conversation is a few MB of JSON.
DEFAULT_MAX_BODY_BYTES = 16 << 20


def _count(value: Any) -> str | None:
    return None if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else "must be an integer >= 1"


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Bounds on one agent request; every one answers a 4xx, in the dialect's own error shape, that names it."""

    ENV_PREFIX: ClassVar[str] = "ROLLOUT_GATEWAY_"

    max_body_bytes: int = setting(
        DEFAULT_MAX_BODY_BYTES, "request body bytes: 413, decided from `Content-Length` before reading, or as soon "
        "as a chunked body outgrows it, and the connection is closed", metavar="N", check=_count, shown="16 MiB")
    max_header_bytes: int = setting(64 << 10, "request header bytes, names and values together: 431", metavar="N",
                                    check=_count, shown="64 KiB")
    max_messages: int = setting(4096, "messages (or input items) in one request", metavar="N", check=_count)
    max_tools: int = setting(512, "tools declared in one request", metavar="N", check=_count)
    max_content_parts: int = setting(1024, "content parts (blocks) in one message", metavar="N", check=_count)
    max_string_chars: int = setting(8 << 20, "characters in one string (a message's text, a tool result, an "
                                    "argument)", metavar="N", check=_count, shown="8 Mi characters")
    max_json_depth: int = setting(64, "nesting depth of free-form JSON (tool schemas, tool-call arguments)",
                                  metavar="N", check=_count)

    def __post_init__(self) -> None:
        check(self)


DEFAULT_LIMITS = RequestLimits()


def too_large(message: str) -> ApiError:
    return ApiError(413, "too_large", message, code="request_too_large")


def check_headers(headers: Iterable[tuple[bytes, bytes]], limits: RequestLimits) -> None:
    """431 when the request's headers add up to more than `max_header_bytes`."""
    size = sum(len(name) + len(value) for name, value in headers)
    if size > limits.max_header_bytes:
        raise ApiError(431, "headers_too_large", f"request headers are {size} bytes; at most "
                       f"{limits.max_header_bytes} are accepted", code="request_header_fields_too_large")


def check_content_length(value: str | None, limits: RequestLimits) -> None:
    """413 for a declared body over the limit: decided before a byte of it is read."""
    if value is None:
        return
    try:
        declared = int(value)
    except ValueError:
        raise ApiError(400, "invalid_request", "the Content-Length header is not a number") from None
    if declared > limits.max_body_bytes:
        raise too_large(f"the request body is {declared} bytes; at most {limits.max_body_bytes} are accepted")


async def read_body(content_length: str | None, receive: Callable[[], Awaitable[Any]], limits: RequestLimits) -> bytes:
    """An ASGI request's body, refused (413) by its declared length before reading, or as soon as it outgrows
    the limit, so no more of it is read."""
    check_content_length(content_length, limits)
    chunks, size, most = [], 0, limits.max_body_bytes
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ApiError(499, "invalid_request", "client disconnected")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > most:
            raise too_large(f"the request body is over {most} bytes (the limit); the rest was not read")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def check_count(count: int, limit: int, what: str, param: str) -> None:
    if count > limit:
        raise ApiError(400, "invalid_request", f"'{param}': {count} {what}, at most {limit} are accepted",
                       code="array_above_max_length", param=param)


def check_string(text: str, limits: RequestLimits, param: str) -> None:
    if len(text) > limits.max_string_chars:
        raise ApiError(400, "invalid_request", f"'{param}': a string of {len(text)} characters, at most "
                       f"{limits.max_string_chars} are accepted", code="string_above_max_length", param=param)


def check_strings(value: Any, limits: RequestLimits, path: str = "") -> None:
    """Every string in a decoded body (or in its part at `path`) within `max_string_chars` (a walk of all of
    it); the error names it.

    Only bodies longer than `max_string_chars` bytes need it: a JSON string takes at least a byte
    per character, so a shorter body cannot hold a longer string (`app` checks that first).
    """
    stack: list[tuple[Any, str]] = [(value, path)]
    most = limits.max_string_chars
    while stack:
        node, path = stack.pop()
        kind = type(node)
        if kind is str:
            if len(node) > most:
                check_string(node, limits, path or "body")
        elif kind is dict:
            stack.extend((key, path) for key in node)
            stack.extend((child, f"{path}.{key}" if path else str(key)) for key, child in node.items())
        elif kind is list:
            stack.extend((child, f"{path}.[{i}]") for i, child in enumerate(node))


def check_depth(value: Any, limits: RequestLimits, param: str, text: str | bytes | None = None) -> None:
    """Free-form JSON (a tool schema, call arguments) nested at most `max_json_depth` containers deep.

    A value nests no deeper than its text has brackets, so `text` (the JSON it was decoded from, or
    else its orjson encoding) usually proves it at C speed; only a value with more brackets than the
    limit is walked. Deep values are refused because the template printers and the msgpack commit
    recurse on them.
    """
    most = limits.max_json_depth
    if text is None:
        try:
            text = orjson.dumps(value)
        except orjson.JSONEncodeError:  # orjson's own nesting limit, far above ours
            raise _too_deep(param, most) from None
    if isinstance(text, str):
        if text.count("{") + text.count("[") <= most:
            return
    elif text.count(b"{") + text.count(b"[") <= most:
        return
    level = [value] if type(value) is dict or type(value) is list else []
    depth = 0
    while level:
        depth += 1
        if depth > most:
            raise _too_deep(param, most)
        inner: list[Any] = []
        for node in level:
            inner += [v for v in (node.values() if type(node) is dict else node) if type(v) in _CONTAINERS]
        level = inner


_CONTAINERS = (dict, list)


def _too_deep(param: str, most: int) -> ApiError:
    return ApiError(400, "invalid_request", f"'{param}' is nested more than {most} levels deep",
                    code="nested_too_deep", param=param)


def check_parts(parts: list[Any], limits: RequestLimits, param: str) -> None:
    """One message's content parts within `max_content_parts` (called where a list of parts is walked)."""
    if len(parts) > limits.max_content_parts:
        check_count(len(parts), limits.max_content_parts, "content parts in one message", param)


def check_turn(tools: list[dict[str, Any]] | None, limits: RequestLimits) -> None:
    """The bounds on a turn's canonical tools that every dialect shares: how many, how deep."""
    if tools:
        check_count(len(tools), limits.max_tools, "tools", "tools")
        encoded = orjson.dumps(tools)
        if encoded.count(b"{") + encoded.count(b"[") > limits.max_json_depth:  # else no tool can be too deep
            for tool in tools:
                check_depth(tool, limits, "tools")
