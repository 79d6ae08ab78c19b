"""The broker's view of the workers' metrics (`broker.metrics.gateway`) and its Prometheus text (`exposition`)."""

from __future__ import annotations

import itertools
import logging
from typing import Any
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from broker.metrics import catalog, exposition, gateway
from broker.metrics.gateway import MAX_REPORTS, GatewayMetrics, WorkerReport, decode_snapshot
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


# Snapshots written out by hand, in the wire's shape, with several series each.

_unknown_names = (f"metric_only_a_newer_worker_has_{n}" for n in itertools.count())


def _wire(
    seq: int,
    counters: dict[tuple[str, tuple[str, ...]], float] | None = None,
    histograms: dict[tuple[str, tuple[str, ...]], list[float]] | None = None,
    gauges: dict[tuple[str, tuple[str, ...]], float] | None = None,
    pid: int = 4242,
) -> dict[str, Any]:
    """A snapshot whose histograms are given by the values observed."""
    m = WorkerMetrics()
    for (name, labels), values in (histograms or {}).items():
        for v in values:
            m.observe(name, labels, v)
    snap = m.snapshot()
    snap.update(seq=seq, pid=pid)
    snap["counters"] = [[name, list(labels), value] for (name, labels), value in (counters or {}).items()]
    snap["gauges"] = [[name, list(labels), value] for (name, labels), value in (gauges or {}).items()]
    return snap


def _brute_sum(snapshots: list[dict[str, Any]]) -> WorkerReport:
    """Counters and histograms of `snapshots` added up directly from the wire rows."""
    total = WorkerReport(0, 0)
    for snap in snapshots:
        for name, labels, value in snap["counters"]:
            key = (name, tuple(labels))
            total.counters[key] = total.counters.get(key, 0) + value
        for name, labels, counts, hist_sum in snap["histograms"]:
            key = (name, tuple(labels))
            held_counts, held_sum = total.histograms.get(key, ([0] * len(counts), 0.0))
            total.histograms[key] = ([a + b for a, b in zip(held_counts, counts, strict=True)], held_sum + hist_sum)
    return total


def _assert_same_totals(got: WorkerReport, expected: WorkerReport) -> None:
    assert got.counters == expected.counters
    assert got.histograms.keys() == expected.histograms.keys()
    for key, (counts, total) in expected.histograms.items():
        assert got.histograms[key][0] == counts
        assert got.histograms[key][1] == pytest.approx(total)


def test_totals_sum_two_workers_counters_and_histograms_bucket_by_bucket() -> None:
    w1 = _wire(1, {("turns", TURN): 3, ("tokens", ("prompt",)): 100},
               {("turn_duration_seconds", ("engine",)): [0.001, 0.3, 400.0]})  # fmt: skip
    w2 = _wire(1, {("turns", TURN): 4, ("http_errors", ("chat", "502")): 1},
               {("turn_duration_seconds", ("engine",)): [0.001, 2.0],
                ("turn_duration_seconds", ("render",)): [0.02]})  # fmt: skip
    g = GatewayMetrics()
    g.heard("w1", w1)
    g.heard("w2", w2)
    totals = g.totals()
    assert totals.counters == {("turns", TURN): 7, ("tokens", ("prompt",)): 100, ("http_errors", ("chat", "502")): 1}
    engine_counts, engine_sum = totals.histograms[("turn_duration_seconds", ("engine",))]
    expected = [0] * (len(SECONDS_BUCKETS) + 1)
    for v in (0.001, 0.3, 400.0, 0.001, 2.0):
        expected[sum(1 for b in SECONDS_BUCKETS if b < v)] += 1
    assert engine_counts == expected and expected[0] == 2 and expected[-1] == 1
    assert engine_sum == pytest.approx(0.001 + 0.3 + 400.0 + 0.001 + 2.0)
    assert sum(totals.histograms[("turn_duration_seconds", ("render",))][0]) == 1
    assert totals.gauges == {}
    _assert_same_totals(totals, _brute_sum([w1, w2]))


