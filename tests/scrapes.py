"""Reading the gateway's metrics in tests: a `/metrics` scrape parsed by prometheus-client's own parser,
and each worker's own snapshot (`/metrics/worker`), flattened."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(root: str) -> Samples:
    """One `GET /metrics`: {(sample name, sorted label pairs): value}. Asserts a 200 in the Prometheus format."""
    reply = httpx.get(f"{root}/metrics", timeout=10)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain; version=0.0.4"), reply
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(reply.text)
        for sample in family.samples
    }


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples called `name` whose labels include `labels`."""
    return sum(v for (n, pairs), v in samples.items() if n == name and labels.items() <= dict(pairs).items())


def flat(snapshot: dict[str, Any]) -> dict[str, float]:
    """A worker snapshot's counters and gauges as {"name" or "name:label:...": value}."""
    return {":".join([name, *labels]): value for name, labels, value in snapshot["counters"] + snapshot["gauges"]}


def worker_snapshots(root: str, workers: int, tries: int = 200) -> dict[int, dict[str, float]]:
    """Each worker's `flat` snapshot by pid, asked over fresh connections until `workers` of them answered."""
    seen: dict[int, dict[str, float]] = {}
    for _ in range(tries):
        with httpx.Client(headers={"Connection": "close"}, timeout=10) as http:
            snapshot = http.get(f"{root}/metrics/worker").json()
        seen[snapshot["pid"]] = flat(snapshot)
        if len(seen) >= workers:
            break
    return seen
