"""gateway_workers.metrics: what one worker counts, and the snapshot its heartbeats carry to the broker.

Pins the wire shape (`broker.protocol.SECONDS_BUCKETS` and the comment beside it): counters add up per
(name, labels), histogram buckets follow Prometheus `le` semantics (a value equal to a bound is in that
bound's bucket, one above every bound in the last), and a snapshot taken on another thread while the event
loop counts never raises and always decodes at the broker.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.metrics.gateway import decode_snapshot
from broker.protocol import SECONDS_BUCKETS
from gateway_workers.metrics import WorkerMetrics

BUCKETS = len(SECONDS_BUCKETS) + 1
TURN = ("chat", "false", "committed")


def _histogram(snapshot: dict[str, Any], name: str, labels: tuple[str, ...]) -> tuple[list[float], float]:
    (row,) = [r for r in snapshot["histograms"] if r[0] == name and r[1] == list(labels)]
    return row[2], row[3]


def _counters(snapshot: dict[str, Any]) -> dict[tuple[str, tuple[str, ...]], float]:
    return {(name, tuple(labels)): value for name, labels, value in snapshot["counters"]}


def test_counts_add_up_per_name_and_labels() -> None:
    m = WorkerMetrics()
    m.count("turns", TURN)
    m.count("turns", TURN)
    m.count("turns", ("chat", "true", "committed"), by=3)
    m.count("tokens", ("prompt",), by=120)
    m.count("tokens", ("prompt",), by=0.5)
    m.count("agent_finishes")
    assert _counters(m.snapshot()) == {
        ("turns", TURN): 2,
        ("turns", ("chat", "true", "committed")): 3,
        ("tokens", ("prompt",)): 120.5,
        ("agent_finishes", ()): 1,
    }


@pytest.mark.parametrize("index", range(len(SECONDS_BUCKETS)))
def test_a_value_equal_to_a_bound_lands_in_that_bounds_bucket(index: int) -> None:
    m = WorkerMetrics()
    m.observe("turn_duration_seconds", ("total",), SECONDS_BUCKETS[index])
    counts, total = _histogram(m.snapshot(), "turn_duration_seconds", ("total",))
    assert counts == [1 if i == index else 0 for i in range(BUCKETS)]
    assert total == SECONDS_BUCKETS[index]


def test_a_value_just_above_a_bound_lands_in_the_next_bucket() -> None:
    m = WorkerMetrics()
    for bound in SECONDS_BUCKETS:
        m.observe("turn_duration_seconds", ("engine",), math.nextafter(bound, math.inf))
    counts, _ = _histogram(m.snapshot(), "turn_duration_seconds", ("engine",))
    assert counts == [0] + [1] * len(SECONDS_BUCKETS)


def test_a_value_above_the_last_bound_lands_in_the_inf_slot_and_the_sum_accumulates() -> None:
    m = WorkerMetrics()
    for seconds in (SECONDS_BUCKETS[-1] + 1, 1e9, 0.0005, 0.0):
        m.observe("turn_duration_seconds", ("total",), seconds)
    counts, total = _histogram(m.snapshot(), "turn_duration_seconds", ("total",))
    assert len(counts) == BUCKETS
    assert counts[-1] == 2 and counts[0] == 2 and sum(counts) == 4
    assert total == SECONDS_BUCKETS[-1] + 1 + 1e9 + 0.0005


def test_histograms_are_kept_apart_by_labels() -> None:
    m = WorkerMetrics()
    m.observe("turn_duration_seconds", ("render",), 0.002)
    m.observe("turn_duration_seconds", ("engine",), 3.0)
    m.observe("turn_duration_seconds", ("engine",), 3.0)
    snapshot = m.snapshot()
    render, engine = (_histogram(snapshot, "turn_duration_seconds", (s,)) for s in ("render", "engine"))
    assert render[0][SECONDS_BUCKETS.index(0.0025)] == 1 and sum(render[0]) == 1 and render[1] == 0.002
    assert engine[0][SECONDS_BUCKETS.index(5.0)] == 2 and sum(engine[0]) == 2 and engine[1] == 6.0


_seconds = st.one_of(
    st.sampled_from(SECONDS_BUCKETS),  # exactly on a bound, where `<` vs `<=` shows
    st.sampled_from(SECONDS_BUCKETS).map(lambda b: math.nextafter(b, math.inf)),
    st.sampled_from(SECONDS_BUCKETS).map(lambda b: math.nextafter(b, -math.inf)),
    st.floats(min_value=-1.0, max_value=1e4, allow_nan=False),
)


@given(st.lists(_seconds, max_size=80))
def test_bucket_counts_match_a_brute_force_count_of_values_within_each_bound(values: list[float]) -> None:
    m = WorkerMetrics()
    for v in values:
        m.observe("turn_duration_seconds", ("total",), v)
    snapshot = m.snapshot()
    if not values:
        assert snapshot["histograms"] == []
        return
    counts, total = _histogram(snapshot, "turn_duration_seconds", ("total",))
    lower, upper = (-math.inf, *SECONDS_BUCKETS), (*SECONDS_BUCKETS, math.inf)
    assert counts == [sum(1 for v in values if lo < v <= hi) for lo, hi in zip(lower, upper, strict=True)]
    expected_total = 0.0
    for v in values:  # in the order observed: the same float additions
        expected_total += v
    assert total == expected_total


def test_snapshot_seq_strictly_increases_and_pid_is_this_process() -> None:
    m = WorkerMetrics()
    snapshots = [m.snapshot() for _ in range(5)]
    seqs = [s["seq"] for s in snapshots]
    assert all(type(s) is int for s in seqs)
    assert all(a < b for a, b in zip(seqs, seqs[1:], strict=False))
    assert {s["pid"] for s in snapshots} == {os.getpid()}
    assert WorkerMetrics().snapshot()["seq"] >= 1  # a fresh process's first snapshot beats the broker's default 0


def test_an_empty_snapshot_has_every_section_and_decodes() -> None:
    snapshot = WorkerMetrics().snapshot()
    assert set(snapshot) == {"seq", "pid", "counters", "histograms", "gauges"}
    assert snapshot["counters"] == snapshot["histograms"] == snapshot["gauges"] == []
    report = decode_snapshot(snapshot)
    assert report.seq == snapshot["seq"] and report.pid == os.getpid()


def test_snapshot_rows_have_the_documented_shape() -> None:
    m = WorkerMetrics()
    m.count("http_errors", ("chat", "502"), by=2)
    m.observe("turn_duration_seconds", ("commit",), 0.04)
    snapshot = m.snapshot()
    assert snapshot["counters"] == [["http_errors", ["chat", "502"], 2]]
    ((name, labels, counts, total),) = snapshot["histograms"]
    assert (name, labels, total) == ("turn_duration_seconds", ["commit"], 0.04)
    assert isinstance(counts, list) and len(counts) == BUCKETS
    assert counts[SECONDS_BUCKETS.index(0.05)] == 1 and sum(counts) == 1
    assert snapshot["gauges"] == []
    report = decode_snapshot(snapshot)
    assert report.counters == {("http_errors", ("chat", "502")): 2}
    assert report.histograms == {("turn_duration_seconds", ("commit",)): (counts, 0.04)}


def test_parts_counter_rows_are_appended_and_its_gauge_rows_returned() -> None:
    m = WorkerMetrics()
    m.count("turns", TURN)
    part_counters = [["render_cache", ["hit"], 7], ["commits_sent", ["delta"], 2]]
    part_gauges = [["render_cache_pieces", [], 11], ["engine_replica", ["http://e:1"], 1]]
    calls = []

    def parts() -> tuple[list[list[Any]], list[list[Any]]]:
        calls.append(1)
        return [list(r) for r in part_counters], [list(r) for r in part_gauges]

    snapshot = m.snapshot(parts)
    assert calls == [1]
    assert snapshot["counters"] == [["turns", list(TURN), 1], *part_counters]
    assert snapshot["gauges"] == part_gauges
    report = decode_snapshot(snapshot)
    assert report.counters[("render_cache", ("hit",))] == 7
    assert report.gauges == {("render_cache_pieces", ()): 11, ("engine_replica", ("http://e:1",)): 1}


def test_a_snapshot_is_a_copy_later_counting_does_not_change() -> None:
    m = WorkerMetrics()
    m.count("turns", TURN)
    m.observe("turn_duration_seconds", ("total",), 0.5)
    before = m.snapshot()
    m.count("turns", TURN)
    m.count("tokens", ("output",), by=9)
    m.observe("turn_duration_seconds", ("total",), 0.5)
    m.observe("turn_duration_seconds", ("render",), 0.5)
    assert before["counters"] == [["turns", list(TURN), 1]]
    ((_, _, counts, total),) = before["histograms"]
    assert sum(counts) == 1 and total == 0.5
    after = m.snapshot()
    assert _counters(after)[("turns", TURN)] == 2
    assert sum(_histogram(after, "turn_duration_seconds", ("total",))[0]) == 2


def test_snapshots_on_other_threads_while_new_keys_are_counted_never_raise_and_always_decode() -> None:
    m = WorkerMetrics()
    per_thread, errors = 1000, []
    # Per snapshot: (seq, number of counter keys, total counted, total observed).
    taken: list[list[tuple[int, int, float, float]]] = [[], []]
    started = threading.Barrier(3)

    def take(out: list[tuple[int, int, float, float]]) -> None:
        started.wait()
        for _ in range(per_thread):
            try:
                report = decode_snapshot(m.snapshot())
            except Exception as e:  # asserted below
                errors.append(e)
                return
            observed = sum(sum(counts) for counts, _ in report.histograms.values())
            out.append((report.seq, len(report.counters), sum(report.counters.values()), observed))

    threads = [threading.Thread(target=take, args=(out,)) for out in taken]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # switch threads often: snapshots land mid-insert, mid-resize
    try:
        for t in threads:
            t.start()
        started.wait()
        k = new = 0
        while any(t.is_alive() for t in threads):
            k += 1
            # New keys all along (paced by the snapshots, so that each one stays cheap): the dicts keep growing.
            if 4 * new <= len(taken[0]) + len(taken[1]):
                new += 1
                m.count("http_errors", ("chat", str(new)))
                if new % 5 == 0:
                    m.observe("turn_duration_seconds", (f"s{new}",), 0.01)
            m.count("turns", TURN)
            m.observe("turn_duration_seconds", ("total",), 0.01)
    finally:
        sys.setswitchinterval(interval)
        for t in threads:
            t.join()
    assert errors == []
    assert [len(out) for out in taken] == [per_thread, per_thread]
    # The pacing aims at a new key per 4 snapshots; a starved counting thread falls behind it, so half is the bound.
    assert new >= per_thread // 4 and len(m.counts) == new + 1 and len(m.histograms) == new // 5 + 1
    # Across both threads, in seq order: every seq once, and a later seq never carries fewer counts.
    ordered = sorted(s for out in taken for s in out)
    assert len({s[0] for s in ordered}) == 2 * per_thread
    for earlier, later in zip(ordered, ordered[1:], strict=False):
        assert all(b >= a for a, b in zip(earlier[1:], later[1:], strict=True))
    assert ordered[-1][2] <= k + new and ordered[-1][3] <= k + new
