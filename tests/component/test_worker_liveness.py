"""Dead workers are noticed: the broker abandons the in-flight turns of a worker it stops hearing from.

A real `BrokerServer` on port-0 sockets with a short silence bound; raw worker peers name themselves in
their OPENs and heartbeat (or fall silent). A finish that waits for a silent worker's turn returns once
the bound passes, without that turn, while a live worker's turn in the same session is waited for and
trained. A worker that was only slow still lands its commit, and a durable broker remembers both who
owns each in-flight turn (so the owner's silence after a restart still abandons it) and what it
abandoned. A backplane heartbeats while idle and while its event loop stalls, and starts its beats again
after they fail.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq
from assets import wait_until
from component.peers import WorkerPeer, assert_linear_rows, conversation

from broker import protocol
from trainer_client import TrainerClient

SILENCE_S = 0.6
SID = "liveness-session-key-0123456789"


def _beat(zctx: zmq.Context, endpoint: str, worker_id: str, stop: threading.Event) -> None:
    """Heartbeats for `worker_id` on a socket of this thread's own (a zmq socket serves one thread at a time)."""
    peer = WorkerPeer(zctx, endpoint)
    try:
        while not stop.wait(SILENCE_S / 4):
            peer.heartbeat(worker_id)
    finally:
        peer.close()


def test_a_finish_stops_waiting_for_a_silent_workers_turn_but_waits_for_a_live_ones(make_broker, zctx):
    broker = make_broker(worker_silence_s=SILENCE_S)
    turns = conversation(7, 2)
    dead, live = WorkerPeer(zctx, broker.worker_endpoint), WorkerPeer(zctx, broker.worker_endpoint)
    stop = threading.Event()
    beating = threading.Thread(target=_beat, args=(zctx, broker.worker_endpoint, "live-worker", stop))
    try:
        with TrainerClient(broker.control_endpoint, timeout=10) as client:
            client.open_session(session_id=SID)
            assert isinstance(live.open_turn(SID, "t0", "live-worker"), protocol.TurnOpened)
            assert live.commit(SID, "t0", turns[0]).outcome == "stored"
            assert isinstance(dead.open_turn(SID, "lost", "dead-worker"), protocol.TurnOpened)  # then silence
            assert isinstance(live.open_turn(SID, "t1", "live-worker"), protocol.TurnOpened)
            beating.start()
            finished: list = []
            t0 = time.monotonic()
            finisher = threading.Thread(target=lambda: finished.append(client.finish_session(SID, wait_timeout=30)))
            finisher.start()
            time.sleep(2 * SILENCE_S)  # the dead worker's turn is abandoned by now; the live one's is still awaited
            assert finisher.is_alive(), "the finish must keep waiting for the live worker's turn"
            assert live.commit(SID, "t1", turns[1]).outcome == "stored"
            finisher.join(20)
            elapsed = time.monotonic() - t0
            stats = client.stats()
    finally:
        stop.set()
        if beating.is_alive():
            beating.join()
        dead.close()
        live.close()
    assert not finisher.is_alive()
    assert elapsed < 20, elapsed  # released by the live commit, not by its 30 s wait_timeout (margin for a loaded box)
    assert_linear_rows(finished[0], turns)  # both live turns, nothing of the lost one
    assert {row.metadata["drain_status"] for row in finished[0]} == {"worker_lost"}  # not a drain timeout
    assert stats["turns_worker_lost"] == 1 and stats["drain_timeouts"] == 0
    assert stats["turns_abandoned"] == 1  # counted at the finish too


