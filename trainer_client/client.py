"""`TrainerClient`: the synchronous trainer-side API over a blocking ZeroMQ DEALER.

Owns the control-plane socket wrapper: request ids, poll deadlines that raise named
errors, socket reset after a timeout, and a socket pool so many trainer threads can
call at once (a pyzmq socket is not thread-safe, so each call borrows one for its
whole send..reply). `episodes()` hands out an `EpisodeStream` (subscriber.py) that
keeps its own socket. With CURVE keys every socket authenticates and encrypts, and a
refused handshake raises `AuthenticationFailed` at once (its monitor is polled with the
reply). Imports plain `zmq`, `broker.protocol` and `broker.curve` only: never
zmq.asyncio, asyncio, uvloop, starlette, transformers or `gateway_workers`.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

import zmq

from broker import curve, protocol
from trainer_client.errors import (
    AuthenticationFailed,
    BrokerTimeout,
    GatewayError,
    InvalidRequest,
    ProtocolMismatch,
    error_for_refusal,
)
from trainer_client.records import TraceRecord
from trainer_client.subscriber import DEFAULT_LEASE_S, DEFAULT_MAX_PENDING, EpisodeStream

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_WAIT_TIMEOUT_S = 5.0
# While the broker is away, the DEALER retries the connection this often (ms), so a
# restarted broker is found again without any action from the caller.
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 1_000
_MAX_ID_LEN = 256

_Reply = TypeVar("_Reply", bound=protocol.Message)


class TrainerClient:
    """Blocking client of the broker's control endpoint; safe to call from many threads.

    Args:
        endpoint: the broker's control endpoint, e.g. "tcp://127.0.0.1:5557".
        timeout: seconds each call may wait for the broker's reply (finish_session adds its
            `wait_timeout`); past it the call raises `BrokerTimeout`.
        client_id: names this client's sessions for `episodes(only_mine=True)`; minted (random)
            unless given. Give the same id to several clients (e.g. one trainer's processes) to
            let each subscribe to all of their sessions.
        curve_keys: a key directory holding `broker.key` and `trainer.key_secret` (`rollout-gateway
            keys`): the connection uses CURVE. None reads $ROLLOUT_GATEWAY_CURVE_KEYS; "" means none.
            Without keys a non-loopback endpoint raises `CurveError` (a ValueError) here.
    """

    def __init__(
        self,
        endpoint: str = protocol.DEFAULT_CONTROL_ENDPOINT,
        timeout: float = DEFAULT_TIMEOUT_S,
        client_id: str | None = None,
        curve_keys: str | None = None,
    ) -> None:
        if not (isinstance(timeout, (int, float)) and timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if client_id is not None and not (isinstance(client_id, str) and 0 < len(client_id) <= _MAX_ID_LEN - 16):
            raise ValueError(f"client_id must be a non-empty string of at most {_MAX_ID_LEN - 16} characters")
        keys_dir = curve.keys_from_env(curve_keys)
        curve.require_keys_off_loopback(endpoint, keys_dir, "the control endpoint")
        self._keys = curve.load_client_keys(keys_dir, "trainer") if keys_dir is not None else None
        # Per CURVE socket, its handshake monitor (none without keys: nothing is added to a call).
        self._watches: dict[zmq.Socket, curve.HandshakeWatch] = {}
        self.endpoint = endpoint
        self.timeout = float(timeout)
        self.client_id = client_id or f"tc-{secrets.token_hex(8)}"
        self._lock = threading.Lock()
        self._idle: list[zmq.Socket] = []
        self._sockets: set[zmq.Socket] = set()
        self._ids = itertools.count(1)
        self._closed = False
        self._pid = os.getpid()
        self._ctx = zmq.Context()

    # --- public API ------------------------------------------------------------------

    def open_session(
        self,
        sampling_defaults: dict[str, Any] | None = None,
        max_context_tokens: int | None = None,
        max_turns: int | None = None,
        session_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        group: str | None = None,
    ) -> str:
        """Open a session and return its key (the agent's API key); minted by the broker unless given.

        `group` names a batch of sessions (e.g. one training step's): `episodes(group=...)` yields
        only the episodes of that group.
        """
        reply = self._call(
            lambda rid: protocol.OpenSession(
                rid,
                session_id,
                dict(sampling_defaults or {}),
                max_context_tokens,
                max_turns,
                dict(metadata or {}),
                self.client_id,
                group,
            ),
            protocol.SessionOpened,
            self.timeout,
        )
        return reply.session_id

    def finish_session(
        self,
        sid: str,
        reward: float | None = None,
        rollout_id: str | int | None = None,
        metadata: dict[str, Any] | None = None,
        wait_timeout: float = DEFAULT_WAIT_TIMEOUT_S,
    ) -> list[TraceRecord]:
        """Close the session, let in-flight turns land for up to `wait_timeout` s, and return its rows.

        The session is freed afterwards. `rollout_id` is stored as a string (ints are converted).
        A session finishes once: `SessionClosed` if `request_finish` or its agent finished it first.
        """
        args = _finish_args(sid, reward, rollout_id, metadata, wait_timeout)
        reply = self._call(
            lambda rid: protocol.FinishSession(rid, *args),
            protocol.SessionFinished,
            self.timeout + wait_timeout,
        )
        if reply.turns_abandoned:
            logger.warning(
                "session %s finished with %d in-flight turn(s) cut off after %.1fs",
                protocol.session_tag(sid),
                reply.turns_abandoned,
                wait_timeout,
            )
        return [TraceRecord.from_wire(row) for row in reply.rows]

    def request_finish(
        self,
        sid: str,
        reward: float | None = None,
        rollout_id: str | int | None = None,
        metadata: dict[str, Any] | None = None,
        wait_timeout: float = DEFAULT_WAIT_TIMEOUT_S,
    ) -> None:
        """Finish the session without waiting for its rows: returns once the broker accepted the finish.

        The episode (rows built exactly as `finish_session` builds them, after in-flight turns had up
        to `wait_timeout` s to land) arrives on `episodes()`. Raises `SessionClosed` if the session
        already finished (by any path), `UnknownSession`, or `BrokerBusy` when the episode outbox is
        full (the session stays open: consume episodes, then retry). The outbox is in the broker's
        memory: episodes not yet acknowledged when the broker restarts are lost with it.
        """
        args = _finish_args(sid, reward, rollout_id, metadata, wait_timeout)
        self._call(
            lambda rid: protocol.RequestFinish(rid, *args),
            protocol.FinishAccepted,
            self.timeout,
        )

    def episodes(
        self,
        timeout: float | None = None,
        max_pending: int = DEFAULT_MAX_PENDING,
        only_mine: bool = False,
        group: str | None = None,
        lease: float = DEFAULT_LEASE_S,
        auto_ack: bool = True,
    ) -> EpisodeStream:
        """Subscribe to finished episodes (`request_finish` and agent finishes): a blocking iterator.

        Several streams (threads, processes, hosts) share the broker's outbox; each episode goes to
        one of them and stays leased to it until acknowledged. See `EpisodeStream` for the arguments.
        """
        return EpisodeStream(
            self,
            timeout=timeout,
            max_pending=max_pending,
            client_id=self.client_id if only_mine else None,
            group=group,
            lease=lease,
            auto_ack=auto_ack,
        )

    def drop_session(self, sid: str) -> bool:
        """Free a session without building rows; False if the broker had no such session."""
        reply = self._call(lambda rid: protocol.DropSession(rid, sid), protocol.SessionDropped, self.timeout)
        return reply.existed

    def stats(self) -> dict[str, Any]:
        """The broker's counters and gauges (sessions, turns in flight, commits, refusals, ...)."""
        return self._call(lambda rid: protocol.GetStats(rid), protocol.Stats, self.timeout).stats

    def close(self) -> None:
        """Close every socket and the context. Call it once no other thread is inside a call."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sockets, self._sockets, self._idle = self._sockets, set(), []
            watches, self._watches = self._watches, {}
        for sock in sockets:
            watch = watches.get(sock)
            if watch is not None:
                watch.close()
            sock.close(linger=0)
        if self._pid == os.getpid():
            self._ctx.term()

    def __enter__(self) -> TrainerClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- socket pool -------------------------------------------------------------------

    def _borrow(self) -> zmq.Socket:
        with self._lock:
            if self._idle and self._pid == os.getpid() and not self._closed:
                return self._idle.pop()
        return self._new_socket()

    def _new_socket(self) -> zmq.Socket:
        """A fresh DEALER to the broker, closed by `close()` (a pooled one, or an episode stream's)."""
        with self._lock:
            if self._closed:
                raise GatewayError("the TrainerClient is closed")
            if self._pid != os.getpid():
                # A forked child must not touch the parent's context or sockets: start afresh.
                self._pid, self._ctx, self._idle, self._sockets = os.getpid(), zmq.Context(), [], set()
                self._watches = {}
            sock = self._ctx.socket(zmq.DEALER)
            self._sockets.add(sock)
            if self._keys is not None:
                self._keys.apply(sock)
                self._watches[sock] = curve.HandshakeWatch(sock, self.endpoint, "trainer")  # before connect
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        sock.connect(self.endpoint)
        return sock

    def _give_back(self, sock: zmq.Socket) -> None:
        with self._lock:
            if not self._closed and sock in self._sockets:
                self._idle.append(sock)
                return
        self._close_socket(sock)

    def _discard(self, sock: zmq.Socket) -> None:
        """Close a socket in an unknown state (timed out, garbage received): no late reply may reach a later call."""
        with self._lock:
            self._sockets.discard(sock)
        self._close_socket(sock)

    def _close_socket(self, sock: zmq.Socket) -> None:
        with self._lock:
            watch = self._watches.pop(sock, None)
        if watch is not None:
            watch.close()
        sock.close(linger=0)

    # --- one request / reply -------------------------------------------------------------

    def _call(self, build: Callable[[int], protocol.Message], expect: type[_Reply], timeout: float) -> _Reply:
        msg = build(self._next_id())
        frame = self._encode(msg)
        sock = self._borrow()
        try:
            reply = self._roundtrip(sock, frame, msg, timeout)
        except BaseException:
            self._discard(sock)
            raise
        self._give_back(sock)
        return self._expect(msg, reply, expect)

    def _next_id(self) -> int:
        return next(self._ids)

    def _encode(self, msg: protocol.Message) -> bytes:
        try:
            return protocol.encode(msg)
        except Exception as e:  # msgpack rejects e.g. objects in metadata: the caller's argument
            raise InvalidRequest(f"cannot encode {msg.TAG}: {e}") from e

    def _roundtrip(self, sock: zmq.Socket, frame: bytes, msg: protocol.Message, timeout: float) -> protocol.Message:
        """Send one request and wait for its reply; BrokerTimeout past `timeout` (the caller resets the socket)."""
        deadline = time.monotonic() + timeout
        if not self._send(sock, frame, deadline, msg):
            raise self._timeout(msg, timeout)
        reply = self._receive(sock, msg.request_id, deadline, msg)
        if reply is None:
            raise self._timeout(msg, timeout)
        return reply

    def _expect(self, msg: protocol.Message, reply: protocol.Message, expect: type[_Reply]) -> _Reply:
        """The reply as `expect`, or the named error for a refusal or a reply of the wrong kind."""
        if isinstance(reply, protocol.Refused):
            raise error_for_refusal(reply.code, reply.message)
        if not isinstance(reply, expect):
            raise ProtocolMismatch(f"broker answered {msg.TAG} with {reply.TAG}")
        return reply

    def _send(self, sock: zmq.Socket, frame: bytes, deadline: float, msg: protocol.Message) -> bool:
        """Queue the frame for the broker; False if the deadline passed first."""
        while True:
            try:
                sock.send(frame, zmq.NOBLOCK)
                return True
            except zmq.Again:
                pass
            except zmq.ZMQError as e:
                raise GatewayError(f"cannot send {msg.TAG} to {self.endpoint}: {e}") from e
            if not sock.poll(_remaining_ms(deadline), zmq.POLLOUT):
                return False

    def _receive(self, sock: zmq.Socket, rid: int, deadline: float, msg: protocol.Message) -> protocol.Message | None:
        """The reply to request `rid`; None if the deadline passed first. `AuthenticationFailed` if the broker
        refuses this client's CURVE handshake meanwhile."""
        watch = self._watches.get(sock)
        while True:
            try:
                if watch is None:
                    ready = sock.poll(_remaining_ms(deadline), zmq.POLLIN)
                else:
                    ready = self._poll_watched(sock, watch, deadline)
                frame = sock.recv(zmq.NOBLOCK) if ready else None
            except zmq.ZMQError as e:
                raise GatewayError(f"cannot receive from {self.endpoint}: {e}") from e
            if frame is None:
                return None
            try:
                reply: protocol.Message = protocol.decode_broker_to_trainer(frame)
            except protocol.ProtocolError as e:
                raise ProtocolMismatch(f"undecodable reply from {self.endpoint}: {e}") from e
            # -1: the broker could not read our request id; one request is in flight per socket.
            if reply.request_id == rid or (reply.request_id == -1 and isinstance(reply, protocol.Refused)):
                return reply
            logger.debug("dropping stale reply %s to request %s", reply.TAG, reply.request_id)

    def _poll_watched(self, sock: zmq.Socket, watch: curve.HandshakeWatch, deadline: float) -> bool:
        """Wait for a reply on `sock` (True) or the deadline (False), raising at a refused handshake."""
        while True:
            ready = dict(zmq.zmq_poll([(sock, zmq.POLLIN), (watch.monitor, zmq.POLLIN)], _remaining_ms(deadline)))
            if watch.monitor in ready:
                refusal = watch.read()
                if refusal is not None:
                    raise AuthenticationFailed(refusal)
            if sock in ready:
                return True
            if time.monotonic() >= deadline:
                return False

    def _timeout(self, msg: protocol.Message, timeout: float) -> BrokerTimeout:
        return BrokerTimeout(f"no reply to {msg.TAG} from the broker at {self.endpoint} within {timeout:.1f}s")


def _remaining_ms(deadline: float) -> int:
    return max(0, math.ceil((deadline - time.monotonic()) * 1000))


def _finish_args(
    sid: str, reward: float | None, rollout_id: str | int | None, metadata: dict[str, Any] | None, wait_timeout: float
) -> tuple[str, float | None, str | None, dict[str, Any], float]:
    """The fields FinishSession and RequestFinish share, checked and normalized (rollout ids travel as text)."""
    if not (isinstance(wait_timeout, (int, float)) and wait_timeout >= 0 and math.isfinite(wait_timeout)):
        raise InvalidRequest(f"wait_timeout must be a finite number >= 0, got {wait_timeout!r}")
    rollout = None if rollout_id is None else str(rollout_id)
    return sid, None if reward is None else float(reward), rollout, dict(metadata or {}), float(wait_timeout)
