"""A durable broker's state survives a crash exactly: random operations, crashes at random points, recovery.

A real `BrokerServer` with a state directory (bound on port 0, so its parked replies have sockets to
go to) is driven through its own dispatcher (`broker.dispatch`), frame by frame, committing the log
after each frame as its loop does before replying; `durable.tick()` writes snapshots a single object
per step, so images of one snapshot are taken at different log positions while the state moves on.
A "crash" drops the server without writing anything more (its descriptors closed as a kill -9 closes
them), sometimes with a torn half-record at the end of the log; a fresh server then recovers from the
directory, and its state (sessions with every committed turn, in-flight and aborted turns, the
RequestFinishes still draining, the outbox's episodes with their holders and flags, the finished-session
memory, the delivery epoch and ids) must equal the state before the crash. Commits are deltas against
the worker's last ACKed turn (the worker's own `CommitBases`), across crashes too.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from component.peers import conversation
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker import protocol
from broker.config import BrokerConfig
from broker.durability import store, wal
from broker.server import BrokerServer
from gateway_workers.capture.commit_bases import CommitBases

SLOTS = 4
TURNS = 6
LEASE = 30.0
KEYS = [f"durable-session-key-{i}-{'k' * 8}" for i in range(SLOTS)]


def state_of(server: BrokerServer) -> dict[str, Any]:
    """Everything a restart must bring back, in a comparable form."""
    reg, fin, ob = server.registry, server.finishes, server.outbox
    sessions = {}
    for sid in reg.session_ids():
        s = reg.session(sid)
        assert s is not None
        pending = fin.pending_request(sid)
        # A FinishSession's close is not durable on purpose: its trainer retries and gets the rows.
        sessions[sid] = {
            "settings": (s.sampling_defaults, s.max_context_tokens, s.max_turns, s.metadata, s.client_id, s.group),
            "closing_by": s.finished_by if pending is not None else None,
            "pending": None if pending is None else (pending.reward, pending.rollout_id, pending.wait_timeout),
            "next_seq": s.next_seq,
            "in_flight": dict(s.in_flight),
            "aborted": set(s.aborted),
            "turns": [dataclasses.astuple(r) for r in s.committed.records()],
        }
    episodes = {}
    for d in ob.delivery_ids():
        held = ob.entry(d)
        assert held is not None
        episode, client_id, holder, lease, redelivered = held
        episodes[d] = (episode, client_id, holder, lease if holder else None, redelivered)
    return {
        "sessions": sessions,
        "episodes": episodes,
        "finished": reg.finished_items(),
        "epoch": ob.epoch,
        "next_delivery_id": ob.next_delivery_id,
        "reserved": ob.stats()["outbox_reserved"],
    }


def assert_same_state(after: dict[str, Any], before: dict[str, Any]) -> None:
    """`after == before`, failing with the first part that differs (a whole state is too long to read)."""
    for key in before:
        if key in ("sessions", "episodes"):
            assert set(after[key]) == set(before[key]), (key, set(after[key]) ^ set(before[key]))
            for item in before[key]:
                assert after[key][item] == before[key][item], (key, item)
        else:
            assert after[key] == before[key], (key, after[key], before[key])


class Harness:
    """One broker process's life, in-process: frames through the dispatcher, the log committed per frame."""

    def __init__(self, state_dir: Path) -> None:
        config = BrokerConfig(
            worker_endpoint="tcp://127.0.0.1:0",
            control_endpoint="tcp://127.0.0.1:0",
            shutdown_linger_ms=0,
            state_dir=str(state_dir),
            fsync="never",
            snapshot_min_bytes=1,  # every tick begins or steps a snapshot
            snapshot_max_bytes=1,
            compact_age_s=0.0,  # compaction may run between frames (it must not change what is stored)
            compact_min_bytes=0,
        )
        self.server = BrokerServer(config)
        self.server.open_state()
        self.server.bind()
        self.rid = 0

    def _call(self, msg: protocol.Message, side: str) -> Any:
        decode = protocol.decode_worker_to_broker if side == "worker" else protocol.decode_trainer_to_broker
        reply = self.server._dispatch.handle([b"peer"], protocol.encode(msg), decode, side)  # type: ignore[arg-type]
        self.server.durable.commit()  # type: ignore[union-attr]  # what the loop does before it sends the reply
        return reply

    def worker(self, msg: protocol.Message) -> Any:
        return self._call(msg, "worker")

    def trainer(self, msg: protocol.Message) -> Any:
        return self._call(msg, "trainer")

    def next_id(self) -> int:
        self.rid += 1
        return self.rid

    def expire(self) -> None:
        """What the loop does once the deadlines of parked finishes and leases have passed."""
        later = time.monotonic() + 1e6
        for parked in (self.server.finishes, self.server.outbox):
            self.server._send_all(parked.expire(later))
        self.server.durable.commit()  # type: ignore[union-attr]  # the loop's pass ends with the log written

    def idle(self) -> None:
        """One idle loop pass: a snapshot step (one object), a compaction step."""
        assert self.server.durable is not None
        self.server.durable.tick()
        self.server.registry.compact_step()

    def crash(self, torn: bytes = b"") -> None:
        """Stop as kill -9 would: nothing more is written (the last commit already was), descriptors close."""
        durable = self.server.durable
        assert durable is not None and durable.writer is not None
        writer = durable.writer
        assert not writer.pending
        if torn:
            os.write(writer._fd, torn)
        os.close(writer._fd)
        writer._fd = -1
        if durable._snapshot is not None:  # its file stays half-written, as a kill leaves it
            durable._snapshot._file.stop()
            os.close(durable._snapshot._fd)
        durable._release_lock()
        self.server.close()


