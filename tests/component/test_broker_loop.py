"""The broker loop's wake-ups over real sockets: no frame is left waiting, no socket starves the other.

The loop sleeps on the sockets' edge-triggered ZMQ_FDs (`broker/server.py`): a missed edge would
leave a frame unanswered until some other frame arrived. Each test ends on a lone request to an
otherwise idle broker, so a lost wake-up shows as a timeout, and bursts overrun DRAIN_BATCH.
"""

from __future__ import annotations

import threading
import time

from component.peers import WorkerPeer, conversation

from broker import protocol
from broker.server import DRAIN_BATCH

LONE_REPLY_S = 2.0  # an idle broker answers a lone request in well under this (it polls every 100 ms at most)


def test_a_pipelined_burst_is_answered_once_each_while_the_trainer_is_served(client, worker, broker, zctx):
    sid = client.open_session()
    n = 5 * DRAIN_BATCH + 7  # several batches, then a partial one
    rids = []
    for k in range(n):  # sent without waiting: the broker finds them queued
        rid = worker.next_id()
        rids.append(rid)
        worker.send_raw(protocol.encode(protocol.OpenTurn(rid, sid, f"t{k}")))
    stats_times: list[float] = []

    def trainer() -> None:
        for _ in range(10):
            t0 = time.monotonic()
            assert client.stats()["sessions_open"] == 1
            stats_times.append(time.monotonic() - t0)

    t = threading.Thread(target=trainer)
    t.start()
    replies = [worker.recv() for _ in range(n)]
    t.join(10)
    assert not t.is_alive()
    assert [r.request_id for r in replies] == rids  # each answered once, in order
    assert [r.seq for r in replies] == list(range(n))  # type: ignore[attr-defined]
    assert len(stats_times) == 10 and max(stats_times) < LONE_REPLY_S
    # the broker is idle again: one more request must still wake it
    assert worker.sock.poll(100) == 0
    assert worker.open_turn(sid, "last").seq == n  # type: ignore[attr-defined]


def test_requests_right_after_parked_replies_are_not_missed(client, worker, broker, zctx):
    # A parked finish is answered on the control socket while the loop serves the worker socket;
    # the trainer's next request must wake the loop all the same.
    for round_ in range(12):
        sid = client.open_session()
        turns = conversation(round_, 2)
        assert isinstance(worker.open_turn(sid, "a"), protocol.TurnOpened)
        assert worker.commit(sid, "a", turns[0]).outcome == "stored"  # type: ignore[attr-defined]
        assert isinstance(worker.open_turn(sid, "b"), protocol.TurnOpened)
        result: dict = {}

        def finish(sid: str = sid, result: dict = result) -> None:
            result["records"] = client.finish_session(sid, wait_timeout=30.0)

        finisher = threading.Thread(target=finish)
        finisher.start()
        deadline = time.monotonic() + 10
        while client.stats()["finishes_parked"] != 1:
            assert time.monotonic() < deadline, "the finish never parked"
            time.sleep(0.005)
        t0 = time.monotonic()
        assert worker.commit(sid, "b", turns[1]).outcome == "stored"  # type: ignore[attr-defined]
        finisher.join(LONE_REPLY_S)
        assert not finisher.is_alive(), "the parked finish was not answered on the commit that drained it"
        assert len(result["records"]) >= 1
        assert client.stats()["finishes_parked"] == 0  # a lone request right after the parked reply
        assert time.monotonic() - t0 < LONE_REPLY_S


def test_a_second_worker_is_served_while_the_first_floods(broker, zctx, client):
    sid = client.open_session()
    flood, other = WorkerPeer(zctx, broker.worker_endpoint), WorkerPeer(zctx, broker.worker_endpoint)
    try:
        n = 3 * DRAIN_BATCH
        for k in range(n):
            flood.send_raw(protocol.encode(protocol.OpenTurn(flood.next_id(), sid, f"f{k}")))
        t0 = time.monotonic()
        opened = other.open_turn(sid, "other")
        assert isinstance(opened, protocol.TurnOpened) and time.monotonic() - t0 < LONE_REPLY_S
        got = [flood.recv() for _ in range(n)]
        assert sorted([*(r.seq for r in got), opened.seq]) == list(range(n + 1))  # type: ignore[attr-defined]
    finally:
        flood.close()
        other.close()
