"""The broker's control endpoint from a trainer: `ControlChannel` (every call) over `ControlSocket`s (one each).

`ControlChannel` is the seam `TrainerClient`'s calls and its episode streams share: request ids, encoding,
a pool of sockets (a pyzmq socket is not thread-safe, so each call borrows one for its whole send..reply),
and the check that a reply is the one expected (a refusal raises its named error).

`ControlSocket` is one DEALER, one request and its reply at a time.

Owns what a call does on the wire: the send and the wait for the reply with the same request id
(stale replies are dropped), both behind a deadline, and the connection under them, watched by a
monitor (`curve.HandshakeWatch`) polled with the reply. A refused handshake raises `AuthenticationFailed`
at once: a wrong key, or no key where the broker requires one. A connection that ends while a call waits
means its reply will not come (the broker's ROUTER drops a reply to a connection that is gone): a call that the broker
recognises when repeated (the caller says so: `resend`) is sent again, the same frame with the same
request id, once a connection is back; any other raises `BrokerDisconnected` at once, instead of
waiting for its timeout. The DEALER reconnects by itself. The public calls are `client.py`'s, the episode
stream's steps `subscriber.py`'s. Plain blocking pyzmq; imports zmq, `broker.protocol`, `broker.curve` and
`trainer_client.errors` only.
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
from typing import TypeVar

import zmq

from broker import curve, protocol
from trainer_client.errors import (
    AuthenticationFailed,
    BrokerDisconnected,
    BrokerTimeout,
    GatewayError,
    InvalidRequest,
    ProtocolMismatch,
    error_for_refusal,
)

logger = logging.getLogger(__name__)

# While the broker is away, the DEALER retries the connection this often (ms), so a
# restarted broker is found again without any action from the caller.
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 1_000
# Request ids start at a random point: the broker recognises a resent FinishSession by its session and
# request id, which must not meet another client's (or an earlier run's) request by chance.
_FIRST_ID_RANGE = 1 << 48
# Each pooled socket takes three of its context's sockets (the DEALER, its monitor and the monitor's peer):
# room for as many calls at once as a default context (1023 sockets) had before the monitors.
_MAX_SOCKETS = 3 * 1024

Reply = TypeVar("Reply", bound=protocol.Message)


class _ConnectionLost(Exception):
    """The connection a request went out on ended before its reply came."""


class ControlSocket:
    """A DEALER to the broker's control endpoint and the monitor of its connection; close it after any error.

    Args:
        ctx: the context (the client's).
        endpoint: the broker's control endpoint.
        keys: CURVE keys to authenticate with, or None.
    """

    def __init__(self, ctx: zmq.Context, endpoint: str, keys: curve.ClientKeys | None) -> None:
        self.endpoint = endpoint
        self.sock = ctx.socket(zmq.DEALER)
        try:
            if keys is not None:
                keys.apply(self.sock)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
            self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
            self._watch = curve.HandshakeWatch(self.sock, endpoint, "trainer", disconnects=True)  # before connect
        except BaseException:
            self.sock.close(linger=0)
            raise
        self.sock.connect(endpoint)

    def roundtrip(
        self, frame: bytes, msg: protocol.Message, timeout: float, *, resend: bool
    ) -> tuple[protocol.Message, bool]:
        """Send `frame` (`msg` encoded) and wait up to `timeout` s for its reply: (the reply, whether it was resent).

        `BrokerTimeout` past the deadline. `BrokerDisconnected` when the connection ends meanwhile and
        `resend` is False, or when no connection is back before the deadline.
        """
        deadline = time.monotonic() + timeout
        self._read_watch()  # what happened while the socket was idle (a restart in between) is not this call's
        resent = False
        while True:
            lost_at = self._watch.disconnects
            if not self._send(frame, deadline, msg):
                raise self._timeout(msg, timeout)
            try:
                reply = self._receive(msg.request_id, deadline, lost_at)
            except _ConnectionLost:
                if not resend:
                    raise BrokerDisconnected(
                        f"the connection to the broker at {self.endpoint} ended while {msg.TAG} waited for its "
                        "reply: it may or may not have taken effect"
                    ) from None
                self._await_connection(deadline, msg, timeout)
                logger.info("resending %s (request %d): its connection to %s ended", msg.TAG, msg.request_id,
                            self.endpoint)
                resent = True
                continue
            if reply is None:
                raise self._timeout(msg, timeout)
            return reply, resent

    def close(self) -> None:
        self._watch.close()
        self.sock.close(linger=0)

    # --- internals -----------------------------------------------------------------------

    def _send(self, frame: bytes, deadline: float, msg: protocol.Message) -> bool:
        """Queue the frame for the broker (while it is away, the DEALER keeps it for the next connection); False if
        the deadline passed first."""
        sock = self.sock
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

    def _receive(self, rid: int, deadline: float, lost_at: int) -> protocol.Message | None:
        """The reply to request `rid`; None if the deadline passed first; `_ConnectionLost` if the connection the
        request went out on (the `lost_at`-th) ended first."""
        while True:
            if not self._poll(deadline, lost_at):
                return None
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                continue
            except zmq.ZMQError as e:
                raise GatewayError(f"cannot receive from {self.endpoint}: {e}") from e
            try:
                reply: protocol.Message = protocol.decode_broker_to_trainer(frame)
            except protocol.ProtocolError as e:
                raise ProtocolMismatch(f"undecodable reply from {self.endpoint}: {e}") from e
            # -1: the broker could not read our request id; one request is in flight per socket.
            if reply.request_id == rid or (reply.request_id == -1 and isinstance(reply, protocol.Refused)):
                return reply
            logger.debug("dropping stale reply %s to request %s", reply.TAG, reply.request_id)

    def _poll(self, deadline: float, lost_at: int) -> bool:
        """Wait for a frame (True) or the deadline (False); the monitor is read meanwhile."""
        watch = self._watch
        while True:
            # Checked before the socket: a reply that came in before the connection ended is still read.
            if watch.disconnects != lost_at:
                raise _ConnectionLost
            ready = dict(zmq.zmq_poll([(self.sock, zmq.POLLIN), (watch.monitor, zmq.POLLIN)], _remaining_ms(deadline)))
            if self.sock in ready:
                return True
            if watch.monitor in ready:
                self._read_watch()
            elif time.monotonic() >= deadline:
                return False

    def _await_connection(self, deadline: float, msg: protocol.Message, timeout: float) -> None:
        while not self._watch.connected:
            if not self._watch.monitor.poll(_remaining_ms(deadline), zmq.POLLIN):
                raise BrokerDisconnected(
                    f"the connection to the broker at {self.endpoint} ended while {msg.TAG} waited for its reply, "
                    f"and no broker answered there again within {timeout:.1f}s"
                )
            self._read_watch()

    def _read_watch(self) -> None:
        refusal = self._watch.read()
        if refusal is not None:  # without keys too: a broker that requires them refuses the plaintext handshake
            raise AuthenticationFailed(refusal)

    def _timeout(self, msg: protocol.Message, timeout: float) -> BrokerTimeout:
        return BrokerTimeout(f"no reply to {msg.TAG} from the broker at {self.endpoint} within {timeout:.1f}s")


class ControlChannel:
    """Every call to one broker's control endpoint: request ids, encoding, a pool of `ControlSocket`s, the reply's
    check. Safe to use from many threads; close it once no other thread is inside a call.

    Args:
        endpoint: the broker's control endpoint.
        keys: CURVE keys to authenticate with, or None.
    """

    def __init__(self, endpoint: str, keys: curve.ClientKeys | None) -> None:
        self.endpoint = endpoint
        self._keys = keys
        self._lock = threading.Lock()
        self._idle: list[ControlSocket] = []
        self._sockets: set[ControlSocket] = set()
        self._ids = itertools.count(1 + secrets.randbelow(_FIRST_ID_RANGE))
        self._closed = False
        self._pid = os.getpid()
        self._ctx = _context()

    def call(self, build: Callable[[int], protocol.Message], expect: type[Reply], timeout: float, *,
             resend: bool = False) -> Reply:
        """One request (`build(request id)`) and its reply, on a pooled socket. `resend`: the broker recognises a
        repeat of this request (by its request id, or by what it asks), so it is sent again if its connection
        ends before the reply (`ControlSocket.roundtrip`)."""
        msg = build(self.next_id())
        frame = self.encode(msg)
        sock = self._borrow()
        try:
            reply, resent = sock.roundtrip(frame, msg, timeout, resend=resend)
        except BaseException:
            self.discard(sock)
            raise
        self._give_back(sock)
        if resent:
            reply = _first_attempt_reply(msg, reply)
        return self.expect(msg, reply, expect)

    def next_id(self) -> int:
        return next(self._ids)

    def encode(self, msg: protocol.Message) -> bytes:
        try:
            return protocol.encode(msg)
        except Exception as e:  # msgpack rejects e.g. objects in metadata: the caller's argument
            raise InvalidRequest(f"cannot encode {msg.TAG}: {e}") from e

    @staticmethod
    def expect(msg: protocol.Message, reply: protocol.Message, expect: type[Reply]) -> Reply:
        """The reply as `expect`, or the named error for a refusal or a reply of the wrong kind."""
        if isinstance(reply, protocol.Refused):
            raise error_for_refusal(reply.code, reply.message)
        if not isinstance(reply, expect):
            raise ProtocolMismatch(f"broker answered {msg.TAG} with {reply.TAG}")
        return reply

    def new_socket(self) -> ControlSocket:
        """A fresh socket to the broker, closed by `close()`: a pooled one, or one a caller keeps (an episode
        stream's), which it hands to `discard` when it is done with it."""
        with self._lock:
            if self._closed:
                raise GatewayError("the TrainerClient is closed")
            if self._pid != os.getpid():
                # A forked child must not touch the parent's context or sockets: start afresh.
                self._pid, self._ctx, self._idle, self._sockets = os.getpid(), _context(), [], set()
            sock = ControlSocket(self._ctx, self.endpoint, self._keys)
            self._sockets.add(sock)
        return sock

    def discard(self, sock: ControlSocket) -> None:
        """Close a socket in an unknown state (timed out, garbage received): no late reply may reach a later call."""
        with self._lock:
            self._sockets.discard(sock)
        sock.close()

    def close(self) -> None:
        """Close every socket and the context."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sockets, self._sockets, self._idle = self._sockets, set(), []
        for sock in sockets:
            sock.close()
        if self._pid == os.getpid():
            self._ctx.term()

    def _borrow(self) -> ControlSocket:
        with self._lock:
            if self._idle and self._pid == os.getpid() and not self._closed:
                return self._idle.pop()
        return self.new_socket()

    def _give_back(self, sock: ControlSocket) -> None:
        with self._lock:
            if not self._closed and sock in self._sockets:
                self._idle.append(sock)
                return
        sock.close()


def _context() -> zmq.Context:
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, _MAX_SOCKETS)
    return ctx


def _first_attempt_reply(msg: protocol.Message, reply: protocol.Message) -> protocol.Message:
    """What a resent request's first attempt got, where the resend is refused for what that attempt did: an
    OpenSession of a chosen key that is open now was opened by it (a key is a secret: nobody else chose it)."""
    if isinstance(msg, protocol.OpenSession) and isinstance(reply, protocol.Refused):
        if reply.code == "duplicate_session" and msg.session_id is not None:
            return protocol.SessionOpened(msg.request_id, msg.session_id)
    return reply


def _remaining_ms(deadline: float) -> int:
    return max(0, math.ceil((deadline - time.monotonic()) * 1000))