class Worker:
    """The test's agents and worker: each slot's conversation, its turns' states, the worker's commit bases."""

    def __init__(self) -> None:
        self.turns = {i: conversation(100 + i, TURNS) for i in range(SLOTS)}
        self.bases = CommitBases()

    def commit(self, h: Harness, sid: str, slot: int, k: int, delta: bool) -> Any:
        t = self.turns[slot][k]
        full = protocol.CommitTurn(
            h.next_id(), sid, f"t{k}", t.prompt_ids, t.output_ids, t.logprobs, "stop", t.prompt_messages,
            t.response_message, flags={"k": k} if k % 2 else {},
        )  # fmt: skip
        sent = full
        crc = None
        if delta:
            d, crc = self.bases.delta_and_crc(full, full.request_id)
            sent = d or full
        reply = self._decoded(h.worker(sent))
        if isinstance(reply, protocol.Refused) and reply.code == "unknown_base":
            sent, crc = full, None
            reply = self._decoded(h.worker(full))
        if isinstance(reply, protocol.TurnCommitted) and reply.outcome == "stored":
            self.bases.remember(full, crc if sent is not full else None)
        return reply

    @staticmethod
    def _decoded(reply: Any) -> Any:
        return protocol.decode_broker_to_worker(reply) if isinstance(reply, bytes) else reply


OPS = st.sampled_from(
    ["open", "open", "open_turn", "open_turn", "open_turn", "commit", "commit", "commit", "commit", "abort",
     "request_finish", "finish", "drop", "fetch", "fetch", "expire", "idle", "idle", "crash"]
)  # fmt: skip


