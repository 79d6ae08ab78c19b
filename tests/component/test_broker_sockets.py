"""The broker over real sockets, in-process: lifecycle, idempotency, drain, refusals, garbage.

A real `BrokerServer` thread on port-0 ROUTER sockets; the worker side is a plain
DEALER speaking `broker.protocol` (tests/component/peers.py) and the trainer side is the
real `TrainerClient` (or a raw DEALER where a test needs to send bytes by hand).
"""

from __future__ import annotations

import random
import re
import threading
import time
import typing

import msgpack
import pytest
import zmq
from component.peers import WorkerPeer, assert_linear_rows, assert_trained_once, conversation

from broker import protocol
from trainer_client import (
    BrokerBusy,
    DuplicateSession,
    InvalidRequest,
    SessionClosed,
    TraceRecord,
    UnknownSession,
)


def run_turns(worker: WorkerPeer, sid: str, turns, prefix: str = "t") -> None:
    for k, turn in enumerate(turns):
        opened = worker.open_turn(sid, f"{prefix}{k}")
        assert isinstance(opened, protocol.TurnOpened), opened
        committed = worker.commit(sid, f"{prefix}{k}", turn)
        assert committed == protocol.TurnCommitted(committed.request_id, f"{prefix}{k}", "stored")


def test_lifecycle_open_turns_commit_finish_free(client, worker):
    sid = client.open_session(sampling_defaults={"temperature": 0.7}, max_context_tokens=4096, metadata={"task": "x"})
    assert re.fullmatch(r"rg-[A-Za-z0-9_-]{32}", sid)  # 24 random bytes = 192 bits
    turns = conversation(1, 4)
    seqs = []
    for k, turn in enumerate(turns):
        opened = worker.open_turn(sid, f"t{k}")
        assert isinstance(opened, protocol.TurnOpened)
        assert opened.sampling_defaults == {"temperature": 0.7} and opened.max_context_tokens == 4096
        seqs.append(opened.seq)
        assert worker.commit(sid, f"t{k}", turn).outcome == "stored"
    assert seqs == [0, 1, 2, 3]
    assert client.stats()["turns_held"] == 4

    records = client.finish_session(sid, reward=0.5, rollout_id="ep-1", metadata={"split": "train"})
    assert all(isinstance(r, TraceRecord) for r in records)
    assert_linear_rows(records, turns)
    assert {(r.reward, r.rollout_id, r.status) for r in records} == {(0.5, "ep-1", "completed")}
    assert records[0].metadata["task"] == "x" and records[0].metadata["split"] == "train"

    stats = client.stats()
    assert stats["sessions_open"] == 0 and stats["turns_held"] == 0 and stats["bytes_held"] == 0
    assert stats["sessions_finished"] == 1 and stats["commits_stored"] == 4
    # the session is gone: stragglers are refused as closed, a second finish too
    refused = worker.open_turn(sid, "late")
    assert isinstance(refused, protocol.Refused) and refused.code == "session_closed"
    with pytest.raises(SessionClosed):
        client.finish_session(sid)


CHOSEN = "my-episode-7-" + "k" * 9  # a chosen key of the shortest length allowed


def test_minted_keys_are_distinct_and_given_ids_are_kept(client):
    minted = {client.open_session() for _ in range(50)}
    assert len(minted) == 50 and all(len(key) >= 32 for key in minted)
    assert client.open_session(session_id=CHOSEN) == CHOSEN
    with pytest.raises(DuplicateSession):
        client.open_session(session_id=CHOSEN)
    with pytest.raises(InvalidRequest):
        client.open_session(session_id="has space" + "k" * 20)
    with pytest.raises(InvalidRequest, match="at least 22 characters"):
        client.open_session(session_id=CHOSEN[:-1])
    with pytest.raises(InvalidRequest):
        client.open_session(max_turns=0)


