"""Trainer-facing package: `TrainerClient` (synchronous, plain pyzmq), `TraceRecord`, `Episode`, `launch_gateway`.

Importing it loads only plain `zmq`, the stdlib and `broker.protocol`: never zmq.asyncio,
asyncio-based code, uvloop, starlette, transformers or `gateway_workers` (a subprocess
test enforces this). `launch_gateway` starts the gateway as subprocesses, never by import.
"""

from __future__ import annotations

from trainer_client.client import TrainerClient
from trainer_client.errors import (
    AuthenticationFailed,
    BrokerBusy,
    BrokerDisconnected,
    BrokerError,
    BrokerTimeout,
    DuplicateSession,
    EpisodeTimeout,
    GatewayError,
    InvalidRequest,
    PauseTimeout,
    ProtocolMismatch,
    SessionClosed,
    UnknownSession,
)
from trainer_client.launcher import launch_gateway
from trainer_client.records import Episode, PauseReport, TraceRecord
from trainer_client.subscriber import EpisodeStream

__all__ = [
    "AuthenticationFailed",
    "BrokerBusy",
    "BrokerDisconnected",
    "BrokerError",
    "BrokerTimeout",
    "DuplicateSession",
    "Episode",
    "EpisodeStream",
    "EpisodeTimeout",
    "GatewayError",
    "InvalidRequest",
    "PauseReport",
    "PauseTimeout",
    "ProtocolMismatch",
    "SessionClosed",
    "TraceRecord",
    "TrainerClient",
    "UnknownSession",
    "launch_gateway",
]
