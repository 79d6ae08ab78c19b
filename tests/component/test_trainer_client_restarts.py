"""TrainerClient calls in flight when the broker crashes: resent when a repeat is safe, else `BrokerDisconnected`.

A real `python -m broker` (ephemeral ports, with and without a state directory) is killed with SIGKILL and
restarted on the same endpoints while a call waits. To have a quick call in flight at the crash, the broker
is first stopped (SIGSTOP): the request waits in its socket until the kill. Every call returns or raises
promptly, never after its timeout: `stats`, `drop_session`, `open_session` with a chosen key and
`finish_session` and `request_finish` are resent and answered by the new broker; `open_session` without a
key raises `BrokerDisconnected` at once. A FinishSession whose reply was lost after its rows were built
gets the same rows when repeated with its request id, and an accepted RequestFinish is accepted again,
from a broker that is still up or from a restarted durable one (the log, or a snapshot taken since),
never a second finish. Broker-side parts run
against the in-thread broker of conftest.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from assets import wait_until
from component.peers import TrainerPeer, WorkerPeer, conversation
from processes import TestProcess, start_broker

from broker import protocol
from trainer_client import BrokerDisconnected, BrokerTimeout, EpisodeTimeout, TrainerClient, UnknownSession

CALL_TIMEOUT_S = 30.0
# A call that rides through a restart returns within this: the broker's start-up and one reconnect, far from
# the call's timeout.
PROMPT_S = 12.0
# The request only has to leave this process: it then waits in the stopped broker's socket.
REQUEST_OUT_S = 0.3
KEY = "restart-component-session-xxxxxxxxxx"


class RestartingBroker:
    """A real broker process, stopped, killed and restarted on the same endpoints (and state directory)."""

    def __init__(self, state_dir: Path | None, env: dict[str, str] | None = None) -> None:
        self.extra = ("--state-dir", str(state_dir)) if state_dir is not None else ()
        self.env = env
        self.proc, self.worker, self.control = start_broker(*self.extra, env=env)
        self.outputs: list[str] = []

    def kill_and_restart(self) -> TestProcess:
        self.proc.kill()
        self.proc.wait(10)
        self.outputs.append(self.proc.output)
        restarted = self.extra or ("--restarted",)  # as serve's supervisor says it
        self.proc, _, _ = start_broker(*restarted, worker=self.worker, control=self.control, env=self.env)
        return self.proc

    def through_a_crash(self, call: Callable[[], Any]) -> dict[str, Any]:
        """Run `call` while the broker is stopped, then kill and restart it: {"value" or "error", "seconds"}."""
        self.proc.signal(signal.SIGSTOP)
        outcome: dict[str, Any] = {}

        def run() -> None:
            t0 = time.monotonic()
            try:
                outcome["value"] = call()
            except Exception as e:
                outcome["error"] = e
            outcome["seconds"] = time.monotonic() - t0

        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(REQUEST_OUT_S)
        self.kill_and_restart()
        thread.join(CALL_TIMEOUT_S + 10)
        assert not thread.is_alive(), "the call hung"
        return outcome

    def stop(self) -> None:
        self.proc.stop()


@pytest.fixture(params=["in_memory", "durable"])
def restarting(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RestartingBroker]:
    broker = RestartingBroker(tmp_path / "state" if request.param == "durable" else None)
    yield broker
    broker.stop()


@pytest.fixture
def trainer(restarting: RestartingBroker) -> Iterator[TrainerClient]:
    with TrainerClient(restarting.control, timeout=CALL_TIMEOUT_S) as client:
        # Its socket connected: a request made while a connection is still in its handshake is not on its way
        # yet (it waits in the socket for the next connection), so a crash then would cost it nothing.
        client.stats()
        yield client


# --- a real broker process, killed -9 --------------------------------------------------------------


def resent(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The requests the client said it resent."""
    return [r.getMessage().split(" ")[1] for r in caplog.records if r.getMessage().startswith("resending ")]