def test_unknown_session_refused_everywhere(client, worker):
    refused = worker.open_turn("no-such-session", "t0")
    assert isinstance(refused, protocol.Refused) and refused.code == "unknown_session"
    with pytest.raises(UnknownSession):
        client.finish_session("no-such-session")
    assert client.drop_session("no-such-session") is False
    # a commit for a session the broker does not hold is acknowledged (the worker stops
    # retrying) and discarded, and counted
    turn = conversation(2, 1)[0]
    assert worker.commit("no-such-session", "t0", turn).outcome == "discarded"
    assert client.stats()["commits_discarded"] == 1


def test_commits_are_idempotent_and_open_turn_retries_get_the_same_seq(client, worker):
    sid = client.open_session()
    turns = conversation(3, 3)
    assert worker.open_turn(sid, "t0").seq == 0
    assert worker.open_turn(sid, "t0").seq == 0  # a retried OPEN (lost reply) is the same turn
    assert worker.open_turn(sid, "t1").seq == 1
    assert worker.open_turn(sid, "t2").seq == 2
    for k, turn in enumerate(turns):
        assert worker.commit(sid, f"t{k}", turn).outcome == "stored"
        assert worker.commit(sid, f"t{k}", turn).outcome == "duplicate"
    refused = worker.open_turn(sid, "t1")  # reusing a finished turn's id is a caller bug
    assert isinstance(refused, protocol.Refused) and refused.code == "bad_request"
    stats = client.stats()
    assert (stats["commits_stored"], stats["commits_duplicate"]) == (3, 3)
    assert_linear_rows(client.finish_session(sid), turns)


def test_commits_out_of_order_are_built_in_open_order(client, worker):
    sid = client.open_session()
    turns = conversation(4, 5)
    for k in range(5):
        worker.open_turn(sid, f"t{k}")
    for k in (3, 0, 4, 2, 1):  # commits from different workers race
        assert worker.commit(sid, f"t{k}", turns[k]).outcome == "stored"
    assert_linear_rows(client.finish_session(sid), turns)


def test_turn_cap_and_aborts(client, worker):
    sid = client.open_session(max_turns=2)
    turns = conversation(5, 2)
    worker.open_turn(sid, "t0")
    worker.open_turn(sid, "x")
    refused = worker.open_turn(sid, "t1")
    assert isinstance(refused, protocol.Refused) and refused.code == "turn_cap"
    aborted = worker.abort(sid, "x")  # frees its slot
    assert isinstance(aborted, protocol.TurnAborted) and aborted.turn_id == "x"
    assert worker.open_turn(sid, "t1").seq == 2
    run_commits = [worker.commit(sid, f"t{k}", turns[k]).outcome for k in range(2)]
    assert run_commits == ["stored", "stored"]
    late = worker.commit(sid, "x", turns[0])  # an aborted turn is never trained on
    assert isinstance(late, protocol.Refused) and late.code == "bad_request"
    assert isinstance(worker.abort(sid, "never-opened"), protocol.TurnAborted)  # gone either way
    records = client.finish_session(sid)
    assert_linear_rows(records, turns)
    assert client.stats()["turns_aborted"] == 1


def test_drain_waits_for_in_flight_turns_without_blocking_the_loop(client, worker, broker, zctx):
    sid = client.open_session()
    turns = conversation(6, 3)
    run_turns(worker, sid, turns[:2])
    worker.open_turn(sid, "t2")  # in flight when finish arrives
    result: dict = {}

    def finish() -> None:
        t0 = time.monotonic()
        result["records"] = client.finish_session(sid, wait_timeout=10.0)
        result["elapsed"] = time.monotonic() - t0

    finisher = threading.Thread(target=finish)
    finisher.start()
    _wait_for(lambda: client.stats()["finishes_parked"] == 1)
    # while the finish is parked: stragglers are refused, a re-sent OPEN of the in-flight
    # turn gets its same answer, and other sessions are served
    refused = worker.open_turn(sid, "t3")
    assert isinstance(refused, protocol.Refused) and refused.code == "session_closed"
    assert worker.open_turn(sid, "t2").seq == 2
    other = client.open_session()
    other_turns = conversation(7, 2)
    run_turns(worker, other, other_turns)
    assert finisher.is_alive()
    assert worker.commit(sid, "t2", turns[2]).outcome == "stored"
    finisher.join(10)
    assert not finisher.is_alive()
    assert result["elapsed"] < 5.0  # answered on the commit, not at the deadline
    assert_linear_rows(result["records"], turns)
    assert result["records"][0].metadata.get("drain_status") is None
    assert_linear_rows(client.finish_session(other), other_turns)


