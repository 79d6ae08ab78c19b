"""Engine streaming over real HTTP against the fake engine process (vLLM and SGLang SSE formats), and the mock.

A stream's chunks must concatenate to exactly what `generate` returns; closing a stream
early must stop the engine (vLLM: the connection closes; SGLang: /abort_request); a
failure mid-stream is an EngineError; both SGLang event styles (cumulative, incremental) parse.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from array import array

import pytest
from assets import TOOLS, wait_until

from gateway_workers.engines import EngineConfig, EngineError, SamplingParams, create_engine
from gateway_workers.engines import sglang as sglang_backend
from gateway_workers.engines import vllm as vllm_backend
from gateway_workers.engines.http_engine import _sse_events
from gateway_workers.engines.mock import MockEngine
from gateway_workers.engines.routing import routing_key
from gateway_workers.rendering.renderer import Renderer

PARAMS = SamplingParams(max_tokens=64, temperature=0.7, seed=3)
LOG_WAIT_S = 5.0


@pytest.fixture(scope="module")
def prompt(qwen3_tokenizer) -> array:
    conversation = [{"role": "user", "content": "Weather in Paris and Rome?"}]
    return Renderer(qwen3_tokenizer).render(conversation, TOOLS).prompt_ids


def _session() -> tuple[str, str]:
    sid = f"sk-{uuid.uuid4().hex}"
    return sid, routing_key(sid)


async def _collect(eng, prompt_ids, sid: str, rid: str):
    chunks = [c async for c in eng.stream(prompt_ids, PARAMS, session_id=sid, request_id=rid)]
    ids = [i for c in chunks for i in c.output_ids]
    lps = [lp for c in chunks for lp in c.logprobs]
    return chunks, ids, lps


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_stream_concatenates_to_the_generate_result(kind, fake_engine, prompt):
    sid, key = _session()

    async def run():
        eng = create_engine(EngineConfig(kind=kind, urls=(fake_engine.url,)), None)
        try:
            whole = await eng.generate(prompt, PARAMS, session_id=sid, request_id=f"g-{uuid.uuid4().hex}")
            chunks, ids, lps = await _collect(eng, prompt, sid, f"s-{uuid.uuid4().hex}")
        finally:
            await eng.aclose()
        return whole, chunks, ids, lps

    whole, chunks, ids, lps = asyncio.run(run())
    assert (ids, lps) == (whole.output_ids, whole.logprobs) and len(chunks) == len(ids) > 1  # one token per step
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + [whole.finish_reason]
    log = fake_engine.log(key)
    assert len(log["streamed"]) == 1 and log["requests"][-1]["body"]["stream"] is True


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_closing_a_stream_early_stops_the_engine(kind, fake_engine, prompt):
    sid, key = _session()
    fake_engine.configure(fault={"token_delay": 0.05, "key": key})
    rid = f"s-{uuid.uuid4().hex}"

    async def run():
        eng = create_engine(EngineConfig(kind=kind, urls=(fake_engine.url,)), None)
        try:
            stream = eng.stream(prompt, PARAMS, session_id=sid, request_id=rid)
            first = await stream.__anext__()
            await stream.aclose()
            return first
        finally:
            await eng.aclose()

    first = asyncio.run(run())
    assert len(first.output_ids) == 1 and first.finish_reason is None
    if kind == "vllm":  # vLLM aborts a request whose connection closed
        assert wait_until(lambda: fake_engine.log(key)["disconnects"], LOG_WAIT_S), fake_engine.log(key)
    else:  # SGLang is told explicitly
        assert wait_until(lambda: fake_engine.log(key)["aborts"], LOG_WAIT_S), fake_engine.log(key)
        assert fake_engine.log(key)["aborts"][0]["rid"] == rid
    log = fake_engine.log(key)
    # The engine stopped early: an abort ends the SGLang stream with a finish of its own, a closed connection ends it.
    assert all(entry["sent"] < 5 for entry in log["streamed"] + log["disconnects"]), log


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_failures_before_and_during_a_stream_are_engine_errors(kind, fake_engine, prompt):
    sid, key = _session()

    async def run() -> list:
        eng = create_engine(EngineConfig(kind=kind, urls=(fake_engine.url,)), None)
        try:
            return await _collect(eng, prompt, sid, f"s-{uuid.uuid4().hex}")
        finally:
            await eng.aclose()

    fake_engine.configure(fault={"status": 500, "times": 1, "key": key})
    with pytest.raises(EngineError, match="HTTP 500"):
        asyncio.run(run())
    fake_engine.configure(fault={"error_after": 3, "key": key})
    with pytest.raises(EngineError, match="mid-stream"):
        asyncio.run(run())


def test_sglang_cumulative_and_incremental_events_parse_alike():
    url = "http://engine"
    entries = [[-0.5, 11, None], [-0.25, 12, None], [-1.0, 13, None]]
    finish = {"type": "stop", "matched": 13}

    def event(items, total, done=False):
        return {
            "meta_info": {
                "output_token_logprobs": items,
                "completion_tokens": total,
                "finish_reason": finish if done else None,
            }
        }

    cumulative = [event(entries[:1], 1), event(entries[:2], 2), event(entries, 3, True)]
    incremental = [event(entries[:1], 1), event(entries[1:2], 2), event(entries[2:], 3, True)]
    for events in (cumulative, incremental):
        have, ids, lps, reasons = 0, [], [], []
        for e in events:
            chunk = sglang_backend.parse_stream_event(url, e, have)
            have += len(chunk.output_ids)
            ids += chunk.output_ids
            lps += chunk.logprobs
            reasons.append(chunk.finish_reason)
        assert (ids, lps, reasons) == ([11, 12, 13], [-0.5, -0.25, -1.0], [None, None, "stop"])
    with pytest.raises(EngineError):
        sglang_backend.parse_stream_event(url, event(entries[:1], 3), 1)  # neither cumulative nor incremental
    with pytest.raises(EngineError):
        sglang_backend.parse_stream_event(url, {"meta_info": {"finish_reason": None}}, 0)


def test_vllm_stream_choices_are_validated():
    url = "http://engine"
    good = {"index": 0, "token_ids": [5], "finish_reason": None, "logprobs": {"content": [{"logprob": -0.5}]}}
    assert vllm_backend.parse_stream_choice(url, good).output_ids == [5]
    assert vllm_backend.parse_stream_choice(url, {**good, "finish_reason": "length"}).finish_reason == "length"
    for bad in ({**good, "index": 1}, {**good, "logprobs": None}, {**good, "finish_reason": "error"}):
        with pytest.raises(EngineError):
            vllm_backend.parse_stream_choice(url, bad)


def test_sse_reader_handles_split_events_crlf_and_big_events():
    big = b'{"x": "' + b"y" * 200_000 + b'"}'
    raw = b'data: {"a": 1}\r\n\r\n: a comment\n\ndata: ' + big + b"\n\ndata: [DONE]\n\n"

    class Content:
        async def iter_any(self):
            for i in range(0, len(raw), 7_001):  # events split across arbitrary chunk borders
                yield raw[i : i + 7_001]

    async def collect():
        return [e async for e in _sse_events(Content(), "http://engine")]  # type: ignore[arg-type]

    assert asyncio.run(collect()) == [b'{"a": 1}', big, b"[DONE]"]


def test_mock_stream_matches_generate_and_honours_delays(builtin_tokenizer):
    config = EngineConfig(kind="mock", mock_per_token_s=0.01, mock_output_tokens=12)
    eng = MockEngine(config, builtin_tokenizer)
    prompt = builtin_tokenizer.encode("hello there", add_special_tokens=False)

    async def run():
        whole = await eng.generate(prompt, PARAMS, session_id="s", request_id="r")
        started = time.monotonic()
        arrivals, ids = [], []
        async for chunk in eng.stream(prompt, PARAMS, session_id="s", request_id="r2"):
            arrivals.append(time.monotonic() - started)
            ids += chunk.output_ids
        return whole, ids, arrivals

    whole, ids, arrivals = asyncio.run(run())
    assert ids == whole.output_ids
    assert arrivals[0] < arrivals[-1] - 0.05  # tokens arrive over time, not all at the end
