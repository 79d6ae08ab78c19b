"""A real `python -m broker --state-dir` killed with SIGKILL and restarted, with and without a state directory.

Under a load of delta commits from raw-protocol workers that retry until ACKed (as gateway workers
do), request finishes and a subscriber acknowledging episodes, the broker is killed -9 at random
moments and restarted on the same endpoints: every ACKed commit is there exactly once (the rows of
each session equal a no-crash broker's rows for the same turns), every request-finished episode
reaches the subscriber, and an episode comes twice only when its ack was lost in a crash (then
marked redelivered). Also: a torn last record (a crash in the middle of an append) is dropped with a
log line; damage in the middle refuses to start, naming the file and offset; one broker per state
directory; an in-memory broker restarted with `--restarted` says the earlier sessions were lost.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import zmq
from component.peers import SyntheticTurn, conversation
from processes import TestProcess, start_broker

from broker import protocol
from broker.durability import wal
from gateway_workers.capture.commit_bases import CommitBases
from trainer_client import BrokerTimeout, DuplicateSession, EpisodeTimeout, SessionClosed, TrainerClient, UnknownSession

pytestmark = pytest.mark.timeout(300)

ATTEMPT_S = 1.0  # one attempt's wait for a reply; a restarting broker takes a few of them
LOAD_DEADLINE_S = 120.0
SESSIONS = 24
TURNS = 8
KILLS = 3
TURN_PAUSE_S = 0.05  # an agent's think time: the load outlasts the kills


def key(i: int) -> str:
    return f"durable-process-session-{i:03d}-xxxxxxxx"


class RetryingWorker:
    """A worker's side of the backplane that outlives broker restarts: every request is retried, with a fresh
    id per attempt, until its reply comes (a stale reply to an earlier attempt is dropped), as the gateway's
    backplane retries commits until ACKed."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.ids = itertools.count(1)
        self.bases = CommitBases()

    def request(self, build: Any, deadline: float) -> protocol.Message:
        while time.monotonic() < deadline:
            rid = next(self.ids)
            self.sock.send(protocol.encode(build(rid)))
            wait_until = time.monotonic() + ATTEMPT_S
            while (left := wait_until - time.monotonic()) > 0 and self.sock.poll(int(left * 1000) + 1):
                reply = protocol.decode_broker_to_worker(self.sock.recv())
                if reply.request_id == rid:
                    return reply
        raise AssertionError("no reply before the load's deadline")

    def run_turn(self, sid: str, k: int, turn: SyntheticTurn, deadline: float) -> None:
        tid = f"t{k}"
        opened = self.request(lambda rid: protocol.OpenTurn(rid, sid, tid), deadline)
        assert isinstance(opened, protocol.TurnOpened), opened
        full = protocol.CommitTurn(
            0, sid, tid, turn.prompt_ids, turn.output_ids, turn.logprobs, "stop", turn.prompt_messages,
            turn.response_message,
        )  # fmt: skip
        delta, crc = self.bases.delta_and_crc(full)
        sent = delta or full
        reply = self.request(lambda rid: _with_id(sent, rid), deadline)
        if isinstance(reply, protocol.Refused) and reply.code == "unknown_base":
            sent, crc = full, None
            reply = self.request(lambda rid: _with_id(full, rid), deadline)
        assert isinstance(reply, protocol.TurnCommitted) and reply.outcome in ("stored", "duplicate"), reply
        self.bases.remember(full, crc if sent is not full else None)

    def close(self) -> None:
        self.sock.close(linger=0)


def _with_id(msg: protocol.CommitTurn, rid: int) -> protocol.CommitTurn:
    return dataclasses.replace(msg, request_id=rid)


def retried(call: Any, deadline: float) -> Any:
    """A trainer call retried through broker restarts (BrokerTimeout), until `deadline`."""
    while True:
        try:
            return call()
        except BrokerTimeout:
            if time.monotonic() > deadline:
                raise


class Broker:
    """The broker under test: one state directory, restarted on the same endpoints after each kill."""

    def __init__(self, state_dir: Path, *extra: str) -> None:
        self.extra = ("--state-dir", str(state_dir), *extra)
        self.proc, self.worker, self.control = start_broker(*self.extra)
        self.outputs: list[str] = []

    def kill_and_restart(self) -> TestProcess:
        self.proc.kill()
        self.proc.wait(10)
        self.outputs.append(self.proc.output)
        self.proc, _, _ = start_broker(*self.extra, worker=self.worker, control=self.control)
        return self.proc


