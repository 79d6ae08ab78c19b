"""`rollout-gateway status`'s arithmetic: percentiles from histogram buckets, rates over an interval, a restart."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.protocol import SECONDS_BUCKETS
from trainer_client.status import quantile, render, summarize

BOUNDS = (0.1, 0.2, 0.4)


def test_quantile_interpolates_within_the_bucket_as_prometheus_does() -> None:
    assert quantile(0.5, BOUNDS, [0, 0, 0, 0]) is None
    assert quantile(0.5, BOUNDS, [10, 0, 0, 0]) == 0.05  # halfway into the first bucket, from 0
    assert quantile(0.5, BOUNDS, [0, 4, 0, 0]) == pytest.approx(0.15)
    assert quantile(0.75, BOUNDS, [0, 2, 2, 0]) == pytest.approx(0.3)  # the middle of the third bucket
    assert quantile(0.99, BOUNDS, [1, 0, 0, 99]) == 0.4  # above every bound: the last bound


@given(st.lists(st.integers(0, 50), min_size=4, max_size=4), st.floats(0.01, 1.0))
def test_quantile_lies_in_the_bucket_that_holds_its_rank(counts: list[int], q: float) -> None:
    value = quantile(q, BOUNDS, counts)
    if sum(counts) == 0:
        assert value is None
        return
    assert value is not None
    rank, below = q * sum(counts), 0
    for i, count in enumerate(counts):
        if count and below + count >= rank:
            low, high = (BOUNDS[i - 1] if i else 0.0), (BOUNDS[i] if i < len(BOUNDS) else BOUNDS[-1])
            assert low - 1e-12 <= value <= high + 1e-12
            return
        below += count


def _stats(uptime: float, committed: int, seconds: list[int], rows: tuple[list[int], float]) -> dict[str, Any]:
    return {
        "uptime_s": uptime, "sessions_open": 2, "turns_in_flight": 1, "rows_per_episode": list(rows),
        "replicas": {"http://e:2": {"healthy": False, "sessions": 0, "last_error": "refused"}},
        "workers": {"w1": {"heard_s_ago": 0.5, "pid": 7, "turns_in_flight": 1, "replicas": ["http://e:1"]}},
        "gateway": {
            "counters": [["turns", ["chat", "false", "committed"], committed],
                         ["turns", ["chat", "true", "refused"], 4], ["tokens", ["output"], 10 * committed],
                         ["engine_errors", ["http://e:1", "timeout"], 2]],
            "histograms": [["turn_duration_seconds", ["total"], seconds, 0.0]],
            "seconds_buckets": list(SECONDS_BUCKETS),
        },
    }  # fmt: skip


def test_rates_and_percentiles_are_over_the_interval_and_a_restart_starts_again() -> None:
    empty = [0] * (len(SECONDS_BUCKETS) + 1)
    slow = list(empty)
    slow[SECONDS_BUCKETS.index(1.0)] = 100  # 100 turns of up to a second since the start
    before = _stats(10.0, 100, slow, ([0, 5] + [0] * 12, 10.0))
    fast = list(slow)
    fast[SECONDS_BUCKETS.index(0.01)] = 50  # then 50 turns of up to 10 ms in the last 5 s
    after = _stats(15.0, 150, fast, ([0, 5, 2] + [0] * 11, 16.0))

    first = summarize(before, None, 0.0)  # since the start: 100 turns in 10 s
    assert first["turns_per_s"]["committed"] == 10.0 and first["tokens_per_s"]["output"] == 100.0
    assert 0.5 < first["turn_seconds"]["p50"] <= 1.0
    assert first["rows_per_episode"] == 2.0 and first["episodes"] == 5

    window = summarize(after, before, 5.0)
    assert window["turns_per_s"]["committed"] == 10.0 and window["turns_per_s"]["refused"] == 0.0
    assert window["turn_seconds"]["p99"] <= 0.01  # only the last interval's turns
    assert window["episodes"] == 2 and window["rows_per_episode"] == 3.0
    down = {"errors": {}, "healthy": False, "sessions": 0, "last_error": "refused"}
    assert window["replicas"] == {"http://e:1": {"errors": {"timeout": 2}}, "http://e:2": down}

    restarted = summarize(_stats(1.0, 150, fast, ([0] * 14, 0.0)), after, 5.0)  # uptime went back
    assert restarted["turns_per_s"]["committed"] == 150.0

    screen = render(window, "tcp://h:1")
    assert "10.0 committed" in screen and "w1" in screen and "pid 7" in screen and "timeout 2" in screen
    assert "UNHEALTHY (refused)" in screen
