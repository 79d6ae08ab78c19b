"""Heap trim policy: when the broker gives freed heap pages back to the OS, and what it reports.

`HeapTrimmer` trims once enough bytes were freed since the last trim, not sooner than the
interval after it, and never more than 0.5% of the time (the next trim waits 200x the last
pause). Clock, timer, RSS and the trim function are injected: no sleeps, no real trim. The
registry side: what it counts as freed (compacted chunks' raw bytes, finished and dropped logs).
"""

from __future__ import annotations

import ctypes

import pytest
from test_compaction import Clock, Episode

from broker.config import BrokerConfig
from broker.sessions import heap_trim
from broker.sessions.heap_trim import HeapTrimmer, glibc_malloc_trim
from broker.sessions.registry import SessionRegistry

MIB = 1024 * 1024


class FakeHeap:
    """A trim function whose every call takes `pause` seconds of the fake timer and gives back `gives` bytes."""

    def __init__(self, clock: Clock, pause: float = 0.002, gives: int = 3 * MIB) -> None:
        self.clock, self.pause, self.gives = clock, pause, gives
        self.rss = 100 * MIB
        self.calls = 0

    def trim(self) -> int:
        self.calls += 1
        self.clock.now += self.pause
        self.rss -= self.gives
        return 1


def trimmer(clock: Clock, heap: FakeHeap, min_bytes: int = 4 * MIB, interval_s: float = 2.0) -> HeapTrimmer:
    return HeapTrimmer(
        min_bytes=min_bytes, interval_s=interval_s, trim=heap.trim, clock=clock, timer=clock, rss=lambda: heap.rss
    )


def test_a_trim_waits_for_enough_freed_bytes_and_then_for_the_interval():
    clock = Clock()
    heap = FakeHeap(clock)
    t = trimmer(clock, heap)
    assert not t.due(0) and not t.due(4 * MIB - 1)
    assert t.due(4 * MIB)  # the first trim needs no interval before it
    assert t.trim(4 * MIB) == pytest.approx(0.002)
    assert heap.calls == 1
    # the counter restarts from the trim: another 4 MiB must be freed...
    assert not t.due(8 * MIB - 1)
    # ...and 2 s must pass after the trim ended, however much is freed meanwhile
    assert not t.due(100 * MIB)
    clock.now += 2.0 - 1e-6
    assert not t.due(100 * MIB)
    clock.now += 1e-6
    assert t.due(100 * MIB) and not t.due(8 * MIB - 1)


def test_a_long_pause_spaces_the_next_trim_beyond_the_interval():
    clock = Clock()
    heap = FakeHeap(clock, pause=0.05)  # 50 ms: a big heap
    t = trimmer(clock, heap, interval_s=1.0)
    t.trim(4 * MIB)
    clock.now += 9.99  # 200 x 50 ms = 10 s > the 1 s interval
    assert not t.due(1000 * MIB)
    clock.now += 0.01
    assert t.due(1000 * MIB)


def test_steady_freeing_never_trims_more_often_than_the_interval():
    """Bytes freed every 10 ms for 60 s (a busy broker): one trim per interval at most, no storm."""
    clock = Clock()
    heap = FakeHeap(clock, pause=0.001)
    t = trimmer(clock, heap, min_bytes=MIB, interval_s=2.0)
    freed = 0
    start = clock.now
    while clock.now < start + 60.0:
        freed += 512 * 1024
        if t.due(freed):
            t.trim(freed)
        clock.now += 0.01
    assert 28 <= heap.calls <= 31  # ~every 2 s after the first, never oftener
    assert t.pause_total_s == pytest.approx(heap.calls * 0.001)