def no_crash_rows(turns_by_session: dict[str, list[SyntheticTurn]], ctx: zmq.Context) -> dict[str, list[Any]]:
    """The same sessions' rows from an in-memory broker that never crashed."""
    proc, worker_ep, control_ep = start_broker()
    with proc, TrainerClient(control_ep, timeout=30) as client:
        worker = RetryingWorker(ctx, worker_ep)
        try:
            deadline = time.monotonic() + LOAD_DEADLINE_S
            out = {}
            for sid, turns in turns_by_session.items():
                client.open_session(session_id=sid, metadata={"s": sid})
                for k, turn in enumerate(turns):
                    worker.run_turn(sid, k, turn, deadline)
                out[sid] = client.finish_session(sid, reward=1.0, rollout_id=sid)
            return out
        finally:
            worker.close()


def test_kill_9_under_load_loses_no_acknowledged_turn_or_episode_and_duplicates_none(tmp_path):
    ctx = zmq.Context()
    broker = Broker(tmp_path / "state", "--fsync", "interval")
    rng = random.Random(22)
    turns = {key(i): conversation(500 + i, TURNS) for i in range(SESSIONS)}
    finished_by_request = {key(i) for i in range(SESSIONS) if i % 2 == 0}
    deadline = time.monotonic() + LOAD_DEADLINE_S
    failures: list[BaseException] = []
    deliveries: list[tuple[str, bool]] = []
    ended: list[float] = []  # when each agents' thread was done
    killed: list[float] = []
    stop = threading.Event()
    try:
        with TrainerClient(broker.control, timeout=ATTEMPT_S) as client:

            def agents(sids: list[str]) -> None:
                worker = RetryingWorker(ctx, broker.worker)
                try:
                    for sid in sids:  # one episode after the other, as one agent runs them
                        try:
                            retried(lambda s=sid: client.open_session(session_id=s, metadata={"s": s}), deadline)
                        except DuplicateSession:
                            pass  # an earlier attempt registered it before the broker went down
                        for k in range(TURNS):
                            worker.run_turn(sid, k, turns[sid][k], deadline)
                            time.sleep(TURN_PAUSE_S)
                        if sid in finished_by_request:
                            try:
                                retried(lambda s=sid: client.request_finish(s, reward=1.0, rollout_id=s), deadline)
                            except SessionClosed:
                                pass  # accepted before the broker went down: its episode is promised
                except BaseException as e:
                    failures.append(e)
                finally:
                    ended.append(time.monotonic())
                    worker.close()

            def subscriber() -> None:
                try:
                    with client.episodes(timeout=0.5, lease=30.0) as stream:
                        while not stop.is_set():
                            try:
                                episode = next(stream)
                            except (EpisodeTimeout, BrokerTimeout):
                                continue
                            deliveries.append((episode.session_id, episode.redelivered))
                except BaseException as e:
                    failures.append(e)

            sids = sorted(turns)
            threads = [threading.Thread(target=agents, args=(sids[i::3],)) for i in range(3)]
            threads.append(threading.Thread(target=subscriber))
            for t in threads:
                t.start()
            for _ in range(KILLS):  # at random moments of the load
                time.sleep(rng.uniform(0.2, 0.8))
                killed.append(time.monotonic())
                broker.kill_and_restart()
            for t in threads[:3]:
                t.join(LOAD_DEADLINE_S)
            assert not any(t.is_alive() for t in threads[:3]), "the load did not finish"
            # the kills did land in the middle of the load: every agent was still at work at each of them
            assert max(killed) < min(ended), (killed, ended)
            got_all = time.monotonic() + 30
            while {s for s, _ in deliveries} != finished_by_request and time.monotonic() < got_all:
                time.sleep(0.05)
            broker.kill_and_restart()  # once more, with the subscriber's last acks possibly in flight
            time.sleep(1.0)
            stop.set()
            threads[3].join(30)
            assert not failures, failures
            # every request-finished episode arrived, once: the stream retries its acks through restarts, and
            # the restarted broker (same epoch, leases restored) applies them
            assert Counter(s for s, _ in deliveries) == Counter(finished_by_request)
            stats = retried(client.stats, deadline)
            assert stats["sessions_open"] == SESSIONS - len(finished_by_request)
            assert stats["outbox_episodes"] == 0  # every delivered episode's ack was applied in the end
            rows = {sid: retried(lambda s=sid: client.finish_session(s, reward=1.0, rollout_id=s), deadline)
                    for sid in sids if sid not in finished_by_request}  # fmt: skip
        expected = no_crash_rows({sid: turns[sid] for sid in rows}, ctx)
        for sid, records in rows.items():
            assert records == expected[sid], sid  # the same rows as a broker that never crashed
        output = "\n".join([*broker.outputs, broker.proc.output])
        assert output.count("recovered from") >= KILLS + 1
    except BaseException:
        for text in broker.outputs:
            print(text)
        raise
    finally:
        stop.set()
        broker.proc.stop()
        ctx.destroy(linger=0)


