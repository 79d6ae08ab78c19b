"""A retried request finds its recorded turn across a durable broker's restart.

The request digest travels in the OPEN a durable broker logs, so a broker restarted on the same state
directory still answers a retry of a committed request with that turn (`TurnReplayed`: same turn id,
same ids) and still holds a retry of a turn left in flight as pending.
"""

from __future__ import annotations

from component.peers import WorkerPeer, conversation
from component.test_durable_loop import ServedBroker

from broker import protocol
from trainer_client import TrainerClient

SID = "durable-retry-session-key-xxxx"


def test_a_retry_after_a_restart_replays_the_recorded_turn(tmp_path, zctx):
    (turn,) = conversation(21, 1)
    first = ServedBroker(tmp_path)
    worker = WorkerPeer(zctx, first.worker_endpoint)
    try:
        with TrainerClient(first.control_endpoint, timeout=10) as client:
            client.open_session(session_id=SID)
        assert isinstance(worker.request(protocol.OpenTurn(worker.next_id(), SID, "t0", "w", "d0")),
                          protocol.TurnOpened)
        assert worker.commit(SID, "t0", turn).outcome == "stored"
        assert isinstance(worker.request(protocol.OpenTurn(worker.next_id(), SID, "t1", "w", "d1")),
                          protocol.TurnOpened)  # left in flight
    finally:
        worker.close()
        first.stop()
    second = ServedBroker(tmp_path)
    worker = WorkerPeer(zctx, second.worker_endpoint)
    try:
        replayed = worker.request(protocol.OpenTurn(worker.next_id(), SID, "t2", "w", "d0", True))
        pending = worker.request(protocol.OpenTurn(worker.next_id(), SID, "t3", "w", "d1", True))
    finally:
        worker.close()
        second.stop()
    assert isinstance(replayed, protocol.TurnReplayed) and replayed.turn_id == "t0"
    assert replayed.prompt_ids == turn.prompt_ids and replayed.output_ids == turn.output_ids
    assert isinstance(pending, protocol.Refused) and pending.code == "turn_pending"
