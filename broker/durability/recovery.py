"""Recovery: rebuild the registry and the outbox from the newest snapshot and the log segments after it.

Loads the snapshot's images (sessions with their turn stores, unacknowledged episodes with their
holders, the outbox's epoch and next delivery id, the finished-session memory), then replays every
record of the segments from the snapshot's on, in order, through the same registry calls that made
them (a commit frame goes through `commit_turn` again, so delta commits meet the same bases) —
skipping, per session and per episode, the records an image already reflects (those before its
position). Records of a session that ended before its image was taken find no session and change
nothing. A torn last record is dropped (the segment is truncated there, with a log line); damage
anywhere else raises `CorruptLog`, unless `truncate_corrupt` drops the log from that record on.
Sessions a RequestFinish was closing come back closing; `pending` holds their requests for the
server to resume, and `answers` the finishes' replies a repeated FinishSession may still ask for.
Imports the stdlib, `broker.protocol`, `broker.sessions`, `broker.episodes` and `broker.durability`;
no sockets.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from broker import protocol
from broker.durability import records
from broker.durability.images import restore_session
from broker.durability.journal import request_of
from broker.durability.records import STATE, WORKER_FRAME
from broker.durability.snapshots import Snapshot, list_snapshots, read_snapshot, snapshot_path
from broker.durability.wal import CorruptLog, SegmentReader, list_segments, position, segment_path
from broker.episodes.answers import AnswerItem, FinishAnswers
from broker.episodes.outbox import Outbox
from broker.generation import Generation
from broker.protocol import session_tag
from broker.sessions.registry import SessionRegistry
from broker.sessions.session import FinishOrigin, Refusal
from broker.sessions.workers import WORKER_LOST

logger = logging.getLogger(__name__)


@dataclass
class Recovered:
    """What a recovery found: where the log goes on, the finishes to resume, and counts for the log line."""

    snapshot_seq: int
    next_seq: int  # the segment the log continues with
    pending: dict[str, protocol.RequestFinish] = field(default_factory=dict)
    answers: list[AnswerItem] = field(default_factory=list)  # oldest first (`episodes.answers`)
    snapshot_bytes: int = 0
    log_bytes: int = 0
    records: int = 0
    skipped: int = 0  # records an image already reflected
    absent: int = 0  # records of sessions that ended before their image was taken
    refused: int = 0  # records the registry refused on replay (none is expected)
    torn: str | None = None
    seconds: float = 0.0


class Replay:
    """Applies a snapshot and then log records, in order, to a fresh registry and outbox."""

    def __init__(self, registry: SessionRegistry, outbox: Outbox, now: float, generation: Generation) -> None:
        self.registry = registry
        self.outbox = outbox
        self.generation = generation
        self.now = now
        self.pending: dict[str, protocol.RequestFinish] = {}
        self.answers = FinishAnswers()  # bounded as the log replays: only the recent ones are kept
        # Per object, the log position its image reflects: its records before it are skipped.
        self._session_at: dict[str, int] = {}
        self._episode_at: dict[int, int] = {}
        self.skipped = self.absent = self.refused = 0

    # --- the snapshot ------------------------------------------------------------------------

    def load(self, snap: Snapshot) -> None:
        header = snap.header
        self.outbox.restore_ids(header.epoch, header.next_delivery_id)
        origins: list[FinishOrigin] = header.finished_origins  # type: ignore[assignment]
        self.registry.restore_finished(list(zip(header.finished_ids, origins, strict=True)))
        self.registry.weight_version = header.weight_version
        if header.generation:
            self.generation.restore(*header.generation)
        answers = zip(header.answer_ids, header.answer_request_ids, header.answer_frames, strict=True)
        self.answers.restore(list(answers), self.now)
        for image in snap.sessions:
            try:
                session = restore_session(image.image)
            except ValueError as e:
                raise records.RecordError(f"snapshot {snap.seq:016x}: {e}") from e
            self.registry.restore(session)
            self._session_at[session.sid] = image.position
            if image.pending is not None:
                close = records.decode_log(image.pending)
                assert isinstance(close, records.CloseRecord)
                self.pending[session.sid] = request_of(close)
        for ep in snap.episodes:
            episode = records.decode_episode(ep.episode)
            self.outbox.restore(episode, ep.client_id, redelivered=ep.redelivered)
            if ep.holder is not None:
                self.outbox.restore_lease(ep.holder, ep.lease, [ep.delivery_id], self.now)
            self._episode_at[ep.delivery_id] = ep.position

    # --- the log -----------------------------------------------------------------------------

    def apply(self, pos: int, kind: int, payload: memoryview) -> None:
        if kind == WORKER_FRAME:
            self._worker_frame(pos, protocol.decode_worker_to_broker(payload))  # type: ignore[arg-type]
        elif kind == STATE:
            self._state(pos, records.decode_log(payload))
        else:
            raise records.RecordError(f"a record of unknown kind {kind}")

    def _skip_session(self, sid: str, pos: int) -> bool:
        at = self._session_at.get(sid)
        if at is not None and pos < at:
            self.skipped += 1
            return True
        return False

    def _episode_ids(self, ids: list[int], pos: int) -> list[int]:
        at = self._episode_at
        kept = [d for d in ids if d not in at or pos >= at[d]]
        self.skipped += len(ids) - len(kept)
        return kept

    def _worker_frame(self, pos: int, msg: protocol.WorkerToBroker) -> None:
        if isinstance(msg, (protocol.Heartbeat, protocol.GetMetrics)):
            raise records.RecordError(f"a logged {msg.TAG} (only turns' frames are logged)")
        sid = msg.session_id
        if self._skip_session(sid, pos):
            return
        registry = self.registry
        if sid not in registry:
            self.absent += 1
            return
        try:
            match msg:
                case protocol.CommitTurn():
                    registry.commit_turn(msg)
                case protocol.OpenTurn():
                    registry.open_turn(sid, msg.turn_id, msg.worker_id, msg.request_digest)
                case protocol.AbortTurn() if msg.reason == WORKER_LOST:
                    registry.abandon_turn(sid, msg.turn_id)
                case protocol.AbortTurn():
                    registry.abort_turn(sid, msg.turn_id)
                case _:
                    raise records.RecordError(f"a logged {msg.TAG} frame (only turns' frames are logged)")
        except Refusal as r:
            self.refused += 1
            logger.warning("replaying %s of session %s: refused (%s)", msg.TAG, session_tag(sid), r.message)

    def _state(self, pos: int, record: records.LogRecord) -> None:
        registry, outbox = self.registry, self.outbox
        match record:
            case records.OpenRecord():
                sid = record.session_id
                if self._skip_session(sid, pos):
                    return
                try:
                    registry.open_session(sid, **records.session_settings(record))
                except Refusal as r:  # e.g. a smaller max_sessions than before the restart
                    self.refused += 1
                    logger.warning("replaying the open of session %s: refused (%s)", session_tag(sid), r.message)
            case records.CloseRecord():
                sid = record.session_id
                if self._skip_session(sid, pos):
                    return
                if sid not in registry:
                    self.absent += 1
                    return
                registry.close(sid, record.origin)  # type: ignore[arg-type]
                self.pending[sid] = request = request_of(record)
                if request.request_id:  # 0: logged by a broker that did not keep it
                    self.answers.accept(request, self.now)
            case records.FinishRecord() | records.DropRecord():
                sid = record.session_id
                if self._skip_session(sid, pos):
                    return
                origin = record.origin if isinstance(record, records.FinishRecord) else "dropped"
                self._end(sid, origin)
                if isinstance(record, records.FinishRecord) and record.answer is not None:
                    self.answers.remember(sid, record.request_id, record.answer, self.now)
            case records.EpisodeRecord():
                sid = record.session_id
                episode = records.decode_episode(record.episode)
                if not self._skip_session(sid, pos):
                    self._end(sid, episode.finished_by)
                if self._episode_ids([record.delivery_id], pos):
                    outbox.restore(episode, record.client_id)
            case records.LeaseRecord():
                ids = self._episode_ids(record.delivery_ids, pos)
                outbox.restore_lease(record.subscriber_id, record.lease, ids, self.now)
            case records.AckRecord():
                outbox.restore_ack(self._episode_ids(record.delivery_ids, pos))
            case records.RequeueRecord():
                outbox.restore_requeue(self._episode_ids(record.delivery_ids, pos), record.redelivered)
            case records.VersionRecord():
                registry.weight_version = record.version
            case records.PauseRecord():
                self.generation.restore(record.epoch, record.paused, record.since)
            case _:
                raise records.RecordError(f"a {type(record).__name__} in the log")


    def _end(self, sid: str, origin: str) -> None:
        """A session's end: freed, or (ended before its image was taken) at least remembered as finished."""
        if not self.registry.forget(sid, origin):  # type: ignore[arg-type]
            self.absent += 1
            self.registry.restore_finished([(sid, origin)])  # type: ignore[list-item]
        self.pending.pop(sid, None)


