"""The episode outbox: finished episodes waiting for subscribers, leased to one of them until acknowledged.

Owns at-least-once delivery for `RequestFinish` (trainer `request_finish`, agent finishes): a
bounded store (episodes and bytes; a finish that would not fit is refused with busy before its
session closes, so nothing is lost), ready queues indexed by group and opening client for the
subscription filters, one lease per subscriber (renewed by each `FetchEpisodes`; when it runs
out, its unacknowledged episodes go back to the queue marked redelivered), and long polls
parked until an episode matches or their wait ends. A durable broker logs each change through
`journal` and restores the outbox after a restart (`restore*`: delivery ids and epoch kept, so
subscribers' acks still apply). Pure bookkeeping like `sessions/registry.py`: no sockets and no clock of
its own (callers pass `now`); envelopes are opaque. Imports the stdlib, `broker.protocol`,
`broker.episodes.journal` and `broker.sessions.registry` (for `Refusal`) only.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field

from broker import protocol
from broker.episodes.journal import NO_JOURNAL, EpisodeJournal
from broker.sessions.session import Refusal

logger = logging.getLogger(__name__)

Envelope = list[bytes]
Reply = tuple[Envelope, protocol.Message]
_Queue = OrderedDict[int, "_Entry"]

# Bounds on one FetchEpisodes' id lists and subscriber id (a subscriber holds at most its credit).
MAX_IDS_PER_FETCH = 10_000
MAX_SUBSCRIBER_ID_LEN = 256
_ROW_OVERHEAD_BYTES = 256  # the row record, its metadata and strings, for the bytes bound


@dataclass(slots=True, eq=False)
class _Entry:
    episode: protocol.DeliveredEpisode  # delivery_id set; `redelivered` is kept below
    client_id: str
    nbytes: int
    redelivered: bool = False
    holder: str | None = None  # the subscriber it is leased to; None while ready

    @property
    def delivery_id(self) -> int:
        return self.episode.delivery_id


@dataclass(slots=True, eq=False)
class _Subscriber:
    subscriber_id: str
    lease: float
    deadline: float  # past it (and not parked), its leases expire
    leased: dict[int, _Entry] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class _Poll:
    envelope: Envelope
    request_id: int
    subscriber: _Subscriber
    credit: int
    client_id: str | None
    group: str | None
    deadline: float
    revoked: list[int]
    acked: int


def _episode_bytes(episode: protocol.DeliveredEpisode) -> int:
    n = _ROW_OVERHEAD_BYTES
    for row in episode.rows:
        n += 4 * len(row.token_ids) + len(row.loss_mask) + 4 * len(row.logprobs) + len(row.response)
        n += _ROW_OVERHEAD_BYTES
    return n


class Outbox:
    """Finished episodes, each leased to at most one subscriber at a time, kept until acknowledged.

    Args:
        max_episodes: episodes held (ready, leased or promised by an accepted finish) at most.
        max_bytes: approximate row bytes held at most.
        max_wait: ceiling on a long poll's wait, seconds.
        max_lease: ceiling on a subscriber's lease, seconds.
        max_credit: episodes one reply carries at most.
    """

    def __init__(
        self, *, max_episodes: int, max_bytes: int, max_wait: float, max_lease: float, max_credit: int
    ) -> None:
        # Delivery ids restart with an in-memory broker; the epoch tells a subscriber's old ids from new
        # ones. A durable broker keeps both across restarts (`restore_ids`), so acks of held episodes still apply.
        self.epoch = secrets.token_hex(8)
        self.journal: EpisodeJournal = NO_JOURNAL  # a durable broker's log (`broker.durability`)
        self._max_episodes = max_episodes
        self._max_bytes = max_bytes
        self._max_wait = max_wait
        self._max_lease = max_lease
        self._max_credit = max_credit
        self.next_delivery_id = 1
        self._entries: dict[int, _Entry] = {}
        self._ready: _Queue = OrderedDict()
        self._ready_by_group: dict[str, _Queue] = {}
        self._ready_by_client: dict[str, _Queue] = {}
        self._subscribers: dict[str, _Subscriber] = {}
        self._polls: OrderedDict[str, _Poll] = OrderedDict()  # parked long polls, oldest first
        self._reserved = 0
        self._bytes = 0
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "episodes_added",
                "episodes_delivered",
                "episodes_redelivered",
                "episodes_acked",
                "leases_expired",
                "outbox_full_refusals",
            ),
            0,
        )

    # --- finishes --------------------------------------------------------------------------

    def reserve(self, *, force: bool = False) -> None:
        """Promise room for one episode (an accepted finish); a Refusal "busy" if the outbox is full.

        `force`: a promise made before a restart, which must be kept whatever the room.
        """
        held = len(self._entries) + self._reserved
        if not force and (held >= self._max_episodes or self._bytes >= self._max_bytes):
            self.counters["outbox_full_refusals"] += 1
            raise Refusal(
                "busy",
                f"the episode outbox is full ({held} episodes, {self._bytes} bytes; limits {self._max_episodes}, "
                f"{self._max_bytes}): subscribers must acknowledge episodes before more sessions can finish; "
                "the session is still open, retry the finish later",
            )
        self._reserved += 1

    def unreserve(self) -> None:
        """Give back a promise whose episode will never come (the session was dropped)."""
        self._reserved = max(0, self._reserved - 1)

    def add(self, episode: protocol.DeliveredEpisode, client_id: str, now: float) -> list[Reply]:
        """Store a finished episode (its room was reserved); returns answers to parked polls it satisfies."""
        self._reserved = max(0, self._reserved - 1)
        delivery_id = self.next_delivery_id
        self.next_delivery_id += 1
        entry = _Entry(dataclasses.replace(episode, delivery_id=delivery_id), client_id, _episode_bytes(episode))
        self._entries[entry.delivery_id] = entry
        self._bytes += entry.nbytes
        self.counters["episodes_added"] += 1
        self.journal.episode_added(entry.episode, client_id)
        self._make_ready(entry, front=False)
        return self._offer(now)

    # --- subscribers -----------------------------------------------------------------------

    def fetch(
        self, envelope: Envelope, msg: protocol.FetchEpisodes, now: float
    ) -> tuple[protocol.EpisodesDelivered | None, list[Reply]]:
        """Apply a subscriber's request; returns its answer (None: parked) and answers to other parked polls."""
        self._validate(msg)
        self._polls.pop(msg.subscriber_id, None)  # a newer request supersedes: the subscriber gave up on it
        sub = self._subscribers.get(msg.subscriber_id)
        if sub is None:
            sub = self._subscribers[msg.subscriber_id] = _Subscriber(msg.subscriber_id, msg.lease, now)
        sub.lease = min(msg.lease, self._max_lease)
        current = msg.epoch == self.epoch  # else its ids name another broker's episodes
        acked_ids = [d for d in msg.acks if self._ack(d)] if current else []
        acked = len(acked_ids)
        if acked_ids:
            self.journal.episodes_acked(acked_ids)
        if current:
            self._requeue([sub.leased.pop(d) for d in msg.release if d in sub.leased], redelivered=False)
        held = set(msg.held) if current else set()
        # Leased to it but neither held nor acknowledged: our reply was lost, or it forgot them.
        # It may have seen them, so whoever gets them next is told.
        self._requeue([sub.leased.pop(d) for d in list(sub.leased) if d not in held], redelivered=True)
        revoked = [d for d in msg.held if d not in sub.leased] if current else list(msg.held)
        credit = min(msg.credit, self._max_credit)
        taken = self._take(credit, msg.client_id, msg.group)
        self._lease(sub, taken)
        wait = min(msg.wait, self._max_wait)
        reply: protocol.EpisodesDelivered | None = None
        if taken or credit <= 0 or wait <= 0:
            sub.deadline = now + sub.lease
            reply = self._answer(msg.request_id, taken, revoked, acked)
        else:
            deadline = now + wait
            self._polls[sub.subscriber_id] = _Poll(
                envelope, msg.request_id, sub, credit, msg.client_id, msg.group, deadline, revoked, acked
            )
            sub.deadline = deadline + sub.lease  # parked: alive at least until we answer
        others = self._offer(now)  # what it gave back may suit a parked poll
        self._forget_if_idle(sub)
        return reply, others

    def expire(self, now: float) -> list[Reply]:
        """Answer long polls whose wait ended; requeue the episodes of subscribers whose lease ran out."""
        out: list[Reply] = []
        for poll in [p for p in self._polls.values() if p.deadline <= now]:
            del self._polls[poll.subscriber.subscriber_id]
            poll.subscriber.deadline = now + poll.subscriber.lease
            out.append((poll.envelope, self._answer(poll.request_id, [], poll.revoked, poll.acked)))
            self._forget_if_idle(poll.subscriber)
        expired = [s for s in self._subscribers.values() if s.deadline <= now and s.subscriber_id not in self._polls]
        for sub in expired:
            del self._subscribers[sub.subscriber_id]
            if sub.leased:
                self.counters["leases_expired"] += 1
                logger.warning(
                    "subscriber %s missed its %.1fs lease: %d unacknowledged episode(s) requeued for redelivery",
                    sub.subscriber_id,
                    sub.lease,
                    len(sub.leased),
                )
            self._requeue(list(sub.leased.values()), redelivered=True)
        if expired:
            out += self._offer(now)
        return out

    def next_deadline(self) -> float | None:
        """When `expire` next has something to do (None: nothing pending)."""
        if not self._subscribers:  # the loop asks on every wake-up; without subscribers there is no poll either
            return None
        times = [p.deadline for p in self._polls.values()]
        times += [s.deadline for s in self._subscribers.values() if s.subscriber_id not in self._polls]
        return min(times, default=None)

    def close(self) -> list[Reply]:
        """At shutdown: answer every parked poll with nothing, so subscribers see the broker go."""
        out: list[Reply] = [
            (p.envelope, self._answer(p.request_id, [], p.revoked, p.acked)) for p in self._polls.values()
        ]
        self._polls.clear()
        return out

    def stats(self) -> dict[str, int]:
        leased = sum(len(s.leased) for s in self._subscribers.values())
        return {
            "outbox_episodes": len(self._entries),
            "outbox_ready": len(self._ready),
            "outbox_leased": leased,
            "outbox_reserved": self._reserved,
            "outbox_bytes": self._bytes,
            "subscribers": len(self._subscribers),
            "polls_parked": len(self._polls),
            **self.counters,
        }

    # --- a durable broker's snapshots and recovery (`broker.durability`) ---------------------

    def delivery_ids(self) -> list[int]:
        """Every episode held (ready or leased), oldest first."""
        return list(self._entries)

    def entry(self, delivery_id: int) -> tuple[protocol.DeliveredEpisode, str, str | None, float, bool] | None:
        """An episode held: (episode, opening client, holder or None, the holder's lease, redelivered); or None."""
        entry = self._entries.get(delivery_id)
        if entry is None:
            return None
        holder = self._subscribers.get(entry.holder) if entry.holder is not None else None
        lease = holder.lease if holder is not None else 0.0
        return entry.episode, entry.client_id, entry.holder, lease, entry.redelivered

    def restore_ids(self, epoch: str, next_delivery_id: int) -> None:
        """Continue a previous run's delivery ids: its subscribers' acks and held ids stay valid."""
        self.epoch = epoch
        self.next_delivery_id = max(self.next_delivery_id, next_delivery_id)

    def restore(self, episode: protocol.DeliveredEpisode, client_id: str, *, redelivered: bool = False) -> None:
        """Put back an episode (its delivery id kept) as ready; a no-op for one held already."""
        if episode.delivery_id in self._entries:
            return
        entry = _Entry(episode, client_id, _episode_bytes(episode), redelivered)
        self._entries[entry.delivery_id] = entry
        self._bytes += entry.nbytes
        self.next_delivery_id = max(self.next_delivery_id, episode.delivery_id + 1)
        self._make_ready(entry, front=False)

    def restore_lease(self, subscriber_id: str, lease: float, delivery_ids: list[int], now: float) -> None:
        """Lease held episodes to a subscriber again, from wherever they are; its lease runs from `now`."""
        entries = [self._entries[d] for d in delivery_ids if d in self._entries]
        if not entries:
            return
        sub = self._subscribers.get(subscriber_id)
        if sub is None:
            sub = self._subscribers[subscriber_id] = _Subscriber(subscriber_id, lease, now + lease)
        sub.lease, sub.deadline = lease, now + lease
        for entry in entries:
            self._detach(entry)
            entry.holder = subscriber_id
            sub.leased[entry.delivery_id] = entry

    def restore_ack(self, delivery_ids: list[int]) -> None:
        for d in delivery_ids:
            self._ack(d)

    def restore_requeue(self, delivery_ids: list[int], redelivered: bool) -> None:
        entries = [self._entries[d] for d in delivery_ids if d in self._entries]
        for entry in entries:
            self._detach(entry)
        self._ready_first(entries, redelivered)

    def _detach(self, entry: _Entry) -> None:
        """Take an episode out of the ready queues or its holder's lease."""
        if entry.holder is None:
            self._unready(entry)
            return
        holder = self._subscribers.get(entry.holder)
        if holder is not None:
            holder.leased.pop(entry.delivery_id, None)
            self._forget_if_idle(holder)
        entry.holder = None

    # --- internals -------------------------------------------------------------------------

    def _validate(self, msg: protocol.FetchEpisodes) -> None:
        if not 0 < len(msg.subscriber_id) <= MAX_SUBSCRIBER_ID_LEN:
            raise Refusal("bad_request", f"subscriber_id must be 1-{MAX_SUBSCRIBER_ID_LEN} characters")
        if msg.credit < 0:
            raise Refusal("bad_request", f"credit must be >= 0, got {msg.credit}")
        if not (math.isfinite(msg.wait) and msg.wait >= 0):
            raise Refusal("bad_request", f"wait must be a finite number >= 0, got {msg.wait!r}")
        if not (math.isfinite(msg.lease) and msg.lease > 0):
            raise Refusal("bad_request", f"lease must be a finite number > 0, got {msg.lease!r}")
        if max(len(msg.acks), len(msg.held), len(msg.release)) > MAX_IDS_PER_FETCH:
            raise Refusal("bad_request", f"at most {MAX_IDS_PER_FETCH} delivery ids per list")

    def _answer(
        self, request_id: int, taken: list[_Entry], revoked: list[int], acked: int
    ) -> protocol.EpisodesDelivered:
        episodes = [dataclasses.replace(e.episode, redelivered=e.redelivered) for e in taken]
        return protocol.EpisodesDelivered(request_id, self.epoch, episodes, revoked, acked)

    def _ack(self, delivery_id: int) -> bool:
        """Forget an episode for good, whoever holds it now (a late ack of a redelivered one still counts)."""
        entry = self._entries.pop(delivery_id, None)
        if entry is None:
            return False
        if entry.holder is None:
            self._unready(entry)
        else:
            holder = self._subscribers.get(entry.holder)
            if holder is not None:
                holder.leased.pop(delivery_id, None)
        self._bytes -= entry.nbytes
        self.counters["episodes_acked"] += 1
        return True

    def _lease(self, sub: _Subscriber, taken: list[_Entry]) -> None:
        if taken:
            self.journal.episodes_leased(sub.subscriber_id, sub.lease, [e.delivery_id for e in taken])
        for entry in taken:
            entry.holder = sub.subscriber_id
            sub.leased[entry.delivery_id] = entry
            self.counters["episodes_delivered"] += 1
            if entry.redelivered:
                self.counters["episodes_redelivered"] += 1

    def _forget_if_idle(self, sub: _Subscriber) -> None:
        if not sub.leased and sub.subscriber_id not in self._polls:
            self._subscribers.pop(sub.subscriber_id, None)

    def _queues(self, entry: _Entry, create: bool) -> list[_Queue]:
        group, client = entry.episode.group, entry.client_id
        queues = [self._ready]
        for index, key in ((self._ready_by_group, group), (self._ready_by_client, client)):
            if key:
                queue = index.setdefault(key, OrderedDict()) if create else index.get(key)
                if queue is not None:
                    queues.append(queue)
        return queues

    def _requeue(self, entries: list[_Entry], *, redelivered: bool) -> None:
        """Back to the ready queues, ahead of newer episodes (they are the oldest), in their own order."""
        if entries:
            self.journal.episodes_requeued([e.delivery_id for e in entries], redelivered)
        self._ready_first(entries, redelivered)

    def _ready_first(self, entries: list[_Entry], redelivered: bool) -> None:
        for entry in sorted(entries, key=lambda e: e.delivery_id, reverse=True):
            entry.redelivered = entry.redelivered or redelivered
            self._make_ready(entry, front=True)

    def _make_ready(self, entry: _Entry, *, front: bool) -> None:
        entry.holder = None
        for queue in self._queues(entry, create=True):
            queue[entry.delivery_id] = entry
            if front:
                queue.move_to_end(entry.delivery_id, last=False)

    def _unready(self, entry: _Entry) -> None:
        self._ready.pop(entry.delivery_id, None)
        group, client = entry.episode.group, entry.client_id
        for index, key in ((self._ready_by_group, group), (self._ready_by_client, client)):
            queue = index.get(key) if key else None
            if queue is not None:
                queue.pop(entry.delivery_id, None)
                if not queue:
                    del index[key]  # type: ignore[arg-type]

    def _take(self, credit: int, client_id: str | None, group: str | None) -> list[_Entry]:
        """Up to `credit` ready episodes matching the filters, oldest first, taken out of the ready queues."""
        if credit <= 0:
            return []
        by_client = self._ready_by_client.get(client_id) if client_id is not None else None
        by_group = self._ready_by_group.get(group) if group is not None else None
        if client_id is not None and group is not None:
            if not by_client or not by_group:
                return []
            source = by_client if len(by_client) <= len(by_group) else by_group  # scan the shorter one
        elif client_id is not None or group is not None:
            one = by_client if client_id is not None else by_group
            if not one:
                return []
            source = one
        else:
            source = self._ready
        taken: list[_Entry] = []
        for entry in source.values():
            if (client_id is None or entry.client_id == client_id) and (group is None or entry.episode.group == group):
                taken.append(entry)
                if len(taken) == credit:
                    break
        for entry in taken:
            self._unready(entry)
        return taken

    def _offer(self, now: float) -> list[Reply]:
        """Hand ready episodes to parked polls, oldest poll first; returns the answers to send."""
        out: list[Reply] = []
        for poll in list(self._polls.values()):
            if not self._ready:
                break
            taken = self._take(poll.credit, poll.client_id, poll.group)
            if not taken:
                continue
            del self._polls[poll.subscriber.subscriber_id]
            self._lease(poll.subscriber, taken)
            poll.subscriber.deadline = now + poll.subscriber.lease
            out.append((poll.envelope, self._answer(poll.request_id, taken, poll.revoked, poll.acked)))
        return out
