"""docs/operations.md lists every metric the gateway exposes, with its type."""

from __future__ import annotations

import re
from pathlib import Path

from broker.metrics import catalog

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def _exposed() -> dict[str, str]:
    metrics = [*catalog.WORKER_METRICS.values(), *(m for m, _ in catalog.BROKER_STATS.values())]
    metrics += [catalog.REFUSALS, catalog.REPLICA_HEALTHY, catalog.REPLICA_SESSIONS, catalog.COMMIT_SECONDS,
                catalog.ROWS_PER_EPISODE, catalog.ROW_DECISIONS,
                catalog.HEARTBEAT_AGE, catalog.WORKER_INFO]  # fmt: skip
    return {catalog.PREFIX + m.name + ("_total" if m.kind == "counter" else ""): m.kind for m in metrics}


def test_every_metric_is_in_the_operations_table_with_its_type() -> None:
    rows = dict(re.findall(r"^\| `(rollout_gateway_\w+)` \| (\w+) \|", DOC.read_text(), re.M))
    assert rows == _exposed()