def recover(
    directory: Path, registry: SessionRegistry, outbox: Outbox, generation: Generation, *,
    truncate_corrupt: bool = False,
) -> Recovered | None:
    """Rebuild `registry`, `outbox` and `generation` (all fresh) from `directory`; None if it holds no state yet.

    Segments and snapshots older than the newest snapshot (left by a cleanup a crash interrupted)
    are deleted; a torn tail is truncated away, so the log continues cleanly in a new segment.
    """
    t0 = time.monotonic()
    snaps = list_snapshots(directory)
    segments = list_segments(directory)
    if not snaps:
        if segments:
            raise records.RecordError(f"{directory} holds log segments but no snapshot: not a state directory we wrote")
        return None
    seq = snaps[-1]
    snap = read_snapshot(snapshot_path(directory, seq), seq)
    replay = Replay(registry, outbox, time.monotonic(), generation)
    replay.load(snap)
    result = Recovered(seq, seq, snapshot_bytes=snap.nbytes)
    live = [s for s in segments if s >= seq]
    for i, s in enumerate(live):
        path = segment_path(directory, s)
        reader = SegmentReader(path, tail=i == len(live) - 1)
        try:
            for offset, kind, payload in reader:
                try:
                    replay.apply(position(s, offset), kind, payload)
                except (records.RecordError, protocol.ProtocolError) as e:
                    raise CorruptLog(path, offset, f"an unreadable record ({e})") from e
                result.records += 1
        except CorruptLog as e:
            if not truncate_corrupt:
                raise
            logger.error("%s; wal_truncate_corrupt is set: the log is cut there, later segments are removed", e)
            _truncate(path, e.offset)
            for later in live[i + 1 :]:
                segment_path(directory, later).unlink()
            result.log_bytes += e.offset
            result.next_seq = s + 1
            break
        result.log_bytes += reader.end
        result.next_seq = s + 1
        if reader.torn is not None:
            result.torn = f"{path.name}: {reader.torn}"
            logger.warning("the last log record was torn by the crash and is dropped: %s", result.torn)
            _truncate(path, reader.end)
    for old in segments:
        if old < seq:
            segment_path(directory, old).unlink()
    for old in snaps[:-1]:
        snapshot_path(directory, old).unlink()
    for unfinished in directory.glob("snap-*.tmp"):  # a snapshot the crash interrupted
        unfinished.unlink()
    result.pending, result.answers = replay.pending, replay.answers.items()
    result.skipped, result.absent, result.refused = replay.skipped, replay.absent, replay.refused
    result.seconds = time.monotonic() - t0
    return result


def _truncate(path: Path, size: int) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)