def test_stats_and_drop_session_in_flight_at_a_crash_are_resent(restarting, trainer, caplog):
    caplog.set_level(logging.INFO, logger="trainer_client.control_socket")
    sid = trainer.open_session(session_id=KEY)
    stats = restarting.through_a_crash(trainer.stats)
    assert "error" not in stats, stats
    assert stats["value"]["uptime_s"] < PROMPT_S and stats["seconds"] < PROMPT_S  # the new broker answered
    dropped = restarting.through_a_crash(lambda: trainer.drop_session(sid))
    assert "error" not in dropped and dropped["seconds"] < PROMPT_S, dropped
    assert dropped["value"] is bool(restarting.extra)  # a durable broker still had it; an in-memory one lost it
    assert resent(caplog) == ["get_stats", "drop_session"]  # each was on its way when the broker died


def test_an_open_with_a_chosen_key_is_resent_and_a_key_open_by_then_is_returned(restarting, trainer, caplog):
    caplog.set_level(logging.INFO, logger="trainer_client.control_socket")
    opened = restarting.through_a_crash(lambda: trainer.open_session(session_id=KEY))
    assert opened.get("value") == KEY and opened["seconds"] < PROMPT_S, opened
    assert trainer.finish_session(KEY) == []  # it is open on the new broker
    # the resend finds the key open (as when the first attempt got there before the crash): it is ours
    with zmq.Context() as ctx:
        peer = TrainerPeer(ctx, restarting.control)
        try:
            peer.request(protocol.OpenSession(peer.next_id(), KEY + "-2", {}, None, None))
        finally:
            peer.close()
    again = restarting.through_a_crash(lambda: trainer.open_session(session_id=KEY + "-2"))
    assert again.get("value") == KEY + "-2", again
    assert resent(caplog) == ["open_session", "open_session"]


def test_a_minted_open_in_flight_at_a_crash_raises_broker_disconnected(restarting, trainer):
    minted = restarting.through_a_crash(trainer.open_session)
    assert isinstance(minted.get("error"), BrokerDisconnected), minted
    assert isinstance(minted["error"], BrokerTimeout)  # callers that retry on timeouts retry this too
    assert minted["seconds"] < PROMPT_S


def test_a_request_finish_in_flight_at_a_crash_is_resent(restarting, trainer, caplog):
    caplog.set_level(logging.INFO, logger="trainer_client.control_socket")
    sid = trainer.open_session(session_id=KEY)
    finish = restarting.through_a_crash(lambda: trainer.request_finish(sid, reward=1.0))
    assert finish["seconds"] < PROMPT_S and resent(caplog) == ["request_finish"], finish
    if restarting.extra:  # the durable broker still had the session: the resend finished it, once
        assert finish.get("value") is None and "error" not in finish, finish
        with trainer.episodes(timeout=10) as stream:
            episode = next(stream)
        assert episode.session_id == sid and episode.reward == 1.0
    else:
        error = finish["error"]
        assert isinstance(error, UnknownSession) and "restarted without a state directory" in str(error)


def test_a_finish_draining_at_a_crash_is_resent(restarting, trainer):
    durable = bool(restarting.extra)
    turns = conversation(3, 2)
    with zmq.Context() as ctx:
        worker = WorkerPeer(ctx, restarting.worker)
        try:
            sid = trainer.open_session(session_id=KEY)
            worker.open_turn(sid, "t0")
            worker.commit(sid, "t0", turns[0])
            worker.open_turn(sid, "t1")  # in flight: the finish waits for it
            outcome: dict[str, Any] = {}

            def finish() -> None:
                t0 = time.monotonic()
                try:
                    outcome["rows"] = trainer.finish_session(sid, reward=1.0, wait_timeout=20.0)
                except Exception as e:
                    outcome["error"] = e
                outcome["seconds"] = time.monotonic() - t0

            thread = threading.Thread(target=finish)
            thread.start()
            assert wait_until(lambda: trainer.stats()["finishes_parked"] == 1, timeout=10)
            restarting.kill_and_restart()
            if durable:  # the worker's commit of the in-flight turn lands on the restarted broker
                committed = worker.request(worker.commit_msg(sid, "t1", turns[1]), timeout=20)
                assert isinstance(committed, protocol.TurnCommitted), committed
            thread.join(CALL_TIMEOUT_S + 30)
            assert not thread.is_alive()
        finally:
            worker.close()
    assert outcome["seconds"] < PROMPT_S, outcome
    if durable:  # the recovered session was finished by the resend, with both turns
        rows = outcome["rows"]
        assert sum(len(r.metadata["turn_ids"]) for r in rows) == 2
    else:  # the in-memory broker lost the session, and says so
        error = outcome["error"]
        assert isinstance(error, UnknownSession) and "restarted without a state directory" in str(error)


