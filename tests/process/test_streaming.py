"""Live streaming on the captured path, in all three dialects, against a fake engine that streams slowly.

The first delta must reach the agent while the engine is still generating; the committed
tokens must be exactly the streamed text; an agent that disconnects mid-stream must abort
the engine request and leave nothing recorded; an engine failing mid-stream must end the
stream with the dialect's error event and record nothing. Streams are read raw (httpx) so
arrival times and event order are observed as sent.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest
from assets import wait_until
from dialects import ENGINE_TIMEOUT_S, SYSTEM, engine_turns, fake_policy, tokenizer
from fidelity import assert_fidelity

from gateway_workers.engines.routing import routing_key

TOKEN_DELAY_S = 0.04  # the fake engine's pace: ~25 tokens/s, so a ~35-token reply takes ~1.4 s
LOG_WAIT_S = 10.0
QUESTION = "What is the capital of Peru?"

REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": (
        "/chat/completions",
        {
            "model": "q",
            "stream": True,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        },
    ),
    "anthropic": (
        "/messages",
        {
            "model": "q",
            "stream": True,
            "max_tokens": 256,
            "system": SYSTEM,
            "messages": [{"role": "user", "content": QUESTION}],
        },
    ),
    "responses": ("/responses", {"model": "q", "stream": True, "instructions": SYSTEM, "input": QUESTION}),
}


@contextmanager
def _stream(gateway: Any, sid: str, dialect: str) -> Iterator[Iterator[tuple[float, str | None, Any]]]:
    """POST a streaming request; yields an iterator of (seconds since the request, event name, decoded data)."""
    path, body = REQUESTS[dialect]
    headers = {"Authorization": f"Bearer {sid}", "x-api-key": sid, "anthropic-version": "2023-06-01"}
    started = time.monotonic()
    with httpx.stream("POST", gateway.base_url + path, json=body, headers=headers, timeout=30) as reply:
        assert reply.status_code == 200, reply.read()

        def events() -> Iterator[tuple[float, str | None, Any]]:
            name = None
            for line in reply.iter_lines():
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    data = line[6:]
                    yield time.monotonic() - started, name, data if data == "[DONE]" else json.loads(data)
                    name = None

        yield events()


def _text_delta(dialect: str, data: Any) -> tuple[str, str] | None:
    """(field, text) when the event carries reasoning or content text."""
    if dialect == "chat" and isinstance(data, dict) and data.get("choices"):
        delta = data["choices"][0]["delta"]
        for field in ("reasoning_content", "content"):
            if delta.get(field):
                return ("reasoning" if field == "reasoning_content" else "content"), delta[field]
    if dialect == "anthropic" and data.get("type") == "content_block_delta":
        delta = data["delta"]
        if delta["type"] in ("thinking_delta", "text_delta"):
            return ("reasoning", delta["thinking"]) if delta["type"] == "thinking_delta" else ("content", delta["text"])
    if dialect == "responses" and data.get("type") in ("response.reasoning_text.delta", "response.output_text.delta"):
        return ("reasoning" if "reasoning" in data["type"] else "content"), data["delta"]
    return None


@pytest.mark.parametrize("dialect", sorted(REQUESTS))
def test_deltas_arrive_while_the_engine_generates_and_the_commit_is_the_streamed_text(
    dialect_gateway, dialect_engine, qwen3_tokenizer_dir, dialect
):
    sid = dialect_gateway.client.open_session()
    key = routing_key(sid)
    dialect_engine.configure(fault={"token_delay": TOKEN_DELAY_S, "key": key})
    texts: dict[str, str] = {"reasoning": "", "content": ""}
    arrivals = []
    with _stream(dialect_gateway, sid, dialect) as events:
        for at, _, data in events:
            piece = _text_delta(dialect, data) if data != "[DONE]" else None
            if piece:
                texts[piece[0]] += piece[1]
                arrivals.append(at)
        ended = at
    (turn,) = engine_turns(dialect_engine, sid, fake_policy(qwen3_tokenizer_dir))
    generation = len(turn.output_ids) * TOKEN_DELAY_S
    assert len(arrivals) > 10, arrivals  # token by token, not one lump
    assert arrivals[0] < ended - generation / 2, (arrivals[0], ended, generation)  # live, not replayed at the end

    records = dialect_gateway.client.finish_session(sid, wait_timeout=10.0)
    assert_fidelity([turn], records)  # committed: exactly the sampled ids and logprobs
    (record,) = records
    committed = tokenizer(qwen3_tokenizer_dir).decode(
        record.token_ids[-record.response_length :], skip_special_tokens=False
    )
    assert committed == f"<think>\n{texts['reasoning']}\n</think>\n\n{texts['content']}<|im_end|>"


@pytest.mark.parametrize("dialect", sorted(REQUESTS))
def test_a_client_leaving_mid_stream_aborts_the_engine_request_and_records_nothing(
    dialect_gateway, dialect_engine, dialect
):
    sid = dialect_gateway.client.open_session()
    key = routing_key(sid)
    dialect_engine.configure(fault={"token_delay": TOKEN_DELAY_S, "key": key})
    with _stream(dialect_gateway, sid, dialect) as events:
        for _, _, data in events:
            if data != "[DONE]" and _text_delta(dialect, data):
                break  # the agent goes away after its first delta
    assert wait_until(lambda: dialect_engine.log(key)["disconnects"], LOG_WAIT_S), dialect_engine.log(key)
    assert dialect_engine.log(key)["streamed"] == []  # the engine stopped before the end of the reply
    assert dialect_gateway.client.finish_session(sid, wait_timeout=5.0) == []


@pytest.mark.parametrize("dialect", sorted(REQUESTS))
def test_an_engine_failing_mid_stream_ends_with_the_dialects_error_and_records_nothing(
    dialect_gateway, dialect_engine, dialect
):
    sid = dialect_gateway.client.open_session()
    dialect_engine.configure(fault={"error_after": 5, "key": routing_key(sid)})
    with _stream(dialect_gateway, sid, dialect) as events:
        received = [(name, data) for _, name, data in events]
    name, last = received[-1]
    if dialect == "chat":
        assert last["error"]["type"] == "api_error" and "mid-stream" in last["error"]["message"]
    elif dialect == "anthropic":
        assert name == "error" and last["type"] == "error" and last["error"]["type"] == "api_error"
    else:
        assert name == last["type"] == "response.failed" and last["response"]["status"] == "failed"
    assert any(_text_delta(dialect, data) for _, data in received[:-1])  # it failed mid-way, after some text
    assert dialect_gateway.client.finish_session(sid, wait_timeout=5.0) == []


def test_the_openai_sdk_raises_on_a_mid_stream_failure_and_the_worker_stays_healthy(dialect_gateway, dialect_engine):
    sid = dialect_gateway.client.open_session()
    dialect_engine.configure(fault={"error_after": 5, "times": None, "key": routing_key(sid)})
    client = openai.OpenAI(base_url=dialect_gateway.base_url, api_key=sid, max_retries=0)
    with pytest.raises(openai.APIError, match="mid-stream"):
        for _ in client.chat.completions.create(
            model="q", stream=True, messages=[{"role": "user", "content": QUESTION}]
        ):
            pass
    dialect_engine.configure(fault={"key": routing_key(sid)})
    reply = client.chat.completions.create(model="q", messages=[{"role": "user", "content": QUESTION}])
    assert reply.choices[0].message.content.startswith("Final answer")
    assert len(dialect_gateway.client.finish_session(sid)) == 1


def test_an_engine_that_never_starts_streaming_is_a_504_in_the_dialects_shape(dialect_gateway, dialect_engine):
    """The first chunk is awaited before any byte is sent, so a hung engine still gets a proper status."""
    sid = dialect_gateway.client.open_session()
    dialect_engine.configure(fault={"hang": True, "key": routing_key(sid)})
    path, body = REQUESTS["anthropic"]
    started = time.monotonic()
    reply = httpx.post(dialect_gateway.base_url + path, json=body, headers={"x-api-key": sid}, timeout=30)
    assert reply.status_code == 504 and reply.json()["error"]["type"] == "api_error"
    assert time.monotonic() - started < ENGINE_TIMEOUT_S + 3
    assert dialect_gateway.client.finish_session(sid, wait_timeout=5.0) == []
