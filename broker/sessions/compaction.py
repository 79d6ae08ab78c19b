"""Idle-time compaction scheduling: which sessions' log bytes are old enough to compress, one slice at a time.

`SessionRegistry` notes each large enough commit here (`note_commit`); an aging entry remembers
the session's log ends and comes of age `compact_age_s` later, and `step` then compresses those
bytes a chunk at a time, a slice per call. The server calls `step` only when a poll finds no frame
waiting, so compaction costs the commit path nothing. Bytes of a session that finishes sooner are
never compressed: compressing costs several times what the finish's decompression does, so only
memory held long is worth it (the figures are in `docs/performance.md`). No sockets, no encoding;
the clock is injected. Imports only the stdlib and `broker.sessions`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from broker.sessions.logs.cold_log import PendingChunk
from broker.sessions.session import AgingEntry, Session

# A cold read decompresses a whole chunk, so chunks stay small; a step compresses one slice, so a frame
# that arrives during a step waits for one slice at most (a chunk's last step adds its flush).
COMPACT_CHUNK_BYTES = 16 * 1024
COMPACT_SLICE_BYTES = 2 * 1024
# Commits of one session within compact_age_s / AGE_BUCKETS of each other share one aging entry
# (stamped with the first one's time, due that much later): a few entries per session, not one a commit.
AGE_BUCKETS = 4


class CompactionScheduler:
    """The aging queue, the sessions with aged bytes to compress, and the chunk being compressed.

    Args:
        sessions: the registry's live sessions by id (shared, not copied): a finished or dropped
            session's entries are let go when they come of age.
        counters: the registry's counters; `bytes_compacted` and `bytes_freed` grow here.
        age_s: how long log bytes are held before they may be compressed.
        clock: monotonic seconds.
    """

    def __init__(
        self, sessions: dict[str, Session], counters: dict[str, int], *, age_s: float, clock: Callable[[], float]
    ) -> None:
        self._sessions = sessions
        self._counters = counters
        self._age = age_s
        self._bucket = age_s / AGE_BUCKETS
        self._clock = clock
        # Oldest first, so due times ascend: a session's log ends after some commits, due age_s after
        # the first of them (+ a bucket).
        self.aging: deque[AgingEntry] = deque()
        self.ready: dict[str, None] = {}  # sessions with aged bytes to compress (FIFO)
        self._chunk: tuple[Session, PendingChunk] | None = None  # the chunk being compressed

    def note_commit(self, session: Session) -> None:
        """Note the session's log ends now: they become compressible age_s (+ a bucket) later."""
        now = self._clock()
        session.idle = False
        entry = session.aging
        if entry is not None and now < entry.due - self._age:  # within the entry's bucket: join it
            entry.ends = session.committed.log_ends
        else:
            due = now + self._bucket + self._age  # the last commit to join it is age_s old then
            entry = AgingEntry(due, session.sid, session.serial, session.committed.log_ends)
            session.aging = entry
            self.aging.append(entry)

    @property
    def pending(self) -> bool:
        """Whether some session has log bytes held age_s to compress (`step`).

        Moves entries that came of age to the sessions they name, so the aging queue holds only
        the last age_s of commits even when the loop is never idle.
        """
        aging = self.aging
        if aging:
            now = self._clock()
            if aging[0].due <= now:
                self._promote(aging, now)
        return self._chunk is not None or bool(self.ready)

    def _promote(self, aging: deque[AgingEntry], now: float) -> None:
        sessions, ready = self._sessions, self.ready
        while aging and aging[0].due <= now:
            entry = aging.popleft()
            sid = entry.sid
            session = sessions.get(sid)
            if session is not None and session.serial == entry.serial:  # else finished (or its id reopened)
                session.aged_to = entry.ends  # a session's entries come of age in commit order
                # Its newest entry: no commit since it closed, so the whole session is age_s old.
                # Its raw tail (kept for the next delta's prefix check) compresses too: a delta after
                # such a pause is rare, and reads the few bytes it needs from the last chunk.
                session.idle = session.aging is entry and self._age > 0  # (age 0: never idle)
                ready[sid] = None

    def step(self, slice_bytes: int = COMPACT_SLICE_BYTES, chunk_bytes: int = COMPACT_CHUNK_BYTES) -> bool:
        """Compress the next `slice_bytes` of aged log bytes (of one chunk of one session); False when none are due."""
        pending = self._chunk
        if pending is None:
            pending = self._next_chunk(chunk_bytes) if self.pending else None
            if pending is None:
                return False
        session, chunk = pending
        if self._sessions.get(session.sid) is not session:  # finished or dropped meanwhile: drop the chunk
            self._chunk = None
            return True
        if chunk.step(slice_bytes):
            self._chunk = None
            self._counters["bytes_compacted"] += len(chunk.raw)
            self._counters["bytes_freed"] += len(chunk.raw)  # the raw bytes left the hot logs
        return True

    def _next_chunk(self, chunk_bytes: int) -> tuple[Session, PendingChunk] | None:
        ready = self.ready
        while ready:
            sid = next(iter(ready))
            session = self._sessions.get(sid)
            chunk = (
                None
                if session is None
                else session.committed.start_compaction(chunk_bytes, session.aged_to, session.idle)
            )
            if session is None or chunk is None:
                del ready[sid]  # gone, or less than a chunk aged: its next aging entry puts it back
                continue
            self._chunk = session, chunk
            return self._chunk
        return None