def _finished_with_lost_reply(broker_control: str, sid: str, rid: int) -> protocol.SessionFinished:
    """A FinishSession sent raw, its reply taken as if it never arrived (the rows were built and sent)."""
    with zmq.Context() as ctx:
        peer = TrainerPeer(ctx, broker_control)
        try:
            reply = peer.request(protocol.FinishSession(rid, sid, 1.0, "ep", {}, 0.0))
        finally:
            peer.close()
    assert isinstance(reply, protocol.SessionFinished)
    return reply


def _repeat(broker_control: str, sid: str, rid: int) -> protocol.Message:
    with zmq.Context() as ctx:
        peer = TrainerPeer(ctx, broker_control)
        try:
            return peer.request(protocol.FinishSession(rid, sid, 1.0, "ep", {}, 0.0))
        finally:
            peer.close()


def _session_with_turns(broker: RestartingBroker, trainer: TrainerClient, sid: str) -> None:
    trainer.open_session(session_id=sid)
    with zmq.Context() as ctx:
        worker = WorkerPeer(ctx, broker.worker)
        try:
            for k, turn in enumerate(conversation(5, 3)):
                worker.open_turn(sid, f"t{k}")
                worker.commit(sid, f"t{k}", turn)
        finally:
            worker.close()


@pytest.mark.parametrize("snapshot_between", [False, True], ids=["from_the_log", "from_a_snapshot"])
def test_a_finish_whose_reply_was_lost_gets_the_same_rows_from_a_restarted_durable_broker(tmp_path, snapshot_between):
    # A snapshot as soon as the log grows at all: one begun after the finish leaves it out of the replayed log.
    env = {"ROLLOUT_BROKER_SNAPSHOT_MIN_BYTES": "1", "ROLLOUT_BROKER_SNAPSHOT_MAX_BYTES": "1"}
    broker = RestartingBroker(tmp_path / "state", env=env if snapshot_between else None)
    try:
        with TrainerClient(broker.control, timeout=CALL_TIMEOUT_S) as trainer:
            _session_with_turns(broker, trainer, KEY)
            first = _finished_with_lost_reply(broker.control, KEY, 77)
            if snapshot_between:
                written = trainer.stats()["snapshots_written"]
                trainer.drop_session(trainer.open_session())
                assert wait_until(lambda: trainer.stats()["snapshots_written"] >= written + 2, timeout=10)
            broker.kill_and_restart()
            again = _repeat(broker.control, KEY, 77)
            assert isinstance(again, protocol.SessionFinished), again
            assert again.rows == first.rows and again.turns_committed == first.turns_committed == 3
            other = _repeat(broker.control, KEY, 78)  # another request: a second finish, refused as ever
            assert isinstance(other, protocol.Refused) and other.code == "session_closed"
            assert trainer.stats()["finish_repeats_answered"] == 1
    finally:
        broker.stop()


@pytest.mark.parametrize("snapshot_between", [False, True], ids=["from_the_log", "from_a_snapshot"])
def test_a_request_finish_whose_reply_was_lost_is_accepted_again_by_a_restarted_durable_broker(
    tmp_path, snapshot_between
):
    env = {"ROLLOUT_BROKER_SNAPSHOT_MIN_BYTES": "1", "ROLLOUT_BROKER_SNAPSHOT_MAX_BYTES": "1"}
    broker = RestartingBroker(tmp_path / "state", env=env if snapshot_between else None)
    try:
        with TrainerClient(broker.control, timeout=CALL_TIMEOUT_S) as trainer:
            _session_with_turns(broker, trainer, KEY)
            with zmq.Context() as ctx:
                worker = WorkerPeer(ctx, broker.worker)
                try:
                    worker.open_turn(KEY, "t3")  # in flight: the accepted finish parks, its promise logged
                finally:
                    worker.close()
            request = protocol.RequestFinish(55, KEY, 1.0, "ep", {}, 20.0)
            with zmq.Context() as ctx:
                peer = TrainerPeer(ctx, broker.control)
                try:
                    assert isinstance(peer.request(request), protocol.FinishAccepted)  # a reply then lost
                finally:
                    peer.close()
            if snapshot_between:
                written = trainer.stats()["snapshots_written"]
                trainer.drop_session(trainer.open_session())
                assert wait_until(lambda: trainer.stats()["snapshots_written"] >= written + 2, timeout=10)
            broker.kill_and_restart()
            with zmq.Context() as ctx:
                peer = TrainerPeer(ctx, broker.control)
                try:
                    again = peer.request(request)
                    other = peer.request(dataclasses.replace(request, request_id=56))
                finally:
                    peer.close()
            assert isinstance(again, protocol.FinishAccepted) and again.request_id == 55, again
            assert isinstance(other, protocol.Refused) and other.code == "session_closed", other
            with trainer.episodes(timeout=30) as stream:  # the in-flight turn is abandoned by its deadline
                episode = next(stream)
            assert episode.session_id == KEY and episode.turns_committed == 3
            assert trainer.stats()["finish_repeats_answered"] == 1
    finally:
        broker.stop()


