"""`POST /v1/messages` on a real `serve` (2 workers, fake vLLM engine), driven by the official `anthropic` SDK.

Tool loops with `messages.create` and with the `messages.stream` helper; every row is checked
against what the engine sampled (recomputed from the fake engine's policy and request log).
Errors come back in Anthropic's shape and leave the worker healthy; count_tokens counts
exactly the prompt a turn sends to the engine.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest
from dialects import ANTHROPIC_TOOLS, SYSTEM, engine_turns, fake_policy, tool_output
from fidelity import assert_fidelity

from gateway_workers.engines.routing import routing_key

MAX_TURNS = 6


def _client(gateway: Any, sid: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.base_url.removesuffix("/v1"), api_key=sid, max_retries=0, timeout=30)


def _agent(client: anthropic.Anthropic, stream: bool) -> list[Any]:
    """A Claude-style tool loop: echo the whole assistant message, answer every tool_use with a tool_result."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Oslo?"}]
    received = []
    for _ in range(MAX_TURNS):
        kwargs = {"model": "qwen3", "max_tokens": 512, "system": SYSTEM, "tools": ANTHROPIC_TOOLS, "messages": messages}
        if stream:
            with client.messages.stream(**kwargs) as s:
                texts = list(s.text_stream)
                message = s.get_final_message()
            assert "".join(texts) == "".join(b.text for b in message.content if b.type == "text")
        else:
            message = client.messages.create(**kwargs)
        received.append(message)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]})
        uses = [b for b in message.content if b.type == "tool_use"]
        if not uses:
            break
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": u.id, "content": tool_output(u.name, u.input)} for u in uses
                ],
            }
        )
    return received


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_tool_loop_captures_exactly_what_the_engine_sampled(
    dialect_gateway, dialect_engine, qwen3_tokenizer_dir, stream
):
    sid = dialect_gateway.client.open_session()
    received = _agent(_client(dialect_gateway, sid), stream)
    assert 2 <= len(received) <= 3
    for message in received[:-1]:
        assert message.stop_reason == "tool_use" and message.content[0].type == "thinking"
        uses = [b for b in message.content if b.type == "tool_use"]
        assert uses and len({u.id for u in uses}) == len(uses) and all(isinstance(u.input, dict) for u in uses)
    final = received[-1]
    assert final.stop_reason == "end_turn" and final.content[-1].text.startswith("Final answer after")
    assert final.usage.output_tokens > 0 and final.usage.input_tokens > 0
    records = dialect_gateway.client.finish_session(sid, reward=1.0, wait_timeout=10.0)
    turns = engine_turns(dialect_engine, sid, fake_policy(qwen3_tokenizer_dir))
    assert len(turns) == len(received)
    assert_fidelity(turns, records)
    assert len(records) == 1, [r.metadata for r in records]  # thinking blocks echoed: the episode extends cleanly


def _post(gateway: Any, path: str, sid: str | None, body: Any) -> httpx.Response:
    headers = {"content-type": "application/json", "anthropic-version": "2023-06-01"}
    if sid:
        headers["x-api-key"] = sid
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{gateway.base_url}{path}", content=content, headers=headers, timeout=30)


GOOD = {"model": "qwen3", "max_tokens": 64, "messages": [{"role": "user", "content": "hello"}]}


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}]},  # no max_tokens
        {**GOOD, "messages": []},
        {**GOOD, "messages": [{"role": "tool", "content": "x"}]},
        {**GOOD, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {**GOOD, "tool_choice": {"type": "any"}},
        {**GOOD, "tools": [{"type": "function", "function": {"name": "f"}}]},  # an OpenAI-shaped tool
        {**GOOD, "temperature": 1.5},
        {**GOOD, "output_format": {"type": "json_schema"}},
    ],
    ids=["json", "max_tokens", "empty", "role", "image", "tool_choice", "tool_type", "temperature", "unknown"],
)
def test_bad_input_is_a_400_in_anthropic_shape_and_records_nothing(dialect_gateway, body):
    sid = dialect_gateway.client.open_session()
    reply = _post(dialect_gateway, "/messages", sid, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error" and error["error"]["message"]
    assert _post(dialect_gateway, "/messages", sid, GOOD).status_code == 200  # the worker is still healthy
    records = dialect_gateway.client.finish_session(sid)
    assert len(records) == 1 and len(records[0].metadata["turn_ids"]) == 1


def test_keys_and_finished_sessions_are_final_in_anthropic_shape(dialect_gateway):
    assert _post(dialect_gateway, "/messages", None, GOOD).json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        _client(dialect_gateway, "no-such-session").messages.create(**GOOD)
    sid = dialect_gateway.client.open_session()
    dialect_gateway.client.finish_session(sid)
    with pytest.raises(anthropic.PermissionDeniedError) as info:
        _client(dialect_gateway, sid).messages.create(**GOOD)
    assert info.value.body["error"]["type"] == "permission_error"


def test_count_tokens_counts_the_prompt_the_engine_sees(dialect_gateway, dialect_engine):
    sid = dialect_gateway.client.open_session()
    client = _client(dialect_gateway, sid)
    kwargs = {
        "model": "qwen3",
        "system": [{"type": "text", "text": SYSTEM}],
        "tools": ANTHROPIC_TOOLS,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Weather in Rome?"}]}],
    }
    counted = client.messages.count_tokens(**kwargs).input_tokens
    assert dialect_engine.log(routing_key(sid))["requests"] == []  # counting runs no turn
    message = client.messages.create(max_tokens=256, **kwargs)
    (request,) = dialect_engine.log(routing_key(sid))["requests"]
    assert counted == len(request["body"]["token_ids"]) == message.usage.input_tokens
    reply = _post(dialect_gateway, "/messages/count_tokens", "no-such-session", kwargs)
    assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"
    dialect_gateway.client.finish_session(sid)
