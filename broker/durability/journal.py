"""Journal: the broker's changes as log records, appended to the write-ahead log's buffer.

The server hands it each worker frame it carried out (OpenTurn, CommitTurn stored, AbortTurn: the
frame as received), each session it opened or dropped; `Finishes` and `Outbox` call it through the
`broker.episodes.journal.EpisodeJournal` seam. Appending only buffers: the server commits the buffer
(`LogWriter.commit`) before it sends any reply, so nothing is acknowledged before it is logged.
Imports the stdlib, `broker.protocol`, `broker.sessions` (for the Session type) and
`broker.durability`; no sockets.
"""

from __future__ import annotations

from broker import protocol
from broker.durability import records
from broker.durability.records import STATE, WORKER_FRAME
from broker.durability.wal import LogWriter
from broker.sessions.session import Session
from broker.sessions.workers import WORKER_LOST


class Journal:
    """Appends records for the registry's and the episode side's durable changes (an `EpisodeJournal`)."""

    def __init__(self, writer: LogWriter) -> None:
        self._writer = writer
        self._append = writer.append

    # --- the server's: worker frames and the trainer's opens and drops ---------------------

    def worker_frame(self, frame: bytes) -> None:
        """An OpenTurn, a stored CommitTurn or an AbortTurn, exactly as received."""
        self._append(WORKER_FRAME, frame)

    def turn_abandoned(self, sid: str, turn_id: str) -> None:
        """An in-flight turn given up with its silent worker: logged as an AbortTurn that says so (`WORKER_LOST`)."""
        self._append(WORKER_FRAME, protocol.encode(protocol.AbortTurn(0, sid, turn_id, WORKER_LOST)))

    def session_opened(self, session: Session) -> None:
        self._state(records.open_record(session))

    def session_dropped(self, sid: str) -> None:
        self._state(records.DropRecord(sid))

    def weight_version_set(self, version: int) -> None:
        self._state(records.VersionRecord(version))

    def generation_changed(self, epoch: int, paused: str, since: float) -> None:
        self._state(records.PauseRecord(epoch, paused, since))

    # --- EpisodeJournal ----------------------------------------------------------------------

    def finish_requested(self, msg: protocol.RequestFinish, origin: str) -> None:
        self._state(close_record(msg, origin))

    def session_finished(self, session_id: str, origin: str, request_id: int = 0, answer: bytes | None = None) -> None:
        self._state(records.FinishRecord(session_id, origin, request_id, answer))

    def episode_added(self, episode: protocol.DeliveredEpisode, client_id: str) -> None:
        self._state(
            records.EpisodeRecord(episode.delivery_id, episode.session_id, client_id, records.encode_episode(episode))
        )

    def episodes_leased(self, subscriber_id: str, lease: float, delivery_ids: list[int]) -> None:
        self._state(records.LeaseRecord(subscriber_id, lease, delivery_ids))

    def episodes_acked(self, delivery_ids: list[int]) -> None:
        self._state(records.AckRecord(delivery_ids))

    def episodes_requeued(self, delivery_ids: list[int], redelivered: bool) -> None:
        self._state(records.RequeueRecord(delivery_ids, redelivered))

    def _state(self, record: records.Record) -> None:
        self._append(STATE, records.encode(record))


def close_record(msg: protocol.RequestFinish, origin: str) -> records.CloseRecord:
    return records.CloseRecord(
        msg.session_id, origin, msg.reward, msg.rollout_id, msg.metadata, msg.wait_timeout, msg.request_id
    )


def request_of(close: records.CloseRecord) -> protocol.RequestFinish:
    """The RequestFinish a CloseRecord logged."""
    return protocol.RequestFinish(
        close.request_id, close.session_id, close.reward, close.rollout_id, close.metadata, close.wait_timeout
    )
