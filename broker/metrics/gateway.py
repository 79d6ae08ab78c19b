"""The workers' metrics as the broker holds them: the newest snapshot of each, and their sums.

A worker's snapshot (`Heartbeat.metrics`, see `broker.protocol.SECONDS_BUCKETS`) is cumulative since the
worker started, so the gateway's totals are the sum over every worker that ever reported, live or not: a
worker that exits (or is killed) keeps its counts in the totals, which therefore never go backwards. Only
gauges (what a process holds now) are dropped with the worker. Reports of workers long gone are folded
into one retired sum, so memory stays bounded however often workers restart. Pure bookkeeping: no sockets,
no clock; imports only the stdlib and `broker.protocol`.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from broker.protocol import SECONDS_BUCKETS

logger = logging.getLogger(__name__)

# Workers whose reports are kept apart (live ones, and recently gone); older ones are summed into one.
MAX_REPORTS = 256

Series = tuple[str, tuple[str, ...]]  # (name, label values)


class Histogram:
    """Counts per bucket (`bounds`, then one above the last) and the sum of what was observed."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def wire(self) -> list[Any]:
        """As a snapshot carries a histogram: [counts, sum]."""
        return [list(self.counts), self.sum]


@dataclass(slots=True)
class WorkerReport:
    """One worker's newest snapshot, decoded."""

    seq: int
    pid: int
    counters: dict[Series, float] = field(default_factory=dict)
    histograms: dict[Series, tuple[list[float], float]] = field(default_factory=dict)
    gauges: dict[Series, float] = field(default_factory=dict)


def _series(row: Any, width: int) -> tuple[Series, list[Any]]:
    """(name, label values) and the rest of a snapshot row; ValueError if it is not one."""
    if not isinstance(row, list) or len(row) != width or not isinstance(row[0], str) or not isinstance(row[1], list):
        raise ValueError(f"not a metrics row: {row!r:.200}")
    labels = tuple(str(v) for v in row[1])
    return (row[0], labels), row[2:]


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"not a number: {value!r:.100}")
    return value


def decode_snapshot(snapshot: Mapping[str, Any]) -> WorkerReport:
    """A snapshot from the wire, checked; ValueError on any malformed part."""
    report = WorkerReport(int(_number(snapshot.get("seq", 0))), int(_number(snapshot.get("pid", 0))))
    for row in snapshot.get("counters", ()):
        key, (value,) = _series(row, 3)
        report.counters[key] = report.counters.get(key, 0) + _number(value)
    for row in snapshot.get("gauges", ()):
        key, (value,) = _series(row, 3)
        report.gauges[key] = _number(value)
    buckets = len(SECONDS_BUCKETS) + 1
    for row in snapshot.get("histograms", ()):
        key, (counts, total) = _series(row, 4)
        if not isinstance(counts, list) or len(counts) != buckets:
            raise ValueError(f"histogram {key[0]} has {len(counts)} buckets, not {buckets}")
        report.histograms[key] = ([_number(c) for c in counts], _number(total))
    return report


class GatewayMetrics:
    """The newest report of each worker, and the sums over all of them.

    A heartbeat only keeps its snapshot (a sequence check and a reference): snapshots are decoded when the
    metrics are read (a scrape, `stats`), so the loop's steady cost does not grow with what workers count.
    """

    def __init__(self) -> None:
        self._seq: dict[str, int] = {}  # by worker id: the newest snapshot's seq
        # Snapshots not decoded yet: the newest, after the one it replaced (which stands in if the newest is malformed).
        self._pending: dict[str, list[Mapping[str, Any]]] = {}
        self._reports: dict[str, WorkerReport] = {}  # each worker's newest report that decoded, oldest first
        self._retired = WorkerReport(0, 0)  # the sums of reports folded away (`MAX_REPORTS`)
        self._malformed: set[str] = set()  # workers whose malformed snapshot was logged
        self.commit_seconds = Histogram(SECONDS_BUCKETS)  # the broker's own, from receipt to acknowledgement

    def heard(self, worker_id: str, snapshot: Mapping[str, Any], live: Iterable[str] = ()) -> None:
        """Keep `worker_id`'s snapshot, unless it is older than the one held (a beat that arrived late)."""
        if not snapshot:
            return
        seq = snapshot.get("seq", 0)
        if type(seq) is not int or seq <= self._seq.get(worker_id, 0):
            return
        self._seq[worker_id] = seq
        pending = self._pending.get(worker_id)
        self._pending[worker_id] = [pending[-1], snapshot] if pending else [snapshot]
        if len(self._seq) > MAX_REPORTS:
            self._retire(set(live))

    @property
    def reports(self) -> dict[str, WorkerReport]:
        """Each worker's newest report that decoded (a malformed snapshot is logged once and leaves the
        worker's previous report in place)."""
        for worker_id, snapshots in self._pending.items():
            for snapshot in reversed(snapshots):  # the newest that decodes
                try:
                    report = decode_snapshot(snapshot)
                except (ValueError, TypeError) as e:
                    if worker_id not in self._malformed:
                        self._malformed.add(worker_id)
                        logger.warning("worker %s sent malformed metrics (ignored): %s", worker_id, e)
                    continue
                self._reports.pop(worker_id, None)
                self._reports[worker_id] = report  # newest last
                break
        self._pending.clear()
        return self._reports

    def _retire(self, live: set[str]) -> None:
        """Fold the oldest reports of workers not live into the retired sums."""
        reports = self.reports
        for worker_id in list(reports):
            if len(self._seq) <= MAX_REPORTS:
                return
            if worker_id not in live:
                _add(self._retired, reports.pop(worker_id))
                del self._seq[worker_id]
        for worker_id in [w for w in self._seq if w not in reports and w not in live]:  # never decoded
            del self._seq[worker_id]

    def totals(self) -> WorkerReport:
        """Counters and histograms summed over every worker that reported (gauges left empty)."""
        total = WorkerReport(0, 0)
        _add(total, self._retired)
        for report in self.reports.values():
            _add(total, report)
        return total


def _add(into: WorkerReport, report: WorkerReport) -> None:
    for key, value in report.counters.items():
        into.counters[key] = into.counters.get(key, 0) + value
    for key, (counts, total) in report.histograms.items():
        held = into.histograms.get(key)
        if held is None:
            into.histograms[key] = (list(counts), total)
        else:
            into.histograms[key] = ([a + b for a, b in zip(held[0], counts, strict=True)], held[1] + total)
