"""Stopping a generation at the engine (`Engine.abort`, what a pause in mode abort does), over real HTTP against the
fake engine process in vLLM's and SGLang's formats.

Asked mid-generation, each engine answers with what it had sampled, in its own way (vLLM: `/abort_requests` with
its `generate-tokens-` id, a whole answer with finish reason `abort`, or a stream that just ends; SGLang:
`/abort_request`, finish reason `{"type": "abort"}`, its stream's last cumulative event). The call raises
`EngineAborted` with the ids it had not yet returned, never counted as a fault; those ids, with the streamed ones,
are exactly the start of what the engine would have sampled. A call that ended before the abort is not touched,
and an engine abort nobody asked for stays a failure.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from assets import FakeEngine, wait_until
from test_engine_fault_kinds import PARAMS, _engine, _session, prompt  # noqa: F401 (a fixture)

from gateway_workers.engines import EngineConfig, EngineError, create_engine
from gateway_workers.engines.base import EngineAborted

TOKEN_S = 0.03
STOP_AFTER_S = 0.3  # about ten tokens in


def _slow_engine(kind: str, url: str) -> Any:
    return create_engine(EngineConfig(kind=kind, urls=(url,), request_timeout_s=30.0), None)  # type: ignore[arg-type]


async def _stopped_whole(kind: str, url: str, sid: str, ids: Any) -> tuple[EngineAborted, Any]:
    eng = _slow_engine(kind, url)
    rid = f"r-{uuid.uuid4().hex}"
    try:
        call = asyncio.ensure_future(eng.generate(ids, PARAMS, session_id=sid, request_id=rid))
        await asyncio.sleep(STOP_AFTER_S)
        await eng.abort(rid, session_id=sid)
        with pytest.raises(EngineAborted) as info:
            await call
        return info.value, eng.faults
    finally:
        await eng.aclose()


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_a_whole_generation_stopped_mid_way_comes_back_with_what_it_sampled(
    kind: str, fake_engine: FakeEngine, prompt: Any  # noqa: F811
) -> None:
    sid, key = _session(fake_engine, {"token_delay": TOKEN_S})
    stopped, faults = asyncio.run(_stopped_whole(kind, fake_engine.url, sid, prompt))
    full = asyncio.run(_whole(kind, fake_engine.url, prompt))
    assert 0 < len(stopped.output_ids) < len(full.output_ids)
    assert stopped.output_ids == full.output_ids[: len(stopped.output_ids)]
    assert stopped.logprobs == full.logprobs[: len(stopped.logprobs)]
    assert not faults  # asked for: not a failure
    (entry,) = fake_engine.log(key)["stopped"]
    assert entry["sampled"] == len(stopped.output_ids)


async def _whole(kind: str, url: str, ids: Any) -> Any:
    eng = _engine(kind, url)
    try:
        return await eng.generate(ids, PARAMS, session_id=f"sk-{uuid.uuid4().hex}", request_id=uuid.uuid4().hex)
    finally:
        await eng.aclose()


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_a_stream_stopped_mid_way_ends_with_the_rest_of_what_it_sampled(
    kind: str, fake_engine: FakeEngine, prompt: Any  # noqa: F811
) -> None:
    sid, key = _session(fake_engine, {"token_delay": TOKEN_S})

    async def run() -> tuple[list[int], EngineAborted, Any]:
        eng = _slow_engine(kind, fake_engine.url)
        rid, got = f"s-{uuid.uuid4().hex}", []
        try:
            with pytest.raises(EngineAborted) as info:
                async for chunk in eng.stream(prompt, PARAMS, session_id=sid, request_id=rid):
                    got += chunk.output_ids
                    if len(got) == 5:
                        asyncio.ensure_future(eng.abort(rid, session_id=sid))
            return got, info.value, eng.faults
        finally:
            await eng.aclose()

    streamed, stopped, faults = asyncio.run(run())
    full = asyncio.run(_whole(kind, fake_engine.url, prompt))
    sampled = streamed + stopped.output_ids
    assert 5 <= len(sampled) < len(full.output_ids) and sampled == full.output_ids[: len(sampled)]
    assert not faults
    assert wait_until(lambda: len(fake_engine.log(key)["aborts"]) == 1, 5)


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_an_abort_after_the_end_changes_nothing_and_one_not_asked_for_stays_a_failure(
    kind: str, fake_engine: FakeEngine, prompt: Any  # noqa: F811
) -> None:
    async def run() -> None:
        eng = _engine(kind, fake_engine.url)
        sid = f"sk-{uuid.uuid4().hex}"
        try:
            done = await eng.generate(prompt, PARAMS, session_id=sid, request_id="ended")
            await eng.abort("ended", session_id=sid)  # nothing in flight: no request sent
            assert done.finish_reason in ("stop", "length") and not eng.stopping
            sid, _ = _session(fake_engine, {"answer": "aborted"})
            with pytest.raises(EngineError) as info:
                await eng.generate(prompt, PARAMS, session_id=sid, request_id=uuid.uuid4().hex)
            assert info.value.kind == "incomplete"
        finally:
            await eng.aclose()

    asyncio.run(run())
