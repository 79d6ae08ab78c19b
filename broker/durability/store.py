"""DurableState: a broker's state directory: its lock, recovery at start, the log while serving, snapshots.

`BrokerServer` makes one when `BrokerConfig.state_dir` is set: `open` takes the directory's lock
(one broker per directory), recovers what it holds into the fresh registry and outbox
(`recovery`), and starts a new log segment; `journal` then gets every change, `commit` writes them
before the server sends replies, and `tick` (once per loop pass) begins a snapshot when the log
since the last one outgrows the live state (at least `snapshot_min_bytes`, at most
`snapshot_max_bytes`: what a restart may have to replay) and writes it a few objects per pass,
paced by what the log grew in that pass so that it ends before the log has grown by half as much
again. A fresh directory starts with an empty snapshot, so every state directory has one. Imports
the stdlib, `broker.config`, `broker.sessions`, `broker.episodes` and `broker.durability`; no
sockets, no asyncio.
"""

from __future__ import annotations

import fcntl
import gc
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from broker.config import BrokerConfig
from broker.durability import records, wal
from broker.durability.journal import Journal
from broker.durability.recovery import Recovered, recover
from broker.durability.snapshots import SnapshotWriter, list_snapshots, snapshot_path
from broker.durability.wal import LogWriter, list_segments, position, segment_path
from broker.episodes.finishes import Finishes
from broker.episodes.outbox import Outbox
from broker.generation import Generation
from broker.sessions.registry import SessionRegistry

logger = logging.getLogger(__name__)

T = TypeVar("T")
LOCK_FILE = "LOCK"
# A snapshot in progress writes at least this much per loop pass (idle passes included)...
SNAPSHOT_STEP_BYTES = 256 * 1024
# ...and, per byte the log grew in that pass, enough that it ends before the log has grown by half
# the threshold that began it: a crash meanwhile replays at most 1.5 thresholds of log.
SNAPSHOT_PACE = 2.0


class StateDirError(Exception):
    """The state directory cannot be used: locked by another broker, unreadable, or not ours."""


class LogFailure(RuntimeError):
    """The write-ahead log could not be written: the broker stops (its loop ends with this error) rather than
    acknowledge what it did not log; a restart recovers what the log holds."""