def test_a_later_snapshot_replaces_the_earlier_one_even_after_the_earlier_was_read() -> None:
    g = GatewayMetrics()
    g.heard("w1", _wire(1, {("turns", TURN): 2}, {("turn_duration_seconds", ("total",)): [0.1]}))
    assert g.totals().counters == {("turns", TURN): 2}  # decoded here
    g.heard("w1", _wire(2, {("turns", TURN): 5}, {("turn_duration_seconds", ("total",)): [0.1, 0.1]}))
    totals = g.totals()
    assert totals.counters == {("turns", TURN): 5}  # cumulative: 5, not 2 + 5
    assert sum(totals.histograms[("turn_duration_seconds", ("total",))][0]) == 2
    assert g.reports["w1"].seq == 2


@pytest.mark.parametrize("late_seq", [1, 2, 3])
def test_a_snapshot_no_newer_than_the_one_held_is_ignored(late_seq: int) -> None:
    g = GatewayMetrics()
    g.heard("w1", _wire(3, {("turns", TURN): 9}))
    assert g.totals().counters == {("turns", TURN): 9}
    g.heard("w1", _wire(late_seq, {("turns", TURN): 1}))  # a beat that arrived late (or a duplicate)
    assert g.totals().counters == {("turns", TURN): 9} and g.reports["w1"].seq == 3


def test_a_snapshot_without_an_integer_seq_is_ignored() -> None:
    g = GatewayMetrics()
    g.heard("w1", _wire(1, {("turns", TURN): 1}))
    for seq in (True, 2.0, "3", None):
        snap = _wire(1, {("turns", TURN): 100})
        snap["seq"] = seq
        g.heard("w1", snap)
    g.heard("w2", {})  # nothing to keep
    assert g.totals().counters == {("turns", TURN): 1} and set(g.reports) == {"w1"}


_MALFORMED: dict[str, dict[str, Any]] = {
    "counter row too short": {"counters": [["turns", list(TURN)]]},
    "counter row too long": {"counters": [["turns", list(TURN), 1, 2]]},
    "gauge row too short": {"gauges": [["render_cache_pieces", []]]},
    "histogram row too short": {"histograms": [["turn_duration_seconds", ["total"], [0] * 18]]},
    "labels not a list": {"counters": [["turns", "chat", 1]]},
    "name not a string": {"counters": [[7, list(TURN), 1]]},
    "counter value a string": {"counters": [["turns", list(TURN), "many"]]},
    "counter value none": {"counters": [["turns", list(TURN), None]]},
    "gauge value a string": {"gauges": [["render_cache_pieces", [], "3"]]},
    "counter value a bool": {"counters": [["turns", list(TURN), True]]},
    "gauge value a bool": {"gauges": [["render_bpe_twin", [], False]]},
    "too few buckets": {"histograms": [["turn_duration_seconds", ["total"], [1] * len(SECONDS_BUCKETS), 0.1]]},
    "too many buckets": {"histograms": [["turn_duration_seconds", ["total"], [1] * (len(SECONDS_BUCKETS) + 2), 0.1]]},
    "buckets not a list": {"histograms": [["turn_duration_seconds", ["total"], 5, 0.1]]},
    "bucket a bool": {"histograms": [["turn_duration_seconds", ["total"], [True] + [0] * len(SECONDS_BUCKETS), 0.1]]},
    "histogram sum a string": {"histograms": [["turn_duration_seconds", ["total"], [0] * 18, "0.1"]]},
    "pid a string": {"pid": "4242"},
    "rows not a list": {"counters": 5},
}


