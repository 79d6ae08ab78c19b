"""The episode stream over real sockets, in-process: request_finish, exactly-once finishes, acks, leases, filters.

A real `BrokerServer` thread on port-0 sockets; the worker side is the test DEALER speaking
`broker.protocol` (it also sends the agent's RequestFinish, as a gateway worker does), the
trainer side the real `TrainerClient` and its `EpisodeStream`s. Leases are set short so that
redelivery happens within the test's bounds.
"""

from __future__ import annotations

import threading
import time

import pytest
from component.peers import WorkerPeer, conversation

from broker import protocol
from trainer_client import (
    BrokerBusy,
    EpisodeTimeout,
    InvalidRequest,
    SessionClosed,
    TrainerClient,
    UnknownSession,
)


def run_turns(worker: WorkerPeer, sid: str, seed: int, n_turns: int = 3) -> list:
    turns = conversation(seed, n_turns, first_prompt=20, tail=5, output=4)
    for k, turn in enumerate(turns):
        assert isinstance(worker.open_turn(sid, f"t{k}"), protocol.TurnOpened)
        assert worker.commit(sid, f"t{k}", turn).outcome == "stored"
    return turns


def agent_finish(worker: WorkerPeer, sid: str, reward: float | None = 1.0, **kw) -> protocol.Message:
    msg = protocol.RequestFinish(worker.next_id(), sid, reward, kw.get("rollout_id"), kw.get("metadata", {}), 5.0)
    return worker.request(msg)


def test_request_finish_builds_the_same_rows_as_finish_session(client, worker):
    control = client.open_session(metadata={"task": "t"})
    run_turns(worker, control, seed=11)
    expected = client.finish_session(control, reward=0.5, rollout_id="ep", metadata={"k": 1})
    sid = client.open_session(metadata={"task": "t"}, group="g")
    run_turns(worker, sid, seed=11)
    assert client.request_finish(sid, reward=0.5, rollout_id="ep", metadata={"k": 1}) is None
    with client.episodes(timeout=5) as stream:
        episode = next(stream)
    assert episode.rows == expected and len(expected) == 1
    assert (episode.session_id, episode.reward, episode.rollout_id, episode.group) == (sid, 0.5, "ep", "g")
    assert (episode.status, episode.finished_by, episode.turns_committed, episode.redelivered) == (
        "complete",
        "trainer",
        3,
        False,
    )
    assert episode.metadata == {"task": "t", "k": 1}
    stats = client.stats()
    assert stats["outbox_episodes"] == 0 and stats["episodes_acked"] == 1 and stats["sessions_finished"] == 2


def test_a_session_finishes_exactly_once_whichever_way_comes_first(client, worker):
    a = client.open_session()
    client.request_finish(a)
    for again in (lambda: client.request_finish(a), lambda: client.finish_session(a)):
        with pytest.raises(SessionClosed, match="already finish.*by the trainer"):
            again()
    refused = agent_finish(worker, a)
    assert isinstance(refused, protocol.Refused) and refused.code == "session_closed"

    b = client.open_session()
    run_turns(worker, b, seed=3, n_turns=1)
    accepted = agent_finish(worker, b, reward=0.25, metadata={"judge": "harness"})
    assert accepted == protocol.FinishAccepted(accepted.request_id, b)
    with pytest.raises(SessionClosed, match="finished by the agent"):
        client.finish_session(b)
    with pytest.raises(SessionClosed, match="finished by the agent"):
        client.request_finish(b)

    c = client.open_session()
    client.finish_session(c)
    with pytest.raises(SessionClosed):
        client.request_finish(c)
    with pytest.raises(UnknownSession):
        client.request_finish("never-opened")
    unknown = agent_finish(worker, "never-opened")
    assert isinstance(unknown, protocol.Refused) and unknown.code == "unknown_session"

    with client.episodes(timeout=5) as stream:
        got = [next(stream), next(stream)]
        with pytest.raises(EpisodeTimeout):
            next(client.episodes(timeout=0.2))
    by_sid = {e.session_id: e for e in got}
    assert set(by_sid) == {a, b}  # c went to its finish_session caller only
    assert by_sid[b].finished_by == "agent" and by_sid[b].reward == 0.25 and by_sid[b].metadata == {"judge": "harness"}
    assert len(by_sid[b].rows) == 1 and by_sid[a].rows == []


