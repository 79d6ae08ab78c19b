"""A trainer's session messages: OpenSession and DropSession."""

from __future__ import annotations

from typing import ClassVar

from broker import protocol
from broker.handlers.base import Answer, Concern, Side
from broker.sessions.session import check_chosen_key


class SessionHandlers(Concern):
    ROUTES: ClassVar[dict[type, str]] = {
        protocol.OpenSession: "open",
        protocol.DropSession: "drop",
    }

    def open(self, msg: protocol.OpenSession, envelope: list[bytes], payload: bytes, side: Side) -> Answer:
        check_chosen_key(msg.session_id)
        session = self._state.registry.open_session(
            msg.session_id, msg.sampling_defaults, msg.max_context_tokens, msg.max_turns, msg.metadata,
            msg.client_id, msg.group, msg.history_mode, msg.linear_fallback,
        )  # fmt: skip
        self._state.journal.session_opened(session)
        return protocol.SessionOpened(msg.request_id, session.sid)

    def drop(self, msg: protocol.DropSession, envelope: list[bytes], payload: bytes, side: Side) -> Answer:
        """Free a session without rows; a finish that waited for it is answered."""
        existed = self._state.registry.drop(msg.session_id)
        if existed:
            self._state.journal.session_dropped(msg.session_id)
        self._send_parked(self._state.finishes.dropped(msg.session_id))
        return protocol.SessionDropped(msg.request_id, msg.session_id, existed)
