"""The broker's view of the workers' metrics (`broker.metrics.gateway`) and its Prometheus text (`exposition`)."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from broker.metrics import exposition
from broker.metrics.gateway import MAX_REPORTS, GatewayMetrics, decode_snapshot
from broker.protocol import SECONDS_BUCKETS
from gateway_workers.metrics import WorkerMetrics

TURN = ("chat", "false", "committed")


def _snapshot(seq: int, committed: int, seconds: float = 0.01, pieces: int = 3) -> dict[str, Any]:
    m = WorkerMetrics()
    m.count("turns", TURN, committed)
    m.observe("turn_duration_seconds", ("total",), seconds)
    snap = m.snapshot(lambda: ([], [["render_cache_pieces", [], pieces]]))
    snap["seq"] = seq
    return snap


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip


@given(st.lists(st.floats(0, 400, allow_nan=False), max_size=60))
def test_a_histogram_counts_each_value_in_the_first_bucket_at_or_above_it(values: list[float]) -> None:
    m = WorkerMetrics()
    for v in values:
        m.observe("turn_duration_seconds", ("engine",), v)
    rows = m.snapshot()["histograms"]
    if not values:
        assert rows == []
        return
    ((_, _, counts, total),) = rows
    bounds = (*SECONDS_BUCKETS, float("inf"))
    expected = [sum(1 for v in values if (i == 0 or v > bounds[i - 1]) and v <= bounds[i]) for i in range(len(bounds))]
    assert counts == expected and total == pytest.approx(sum(values))


def test_snapshots_taken_on_another_thread_while_counting_always_decode() -> None:
    m = WorkerMetrics()
    stop, seen, errors = threading.Event(), [], []

    def take() -> None:
        while not stop.is_set():
            try:
                seen.append(decode_snapshot(m.snapshot()))
            except Exception as e:  # reported below
                errors.append(e)

    thread = threading.Thread(target=take)
    thread.start()
    for k in range(20_000):
        m.count("http_errors", ("chat", str(k % 500)))
        m.observe("turn_duration_seconds", (str(k % 50),), 0.001)
    stop.set()
    thread.join()
    assert not errors and seen
    assert [r.seq for r in seen] == sorted(r.seq for r in seen) and seen[0].pid == os.getpid()


def test_totals_take_each_workers_newest_snapshot_once_and_ignore_late_ones() -> None:
    g = GatewayMetrics()
    g.heard("w1", _snapshot(1, 2))
    g.heard("w2", _snapshot(1, 5))
    g.heard("w1", _snapshot(3, 4))  # cumulative: replaces, never adds
    g.heard("w1", _snapshot(2, 3))  # older, arrived late
    totals = g.totals()
    assert totals.counters[("turns", TURN)] == 9
    counts, total = totals.histograms[("turn_duration_seconds", ("total",))]
    assert sum(counts) == 2 and total == pytest.approx(0.02)


def test_a_malformed_snapshot_leaves_the_previous_report_and_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    g = GatewayMetrics()
    g.heard("w1", _snapshot(1, 2))
    bad = [
        {"seq": 2, "counters": [["turns", ["chat"]]]},  # a row of the wrong width
        {"seq": 3, "counters": [["turns", list(TURN), "many"]]},
        {"seq": 4, "counters": [["turns", list(TURN), True]]},
        {"seq": 5, "histograms": [["turn_duration_seconds", ["total"], [1, 2], 0.1]]},  # wrong bucket count
    ]
    with caplog.at_level(logging.WARNING, logger="broker.metrics.gateway"):
        for snapshot in bad:
            g.heard("w1", snapshot)
            assert g.totals().counters[("turns", TURN)] == 2
    assert sum("malformed" in r.message for r in caplog.records) == 1


def test_reports_past_the_bound_fold_into_the_totals_unchanged_and_live_ones_stay() -> None:
    g = GatewayMetrics()
    for k in range(MAX_REPORTS + 10):
        g.heard(f"w{k}", _snapshot(1, 1), live={"w0"})
    assert len(g.reports) <= MAX_REPORTS and "w0" in g.reports
    assert g.totals().counters[("turns", TURN)] == MAX_REPORTS + 10


def test_the_exposition_has_help_and_types_sums_the_workers_and_labels_their_gauges(
    caplog: pytest.LogCaptureFixture,
) -> None:
    g = GatewayMetrics()
    g.heard("w1", _snapshot(1, 2, pieces=3))
    g.heard("w2", _snapshot(1, 5, seconds=0.2, pieces=4))
    g.heard("gone", _snapshot(1, 1, pieces=9))
    unknown = _snapshot(2, 0)
    unknown["counters"].append(["from_a_newer_worker", [], 1])
    g.heard("w2b", unknown)
    stats = {"commits_stored": 5, "sessions_open": 2, "refusals": {"busy": 3},
             "replicas": {"http://e:1": {"healthy": False, "sessions": 1, "last_error": "x"}}}  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="broker.metrics.exposition"):
        text = exposition.render(stats, g, {"w1": 10.0, "w2": 9.5}, now=10.5)
    families = list(text_string_to_metric_families(text))
    assert families and all(f.documentation and f.type in ("counter", "gauge", "histogram") for f in families)
    samples = _samples(text)
    assert samples[("rollout_gateway_turns_total", (("dialect", "chat"), ("outcome", "committed"),
                                                    ("stream", "false")))] == 8  # fmt: skip
    assert samples[("rollout_gateway_turn_duration_seconds_bucket", (("le", "+Inf"), ("stage", "total")))] == 4
    assert samples[("rollout_gateway_turn_duration_seconds_count", (("stage", "total"),))] == 4
    pieces = {dict(k[1])["worker"]: v for k, v in samples.items() if k[0] == "rollout_gateway_render_cache_pieces"}
    assert pieces == {"w1": 3, "w2": 4}  # gauges of live workers only
    ages = {dict(k[1])["worker"]: v for k, v in samples.items()
            if k[0] == "rollout_gateway_worker_heartbeat_age_seconds"}  # fmt: skip
    assert ages == {"w1": pytest.approx(0.5), "w2": pytest.approx(1.0)}
    assert samples[("rollout_gateway_broker_commits_total", (("outcome", "stored"),))] == 5
    assert samples[("rollout_gateway_sessions_open", ())] == 2
    assert samples[("rollout_gateway_broker_refusals_total", (("code", "busy"),))] == 3
    assert samples[("rollout_gateway_engine_replica_healthy", (("replica", "http://e:1"),))] == 0
    assert not any("from_a_newer_worker" in name for name, _ in samples)
    assert sum("from_a_newer_worker" in r.message for r in caplog.records) == 1
