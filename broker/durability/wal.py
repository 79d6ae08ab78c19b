"""The write-ahead log: numbered segment files of length-prefixed, CRC-32-checked records.

Owns the bytes on disk and nothing of their meaning: a record is a kind byte and a payload
(`broker.durability.records` says what they hold). `LogWriter` appends records to an in-memory
buffer and `commit` writes the buffer with one write(2) (the server commits before it sends the
replies of a loop pass: a reply is never sent before its record is in the OS), then syncs by the
fsync policy: `always` fdatasyncs before returning (group commit: one sync per pass), `interval`
leaves that to a syncer thread every `interval_s`, `never` leaves it to the OS. A record's header
carries its body's length, the body's CRC-32 and a CRC-32 of those 8 bytes, so `SegmentReader` tells
a torn last write (dropped) from corruption in the middle of the log (`CorruptLog`, naming the file
and offset). Stdlib only: no zmq, no asyncio, nothing of `broker` (the layer rule in
tests/unit/test_import_layers.py).
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import struct
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

logger = logging.getLogger(__name__)

FsyncPolicy = Literal["always", "interval", "never"]
FSYNC_POLICIES: tuple[FsyncPolicy, ...] = ("always", "interval", "never")

# Body length, CRC-32 of the body, CRC-32 of the first two fields. The header's own checksum is what
# tells a torn write (the file ends inside a record whose header is intact) from a corrupt length.
_HEADER = struct.Struct("<III")
_LENGTH_CRC = struct.Struct("<II")
_CRC_KIND = struct.Struct("<IB")
_KIND_BYTES = [bytes((k,)) for k in range(256)]
_KIND_CRCS = [zlib.crc32(b) for b in _KIND_BYTES]  # a body's CRC-32 starts from its kind byte's
# Buffers one writev(2) takes at most (Linux's IOV_MAX is 1024; a commit usually holds a batch's
# 64 records, two buffers each).
IOV_BATCH = 512
HEADER_BYTES = _HEADER.size
# A position in the log is one int: the segment's number above these bits, the offset in it below.
# Segments rotate long before 1 TiB.
OFFSET_BITS = 40
_OFFSET_MASK = (1 << OFFSET_BITS) - 1

SEGMENT_RE = re.compile(r"wal-([0-9a-f]{16})\.log")


class CorruptLog(Exception):
    """A record that cannot be read where more data follows it: not a torn last write, but damage.

    The broker refuses to start rather than silently lose what follows (`path`, `offset` name the
    record). Move the state directory away to start empty, or set `wal_truncate_corrupt` to keep
    only what precedes the damaged record.
    """

    def __init__(self, path: Path, offset: int, why: str) -> None:
        super().__init__(f"{path}: corrupt record at offset {offset}: {why}")
        self.path = path
        self.offset = offset


def position(seq: int, offset: int) -> int:
    """The log position of byte `offset` of segment `seq` (positions order records across segments)."""
    return seq << OFFSET_BITS | offset


def segment_of(pos: int) -> int:
    return pos >> OFFSET_BITS


def offset_of(pos: int) -> int:
    return pos & _OFFSET_MASK


def segment_path(directory: Path, seq: int) -> Path:
    return directory / f"wal-{seq:016x}.log"


def list_segments(directory: Path) -> list[int]:
    """The segment numbers in `directory`, ascending."""
    found = (SEGMENT_RE.fullmatch(p.name) for p in directory.iterdir())
    return sorted(int(m.group(1), 16) for m in found if m)


def append_record(buf: bytearray, kind: int, payload: bytes | bytearray | memoryview) -> None:
    """Append one record as it lies on disk to `buf`: header, kind byte (0-255), payload."""
    buf += record_header(kind, len(payload), zlib.crc32(payload, _KIND_CRCS[kind]))
    buf += payload


def record_header(kind: int, payload_length: int, body_crc: int) -> bytes:
    """A record's header and kind byte, for a payload written in parts (`body_crc`: over the kind byte and them)."""
    head = _LENGTH_CRC.pack(payload_length + 1, body_crc)
    return head + _CRC_KIND.pack(zlib.crc32(head), kind)