def run_ops(data: st.DataObject, state_dir: Path, steps: int) -> None:
    h = Harness(state_dir)
    worker = Worker()
    subscribers: dict[str, set[int]] = {"sub-a": set(), "sub-b": set()}
    epoch = ""
    crashes = 0
    try:
        for _ in range(steps):
            op = data.draw(OPS)
            slot = data.draw(st.integers(0, SLOTS - 1))
            sid = KEYS[slot]
            k = data.draw(st.integers(0, TURNS - 1))
            session = h.server.registry.session(sid)
            if session is not None and op == "open_turn" and session.next_seq < TURNS:
                k = session.next_seq  # mostly the next turn, as an agent goes
            elif session is not None and op in ("commit", "abort") and session.in_flight:
                k = int(data.draw(st.sampled_from(sorted(session.in_flight)))[1:])  # a turn in flight
            if op == "open":
                h.trainer(protocol.OpenSession(h.next_id(), sid, {"t": slot}, 4096, None, {"m": slot}, "c1", "g"))
            elif op == "open_turn":
                h.worker(protocol.OpenTurn(h.next_id(), sid, f"t{k}"))
            elif op == "commit":
                worker.commit(h, sid, slot, k, delta=data.draw(st.booleans()))
            elif op == "abort":
                h.worker(protocol.AbortTurn(h.next_id(), sid, f"t{k}", "client_disconnect"))
            elif op == "request_finish":
                wait = data.draw(st.sampled_from([0.0, 5.0]))
                side = data.draw(st.sampled_from(["worker", "trainer"]))
                h._call(protocol.RequestFinish(h.next_id(), sid, 1.0, f"ep-{slot}", {"r": 1}, wait), side)
            elif op == "finish":
                wait = data.draw(st.sampled_from([0.0, 5.0]))
                h.trainer(protocol.FinishSession(h.next_id(), sid, 0.5, None, {}, wait))
            elif op == "drop":
                h.trainer(protocol.DropSession(h.next_id(), sid))
            elif op == "fetch":
                name = data.draw(st.sampled_from(sorted(subscribers)))
                held = subscribers[name]
                acks = sorted(d for d in held if data.draw(st.booleans()))
                keep = sorted(held - set(acks))
                credit = data.draw(st.integers(0, 2))
                reply = h.trainer(
                    protocol.FetchEpisodes(h.next_id(), name, epoch, credit, acks, keep, [], 0.0, LEASE, None, None)
                )
                assert isinstance(reply, protocol.EpisodesDelivered), reply
                epoch = reply.epoch
                subscribers[name] = (set(keep) - set(reply.revoked)) | {e.delivery_id for e in reply.episodes}
            elif op == "expire":
                h.expire()
            elif op == "idle":
                h.idle()
            elif op == "crash":
                before = state_of(h.server)
                torn = b""
                if data.draw(st.booleans()):  # a record cut short by the crash, at some byte
                    buf = bytearray()
                    wal.append_record(buf, 1, protocol.encode(protocol.OpenTurn(0, sid, "torn")))
                    torn = bytes(buf[: data.draw(st.integers(1, len(buf) - 1))])
                h.crash(torn)
                crashes += 1
                h = Harness(state_dir)
                assert_same_state(state_of(h.server), before)
        before = state_of(h.server)
        h.crash()
        after = Harness(state_dir)
        try:
            assert_same_state(state_of(after.server), before)
        finally:
            after.crash()
    except BaseException:
        h.server.close()
        raise


@pytest.fixture(autouse=True)
def one_object_per_snapshot_step(monkeypatch):
    monkeypatch.setattr(store, "SNAPSHOT_STEP_BYTES", 1)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_random_operations_and_crashes_recover_the_exact_state(data):
    with tempfile.TemporaryDirectory() as d:
        run_ops(data, Path(d), steps=160)


def test_a_long_history_with_snapshots_between_crashes(tmp_path):
    """A fixed, longer run: sessions live across several snapshots and restarts, then finish with their rows."""
    h = Harness(tmp_path)
    worker = Worker()
    for slot in range(SLOTS):
        h.trainer(protocol.OpenSession(h.next_id(), KEYS[slot], {}, None, None, {}, "", None))
    for k in range(TURNS):
        for slot in range(SLOTS):
            h.worker(protocol.OpenTurn(h.next_id(), KEYS[slot], f"t{k}"))
            assert worker.commit(h, KEYS[slot], slot, k, delta=True).outcome == "stored"
            h.idle()
        before = state_of(h.server)
        h.crash()
        h = Harness(tmp_path)
        assert_same_state(state_of(h.server), before)
    assert h.server.durable is not None and h.server.durable.recovered is not None
    assert h.server.durable.recovered.skipped > 0  # images taken mid-log: their records before them were skipped
    for slot in range(SLOTS):
        reply = h.trainer(protocol.FinishSession(h.next_id(), KEYS[slot], 1.0, None, {}, 0.0))
        assert isinstance(reply, protocol.SessionFinished) and reply.turns_committed == TURNS
        rows = reply.rows
        assert len(rows) == 1 and sum(rows[0].loss_mask) == TURNS * len(worker.turns[slot][0].output_ids)
    h.crash()
