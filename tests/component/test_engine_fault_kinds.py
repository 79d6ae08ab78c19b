"""Engine faults at the engine seam, over real HTTP against the fake engine process (vLLM and SGLang formats).

Each fault the fake engine injects (HTTP errors, hangs, dropped connections, error events, answers of the
wrong kind or shape, generations that do not finish) must be an EngineError of its `FaultKind` (EngineTimeout
for a hang), raised by `generate` or by a `stream` after exactly the chunks that came before it, never a
result; it is counted once against its replica (`Engine.faults`), and an engine that was still generating
is stopped (vLLM: the connection closes; SGLang: /abort_request).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from array import array
from collections import Counter
from typing import Any

import fake_engine as fake
import pytest
from assets import TOOLS, FakeEngine, wait_until

from gateway_workers.engines import EngineConfig, EngineError, EngineTimeout, SamplingParams, create_engine
from gateway_workers.engines.routing import choose_replica, routing_key
from gateway_workers.rendering.renderer import Renderer

PARAMS = SamplingParams(max_tokens=64, temperature=0.7, seed=3)
TIMEOUT_S = 0.5  # the engine bound for the hang faults
LOG_WAIT_S = 5.0
MID = 3  # mid-stream faults strike after this many tokens
SLOW_TOKEN_S = 0.05  # the pace that keeps the engine generating while the fault strikes

# (fault, expected kind, tokens a stream yields before it fails, whether the engine is still generating then)
STREAM_FAULTS: dict[str, tuple[dict[str, Any], str, int | None, bool]] = {
    "status 500": ({"status": 500}, "status", 0, False),
    "status 400": ({"status": 400}, "status", 0, False),
    "hang": ({"hang": True}, "timeout", 0, True),
    "hang mid-stream": ({"hang_after": MID}, "timeout", MID, True),
    "drop mid-stream": ({"drop_after": MID}, "connection", MID, False),
    "error event": ({"error_after": MID}, "error_event", MID, False),
    "no finish reason": ({"answer": "no_finish"}, "incomplete", None, False),  # None: every token, then no finish
    "aborted by the engine": ({"answer": "aborted", "answer_after": MID}, "incomplete", MID, False),
    "json body": ({"answer": "json"}, "bad_answer", 0, False),
    "garbage": ({"answer": "garbage"}, "incomplete", 0, False),  # no events at all: nothing ever finishes
    "garbage mid-stream": ({"answer": "garbage", "answer_after": MID}, "incomplete", MID, False),
    "no ids": ({"answer": "no_ids"}, "bad_answer", 0, True),
    "short logprobs": ({"answer": "short_logprobs"}, "bad_answer", 0, True),
    "short logprobs mid-stream": ({"answer": "short_logprobs", "answer_after": MID}, "bad_answer", MID, True),
}
GENERATE_FAULTS: dict[str, tuple[dict[str, Any], str]] = {
    "status 500": ({"status": 500}, "status"),
    "status 400": ({"status": 400}, "status"),
    "hang": ({"hang": True}, "timeout"),
    "drop": ({"drop_after": 0}, "connection"),
    "no finish reason": ({"answer": "no_finish"}, "incomplete"),
    "aborted by the engine": ({"answer": "aborted"}, "incomplete"),
    "sse body": ({"answer": "sse"}, "bad_answer"),
    "garbage": ({"answer": "garbage"}, "bad_answer"),
    "no ids": ({"answer": "no_ids"}, "bad_answer"),
    "short logprobs": ({"answer": "short_logprobs"}, "bad_answer"),
}


@pytest.fixture(scope="module")
def prompt(qwen3_tokenizer) -> array:
    return Renderer(qwen3_tokenizer).render([{"role": "user", "content": "Weather in Lima?"}], TOOLS).prompt_ids


def _engine(kind: str, url: str) -> Any:
    return create_engine(EngineConfig(kind=kind, urls=(url,), request_timeout_s=TIMEOUT_S), None)  # type: ignore[arg-type]


def _session(fake_engine: FakeEngine, fault: dict[str, Any]) -> tuple[str, str]:
    sid = f"sk-{uuid.uuid4().hex}"
    key = routing_key(sid)
    fake_engine.configure(fault={**fault, "key": key})
    return sid, key


def fault_name(fault: dict[str, Any]) -> str:
    """The name the fake engine logs for a request this fault struck."""
    return fake.Fault(**fault).name() or ""


def _stopped(fake_engine: FakeEngine, kind: str, key: str) -> bool:
    """Whether the engine was told to stop: vLLM by the closed connection, SGLang by /abort_request."""
    log = fake_engine.log(key)
    return bool(log["aborts"] if kind == "sglang" else log["disconnects"])


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
@pytest.mark.parametrize("name", sorted(STREAM_FAULTS))
def test_a_stream_fault_is_an_engine_error_after_the_chunks_before_it(kind, name, fake_engine, prompt):
    fault, fault_kind, before, generating = STREAM_FAULTS[name]
    pace = {"token_delay": SLOW_TOKEN_S} if generating else {}
    sid, key = _session(fake_engine, {**fault, **pace})
    chunks: list[Any] = []

    async def run() -> Counter:
        eng = _engine(kind, fake_engine.url)
        try:
            with pytest.raises(EngineError) as info:
                async for chunk in eng.stream(prompt, PARAMS, session_id=sid, request_id=f"s-{uuid.uuid4().hex}"):
                    chunks.append(chunk)
            assert info.value.kind == fault_kind, info.value
            assert isinstance(info.value, EngineTimeout) == (fault_kind == "timeout")
            return eng.faults
        finally:
            await eng.aclose()

    faults = asyncio.run(run())
    assert faults == Counter({(fake_engine.url, fault_kind): 1})
    sampled = sum(len(c.output_ids) for c in chunks)
    if before is None:
        assert sampled > MID and all(c.finish_reason is None for c in chunks)
    else:
        assert sampled == before and all(c.finish_reason is None for c in chunks)
    (request,) = fake_engine.log(key)["requests"]
    assert request["fault"] == fault_name(fault)
    if generating:
        assert wait_until(lambda: _stopped(fake_engine, kind, key), LOG_WAIT_S), fake_engine.log(key)
        if kind == "sglang":
            assert [a["rid"] for a in fake_engine.log(key)["aborts"]] == [request["rid"]]
        else:  # the engine never got to send the whole reply
            assert fake_engine.log(key)["streamed"] == []


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
@pytest.mark.parametrize("name", sorted(GENERATE_FAULTS))
def test_a_generate_fault_is_an_engine_error_counted_once(kind, name, fake_engine, prompt):
    fault, fault_kind = GENERATE_FAULTS[name]
    sid, key = _session(fake_engine, fault)

    async def run() -> Counter:
        eng = _engine(kind, fake_engine.url)
        try:
            with pytest.raises(EngineError) as info:
                await eng.generate(prompt, PARAMS, session_id=sid, request_id=f"g-{uuid.uuid4().hex}")
            assert info.value.kind == fault_kind, info.value
            assert isinstance(info.value, EngineTimeout) == (fault_kind == "timeout")
            return eng.faults
        finally:
            await eng.aclose()

    assert asyncio.run(run()) == Counter({(fake_engine.url, fault_kind): 1})
    assert [r["fault"] for r in fake_engine.log(key)["requests"]] == [fault_name(fault)]
    if fault_kind == "timeout":
        assert wait_until(lambda: _stopped(fake_engine, kind, key), LOG_WAIT_S), fake_engine.log(key)


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_a_fault_with_times_strikes_that_often_then_the_engine_answers(kind, fake_engine, prompt):
    sid, key = _session(fake_engine, {"answer": "no_finish", "times": 2})

    async def run() -> tuple[list[str], Counter]:
        eng = _engine(kind, fake_engine.url)
        outcomes = []
        try:
            for n in range(3):
                try:
                    result = await eng.generate(prompt, PARAMS, session_id=sid, request_id=f"t-{n}-{uuid.uuid4().hex}")
                    outcomes.append(result.finish_reason)
                except EngineError as e:
                    outcomes.append(e.kind)
            return outcomes, eng.faults
        finally:
            await eng.aclose()

    outcomes, faults = asyncio.run(run())
    assert outcomes == ["incomplete", "incomplete", "stop"]
    assert faults == Counter({(fake_engine.url, "incomplete"): 2})
    assert [r["fault"] for r in fake_engine.log(key)["requests"]] == ["no_finish", "no_finish", None]


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_faults_are_counted_per_replica(kind, fake_engine, prompt):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"  # closed again before use: nothing listens there

    candidates = (f"sk-{uuid.uuid4().hex}" for _ in range(1000))
    on = {fake_engine.url: 0, dead: 0}
    sessions = []
    for sid in candidates:  # four sessions on each replica
        replica = choose_replica([fake_engine.url, dead], routing_key(sid))
        if on[replica] < 4:
            on[replica] += 1
            sessions.append(sid)

    async def run() -> Counter:
        eng = create_engine(EngineConfig(kind=kind, urls=(fake_engine.url, dead), request_timeout_s=TIMEOUT_S), None)
        try:
            for sid in sessions:
                fake_engine.configure(fault={"status": 503, "key": routing_key(sid)})
                with pytest.raises(EngineError):
                    await eng.generate(prompt, PARAMS, session_id=sid, request_id=f"r-{uuid.uuid4().hex}")
            return eng.faults
        finally:
            await eng.aclose()

    assert asyncio.run(run()) == Counter({(fake_engine.url, "status"): 4, (dead, "connection"): 4})


def test_an_sglang_abort_is_answered_by_an_empty_200_and_not_reported_as_failed(fake_engine, prompt, caplog):
    """SGLang's /abort_request answers an empty body: that is its success, not a failed abort."""
    sid, key = _session(fake_engine, {"hang": True})

    async def run() -> None:
        eng = _engine("sglang", fake_engine.url)
        try:
            with pytest.raises(EngineTimeout):
                await eng.generate(prompt, PARAMS, session_id=sid, request_id="r-abort")
        finally:
            await eng.aclose()

    with caplog.at_level(logging.WARNING, logger="gateway_workers.engines.sglang"):
        asyncio.run(run())
    assert [a["rid"] for a in fake_engine.log(key)["aborts"]] == ["r-abort"]
    assert not [r for r in caplog.records if "abort" in r.getMessage()], caplog.text