def fsync_directory(directory: Path) -> None:
    """Make a file's creation, rename or removal in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SegmentReader:
    """The records of one file, in order: iterate for (offset, kind, payload).

    Maps the whole file (replay is a sequential scan; payloads are views into the mapping, so
    nothing is copied before a decoder reads it; the mapping goes with the last view of it). A
    damaged record where nothing but
    zeros or the end of the file follows is a torn last write: with `tail=True` (the newest
    segment, the only one a crash can leave half-written) iteration stops there, `torn` says why and
    `end` is where the good records end; anywhere else it raises `CorruptLog`.
    """

    def __init__(self, path: Path, *, tail: bool) -> None:
        self.path = path
        self.tail = tail
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            self.data: bytes | mmap.mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        self.size = size
        self.end = 0  # offset just past the last good record read so far
        self.torn: str | None = None

    def __iter__(self) -> Iterator[tuple[int, int, memoryview]]:
        data = self.data
        n = len(data)
        view = memoryview(data)
        off = 0
        unpack, crc32 = _HEADER.unpack_from, zlib.crc32
        while off < n:
            if n - off < HEADER_BYTES:
                self._damaged(off, "the file ends inside a record header")
                return
            length, body_crc, head_crc = unpack(data, off)
            if crc32(view[off : off + 8]) != head_crc:
                self._damaged(off, "the record header fails its checksum", at_end=False)
                return
            start, stop = off + HEADER_BYTES, off + HEADER_BYTES + length
            if length == 0:  # an intact header of an empty body: no writer of ours made it
                raise CorruptLog(self.path, off, "a record without a kind byte")
            if stop > n:
                self._damaged(off, f"the file ends inside a {length}-byte record")
                return
            body = view[start:stop]
            if crc32(body) != body_crc:
                self._damaged(off, "the record fails its checksum", at_end=stop == n)
                return
            yield off, body[0], body[1:]
            off = self.end = stop

    def _damaged(self, off: int, why: str, at_end: bool = True) -> None:
        """A bad record at `off`: a torn tail (recorded) if only zeros or nothing follow, else CorruptLog."""
        # A process killed mid-write leaves a prefix of what it wrote (the file just ends); a power
        # loss may leave zeros past the last block that reached the disk.
        if self.tail and (at_end or not self.data[off:].strip(b"\0")):
            self.torn = f"{why} (offset {off}, {self.size - off} bytes dropped)"
            return
        raise CorruptLog(self.path, off, why)


class _Syncer(threading.Thread):
    """The `interval` policy's thread: fdatasyncs the open segment every `interval_s` when it was written to.

    It syncs a duplicate of the writer's descriptor, so the writer may close its own at any time;
    `switch` hands it the next segment's (after a last sync of the previous one).
    """

    def __init__(self, interval_s: float) -> None:
        super().__init__(name="wal-syncer", daemon=True)
        self._interval = interval_s
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._fd: int | None = None
        self.dirty = False  # set by the writer after each write; cleared here before each sync
        self.syncs = 0
        self.error: OSError | None = None

    def run(self) -> None:
        while not self._stopping.wait(self._interval):
            self.sync_now()

    def sync_now(self) -> None:
        with self._lock:
            if self._fd is None or not self.dirty:
                return
            # Cleared before the sync: a write that lands during it sets it again for the next round.
            self.dirty = False
            try:
                os.fdatasync(self._fd)
                self.syncs += 1
            except OSError as e:
                logger.error("fdatasync of the write-ahead log failed: %s", e)
                self.error = e

    def switch(self, fd: int | None) -> None:
        """Sync and let go of the current segment; watch `fd` (duplicated) from now on (None: none)."""
        with self._lock:
            if self._fd is not None:
                try:
                    os.fdatasync(self._fd)
                finally:
                    os.close(self._fd)
            self._fd = None if fd is None else os.dup(fd)
            self.dirty = False

    def stop(self) -> None:
        self._stopping.set()
        self.join()
        self.switch(None)


class LogWriter:
    """Appends records to the log's segments in `directory`, starting a new segment `seq`.

    Args:
        directory: the state directory (exists; the caller holds its lock).
        seq: the number of the segment to create; it must not exist.
        fsync: when written bytes are synced (see the module docstring).
        interval_s: the `interval` policy's period.
        segment_bytes: a segment is sealed (synced, closed) and the next one started once it holds this
            much; records are never split across segments.
    """

    def __init__(self, directory: Path, seq: int, *, fsync: FsyncPolicy, interval_s: float, segment_bytes: int) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync policy must be one of {FSYNC_POLICIES}, got {fsync!r}")
        self.directory = directory
        self.fsync: FsyncPolicy = fsync
        self._segment_bytes = segment_bytes
        # The buffered records, as header and payload buffers: writev(2) copies each payload straight
        # from the frame it arrived in (no copy into a buffer of ours first).
        self._parts: list[bytes | bytearray | memoryview] = []
        self._buffered = 0
        self._failed: OSError | None = None
        self.seq = seq
        self._offset = 0  # bytes written to the open segment
        self._fd = -1
        self.bytes_written = 0
        self.syncs = 0
        self._syncer = _Syncer(interval_s) if fsync == "interval" else None
        self._open_segment(seq)
        if self._syncer is not None:
            self._syncer.start()

    # --- appending ---------------------------------------------------------------------

    @property
    def position(self) -> int:
        """The position the next record will have (buffered records count as appended)."""
        return position(self.seq, self._offset + self._buffered)

    @property
    def pending(self) -> bool:
        """Whether records wait in the buffer for `commit`."""
        return bool(self._parts)

    def append(self, kind: int, payload: bytes | bytearray | memoryview) -> None:
        """Buffer one record (the same bytes as `append_record`); it reaches the file at the next `commit`.

        The payload is kept by reference until then: it must not change meanwhile (frames never do).
        """
        parts = self._parts
        parts.append(record_header(kind, len(payload), zlib.crc32(payload, _KIND_CRCS[kind])))
        parts.append(payload)
        self._buffered += HEADER_BYTES + 1 + len(payload)

    def commit(self) -> None:
        """Write the buffered records (one writev(2)); with `always`, fdatasync before returning.

        Raises OSError when the disk refuses, or when the `interval` syncer's last sync failed: the file
        is cut back to its last whole commit, and the writer refuses every later commit (a broker whose
        log fails stops; nothing it did not write is acknowledged).
        """
        if self._failed is not None:
            raise OSError(f"the write-ahead log failed earlier: {self._failed}") from self._failed
        syncer = self._syncer
        if syncer is not None and syncer.error is not None:
            self._failed = syncer.error
            raise OSError(f"the write-ahead log's last fdatasync failed: {syncer.error}") from syncer.error
        parts = self._parts
        if not parts:
            return
        fd = self._fd
        try:
            for i in range(0, len(parts), IOV_BATCH):
                chunk = parts[i : i + IOV_BATCH]
                done, want = os.writev(fd, chunk), sum(map(len, chunk))
                if done < want:  # a regular file takes it all at once unless the disk is full
                    rest = memoryview(b"".join(chunk))
                    while done < want:
                        done += os.write(fd, rest[done:])
        except OSError as e:
            self._failed = e
            try:
                os.ftruncate(fd, self._offset)  # no half record may stay where the next start reads
            except OSError:
                pass
            raise
        self._offset += self._buffered
        self.bytes_written += self._buffered
        parts.clear()
        self._buffered = 0
        if self.fsync == "always":
            os.fdatasync(fd)
            self.syncs += 1
        elif syncer is not None:
            syncer.dirty = True
        if self._offset >= self._segment_bytes:
            self.rotate()

    def sync(self) -> None:
        """Commit, then fdatasync now whatever the policy (a clean shutdown, a snapshot's end)."""
        self.commit()
        os.fdatasync(self._fd)
        self.syncs += 1

    def rotate(self) -> int:
        """Seal the open segment (committed and synced, except under `never`) and start the next; its number."""
        self.commit()
        if self.fsync != "never":
            os.fdatasync(self._fd)
            self.syncs += 1
        os.close(self._fd)
        self._fd = -1
        self._open_segment(self.seq + 1)
        return self.seq

    def close(self) -> None:
        """Commit, sync (except under `never`), stop the syncer, close the segment."""
        if self._fd < 0:
            return
        try:
            if self._failed is None:
                self.commit()
                if self.fsync != "never":
                    os.fdatasync(self._fd)
        finally:
            if self._syncer is not None:
                self._syncer.stop()
            os.close(self._fd)
            self._fd = -1

    @property
    def interval_syncs(self) -> int:
        return self._syncer.syncs if self._syncer is not None else 0

    def _open_segment(self, seq: int) -> None:
        path = segment_path(self.directory, seq)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        self.seq = seq
        self._offset = 0
        if self.fsync != "never":
            fsync_directory(self.directory)  # the new name itself must survive a power loss
        if self._syncer is not None:
            self._syncer.switch(self._fd)
