"""`POST /v1/responses` on a real `serve`, driven by the official `openai` SDK; and one session in all three dialects.

Function-call loops that resend the whole conversation and loops that send only the new
items with `previous_response_id`, with `responses.create` and the `responses.stream`
helper; rows are checked against what the engine sampled. Response ids never cross
sessions; bad input is a 400 in OpenAI's shape.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest
from assets import TOOLS
from dialects import ANTHROPIC_TOOLS, RESPONSES_TOOLS, SYSTEM, engine_turns, fake_policy, tool_output
from fidelity import assert_fidelity

MAX_TURNS = 6


def _client(gateway: Any, sid: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=sid, max_retries=0, timeout=30)


def _respond(client: openai.OpenAI, stream: bool, **kwargs: Any) -> Any:
    kwargs = {"model": "qwen3", "instructions": SYSTEM, "tools": RESPONSES_TOOLS, **kwargs}
    if not stream:
        return client.responses.create(**kwargs)
    deltas = []
    with client.responses.stream(**kwargs) as s:
        for event in s:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        response = s.get_final_response()
    assert "".join(deltas) == response.output_text
    return response


def _outputs(response: Any) -> list[dict[str, Any]]:
    calls = [item for item in response.output if item.type == "function_call"]
    return [
        {"type": "function_call_output", "call_id": c.call_id, "output": tool_output(c.name, json.loads(c.arguments))}
        for c in calls
    ]


def _agent(client: openai.OpenAI, stream: bool, chained: bool) -> list[Any]:
    """Resend everything (the default), or chain with previous_response_id and send only the tool outputs."""
    items: list[Any] = [{"role": "user", "content": "What is the weather in Lima?"}]
    received: list[Any] = []
    for _ in range(MAX_TURNS):
        if chained and received:
            response = _respond(client, stream, input=_outputs(received[-1]), previous_response_id=received[-1].id)
        else:
            response = _respond(client, stream, input=items)
        received.append(response)
        outputs = _outputs(response)
        if not outputs:
            break
        items += [item.model_dump(exclude_none=True) for item in response.output] + outputs
    return received


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
@pytest.mark.parametrize("chained", [False, True], ids=["full_input", "previous_response_id"])
def test_function_call_loop_captures_exactly_what_the_engine_sampled(
    dialect_gateway, dialect_engine, qwen3_tokenizer_dir, stream, chained
):
    sid = dialect_gateway.client.open_session()
    received = _agent(_client(dialect_gateway, sid), stream, chained)
    assert 2 <= len(received) <= 3
    for response in received[:-1]:
        assert response.status == "completed" and response.output[0].type == "reasoning"
        calls = [item for item in response.output if item.type == "function_call"]
        assert calls and len({c.call_id for c in calls}) == len(calls)
    final = received[-1]
    assert final.output_text.startswith("Final answer after") and final.usage.output_tokens > 0
    if chained:
        assert [r.previous_response_id for r in received[1:]] == [r.id for r in received[:-1]]
    records = dialect_gateway.client.finish_session(sid, wait_timeout=10.0)
    turns = engine_turns(dialect_engine, sid, fake_policy(qwen3_tokenizer_dir))
    assert len(turns) == len(received)
    assert_fidelity(turns, records)
    assert len(records) == 1, [r.metadata for r in records]


def test_response_ids_are_scoped_to_their_session(dialect_gateway):
    mine, other = dialect_gateway.client.open_session(), dialect_gateway.client.open_session()
    first = _client(dialect_gateway, mine).responses.create(model="qwen3", input="hello")
    for sid, previous in ((other, first.id), (mine, "resp_" + "0" * 32), (mine, "not-a-response-id")):
        with pytest.raises(openai.BadRequestError) as info:
            _client(dialect_gateway, sid).responses.create(model="qwen3", input="again", previous_response_id=previous)
        assert info.value.body["param"] == "previous_response_id"
    follow = _client(dialect_gateway, mine).responses.create(
        model="qwen3", input="again", previous_response_id=first.id
    )
    assert follow.previous_response_id == first.id
    # qwen3.jinja drops the first reply's <think> once a new user message follows: two rows, both turns kept.
    assert sum(len(r.metadata["turn_ids"]) for r in dialect_gateway.client.finish_session(mine)) == 2
    assert dialect_gateway.client.finish_session(other) == []


GOOD = {"model": "qwen3", "input": "hello"}


@pytest.mark.parametrize(
    "body, param",
    [
        (b"{not json", None),
        ({"model": "qwen3"}, "input"),
        ({**GOOD, "input": [{"type": "item_reference", "id": "x"}]}, "input"),
        ({**GOOD, "input": [{"role": "wizard", "content": "x"}]}, "input"),
        ({**GOOD, "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text"),
        ({**GOOD, "tools": [{"type": "browser"}]}, "tools"),
        ({**GOOD, "tool_choice": "required"}, "tool_choice"),
        ({**GOOD, "max_output_tokens": 0}, "max_output_tokens"),
        ({**GOOD, "conversation": "conv_1"}, "conversation"),
    ],
    ids=["json", "no_input", "item_type", "role", "format", "tool_type", "tool_choice", "max_tokens", "unknown"],
)
def test_bad_input_is_a_400_in_openai_shape_and_records_nothing(dialect_gateway, body, param):
    sid = dialect_gateway.client.open_session()
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = httpx.post(
        f"{dialect_gateway.base_url}/responses",
        content=content,
        timeout=30,
        headers={"Authorization": f"Bearer {sid}", "content-type": "application/json"},
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["param"] == param
    assert _client(dialect_gateway, sid).responses.create(**GOOD).status == "completed"  # still healthy
    assert len(dialect_gateway.client.finish_session(sid)[0].metadata["turn_ids"]) == 1


def test_one_session_in_three_dialects_is_one_clean_row(dialect_gateway, dialect_engine, qwen3_tokenizer_dir):
    """Chat Completions, then Anthropic Messages, then Responses, each resending the conversation its own way."""
    sid = dialect_gateway.client.open_session()
    chat = openai.OpenAI(base_url=dialect_gateway.base_url, api_key=sid, max_retries=0)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the weather in Quito?"},
    ]
    first = chat.chat.completions.create(model="qwen3", messages=messages, tools=TOOLS).choices[0].message
    assert first.tool_calls

    # Anthropic: the same history as blocks (thinking + tool_use), tool results as tool_result blocks.
    history = [
        {"role": "user", "content": messages[1]["content"]},
        {
            "role": "assistant",
            "content": [{"type": "thinking", "thinking": first.reasoning_content, "signature": "x"}]
            + [
                {"type": "tool_use", "id": c.id, "name": c.function.name, "input": json.loads(c.function.arguments)}
                for c in first.tool_calls
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": c.id,
                    "content": tool_output(c.function.name, json.loads(c.function.arguments)),
                }
                for c in first.tool_calls
            ],
        },
    ]
    claude = anthropic.Anthropic(base_url=dialect_gateway.base_url.removesuffix("/v1"), api_key=sid, max_retries=0)
    second = claude.messages.create(
        model="qwen3", max_tokens=512, system=SYSTEM, tools=ANTHROPIC_TOOLS, messages=history
    )
    uses = [b for b in second.content if b.type == "tool_use"]
    assert second.stop_reason == "tool_use" and uses

    # Responses: the whole conversation as items; each model turn is a reasoning item plus function_call items.
    thinking = next(b.thinking for b in second.content if b.type == "thinking")
    items: list[dict[str, Any]] = [{"role": "user", "content": messages[1]["content"]}]
    for reasoning, calls in (
        (
            first.reasoning_content,
            [(c.id, c.function.name, json.loads(c.function.arguments)) for c in first.tool_calls],
        ),
        (thinking, [(u.id, u.name, u.input) for u in uses]),
    ):
        items.append(
            {
                "type": "reasoning",
                "id": "rs_x",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": reasoning}],
            }
        )
        items += [{"type": "function_call", "call_id": i, "name": n, "arguments": json.dumps(a)} for i, n, a in calls]
        items += [{"type": "function_call_output", "call_id": i, "output": tool_output(n, a)} for i, n, a in calls]
    third = _client(dialect_gateway, sid).responses.create(
        model="qwen3", instructions=SYSTEM, tools=RESPONSES_TOOLS, input=items
    )
    assert third.output_text.startswith("Final answer after")

    records = dialect_gateway.client.finish_session(sid, wait_timeout=10.0)
    turns = engine_turns(dialect_engine, sid, fake_policy(qwen3_tokenizer_dir))
    assert len(turns) == 3
    assert_fidelity(turns, records)
    assert len(records) == 1 and records[0].metadata["decisions"]["clean"] == 2, [r.metadata for r in records]
