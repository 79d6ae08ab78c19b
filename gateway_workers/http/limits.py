"""Request limits: how big a request may be, checked at the edge before it costs the worker real time.

`RequestLimits` is one picklable record in `WorkerConfig` (CLI flags, `ROLLOUT_GATEWAY_MAX_*` variables).
The body and header bounds are checked by the app before the body is read or parsed (413 / 431, and
the connection is closed so an unread body is never buffered); the shape bounds (messages, tools,
content parts, string lengths, JSON nesting) by the adapters while they translate, through `check_turn`
and `check_json`. Deep JSON is refused because the template printers and the msgpack commit recurse on it.
Imports nothing of the gateway but `http.errors`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gateway_workers.http.errors import ApiError

# Anthropic's own API refuses bodies over 32 MB; a 1M-token conversation is a few MB of JSON.
DEFAULT_MAX_BODY_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Bounds on one agent request; every one answers a 4xx that names it.

    Args:
        max_body_bytes: the body, by Content-Length before reading and by bytes read for a chunked body (413).
        max_header_bytes: all request header names and values together (431).
        max_messages: messages (input items) in one request.
        max_tools: tools declared in one request.
        max_content_parts: content parts (blocks) in one message.
        max_string_chars: one string: a message's text, a tool result, an argument value.
        max_json_depth: nesting of free-form JSON (tool schemas, tool-call arguments).
    """

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_header_bytes: int = 64 << 10
    max_messages: int = 4096
    max_tools: int = 512
    max_content_parts: int = 1024
    max_string_chars: int = 8 << 20
    max_json_depth: int = 64

    def __post_init__(self) -> None:
        for name in self.__slots__:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


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


def check_count(count: int, limit: int, what: str, param: str) -> None:
    if count > limit:
        raise ApiError(400, "invalid_request", f"'{param}': {count} {what}, at most {limit} are accepted",
                       code="array_above_max_length", param=param)


def check_string(text: str, limits: RequestLimits, param: str) -> None:
    if len(text) > limits.max_string_chars:
        raise ApiError(400, "invalid_request", f"'{param}': a string of {len(text)} characters, at most "
                       f"{limits.max_string_chars} are accepted", code="string_above_max_length", param=param)


def check_json(value: Any, limits: RequestLimits, param: str) -> None:
    """Free-form JSON (a schema, call arguments): nesting, container sizes and strings within the limits."""
    stack = [(value, 1)]
    max_depth, max_items, max_chars = limits.max_json_depth, limits.max_messages, limits.max_string_chars
    while stack:
        node, depth = stack.pop()
        kind = type(node)
        if kind is str:
            if len(node) > max_chars:
                check_string(node, limits, param)
            continue
        if kind is dict:
            children = [*node.keys(), *node.values()]
        elif kind is list:
            children = node
        else:
            continue
        if depth > max_depth:
            raise ApiError(400, "invalid_request", f"'{param}' is nested more than {max_depth} levels deep",
                           code="nested_too_deep", param=param)
        if len(node) > max_items:
            check_count(len(node), max_items, "items in one object or array", param)
        stack.extend((child, depth + 1) for child in children)


def check_turn(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, limits: RequestLimits) -> None:
    """The shape bounds of a translated turn (canonical messages and tools), in one pass."""
    check_count(len(messages), limits.max_messages, "messages", "messages")
    max_chars = limits.max_string_chars
    for message in messages:
        if len(message["content"]) > max_chars:
            check_string(message["content"], limits, "messages")
        reasoning = message.get("reasoning")
        if reasoning is not None and len(reasoning) > max_chars:
            check_string(reasoning, limits, "messages")
        calls = message.get("tool_calls")
        if calls:
            for call in calls:
                check_json(call["arguments"], limits, "messages")
    if tools:
        check_count(len(tools), limits.max_tools, "tools", "tools")
        for tool in tools:
            check_json(tool, limits, "tools")
