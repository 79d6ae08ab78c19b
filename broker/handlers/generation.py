"""A trainer's pause and resume of generation, and the question whether it is paused (`broker.generation`).

A pause or resume is logged, then told to every worker heard (`GenerationChanged`, sent by the loop after the
log is written); a pause's answer waits, parked, until every live worker reports it idle, or its timeout.
"""

from __future__ import annotations

import logging
import math
import time
from typing import ClassVar

from broker import protocol
from broker.handlers.base import Answer, Concern, Side
from broker.sessions.session import Refusal
from broker.state import BrokerState

logger = logging.getLogger("broker.server")


class GenerationHandlers(Concern):
    ROUTES: ClassVar[dict[type, str]] = {
        protocol.PauseGeneration: "pause",
        protocol.ResumeGeneration: "resume",
        protocol.GetGeneration: "get",
    }

    def pause(self, msg: protocol.PauseGeneration, envelope: list[bytes], payload: bytes, side: Side) -> Answer:
        state = self._state
        limit = state.config.max_wait_timeout
        if msg.mode not in protocol.PAUSE_MODES:
            modes = ", ".join(protocol.PAUSE_MODES)
            raise Refusal("bad_request", f"a pause's mode is one of {modes}, not {msg.mode!r}")
        if not (isinstance(msg.timeout, float) and math.isfinite(msg.timeout) and 0 <= msg.timeout <= limit):
            raise Refusal("bad_request", f"a pause's timeout is seconds in [0, {limit:g}], not {msg.timeout!r}")
        generation, now = state.generation, time.monotonic()
        changed = generation.pause(msg.mode, now)
        if changed:
            state.journal.generation_changed(generation.epoch, generation.mode, generation.since)
            tell_workers(state)
            logger.info("generation paused (%s): the workers hold new turns until the resume", msg.mode)
        generation.park(envelope, msg.request_id, msg.timeout, not changed, now)
        self._send_parked(generation.answers(state.workers.heard, now))
        return None

    def resume(self, msg: protocol.ResumeGeneration, envelope: list[bytes], payload: bytes, side: Side) -> Answer:
        state = self._state
        version, registry = msg.weight_version, state.registry
        if type(version) is not int or not -1 <= version < 2**31:
            raise Refusal("bad_request", f"a weight version is an int in [0, 2**31) (-1: unchanged), not {version!r}")
        if version >= 0:  # before the release: the held turns sample under it
            registry.weight_version = version
            state.journal.weight_version_set(version)
        generation, now = state.generation, time.monotonic()
        paused_s = generation.resume(now)
        if paused_s is not None:
            state.journal.generation_changed(generation.epoch, generation.mode, generation.since)
            tell_workers(state)
            logger.info("generation resumed after %.3fs (weight version %d)", paused_s, registry.weight_version)
        self._send_parked(generation.answers(state.workers.heard, now))  # pauses still waiting: not idle
        return protocol.GenerationResumed(msg.request_id, paused_s is not None, paused_s or 0.0,
                                          registry.weight_version)  # fmt: skip

    def get(self, msg: protocol.GetGeneration, envelope: list[bytes], payload: bytes, side: Side) -> Answer:
        generation = self._state.generation
        return protocol.GenerationState(msg.request_id, generation.mode, generation.since)


def tell_workers(state: BrokerState) -> None:
    """The pause in force, to every worker heard (on its heartbeat socket)."""
    told = state.generation.changed(state.registry.weight_version)
    state.to_workers += [(envelope, told) for envelope in state.generation.envelopes.values()]
