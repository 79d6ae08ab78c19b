"""OpenAI Responses dialect: `POST /v1/responses` -> TurnRequest, turns -> Response objects and event streams.

Every field has one verdict (`request_fields.RESPONSES`). Input items become canonical messages in
`responses_items`; `instructions` is the system message. Function, custom and namespace tools go through
`adapters.tools` (a namespace's tools under flattened names, their calls answered under the namespace);
every other tool type is hosted, left out and noted. `previous_response_id` (`resp_<turn id>`) names a
committed turn of the same session: `load_history` fetches its canonical prompt + response from the broker and
`with_history` prepends them (new instructions replace the old system message). Tool-call ids derive from the
turn, so a follow-up's outputs find their call names. Replies stream live with the event sequence the `openai`
SDK consumes. No I/O here but the broker lookup in `load_history`.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson

from broker.protocol import TurnFound
from gateway_workers.adapters import request_fields
from gateway_workers.adapters.common import (
    KEEPALIVE,
    BlockEvent,
    arguments_json,
    bad,
    block_events,
    check_known,
    check_object,
    check_tool_choice,
    check_types,
    earlier_elements,
    flag,
    integer,
    invalid_type,
    number,
    sse,
    unsupported,
    wrong_value,
)
from gateway_workers.adapters.openai_chat import error_body  # noqa: F401 -- the Responses API shares its error shape
from gateway_workers.adapters.responses_items import canonical_messages, ends_model_turns
from gateway_workers.adapters.tool_readers import responses_tools
from gateway_workers.adapters.tools import NO_TOOLS, ToolSet, custom_input
from gateway_workers.formats import ParsedResponse
from gateway_workers.formats.parsed import reply_deltas
from gateway_workers.http.errors import ApiError
from gateway_workers.http.limits import DEFAULT_LIMITS, RequestLimits, check_count, check_turn
from gateway_workers.turns.captured import CapturedTurn, LiveReply, TurnRequest, tool_call_id
from gateway_workers.turns.pipeline import TurnPipeline

HISTORY_FIELD = "input"  # the conversation, which grows at its end (`Adapter.HISTORY_FIELD`)
_KNOWN = request_fields.known_fields("responses")
_RESPONSE_ID = re.compile(r"resp_([0-9a-f]{32})")
_TYPES = {"model": str, "metadata": dict, "store": bool, "user": str, "service_tier": str, "prompt_cache_key": str,
          "safety_identifier": str, "prompt_cache_retention": str, "include": list, "reasoning": dict,
          "truncation": str, "stream_options": dict, "parallel_tool_calls": bool, "text": dict,
          "client_metadata": dict}


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A validated Responses body; `items` are kept for `with_history` to canonicalize again; `toolset` maps
    calls back to the wire; `ignored`: the ignored fields it carried, by name."""

    turn: TurnRequest
    stream: bool
    instructions: str | None
    items: list[Any]
    wire_tools: list[Any]
    previous_response_id: str | None = None
    previous_turn_id: str | None = None
    toolset: ToolSet = NO_TOOLS
    ignored: tuple[str, ...] = ()

    @property
    def hosted(self) -> tuple[tuple[str, str], ...]:
        return self.toolset.hosted


def _refuse_unserved(body: dict[str, Any]) -> None:
    """The fields whose meaning this gateway cannot give (`request_fields`: refused), when they ask for it."""
    for name, why in (("conversation", "server-held conversations are not served: use previous_response_id or "
                       "send the input"), ("prompt", "stored prompt templates are not served")):
        if body.get(name) is not None:
            raise unsupported(name, why, value=False)
    if flag(body, "background"):
        raise unsupported("background", "responses are not served in the background")
    if integer(body, "top_logprobs", 0):
        raise unsupported("top_logprobs", "is not served: the sampled logprobs are recorded, not returned")
    check_tool_choice(body)
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise invalid_type("text.format", "an object", fmt, "text")
        kind = fmt.get("type")
        if kind in ("json_object", "json_schema"):
            raise unsupported("text.format", f"{kind!r} needs constrained decoding, which is not served",
                              param="text")
        if kind != "text":
            raise wrong_value("text.format.type", kind, ("text", "json_object", "json_schema"), "text")


