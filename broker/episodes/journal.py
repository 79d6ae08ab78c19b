"""The seam a durable broker logs its changes through, and the journal of a broker that logs nothing.

The handlers (worker frames, opens, drops, weight versions, pauses), `Finishes` and `Outbox` call their
journal right after each change that a restart must not lose (a stored commit, a close by request,
a finish, an episode handed to the outbox, its leases, acks and requeues). `broker.durability.journal`
implements `BrokerJournal` by appending log records, which the server writes before it sends any reply;
a broker without a state directory has `NO_JOURNAL`, whose calls do nothing, so no caller asks which one
it has. Imports only the stdlib, `broker.protocol` and `broker.sessions` (the Session type); never
`broker.durability`.
"""

from __future__ import annotations

from typing import Protocol

from broker import protocol
from broker.sessions.session import Session


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


class BrokerJournal(EpisodeJournal, Protocol):
    """Every durable change: the episode side's and the handlers'."""

    def worker_frame(self, frame: bytes) -> None:
        """An OpenTurn, a stored CommitTurn or an AbortTurn, exactly as received."""

    def turn_abandoned(self, sid: str, turn_id: str) -> None:
        """An in-flight turn given up with its silent worker."""

    def session_opened(self, session: Session) -> None:
        """A session opened, with its settings."""

    def session_dropped(self, sid: str) -> None:
        """A session dropped without rows."""

    def weight_version_set(self, version: int) -> None:
        """The trainer set the policy version."""

    def generation_changed(self, epoch: int, paused: str, since: float) -> None:
        """The trainer paused generation (`paused`: its mode) or resumed it ("")."""


class NoJournal:
    """The journal of a broker without a state directory: nothing is logged."""

    def finish_requested(self, msg: protocol.RequestFinish, origin: str) -> None:
        pass

    def session_finished(self, session_id: str, origin: str, request_id: int = 0, answer: bytes | None = None) -> None:
        pass

    def episode_added(self, episode: protocol.DeliveredEpisode, client_id: str) -> None:
        pass

    def episodes_leased(self, subscriber_id: str, lease: float, delivery_ids: list[int]) -> None:
        pass

    def episodes_acked(self, delivery_ids: list[int]) -> None:
        pass

    def episodes_requeued(self, delivery_ids: list[int], redelivered: bool) -> None:
        pass

    def worker_frame(self, frame: bytes) -> None:
        pass

    def turn_abandoned(self, sid: str, turn_id: str) -> None:
        pass

    def session_opened(self, session: Session) -> None:
        pass

    def session_dropped(self, sid: str) -> None:
        pass

    def weight_version_set(self, version: int) -> None:
        pass

    def generation_changed(self, epoch: int, paused: str, since: float) -> None:
        pass


NO_JOURNAL = NoJournal()
