"""Snapshots: the live state written object by object, so that a restart loads it instead of replaying history.

A snapshot is begun with a new log segment `seq` (`snap-<seq>.snap`): its header holds what the
outbox and the finished-session memory were at that segment's start; then each session and each
unacknowledged episode that was live then is written as its image (`durability.images`,
`records.EpisodeImage`), a few per loop pass, each stamped with the log position it reflects. The
state keeps changing meanwhile: an image taken at position p reflects every record before p, so
recovery replays the segments from `seq` on and skips, per session or episode, the records an image
already holds. Once every object is written, the file is synced and renamed into place, and only then
are the older segments and snapshots deleted. Sessions opened after the segment began are in the log
already and are not imaged. The loop's thread only takes the images (a session's compressed chunks
by reference, its raw tails copied once: `records.image_parts`); a writer thread checksums and
writes them, since a snapshot rewrites the whole live state and the loop must keep serving. A
restart maps the file and restores every large buffer (compressed chunks, raw tails, a store's raw
messages) as a view of the mapping, copied only by a session that appends to it (a snapshot file is
only ever replaced by rename or removed, never truncated, so the mapping stays valid; a removed one
keeps its disk space until the last view of it goes). Imports the stdlib, `broker.sessions`,
`broker.episodes` and `broker.durability`; no sockets.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from broker.durability import records
from broker.durability.images import session_image
from broker.durability.journal import close_record
from broker.durability.records import STATE, STATE_WITH_BLOBS
from broker.durability.wal import IOV_BATCH, SegmentReader, fsync_directory, record_header
from broker.episodes.finishes import Finishes
from broker.episodes.outbox import Outbox
from broker.sessions.registry import SessionRegistry

SNAPSHOT_RE = re.compile(r"snap-([0-9a-f]{16})\.snap")
# Images queued for the writer thread at most; past it the loop waits for it (a bound on a snapshot's memory).
MAX_QUEUED_BYTES = 64 * 1024 * 1024


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
        record: records.SnapshotRecord | None = None
        if trailer is None and kind == STATE:
            record = records.decode_snapshot(payload)
        elif trailer is None and kind == STATE_WITH_BLOBS:
            record = records.decode_image(payload)
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


class _FileWriter(threading.Thread):
    """Checksums and writes a snapshot's records in its own thread, so the broker's loop only builds them.

    `put` queues a record as a kind and payload parts (immutable buffers: `records.image_parts`); it
    waits while more than MAX_QUEUED_BYTES are queued, which bounds the memory a snapshot holds. zlib's
    CRC-32 and writev(2) release the GIL, so on a machine with a spare core this costs the loop nothing.
    A failure is kept and raised by the next `put` or `drain`.
    """

    def __init__(self, fd: int) -> None:
        super().__init__(name="snapshot-writer", daemon=True)
        self._fd = fd
        self._cond = threading.Condition()
        self._queue: deque[tuple[int, list[bytes | memoryview]] | None] = deque()
        self._queued = 0
        self.error: OSError | None = None
        self.nbytes = 0

    def put(self, kind: int, parts: list[bytes | memoryview]) -> None:
        size = sum(map(len, parts))
        with self._cond:
            while self._queued > MAX_QUEUED_BYTES and self.error is None:
                self._cond.wait()
            self._raise()
            self._queue.append((kind, parts))
            self._queued += size
            self._cond.notify_all()

    def drain(self) -> None:
        """Wait until everything queued is written; raise what failed."""
        with self._cond:
            while self._queue and self.error is None:
                self._cond.wait()
            self._raise()

    def stop(self) -> None:
        with self._cond:
            self._queue.append(None)
            self._cond.notify_all()
        self.join()

    def _raise(self) -> None:
        if self.error is not None:
            raise OSError(f"writing the snapshot failed: {self.error}") from self.error

    def run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                item = self._queue[0]
            if item is None:
                return
            kind, parts = item
            try:
                if self.error is None:
                    self._write(kind, parts)
            except OSError as e:
                self.error = e
            with self._cond:
                self._queue.popleft()
                self._queued -= sum(map(len, parts))
                self._cond.notify_all()

    def _write(self, kind: int, parts: list[bytes | memoryview]) -> None:
        crc = zlib.crc32(bytes((kind,)))
        for part in parts:
            crc = zlib.crc32(part, crc)
        out = [record_header(kind, sum(map(len, parts)), crc), *parts]
        for i in range(0, len(out), IOV_BATCH):
            chunk = out[i : i + IOV_BATCH]
            done, want = os.writev(self._fd, chunk), sum(map(len, chunk))
            if done < want:  # a regular file takes it all unless the disk is full
                rest = memoryview(b"".join(chunk))
                while done < want:
                    done += os.write(self._fd, rest[done:])
            self.nbytes += want


class SnapshotWriter:
    """One snapshot being written: begun with segment `seq`, over the objects live at that segment's start.

    The loop's thread takes each object's image (`step`); a writer thread checksums and writes it.

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
        self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._file = _FileWriter(self._fd)
        self._file.start()
        self._file.put(STATE, [records.encode(header)])

    @property
    def remaining(self) -> int:
        return len(self._sessions) + len(self._episodes)

    @property
    def nbytes(self) -> int:
        """Bytes written so far (all of them once `finish` returned)."""
        return self._file.nbytes

    def step(self, position: int, budget: int) -> bool:
        """Image the next objects (at least one, about `budget` bytes) as of log `position`; True when all are.

        Raises OSError if the writer thread failed on what earlier steps queued.
        """
        taken = 0
        put = self._file.put
        registry, sessions = self._registry, self._sessions
        while sessions and taken < budget:
            sid, serial = sessions.popleft()
            session = registry.session(sid)
            if session is None or session.serial != serial:
                continue  # over since the snapshot began (its records from then on are in the log)
            pending = self._finishes.pending_request(sid)
            close = None if pending is None else records.encode(close_record(pending, session.finished_by or "trainer"))
            image = session_image(session, closing=pending is not None)
            parts = records.image_parts(records.SessionImage(position, image, close))
            put(STATE_WITH_BLOBS, parts)
            taken += sum(map(len, parts))
            self._written[0] += 1
        outbox, episodes = self._outbox, self._episodes
        while not sessions and episodes and taken < budget:
            delivery_id = episodes.popleft()
            held = outbox.entry(delivery_id)
            if held is None:
                continue  # acknowledged since
            episode, client_id, holder, lease, redelivered = held
            episode_image = records.EpisodeImage(
                position, delivery_id, episode.session_id, client_id, holder, lease, redelivered,
                records.encode_episode(episode),
            )  # fmt: skip
            payload = records.encode(episode_image)
            put(STATE, [payload])
            taken += len(payload)
            self._written[1] += 1
        return not sessions and not episodes

    def finish(self) -> Path:
        """Write the trailer, wait for the writer, sync, rename into place (and sync the directory): the snapshot
        now counts."""
        self._file.put(STATE, [records.encode(records.SnapshotTrailer(*self._written))])
        self._file.drain()
        self._file.stop()
        if self._sync:
            os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        os.replace(self._tmp, self._final)
        if self._sync:
            fsync_directory(self._directory)
        return self._final

    def abort(self) -> None:
        """Give up on this snapshot (a write failed, or the broker stops): its file is removed, the log keeps
        everything."""
        if self._file.is_alive():
            self._file.stop()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._tmp.unlink(missing_ok=True)
