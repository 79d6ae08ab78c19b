"""Finishes and the episode stream: RequestFinish (a trainer's, or an agent's through its worker),
FinishSession (the rows in the reply) and FetchEpisodes (a subscriber's long poll)."""

from __future__ import annotations

import time
from typing import ClassVar

from broker import protocol
from broker.handlers.base import Answer, Concern, SendParked, Side
from broker.sessions.session import FinishOrigin
from broker.state import BrokerState


class EpisodeHandlers(Concern):
    ROUTES: ClassVar[dict[type, str]] = {
        protocol.RequestFinish: "request_finish",
        protocol.FinishSession: "finish",
        protocol.FetchEpisodes: "fetch",
    }

    def __init__(self, state: BrokerState, send_parked: SendParked) -> None:
        super().__init__(state, send_parked)
        self._finishes, self._outbox = state.finishes, state.outbox

    def request_finish(self, msg: protocol.RequestFinish, envelope: list[bytes], payload: bytes, side: Side) -> Answer:
        origin: FinishOrigin = "agent" if side == "worker" else "trainer"
        accepted, replies = self._finishes.request_finish(msg, origin, time.monotonic())
        self._send_parked(replies)
        return accepted

    def finish(self, msg: protocol.FinishSession, envelope: list[bytes], payload: bytes, side: Side) -> Answer:
        return self._finishes.finish(envelope, msg, time.monotonic())

    def fetch(self, msg: protocol.FetchEpisodes, envelope: list[bytes], payload: bytes, side: Side) -> Answer:
        reply, others = self._outbox.fetch(envelope, msg, time.monotonic())
        self._send_parked(others)
        return reply
