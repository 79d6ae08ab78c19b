"""Anthropic Messages dialect: `POST /v1/messages` (and count_tokens) -> TurnRequest, turns -> Messages replies.

Content blocks map onto canonical messages: `thinking` -> reasoning, `text` -> content,
`tool_use` -> tool calls (ids are wire-only), each `tool_result` -> a tool message named
after its call; `redacted_thinking` carries nothing we can render and is dropped. Replies
are one message with thinking / text / tool_use blocks, streamed live with the event
sequence the `anthropic` SDK consumes (message_start, ping, content_block_start / delta /
stop, message_delta with stop_reason and usage, message_stop). Strict validation, as in
the other dialects. No I/O here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson

from gateway_workers.adapters.base import no_history
from gateway_workers.adapters.common import (
    BlockEvent,
    OpenCalls,
    bad,
    block_events,
    canonical_tools,
    check_known,
    check_object,
    check_types,
    earlier_elements,
    flag,
    integer,
    number,
    sse,
)
from gateway_workers.formats.live_split import reply_deltas
from gateway_workers.http.errors import ApiError
from gateway_workers.http.limits import (
    DEFAULT_LIMITS,
    RequestLimits,
    check_count,
    check_depth,
    check_parts,
    check_turn,
)
from gateway_workers.turns.live import LiveTurn
from gateway_workers.turns.pipeline import CapturedTurn, TurnRequest, tool_call_id

# Accepted and without effect on a token-in/token-out turn (thinking is the chat template's business).
HISTORY_FIELD = "messages"  # the conversation, which grows at its end (`Adapter.HISTORY_FIELD`)
_IGNORED = {"model", "metadata", "service_tier", "thinking", "context_management", "output_config"}
_HANDLED = {
    "messages",
    "system",
    "tools",
    "tool_choice",
    "max_tokens",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "stream",
}
_TYPES = {"model": str, "metadata": dict, "service_tier": str, "context_management": dict, "output_config": dict}
MAX_TOOL_NAME = 128  # the Messages API's own bound (OpenAI's is 64)
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
    the next request's parse compares its own with (`Adapter.parse_request`'s `earlier`)."""

    turn: TurnRequest
    stream: bool
    raw_system: Any = None
    raw_messages: list[Any] | None = None


def _text_blocks(content: Any, where: str, joiner: str, limits: RequestLimits) -> str:
    """A string, or a list of text blocks joined (other block types are refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}: content must be a string or a list of text blocks", "messages")
    check_parts(content, limits, "messages")
    texts = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise bad(f"{where}: a block of type {kind!r} is not supported here (text only)", "messages")
        texts.append(block["text"])
    return joiner.join(texts)


def _assistant(content: Any, where: str, pending: OpenCalls, limits: RequestLimits) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise bad(f"{where}: content must be a string or a list of blocks", "messages")
    check_parts(content, limits, "messages")
    text, reasoning, calls = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # encrypted elsewhere; nothing of it can be rendered
        elif kind == "tool_use":
            name, arguments = block.get("name"), block.get("input")
            if not isinstance(name, str) or not name or not isinstance(arguments, dict):
                raise bad(f"{where}.content[{j}]: tool_use needs a name and an object input", "messages")
            call_id = block.get("id")
            if not isinstance(call_id, str) or not call_id:
                raise bad(f"{where}.content.{j}.tool_use.id: Field required (a string)", "messages",
                          code="missing_required_parameter")
            if call_id in pending:
                raise bad(f"{where}.content.{j}: `tool_use` ids must be unique: {call_id!r}", "messages")
            pending[call_id] = name
            check_depth(arguments, limits, "messages")
            calls.append({"name": name, "arguments": arguments})
        else:
            raise bad(f"{where}.content[{j}]: block type {kind!r} is not supported in assistant messages", "messages")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if reasoning and "".join(reasoning):
        message["reasoning"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _user(content: Any, where: str, pending: OpenCalls, limits: RequestLimits) -> list[dict[str, Any]]:
    """A user turn: its tool results become tool messages and its text a user message, in order."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise bad(f"{where}: content must be a string or a list of blocks", "messages")
    check_parts(content, limits, "messages")
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            result = block.get("content", "")
            tool: dict[str, Any] = {
                "role": "tool",
                "content": _text_blocks(result, f"{where}.content[{j}].content", "\n", limits),
            }
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad(f"{where}.content.{j}.tool_result.tool_use_id: Field required (a string)", "messages",
                          code="missing_required_parameter")
            name = pending.pop(call_id, None)
            if name is None:
                raise bad(f"{where}.content.{j}: unexpected `tool_use_id` found in `tool_result` blocks: {call_id}. "
                          "Each `tool_result` block must have a corresponding `tool_use` block in the previous "
                          "message.", "messages")
            tool["name"] = name
            out.append(tool)
        else:
            raise bad(
                f"{where}.content[{j}]: block type {kind!r} is not supported (text and tool_result only)", "messages"
            )
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _messages(body: dict[str, Any], limits: RequestLimits, earlier: MessagesRequest | None) -> list[dict[str, Any]]:
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("'messages' must be a non-empty list", "messages")
    check_count(len(raw), limits.max_messages, "messages", "messages")
    system = body.get("system")
    # A message converts to canonical messages of its own, whatever comes before it but open calls
    messages: list[dict[str, Any]] = []
    start = 0
    if earlier is not None and system is earlier.raw_system:
        start = earlier_elements(earlier.raw_messages, raw)
        messages = [*earlier.turn.messages] if start else []
    if not start and system is not None:
        text = _text_blocks(system, "system", "\n", limits)
        if text:
            messages.append({"role": "system", "content": text})
    pending: OpenCalls = {}
    for i, message in enumerate(raw[start:], start):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise bad(f"{where} must be an object with role 'user' or 'assistant'", "messages")
        # a tool_use's result must come in the very next message, which must then answer all of them
        opened = dict(pending)
        if message["role"] == "assistant":
            _unanswered(opened, i)
            messages.append(_assistant(message.get("content"), where, pending, limits))
        else:
            messages.extend(_user(message.get("content"), where, pending, limits))
            _unanswered(pending, i - 1)
            pending.clear()
    _unanswered(pending, len(raw) - 1)
    return messages


