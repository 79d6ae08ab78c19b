"""ItemLog and MessageLog: a raw tail moved chunk by chunk into a compressed head reads back the same.

Appends and compactions interleave at random; after every step every read range, `startswith`
and `read_all` must equal what a plain byte string of everything appended gives, and a chunk
whose log was compacted meanwhile by another chunk must refuse to land rather than drop bytes.
"""

from __future__ import annotations

import random
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.sessions.logs.append_logs import ItemLog, MessageLog
from broker.sessions.logs.cold_log import PendingChunk


def _finish(chunk: PendingChunk) -> None:
    while not chunk.step(3000):
        pass


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 4]), st.integers(0, 2**32), st.lists(st.integers(0, 900), min_size=1, max_size=12))
def test_item_log_reads_what_was_appended_across_compactions(width: int, seed: int, appends: list[int]) -> None:
    rng = random.Random(seed)
    log, raw = ItemLog(width), bytearray()
    for n in appends:
        data = rng.randbytes(n * width)
        log.hot += data
        raw += data
        due = len(log.hot) - len(log.hot) % width
        if due and rng.random() < 0.6:
            _finish(log.chunk(rng.randrange(width, due + 1, width), rng.choice([width, 64, 4096])))
        assert (log.size, log.read_all()) == (len(raw), raw)
        for _ in range(8):
            lo = rng.randrange(len(raw) + 1)
            hi = rng.randrange(lo, len(raw) + 1)
            assert log.read(lo, hi) == raw[lo:hi]
            assert log.startswith(memoryview(raw)[lo:hi], lo)
            if hi > lo:
                assert not log.startswith(memoryview(bytes(raw[lo:hi - 1]) + bytes([raw[hi - 1] ^ 1])), lo)
    assert log.stored == log.cold.stored + len(log.hot)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32), st.lists(st.integers(0, 5), min_size=1, max_size=12))
def test_message_log_reads_what_was_added_across_compactions(seed: int, batches: list[int]) -> None:
    rng = random.Random(seed)
    log, added = MessageLog(), []
    for n in batches:
        msgs = [rng.randbytes(rng.choice([0, 5, 300, 9000])) for _ in range(n)]
        log.add(msgs)
        added += msgs
        due = log.due(rng.randrange(log.held + 1))
        if due and rng.random() < 0.6:
            before = len(log.cold_ends)
            _finish(log.chunk(due, rng.choice([1, 256, 4096])))
            assert len(log.cold_ends) > before
        assert log.held == len(added) and log.raw_bytes == sum(map(len, added))
        assert log.read_all() == b"".join(added)
        for _ in range(8):
            start = rng.randrange(len(added) + 1)
            stop = rng.randrange(start, len(added) + 1)
            assert log.read(start, stop) == b"".join(added[start:stop])


def test_a_huge_next_message_is_left_for_its_own_chunk() -> None:
    log = MessageLog()
    log.add([b"a" * 100, b"b" * 50_000, b"c" * 10])
    _finish(log.chunk(log.due(3), 1000))
    assert list(log.cold_ends) == [100] and log.hot[0] == b"b" * 50_000
    _finish(log.chunk(log.due(3), 1000))
    assert list(log.cold_ends) == [100, 50_100] and log.read_all() == b"a" * 100 + b"b" * 50_000 + b"c" * 10


def test_overlapping_chunks_of_one_log_refuse_to_land() -> None:
    items = ItemLog(4)
    items.hot += bytes(range(64))
    first, second = items.chunk(16, 16), items.chunk(32, 32)
    _finish(first)
    with pytest.raises(RuntimeError, match="overlapping"):
        _finish(second)
    assert items.read_all() == bytes(range(64)) and items.cold.size == 16
    msgs = MessageLog()
    msgs.add([b"x" * 20, b"y" * 20])
    first, second = msgs.chunk(msgs.due(1), 8), msgs.chunk(msgs.due(2), 64)
    _finish(first)
    with pytest.raises(RuntimeError, match="overlapping"):
        _finish(second)
    assert msgs.read_all() == b"x" * 20 + b"y" * 20 and list(msgs.cold_ends) == [20]


