"""broker.episodes.outbox: bounded store, one lease per subscriber, acks, redelivery, long polls, filters.

Pure bookkeeping, so the clock is the test's: every call takes `now`. A random-schedule test
checks the delivery invariants over thousands of interleaved finishes, fetches, acks, crashes
and lease expiries: an episode is leased to at most one subscriber at a time, never handed out
again once acknowledged, and every episode is eventually acknowledged (nothing lost).
"""

from __future__ import annotations

import dataclasses
import random
from array import array

import pytest

from broker import protocol
from broker.episodes.outbox import Outbox
from broker.sessions.registry import Refusal


def make_outbox(**overrides) -> Outbox:
    settings = dict(max_episodes=100, max_bytes=10**9, max_wait=30.0, max_lease=600.0, max_credit=64)
    settings.update(overrides)
    return Outbox(**settings)


def episode(sid: str, group: str | None = None, n_tokens: int = 8) -> protocol.DeliveredEpisode:
    row = protocol.TraceRow(
        protocol.ids_array(range(n_tokens)),
        array("B", [1] * 2),
        protocol.logprobs_array([-0.5, -0.25]),
        2,
        "",
        None,
        1.0,
        "completed",
        {},
    )
    return protocol.DeliveredEpisode(0, sid, [row], 1.0, None, {}, "complete", False, group, "trainer", 1, 0)


def add(box: Outbox, sid: str, *, client: str = "c1", group: str | None = None, now: float = 0.0) -> list:
    box.reserve()
    return box.add(episode(sid, group), client, now)


class Sub:
    """A test subscriber: builds FetchEpisodes the way EpisodeStream does."""

    def __init__(self, box: Outbox, name: str, *, lease: float = 10.0, client_id=None, group=None) -> None:
        self.box, self.name, self.lease, self.client_id, self.group = box, name, lease, client_id, group
        self.held: list[int] = []
        self.rid = 0

    def msg(self, credit: int, acks=(), release=(), wait: float = 0.0, held=None, epoch=None):
        self.rid += 1
        return protocol.FetchEpisodes(
            self.rid,
            self.name,
            self.box.epoch if epoch is None else epoch,
            credit,
            list(acks),
            list(self.held if held is None else held),
            list(release),
            wait,
            self.lease,
            self.client_id,
            self.group,
        )

    def fetch(self, credit: int = 4, *, now: float = 0.0, **kw):
        reply, others = self.box.fetch([self.name.encode()], self.msg(credit, **kw), now)
        if reply is not None:
            self.held = [d for d in self.held if d not in reply.revoked and d not in kw.get("acks", ())]
            self.held += [e.delivery_id for e in reply.episodes]
        return reply, others


def sids(reply) -> list[str]:
    return [e.session_id for e in reply.episodes]


def test_each_episode_goes_to_one_subscriber_up_to_its_credit():
    box = make_outbox()
    for i in range(5):
        assert add(box, f"s{i}") == []
    a, b = Sub(box, "a"), Sub(box, "b")
    ra, _ = a.fetch(credit=2)
    rb, _ = b.fetch(credit=10)
    assert sids(ra) == ["s0", "s1"] and sids(rb) == ["s2", "s3", "s4"]
    assert not any(e.redelivered for e in ra.episodes + rb.episodes)
    assert ra.epoch == box.epoch and ra.revoked == [] and ra.acked == 0
    stats = box.stats()
    assert (stats["outbox_episodes"], stats["outbox_ready"], stats["outbox_leased"]) == (5, 0, 5)
    # acks free them for good; a second ack of the same id is a no-op
    ack_ids = [e.delivery_id for e in ra.episodes]
    r, _ = a.fetch(credit=0, acks=ack_ids)
    assert r.acked == 2 and r.episodes == []
    r, _ = a.fetch(credit=0, acks=ack_ids)
    assert r.acked == 0
    assert box.stats()["outbox_episodes"] == 3 and box.stats()["episodes_acked"] == 2


def test_a_full_outbox_refuses_with_busy_and_acks_make_room():
    box = make_outbox(max_episodes=2)
    add(box, "s0")
    box.reserve()  # an accepted finish still draining counts too
    with pytest.raises(Refusal) as e:
        box.reserve()
    assert e.value.code == "busy" and "outbox is full" in e.value.message
    box.add(episode("s1"), "c1", 0.0)
    sub = Sub(box, "a")
    r, _ = sub.fetch(credit=1)
    with pytest.raises(Refusal):
        box.reserve()  # leased is still held
    sub.fetch(credit=0, acks=[r.episodes[0].delivery_id])
    box.reserve()  # room again
    box.unreserve()
    assert box.stats()["outbox_full_refusals"] == 2