def parse_request(
    body: Any, limits: RequestLimits = DEFAULT_LIMITS, earlier: ResponsesRequest | None = None
) -> ResponsesRequest:
    body = check_object(body)
    top_ignored = check_known(body, _KNOWN)
    check_types(body, _TYPES)
    _refuse_unserved(body)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid_type("instructions", "a string", instructions)
    previous = body.get("previous_response_id")
    previous_turn = None
    if previous is not None:
        match = _RESPONSE_ID.fullmatch(previous) if isinstance(previous, str) else None
        if match is None:
            raise bad(f"previous_response_id {previous!r} is not a response of this session", "previous_response_id",
                      "invalid_value")
        previous_turn = match.group(1)
    items = body.get("input")
    if type(items) is list:
        check_count(len(items), limits.max_messages, "input items", "input")
    ignored: set[str] = set()
    # With previous_response_id, call outputs may answer that response's calls: checked once it is loaded.
    start = _earlier_items(earlier, items, instructions) if earlier is not None and previous_turn is None else 0
    if earlier is not None and start:
        messages = [*earlier.turn.messages, *canonical_messages(items, {}, limits, start, ignored)]
    else:
        messages = canonical_messages(items, None if previous_turn is not None else {}, limits, 0, ignored)
        if instructions:
            messages.insert(0, {"role": "system", "content": instructions})
    toolset = responses_tools(body.get("tools"))
    check_turn(toolset.tools, limits)
    turn = TurnRequest(
        messages=messages,
        tools=toolset.tools,
        max_tokens=integer(body, "max_output_tokens", 1),
        temperature=number(body, "temperature", 0.0, 2.0),
        top_p=number(body, "top_p", 0.0, 1.0),
    )
    if ignored or toolset.ignored:
        top_ignored = (*top_ignored, *sorted(ignored | toolset.ignored))
    return ResponsesRequest(
        turn,
        flag(body, "stream"),
        instructions,
        items if isinstance(items, list) else [items],
        body.get("tools") or [],
        previous,
        previous_turn,
        toolset,
        top_ignored,
    )


def _earlier_items(earlier: ResponsesRequest, items: Any, instructions: str | None) -> int:
    """How many leading `items` are `earlier`'s, converted already (`Adapter.parse_request`'s `earlier`): when
    that request stood alone (no previous_response_id: its messages are its items'), had these instructions,
    and left no model turn open, for the items after it to convert on their own; else 0."""
    if (earlier.previous_turn_id is not None or earlier.instructions is not instructions or type(items) is not list
            or not ends_model_turns(earlier.items[-1])):
        return 0
    return earlier_elements(earlier.items, items)


async def load_history(request: ResponsesRequest, session_id: str, pipeline: TurnPipeline) -> ResponsesRequest:
    """A request naming `previous_response_id`: that committed turn's messages (from the broker), then the input."""
    if request.previous_turn_id is None:
        return request
    try:
        found = await pipeline.get_turn(session_id, request.previous_turn_id)
    except ApiError as e:
        if e.code in ("unknown_turn", "turn_pending"):
            raise ApiError(400, "invalid_request", f"previous_response_id {request.previous_response_id!r} is not a "
                           "committed response of this session", code=e.code, param="previous_response_id") from None
        raise
    return with_history(request, found)


def with_history(request: ResponsesRequest, found: TurnFound) -> ResponsesRequest:
    """Prepend a previous turn's prompt and response (`previous_response_id`) to the new input."""
    chain = [*found.prompt_messages, found.response_message]
    if request.instructions:
        if chain and chain[0].get("role") == "system":
            chain = chain[1:]  # instructions are not carried over from the previous response
        chain.insert(0, {"role": "system", "content": request.instructions})
    calls = found.response_message.get("tool_calls") or []
    call_names = {tool_call_id("call_", found.turn_id, i): c.get("name") for i, c in enumerate(calls)}
    items = request.items[0] if len(request.items) == 1 and isinstance(request.items[0], str) else request.items
    turn = dataclasses.replace(request.turn, messages=chain + canonical_messages(items, call_names, None))
    return dataclasses.replace(request, turn=turn)


# --- replies -------------------------------------------------------------------------------------