def _read_only(image: list, at: int) -> list:
    """`image` with its item `at` as a read-only view of a copy: what a snapshot's mapping gives a restart."""
    out = list(image)
    out[at] = memoryview(bytes(image[at]))
    return out


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([1, 4]), st.integers(0, 2**32), st.lists(st.integers(1, 900), min_size=1, max_size=8))
def test_a_restored_item_log_keeps_its_tail_as_a_view_until_it_appends(
    width: int, seed: int, appends: list[int]
) -> None:
    rng = random.Random(seed)
    log, raw = ItemLog(width), bytearray()
    for n in appends:
        data = rng.randbytes(n * width)
        log.hot += data
        raw += data
        if rng.random() < 0.4:
            _finish(log.chunk(len(log.hot) - len(log.hot) % width, 4096))
    restored = ItemLog.from_image(_read_only(log.image(), 0))
    snapshot = restored.hot
    assert type(snapshot) is memoryview and restored.read_all() == raw
    for _ in range(8):
        lo = rng.randrange(len(raw) + 1)
        hi = rng.randrange(lo, len(raw) + 1)
        assert restored.read(lo, hi) == raw[lo:hi]
        assert restored.startswith(memoryview(raw)[lo:hi], lo)
        if hi > lo:
            assert not restored.startswith(memoryview(bytes(raw[lo:hi - 1]) + bytes([raw[hi - 1] ^ 1])), lo)
    due = len(restored.hot) - len(restored.hot) % width
    if due > width:  # compacting a view slices it: still no copy
        _finish(restored.chunk(due - width, 64))
        assert type(restored.hot) is memoryview and restored.read_all() == raw
    more = rng.randbytes(3 * width)
    restored.tail().extend(more)  # the first append copies the tail out
    assert type(restored.hot) is bytearray and restored.read_all() == raw + more
    assert snapshot == log.image()[0]  # what it was restored from is untouched


def test_a_writable_buffer_in_an_image_is_copied_not_shared() -> None:
    log = ItemLog(4)
    log.hot += bytes(64)
    restored = ItemLog.from_image(log.image())  # an image taken in memory shares the live bytearray
    restored.tail().extend(b"\1" * 4)
    assert log.read_all() == bytes(64) and restored.read_all() == bytes(64) + b"\1" * 4


def test_a_restored_message_log_takes_its_messages_as_views_of_one_buffer() -> None:
    log, added = MessageLog(), [b"a" * 100, b"", b"b" * 9000, b"c" * 7]
    log.add(added)
    _finish(log.chunk(log.due(1), 64))
    image = log.image()
    assert bytes(image[0]) == b"".join(added[1:])  # the hot messages back to back: one blob in a snapshot
    restored = MessageLog.from_image(_read_only(image, 0))
    assert all(type(m) is memoryview for m in restored.hot) and [bytes(m) for m in restored.hot] == added[1:]
    assert restored.read_all() == b"".join(added) and restored.read(1, 3) == b"b" * 9000
    assert (restored.held, restored.raw_bytes, restored.stored) == (log.held, log.raw_bytes, log.stored)
    while restored.due(3):  # views compress like bytes
        _finish(restored.chunk(restored.due(3), 64))
    restored.add([b"d" * 5])
    assert restored.read_all() == b"".join(added) + b"d" * 5 and list(restored.cold_ends) == [100, 100, 9100]


def test_a_message_log_image_of_layout_2_still_loads() -> None:
    log = MessageLog()
    log.add([b"x" * 10, b"y" * 20])
    _, _, cold, cold_ends, raw_bytes = log.image()
    old = MessageLog.from_image([[b"x" * 10, b"y" * 20], cold, cold_ends, raw_bytes])
    assert old.read_all() == b"x" * 10 + b"y" * 20 and old.held == 2


@pytest.mark.parametrize("ends", [[10, 5, 30], [10, 20], [-5, 30], [10, 20, 30, 40]])
def test_hot_message_ends_that_do_not_split_the_buffer_are_refused(ends: list[int]) -> None:
    log = MessageLog()
    _, _, cold, cold_ends, raw_bytes = log.image()
    with pytest.raises(ValueError, match="do not split"):
        MessageLog.from_image([bytes(30), array("q", ends).tobytes(), cold, cold_ends, raw_bytes])