def _unanswered(open_calls: dict[str, str], index: int) -> None:
    if open_calls:
        raise bad(f"messages.{index}: `tool_use` ids were found without `tool_result` blocks immediately after: "
                  f"{', '.join(open_calls)}. Each `tool_use` block must have a corresponding `tool_result` block "
                  "in the next message.", "messages")


def _tool_fields(tool: dict[str, Any]) -> tuple[Any, Any, Any]:
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise bad(f"tools: tool {tool.get('name')!r} needs an 'input_schema' object", "tools",
                  code="missing_required_parameter" if schema is None else "invalid_request")
    if schema.get("type") != "object":
        raise bad(f"tools: tool {tool.get('name')!r}: input_schema.type must be 'object'", "tools")
    return tool.get("name"), tool.get("description"), schema


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    """Client tools only: server tools (web search, ...) have a `type` and are not ours to run."""
    tools = canonical_tools(raw, "custom", _tool_fields, default_kind="custom", max_name=MAX_TOOL_NAME)
    names = [tool["function"]["name"] for tool in tools or ()]
    if len(set(names)) < len(names):
        raise bad("tools: tool names must be unique", "tools")
    return tools


def _check_thinking(thinking: Any, max_tokens: int | None) -> None:
    """`thinking` has no effect here (the chat template decides), but a malformed one is the agent's bug."""
    if thinking is None:
        return
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise bad("thinking.type: must be 'enabled', 'disabled' or 'adaptive'", "thinking")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < MIN_THINKING_BUDGET:
            raise bad(f"thinking.budget_tokens: must be an integer >= {MIN_THINKING_BUDGET}", "thinking")
        if max_tokens is not None and budget >= max_tokens:
            raise bad("max_tokens must be greater than thinking.budget_tokens", "max_tokens")


load_history = no_history  # a request carries its whole conversation


def parse_request(
    body: Any, limits: RequestLimits = DEFAULT_LIMITS, earlier: MessagesRequest | None = None, *, counting: bool = False
) -> MessagesRequest:
    """Validate a Messages body (`counting`: a count_tokens body, without max_tokens)."""
    body = check_object(body)
    check_known(body, _HANDLED, _IGNORED)
    check_types(body, _TYPES)
    choice = body.get("tool_choice")
    if choice is not None and (not isinstance(choice, dict) or choice.get("type") != "auto"):
        raise bad("only tool_choice {'type': 'auto'} is supported", "tool_choice")
    stop = body.get("stop_sequences")
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise bad("'stop_sequences' must be a list of non-empty strings", "stop_sequences")
    max_tokens = integer(body, "max_tokens", 1)
    if max_tokens is None and not counting:
        raise bad("'max_tokens' is required", "max_tokens", code="missing_required_parameter")
    _check_thinking(body.get("thinking"), max_tokens)
    messages, tools = _messages(body, limits, earlier), _tools(body.get("tools"))
    check_turn(tools, limits)
    turn = TurnRequest(
        messages=messages,
        tools=tools,
        max_tokens=max_tokens,
        temperature=number(body, "temperature", 0.0, 1.0),
        top_p=number(body, "top_p", 0.0, 1.0),
        top_k=integer(body, "top_k", 0),
        stop=tuple(stop or ()),
    )
    return MessagesRequest(turn, flag(body, "stream"), body.get("system"), body["messages"])


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


async def stream_events(live: LiveTurn, request: MessagesRequest, model: str) -> AsyncIterator[bytes]:
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