def test_a_torn_last_record_from_a_crash_mid_append_is_dropped(tmp_path):
    ctx = zmq.Context()
    state = tmp_path / "state"
    broker = Broker(state, "--fsync", "always")
    turns = conversation(7, 3)
    sid = key(1)
    try:
        with TrainerClient(broker.control, timeout=10) as client:
            client.open_session(session_id=sid)
            worker = RetryingWorker(ctx, broker.worker)
            deadline = time.monotonic() + 30
            for k, turn in enumerate(turns):
                worker.run_turn(sid, k, turn, deadline)
            worker.close()
            broker.proc.kill()
            broker.proc.wait(10)
            # what a kill in the middle of an append leaves: the start of a record, the rest never written
            last = wal.segment_path(state, wal.list_segments(state)[-1])
            record = bytearray()
            wal.append_record(record, 1, protocol.encode(protocol.OpenTurn(1, sid, "t-torn")))
            with open(last, "ab") as f:
                f.write(record[: len(record) // 2])
            broker.proc, _, _ = start_broker(*broker.extra, worker=broker.worker, control=broker.control)
            assert f"the last log record was torn by the crash and is dropped: {last.name}" in broker.proc.output
            assert client.stats()["turns_in_flight"] == 0  # the torn OpenTurn was never acknowledged
            records = client.finish_session(sid)
        assert len(records) == 1 and sum(records[0].loss_mask) == sum(len(t.output_ids) for t in turns)
    finally:
        broker.proc.stop()
        ctx.destroy(linger=0)


def test_damage_in_the_middle_of_the_log_refuses_to_start_naming_file_and_offset(tmp_path):
    state = tmp_path / "state"
    broker = Broker(state)
    with TrainerClient(broker.control, timeout=10) as client:
        for i in range(5):
            client.open_session(session_id=key(i))
    broker.proc.kill()
    broker.proc.wait(10)
    segment = wal.segment_path(state, wal.list_segments(state)[-1])
    data = bytearray(segment.read_bytes())
    offsets = [off for off, _, _ in wal.SegmentReader(segment, tail=True)]
    data[offsets[2] + wal.HEADER_BYTES + 3] ^= 0xFF  # inside the third record: two more follow it
    segment.write_bytes(bytes(data))
    args = ["-m", "broker", "--worker-endpoint", "tcp://127.0.0.1:0", "--control", "tcp://127.0.0.1:0"]
    with TestProcess([sys.executable, *args, "--state-dir", str(state)]) as p:
        assert p.wait(30) == 1
        p.expect(rf"{segment}: corrupt record at offset {offsets[2]}", 1)
    # told to, it keeps what precedes the damage and starts
    proc, _, control = start_broker(*broker.extra, env={"ROLLOUT_BROKER_WAL_TRUNCATE_CORRUPT": "1"})
    with proc, TrainerClient(control, timeout=10) as client:
        assert client.stats()["sessions_open"] == 2


def test_one_broker_per_state_directory(tmp_path):
    broker = Broker(tmp_path / "state")
    with broker.proc:
        args = ["-m", "broker", "--worker-endpoint", "tcp://127.0.0.1:0", "--control", "tcp://127.0.0.1:0"]
        with TestProcess([sys.executable, *args, *broker.extra]) as second:
            assert second.wait(30) == 1
            second.expect("is in use by another broker", 1)


@pytest.mark.parametrize("restarted", [True, False])
def test_without_a_state_dir_a_restarted_broker_says_earlier_sessions_were_lost(restarted):
    proc, worker_ep, control_ep = start_broker()
    with TrainerClient(control_ep, timeout=5) as client:
        try:
            sid = client.open_session()
            proc.kill()
            proc.wait(10)
            extra = ("--restarted",) if restarted else ()
            proc, _, _ = start_broker(*extra, worker=worker_ep, control=control_ep)
            with pytest.raises(UnknownSession) as e:
                retried(lambda: client.finish_session(sid), time.monotonic() + 30)
            said = "restarted without a state directory (--state-dir)" in str(e.value)
            assert said == restarted, str(e.value)
        finally:
            proc.stop()