def test_drain_timeout_returns_what_was_committed_and_discards_late_commits(client, worker):
    sid = client.open_session()
    turns = conversation(8, 3)
    run_turns(worker, sid, turns[:2])
    worker.open_turn(sid, "t2")
    t0 = time.monotonic()
    records = client.finish_session(sid, wait_timeout=0.5)
    elapsed = time.monotonic() - t0
    assert 0.45 <= elapsed < 3.0
    assert_trained_once(records, turns[:2])
    assert {r.metadata["drain_status"] for r in records} == {"drain_timeout"}
    assert {r.metadata["turns_abandoned"] for r in records} == {1}
    assert worker.commit(sid, "t2", turns[2]).outcome == "discarded"
    stats = client.stats()
    assert stats["drain_timeouts"] == 1 and stats["turns_abandoned"] == 1 and stats["commits_discarded"] == 1


def test_finish_with_nothing_in_flight_answers_at_once_and_abort_completes_a_drain(client, worker):
    sid = client.open_session()
    turns = conversation(9, 1)
    run_turns(worker, sid, turns)
    worker.open_turn(sid, "gone")
    done = threading.Event()
    records: list = []
    finisher = threading.Thread(
        target=lambda: (records.extend(client.finish_session(sid, wait_timeout=30)), done.set())
    )
    finisher.start()
    _wait_for(lambda: client.stats()["finishes_parked"] == 1)
    worker.abort(sid, "gone")  # the last in-flight turn ends by abort: the finish completes now
    assert done.wait(5)
    finisher.join(5)
    assert_linear_rows(records, turns)


def test_drop_frees_and_answers_a_parked_finish(client, worker):
    sid = client.open_session()
    run_turns(worker, sid, conversation(10, 1))
    assert client.stats()["bytes_held"] > 0
    worker.open_turn(sid, "t9")
    errors: list = []

    def finish() -> None:
        try:
            client.finish_session(sid, wait_timeout=30)
        except UnknownSession as e:
            errors.append(e)

    finisher = threading.Thread(target=finish)
    finisher.start()
    _wait_for(lambda: client.stats()["finishes_parked"] == 1)
    assert client.drop_session(sid) is True
    finisher.join(5)
    assert len(errors) == 1 and "dropped" in str(errors[0])
    assert client.drop_session(sid) is False
    stats = client.stats()
    assert stats["sessions_dropped"] == 1 and stats["bytes_held"] == 0 and stats["turns_in_flight"] == 0


def test_garbage_from_peers_is_refused_and_the_broker_keeps_serving(client, worker, raw_trainer):
    good = client.open_session()
    cases = [
        (b"\xc1 not msgpack", "protocol", -1),
        (msgpack.packb({"a": 1}), "protocol", -1),
        (msgpack.packb([protocol.PROTOCOL_VERSION, "no_such_tag", 41]), "protocol", 41),
        (msgpack.packb([protocol.PROTOCOL_VERSION + 1, "open_turn", 42, good, "t"]), "version_mismatch", 42),
        (msgpack.packb([protocol.PROTOCOL_VERSION, "open_turn", 43, 12345, "t"]), "protocol", 43),
        (msgpack.packb([protocol.PROTOCOL_VERSION, "commit_turn", 44, good, "t", b"abc"]), "protocol", 44),
    ]
    for frame, code, rid in cases:
        for peer in (worker, raw_trainer):
            peer.send_raw(frame)
            reply = peer.recv()
            assert isinstance(reply, protocol.Refused), (frame, reply)
            assert (reply.code, reply.request_id) == (code, rid), (frame, reply)
    # a message of the other direction is as unknown as any tag
    worker.send_raw(protocol.encode(protocol.GetStats(45)))
    assert worker.recv() == protocol.Refused(45, "protocol", "unknown message 'get_stats' for worker_to_broker")
    raw_trainer.send_raw(protocol.encode(protocol.OpenTurn(46, good, "t")))
    assert raw_trainer.recv().code == "protocol"
    worker.send_raw(b"")  # an empty frame
    assert worker.recv().code == "protocol"
    # extra frames are kept as an envelope (REQ peers send one): still exactly one answer
    worker.sock.send_multipart([b"two", b"frames"])
    assert worker.sock.poll(5000)
    envelope, payload = worker.sock.recv_multipart()
    assert envelope == b"two" and protocol.decode_broker_to_worker(payload).code == "protocol"
    # nothing above touched the good session or stopped the loop
    turns = conversation(11, 2)
    run_turns(worker, good, turns)
    assert_linear_rows(client.finish_session(good), turns)
    assert client.stats()["protocol_errors"] == 2 * len(cases) + 4


