"""The control messages: GetStats, GetMetrics (either side: a worker's `/metrics` scrape sends its own counts
along), SetEngines and SetWeightVersion; and the broker's stats and metrics they answer with, and the engine
replicas' health checks taken in."""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any, ClassVar

from broker import protocol
from broker.handlers.base import Answer, Concern, Side
from broker.metrics import exposition
from broker.sessions.session import Refusal
from broker.state import BrokerState

logger = logging.getLogger("broker.server")

# SetEngines takes at most this many replicas.
MAX_REPLICAS = 1024


class ControlHandlers(Concern):
    ROUTES: ClassVar[dict[type, str]] = {
        protocol.GetStats: "get_stats",
        protocol.GetMetrics: "get_metrics",
        protocol.SetEngines: "set_engines",
        protocol.SetWeightVersion: "set_weight_version",
    }

    def get_stats(self, msg: protocol.GetStats, envelope: list[bytes], payload: bytes, side: Side) -> Answer:
        return protocol.Stats(msg.request_id, stats(self._state))

    def get_metrics(self, msg: protocol.GetMetrics, envelope: list[bytes], payload: bytes, side: Side) -> Answer:
        state = self._state
        if msg.worker_id:
            state.metrics.heard(msg.worker_id, msg.metrics, state.workers.heard)
        return protocol.MetricsText(msg.request_id, metrics_text(state))

    def set_engines(self, msg: protocol.SetEngines, envelope: list[bytes], payload: bytes, side: Side) -> Answer:
        urls = msg.urls
        if not isinstance(urls, list) or len(urls) > MAX_REPLICAS or not all(
            isinstance(u, str) and u.startswith(("http://", "https://")) and len(u) <= 2048 for u in urls
        ):
            raise Refusal("bad_request", f"engines are at most {MAX_REPLICAS} http(s):// base URLs")
        replicas = self._state.replicas
        replicas.set(urls)
        self._state.health.watch(replicas.urls)
        logger.info("engine replicas set: %s", ", ".join(replicas.urls) or "none")
        return protocol.EnginesSet(msg.request_id, list(replicas.urls))

    def set_weight_version(
        self, msg: protocol.SetWeightVersion, envelope: list[bytes], payload: bytes, side: Side
    ) -> Answer:
        version = msg.version
        if type(version) is not int or not 0 <= version < 2**31:
            raise Refusal("bad_request", f"a weight version is an int in [0, 2**31), not {version!r}")
        registry = self._state.registry
        previous, registry.weight_version = registry.weight_version, version
        self._state.journal.weight_version_set(version)
        return protocol.WeightVersionSet(msg.request_id, version, previous)


def health_checked(state: BrokerState) -> None:
    """Take the health checks' verdicts: a replica that failed takes no new sessions, and its sessions move."""
    results = state.health.results
    while not results.empty():
        url, healthy, error = results.get_nowait()
        if state.replicas.health(url, healthy, error):
            if healthy:
                logger.info("engine replica %s is healthy again: it takes sessions", url)
            else:
                logger.warning("engine replica %s failed its health check (%s): its sessions move to the "
                               "others at their next turn", url, error)  # fmt: skip


def metrics_text(state: BrokerState) -> str:
    """The whole gateway's metrics, Prometheus text (`broker.metrics.exposition`)."""
    return exposition.render(stats(state), state.metrics, state.workers.heard, time.monotonic())


def worker_stats(state: BrokerState) -> dict[str, dict[str, Any]]:
    """Each live worker: seconds since its last heartbeat, its pid, the turns it has in flight and the engine
    replicas it sends to."""
    in_flight: Counter[str] = Counter()
    for session in state.registry.sessions():
        in_flight.update(session.owners.values())
    now = time.monotonic()
    return {
        worker_id: {
            "heard_s_ago": round(now - heard, 3),
            "pid": report.pid if (report := state.metrics.reports.get(worker_id)) is not None else None,
            "turns_in_flight": in_flight[worker_id],
            "replicas": [labels[0] for name, labels in report.gauges if name == "engine_replica"]
            if report is not None
            else [],
        }
        for worker_id, heard in state.workers.heard.items()
    }


def stats(state: BrokerState) -> dict[str, Any]:
    """Registry gauges and counters plus the loop's own: refusals by code, protocol errors, drops; the
    workers (`worker_stats`) and the sums of their metrics (`gateway`: `broker.metrics.gateway`)."""
    registry, totals = state.registry, state.metrics.totals()
    return {
        **registry.stats(),
        **state.outbox.stats(),
        **state.finishes.stats(),
        **state.trimmer.stats(registry.counters["bytes_freed"]),
        "workers_heard": len(state.workers.heard),
        "weight_version": registry.weight_version,
        **state.generation.stats(time.monotonic()),
        **state.replicas.stats(),
        "workers": worker_stats(state),
        **state.rows.stats(),
        "broker_commit_seconds": state.metrics.commit_seconds.wire(),
        "gateway": {
            "counters": [[name, list(labels), value] for (name, labels), value in totals.counters.items()],
            "histograms": [[name, list(labels), counts, total]
                           for (name, labels), (counts, total) in totals.histograms.items()],
            "seconds_buckets": list(protocol.SECONDS_BUCKETS),
        },
        **(state.durable.stats() if state.durable is not None else {"state_dir": None}),
        "refusals": dict(state.refusals),
        "protocol_errors": state.loop_counters["protocol_errors"],
        "replies_dropped": state.loop_counters["replies_dropped"],
        "uptime_s": round(time.monotonic() - state.started, 3),
        "protocol_version": protocol.PROTOCOL_VERSION,
    }
