"""The whole gateway's metrics in the Prometheus text format, rendered with `prometheus-client`.

What a worker's `GET /metrics` answers (it asks the broker, `protocol.GetMetrics`): one scrape of any
worker sees every worker and the broker. Built on each request from the broker's stats, the workers'
reports (`gateway.GatewayMetrics`) and the liveness table, by a collector the library renders
(`# HELP` and `# TYPE` lines, escaping, cumulative histogram buckets). Runs on the broker's loop, once
per scrape. Imports `prometheus_client` (at the broker's start: loading it takes tens of milliseconds, which
the first scrape must not stall the loop for) and `broker.metrics`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from broker.metrics.catalog import (
    BROKER_STATS,
    COMMIT_SECONDS,
    HEARTBEAT_AGE,
    PREFIX,
    REFUSALS,
    REPLICA_HEALTHY,
    REPLICA_SESSIONS,
    ROW_DECISIONS,
    ROWS_BUCKETS,
    ROWS_PER_EPISODE,
    WORKER_INFO,
    WORKER_METRICS,
    Metric,
)
from broker.metrics.gateway import GatewayMetrics
from broker.protocol import SECONDS_BUCKETS

logger = logging.getLogger(__name__)
_unknown_logged: set[str] = set()


class _Families:
    """The metric families of one scrape, made on first use, in the order first used."""

    def __init__(self) -> None:
        self._types = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}
        self.families: dict[str, Any] = {}

    def get(self, metric: Metric, per_worker: bool = False) -> Any:
        family = self.families.get(metric.name)
        if family is None:
            labels = ["worker", *metric.labels] if per_worker else list(metric.labels)
            family = self.families[metric.name] = self._types[metric.kind](
                PREFIX + metric.name, metric.help, labels=labels
            )
        return family

    def sample(self, metric: Metric, labels: tuple[str, ...], value: float, worker: str | None = None) -> None:
        """One sample; a per-worker metric's (a gauge of one process) is labelled with the `worker` too."""
        if worker is None:
            self.get(metric).add_metric(list(labels), value)
        else:
            self.get(metric, per_worker=True).add_metric([worker, *labels], value)

    def histogram(
        self, metric: Metric, labels: tuple[str, ...], bounds: tuple[float, ...], counts: list[float], total: float
    ) -> None:
        cumulative, running = [], 0.0
        for bound, count in zip((*bounds, float("inf")), counts, strict=True):
            running += count
            cumulative.append((floatToGoString(bound), running))
        self.get(metric).add_metric(list(labels), cumulative, total)


def _known(name: str, labels: tuple[str, ...], kind: str) -> Metric | None:
    """The catalog's metric a worker's row names, if its kind and label count match (else logged once)."""
    metric = WORKER_METRICS.get(name)
    if metric is not None and metric.kind == kind and len(metric.labels) == len(labels):
        return metric
    if name not in _unknown_logged:
        _unknown_logged.add(name)
        logger.warning(
            "a worker reports a %s %r this broker does not know (%d labels); not exposed (a newer "
            "worker? upgrade the broker)",
            kind,
            name,
            len(labels),
        )
    return None


def render(stats: Mapping[str, Any], gateway: GatewayMetrics, heard: Mapping[str, float], now: float) -> str:
    """The text exposition: the workers' totals and live gauges, then the broker's own."""
    families = _Families()
    totals = gateway.totals()
    for (name, labels), value in totals.counters.items():
        if (metric := _known(name, labels, "counter")) is not None:
            families.sample(metric, labels, value)
    for (name, labels), (counts, total) in totals.histograms.items():
        if (metric := _known(name, labels, "histogram")) is not None:
            families.histogram(metric, labels, SECONDS_BUCKETS, counts, total)
    for worker_id, last in heard.items():
        report = gateway.reports.get(worker_id)
        families.sample(HEARTBEAT_AGE, (), max(0.0, now - last), worker_id)
        if report is None:
            continue
        families.sample(WORKER_INFO, (str(report.pid),), 1, worker_id)
        for (name, labels), value in report.gauges.items():
            if (metric := _known(name, labels, "gauge")) is not None:
                families.sample(metric, labels, value, worker_id)
    for key, value in stats.items():
        entry = BROKER_STATS.get(key)
        if entry is not None and isinstance(value, (int, float)):
            metric, labels = entry
            families.sample(metric, labels, float(value))
    for code, count in stats.get("refusals", {}).items():
        families.sample(REFUSALS, (code,), count)
    for url, replica in stats.get("replicas", {}).items():
        families.sample(REPLICA_HEALTHY, (url,), int(replica["healthy"]))
        families.sample(REPLICA_SESSIONS, (url,), replica["sessions"])
    families.histogram(COMMIT_SECONDS, (), SECONDS_BUCKETS, *gateway.commit_seconds.wire())
    rows = stats.get("rows_per_episode")
    if rows is not None:
        families.histogram(ROWS_PER_EPISODE, (), ROWS_BUCKETS, *rows)
    for decision, count in stats.get("row_decisions", {}).items():
        families.sample(ROW_DECISIONS, (decision,), count)

    class _Collector:
        def collect(self) -> Iterator[Any]:
            yield from families.families.values()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())  # type: ignore[arg-type]
    return generate_latest(registry).decode()
