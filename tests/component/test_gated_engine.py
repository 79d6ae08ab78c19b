"""`turns.gated_engine.GatedEngine` over the mock engine: a pause in mode abort stops a call in flight, which keeps
what it sampled, waits for the resume and asks for the rest; the result is one generation whose parts carry the
versions they were sampled under. A call that neither waited nor was stopped comes back untouched."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from array import array
from typing import Any

from gateway_workers.capture.generation import GenerationGate
from gateway_workers.engines import EngineConfig, SamplingParams
from gateway_workers.engines.base import UNKNOWN_VERSION, EngineChunk
from gateway_workers.engines.mock import MockEngine
from gateway_workers.turns.gated_engine import GatedEngine

PARAMS = SamplingParams(max_tokens=20, temperature=1.0, seed=5)
TOKEN_S = 0.01


def _gated(tokenizer: Any) -> tuple[GatedEngine, GenerationGate, MockEngine]:
    mock = MockEngine(EngineConfig(kind="mock", mock_per_token_s=TOKEN_S, mock_output_tokens=20), tokenizer)
    gate = GenerationGate()
    gate.apply(1, "", 3, told=True)  # generating under version 3
    return GatedEngine(mock, gate, hold_s=10.0), gate, mock


def test_an_abort_pause_splits_a_whole_generation_into_kept_tokens_and_the_rest(builtin_tokenizer: Any) -> None:
    gated, gate, mock = _gated(builtin_tokenizer)
    prompt = array("i", builtin_tokenizer.encode("hello there", add_special_tokens=False))

    async def run() -> Any:
        plain = await gated.generate(prompt, PARAMS, session_id="s", request_id="plain")
        assert plain.weight_versions == () and gate.report() == [1, 0, 0, 0, 0]  # untouched
        call = asyncio.ensure_future(gated.generate(prompt, PARAMS, session_id="s", request_id="r"))
        await asyncio.sleep(6 * TOKEN_S)
        gate.apply(2, "abort", -1, told=True)
        await asyncio.sleep(0.05)
        assert gate.engine_calls == 0 and gate.turns_held == 1 and gate.tokens_kept > 0 and not call.done()
        kept = gate.tokens_kept
        gate.apply(3, "", 4, told=True)
        return await call, kept

    result, kept = asyncio.run(run())
    partial = mock.reply(prompt, PARAMS).output_ids[:kept]
    rest = mock.reply(array("i", [*prompt, *partial]), dataclasses.replace(PARAMS, max_tokens=20 - kept))
    assert result.output_ids == partial + rest.output_ids
    assert result.weight_versions == ((3, kept), (4, len(rest.output_ids)))
    assert gate.counters["stopped"] == 1 and gate.counters["tokens_kept"] == kept


def test_an_abort_pause_stops_a_stream_whose_chunks_go_on_after_the_resume(builtin_tokenizer: Any) -> None:
    gated, gate, mock = _gated(builtin_tokenizer)
    prompt = array("i", builtin_tokenizer.encode("stream it", add_special_tokens=False))

    async def run() -> list[Any]:
        chunks = []
        async for chunk in gated.stream(prompt, PARAMS, session_id="s", request_id="r"):
            chunks.append(chunk)
            if sum(len(c.output_ids) for c in chunks) == 5:
                gate.apply(2, "abort", -1, told=True)
                asyncio.get_running_loop().call_later(0.05, gate.apply, 3, "", 4, True)
        return chunks

    chunks = asyncio.run(run())
    ids = [t for c in chunks for t in c.output_ids]
    partial = mock.reply(prompt, PARAMS).output_ids[:5]
    rest = mock.reply(array("i", [*prompt, *partial]), dataclasses.replace(PARAMS, max_tokens=15))
    assert ids == partial + rest.output_ids  # the agent's deltas go on where they stopped
    assert [c.finish_reason for c in chunks].count(None) == len(chunks) - 1
    assert chunks[-1].weight_versions == ((3, 5), (4, len(rest.output_ids)))
    assert gate.report() == [3, 0, 0, 5, 0]


class _TrailedEngine:
    """An engine whose stream has a trailer after its finish (as vLLM's usage and [DONE]): read or not."""

    faults: Any = None
    replicas: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.trailer_read = False

    async def stream(self, prompt_ids: Any, params: Any, **kwargs: Any) -> Any:
        yield EngineChunk([1, 2], [-0.5, -0.25])
        yield EngineChunk([3], [-0.125], "stop")
        self.trailer_read = True


def test_a_plain_stream_is_untouched_and_read_to_its_trailer() -> None:
    inner = _TrailedEngine()
    gate = GenerationGate()
    gate.apply(1, "", 3, told=True)
    gated = GatedEngine(inner, gate, hold_s=1.0)  # type: ignore[arg-type]

    async def run() -> list[Any]:
        chunks = [c async for c in gated.stream([5, 6], PARAMS, session_id="s", request_id="r")]
        return chunks

    chunks = asyncio.run(run())
    assert [c.output_ids for c in chunks] == [[1, 2], [3]] and chunks[-1].weight_versions == ()
    assert inner.trailer_read and gate.report() == [1, 0, 0, 0, 0]


def test_a_started_stream_stopped_by_a_pause_outlasts_the_hold_bound_with_keepalives(builtin_tokenizer: Any) -> None:
    mock = MockEngine(EngineConfig(kind="mock", mock_per_token_s=TOKEN_S, mock_output_tokens=20), builtin_tokenizer)
    gate = GenerationGate()
    gate.apply(1, "", 3, told=True)
    gated = GatedEngine(mock, gate, hold_s=0.1, keepalive_s=0.05)
    prompt = array("i", builtin_tokenizer.encode("keep me open", add_special_tokens=False))

    async def run() -> list[Any]:
        chunks: list[Any] = []
        async for chunk in gated.stream(prompt, PARAMS, session_id="s", request_id="r"):
            chunks.append(chunk)
            if sum(len(c.output_ids) for c in chunks) == 3 and not gate.paused and gate.epoch == 1:
                gate.apply(2, "abort", -1, told=True)
                asyncio.get_running_loop().call_later(0.4, gate.apply, 3, "", 4, True)  # 4 hold bounds later
        return chunks

    chunks = asyncio.run(run())
    waits = [c for c in chunks if not c.output_ids and c.finish_reason is None]
    assert len(waits) >= 4  # keep-alives while it waited, where a new request would have had its 503
    ids = [t for c in chunks for t in c.output_ids]
    partial = mock.reply(prompt, PARAMS).output_ids[:3]
    rest = mock.reply(array("i", [*prompt, *partial]), dataclasses.replace(PARAMS, max_tokens=17))
    assert ids == partial + rest.output_ids and chunks[-1].weight_versions == ((3, 3), (4, len(rest.output_ids)))
    assert gate.turns_held == 0 and gate.counters["hold_timeouts"] == 0


def test_a_keep_pause_holds_calls_in_the_engine_and_flags_what_it_cannot_version(builtin_tokenizer: Any) -> None:
    gated, gate, mock = _gated(builtin_tokenizer)
    gate.worker_id = "w"
    prompt = array("i", builtin_tokenizer.encode("hold me", add_special_tokens=False))
    pause_s = 0.3

    async def run() -> tuple[list[Any], Any, float]:
        chunks: list[Any] = []
        whole = asyncio.ensure_future(gated.generate(prompt, PARAMS, session_id="s", request_id="w"))
        started = time.monotonic()
        async for chunk in gated.stream(prompt, PARAMS, session_id="s", request_id="r"):
            chunks.append(chunk)
            if sum(len(c.output_ids) for c in chunks) == 4 and gate.epoch == 1:
                gate.apply(2, "keep", -1, told=True, engine_pausers=["w"])  # the mock is this worker's own
                asyncio.get_running_loop().call_later(pause_s, gate.apply, 3, "", 4, True, ["w"])
        return chunks, await whole, time.monotonic() - started

    chunks, whole, took = asyncio.run(run())
    reply = mock.reply(prompt, PARAMS)
    assert [t for c in chunks for t in c.output_ids] == reply.output_ids  # one generation, held in place
    assert chunks[-1].weight_versions == ((3, 4), (UNKNOWN_VERSION, len(reply.output_ids) - 4))  # the mock can't say
    assert whole.output_ids == reply.output_ids and whole.weight_versions == ((UNKNOWN_VERSION, 20),)
    assert took >= 20 * TOKEN_S + pause_s  # nothing sampled while paused: the pause adds to its pace
    assert gate.keep_pauses == 1 and gate.engines_paused == set() and gate.report() == [3, 0, 0, 0, 0]
