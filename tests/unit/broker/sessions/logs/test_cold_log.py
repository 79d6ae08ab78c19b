"""ColdLog and PendingChunk: compressed chunks read back exactly the raw log, shuffled or not.

A log is cut into chunks of random sizes (whole items for a shuffled log), each compressed a
random slice size per step; every read(lo, hi), aligned to items or not, and read_all must equal
the raw bytes. Byte-shuffling must also pay on the ids it is for (the bench's uniform ids).
"""

from __future__ import annotations

import random
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.sessions.logs.cold_log import ColdLog, PendingChunk


def _fill(log: ColdLog, raw: bytes, cuts: list[int], slice_bytes: int) -> None:
    """Compress `raw` into `log` as chunks ending at `cuts` (the last at len(raw))."""
    pos = 0
    for end in cuts:
        done: list[tuple[int, bytes]] = []
        chunk = PendingChunk(raw[pos:end], lambda n, c, done=done: done.append((n, c)), log.width)
        steps = 0
        while not chunk.step(slice_bytes):
            steps += 1
            assert not done and steps <= end - pos + 8  # each step moves at least a byte on
        assert len(done) == 1 and done[0][0] == end - pos
        log.add_chunk(*done[0])
        pos = end


@settings(max_examples=80, deadline=None)
@given(
    st.sampled_from([1, 2, 4, 8]),
    st.integers(0, 2**32),
    st.integers(0, 600),
    st.lists(st.integers(1, 200), max_size=6),
    st.sampled_from([1, 3, 7, 64, 1 << 20]),
    st.lists(st.tuples(st.integers(-5, 2500), st.integers(-5, 2500)), min_size=1, max_size=12),
)
def test_reads_of_any_range_give_back_the_raw_bytes(width, seed, n_items, chunk_items, slice_bytes, reads):
    rng = random.Random(seed)
    raw = bytes(rng.choice([0, 1, 2, rng.randrange(256)]) for _ in range(n_items * width))
    cuts, pos = [], 0
    for k in chunk_items:
        pos = min(pos + k * width, len(raw))
        cuts.append(pos)
    if not cuts or cuts[-1] < len(raw):
        cuts.append(len(raw))
    cuts = sorted(set(c for c in cuts if c > 0))
    log = ColdLog(width)
    _fill(log, raw, cuts, slice_bytes)
    assert log.size == len(raw) and log.stored == sum(len(c) for c in log._chunks)
    assert log.read_all() == raw
    for lo, hi in reads:  # unaligned, empty and reversed ranges too
        lo, hi = max(min(lo, len(raw)), 0), max(min(hi, len(raw)), 0)
        assert log.read(lo, hi) == raw[lo:hi], (lo, hi)


def test_a_shuffled_chunk_is_the_items_byte_planes_deflated():
    ids = bytes(range(16))  # four 4-byte items
    done: list[tuple[int, bytes]] = []
    chunk = PendingChunk(ids, lambda n, c: done.append((n, c)), 4)
    while not chunk.step(3):
        pass
    planes = b"".join(ids[k::4] for k in range(4))
    assert zlib.decompress(done[0][1], -15) == planes


def test_chunks_of_partial_items_are_refused():
    with pytest.raises(ValueError, match="4-byte items"):
        PendingChunk(b"12345", lambda n, c: None, 4)
    with pytest.raises(ValueError, match="4-byte items"):
        ColdLog(4).add_chunk(6, b"")


def test_shuffling_compresses_uniform_token_ids_better():
    rng = random.Random(3)
    ids = b"".join(rng.randrange(1000, 150_000).to_bytes(4, "little") for _ in range(4096))
    sizes = []
    for width in (1, 4):
        log = ColdLog(width)
        _fill(log, ids, [len(ids)], 2048)
        assert log.read_all() == ids
        sizes.append(log.stored)
    # ids under 2^18: two random low bytes, a few bits of a third, a zero fourth (entropy ~2.15 bytes)
    assert sizes[1] < 0.85 * sizes[0] and sizes[1] < 2.4 * 4096
