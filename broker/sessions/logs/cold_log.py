"""ColdLog: the compressed, older part of an append-only byte log (a session's token or message log).

`turn_store.TurnStore` keeps each log's recent bytes in a bytearray and, in the broker's idle
time, moves older bytes here as raw-deflate chunks (level 1). A log of fixed-size items (int32
token ids) is byte-shuffled first, as blosc's shuffle filter does: each chunk deflates its items'
first bytes, then their second bytes, and so on (uniform random ids: 0.58 of their raw size instead
of 0.73; message text: ~0.65). A chunk is compressed a slice at a time (`PendingChunk`), so no single
idle step holds the loop long. Reads of cold bytes (a full commit's comparison, GET, finish)
decompress the chunks they touch. Pure data structure; imports only the stdlib.
"""

from __future__ import annotations

import zlib
from array import array
from bisect import bisect_right
from collections.abc import Callable
from typing import Any

# A chunk is compressed only once this many bytes are due: smaller ones compress worse.
MIN_CHUNK = 16 * 1024
_LEVEL = 1  # the fastest: the broker compresses in its idle time, between requests
# Raw deflate: no zlib header or Adler-32 (the bytes never leave this process), a little cheaper to
# compress and to decompress than zlib.compress at the same ratio (docs/performance.md).
_WBITS = -15
# memLevel 6 (zlib's default is 8) ends a deflate block every 4096 symbols instead of 16384, so
# Huffman-coding a block is spread over the slices rather than left for the chunk's final flush
# (at 8 that flush alone cost several slices); it costs a little ratio on token ids, none on text
# (docs/performance.md).
_MEM_LEVEL = 6


class PendingChunk:
    """A chunk being compressed a slice per `step`; the last step hands it to `on_done(raw_len, chunk)`.

    `raw` must not change meanwhile (the caller passes an immutable copy, bytes it never mutates, or, with
    `width` 1, a read-only view: a restored message). With `width` > 1, `raw` is bytes of `width`-byte items
    (its length a multiple of it), compressed byte-shuffled: the items' byte 0 plane, then byte 1, ...
    (`ColdLog(width)` reads it back).
    """

    __slots__ = ("raw", "_on_done", "_pos", "_deflate", "_parts", "_width")

    def __init__(self, raw: bytes | memoryview, on_done: Callable[[int, bytes], None], width: int = 1) -> None:
        if len(raw) % width:
            raise ValueError(f"a chunk of {width}-byte items cannot hold {len(raw)} bytes")
        self.raw = raw
        self._on_done = on_done
        self._pos = 0  # in the shuffled stream: plane pos // items, item pos % items
        self._deflate = zlib.compressobj(_LEVEL, zlib.DEFLATED, _WBITS, _MEM_LEVEL)
        self._parts: list[bytes] = []
        self._width = width

    def step(self, slice_bytes: int) -> bool:
        """Compress the next `slice_bytes` raw bytes, or once all are in, end the chunk and hand it over (True)."""
        pos, raw, width = self._pos, self.raw, self._width
        if pos < len(raw):
            if width == 1:
                end = min(pos + slice_bytes, len(raw))
                with memoryview(raw) as view:
                    self._parts.append(self._deflate.compress(view[pos:end]))
            else:  # the next slice of one byte plane, gathered by a strided slice (no shuffled copy of the chunk)
                items = len(raw) // width
                plane, first = divmod(pos, items)
                last = min(first + max(slice_bytes, 1), items)
                start = plane + first * width
                self._parts.append(self._deflate.compress(raw[start : plane + last * width : width]))
                end = pos + last - first
            self._pos = end
            return False
        # The flush codes the last block (up to 4096 symbols): a step of its own, not on top of a slice.
        self._parts.append(self._deflate.flush())
        self._on_done(len(raw), b"".join(self._parts))
        return True


class ColdLog:
    """Chunks of raw-deflate-compressed log bytes [0, size), in order; byte-shuffled when `width` > 1.

    `width`: the log's item size; its chunks come from `PendingChunk(raw, on_done, width)`.
    """

    __slots__ = ("_chunks", "_starts", "size", "stored", "width")

    def __init__(self, width: int = 1) -> None:
        self._chunks: list[bytes | memoryview] = []
        self._starts = array("q")  # each chunk's first byte in the log
        self.size = 0  # raw bytes held
        self.stored = 0  # compressed bytes held
        self.width = width

    def image(self) -> list[Any]:
        """What `from_image` rebuilds this log from (the chunks are shared, not copied: pack it at once)."""
        return [self._chunks, self._starts.tobytes(), self.size, self.stored, self.width]

    @classmethod
    def from_image(cls, image: list[Any]) -> ColdLog:
        """The log an image was taken of. Its chunks may be read-only views (of a durable broker's snapshot
        file, mapped): a chunk is only ever decompressed, which reads any buffer."""
        chunks, starts, size, stored, width = image
        log = cls(width)
        log._chunks = list(chunks)
        log._starts.frombytes(starts)
        log.size, log.stored = size, stored
        return log

    def add_chunk(self, raw_len: int, chunk: bytes) -> None:
        """Append the log's next `raw_len` bytes, already compressed (a `PendingChunk`'s end)."""
        if raw_len % self.width:
            raise ValueError(f"a chunk of {self.width}-byte items cannot hold {raw_len} bytes")
        self._chunks.append(chunk)
        self._starts.append(self.size)
        self.size += raw_len
        self.stored += len(chunk)

    def read(self, lo: int, hi: int) -> bytes:
        """Log bytes [lo, hi) (0 <= lo, hi <= size)."""
        if hi <= lo:
            return b""
        starts, width = self._starts, self.width
        k = bisect_right(starts, lo) - 1
        parts: list[bytes | bytearray] = []
        while k < len(starts) and starts[k] < hi:
            raw = zlib.decompress(self._chunks[k], _WBITS)
            base = starts[k]
            a, b = max(lo - base, 0), min(hi - base, len(raw))
            if width == 1:
                parts.append(raw[a:b])
            else:  # unshuffle only the items [a, b) touches
                first, last = a // width, -(-b // width)
                parts.append(_unshuffle(raw, width, first, last)[a - first * width : b - first * width])
            k += 1
        return b"".join(parts)

    def read_all(self) -> bytes:
        width = self.width
        raws = [zlib.decompress(chunk, _WBITS) for chunk in self._chunks]
        if width > 1:
            return b"".join([_unshuffle(raw, width, 0, len(raw) // width) for raw in raws])
        return b"".join(raws)


def _unshuffle(planes: bytes, width: int, first: int, last: int) -> bytearray:
    """Items [first, last) of a byte-shuffled chunk (`width` planes back to back), interleaved again."""
    items = len(planes) // width
    out = bytearray((last - first) * width)
    for plane in range(width):
        at = plane * items
        out[plane::width] = planes[at + first : at + last]  # a strided copy, in C
    return out
