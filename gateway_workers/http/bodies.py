"""Agent request bodies decoded in proportion to what is new in them (`BodyDecoder`).

An agent sends its whole conversation with every request, and an SDK writes the same messages out the same
way each time, so a session's next body is nearly always its previous body with messages inserted before
the bracket that closes its history array (`messages`, or Responses' `input`). Decoding and checksumming
every body whole made a long episode's turns cost in proportion to their context (docs/performance.md).
So each recent session's last body is kept with its decode, and a body that

- begins with that body up to the bracket, then has a comma,
- and ends with what followed the bracket,

has only the elements between decoded, as a JSON array of their own; the rest of its value is the earlier
one's (shared, never mutated: the adapters build their own messages), and its CRC-32 continues from the
shared beginning's. Any other body is decoded whole, exactly as without this. What the caller made of the
earlier body (`attach`: the adapter's parsed request) comes back with the body that shares its elements
(`DecodedBody.earlier`), so an adapter converts only the new ones too.

Why the splice is the whole body's decode: a JSON parser reads the shared beginning as it read it before,
which leaves it inside the history array just after an element; a comma and a sequence of whole elements
(the inserted text parsed as the only element of an array of its own proves it is one: `_elements`) leave
it in that same place; and from there the rest is what followed before, so it is read as it was. Which
bracket closes the array is never searched for in the text (a `]` inside a string would fool a search): it is
learnt from two bodies decoded whole, the second the first with elements inserted at the first's place where
the two diverge from `]` to `,`, and the whole decode equal to the first's with those elements appended;
after that each extension says where its own bracket is.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

# Each worker keeps the last body of this many recent sessions, with its decode (counted by `_cost`).
BODY_SESSIONS = 4096
BODY_BYTES = 128 * 1024 * 1024
_BLOCK = 1 << 16  # the prefix shared by two bodies is found a block at a time, then bisected
_COMMA, _CLOSE = ord(","), ord("]")
_NODE_BYTES = 96  # per value in a decode, past its text (tracemalloc of short-message and tool-call bodies)


@dataclass(frozen=True, slots=True)
class DecodedBody:
    """A body's JSON value and the zlib.crc32 of its bytes; `fresh`: the parts decoded now, each with its
    place in the value (all of it when decoded whole), which are all that checks of the values need to see."""

    value: Any
    crc32: int
    fresh: tuple[tuple[Any, str], ...]
    fresh_bytes: int
    # What was attached to the session's previous body when this one's history begins with that body's
    # elements, the same objects (extended, or repeated); else None.
    earlier: Any = None


@dataclass(slots=True)
class _Last:
    path: str
    raw: bytes
    value: Any
    crc32: int
    # The offset in `raw` of the `]` that closes value[field], and the CRC-32 of the bytes before it; None
    # until known (a body decoded whole, with no earlier one it extends).
    end: int | None = None
    end_crc32: int = 0
    cost: int = 0  # `_cost` of the body
    attached: Any = None  # `BodyDecoder.attach`


def _nothing(decoded: DecodedBody) -> None:
    """A check that accepts every body."""


class BodyDecoder:
    """Each recent session's last request body and its decode, so the next one decodes only what it adds.

    Bounded by sessions and bytes, the least recently used dropped first; a session that ends is forgotten
    (`forget`). The event loop's thread only.
    """

    def __init__(self, max_sessions: int = BODY_SESSIONS, max_bytes: int = BODY_BYTES) -> None:
        self.max_sessions, self.max_bytes = max_sessions, max_bytes
        self._last: OrderedDict[str, _Last] = OrderedDict()
        self._bytes = 0
        self.counts = {"extended": 0, "repeated": 0, "whole": 0}

    def __len__(self) -> int:
        return len(self._last)

    def decode(self, session_id: str, path: str, field: str, raw: bytes,
               check: Callable[[DecodedBody], None] = _nothing) -> DecodedBody:
        """`raw` (a request to `path` whose conversation is `field`) decoded; orjson.JSONDecodeError if it is
        not JSON. `check` sees what was decoded now and may raise: a body it refuses is not kept, so no later
        body shares a part that was never checked."""
        last = self._drop(session_id)
        if last is not None and last.path != path:
            last = None  # another route's body: nothing to share
        if last is not None and raw == last.raw:  # a retry: the same request again
            self.counts["repeated"] += 1
            self._keep(session_id, last)
            return DecodedBody(last.value, last.crc32, (), 0, last.attached)
        extended = _extend(last, field, raw) if last is not None and last.end is not None else None
        if extended is not None:
            self.counts["extended"] += 1
            entry, decoded = extended
        else:
            value = orjson.loads(raw)
            self.counts["whole"] += 1
            end = _end_learnt(last, field, raw, value) if last is not None else None
            if end is None:
                entry = _Last(path, raw, value, zlib.crc32(raw), cost=_cost(raw))
            else:
                end_crc = zlib.crc32(memoryview(raw)[:end])
                crc = zlib.crc32(memoryview(raw)[end:], end_crc)
                entry = _Last(path, raw, value, crc, end, end_crc, _cost(raw))
            decoded = DecodedBody(value, entry.crc32, ((value, ""),), len(raw))
        check(decoded)
        self._keep(session_id, entry)
        return decoded

    def attach(self, session_id: str, parsed: Any) -> None:
        """Keep `parsed` (what the caller made of the body just decoded for the session) with that body, for the
        next body that shares its history elements (`DecodedBody.earlier`). Nothing of it may change later
        but for equal values: the next body's parse takes it as its own. `_cost` allows for it: an adapter's
        parse shares the decode's strings (tracemalloc of tool-calling chat bodies: decode + parse within it).
        Not for one case: a linear session's parse takes its commit base's messages in place of an unchanged
        echo (`turns.history`), which after a body decoded whole are an earlier decode's, held once more."""
        last = self._last.get(session_id)
        if last is not None:
            last.attached = parsed

    def forget(self, sessions: list[str]) -> None:
        for session in sessions:
            self._drop(session)

    def _keep(self, session_id: str, entry: _Last) -> None:
        self._last[session_id] = entry
        self._bytes += entry.cost
        while self._last and (len(self._last) > self.max_sessions or self._bytes > self.max_bytes):
            self._drop(next(iter(self._last)))

    def _drop(self, session_id: str) -> _Last | None:
        last = self._last.pop(session_id, None)
        if last is not None:
            self._bytes -= last.cost
        return last