def test_the_byte_bound_refuses_too():
    box = make_outbox(max_bytes=1)
    add(box, "s0")
    with pytest.raises(Refusal, match="outbox is full"):
        box.reserve()


def test_a_long_poll_is_parked_until_an_episode_arrives_or_its_wait_ends():
    box = make_outbox()
    a = Sub(box, "a")
    reply, _ = a.fetch(credit=2, wait=5.0, now=0.0)
    assert reply is None and box.stats()["polls_parked"] == 1
    assert box.next_deadline() == 5.0
    answers = add(box, "s0", now=1.0)
    assert len(answers) == 1
    envelope, answer = answers[0]
    assert envelope == [b"a"] and answer.request_id == a.rid and sids(answer) == ["s0"]
    # nothing more: a parked poll times out with an empty answer
    assert a.fetch(credit=1, wait=2.0, now=1.0, held=[answer.episodes[0].delivery_id])[0] is None
    assert box.expire(2.9) == []
    ((_, empty),) = box.expire(3.0)
    assert empty.episodes == [] and empty.request_id == a.rid


def test_a_newer_fetch_supersedes_a_parked_one():
    box = make_outbox()
    a = Sub(box, "a")
    assert a.fetch(credit=1, wait=5.0)[0] is None
    assert a.fetch(credit=1, wait=5.0)[0] is None
    assert box.stats()["polls_parked"] == 1
    ((_, answer),) = add(box, "s0")
    assert answer.request_id == a.rid  # the newer request gets it


def test_lease_expiry_requeues_unacked_episodes_marked_redelivered_and_revokes_them():
    box = make_outbox()
    for i in range(3):
        add(box, f"s{i}")
    dead, alive = Sub(box, "dead", lease=1.0), Sub(box, "alive", lease=10.0)
    r, _ = dead.fetch(credit=2, now=0.0)
    assert sids(r) == ["s0", "s1"]
    assert box.next_deadline() == 1.0
    assert box.expire(0.99) == []
    # a parked poll of the survivor gets them as soon as the lease runs out
    r, _ = alive.fetch(credit=4, now=0.5)
    assert sids(r) == ["s2"]
    assert alive.fetch(credit=4, wait=5.0, now=0.5)[0] is None
    ((envelope, answer),) = box.expire(1.0)
    assert envelope == [b"alive"]
    assert sids(answer) == ["s0", "s1"] and all(e.redelivered for e in answer.episodes)
    assert box.stats()["leases_expired"] == 1 and box.stats()["episodes_redelivered"] == 2
    # the dead one comes back: what it held is revoked, and its late ack still counts
    late, rest = dead.held[0], dead.held[1:]
    r, _ = dead.fetch(credit=0, acks=[late], held=rest, now=2.0)
    assert r.acked == 1 and r.revoked == rest
    assert box.stats()["outbox_episodes"] == 2


def test_held_ids_that_were_never_received_go_back_marked():
    box = make_outbox()
    add(box, "s0")
    a, b = Sub(box, "a"), Sub(box, "b")
    r, _ = a.fetch(credit=1)
    # the reply was lost: the next request holds nothing, so the broker takes it back
    r2, _ = a.fetch(credit=0, held=[])
    assert r2.episodes == []
    r3, _ = b.fetch(credit=1)
    assert sids(r3) == ["s0"] and r3.episodes[0].redelivered


def test_released_episodes_go_back_unmarked_and_first():
    box = make_outbox()
    for i in range(3):
        add(box, f"s{i}")
    a, b = Sub(box, "a"), Sub(box, "b")
    r, _ = a.fetch(credit=2)
    a.fetch(credit=0, release=[e.delivery_id for e in r.episodes], held=[])
    r, _ = b.fetch(credit=3)
    assert sids(r) == ["s0", "s1", "s2"] and not any(e.redelivered for e in r.episodes)


def test_group_and_client_filters_alone_and_together():
    box = make_outbox()
    add(box, "a-g1", client="A", group="g1")
    add(box, "b-g1", client="B", group="g1")
    add(box, "a-g2", client="A", group="g2")
    add(box, "a-none", client="A")
    add(box, "b-none", client="B")
    assert sids(Sub(box, "1", client_id="A", group="g1").fetch(10)[0]) == ["a-g1"]
    assert sids(Sub(box, "2", group="g1").fetch(10)[0]) == ["b-g1"]
    assert sids(Sub(box, "3", client_id="A").fetch(10)[0]) == ["a-g2", "a-none"]
    assert sids(Sub(box, "4", group="nope").fetch(10)[0]) == []
    assert sids(Sub(box, "5").fetch(10)[0]) == ["b-none"]
    # a parked filtered poll is passed over by a non-matching episode
    g3 = Sub(box, "6", group="g3")
    assert g3.fetch(1, wait=5)[0] is None
    assert add(box, "b-g4", client="B", group="g4") == []
    ((_, answer),) = add(box, "b-g3", client="B", group="g3")
    assert sids(answer) == ["b-g3"]


