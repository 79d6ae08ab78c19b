"""One frame in, one reply out: decode a frame with `broker.protocol`, route the message by its class to its
handler (`broker.handlers`), and encode the reply. Every failure becomes a `Refused` with the request's id: an
undecodable frame (logged, rate-limited), a handler's `Refusal`, or a handler that raised (logged with its
traceback). No sockets: `broker.server` receives the frames and sends what this returns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from broker import protocol
from broker.handlers.base import Answer, Handler, Side
from broker.protocol import session_tag
from broker.sessions.session import Refusal
from broker.state import BrokerState

logger = logging.getLogger("broker.server")

# Protocol errors are logged individually up to this many, then at most once per interval.
PROTOCOL_LOG_BURST = 20
PROTOCOL_LOG_INTERVAL_S = 5.0

Decoder = Callable[[bytes], "protocol.WorkerToBroker | protocol.TrainerToBroker"]


def _tag_of(msg: object) -> str | None:
    """The tag of the session a message names, for the log (its id is an API key)."""
    sid = getattr(msg, "session_id", None)
    return session_tag(sid) if isinstance(sid, str) else None


class Dispatch:
    """Routes decoded frames to `routes` (message class -> handler) over `state`."""

    def __init__(self, state: BrokerState, routes: dict[type, Handler]) -> None:
        self._state = state
        self._routes = routes
        self._last_protocol_log = 0.0

    def handle(self, envelope: list[bytes], payload: bytes, decode: Decoder, side: Side) -> Answer:
        """Decode one frame of `side` and route it to its handler; the reply (or None when it is parked) repeats
        its request id."""
        try:
            msg = decode(payload)
        except protocol.ProtocolError as e:
            return self._protocol_error(side, e)
        try:
            handler = self._routes.get(type(msg))
            if handler is None:
                raise TypeError(f"no handler for {type(msg).__name__}")
            return handler(msg, envelope, payload, side)
        except Refusal as r:
            return protocol.Refused(msg.request_id, r.code, r.message)
        except Exception:
            logger.exception("%s for session %s failed", msg.TAG, _tag_of(msg))
            return protocol.Refused(msg.request_id, "internal", f"the broker failed handling {msg.TAG}; see its log")

    def encode(self, reply: protocol.Message | bytes) -> bytes:
        """The frame of one reply: a message, or a frame a handler encoded itself (`protocol.frame_encoder`).
        Counts refusals by code."""
        if type(reply) is bytes:
            return reply
        assert isinstance(reply, protocol.Message)
        try:
            frame = protocol.encode(reply)
        except Exception:
            logger.exception("cannot encode %s reply to request %s", reply.TAG, reply.request_id)
            reply = protocol.Refused(reply.request_id, "internal", "the broker could not encode its reply")
            frame = protocol.encode(reply)
        if isinstance(reply, protocol.Refused):
            self._state.refusals[reply.code] += 1
        return frame

    def _protocol_error(self, side: str, e: protocol.ProtocolError) -> protocol.Refused:
        """The Refused that answers an undecodable frame (logged, rate-limited)."""
        code = "version_mismatch" if isinstance(e, protocol.VersionMismatch) else "protocol"
        counters = self._state.loop_counters
        counters["protocol_errors"] += 1
        n = counters["protocol_errors"]
        now = time.monotonic()
        if n <= PROTOCOL_LOG_BURST or now - self._last_protocol_log >= PROTOCOL_LOG_INTERVAL_S:
            self._last_protocol_log = now
            logger.warning("bad frame from a %s peer (%d so far): %s", side, n, e)
        rid = e.request_id if e.request_id is not None else -1
        return protocol.Refused(rid, code, str(e))
