"""The seam a durable broker logs the episode side through: what finishes and the outbox report as they change.

`Finishes` and `Outbox` call an `EpisodeJournal`, when they are given one, right after each change
of theirs that a restart must not lose (a close by request, a finish, an episode handed to the
outbox, its leases, acks and requeues); `broker.durability.journal` implements it by appending log
records, which the server writes before it sends any reply. Without one (no state directory) they
call nothing. Imports only the stdlib and `broker.protocol`; never `broker.durability`.
"""

from __future__ import annotations

from typing import Protocol

from broker import protocol


class EpisodeJournal(Protocol):
    """Receives the episode side's durable changes, in the order they happen."""

    def finish_requested(self, msg: protocol.RequestFinish, origin: str) -> None:
        """A RequestFinish closed its session: its episode is promised (it reaches the outbox later)."""

    def session_finished(self, session_id: str, origin: str, request_id: int = 0, answer: bytes | None = None) -> None:
        """A FinishSession built its session's rows and freed it (before the rows are sent); `answer`: the reply
        frame they go in, for request `request_id` (None: the rows failed to build)."""

    def episode_added(self, episode: protocol.DeliveredEpisode, client_id: str) -> None:
        """An episode (its `delivery_id` set) entered the outbox; its session is over."""

    def episodes_leased(self, subscriber_id: str, lease: float, delivery_ids: list[int]) -> None:
        """Episodes were leased to a subscriber."""

    def episodes_acked(self, delivery_ids: list[int]) -> None:
        """Episodes were acknowledged, for good."""

    def episodes_requeued(self, delivery_ids: list[int], redelivered: bool) -> None:
        """Leased episodes went back to the ready queue (`redelivered`: marked so for their next holder)."""
