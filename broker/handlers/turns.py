"""A worker's turn messages: OpenTurn (or the recorded reply of a retried request), CommitTurn, AbortTurn,
GetTurn (a committed turn's messages, for linear history), and Heartbeat; and the silent workers whose turns
are given up.

The commit and the open are the broker's hot path: their replies are encoded straight from their fields
(building the frozen message costs more than encoding it), and a stored commit's frame is logged as received.
"""

from __future__ import annotations

import time
from typing import ClassVar

from broker import protocol
from broker.handlers.base import Answer, Concern, SendParked, Side
from broker.handlers.generation import tell_workers
from broker.sessions.workers import abandon_turns_of
from broker.state import BrokerState

_encode_turn_opened = protocol.frame_encoder(protocol.TurnOpened)
_encode_turn_committed = protocol.frame_encoder(protocol.TurnCommitted)
_encode_turn_aborted = protocol.frame_encoder(protocol.TurnAborted)


class TurnHandlers(Concern):
    ROUTES: ClassVar[dict[type, str]] = {
        protocol.CommitTurn: "commit",
        protocol.OpenTurn: "open",
        protocol.AbortTurn: "abort",
        protocol.GetTurn: "get_turn",
        protocol.Heartbeat: "heartbeat",
    }

    def __init__(self, state: BrokerState, send_parked: SendParked) -> None:
        super().__init__(state, send_parked)
        self._registry, self._finishes, self._replicas = state.registry, state.finishes, state.replicas

    def commit(self, msg: protocol.CommitTurn, envelope: list[bytes], payload: bytes, side: Side) -> Answer:
        self._state.commits_received.append(time.perf_counter())
        outcome = self._registry.commit_turn(msg)
        if outcome == "stored":
            self._state.journal.worker_frame(payload)  # the frame as received: replayed as it was stored
        parked = self._finishes.turn_ended(msg.session_id, time.monotonic())
        if parked:
            self._send_parked(parked)
        return _encode_turn_committed(request_id=msg.request_id, turn_id=msg.turn_id, outcome=outcome)

    def open(self, msg: protocol.OpenTurn, envelope: list[bytes], payload: bytes, side: Side) -> Answer:
        # Its worker is heard by its heartbeats (the first goes out before any OPEN on the same socket).
        registry = self._registry
        if msg.retry:
            replayed = registry.repeated_turn(msg.session_id, msg.request_digest, msg.turn_id)
            if replayed is not None:
                return protocol.TurnReplayed(
                    msg.request_id, replayed.turn_id, replayed.prompt_ids, replayed.output_ids,
                    replayed.finish_reason, replayed.response_message, replayed.flags,
                )  # fmt: skip
        session, seq = registry.open_turn(msg.session_id, msg.turn_id, msg.worker_id, msg.request_digest)
        self._state.journal.worker_frame(payload)
        linear = session.history_mode == "linear"
        return _encode_turn_opened(
            request_id=msg.request_id,
            turn_id=msg.turn_id,
            seq=seq,
            sampling_defaults=session.sampling_defaults,
            max_context_tokens=session.max_context_tokens,
            history_mode=session.history_mode,
            linear_fallback=session.linear_fallback if linear else "",
            heads=session.heads if linear else [],
            pending=len(session.in_flight) - 1 if linear else 0,
            weight_version=registry.weight_version,
            replica=self._replicas.assign(msg.session_id),
            generation_epoch=self._state.generation.epoch,
            paused=self._state.generation.mode,
        )

    def abort(self, msg: protocol.AbortTurn, envelope: list[bytes], payload: bytes, side: Side) -> Answer:
        if self._registry.abort_turn(msg.session_id, msg.turn_id, msg.reason) is not None:
            self._state.journal.worker_frame(payload)
        parked = self._finishes.turn_ended(msg.session_id, time.monotonic())
        if parked:
            self._send_parked(parked)
        return _encode_turn_aborted(request_id=msg.request_id, turn_id=msg.turn_id)

    def get_turn(self, msg: protocol.GetTurn, envelope: list[bytes], payload: bytes, side: Side) -> Answer:
        """A committed turn's canonical messages, looked up in that session only (ids never cross sessions)."""
        if msg.with_ids:
            record = self._registry.turn_record(msg.session_id, msg.turn_id)
            return protocol.TurnFound(
                msg.request_id, msg.turn_id, record.prompt_messages, record.response_message, record.prompt_ids,
                record.output_ids,
            )  # fmt: skip
        prompt_messages, response_message = self._registry.turn_messages(msg.session_id, msg.turn_id)
        return protocol.TurnFound(msg.request_id, msg.turn_id, prompt_messages, response_message)

    def heartbeat(self, msg: protocol.Heartbeat, envelope: list[bytes], payload: bytes, side: Side) -> Answer:
        """Answered only with the sessions that ended since this worker's last beat."""
        state = self._state
        workers, generation, now = state.workers, state.generation, time.monotonic()
        workers.hear(msg.worker_id, now)
        state.metrics.heard(msg.worker_id, msg.metrics, workers.heard)
        if generation.heard(msg.worker_id, msg.generation, envelope):
            state.to_workers.append((envelope, generation.changed(self._registry.weight_version)))
        if generation.parked:
            self._send_parked(generation.answers(workers.heard, now))
        ended = workers.ended_since(msg.worker_id, self._registry)
        return protocol.SessionsEnded(0, ended) if ended else None

    def abandon_silent_workers(self, now: float) -> None:
        """Give up the in-flight turns of workers unheard for `worker_silence_s` (logged as aborts), and release
        the finishes that waited for them."""
        workers = self._state.workers
        silent = workers.silent(now)
        if silent:
            if self._state.generation.forget(silent):
                tell_workers(self._state)  # the lost workers' engine replicas go to those left
            self._send_parked(self._state.generation.answers(workers.heard, now))
        for worker_id in silent:
            abandoned = abandon_turns_of(self._registry, worker_id, workers.silence_s)
            for sid, turn_id in abandoned:
                self._state.journal.turn_abandoned(sid, turn_id)
            for sid in {sid for sid, _ in abandoned}:
                self._send_parked(self._finishes.turn_ended(sid, now))