# --- the broker's side, in-thread: a repeat while it stays up -----------------------------------------


def test_a_parked_finish_repeated_with_its_request_id_answers_the_new_connection(broker, client, worker, zctx):
    sid = client.open_session(session_id=KEY)
    (turn,) = conversation(9, 1)
    worker.open_turn(sid, "t0")
    first, second = TrainerPeer(zctx, broker.control_endpoint), TrainerPeer(zctx, broker.control_endpoint)
    msg = protocol.FinishSession(4242, sid, 1.0, None, {}, 20.0)
    first.send_raw(protocol.encode(msg))
    assert wait_until(lambda: client.stats()["finishes_parked"] == 1, timeout=5)
    second.send_raw(protocol.encode(msg))  # the same request, from the connection a resend goes out on
    # answered after the broker took the repeat (one connection is served in order), which it answered nothing
    stats = second.request(protocol.GetStats(second.next_id()))
    assert isinstance(stats, protocol.Stats) and stats.stats["finishes_parked"] == 1
    worker.commit(sid, "t0", turn)
    reply = second.recv()
    assert isinstance(reply, protocol.SessionFinished) and reply.request_id == 4242 and reply.turns_committed == 1
    assert first.sock.poll(200) == 0  # one finish, one answer
    first.close()
    second.close()


def test_a_done_finish_repeated_with_its_request_id_gets_its_reply_again(broker, client, worker, raw_trainer):
    sid = client.open_session(session_id=KEY)
    for k, turn in enumerate(conversation(11, 2)):
        worker.open_turn(sid, f"t{k}")
        worker.commit(sid, f"t{k}", turn)
    msg = protocol.FinishSession(900, sid, 0.5, "ep-9", {}, 0.0)
    first = raw_trainer.request(msg)
    again = raw_trainer.request(msg)
    assert isinstance(first, protocol.SessionFinished) and again == first
    other = raw_trainer.request(protocol.FinishSession(901, sid, 0.5, "ep-9", {}, 0.0))
    assert isinstance(other, protocol.Refused) and other.code == "session_closed"
    stats = client.stats()
    assert stats["finish_repeats_answered"] == 1 and stats["finish_answers_kept"] == 1


def test_a_request_finish_repeated_with_its_request_id_is_accepted_again_and_finishes_once(
    broker, client, worker, raw_trainer
):
    sid = client.open_session(session_id=KEY)
    (turn,) = conversation(13, 1)
    worker.open_turn(sid, "t0")
    msg = protocol.RequestFinish(700, sid, 0.5, "ep-7", {}, 20.0)
    first = raw_trainer.request(msg)
    parked = raw_trainer.request(msg)  # while its session drains
    worker.commit(sid, "t0", turn)
    with client.episodes(timeout=10) as stream:
        episode = next(stream)
    done = raw_trainer.request(msg)  # after its episode was delivered
    assert isinstance(first, protocol.FinishAccepted) and parked == first and done == first
    other = raw_trainer.request(protocol.RequestFinish(701, sid, 0.5, "ep-7", {}, 20.0))
    assert isinstance(other, protocol.Refused) and other.code == "session_closed"
    assert episode.session_id == sid and episode.turns_committed == 1
    assert client.stats()["finish_repeats_answered"] == 2
    with client.episodes(timeout=0.5) as stream:  # one finish, one episode
        with pytest.raises(EpisodeTimeout):
            next(stream)