def test_a_restarted_broker_ignores_ids_of_another_epoch():
    box = make_outbox()
    add(box, "s0")
    sub = Sub(box, "a")
    r, _ = sub.fetch(credit=1, acks=[1], held=[1], epoch="old-broker")
    assert r.acked == 0 and r.revoked == [1]  # not this broker's episode 1
    assert sids(r) == ["s0"] and box.stats()["outbox_episodes"] == 1


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"subscriber_id": ""}, "subscriber_id"),
        ({"credit": -1}, "credit"),
        ({"wait": float("nan")}, "wait"),
        ({"lease": 0.0}, "lease"),
        ({"acks": list(range(10_001))}, "at most"),
    ],
)
def test_bad_fetches_are_refused_as_bad_request(fields, fragment):
    box = make_outbox()
    base = Sub(box, "a").msg(1)
    with pytest.raises(Refusal, match=fragment) as e:
        box.fetch([b"a"], dataclasses.replace(base, **fields), 0.0)
    assert e.value.code == "bad_request"


def test_close_answers_parked_polls_empty():
    box = make_outbox()
    Sub(box, "a").fetch(1, wait=5)
    ((envelope, answer),) = box.close()
    assert envelope == [b"a"] and answer.episodes == [] and box.stats()["polls_parked"] == 0


def test_random_schedules_keep_the_delivery_invariants():
    rng = random.Random(7)
    box = make_outbox(max_episodes=6)
    subs = {f"s{i}": Sub(box, f"s{i}", lease=rng.choice([1.0, 3.0])) for i in range(4)}
    alive = dict.fromkeys(subs, True)
    last_contact = dict.fromkeys(subs, 0.0)
    now, added, acked = 0.0, 0, set()
    ever_delivered: set[int] = set()
    holder_of: dict[int, str] = {}  # as the subscribers know it: delivered and still held

    def fetch(sub: Sub, credit: int, acks: list[int]) -> None:
        reply, others = sub.fetch(credit=credit, acks=acks, now=now)
        assert others == []  # nobody parks in this schedule
        acked.update(acks)
        last_contact[sub.name] = now
        for d in [d for d, name in holder_of.items() if name == sub.name and d not in sub.held]:
            del holder_of[d]  # acked, revoked, or given back by not holding it
        for e in reply.episodes:
            d = e.delivery_id
            assert d not in acked, "an acknowledged episode was handed out again"
            assert e.redelivered == (d in ever_delivered)  # marked exactly when handed out before
            holder = holder_of.get(d)
            if holder is not None and holder != sub.name:
                # the previous holder's lease must have run out
                assert last_contact[holder] + subs[holder].lease <= now, "leased to two subscribers at once"
            holder_of[d] = sub.name
            ever_delivered.add(d)

    for _ in range(4000):
        now += rng.choice([0.0, 0.05, 0.3])
        op = rng.random()
        if op < 0.3 and added < 400:
            try:
                box.reserve()
            except Refusal:
                pass
            else:
                added += 1
                assert box.add(episode(f"e{added}"), "c", now) == []
        elif op < 0.9:
            sub = subs[rng.choice(list(subs))]
            if not alive[sub.name]:
                alive[sub.name], sub.held = True, []  # a restarted subscriber holds nothing
            fetch(sub, rng.randrange(0, 4), [d for d in sub.held if rng.random() < 0.7])
        elif op < 0.95:
            alive[rng.choice(list(subs))] = False  # crashed: stops polling, its leases will expire
        box.expire(now)
    # drain: every subscriber comes back and acks everything until the outbox is empty
    for sub in subs.values():
        if not alive[sub.name]:
            sub.held = []
    for _ in range(200):
        now += 5.0
        box.expire(now)
        for sub in subs.values():
            fetch(sub, 8, list(sub.held))
        if box.stats()["outbox_episodes"] == 0:
            break
    stats = box.stats()
    assert stats["outbox_episodes"] == 0 and stats["episodes_acked"] == added > 100
    assert stats["episodes_added"] == added and stats["outbox_bytes"] == 0 and stats["outbox_reserved"] == 0
    assert stats["episodes_redelivered"] > 0 and stats["outbox_full_refusals"] > 0  # the schedule did both
