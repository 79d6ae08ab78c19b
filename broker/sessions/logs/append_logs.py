"""A session's append-only logs, each a compressed head (`cold_log.ColdLog`) and a raw tail.

`ItemLog` holds fixed-size items (int32 token ids, float32 logprobs) as bytes; `MessageLog` holds
each distinct message's msgpack bytes once. Appends go to the raw tail; in the broker's idle time
`chunk` hands the oldest due tail bytes out as a `PendingChunk`, and its end moves them into the
compressed head. Reads take bytes from either part. `turn_store.TurnStore` decides what is due and
keeps the turns' ranges into these logs. A log restored from a durable broker's snapshot keeps its raw
tail (and its large messages) as read-only views of the snapshot's mapping until something is appended
(`ItemLog.tail`): a restart then copies none of the live state, which it otherwise spent most of its
time doing (page faults of fresh memory; docs/performance.md, "Broker durability"). Pure data
structures; imports only the stdlib and `broker`.
"""

from __future__ import annotations

from array import array
from functools import partial
from itertools import accumulate, chain, pairwise, starmap
from operator import le
from typing import Any

from broker import protocol
from broker.sessions.logs.cold_log import ColdLog, PendingChunk


class ItemLog:
    """`width`-byte items: the first `cold.size` bytes compressed, the rest raw in `hot`."""

    __slots__ = ("hot", "cold")

    def __init__(self, width: int) -> None:
        # A bytearray: `bytearray.startswith(buffer, offset)` compares against it in place. Restored from a
        # snapshot it may be a read-only view until the first append (`tail`).
        self.hot: bytearray | memoryview = bytearray()
        self.cold = ColdLog(width)  # byte-shuffled: ids' high bytes compress far better than their low ones

    @property
    def size(self) -> int:
        """Bytes held, as if none were compressed."""
        return self.cold.size + len(self.hot)

    @property
    def stored(self) -> int:
        """Bytes held, the compressed head as compressed."""
        return self.cold.stored + len(self.hot)

    def image(self) -> list[Any]:
        """What `from_image` rebuilds this log from (buffers shared, not copied: pack it at once)."""
        return [self.hot, self.cold.image()]

    @classmethod
    def from_image(cls, image: list[Any]) -> ItemLog:
        """The log an image was taken of. A read-only view (of a snapshot's mapping) is kept as the tail, not copied:
        an idle session never copies it, and a busy one copies it at its next append (`tail`)."""
        hot, cold = image
        log = cls.__new__(cls)
        log.hot = hot if type(hot) is memoryview and hot.readonly else bytearray(hot)
        log.cold = ColdLog.from_image(cold)
        return log

    def tail(self) -> bytearray:
        """The raw tail, to append to in place (a restored view is copied into a bytearray of its own first)."""
        hot = self.hot
        if type(hot) is not bytearray:
            hot = self.hot = bytearray(hot)
        return hot

    def read(self, lo: int, hi: int) -> bytes | bytearray | memoryview:
        """Log bytes [lo, hi) (compressed parts decompressed)."""
        cold = self.cold.size
        if lo >= cold:
            return self.hot[lo - cold : hi - cold]
        return self.cold.read(lo, min(hi, cold)) + self.hot[: max(hi - cold, 0)]

    def read_all(self) -> bytes:
        return self.cold.read_all() + self.hot

    def startswith(self, buf: memoryview, pos: int) -> bool:
        """Whether the log holds the bytes `buf` from byte `pos` on."""
        at = pos - self.cold.size
        if at >= 0:
            hot = self.hot
            if type(hot) is bytearray:
                return hot.startswith(buf, at)
            return hot[at : at + len(buf)] == buf
        return self.read(pos, pos + len(buf)) == buf

    def chunk(self, due: int, chunk_bytes: int) -> PendingChunk:
        """The oldest min(`due`, ~`chunk_bytes`) raw bytes, whole items, as a chunk whose end compresses them."""
        width = self.cold.width
        n = min(due, max(chunk_bytes - chunk_bytes % width, width))
        return PendingChunk(bytes(self.hot[:n]), partial(self._add_cold, self.cold.size), width)

    def _add_cold(self, cold_size: int, raw_len: int, chunk: bytes) -> None:
        if self.cold.size != cold_size:  # another compaction of this log ran meanwhile: these bytes moved
            raise RuntimeError("overlapping compactions of one log")
        self.cold.add_chunk(raw_len, chunk)
        hot = self.hot
        if type(hot) is bytearray:
            # In place: bytearray moves its start, and copies what remains into an exact-size buffer only
            # once that is under half its allocation; a copy per chunk would cost O(hot bytes) a step.
            del hot[:raw_len]
        else:  # a restored view: sliced, not copied
            self.hot = hot[raw_len:]