def test_a_silent_workers_finish_returns_within_the_bound(make_broker, zctx):
    broker = make_broker(worker_silence_s=SILENCE_S)
    worker = WorkerPeer(zctx, broker.worker_endpoint)
    try:
        with TrainerClient(broker.control_endpoint, timeout=10) as client:
            client.open_session(session_id=SID)
            assert isinstance(worker.open_turn(SID, "t0", "gone-worker"), protocol.TurnOpened)
            t0 = time.monotonic()
            records = client.finish_session(SID, wait_timeout=30)
            elapsed = time.monotonic() - t0
    finally:
        worker.close()
    assert records == []
    assert SILENCE_S <= elapsed < SILENCE_S + 1.0, elapsed


def test_an_unnamed_turn_is_never_abandoned(make_broker, zctx):
    """A worker that names no id (an older worker) keeps today's rule: the finish waits for its wait_timeout."""
    broker = make_broker(worker_silence_s=SILENCE_S)
    worker = WorkerPeer(zctx, broker.worker_endpoint)
    try:
        with TrainerClient(broker.control_endpoint, timeout=10) as client:
            client.open_session(session_id=SID)
            assert isinstance(worker.open_turn(SID, "t0"), protocol.TurnOpened)
            t0 = time.monotonic()
            assert client.finish_session(SID, wait_timeout=3 * SILENCE_S) == []
            elapsed = time.monotonic() - t0
            stats = client.stats()
    finally:
        worker.close()
    assert elapsed >= 3 * SILENCE_S - 0.05, elapsed
    assert stats["turns_worker_lost"] == 0


def test_a_slow_workers_commit_after_it_was_given_up_still_lands(make_broker, zctx):
    broker = make_broker(worker_silence_s=SILENCE_S)
    turns = conversation(8, 1)
    worker = WorkerPeer(zctx, broker.worker_endpoint)
    try:
        with TrainerClient(broker.control_endpoint, timeout=10) as client:
            client.open_session(session_id=SID)
            assert isinstance(worker.open_turn(SID, "t0", "slow-worker"), protocol.TurnOpened)
            assert wait_until(lambda: client.stats()["turns_worker_lost"] == 1, timeout=5)
            assert worker.commit(SID, "t0", turns[0]).outcome == "stored"
            stats = client.stats()
            records = client.finish_session(SID, wait_timeout=0)
    finally:
        worker.close()
    assert stats["commits_late"] == 1
    assert_linear_rows(records, turns)


def test_a_durable_broker_remembers_owners_and_abandonments_across_a_restart(tmp_path, zctx):
    from component.test_durable_loop import ServedBroker

    first = ServedBroker(tmp_path, worker_silence_s=SILENCE_S)
    worker = WorkerPeer(zctx, first.worker_endpoint)
    try:
        with TrainerClient(first.control_endpoint, timeout=10) as client:
            client.open_session(session_id=SID)
            assert isinstance(worker.open_turn(SID, "abandoned", "w-before"), protocol.TurnOpened)
            assert wait_until(lambda: client.stats()["turns_worker_lost"] == 1, timeout=5)
            assert isinstance(worker.open_turn(SID, "owned", "w-after"), protocol.TurnOpened)
    finally:
        worker.close()
        first.stop()
    second = ServedBroker(tmp_path, worker_silence_s=SILENCE_S)
    try:
        with TrainerClient(second.control_endpoint, timeout=10) as client:
            restored = client.stats()
            t0 = time.monotonic()
            records = client.finish_session(SID, wait_timeout=30)  # "owned"'s worker never shows up again
            elapsed = time.monotonic() - t0
            stats = client.stats()
    finally:
        second.stop()
    assert restored["turns_in_flight"] == 1  # "owned"; "abandoned" stayed abandoned
    assert records == []
    assert elapsed < SILENCE_S + 1.0, elapsed
    assert stats["turns_worker_lost"] == 1  # counted afresh by this broker: "owned"