@pytest.mark.parametrize("malformed", list(_MALFORMED.values()), ids=list(_MALFORMED))
def test_each_malformed_snapshot_is_ignored_and_the_previous_report_stays(
    malformed: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    good = _wire(1, {("turns", TURN): 2}, {("turn_duration_seconds", ("total",)): [0.1]},
                 {("render_cache_pieces", ()): 3})  # fmt: skip
    bad = {**_wire(2, {("turns", TURN): 50}), **malformed}
    with pytest.raises((ValueError, TypeError)):  # `reports` catches either
        decode_snapshot(bad)
    g = GatewayMetrics()
    g.heard("w1", good)
    before = g.totals()
    with caplog.at_level(logging.WARNING, logger="broker.metrics.gateway"):
        g.heard("w1", bad)
        totals = g.totals()
    assert totals.counters == before.counters == {("turns", TURN): 2}
    assert totals.histograms == before.histograms
    assert g.reports["w1"].seq == 1 and g.reports["w1"].gauges == {("render_cache_pieces", ()): 3}
    assert [r.levelno for r in caplog.records if "malformed" in r.message] == [logging.WARNING]
    assert "w1" in caplog.text


def test_malformed_snapshots_are_logged_once_per_worker_and_a_good_one_after_them_is_taken(
    caplog: pytest.LogCaptureFixture,
) -> None:
    g = GatewayMetrics()
    bad = list(_MALFORMED.values())
    with caplog.at_level(logging.WARNING, logger="broker.metrics.gateway"):
        for seq, malformed in enumerate(bad, start=1):
            for worker in ("w1", "w2"):
                g.heard(worker, {**_wire(seq, {("turns", TURN): seq}), **malformed})
                g.totals()
        assert g.reports == {} and g.totals().counters == {}  # no report ever decoded
        g.heard("w1", _wire(len(bad) + 1, {("turns", TURN): 7}))
        assert g.totals().counters == {("turns", TURN): 7}
        g.heard("w1", {**_wire(len(bad) + 2, {("turns", TURN): 8}), **bad[0]})
        assert g.totals().counters == {("turns", TURN): 7}
    logged = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert len(logged) == 2 and sum("w1" in m for m in logged) == 1 and sum("w2" in m for m in logged) == 1


def _worker_snapshot(k: int, seq: int = 1) -> dict[str, Any]:
    """Worker k's snapshot: series shared by every worker and some of its own, all with k-dependent values."""
    counters = {("turns", TURN): k + 1, ("tokens", ("prompt",)): 10 * k + seq, ("http_errors", ("chat", str(k % 7))): 1}
    histograms = {
        ("turn_duration_seconds", ("total",)): [0.001 * (k % 13), 0.5 + k],
        ("turn_duration_seconds", (f"s{k % 5}",)): [0.01],
    }
    return _wire(seq, counters, histograms, {("render_cache_pieces", ()): k})


def test_folding_past_max_reports_bounds_the_reports_and_leaves_the_totals_unchanged() -> None:
    g = GatewayMetrics()
    snapshots = [_worker_snapshot(k) for k in range(MAX_REPORTS + 10)]
    for k, snap in enumerate(snapshots):
        g.heard(f"w{k}", snap)  # none live: each gone once it has reported
        assert len(g.reports) <= MAX_REPORTS
    assert len(g.reports) == MAX_REPORTS
    assert set(g.reports) == {f"w{k}" for k in range(10, MAX_REPORTS + 10)}  # the oldest went first
    _assert_same_totals(g.totals(), _brute_sum(snapshots))
    assert g.totals().counters[("turns", TURN)] == sum(k + 1 for k in range(MAX_REPORTS + 10))


def test_live_workers_are_never_folded() -> None:
    g = GatewayMetrics()
    live = {f"w{k}" for k in range(0, MAX_REPORTS + 10, 9)}  # the oldest among them
    snapshots = {f"w{k}": _worker_snapshot(k) for k in range(MAX_REPORTS + 10)}
    for worker, snap in snapshots.items():
        g.heard(worker, snap, live=live)
    reports = g.reports
    assert live <= set(reports) and len(reports) <= MAX_REPORTS
    for worker in live:  # kept whole, gauges and all
        assert reports[worker] == decode_snapshot(snapshots[worker])
    _assert_same_totals(g.totals(), _brute_sum(list(snapshots.values())))
    # A live worker's next snapshot still replaces its own (it was not folded, so not counted twice).
    g.heard("w0", _worker_snapshot(0, seq=2), live=live)
    newer = list(snapshots.values())
    newer[0] = _worker_snapshot(0, seq=2)
    _assert_same_totals(g.totals(), _brute_sum(newer))


def test_when_every_worker_is_live_nothing_is_folded() -> None:
    g = GatewayMetrics()
    workers = [f"w{k}" for k in range(MAX_REPORTS + 5)]
    for k, worker in enumerate(workers):
        g.heard(worker, _worker_snapshot(k), live=workers)
    assert set(g.reports) == set(workers)


@given(
    st.lists(
        st.tuples(st.integers(0, 9), st.integers(1, 6), st.integers(0, 1000)),  # (worker, seq, value)
        max_size=60,
    ),
    st.integers(1, 5),
)
def test_totals_are_the_newest_snapshot_of_every_worker_whatever_is_folded(
    beats: list[tuple[int, int, int]], bound: int
) -> None:
    """With a small bound: a worker is live until its last beat (never heard once gone), then may be folded."""
    last_beat = {worker: i for i, (worker, _, _) in enumerate(beats)}
    newest: dict[int, tuple[int, dict[str, Any]]] = {}
    g = GatewayMetrics()
    with mock.patch.object(gateway, "MAX_REPORTS", bound):
        for i, (worker, seq, value) in enumerate(beats):
            snap = _wire(seq, {("turns", TURN): value, ("tokens", (str(worker),)): seq},
                         {("turn_duration_seconds", ("total",)): [value / 10]})  # fmt: skip
            live = {f"w{w}" for w, j in last_beat.items() if j > i} | {f"w{worker}"}
            g.heard(f"w{worker}", snap, live=live)
            accepted = seq > newest.get(worker, (0, {}))[0]
            if accepted:
                newest[worker] = (seq, snap)
            if i % 3 == 0:
                g.totals()  # decode now and then, as scrapes do
            if accepted:  # each snapshot kept folds what it must (a late one, ignored, folds nothing)
                assert len(g.reports) <= max(bound, len(live))
        _assert_same_totals(g.totals(), _brute_sum([snap for _, snap in newest.values()]))


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _render_two_workers(**kwargs: Any) -> str:
    g = GatewayMetrics()
    g.heard("w1", _wire(1, {("turns", TURN): 2}, {("turn_duration_seconds", ("engine",)): [0.001, 0.2]},
                        {("render_cache_pieces", ()): 3}, pid=101))  # fmt: skip
    g.heard("w2", _wire(1, {("turns", TURN): 5}, {("turn_duration_seconds", ("engine",)): [0.001, 500.0]},
                        {("render_cache_pieces", ()): 4}, pid=102))  # fmt: skip
    heard = kwargs.pop("heard", {"w1": 10.0, "w2": 9.5})
    return exposition.render(kwargs.pop("stats", {}), g, heard, now=kwargs.pop("now", 10.5))


def test_every_family_has_help_and_a_type_and_every_name_the_prefix() -> None:
    stats = {key: 1 for key in catalog.BROKER_STATS} | {"refusals": {"busy": 1}, "row_decisions": {"clean": 2},
             "rows_per_episode": [[0] * (len(catalog.ROWS_BUCKETS) + 1), 0.0],
             "replicas": {"http://e:1": {"healthy": True, "sessions": 2}}}  # fmt: skip
    families = _families(_render_two_workers(stats=stats))
    assert len(families) > 10
    for name, family in families.items():
        assert name.startswith(catalog.PREFIX)
        assert family.documentation.strip(), name
        assert family.type in ("counter", "gauge", "histogram"), name
        assert family.samples, name


def test_a_worker_counter_is_summed_over_the_workers_under_its_label_names() -> None:
    family = _families(_render_two_workers())["rollout_gateway_turns"]
    assert family.type == "counter" and family.documentation == catalog.WORKER_METRICS["turns"].help
    assert [(s.name, s.labels, s.value) for s in family.samples] == [
        ("rollout_gateway_turns_total", {"dialect": "chat", "stream": "false", "outcome": "committed"}, 7)
    ]


def test_histogram_buckets_are_cumulative_and_the_inf_bucket_is_the_count() -> None:
    family = _families(_render_two_workers())["rollout_gateway_turn_duration_seconds"]
    assert family.type == "histogram"
    buckets = [(s.labels["le"], s.value) for s in family.samples if s.name.endswith("_bucket")]
    assert all(s.labels.get("stage") == "engine" for s in family.samples)
    assert [le for le, _ in buckets] == [str(b) for b in SECONDS_BUCKETS] + ["+Inf"]
    values = [v for _, v in buckets]
    assert values == sorted(values)  # cumulative: never decreasing
    assert dict(buckets)["0.001"] == 2  # exactly on the bound: counted in it
    assert dict(buckets)["0.25"] == 3 and dict(buckets)["300.0"] == 3 and dict(buckets)["+Inf"] == 4
    (count,) = [s.value for s in family.samples if s.name.endswith("_count")]
    (total,) = [s.value for s in family.samples if s.name.endswith("_sum")]
    assert count == values[-1] == 4
    assert total == pytest.approx(0.001 + 0.2 + 0.001 + 500.0)


def test_per_worker_gauges_carry_the_worker_label_and_only_heard_workers_appear() -> None:
    families = _families(_render_two_workers(heard={"w2": 9.0, "w3": 8.0}))  # w1 not heard; w3 sent nothing yet
    pieces = families["rollout_gateway_render_cache_pieces"]
    assert pieces.type == "gauge"
    assert [(s.labels, s.value) for s in pieces.samples] == [({"worker": "w2"}, 4)]
    info = families["rollout_gateway_worker_info"]
    assert [(s.labels, s.value) for s in info.samples] == [({"worker": "w2", "pid": "102"}, 1)]
    ages = {s.labels["worker"]: s.value for s in families["rollout_gateway_worker_heartbeat_age_seconds"].samples}
    assert ages == {"w2": pytest.approx(1.5), "w3": pytest.approx(2.5)}
    # The counters still count every worker that reported, heard now or not.
    assert families["rollout_gateway_turns"].samples[0].value == 7


def test_no_worker_heard_means_no_per_worker_family() -> None:
    families = _families(_render_two_workers(heard={}))
    assert "rollout_gateway_render_cache_pieces" not in families
    assert "rollout_gateway_worker_heartbeat_age_seconds" not in families
    assert families["rollout_gateway_turns"].samples[0].value == 7


@pytest.mark.parametrize(("heard_at", "now"), [(100.0, 100.0), (100.0, 103.25), (90.5, 1000.0), (105.0, 100.0)])
def test_heartbeat_age_is_now_minus_the_time_heard(heard_at: float, now: float) -> None:
    families = _families(_render_two_workers(heard={"w1": heard_at}, now=now))
    (sample,) = families["rollout_gateway_worker_heartbeat_age_seconds"].samples
    assert sample.labels == {"worker": "w1"}
    assert sample.value == pytest.approx(max(0.0, now - heard_at))


@pytest.mark.parametrize("key", list(catalog.BROKER_STATS))
def test_each_broker_stat_appears_under_its_metric_name_and_label_values(key: str) -> None:
    metric, label_values = catalog.BROKER_STATS[key]
    text = exposition.render({key: 5, "not_a_stat": 9}, GatewayMetrics(), {}, now=0.0)
    family = _families(text)[catalog.PREFIX + metric.name]
    assert family.type == metric.kind and family.documentation == metric.help
    sample_name = catalog.PREFIX + metric.name + ("_total" if metric.kind == "counter" else "")
    assert [(s.name, s.labels, s.value) for s in family.samples] == [
        (sample_name, dict(zip(metric.labels, label_values, strict=True)), 5)
    ]
    assert "not_a_stat" not in text


def test_broker_stats_of_one_metric_share_its_family() -> None:
    stats = {"commits_stored": 5, "commits_duplicate": 2, "commits_late": 0}
    family = _families(exposition.render(stats, GatewayMetrics(), {}, now=0.0))["rollout_gateway_broker_commits"]
    assert {s.labels["outcome"]: s.value for s in family.samples} == {"stored": 5, "duplicate": 2, "late": 0}
    assert {s.name for s in family.samples} == {"rollout_gateway_broker_commits_total"}


def test_refusals_are_a_counter_by_code() -> None:
    stats = {"refusals": {"unknown_session": 3, "busy": 1}}
    family = _families(exposition.render(stats, GatewayMetrics(), {}, now=0.0))["rollout_gateway_broker_refusals"]
    assert family.type == "counter"
    assert {(s.name, s.labels["code"], s.value) for s in family.samples} == {
        ("rollout_gateway_broker_refusals_total", "unknown_session", 3),
        ("rollout_gateway_broker_refusals_total", "busy", 1),
    }


def test_the_brokers_commit_latency_is_a_histogram_of_what_it_observed() -> None:
    g = GatewayMetrics()
    for seconds in (0.0005, 0.001, 0.003, 7.0):
        g.commit_seconds.observe(seconds)
    family = _families(exposition.render({}, g, {}, now=0.0))["rollout_gateway_broker_commit_seconds"]
    buckets = {s.labels["le"]: s.value for s in family.samples if s.name.endswith("_bucket")}
    assert buckets["0.001"] == 2 and buckets["0.005"] == 3 and buckets["5.0"] == 3 and buckets["+Inf"] == 4
    (total,) = [s.value for s in family.samples if s.name.endswith("_sum")]
    assert total == pytest.approx(0.0005 + 0.001 + 0.003 + 7.0)


def test_an_unknown_worker_metric_is_not_exposed_and_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    unknown_counter, unknown_gauge, unknown_hist = next(_unknown_names), next(_unknown_names), next(_unknown_names)
    g = GatewayMetrics()
    for worker in ("w1", "w2"):
        g.heard(worker, _wire(1, {("turns", TURN): 1, (unknown_counter, ("x",)): 4},
                              {(unknown_hist, ()): [0.1]}, {(unknown_gauge, ()): 2}))  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="broker.metrics.exposition"):
        texts = [exposition.render({}, g, {"w1": 0.0, "w2": 0.0}, now=1.0) for _ in range(3)]
    for text in texts:
        assert unknown_counter not in text and unknown_gauge not in text and unknown_hist not in text
        assert _families(text)["rollout_gateway_turns"].samples[0].value == 2  # the known ones still are
    for name in (unknown_counter, unknown_gauge, unknown_hist):
        assert sum(name in r.getMessage() for r in caplog.records) == 1, name


def test_a_known_name_of_the_wrong_kind_or_label_count_is_not_exposed() -> None:
    g = GatewayMetrics()
    g.heard("w1", _wire(1, {("turns", ("chat",)): 3, ("render_cache_pieces", ()): 8, ("tokens", ("output",)): 2},
                        gauges={("agent_finishes", ()): 1}))  # fmt: skip
    families = _families(exposition.render({}, g, {"w1": 0.0}, now=0.0))
    assert "rollout_gateway_turns" not in families  # a counter with one label where the catalog has three
    assert "rollout_gateway_render_cache_pieces" not in families  # a gauge sent as a counter
    assert "rollout_gateway_agent_finishes" not in families  # a counter sent as a gauge
    assert [(s.labels, s.value) for s in families["rollout_gateway_tokens"].samples] == [({"kind": "output"}, 2)]
