"""The base of every wire message, and the messages both sockets carry (re-exported by `broker.protocol`).

`Message` (the request id every message starts with, and its wire `TAG`); `RequestFinish`, which a
trainer sends on the control socket and a worker relays for an agent on the worker socket; and the
two replies the broker sends on either socket, `FinishAccepted` and `Refused`; and `GetMetrics`, which
either side may send for the whole gateway's Prometheus exposition (`MetricsText`). Import them from
`broker.protocol`, the wire contract. Imports only the stdlib; nothing of `broker`, no msgpack.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True, slots=True)
class Message:
    """Base of every wire message; `TAG` names it on the wire."""

    TAG: ClassVar[str] = ""
    request_id: int


@dataclass(frozen=True, slots=True)
class RequestFinish(Message):
    """Finish a session without waiting for its rows: they go to the episode outbox (see `FetchEpisodes`).

    Sent by a trainer (`request_finish`), or by a worker for an agent's `POST /rollout/v1/sessions/finish`
    (then on the worker socket). Answered at once with `FinishAccepted`; in-flight turns still get up to
    `wait_timeout` s to land. A session finishes exactly once, whichever request comes first: the others
    are refused with session_closed. A full outbox refuses it with busy and leaves the session open.
    """

    TAG: ClassVar[str] = "request_finish"
    session_id: str
    reward: float | None
    rollout_id: str | None
    metadata: dict[str, Any]
    wait_timeout: float


@dataclass(frozen=True, slots=True)
class FinishAccepted(Message):
    """A `RequestFinish` was accepted: the session is closed and its episode will reach the outbox."""

    TAG: ClassVar[str] = "finish_accepted"
    session_id: str


@dataclass(frozen=True, slots=True)
class Refused(Message):
    """The request was not carried out; `code` says why (see ErrorCode)."""

    TAG: ClassVar[str] = "refused"
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class GetMetrics(Message):
    """Ask for the whole gateway's metrics in the Prometheus text format (`broker.metrics`).

    A worker asking for its `/metrics` scrape sends its own fresh snapshot (`Heartbeat.metrics`), so that
    the answer counts everything it did up to now; the other workers are counted as of their last beat.
    """

    TAG: ClassVar[str] = "get_metrics"
    worker_id: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class MetricsText(Message):
    """The Prometheus text exposition (version 0.0.4) of the whole gateway."""

    TAG: ClassVar[str] = "metrics_text"
    text: str
