"""What every handler shares: the side a frame came from, a handler's signature, the way parked replies go
out, and the class a concern's handlers are methods of (`Concern`). Imports `broker.protocol`, `broker.state`
and `broker.episodes.outbox` (the reply type) only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

from broker import protocol
from broker.episodes.outbox import Reply
from broker.state import BrokerState

# Which socket a frame came from: it picks the decoder (what each side may send), names the peer in
# logs, and says who finished a session on a RequestFinish (a worker relays an agent's).
Side = Literal["worker", "trainer"]
# A handler's reply: a message, a frame it encoded itself, or None when the reply waits (parked).
Answer = protocol.Message | bytes | None
Handler = Callable[[Any, list[bytes], bytes, Side], Answer]
# Sends replies to parked requests (finishes, long polls) to their trainer peers.
SendParked = Callable[[list[Reply]], None]


class Concern:
    """Handlers of one concern over the shared `BrokerState`: `ROUTES` names the method each message class goes to."""

    ROUTES: ClassVar[dict[type, str]] = {}

    def __init__(self, state: BrokerState, send_parked: SendParked) -> None:
        self._state = state
        self._send_parked = send_parked

    def routes(self) -> dict[type, Handler]:
        return {message_class: getattr(self, name) for message_class, name in self.ROUTES.items()}