class MessageLog:
    """Messages' msgpack bytes in order: the first `len(cold_ends)` compressed back to back, the rest in `hot`."""

    __slots__ = ("hot", "cold", "cold_ends", "raw_bytes")

    def __init__(self) -> None:
        # A list: appending never copies what is already held, as a growing bytearray's reallocations do.
        # Restored from a snapshot, its messages are read-only views: a message is only ever joined,
        # sliced or compressed, which reads any buffer.
        self.hot: list[bytes | memoryview] = []
        self.cold = ColdLog()
        self.cold_ends = array("q")  # each compressed message's end offset in `cold`
        self.raw_bytes = 0  # every message held, uncompressed

    @property
    def held(self) -> int:
        return len(self.cold_ends) + len(self.hot)

    @property
    def stored(self) -> int:
        """Bytes held, the compressed head as compressed."""
        return self.cold.stored + sum(map(len, self.hot))

    def image(self) -> list[Any]:
        """What `from_image` rebuilds this log from: the hot messages back to back and each one's end, then the
        compressed head (shared, not copied: pack it at once).

        One buffer rather than an item per message: a snapshot writes it beside its frame as one blob, and a
        restart takes each message as a view of it instead of decoding a copy of each.
        """
        hot = self.hot
        ends = array("q", accumulate(map(len, hot)))
        return [b"".join(hot), ends.tobytes(), self.cold.image(), self.cold_ends.tobytes(), self.raw_bytes]

    @classmethod
    def from_image(cls, image: list[Any]) -> MessageLog:
        """The log an image was taken of; an image of session layout 2 or before holds its hot messages as a list."""
        log = cls()
        if len(image) == 4:
            hot, cold, cold_ends, raw_bytes = image
            log.hot = list(hot)
        else:
            joined, hot_ends, cold, cold_ends, raw_bytes = image
            ends = array("q")
            ends.frombytes(hot_ends)
            bounds = list(pairwise(chain((0,), ends)))
            if (ends[-1] if ends else 0) != len(joined) or not all(starmap(le, bounds)):
                raise ValueError(f"hot message ends that do not split a buffer of {len(joined)} bytes")
            view = memoryview(joined)  # a read-only view of a snapshot's mapping (or small bytes)
            log.hot = [view[a:b] for a, b in bounds]
        log.cold = ColdLog.from_image(cold)
        log.cold_ends.frombytes(cold_ends)
        log.raw_bytes = raw_bytes
        return log

    def add(self, messages: list[bytes]) -> None:
        self.hot += messages
        self.raw_bytes += sum(map(len, messages))

    def read(self, start: int, stop: int) -> bytes:
        """Messages [start, stop) packed back to back (compressed ones decompressed)."""
        if stop <= start:
            return b""
        ends = self.cold_ends
        n_cold = len(ends)
        parts: list[bytes | memoryview] = []
        if start < n_cold:
            parts.append(self.cold.read(ends[start - 1] if start else 0, ends[min(stop, n_cold) - 1]))
        if stop > n_cold:
            parts += self.hot[max(start - n_cold, 0) : stop - n_cold]
        return b"".join(parts)

    def read_all(self) -> bytes:
        return self.cold.read_all() + b"".join(self.hot)

    def due(self, end: int) -> list[bytes | memoryview]:
        """The raw messages before message `end`."""
        return self.hot[: max(end - len(self.cold_ends), 0)]

    def chunk(self, due: list[bytes | memoryview], chunk_bytes: int) -> PendingChunk:
        """The oldest `due` messages (from `due(...)`) up to ~`chunk_bytes`, as a chunk whose end compresses them."""
        k = n = 0
        for m in due:
            if k and n + len(m) > 2 * chunk_bytes:
                break  # a huge next message starts its own chunk: joining it would copy it here
            k += 1
            n += len(m)
            if n >= chunk_bytes:
                break
        raw = due[0] if k == 1 else b"".join(due[:k])
        return PendingChunk(raw, partial(self._add_cold, self.cold.size, k))

    def _add_cold(self, cold_size: int, n_msgs: int, raw_len: int, chunk: bytes) -> None:
        if self.cold.size != cold_size:
            raise RuntimeError("overlapping compactions of one log")
        self.cold.add_chunk(raw_len, chunk)
        end = cold_size
        for m in self.hot[:n_msgs]:
            end += len(m)
            self.cold_ends.append(end)
        self.hot = self.hot[n_msgs:]


def packed_messages(prompt: list[Any], response: Any) -> list[bytes]:
    """A commit's prompt messages then its response as msgpack bytes; ValueError if one is no map."""
    out = [*prompt, response]
    for i, m in enumerate(out):
        if type(m) is not bytes:
            if type(m) is not dict:
                raise ValueError(f"message {i} is a {type(m).__name__}, not a map")
            out[i] = protocol.pack_message(m)  # an in-process caller or an older worker: dicts
        elif not protocol.is_packed_map(m):
            raise ValueError(f"message {i} is not a packed map")
    return out
