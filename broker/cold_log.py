"""ColdLog: the compressed, older part of an append-only byte log (a session's token or message log).

`turn_store.TurnStore` keeps each log's recent bytes in a bytearray and, in the broker's idle
time, moves older bytes here as raw-deflate chunks (level 1: ~0.7 of int32 token ids, ~0.65 of
message text). A chunk is compressed a slice at a time (`PendingChunk`), so no single idle step
holds the loop long. Reads of cold bytes (a full commit's comparison, GET, finish) decompress the
chunks they touch. Pure data structure; imports only the stdlib.
"""

from __future__ import annotations

import zlib
from array import array
from bisect import bisect_right
from collections.abc import Callable

# A chunk is compressed only once this many bytes are due: smaller ones compress worse.
MIN_CHUNK = 16 * 1024
_LEVEL = 1  # the fastest: the broker compresses in its idle time, between requests
# Raw deflate: no zlib header or Adler-32 (the bytes never leave this process), ~4% fewer
# instructions to compress and ~10% fewer to decompress than zlib.compress at the same ratio.
_WBITS = -15
# memLevel 6 (zlib's default is 8) ends a deflate block every 4096 symbols instead of 16384, so
# Huffman-coding a block is spread over the slices rather than left for the chunk's final flush
# (at 8 that flush alone cost ~3x a 2 KiB slice); it costs ~1.5% of ratio on token ids, none on text.
_MEM_LEVEL = 6


class PendingChunk:
    """A chunk being compressed a slice per `step`; the last step hands it to `on_done(raw_len, chunk)`.

    `raw` must not change meanwhile (the caller passes an immutable copy or bytes it never mutates).
    """

    __slots__ = ("raw", "_on_done", "_pos", "_deflate", "_parts")

    def __init__(self, raw: bytes, on_done: Callable[[int, bytes], None]) -> None:
        self.raw = raw
        self._on_done = on_done
        self._pos = 0
        self._deflate = zlib.compressobj(_LEVEL, zlib.DEFLATED, _WBITS, _MEM_LEVEL)
        self._parts: list[bytes] = []

    def step(self, slice_bytes: int) -> bool:
        """Compress the next `slice_bytes` raw bytes, or once all are in, end the chunk and hand it over (True)."""
        pos, raw = self._pos, self.raw
        if pos < len(raw):
            end = min(pos + slice_bytes, len(raw))
            with memoryview(raw) as view:
                self._parts.append(self._deflate.compress(view[pos:end]))
            self._pos = end
            return False
        # The flush codes the last block (up to 4096 symbols): a step of its own, not on top of a slice.
        self._parts.append(self._deflate.flush())
        self._on_done(len(raw), b"".join(self._parts))
        return True


class ColdLog:
    """Chunks of raw-deflate-compressed log bytes [0, size), in order."""

    __slots__ = ("_chunks", "_starts", "size", "stored")

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._starts = array("q")  # each chunk's first byte in the log
        self.size = 0  # raw bytes held
        self.stored = 0  # compressed bytes held

    def add_chunk(self, raw_len: int, chunk: bytes) -> None:
        """Append the log's next `raw_len` bytes, already compressed (a `PendingChunk`'s end)."""
        self._chunks.append(chunk)
        self._starts.append(self.size)
        self.size += raw_len
        self.stored += len(chunk)

    def read(self, lo: int, hi: int) -> bytes:
        """Log bytes [lo, hi) (0 <= lo, hi <= size)."""
        if hi <= lo:
            return b""
        starts = self._starts
        k = bisect_right(starts, lo) - 1
        parts = []
        while k < len(starts) and starts[k] < hi:
            raw = zlib.decompress(self._chunks[k], _WBITS)
            base = starts[k]
            parts.append(raw[max(lo - base, 0) : hi - base])
            k += 1
        return b"".join(parts)

    def read_all(self) -> bytes:
        return b"".join([zlib.decompress(chunk, _WBITS) for chunk in self._chunks])
