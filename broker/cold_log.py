"""ColdLog: the compressed, older part of an append-only byte log (a session's token or message log).

`turn_store.TurnStore` keeps each log's recent bytes in a bytearray and, in the broker's idle
time, moves older bytes here as zlib chunks (level 1: ~0.7 of int32 token ids, ~0.65 of message
text). Reads of cold bytes (a full commit's comparison, GET, finish) decompress the chunks they
touch. Pure data structure; imports only the stdlib.
"""

from __future__ import annotations

import zlib
from array import array
from bisect import bisect_right

# A chunk is compressed only once this many bytes are due: smaller ones compress worse.
MIN_CHUNK = 16 * 1024
_LEVEL = 1  # the fastest: the broker compresses in its idle time, between requests
# Raw deflate: no zlib header or Adler-32 (the bytes never leave this process), ~4% fewer
# instructions to compress and ~10% fewer to decompress than zlib.compress at the same ratio.
_WBITS = -15


class ColdLog:
    """Chunks of zlib-compressed log bytes [0, size), in order."""

    __slots__ = ("_chunks", "_starts", "size", "stored")

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._starts = array("q")  # each chunk's first byte in the log
        self.size = 0  # raw bytes held
        self.stored = 0  # compressed bytes held

    def add(self, raw: bytes | bytearray) -> None:
        """Append the log's next `len(raw)` bytes."""
        deflate = zlib.compressobj(_LEVEL, zlib.DEFLATED, _WBITS)
        chunk = deflate.compress(raw) + deflate.flush()
        self._chunks.append(chunk)
        self._starts.append(self.size)
        self.size += len(raw)
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