def test_a_req_socket_peer_gets_its_reply_through_the_envelope(broker, zctx):
    req = zctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(broker.control_endpoint)
    req.send(protocol.encode(protocol.GetStats(7)))
    assert req.poll(5000)
    reply = protocol.decode_broker_to_trainer(req.recv())
    assert isinstance(reply, protocol.Stats) and reply.request_id == 7
    req.close()


def test_session_limit_is_refused_as_busy(make_broker):
    from trainer_client import TrainerClient

    b = make_broker(max_sessions=2, max_turns_cap=3)
    with TrainerClient(b.control_endpoint, timeout=5) as client:
        client.open_session()
        sid = client.open_session(max_turns=10)
        with pytest.raises(BrokerBusy):
            client.open_session()
        client.drop_session(sid)
        client.open_session()  # room again


def test_responses_are_decoded_with_a_configured_tokenizer(make_broker, zctx, tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        ["the quick brown fox jumps over the lazy dog"] * 20,
        trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_end|>"]),
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    b = make_broker(tokenizer=str(tmp_path))  # a directory holding tokenizer.json
    from trainer_client import TrainerClient

    worker = WorkerPeer(zctx, b.worker_endpoint)
    text = "the lazy fox<|im_end|>"
    out = protocol.ids_array(tok.encode(text).ids)
    turn = conversation(12, 1)[0]
    turn = type(turn)(
        turn.prompt_ids, out, protocol.logprobs_array([-0.25] * len(out)), turn.prompt_messages, turn.response_message
    )
    try:
        with TrainerClient(b.control_endpoint, timeout=10) as client:
            sid = client.open_session()
            run_turns(worker, sid, [turn])
            (record,) = client.finish_session(sid)
    finally:
        worker.close()
    assert record.response == text  # special tokens kept
    assert record.response_ids == out.tolist()


def _wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_fuzzed_frames_each_get_one_answer_and_never_stop_the_broker(client, worker, raw_trainer):
    rng = random.Random(1234)
    # Every frame but a well-formed heartbeat (the one message never answered) gets exactly one reply.
    tags = [cls.TAG for union in (protocol.WorkerToBroker, protocol.TrainerToBroker) for cls in typing.get_args(union)
            if cls is not protocol.Heartbeat]
    atoms = [None, True, 0, -1, 2**40, 1.5, "", "s", b"", b"\x00\x01\x02", [], {}, {"role": "user"}, [{"a": 1}]]

    def frame() -> bytes:
        kind = rng.random()
        if kind < 0.2:
            return rng.randbytes(rng.randrange(0, 40))
        fields = [rng.choice(atoms) for _ in range(rng.randrange(0, 12))]
        version = protocol.PROTOCOL_VERSION if kind < 0.9 else rng.choice([0, 2, "1"])
        return msgpack.packb([version, rng.choice(tags), rng.randrange(1, 10**6), *fields], use_bin_type=True)

    for _ in range(300):
        peer = rng.choice([worker, raw_trainer])
        peer.send_raw(frame())
        reply = peer.recv()  # exactly one answer, well-formed, for anything
        assert isinstance(reply, protocol.Message)
        if isinstance(reply, protocol.Refused):
            assert reply.code in typing.get_args(protocol.ErrorCode)
    turns = conversation(13, 2)
    sid = client.open_session()
    run_turns(worker, sid, turns)
    assert_linear_rows(client.finish_session(sid), turns)
