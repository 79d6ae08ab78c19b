"""What one worker counts, and the snapshot of it that its heartbeats carry to the broker.

Metrics are aggregated at the broker (`broker.metrics`): it already sees every session, turn and episode,
and every worker heartbeats to it, so one `/metrics` scrape on any worker (which asks the broker) sees the
whole gateway, wherever its processes run. A worker only counts, on its event loop, into plain dicts
(a turn costs a few dict updates, no lock, no file write), and hands a snapshot to whoever asks: the
heartbeat thread every beat, `/metrics` on a scrape. The snapshot's shape is the wire contract's
(`broker.protocol.SECONDS_BUCKETS` and the comment beside it); the names and their help text are listed
in `broker.metrics.catalog`. What the worker's parts count themselves is added by `TurnPipeline.metric_rows`.
Imports the stdlib and `broker.protocol` only.
"""

from __future__ import annotations

import itertools
import os
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import Any

from broker.protocol import SECONDS_BUCKETS

Labels = tuple[str, ...]
_BUCKETS = len(SECONDS_BUCKETS) + 1  # the last counts what is above every bound


class WorkerMetrics:
    """Counters and histograms of one worker process, written by its event loop.

    `snapshot` may run on another thread (the heartbeat's): it copies each dict in one C call, which the
    interpreter never interrupts, so it sees every update either whole or not at all.
    """

    def __init__(self) -> None:
        self.counts: dict[tuple[str, Labels], float] = {}
        self.histograms: dict[tuple[str, Labels], list[float]] = {}  # bucket counts, then the sum
        self._seq = itertools.count(1)
        self._snapshot_lock = threading.Lock()

    def count(self, name: str, labels: Labels = (), by: float = 1) -> None:
        key = (name, labels)
        self.counts[key] = self.counts.get(key, 0) + by

    def count_each(self, name: str, label: str, values: Iterable[str]) -> None:
        """`count(name, (label, value))` for each of `values`, in one call (a request's ignored fields)."""
        counts = self.counts
        for value in values:
            key = (name, (label, value))
            counts[key] = counts.get(key, 0) + 1

    def observe(self, name: str, labels: Labels, seconds: float) -> None:
        key = (name, labels)
        counts = self.histograms.get(key)
        if counts is None:
            counts = self.histograms[key] = [0] * _BUCKETS + [0.0]
        counts[bisect_left(SECONDS_BUCKETS, seconds)] += 1
        counts[-1] += seconds

    def snapshot(self, parts: Callable[[], tuple[list[list[Any]], list[list[Any]]]] | None = None) -> dict[str, Any]:
        """Everything counted so far, plus `parts()`: what the worker's parts count themselves (counter rows)
        and hold now (gauge rows), in the wire's shape."""
        # One at a time: a later seq never carries older counts, so the broker can drop what arrives late.
        with self._snapshot_lock:
            more_counters, gauges = parts() if parts is not None else ([], [])
            seq = next(self._seq)
            counts, histograms = dict(self.counts), dict(self.histograms)
            bucketed = [[name, list(labels), list(h[:-1]), h[-1]] for (name, labels), h in histograms.items()]
        return {
            "seq": seq,
            "pid": os.getpid(),
            "counters": [[name, list(labels), value] for (name, labels), value in counts.items()] + more_counters,
            "histograms": bucketed,
            "gauges": gauges,
        }