class DurableState:
    """The state directory of one broker process.

    Args:
        config: gives `state_dir`, `fsync`, `fsync_interval_ms`, `wal_segment_bytes`,
            `snapshot_min_bytes`, `snapshot_max_bytes` and `wal_truncate_corrupt`.
        registry, outbox, finishes, generation: the broker's (fresh) state; recovery fills the registry, the
            outbox and the generation, and the journal is attached to the outbox and the finishes.
    """

    def __init__(
        self, config: BrokerConfig, registry: SessionRegistry, outbox: Outbox, finishes: Finishes,
        generation: Generation,
    ) -> None:
        assert config.state_dir is not None
        self.directory = Path(config.state_dir)
        self._config = config
        self._registry, self._outbox, self._finishes = registry, outbox, finishes
        self._generation = generation
        self._lock_fd = -1
        self.writer: LogWriter | None = None
        self.journal: Journal | None = None
        self.recovered: Recovered | None = None
        self._snapshot: SnapshotWriter | None = None
        self._tail_start = 0  # writer.bytes_written when the newest snapshot began
        self._tail_before = 0  # log bytes since that snapshot that an earlier process wrote (replayed)
        self._tick_written = 0  # writer.bytes_written at the last tick
        self._last_snapshot_bytes = 0
        self.snapshots_written = 0
        self.snapshot_failures = 0
        self.failed = False  # the log could not be written: nothing more is acknowledged

    # --- start -------------------------------------------------------------------------------

    def open(self) -> Recovered | None:
        """Lock, recover, start the log; returns what was recovered (None: the directory was new).

        Raises StateDirError (locked, or not a state directory), `wal.CorruptLog` (damage in the log
        or a snapshot) or `records.RecordError` (a record this broker cannot read).
        """
        config = self._config
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._release_lock()
            raise StateDirError(f"{self.directory} is in use by another broker (its {LOCK_FILE} is locked)") from None
        except OSError as e:
            self._release_lock()
            raise StateDirError(f"cannot use {self.directory} as the state directory: {e}") from e
        # Recovery builds millions of objects that all live on: collections in the middle of it would
        # scan them over and over for nothing (docs/performance.md, "Broker durability").
        collecting = gc.isenabled()
        gc.disable()
        try:
            recovered = recover(
                self.directory, self._registry, self._outbox, self._generation,
                truncate_corrupt=config.wal_truncate_corrupt,
            )
            if recovered is None:
                seq = 0
                self._write_empty_snapshot(seq)
            else:
                seq = recovered.next_seq
                self._tail_before = recovered.log_bytes
                self._last_snapshot_bytes = recovered.snapshot_bytes
            writer = LogWriter(
                self.directory, seq, fsync=config.fsync, interval_s=config.fsync_interval_ms / 1000,
                segment_bytes=config.wal_segment_bytes,
            )  # fmt: skip
        except BaseException:
            self._release_lock()
            raise
        finally:
            if collecting:
                gc.enable()
        self.writer = writer
        self.journal = Journal(writer)
        self._outbox.journal = self._finishes.journal = self.journal
        self.recovered = recovered
        # This process's counters count its own work, not the replayed history.
        for counters in (self._registry.counters, self._outbox.counters, self._finishes.counters):
            for key in counters:
                counters[key] = 0
        if recovered is not None:
            self._finishes.answers.restore(recovered.answers, time.monotonic())
            # The RequestFinishes recovered with their sessions closing keep their promises (`Finishes.resume`);
            # their episodes are logged like any other. No subscriber can be waiting yet: no replies.
            now = time.monotonic()
            for msg in recovered.pending.values():
                replies = self._finishes.resume(msg, now)
                assert not replies, "no subscriber can be waiting before the sockets are bound"
        return recovered

    def _write_empty_snapshot(self, seq: int) -> None:
        header = self._header(seq)
        writer = SnapshotWriter(self.directory, seq, header, self._registry, self._outbox, self._finishes)
        writer.step(position(seq, 0), SNAPSHOT_STEP_BYTES)
        writer.finish()

    def _header(self, seq: int) -> records.SnapshotHeader:
        finished = self._registry.finished_items()
        answers = self._finishes.answers.items()
        return records.SnapshotHeader(
            position(seq, 0), sys.byteorder, self._outbox.epoch, self._outbox.next_delivery_id,
            [sid for sid, _ in finished], [origin for _, origin in finished],
            [sid for sid, _, _ in answers], [rid for _, rid, _ in answers], [frame for _, _, frame in answers],
            self._registry.weight_version,
            [(g := self._generation).epoch, g.mode, g.since],
        )  # fmt: skip

    # --- serving -------------------------------------------------------------------------------

    def commit(self) -> None:
        """Write what was logged since the last commit (and sync it under `always`); before any reply.

        Raises LogFailure if the log cannot be written (and `failed` stays set).
        """
        assert self.writer is not None
        self._log_call(self.writer.commit)

    def _log_call(self, call: Callable[[], T]) -> T:
        """`call` on the log; its OSError is the log's failure (LogFailure), never a snapshot's."""
        try:
            return call()
        except OSError as e:
            self.failed = True
            raise LogFailure(f"cannot write the write-ahead log in {self.directory}: {e}") from e

    @property
    def tail_bytes(self) -> int:
        """Log bytes since the newest snapshot began: what a restart would replay."""
        assert self.writer is not None
        return self._tail_before + self.writer.bytes_written - self._tail_start

    def threshold(self) -> int:
        """Log bytes since the last snapshot that begin the next one: about the live state, within the bounds."""
        config = self._config
        return max(config.snapshot_min_bytes, min(self._last_snapshot_bytes, config.snapshot_max_bytes))

    @property
    def snapshotting(self) -> bool:
        return self._snapshot is not None

    def tick(self) -> bool:
        """Once per loop pass: begin a snapshot when due, or write the next part of the one in progress.

        Returns whether a snapshot is in progress (the loop then does not sleep: its idle passes write it).
        """
        writer = self.writer
        assert writer is not None
        # What the pass logged with no reply to send (a lease that ran out, a drain that ended into the
        # outbox) is written now too, not only with the next reply (a failure here stops the broker).
        self.commit()
        grew = writer.bytes_written - self._tick_written
        if self._snapshot is None:
            if self.tail_bytes >= self.threshold():
                self._begin()
            self._tick_written = writer.bytes_written
            return self._snapshot is not None
        snap = self._snapshot
        try:
            pace = SNAPSHOT_PACE * max(self._last_snapshot_bytes, 1) / self.threshold()
            if snap.step(writer.position, max(SNAPSHOT_STEP_BYTES, int(pace * grew))):
                self._finish(snap)
        except OSError as e:
            self._fail(snap, e)
        self._tick_written = writer.bytes_written
        return self._snapshot is not None

    def _begin(self) -> None:
        writer = self.writer
        assert writer is not None
        # A snapshot begins with a segment of its own (a commit may have just started an empty one).
        seq = writer.seq if wal.offset_of(writer.position) == 0 else self._log_call(writer.rotate)
        try:
            self._snapshot = SnapshotWriter(
                self.directory, seq, self._header(seq), self._registry, self._outbox, self._finishes
            )
        except OSError as e:
            self.snapshot_failures += 1
            logger.error("cannot begin a snapshot in %s: %s; retrying after more log", self.directory, e)
            self._restart_tail()
            return
        logger.debug("snapshot %016x begun: %d objects", seq, self._snapshot.remaining)
        # The new segment begins the snapshot's tail; older segments go once it is complete.
        self._tail_start, self._tail_before = writer.bytes_written, 0

    def _finish(self, snap: SnapshotWriter) -> None:
        assert self.writer is not None
        if self._config.fsync != "never":
            self._log_call(self.writer.sync)  # the log up to the snapshot's last image, before older segments go
        snap.finish()
        self._snapshot = None
        self._last_snapshot_bytes = snap.nbytes
        self.snapshots_written += 1
        for seq in list_segments(self.directory):
            if seq < snap.seq:
                segment_path(self.directory, seq).unlink()
        for seq in list_snapshots(self.directory):
            if seq < snap.seq:
                snapshot_path(self.directory, seq).unlink()
        logger.info("snapshot %016x written: %d bytes; older log segments removed", snap.seq, snap.nbytes)

    def _fail(self, snap: SnapshotWriter, e: OSError) -> None:
        self.snapshot_failures += 1
        logger.error("writing snapshot %016x failed: %s; the log keeps everything, retrying later", snap.seq, e)
        snap.abort()
        self._snapshot = None
        self._restart_tail()

    def _restart_tail(self) -> None:
        """Count the tail from now, so a failing disk is retried after another threshold of log, not every pass."""
        assert self.writer is not None
        self._tail_before = 0
        self._tail_start = self.writer.bytes_written

    # --- stop --------------------------------------------------------------------------------

    def close(self) -> None:
        """Commit and sync the log (except under `never`) and release the directory; a snapshot in progress
        is dropped (the log holds everything it would have)."""
        try:
            if self._snapshot is not None:
                self._snapshot.abort()
                self._snapshot = None
            if self.writer is not None:
                self.writer.close()
        except OSError as e:
            logger.error("closing the write-ahead log in %s failed: %s", self.directory, e)
        finally:
            self._release_lock()

    def _release_lock(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = -1

    def stats(self) -> dict[str, Any]:
        writer, rec = self.writer, self.recovered
        return {
            "state_dir": str(self.directory),
            "fsync": self._config.fsync,
            "wal_bytes_written": writer.bytes_written if writer is not None else 0,
            "wal_syncs": (writer.syncs + writer.interval_syncs) if writer is not None else 0,
            "wal_tail_bytes": self.tail_bytes if writer is not None else 0,
            "snapshots_written": self.snapshots_written,
            "snapshot_failures": self.snapshot_failures,
            "snapshot_in_progress": self._snapshot is not None,
            "last_snapshot_bytes": self._last_snapshot_bytes,
            "recovery_s": round(rec.seconds, 3) if rec is not None else 0.0,
            "recovered_records": rec.records if rec is not None else 0,
            "recovered_log_bytes": rec.log_bytes if rec is not None else 0,
        }