def test_a_backplane_names_itself_in_its_opens_and_heartbeats_while_idle(make_broker, monkeypatch):
    import asyncio

    from gateway_workers.capture import backplane as backplane_module
    from gateway_workers.capture.backplane import Backplane

    monkeypatch.setattr(backplane_module, "HEARTBEAT_INTERVAL_S", SILENCE_S / 4)
    broker = make_broker(worker_silence_s=SILENCE_S)

    async def main(client: TrainerClient) -> tuple[str, str]:
        backplane = Backplane(broker.worker_endpoint)
        backplane.start()
        try:
            await backplane.open_turn(SID, "t0")
            await asyncio.sleep(3 * SILENCE_S)  # idle, yet heard: the turn stays in flight
            return backplane.worker_id, broker.server.registry.session(SID).owners["t0"]
        finally:
            await backplane.close()

    with TrainerClient(broker.control_endpoint, timeout=10) as client:
        client.open_session(session_id=SID)
        worker_id, owner = asyncio.run(main(client))
        assert client.stats()["turns_in_flight"] == 1
        assert wait_until(lambda: client.stats()["turns_worker_lost"] == 1, timeout=5)  # closed: silent from now on
    assert owner == worker_id


def test_a_worker_whose_event_loop_stalls_is_slow_not_dead(make_broker, monkeypatch):
    """A saturated worker's event loop may run seconds late; its heartbeats do not wait for it."""
    import asyncio

    from gateway_workers.capture import backplane as backplane_module
    from gateway_workers.capture.backplane import Backplane

    monkeypatch.setattr(backplane_module, "HEARTBEAT_INTERVAL_S", SILENCE_S / 4)
    broker = make_broker(worker_silence_s=SILENCE_S)

    async def main() -> int:
        backplane = Backplane(broker.worker_endpoint)
        backplane.start()
        try:
            await backplane.open_turn(SID, "t0")
            time.sleep(5 * SILENCE_S)  # the loop runs nothing meanwhile
            return broker.server.registry.counters["turns_worker_lost"]
        finally:
            await backplane.close()

    with TrainerClient(broker.control_endpoint, timeout=10) as client:
        client.open_session(session_id=SID)
        assert asyncio.run(main()) == 0
        assert client.stats()["turns_in_flight"] == 1


def test_a_worker_whose_heartbeats_fail_starts_them_again(make_broker, monkeypatch, caplog):
    """A failure inside the heartbeat thread is logged and the beats start over: the broker keeps the worker."""
    import asyncio

    from gateway_workers.capture import backplane as backplane_module
    from gateway_workers.capture import heartbeat as heartbeat_module
    from gateway_workers.capture.backplane import Backplane

    monkeypatch.setattr(backplane_module, "HEARTBEAT_INTERVAL_S", SILENCE_S / 4)
    monkeypatch.setattr(heartbeat_module, "RESTART_DELAY_S", SILENCE_S / 4)
    failures = [RuntimeError("a bug in the beat")]
    beat = heartbeat_module.HeartbeatThread._beat

    def failing_once(self: heartbeat_module.HeartbeatThread) -> bytes:
        if failures:
            raise failures.pop()
        return beat(self)

    monkeypatch.setattr(heartbeat_module.HeartbeatThread, "_beat", failing_once)
    broker = make_broker(worker_silence_s=SILENCE_S)

    async def main() -> tuple[int, int]:
        backplane = Backplane(broker.worker_endpoint)
        backplane.start()
        try:
            await backplane.open_turn(SID, "t0")
            await asyncio.sleep(5 * SILENCE_S)
            assert backplane._heartbeats is not None
            return broker.server.registry.counters["turns_worker_lost"], backplane._heartbeats.restarts
        finally:
            await backplane.close()

    with TrainerClient(broker.control_endpoint, timeout=10) as client:
        client.open_session(session_id=SID)
        with caplog.at_level(logging.ERROR, logger=heartbeat_module.__name__):
            lost, restarts = asyncio.run(main())
        assert (failures, restarts, lost) == ([], 1, 0)
        assert client.stats()["turns_in_flight"] == 1
    assert "heartbeats to the broker at" in caplog.text and "a bug in the beat" in caplog.text