def test_an_in_flight_turn_is_waited_for_and_a_drop_cancels_the_episode(client, worker):
    sid = client.open_session()
    turns = conversation(5, 2, first_prompt=20, tail=5, output=4)
    worker.open_turn(sid, "t0")
    worker.commit(sid, "t0", turns[0])
    worker.open_turn(sid, "t1")  # still generating when the finish arrives
    client.request_finish(sid, reward=1.0, wait_timeout=10)
    assert client.stats()["outbox_reserved"] == 1
    assert worker.commit(sid, "t1", turns[1]).outcome == "stored"  # in flight: still accepted
    cut = client.open_session()
    worker.open_turn(cut, "t0")
    client.request_finish(cut, wait_timeout=0.2)
    dropped = client.open_session()
    worker.open_turn(dropped, "t0")
    client.request_finish(dropped, wait_timeout=10)
    assert client.drop_session(dropped) is True
    with client.episodes(timeout=5) as stream:
        first, second = next(stream), next(stream)
        with pytest.raises(EpisodeTimeout):
            next(client.episodes(timeout=0.3))
    assert (first.session_id, first.status, first.turns_committed) == (sid, "complete", 2)
    assert sum(sum(r.loss_mask) for r in first.rows) == 8
    assert (second.session_id, second.status, second.turns_abandoned) == (cut, "drain_timeout", 1)
    stats = client.stats()
    assert stats["outbox_reserved"] == 0 and stats["outbox_episodes"] == 0


def test_a_full_outbox_refuses_finishes_as_busy_and_loses_nothing(make_broker, zctx):
    broker = make_broker(outbox_max_episodes=3)
    worker = WorkerPeer(zctx, broker.worker_endpoint)
    with TrainerClient(broker.control_endpoint, timeout=5) as client:
        sids = [client.open_session() for _ in range(5)]
        for sid in sids[:3]:
            client.request_finish(sid)
        with pytest.raises(BrokerBusy, match="outbox is full"):
            client.request_finish(sids[3])
        refused = agent_finish(worker, sids[4])
        assert isinstance(refused, protocol.Refused) and refused.code == "busy"
        # a refused finish changed nothing: the session is open and takes turns
        run_turns(worker, sids[3], seed=1, n_turns=2)
        got = []
        with client.episodes(timeout=5, max_pending=1) as stream:
            got.append(next(stream).session_id)
            got.append(next(stream).session_id)  # acknowledges the first: room for one
            client.request_finish(sids[3])
            with pytest.raises(BrokerBusy):
                client.request_finish(sids[4])
            for _ in range(2):
                got.append(next(stream).session_id)
            assert isinstance(agent_finish(worker, sids[4]), protocol.FinishAccepted)
            got.append(next(stream).session_id)
        assert sorted(got) == sorted(sids)
        stats = client.stats()
        assert stats["outbox_full_refusals"] == 3 and stats["refusals"]["busy"] == 3
        assert stats["episodes_acked"] == 5 and stats["outbox_episodes"] == 0
    worker.close()


def test_two_streams_in_two_threads_share_the_episodes_each_exactly_once(client, worker):
    n = 40
    sids = [client.open_session() for _ in range(n)]
    seen: dict[str, list[str]] = {"A": [], "B": []}
    done = threading.Event()
    errors: list[BaseException] = []

    def consume(name: str) -> None:
        try:
            with client.episodes(max_pending=3, timeout=0.2) as stream:
                while not done.is_set():  # a short timeout lets the loop notice the end
                    try:
                        episode = next(stream)
                    except EpisodeTimeout:
                        continue
                    seen[name].append(episode.session_id)
                    assert not episode.redelivered
                    if len(seen["A"]) + len(seen["B"]) >= n:
                        done.set()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=consume, args=(name,)) for name in seen]
    for t in threads:
        t.start()
    for sid in sids:
        client.request_finish(sid)
    assert done.wait(20), seen
    for t in threads:
        t.join(15)
    assert not errors, errors
    assert sorted(seen["A"] + seen["B"]) == sorted(sids)
    assert seen["A"] and seen["B"]  # both took part
    stats = client.stats()
    assert stats["episodes_delivered"] == n and stats["episodes_acked"] == n and stats["episodes_redelivered"] == 0


def test_a_stream_that_stops_polling_loses_its_episodes_to_another_marked_redelivered(client, worker):
    sids = [client.open_session() for _ in range(3)]
    for sid in sids:
        client.request_finish(sid)
    stalled = client.episodes(max_pending=3, lease=0.5, timeout=0.3)
    first = next(stalled)  # holds 3: one yielded, two prefetched; then stops polling
    assert stalled.pending == 3
    t0 = time.monotonic()
    with client.episodes(timeout=5) as survivor:
        got = [next(survivor), next(survivor), next(survivor)]
    assert 0.4 < time.monotonic() - t0 < 3.0
    assert sorted(e.session_id for e in got) == sorted(sids) and all(e.redelivered for e in got)
    # the stalled stream comes back: its prefetched ones were revoked, never yielded twice
    first.ack()  # late, and the survivor already acknowledged it: a no-op at the broker
    with pytest.raises(EpisodeTimeout):
        next(stalled)
    assert stalled.pending == 0
    stalled.close()
    assert client.stats()["leases_expired"] == 1


