"""The wire adapters without I/O: canonical messages per dialect, cross-dialect equality, reply and event shapes."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest
from assets import TOOLS

from broker.protocol import TurnFound
from gateway_workers.adapters import anthropic_messages, openai_chat, openai_responses, responses_items
from gateway_workers.adapters.common import from_list
from gateway_workers.engines.base import EngineResult
from gateway_workers.formats import ParsedResponse
from gateway_workers.formats.parsed import LiveDelta
from gateway_workers.http.errors import ApiError
from gateway_workers.http.limits import DEFAULT_LIMITS
from gateway_workers.turns.captured import CapturedTurn, TurnRequest, tool_call_id

CALL = {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}
ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
        "cache_control": {"type": "ephemeral"},
    }
    for t in TOOLS
]
RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "parameters": t["function"]["parameters"],
        "strict": True,
    }
    for t in TOOLS
]

# One conversation: system, user, a model turn (reasoning + text + a call), the tool's result, a user follow-up.
CANONICAL = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "Checking.", "reasoning": "Need a lookup.", "tool_calls": [CALL]},
    {"role": "tool", "content": "rainy", "name": "get_weather"},
    {"role": "user", "content": "Thanks!"},
]


def _chat() -> TurnRequest:
    return openai_chat.parse_request(
        {
            "model": "m",
            "tools": TOOLS,
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Oslo?"},
                {
                    "role": "assistant",
                    "content": "Checking.",
                    "reasoning_content": "Need a lookup.",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": json.dumps(CALL["arguments"])},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "rainy"},
                {"role": "user", "content": "Thanks!"},
            ],
        }
    ).turn


def _anthropic() -> TurnRequest:
    return anthropic_messages.parse_request(
        {
            "model": "m",
            "max_tokens": 64,
            "tools": ANTHROPIC_TOOLS,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "Need a lookup.", "signature": "s"},
                        {"type": "redacted_thinking", "data": "opaque"},
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": CALL["arguments"]},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "rainy"}],
                        },
                        {"type": "text", "text": "Thanks!"},
                    ],
                },
            ],
        }
    ).turn


def _responses() -> TurnRequest:
    return openai_responses.parse_request(
        {
            "model": "m",
            "tools": RESPONSES_TOOLS,
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "Need a lookup."}],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
                },
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "get_weather",
                    "arguments": json.dumps(CALL["arguments"]),
                },
                {"type": "function_call_output", "call_id": "call_1", "output": "rainy"},
                {"role": "user", "content": "Thanks!"},
            ],
        }
    ).turn


def test_the_same_conversation_is_the_same_canonical_turn_in_every_dialect():
    chat, claude, responses = _chat(), _anthropic(), _responses()
    assert chat.messages == claude.messages == responses.messages == CANONICAL
    assert chat.tools == claude.tools == responses.tools == TOOLS  # canonical tools render the same prompt


def test_anthropic_user_turns_keep_tool_results_and_text_in_order():
    turn = anthropic_messages.parse_request(
        {
            "model": "m",
            "max_tokens": 8,
            "messages": [
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "a", "name": "f", "input": {}},
                        {"type": "tool_use", "id": "b", "name": "g", "input": {}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "a", "content": "1"},
                        {"type": "tool_result", "tool_use_id": "b"},
                        {"type": "text", "text": "and?"},
                    ],
                },
            ],
        }
    ).turn
    assert turn.messages[1:] == [
        {"role": "tool", "content": "1", "name": "f"},
        {"role": "tool", "content": "", "name": "g"},
        {"role": "user", "content": "and?"},
    ]


def test_responses_fold_a_model_turn_and_split_consecutive_turns():
    messages = responses_items.canonical_messages(
        [
            {"type": "reasoning", "id": "r1", "summary": [{"type": "summary_text", "text": "first"}]},
            {"type": "function_call", "call_id": "x", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "x", "output": [{"type": "input_text", "text": "ok"}]},
            {"type": "reasoning", "id": "r2", "summary": [], "content": [{"type": "reasoning_text", "text": "second"}]},
            {"role": "assistant", "content": "done"},
            {"role": "developer", "content": "be nice"},
        ],
        {},
        DEFAULT_LIMITS,
    )
    assert messages == [
        {"role": "assistant", "content": "", "reasoning": "first", "tool_calls": [{"name": "f", "arguments": {}}]},
        {"role": "tool", "content": "ok", "name": "f"},
        {"role": "assistant", "content": "done", "reasoning": "second"},
        {"role": "system", "content": "be nice"},
    ]


def test_previous_response_id_prepends_the_stored_turn_and_names_its_calls():
    turn_id = "ab" * 16
    request = openai_responses.parse_request(
        {
            "model": "m",
            "instructions": "New rules.",
            "previous_response_id": f"resp_{turn_id}",
            "input": [
                {"type": "function_call_output", "call_id": tool_call_id("call_", turn_id, 0), "output": "rainy"}
            ],
        }
    )
    assert request.previous_turn_id == turn_id
    found = TurnFound(1, turn_id, CANONICAL[:2], {"role": "assistant", "content": "", "tool_calls": [CALL]})
    resolved = openai_responses.with_history(request, found)
    assert resolved.turn.messages == [
        {"role": "system", "content": "New rules."},
        CANONICAL[1],
        found.response_message,
        {"role": "tool", "content": "rainy", "name": "get_weather"},
    ]


@pytest.mark.parametrize(
    "adapter, body, param",
    [
        (anthropic_messages, {"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        (
            anthropic_messages,
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
            "messages",
        ),
        (anthropic_messages, {"max_tokens": 5, "top_k": -1, "messages": [{"role": "user", "content": "x"}]}, "top_k"),
        (
            anthropic_messages,
            {"max_tokens": 5, "stream": "yes", "messages": [{"role": "user", "content": "x"}]},
            "stream",
        ),
        (openai_responses, {"input": []}, "input"),
        (openai_responses, {"input": [{"type": "function_call", "name": "f"}]}, "input"),
        (openai_responses, {"input": "x", "previous_response_id": "resp_zz"}, "previous_response_id"),
        (openai_responses, {"input": "x", "background": True}, "background"),
        (openai_responses, {"input": "x", "instructions": ["x"]}, "instructions"),
    ],
)
def test_bad_bodies_name_the_parameter(adapter, body, param):
    with pytest.raises(ApiError) as info:
        adapter.parse_request(body)
    assert info.value.status == 400 and info.value.param == param


def _captured(parsed: ParsedResponse, finish: str = "stop") -> CapturedTurn:
    result = EngineResult(output_ids=[1, 2, 3], logprobs=[-0.5] * 3, finish_reason=finish)  # type: ignore[arg-type]
    return CapturedTurn("sid", "f" * 32, TurnRequest(messages=[]), [7] * 10, result, parsed, created=123)


PARSED = ParsedResponse(content="Checking.", reasoning="Need a lookup.", tool_calls=[CALL])


def test_whole_replies_in_each_dialect():
    turn = _captured(PARSED)
    message = json.loads(anthropic_messages.response_body(turn, None, "m"))  # type: ignore[arg-type]
    assert [b["type"] for b in message["content"]] == ["thinking", "text", "tool_use"]
    assert message["content"][2] == {
        "type": "tool_use",
        "id": tool_call_id("toolu_", turn.turn_id, 0),
        "name": "get_weather",
        "input": CALL["arguments"],
    }
    assert message["stop_reason"] == "tool_use" and message["usage"]["output_tokens"] == 3
    request = openai_responses.parse_request({"input": "x"})
    response = json.loads(openai_responses.response_body(turn, request, "m"))
    assert [i["type"] for i in response["output"]] == ["reasoning", "message", "function_call"]
    assert response["output"][2]["call_id"] == tool_call_id("call_", turn.turn_id, 0)
    assert json.loads(response["output"][2]["arguments"]) == CALL["arguments"]
    truncated = json.loads(
        openai_responses.response_body(_captured(ParsedResponse(content="cut"), "length"), request, "m")
    )
    assert truncated["status"] == "incomplete" and truncated["incomplete_details"] == {"reason": "max_output_tokens"}


def _live(deltas: list[LiveDelta], parsed: ParsedResponse) -> Any:
    turn = _captured(parsed)
    return SimpleNamespace(
        turn_id=turn.turn_id, created=1, prompt_ids=turn.prompt_ids, turn=turn, deltas=lambda: from_list(deltas)
    )


def _events(stream: Any) -> list[dict[str, Any]]:
    async def collect() -> list[bytes]:
        return [chunk async for chunk in stream]

    out = []
    for chunk in asyncio.run(collect()):
        data = [line[6:] for line in chunk.decode().splitlines() if line.startswith("data: ")]
        out += [json.loads(d) for d in data if d != "[DONE]"]
    return out


def test_anthropic_event_sequence():
    live = _live(
        [
            LiveDelta("reasoning", "Need "),
            LiveDelta("reasoning", "a lookup."),
            LiveDelta("content", "Checking."),
            LiveDelta("tool_call", call=CALL),
        ],
        PARSED,
    )
    events = _events(anthropic_messages.stream_events(live, None, "m"))  # type: ignore[arg-type]
    kinds = [e["type"] + (":" + e["delta"]["type"] if e["type"] == "content_block_delta" else "") for e in events]
    assert kinds == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta:thinking_delta",
        "content_block_delta:thinking_delta",
        "content_block_delta:signature_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta:text_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta:input_json_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert [e["index"] for e in events if e["type"] == "content_block_start"] == [0, 1, 2]
    assert events[-2]["delta"]["stop_reason"] == "tool_use" and events[-2]["usage"]["output_tokens"] == 3


def test_responses_event_sequence_numbers_every_event():
    live = _live(
        [
            LiveDelta("reasoning", "Need a lookup."),
            LiveDelta("content", "Check"),
            LiveDelta("content", "ing."),
            LiveDelta("tool_call", call=CALL),
        ],
        PARSED,
    )
    request = openai_responses.parse_request({"input": "x", "stream": True})
    events = _events(openai_responses.stream_events(live, request, "m"))  # type: ignore[arg-type]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][1]["content"][0]["text"] == "Checking." and final["usage"]["output_tokens"] == 3


@pytest.mark.parametrize("dialect", ["chat", "messages", "responses"])
def test_a_keepalive_is_an_sse_comment_that_changes_no_event(dialect: str) -> None:
    deltas = [LiveDelta("reasoning", "Need "), LiveDelta("reasoning", "a lookup."), LiveDelta("content", "Checking.")]
    waiting = [*deltas[:1], LiveDelta("keepalive"), LiveDelta("keepalive"), *deltas[1:]]

    def stream(items: list[LiveDelta]) -> Any:
        live = _live(items, PARSED)
        if dialect == "chat":
            request = openai_chat.parse_request({"messages": [{"role": "user", "content": "x"}], "stream": True})
            return openai_chat.stream_events(live, request, "m")
        if dialect == "messages":
            return anthropic_messages.stream_events(live, None, "m")  # type: ignore[arg-type]
        return openai_responses.stream_events(live, openai_responses.parse_request({"input": "x"}), "m")

    async def raw(items: list[LiveDelta]) -> list[bytes]:
        return [chunk async for chunk in stream(items)]

    sent = asyncio.run(raw(waiting))
    assert sent.count(b": keep-alive\n\n") == 2  # a comment line: the SDKs' SSE decoders skip it
    assert _events(stream(waiting)) == _events(stream(deltas))  # the block it came in stays open
