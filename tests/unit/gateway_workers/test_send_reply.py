"""`app.send_reply` settles every reply source once, whatever happened to the reply: a retry's replayed turn
that did not reach its agent is counted as aborted, commits nothing, and records no stage timings it never
had (it was sampled by an earlier attempt)."""

from __future__ import annotations

import asyncio
from array import array
from typing import Any

from broker import protocol
from gateway_workers.app import TurnLabels, send_reply
from gateway_workers.http.connection import AgentConnection
from gateway_workers.metrics import WorkerMetrics
from gateway_workers.turns.captured import TurnRequest
from gateway_workers.turns.replay import ReplayedLive, replayed_turn

RECORDED = protocol.TurnReplayed(7, "turn-1", array("i", [1, 2, 3]), array("i", [4, 5]), "stop",
                                 {"role": "assistant", "content": "again"}, {"ill_formed": False})


async def _body() -> Any:
    yield b"{}"


async def _send_a_reply_that_fails(source: Any) -> WorkerMetrics:
    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()  # the agent stays connected: only the send fails
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        raise RuntimeError("the connection broke")

    metrics, labels = WorkerMetrics(), TurnLabels("chat", 0.0, "/v1/chat/completions")
    connection = AgentConnection(receive)
    await send_reply(source, _body(), [], send, connection, metrics, labels)
    return metrics


def test_a_replayed_reply_that_failed_is_counted_aborted_without_stage_timings():
    for make in (lambda turn: turn, ReplayedLive):
        source = make(replayed_turn("sid", TurnRequest(messages=[]), RECORDED))
        assert source.replayed
        metrics = asyncio.run(_send_a_reply_that_fails(source))
        turns = {labels: n for (name, labels), n in metrics.counts.items() if name == "turns"}
        assert turns == {("chat", "unknown", "aborted"): 1}
        stages = {labels for (name, labels) in metrics.histograms if name == "turn_duration_seconds"}
        assert stages == {("reply",), ("total",)}