def test_the_counters_report_trims_pauses_and_released_bytes():
    clock = Clock()
    heap = FakeHeap(clock, pause=0.003, gives=5 * MIB)
    t = trimmer(clock, heap, interval_s=0.0)
    assert t.stats(MIB) == {
        "heap_trim_enabled": True,
        "heap_trims": 0,
        "heap_trim_pause_ms_last": 0.0,
        "heap_trim_pause_ms_max": 0.0,
        "heap_trim_pause_ms_total": 0.0,
        "heap_trim_released_bytes": 0,
        "bytes_freed_since_trim": MIB,
    }
    t.trim(4 * MIB)
    heap.pause = 0.001
    clock.now += 1.0
    t.trim(9 * MIB)
    stats = t.stats(10 * MIB)
    assert stats["heap_trims"] == 2
    assert stats["heap_trim_pause_ms_last"] == pytest.approx(1.0)
    assert stats["heap_trim_pause_ms_max"] == pytest.approx(3.0)
    assert stats["heap_trim_pause_ms_total"] == pytest.approx(4.0)
    assert stats["heap_trim_released_bytes"] == 10 * MIB
    assert stats["bytes_freed_since_trim"] == MIB


def test_zero_bytes_or_no_trim_function_never_trims():
    clock = Clock()
    heap = FakeHeap(clock)
    assert not trimmer(clock, heap, min_bytes=0).due(10**12)
    off = HeapTrimmer(min_bytes=MIB, interval_s=0.0, trim=None, clock=clock)
    assert not off.enabled and not off.due(10**12) and off.stats(0)["heap_trim_enabled"] is False


def test_glibc_malloc_trim_is_bound_where_the_c_library_has_it() -> None:
    has_it = hasattr(ctypes.CDLL(None), "malloc_trim")
    trim = glibc_malloc_trim()
    assert (trim is not None) == has_it
    if trim is not None:
        assert trim() in (0, 1)  # a real trim of this process: harmless
        assert (heap_trim.rss_bytes() or 0) > 0


def test_without_malloc_trim_it_says_so_at_debug_and_returns_none(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class NoTrim:  # a C library like musl's or macOS's: no such symbol
        def __init__(self, name: object) -> None:
            pass

        def __getattr__(self, name: str) -> object:
            raise AttributeError(name)

    monkeypatch.setattr(heap_trim.ctypes, "CDLL", NoTrim)
    with caplog.at_level("DEBUG", logger="broker.sessions.heap_trim"):
        assert glibc_malloc_trim() is None
    assert [r.levelname for r in caplog.records] == ["DEBUG"] and "malloc_trim" in caplog.records[0].getMessage()


def test_the_registry_counts_compacted_finished_and_dropped_bytes_as_freed():
    clock = Clock()
    reg = SessionRegistry(max_sessions=3, compact_age_s=0.0, clock=clock)
    ep = Episode(reg, "a")
    for _ in range(3):
        ep.turn(8192)
    assert reg.counters["bytes_freed"] == 0  # commits free nothing
    while reg.compact_step():
        pass
    compacted = reg.counters["bytes_compacted"]
    assert compacted > 0 and reg.counters["bytes_freed"] == compacted
    held = ep.store.bytes_held()
    reg.close("a")
    reg.finish("a")
    assert reg.counters["bytes_freed"] == compacted + held
    other = Episode(reg, "b", seed=1)
    other.turn(1000)
    held_b = other.store.bytes_held()
    assert reg.drop("b")
    assert reg.counters["bytes_freed"] == compacted + held + held_b


def test_the_trim_settings_come_from_the_environment_and_are_checked():
    default = BrokerConfig()
    assert default.trim_min_bytes == 256 * 1024 and default.trim_interval_s == 1.0
    config = BrokerConfig.from_env({"ROLLOUT_BROKER_TRIM_MIN_BYTES": "0", "ROLLOUT_BROKER_TRIM_INTERVAL_S": "0.5"})
    assert config.trim_min_bytes == 0 and config.trim_interval_s == 0.5
    with pytest.raises(ValueError, match="trim_interval_s"):
        BrokerConfig.from_env({"ROLLOUT_BROKER_TRIM_INTERVAL_S": "-1"})
    with pytest.raises(ValueError, match="ROLLOUT_BROKER_TRIM_MIN_BYTES"):
        BrokerConfig.from_env({"ROLLOUT_BROKER_TRIM_MIN_BYTES": "lots"})