def decode_whole(raw: bytes, check: Callable[[DecodedBody], None] = _nothing) -> DecodedBody:
    """`raw` decoded whole and checked, kept nowhere (a request that is no turn of a conversation)."""
    value = orjson.loads(raw)
    decoded = DecodedBody(value, zlib.crc32(raw), ((value, ""),), len(raw))
    check(decoded)
    return decoded


def _extend(last: _Last, field: str, raw: bytes) -> tuple[_Last, DecodedBody] | None:
    """`raw` decoded as `last`'s body with elements inserted before its history's closing bracket, if it is."""
    end, before = last.end, last.raw
    assert end is not None
    after = len(before) - end  # the bracket and what follows it
    stop = len(raw) - after
    if (stop <= end + 1 or raw[end] != _COMMA or not raw.startswith(memoryview(before)[:end])
            or not raw.endswith(memoryview(before)[end:])):
        return None
    inserted = memoryview(raw)[end + 1 : stop]
    added = _elements(inserted)
    if added is None:
        return None  # decoded whole, which names the error
    history = last.value[field]
    value = {**last.value, field: [*history, *added]}
    end_crc = zlib.crc32(memoryview(raw)[end:stop], last.end_crc32)  # the comma and the inserted elements
    crc = zlib.crc32(memoryview(raw)[stop:], end_crc)
    fresh = tuple((item, f"{field}.[{i}]") for i, item in enumerate(added, len(history)))
    entry = _Last(last.path, raw, value, crc, stop, end_crc, last.cost + _cost(raw, end, stop))
    return entry, DecodedBody(value, crc, fresh, len(inserted), last.attached)


def _end_learnt(last: _Last, field: str, raw: bytes, value: Any) -> int | None:
    """Where `raw`'s history array closes, if `raw` (decoded whole as `value`) is `last`'s body with elements
    inserted before the bracket that closes its history: the two diverge from `]` to `,`, the text between
    that point and what followed the bracket decodes as an array, and `value` is `last`'s with it appended."""
    before = last.value.get(field) if isinstance(last.value, dict) else None
    if not isinstance(value, dict) or not isinstance(before, list) or not before:
        return None
    at = _shared_prefix(last.raw, raw)
    if at >= len(last.raw) or last.raw[at] != _CLOSE or at >= len(raw) or raw[at] != _COMMA:
        return None
    after = memoryview(last.raw)[at:]
    stop = len(raw) - len(after)
    if stop <= at + 1 or not raw.endswith(after):
        return None
    added = _elements(memoryview(raw)[at + 1 : stop])
    try:
        if added is None or value != {**last.value, field: [*before, *added]}:
            return None
    except RecursionError:  # values nested deeper than the interpreter compares (orjson decodes 1024 levels)
        return None
    return stop


def _elements(text: memoryview) -> list[Any] | None:
    """The JSON values `text` lists, comma-separated; None unless it is one or more whole values and nothing
    else (a comma followed by only whitespace is no JSON either).

    `text` is decoded as the one element of a top-level array: nothing may follow a JSON text's top-level
    value, so a text that closes a bracket it did not open (`1],"messages":[2`) cannot keep the outer array
    to one element, and is refused. Its values sit two levels deep, as in the body (a top-level field's
    array), so orjson's nesting limit is the same."""
    try:
        outer = orjson.loads(b"".join((b"[[", text, b"]]")))
    except orjson.JSONDecodeError:
        return None
    return outer[0] or None if len(outer) == 1 else None


def _cost(raw: bytes, start: int = 0, stop: int | None = None) -> int:
    """What keeping `raw[start:stop]` and its decode holds, about: the text twice (a decode of long strings is
    their size again), plus each container and value's objects, which make a body of short messages several
    times its size."""
    stop = len(raw) if stop is None else stop
    return 2 * (stop - start) + _NODE_BYTES * (raw.count(b",", start, stop) + raw.count(b"{", start, stop))


def _shared_prefix(a: bytes, b: bytes) -> int:
    """The length of the longest common prefix of `a` and `b` (memcmp a block at a time, then bisection)."""
    n, good = min(len(a), len(b)), 0
    view = memoryview(a)
    while good < n:
        bad = min(good + _BLOCK, n)
        if b.startswith(view[good:bad], good):
            good = bad
            continue
        while bad - good > 1:  # a[:good] == b[:good]; a[good:bad] != b[good:bad]
            mid = (good + bad) // 2
            if b.startswith(view[good:mid], good):
                good = mid
            else:
                bad = mid
        return good
    return good
