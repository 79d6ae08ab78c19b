"""Anthropic Messages dialect: `POST /v1/messages` (and count_tokens) -> TurnRequest, turns -> Messages replies.

Every field has one verdict (`request_fields.MESSAGES`); the conversation's blocks map onto canonical
messages in `anthropic_blocks`. Tools without a `type` (or `custom`) are the agent's own; every typed tool is
Anthropic's (server tools, and client tools whose schema only Anthropic has): hosted, left out and noted.
Replies are one message with thinking / text / tool_use blocks, streamed live with the event sequence the
`anthropic` SDK consumes (message_start, ping, content_block_start / delta / stop, message_delta with
stop_reason and usage, message_stop). No I/O here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson

from gateway_workers.adapters import request_fields
from gateway_workers.adapters.anthropic_blocks import canonical_messages, clears, text_blocks
from gateway_workers.adapters.base import no_history
from gateway_workers.adapters.common import (
    KEEPALIVE,
    BlockEvent,
    bad,
    block_events,
    check_known,
    check_object,
    check_types,
    earlier_elements,
    flag,
    integer,
    invalid_type,
    missing,
    non_empty_list,
    number,
    sse,
    unsupported,
)
from gateway_workers.adapters.tool_readers import messages_tools
from gateway_workers.adapters.tools import NO_TOOLS, ToolSet
from gateway_workers.formats.parsed import reply_deltas
from gateway_workers.http.errors import ApiError
from gateway_workers.http.limits import DEFAULT_LIMITS, RequestLimits, check_count, check_turn
from gateway_workers.turns.captured import CapturedTurn, LiveReply, TurnRequest, tool_call_id

HISTORY_FIELD = "messages"  # the conversation, which grows at its end (`Adapter.HISTORY_FIELD`)
_KNOWN = request_fields.known_fields("messages")
_SYSTEM_IGNORED = request_fields.ignored_fields("messages", "system[text]")
_TYPES = {"model": str, "metadata": dict, "service_tier": str, "context_management": dict, "output_config": dict}
MIN_THINKING_BUDGET = 1024  # the Messages API's own floor for thinking.budget_tokens
SIGNATURE = "rollout-gateway"  # thinking blocks carry a signature; ours only says where they came from

_ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "rate_limit": "rate_limit_error",
    "unavailable": "overloaded_error",
    "too_large": "request_too_large",
    "headers_too_large": "request_too_large",
}


def error_body(error: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(error.kind, "api_error"), "message": error.message}}


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    """A validated Messages body; `raw_system` and `raw_messages`, its system prompt and messages as sent, which
    the next request's parse compares its own with (`Adapter.parse_request`'s `earlier`); `toolset`: its tools;
    `ignored`: the ignored fields it carried (what it added to the previous request), by name."""

    turn: TurnRequest
    stream: bool
    raw_system: Any = None
    raw_messages: list[Any] | None = None
    toolset: ToolSet = NO_TOOLS
    ignored: tuple[str, ...] = ()

    @property
    def hosted(self) -> tuple[tuple[str, str], ...]:
        return self.toolset.hosted


def _messages(body: dict[str, Any], limits: RequestLimits, earlier: MessagesRequest | None,
              ignored: set[str]) -> list[dict[str, Any]]:
    raw = non_empty_list(body.get("messages"), "messages", "an array")
    check_count(len(raw), limits.max_messages, "messages", "messages")
    system = body.get("system")
    # A message converts to canonical messages of its own, whatever comes before it but open calls; a system
    # message a later user message clears (`clear_at`) stops the reuse, as the new messages may hold one.
    start = 0
    if earlier is not None and system is earlier.raw_system and earlier.raw_messages is not None:
        start = earlier_elements(earlier.raw_messages, raw)
        if start and any(map(clears, earlier.raw_messages)):
            start = 0
    messages: list[dict[str, Any]] = [*earlier.turn.messages] if start and earlier is not None else []
    if not start and system is not None:
        text = text_blocks(system, "system", "\n", limits, ignored, "system")
        if text:
            messages.append({"role": "system", "content": text})
    return messages + canonical_messages(raw, start, limits, ignored)


def _check_thinking(thinking: Any, max_tokens: int | None) -> None:
    """`thinking` has no effect here (the chat template decides), but a malformed one is the agent's bug."""
    if thinking is None:
        return
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise bad("thinking.type: must be 'enabled', 'disabled' or 'adaptive'", "thinking", "invalid_value")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < MIN_THINKING_BUDGET:
            raise bad(f"thinking.budget_tokens: must be an integer >= {MIN_THINKING_BUDGET}", "thinking",
                      "invalid_value")
        if max_tokens is not None and budget >= max_tokens:
            raise bad("max_tokens must be greater than thinking.budget_tokens", "max_tokens", "invalid_value")


def _refuse_unserved(body: dict[str, Any]) -> None:
    """The fields whose meaning this gateway cannot give (`request_fields`: refused), when they ask for it."""
    for name, why in (("compaction", "server-side compaction is not served"),
                      ("thread", "server-held threads are not served: send the whole conversation")):
        if body.get(name) is not None:
            raise unsupported(name, why, value=False)
    output = body.get("output_config")
    if output is not None and output.get("format") is not None:
        raise unsupported("output_config.format", "structured outputs need constrained decoding, which is not "
                          "served", param="output_config")
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind in ("any", "tool", "none"):
            raise unsupported("tool_choice", f"{kind!r} is not served: without constrained decoding the model's "
                              "choice cannot be forced (only 'auto')")
        if kind != "auto":
            raise bad("tool_choice.type: must be 'auto', 'any', 'tool' or 'none'", "tool_choice", "invalid_value")


