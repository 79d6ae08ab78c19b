"""A durable broker's loop over real sockets: snapshots while serving, and a log that cannot be written.

A real `BrokerServer` with a state directory runs in a thread on port-0 sockets. With small snapshot
bounds, commits from a raw worker peer make it write snapshots as it serves; older segments go, and a
second server on the directory recovers every turn (and the policy version) from the snapshot plus the
log after it. When the
log cannot be written (its descriptor pulled from under it), the broker acknowledges nothing more:
the commit gets no ACK and the loop ends with `LogFailure`, and what the directory holds is what had
been acknowledged.
"""

from __future__ import annotations

import os
import threading

import pytest
from component.peers import PeerTimeout, WorkerPeer, assert_linear_rows, conversation

from broker import protocol
from broker.config import BrokerConfig
from broker.durability import snapshots, wal
from broker.durability.store import LogFailure
from broker.server import BrokerServer
from trainer_client import TrainerClient

STOP_TIMEOUT_S = 10.0


class ServedBroker:
    """A durable BrokerServer serving in a thread; `error` holds what ended its loop, if anything did."""

    def __init__(self, state_dir, **overrides) -> None:
        config = BrokerConfig(
            worker_endpoint="tcp://127.0.0.1:0", control_endpoint="tcp://127.0.0.1:0", shutdown_linger_ms=0,
            state_dir=str(state_dir), **overrides,
        )  # fmt: skip
        self.server = BrokerServer(config)
        self.server.open_state()
        self.worker_endpoint, self.control_endpoint = self.server.bind()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.server.run()
        except BaseException as e:  # reported to the test
            self.error = e

    def stop(self) -> None:
        self.server.request_exit()
        self.thread.join(STOP_TIMEOUT_S)
        assert not self.thread.is_alive()


def test_snapshots_are_written_while_serving_and_a_restart_loads_them(tmp_path, zctx):
    small = {"snapshot_min_bytes": 64 * 1024, "snapshot_max_bytes": 64 * 1024, "wal_segment_bytes": 256 * 1024}
    broker = ServedBroker(tmp_path, **small)
    sessions = {f"served-session-key-{i:02d}-xxxx": conversation(40 + i, 8, first_prompt=400) for i in range(6)}
    try:
        with TrainerClient(broker.control_endpoint, timeout=10) as client:
            assert client.set_weight_version(7) == -1  # logged in the first segment, which a snapshot replaces
            assert client.pause_generation("wait", timeout=1).workers == 0  # so is the pause (no worker: idle)
            worker = WorkerPeer(zctx, broker.worker_endpoint)
            for sid in sessions:
                client.open_session(session_id=sid)
            for k in range(8):
                for sid, turns in sessions.items():
                    assert isinstance(worker.open_turn(sid, f"t{k}"), protocol.TurnOpened)
                    assert worker.commit(sid, f"t{k}", turns[k]).outcome == "stored"
            worker.close()
            stats = client.stats()
        assert stats["snapshots_written"] >= 2 and stats["wal_bytes_written"] > 2 * small["snapshot_max_bytes"]
    finally:
        broker.stop()
    assert broker.error is None
    kept = snapshots.list_snapshots(tmp_path)
    assert len(kept) == 1  # older snapshots and the segments before the newest one are gone
    assert min(wal.list_segments(tmp_path)) >= kept[0]
    again = ServedBroker(tmp_path, **small)
    try:
        assert again.server.durable is not None and again.server.durable.recovered is not None
        assert again.server.durable.recovered.snapshot_bytes > 0
        with TrainerClient(again.control_endpoint, timeout=10) as client:
            assert client.stats()["weight_version"] == 7  # from the snapshot: the segment that logged it is gone
            assert client.generation_paused() == "wait" and client.resume_generation() is True
            for sid, turns in sessions.items():
                assert_linear_rows(client.finish_session(sid), turns)
    finally:
        again.stop()


def test_a_log_that_cannot_be_written_stops_the_broker_without_acknowledging(tmp_path, zctx):
    broker = ServedBroker(tmp_path, fsync="always")
    sid = "unwritable-session-key-xxxx"
    turns = conversation(9, 2)
    with TrainerClient(broker.control_endpoint, timeout=10) as client:
        client.open_session(session_id=sid)
    worker = WorkerPeer(zctx, broker.worker_endpoint)
    try:
        worker.open_turn(sid, "t0")
        assert worker.commit(sid, "t0", turns[0]).outcome == "stored"
        worker.open_turn(sid, "t1")
        assert broker.server.durable is not None and broker.server.durable.writer is not None
        # The disk refuses writes from now on: the log's descriptor becomes a read-only one (its number stays taken).
        read_only = os.open(os.devnull, os.O_RDONLY)
        os.dup2(read_only, broker.server.durable.writer._fd)
        os.close(read_only)
        with pytest.raises(PeerTimeout):
            worker.request(worker.commit_msg(sid, "t1", turns[1]), 2.0)
        broker.thread.join(STOP_TIMEOUT_S)
        assert not broker.thread.is_alive() and isinstance(broker.error, LogFailure)
    finally:
        worker.close()
        broker.server.close()
    again = ServedBroker(tmp_path)  # the stopped broker let go of the directory
    try:
        with TrainerClient(again.control_endpoint, timeout=10) as client:
            stats = client.stats()
            assert (stats["turns_held"], stats["turns_in_flight"]) == (1, 1)  # t0 stored, t1 opened, never ACKed
    finally:
        again.stop()
