"""Snapshots: the live state written object by object, so that a restart loads it instead of replaying history.

A snapshot is begun with a new log segment `seq` (`snap-<seq>.snap`): its header holds what the
outbox and the finished-session memory were at that segment's start; then each session and each
unacknowledged episode that was live then is written as its image (`sessions.images`,
`records.EpisodeImage`), a few per loop pass, each stamped with the log position it reflects. The
state keeps changing meanwhile: an image taken at position p reflects every record before p, so
recovery replays the segments from `seq` on and skips, per session or episode, the records an image
already holds. Once every object is written, the file is synced and renamed into place, and only then
are the older segments and snapshots deleted. Sessions opened after the segment began are in the log
already and are not imaged. Imports the stdlib, `broker.sessions`, `broker.episodes` and
`broker.durability`; no sockets.
"""

from __future__ import annotations

import os
import re
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from broker.durability import records
from broker.durability.journal import close_record
from broker.durability.records import STATE
from broker.durability.wal import SegmentReader, append_record, fsync_directory
from broker.episodes.finishes import Finishes
from broker.episodes.outbox import Outbox
from broker.sessions.images import session_image
from broker.sessions.registry import SessionRegistry

SNAPSHOT_RE = re.compile(r"snap-([0-9a-f]{16})\.snap")


def snapshot_path(directory: Path, seq: int) -> Path:
    return directory / f"snap-{seq:016x}.snap"


def list_snapshots(directory: Path) -> list[int]:
    """The complete snapshots in `directory` by the segment each was begun with, ascending."""
    found = (SNAPSHOT_RE.fullmatch(p.name) for p in directory.iterdir())
    return sorted(int(m.group(1), 16) for m in found if m)


@dataclass
class Snapshot:
    """A snapshot read back: its header, then its images in the order written."""

    seq: int
    header: records.SnapshotHeader
    sessions: list[records.SessionImage] = field(default_factory=list)
    episodes: list[records.EpisodeImage] = field(default_factory=list)
    nbytes: int = 0


def read_snapshot(path: Path, seq: int) -> Snapshot:
    """Every record of a snapshot file; RecordError if it is not a whole snapshot, CorruptLog if damaged."""
    reader = SegmentReader(path, tail=False)  # renamed into place only once synced: no torn tail is possible
    it = iter(reader)
    first = next(it, None)
    header = records.decode_snapshot(first[2]) if first is not None and first[1] == STATE else None
    if not isinstance(header, records.SnapshotHeader):
        raise records.RecordError(f"{path} does not start with a snapshot header")
    if header.byteorder != sys.byteorder:
        raise records.RecordError(f"{path} was written on a {header.byteorder}-endian machine")
    snap = Snapshot(seq, header, nbytes=reader.size)
    trailer = None
    for offset, kind, payload in it:
        record = records.decode_snapshot(payload) if kind == STATE and trailer is None else None
        if isinstance(record, records.SessionImage):
            snap.sessions.append(record)
        elif isinstance(record, records.EpisodeImage):
            snap.episodes.append(record)
        elif isinstance(record, records.SnapshotTrailer):
            trailer = record
        else:
            raise records.RecordError(f"{path}: an unexpected record at offset {offset}")
    if trailer is None or (trailer.sessions, trailer.episodes) != (len(snap.sessions), len(snap.episodes)):
        raise records.RecordError(f"{path} is incomplete (its trailer is missing or does not match its images)")
    return snap


class SnapshotWriter:
    """One snapshot being written: begun with segment `seq`, over the objects live at that segment's start.

    Args:
        directory: the state directory.
        seq: the segment the log rotated to when this snapshot began.
        registry, outbox, finishes: the broker's state, read (never changed) at each step.
        sync: fsync the file and the directory before it is renamed into place.
    """

    def __init__(
        self,
        directory: Path,
        seq: int,
        header: records.SnapshotHeader,
        registry: SessionRegistry,
        outbox: Outbox,
        finishes: Finishes,
        *,
        sync: bool = True,
    ) -> None:
        self.seq = seq
        self._directory = directory
        self._final = snapshot_path(directory, seq)
        self._tmp = self._final.with_suffix(".tmp")
        self._registry, self._outbox, self._finishes = registry, outbox, finishes
        self._sync = sync
        sessions = [(sid, s.serial) for sid in registry.session_ids() if (s := registry.session(sid)) is not None]
        self._sessions = deque(sessions)
        self._episodes = deque(outbox.delivery_ids())
        self._written = [0, 0]  # sessions, episodes
        self.nbytes = 0
        self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        buf = bytearray()
        append_record(buf, STATE, records.encode(header))
        self._write(buf)

    @property
    def remaining(self) -> int:
        return len(self._sessions) + len(self._episodes)

    def step(self, position: int, budget: int) -> bool:
        """Write the next objects (at least one, about `budget` bytes) as of log `position`; True when all are."""
        buf = bytearray()
        registry, sessions = self._registry, self._sessions
        while sessions and len(buf) < budget:
            sid, serial = sessions.popleft()
            session = registry.session(sid)
            if session is None or session.serial != serial:
                continue  # over since the snapshot began (its records from then on are in the log)
            pending = self._finishes.pending_request(sid)
            close = None if pending is None else records.encode(close_record(pending, session.finished_by or "trainer"))
            image = session_image(session, closing=pending is not None)
            append_record(buf, STATE, records.encode(records.SessionImage(position, image, close)))
            self._written[0] += 1
        outbox, episodes = self._outbox, self._episodes
        while not sessions and episodes and len(buf) < budget:
            delivery_id = episodes.popleft()
            held = outbox.entry(delivery_id)
            if held is None:
                continue  # acknowledged since
            episode, client_id, holder, lease, redelivered = held
            episode_image = records.EpisodeImage(
                position, delivery_id, episode.session_id, client_id, holder, lease, redelivered,
                records.encode_episode(episode),
            )  # fmt: skip
            append_record(buf, STATE, records.encode(episode_image))
            self._written[1] += 1
        if buf:
            self._write(buf)
        return not sessions and not episodes

    def finish(self) -> Path:
        """Write the trailer, sync, rename into place (and sync the directory); the snapshot now counts."""
        buf = bytearray()
        append_record(buf, STATE, records.encode(records.SnapshotTrailer(*self._written)))
        self._write(buf)
        if self._sync:
            os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        os.replace(self._tmp, self._final)
        if self._sync:
            fsync_directory(self._directory)
        return self._final

    def abort(self) -> None:
        """Give up on this snapshot (a write failed): its file is removed, the log keeps everything."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._tmp.unlink(missing_ok=True)

    def _write(self, buf: bytearray) -> None:
        with memoryview(buf) as view:
            done = 0
            while done < len(view):
                done += os.write(self._fd, view[done:])
        self.nbytes += len(buf)