load_history = no_history  # a request carries its whole conversation


def parse_request(
    body: Any, limits: RequestLimits = DEFAULT_LIMITS, earlier: MessagesRequest | None = None, *, counting: bool = False
) -> MessagesRequest:
    """Validate a Messages body (`counting`: a count_tokens body, without max_tokens)."""
    body = check_object(body)
    top_ignored = check_known(body, _KNOWN)
    check_types(body, _TYPES)
    _refuse_unserved(body)
    stop = body.get("stop_sequences")
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise invalid_type("stop_sequences", "an array of non-empty strings", stop)
    max_tokens = integer(body, "max_tokens", 1)
    if max_tokens is None and not counting:
        raise missing("max_tokens")
    _check_thinking(body.get("thinking"), max_tokens)
    ignored: set[str] = set()
    messages = _messages(body, limits, earlier, ignored)
    toolset = messages_tools(body.get("tools"), body.get("mcp_servers"))
    check_turn(toolset.tools, limits)
    turn = TurnRequest(
        messages=messages,
        tools=toolset.tools,
        max_tokens=max_tokens,
        temperature=number(body, "temperature", 0.0, 1.0),
        top_p=number(body, "top_p", 0.0, 1.0),
        top_k=integer(body, "top_k", 0),
        stop=tuple(stop or ()),
    )
    if ignored or toolset.ignored:
        top_ignored = (*top_ignored, *sorted(ignored | toolset.ignored))
    return MessagesRequest(turn, flag(body, "stream"), body.get("system"), body["messages"], toolset, top_ignored)


def _stop_reason(finish_reason: str) -> str:
    return {"length": "max_tokens", "tool_calls": "tool_use"}.get(finish_reason, "end_turn")


def _block(event: BlockEvent, turn_id: str) -> dict[str, Any]:
    """The block an `open` event starts, empty (tool calls arrive whole: their input comes as one delta)."""
    if event.kind == "reasoning":
        return {"type": "thinking", "thinking": "", "signature": ""}
    if event.kind == "content":
        return {"type": "text", "text": ""}
    assert event.call is not None
    return {
        "type": "tool_use",
        "id": tool_call_id("toolu_", turn_id, event.call_index),
        "name": event.call["name"],
        "input": {},
    }


def _message(
    turn_id: str, model: str, content: list[dict[str, Any]], stop_reason: str | None, prompt: int, output: int
) -> dict[str, Any]:
    return {
        "id": f"msg_{turn_id}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": {
            "input_tokens": prompt,
            "output_tokens": output,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }


def response_body(turn: CapturedTurn, request: MessagesRequest, model: str) -> bytes:
    content: list[dict[str, Any]] = []
    calls = 0
    for delta in reply_deltas(turn.parsed):
        if delta.kind == "reasoning":
            content.append({"type": "thinking", "thinking": delta.text, "signature": SIGNATURE})
        elif delta.kind == "content":
            content.append({"type": "text", "text": delta.text})
        else:
            assert delta.call is not None
            content.append(
                {
                    "type": "tool_use",
                    "id": tool_call_id("toolu_", turn.turn_id, calls),
                    "name": delta.call["name"],
                    "input": delta.call["arguments"],
                }
            )
            calls += 1
    return orjson.dumps(
        _message(
            turn.turn_id,
            model,
            content,
            _stop_reason(turn.finish_reason),
            len(turn.prompt_ids),
            len(turn.result.output_ids),
        )
    )


async def stream_events(live: LiveReply, request: MessagesRequest, model: str) -> AsyncIterator[bytes]:
    """The Messages SSE stream of a live turn."""
    start = _message(live.turn_id, model, [], None, len(live.prompt_ids), 0)
    yield sse({"type": "message_start", "message": start}, "message_start")
    yield sse({"type": "ping"}, "ping")
    try:
        async for event in block_events(live.deltas()):
            index = event.index
            if event.action == "open":
                block = _block(event, live.turn_id)
                yield sse(
                    {"type": "content_block_start", "index": index, "content_block": block}, "content_block_start"
                )
                if event.kind == "tool_call":
                    assert event.call is not None
                    delta = {"type": "input_json_delta", "partial_json": orjson.dumps(event.call["arguments"]).decode()}
                    yield sse({"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta")
            elif event.action == "delta":
                delta = (
                    {"type": "thinking_delta", "thinking": event.text}
                    if event.kind == "reasoning"
                    else {"type": "text_delta", "text": event.text}
                )
                yield sse({"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta")
            elif event.action == "keepalive":
                yield KEEPALIVE
            else:
                if event.kind == "reasoning":
                    delta = {"type": "signature_delta", "signature": SIGNATURE}
                    yield sse({"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta")
                yield sse({"type": "content_block_stop", "index": index}, "content_block_stop")
    except ApiError as e:
        yield sse(error_body(e), "error")
        raise
    turn = live.turn
    assert turn is not None
    stop = {"stop_reason": _stop_reason(turn.finish_reason), "stop_sequence": None}
    usage = {"input_tokens": len(turn.prompt_ids), "output_tokens": len(turn.result.output_ids)}
    yield sse({"type": "message_delta", "delta": stop, "usage": usage}, "message_delta")
    yield sse({"type": "message_stop"}, "message_stop")