def test_close_hands_back_unseen_episodes_and_an_exception_hands_back_the_current_one(client, worker):
    sids = [client.open_session() for _ in range(3)]
    for sid in sids:
        client.request_finish(sid)
    with client.episodes(max_pending=3, timeout=5) as stream:
        kept = next(stream)  # the other two are prefetched, unseen
    with pytest.raises(RuntimeError):
        with client.episodes(max_pending=1, timeout=5) as stream:
            failed = next(stream)
            raise RuntimeError("the training step failed")
    with client.episodes(max_pending=3, timeout=5) as stream:
        again = next(stream)
        last = next(stream)
        with pytest.raises(EpisodeTimeout):
            next(client.episodes(timeout=0.2))
    assert again.session_id == failed.session_id and again.redelivered
    assert not last.redelivered and last.session_id not in (kept.session_id, failed.session_id)
    assert client.stats()["outbox_episodes"] == 0


def test_explicit_acks_without_auto_ack_and_the_pending_bound(client, worker):
    sids = [client.open_session() for _ in range(4)]
    for sid in sids:
        client.request_finish(sid)
    stream = client.episodes(max_pending=2, auto_ack=False, timeout=5)
    a, b = next(stream), next(stream)
    with pytest.raises(InvalidRequest, match="unacknowledged"):
        next(stream)
    assert client.stats()["outbox_leased"] == 2
    a.ack()
    a.ack()  # idempotent
    assert client.stats()["episodes_acked"] == 1
    c = next(stream)
    b.ack()
    c.ack()
    d = next(stream)
    stream.close()  # auto_ack off: d was not acknowledged, it goes back marked
    with client.episodes(timeout=5) as other:
        again = next(other)
    assert again.session_id == d.session_id and again.redelivered
    assert {e.session_id for e in (a, b, c, d)} == set(sids)


def test_only_mine_and_group_filters(broker, worker):
    with (
        TrainerClient(broker.control_endpoint, timeout=5) as alice,
        TrainerClient(broker.control_endpoint, timeout=5) as bob,
    ):
        opened = {
            "alice-g1": alice.open_session(group="g1"),
            "alice-g2": alice.open_session(group="g2"),
            "bob-g1": bob.open_session(group="g1"),
            "bob": bob.open_session(),
        }
        for name, sid in opened.items():
            (alice if name.startswith("alice") else bob).request_finish(sid, metadata={"name": name})

        def drain(stream) -> list[str]:
            names = []
            with stream:
                try:
                    while True:
                        names.append(next(stream).metadata["name"])
                except EpisodeTimeout:
                    return sorted(names)

        assert drain(alice.episodes(only_mine=True, group="g1", timeout=0.3)) == ["alice-g1"]
        assert drain(bob.episodes(group="g1", timeout=0.3)) == ["bob-g1"]
        assert drain(alice.episodes(only_mine=True, timeout=0.3)) == ["alice-g2"]
        assert drain(alice.episodes(only_mine=True, timeout=0.3)) == []
        assert drain(alice.episodes(timeout=0.3)) == ["bob"]
    # a client id can be shared on purpose (e.g. the processes of one trainer)
    with (
        TrainerClient(broker.control_endpoint, client_id="trainer-7") as c1,
        TrainerClient(broker.control_endpoint, client_id="trainer-7") as c2,
    ):
        sid = c1.open_session()
        c1.request_finish(sid)
        with c2.episodes(only_mine=True, timeout=5) as stream:
            assert next(stream).session_id == sid


def test_timeouts_and_arguments(client):
    t0 = time.monotonic()
    with pytest.raises(EpisodeTimeout, match="no episode within 0.5s"):
        next(client.episodes(timeout=0.5))
    assert 0.5 <= time.monotonic() - t0 < 1.5
    for bad in ({"max_pending": 0}, {"lease": 0}, {"timeout": -1}, {"max_pending": 2.5}):
        with pytest.raises(ValueError):
            client.episodes(**bad)
    with pytest.raises(ValueError):
        TrainerClient("tcp://127.0.0.1:1", client_id="")
    with pytest.raises(InvalidRequest):
        client.request_finish(client.open_session(), wait_timeout=-1)
    closed = client.episodes(timeout=0.1)
    closed.close()
    assert list(closed) == []
