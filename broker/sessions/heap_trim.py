"""HeapTrimmer: give the C heap's free pages back to the OS once the broker has freed enough memory.

glibc keeps pages that `free` returns inside its heaps (only the top of a heap goes back by
itself), so log bytes that compaction replaced by deflated ones, and finished sessions' logs,
stay in the broker's RSS. `malloc_trim(0)` hands every whole free page back (madvise), but its
pause grows with the heap and no frame is served meanwhile: this module decides when it is worth
it (bytes freed since the last trim, a minimum interval, and a duty bound from the last pause),
with the clock and the trim function injectable. The server calls it from its idle work only.
Imports only the stdlib (ctypes); never zmq or the other packages.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

# After a trim that paused the loop P seconds, the next waits at least this many times P: trims take
# at most 0.5% of the broker's time however large its heap grows (their pause grows with it; measured
# pauses: docs/performance.md, "Broker memory"), so at most ~0.5% of frames can arrive during one.
PAUSE_SPACING = 200.0
_STATM = "/proc/self/statm"
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

TrimFn = Callable[[], int]


def glibc_malloc_trim() -> TrimFn | None:
    """glibc's `malloc_trim(0)`, bound through ctypes; None where the C library has none (musl, macOS)."""
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError) as e:  # TypeError: CDLL(None) on Windows
        logger.debug("no malloc_trim in this C library (%s): freed heap pages stay with the process", e)
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int

    def trim() -> int:
        # pad 0: keep nothing spare at the top of the main heap; returns 1 if any memory went back
        return int(fn(0))

    return trim


def rss_bytes() -> int | None:
    """This process's resident set size (Linux /proc), or None where it cannot be read."""
    try:
        with open(_STATM, "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


class HeapTrimmer:
    """Decides when the broker trims its heap, trims, and keeps the counters.

    Args:
        min_bytes: trim once at least this many bytes were freed since the last trim (0: never trim).
        interval_s: and at least this many seconds after the last trim ended.
        trim: the trim function (`glibc_malloc_trim()`); None: the C library has none, never trim.
        clock: monotonic seconds, for the interval.
        timer: high-resolution seconds, for the pause.
        rss: the process's RSS in bytes (None if unknown), read around each trim.
    """

    def __init__(
        self,
        *,
        min_bytes: int,
        interval_s: float,
        trim: TrimFn | None,
        clock: Callable[[], float] = time.monotonic,
        timer: Callable[[], float] = time.perf_counter,
        rss: Callable[[], int | None] = rss_bytes,
    ) -> None:
        self.enabled = min_bytes > 0 and trim is not None
        self._min_bytes = min_bytes
        self._interval = interval_s
        self._trim = trim
        self._clock = clock
        self._timer = timer
        self._rss = rss
        self._freed_at_trim = 0  # the freed-bytes counter's value at the last trim
        self._next_at = float("-inf")  # no trim before this clock time
        self.trims = 0
        self.pause_last_s = 0.0
        self.pause_max_s = 0.0
        self.pause_total_s = 0.0
        self.released_bytes = 0  # RSS the trims gave back, summed

    def due(self, freed_total: int) -> bool:
        """Whether to trim now, given the lifetime count of bytes freed (a counter that only grows)."""
        # the byte test first: on the loop's every pass it is all this costs while nothing is freed
        return self.enabled and freed_total - self._freed_at_trim >= self._min_bytes and self._clock() >= self._next_at

    def trim(self, freed_total: int) -> float:
        """Trim the heap now; returns the pause in seconds. Call only when `due` and no frame waits."""
        assert self._trim is not None
        before = self._rss()
        t0 = self._timer()
        released = self._trim()
        pause = self._timer() - t0
        after = self._rss()
        self._freed_at_trim = freed_total
        self._next_at = self._clock() + max(self._interval, PAUSE_SPACING * pause)
        self.trims += 1
        self.pause_last_s = pause
        self.pause_max_s = max(self.pause_max_s, pause)
        self.pause_total_s += pause
        gone = before - after if before is not None and after is not None else 0
        self.released_bytes += max(gone, 0)
        logger.debug("heap trim %d: %.2f ms, RSS -%d KiB (released: %s)", self.trims, 1e3 * pause, gone >> 10, released)
        return pause

    def stats(self, freed_total: int) -> dict[str, Any]:
        """The trim counters for the broker's stats (pauses in ms)."""
        return {
            "heap_trim_enabled": self.enabled,
            "heap_trims": self.trims,
            "heap_trim_pause_ms_last": round(1e3 * self.pause_last_s, 3),
            "heap_trim_pause_ms_max": round(1e3 * self.pause_max_s, 3),
            "heap_trim_pause_ms_total": round(1e3 * self.pause_total_s, 3),
            "heap_trim_released_bytes": self.released_bytes,
            "bytes_freed_since_trim": freed_total - self._freed_at_trim,
        }