def _item(event: BlockEvent, turn_id: str, text: str, done: bool, toolset: ToolSet = NO_TOOLS) -> dict[str, Any]:
    status = "completed" if done else "in_progress"
    if event.kind == "reasoning":
        content = [{"type": "reasoning_text", "text": text}] if done else []
        return {
            "id": f"rs_{turn_id}_{event.index}",
            "type": "reasoning",
            "summary": [],
            "content": content,
            "status": status,
        }
    if event.kind == "content":
        content = [_output_text(text)] if done else []
        return {
            "id": f"msg_{turn_id}_{event.index}",
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }
    assert event.call is not None
    namespace, name = toolset.wire_name(event.call["name"])
    item = {"id": f"fc_{turn_id}_{event.index}", "type": "function_call",
            "call_id": tool_call_id("call_", turn_id, event.call_index), "name": name}
    if event.call["name"] in toolset.custom:
        item["type"] = "custom_tool_call"
        item["input"] = custom_input(event.call["arguments"]) if done else ""
    else:
        item["arguments"] = arguments_json(event.call["arguments"]) if done else ""
        item["status"] = status
    if namespace is not None:
        item["namespace"] = namespace
    return item


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _response(
    request: ResponsesRequest,
    turn_id: str,
    model: str,
    created: int,
    output: list[dict[str, Any]],
    status: str,
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    turn = request.turn
    return {
        "id": f"resp_{turn_id}",
        "object": "response",
        "created_at": created,
        "status": status,
        "completed_at": int(time.time()) if status != "in_progress" else None,
        "model": model,
        "output": output,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.instructions,
        "previous_response_id": request.previous_response_id,
        "tools": request.wire_tools,
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "temperature": turn.temperature,
        "top_p": turn.top_p,
        "max_output_tokens": turn.max_tokens,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "reasoning": {"effort": None, "summary": None},
        "metadata": {},
        "store": False,
        "background": False,
        "usage": usage,
    }


def _usage(turn: CapturedTurn) -> dict[str, Any]:
    prompt, output = len(turn.prompt_ids), len(turn.result.output_ids)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


def _status(turn: CapturedTurn) -> str:
    return "incomplete" if turn.finish_reason == "length" else "completed"


def _output(parsed: ParsedResponse, turn_id: str, toolset: ToolSet) -> list[dict[str, Any]]:
    output, calls = [], 0
    for index, delta in enumerate(reply_deltas(parsed)):
        event = BlockEvent("close", index, delta.kind, call=delta.call, call_index=calls)
        calls += delta.kind == "tool_call"
        output.append(_item(event, turn_id, delta.text, True, toolset))
    return output


def response_body(turn: CapturedTurn, request: ResponsesRequest, model: str) -> bytes:
    return orjson.dumps(
        _response(
            request, turn.turn_id, model, turn.created, _output(turn.parsed, turn.turn_id, request.toolset),
            _status(turn), _usage(turn)
        )
    )


async def stream_events(live: LiveReply, request: ResponsesRequest, model: str) -> AsyncIterator[bytes]:
    """The Responses SSE stream of a live turn; every event carries a sequence_number."""
    seq = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal seq
        seq += 1
        return sse({"type": kind, "sequence_number": seq - 1, **fields}, kind)

    turn_id, toolset = live.turn_id, request.toolset
    started = _response(request, turn_id, model, live.created, [], "in_progress", None)
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    output: list[dict[str, Any]] = []
    text = ""
    try:
        async for block in block_events(live.deltas()):
            if block.action == "keepalive":
                yield KEEPALIVE
                continue
            ids = {"item_id": _item(block, turn_id, "", False, toolset)["id"], "output_index": block.index}
            if block.action == "open":
                text = ""
                yield event(
                    "response.output_item.added", output_index=block.index,
                    item=_item(block, turn_id, "", False, toolset),
                )
                if block.kind == "reasoning":
                    yield event(
                        "response.content_part.added",
                        **ids,
                        content_index=0,
                        part={"type": "reasoning_text", "text": ""},
                    )
                elif block.kind == "content":
                    yield event("response.content_part.added", **ids, content_index=0, part=_output_text(""))
                else:
                    assert block.call is not None
                    if block.call["name"] in toolset.custom:
                        given = custom_input(block.call["arguments"])
                        yield event("response.custom_tool_call_input.delta", **ids, delta=given)
                        yield event("response.custom_tool_call_input.done", **ids, input=given)
                    else:
                        args = arguments_json(block.call["arguments"])
                        name = toolset.wire_name(block.call["name"])[1]
                        yield event("response.function_call_arguments.delta", **ids, delta=args)
                        yield event("response.function_call_arguments.done", **ids, arguments=args, name=name)
            elif block.action == "delta":
                text += block.text
                kind = "response.reasoning_text.delta" if block.kind == "reasoning" else "response.output_text.delta"
                extra: dict[str, Any] = {} if block.kind == "reasoning" else {"logprobs": []}
                yield event(kind, **ids, content_index=0, delta=block.text, **extra)
            else:
                if block.kind == "reasoning":
                    yield event("response.reasoning_text.done", **ids, content_index=0, text=text)
                    yield event(
                        "response.content_part.done",
                        **ids,
                        content_index=0,
                        part={"type": "reasoning_text", "text": text},
                    )
                elif block.kind == "content":
                    yield event("response.output_text.done", **ids, content_index=0, text=text, logprobs=[])
                    yield event("response.content_part.done", **ids, content_index=0, part=_output_text(text))
                item = _item(block, turn_id, text, True, toolset)
                output.append(item)
                yield event("response.output_item.done", output_index=block.index, item=item)
    except ApiError as e:
        failed = _response(request, turn_id, model, live.created, output, "failed", None)
        failed["error"] = {"code": "server_error", "message": e.message}
        yield event("response.failed", response=failed)
        raise
    turn = live.turn
    assert turn is not None
    status = _status(turn)
    final = _response(request, turn_id, model, live.created, output, status, _usage(turn))
    yield event("response.completed" if status == "completed" else "response.incomplete", response=final)
