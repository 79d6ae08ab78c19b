"""`capture.generation.GenerationGate`: engine calls pass while generating, wait while paused, and count."""

from __future__ import annotations

import asyncio

import pytest

from gateway_workers.capture.generation import GenerationGate, HoldTimeout


def test_calls_wait_while_paused_and_go_on_at_the_resume_under_its_version() -> None:
    async def run() -> None:
        gate, beats = GenerationGate(), []
        gate.beat_soon = lambda: beats.append(gate.report())
        assert await gate.enter(1.0) is False and gate.engine_calls == 1  # generating: at once
        gate.apply(1, "wait", -1, told=True)
        assert beats[-1] == [1, 1, 0, 0, 0]  # the pause applied: told at once
        waiting = asyncio.ensure_future(gate.enter(5.0))
        await asyncio.sleep(0.01)
        assert not waiting.done() and gate.turns_held == 1 and gate.report() == [1, 1, 1, 0, 0]
        gate.leave()
        assert beats[-1] == [1, 0, 1, 0, 0]  # the last call done while paused: told at once
        gate.apply(1, "", 3)  # not newer: ignored, but the version of this epoch is taken
        assert not waiting.done() and gate.weight_version == 3
        gate.apply(2, "", 4)  # an OPEN's answer: applied, but not reported until the broker tells it
        assert await waiting is True and gate.weight_version == 4 and gate.turns_held == 0
        gate.leave()
        assert gate.report() == [1, 0, 0, 0, 0]
        gate.apply(2, "", 4, told=True)
        assert gate.report() == [2, 0, 0, 0, 0]

    asyncio.run(run())


def test_a_call_held_past_its_bound_or_cancelled_leaves_no_count_behind() -> None:
    async def run() -> None:
        gate = GenerationGate()
        gate.apply(1, "wait", -1)
        with pytest.raises(HoldTimeout):
            await gate.enter(0.05)
        assert (gate.turns_held, gate.engine_calls, gate.counters["hold_timeouts"]) == (0, 0, 1)
        waiting = asyncio.ensure_future(gate.enter(5.0))
        await asyncio.sleep(0.01)
        waiting.cancel()  # the agent left
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert (gate.turns_held, gate.engine_calls) == (0, 0)

    asyncio.run(run())


def test_a_resume_and_the_next_pause_applied_together_keep_a_held_call_held() -> None:
    async def run() -> None:
        gate = GenerationGate()
        gate.apply(1, "abort", -1)
        waiting = asyncio.ensure_future(gate.enter(5.0))
        await asyncio.sleep(0.01)
        gate.apply(2, "", 4)
        gate.apply(3, "wait", 4)  # in the same pass of the loop: the waiter wakes into a new pause
        await asyncio.sleep(0.05)
        assert not waiting.done() and gate.engine_calls == 0 and gate.turns_held == 1
        gate.apply(4, "", 4)
        assert await waiting is True and gate.engine_calls == 1

    asyncio.run(run())


def test_an_older_epoch_told_by_a_restarted_broker_is_taken_an_older_open_answer_is_not() -> None:
    async def run() -> None:
        gate = GenerationGate()
        gate.apply(9, "wait", 2)
        gate.apply(1, "", 3)  # an OPEN's answer from before: ignored
        assert (gate.epoch, gate.paused) == (9, "wait")
        gate.apply(0, "", -1, told=True)  # a broker restarted without its state: it counts from 0
        assert (gate.epoch, gate.paused) == (0, "") and await gate.enter(1.0) is False
        gate.apply(0, "", 5)  # its OPEN answers now update the version
        assert gate.weight_version == 5

    asyncio.run(run())


def test_a_keep_pause_pauses_this_workers_share_of_the_replicas_and_the_resume_resumes_them() -> None:
    async def run() -> None:
        gate, calls = GenerationGate(), []
        gate.worker_id, gate.replicas = "w2", ("http://a", "http://b", "http://c")
        failures = [1]  # the first pause of http://b fails: asked again

        async def pause(replica: str) -> None:
            calls.append(("pause", replica))
            if replica == "http://b" and failures:
                failures.pop()
                raise RuntimeError("no answer")

        async def resume(replica: str, version: int | None) -> None:
            calls.append(("resume", replica, version))

        gate.pause_engine, gate.resume_engine = pause, resume
        gate.apply(1, "", 3, told=True)
        gate.apply(2, "keep", 3, told=True, engine_pausers=["w1", "w2"])  # w2 is the second: http://b
        assert gate.report()[4] == 1 and gate.keep_pauses == 1
        await asyncio.sleep(0.01)
        assert calls == [("pause", "http://b")] and gate.report()[4] == 1  # failed: not paused yet
        await asyncio.sleep(1.1)
        assert calls == [("pause", "http://b")] * 2 and gate.report() == [2, 0, 0, 0, 0]
        gate.apply(2, "keep", 3, told=True, engine_pausers=["w2"])  # w1 was lost: its replicas are w2's now
        await asyncio.sleep(0.01)
        assert calls[2:] == [("pause", "http://a"), ("pause", "http://c")]
        gate.apply(3, "", 4, told=True, engine_pausers=["w2"])
        await asyncio.sleep(0.01)
        assert sorted(calls[4:]) == [("resume", r, 4) for r in ("http://a", "http://b", "http://c")]
        assert gate.engines_paused == set()

    asyncio.run(run())
