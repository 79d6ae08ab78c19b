"""The broker's socket role: one bound ROUTER socket (the worker or the control endpoint), and the raw calls on it.

Owns the socket setup `broker.server` needs twice: the ROUTER created with its options (LINGER, HWM,
MAXMSGSIZE, ROUTER_MANDATORY, and CURVE with a ZAP domain when keys are configured), bound (port 0
works; `endpoint` is the address actually bound), and a bind failure turned into `BindError`, which
names the endpoint; `bind_routers` binds both, refusing a non-loopback endpoint without keys before
anything is bound. The loop's per-frame calls are the cheapest pyzmq offers and go straight to
`RouterSocket.sock` (`send_part`, `waiting`, its own `recv`): nothing of this wrapper sits between a
frame and libzmq (CURVE works inside libzmq). Plain blocking pyzmq, no asyncio; imports nothing of
`broker` but its config, `broker.curve` and `broker.zap`.
"""

from __future__ import annotations

from types import TracebackType

import zmq

from broker import curve
from broker.config import BrokerConfig
from broker.zap import ZapHandler

NOBLOCK = int(zmq.NOBLOCK)
POLLIN = int(zmq.POLLIN)
MORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_zmq_poll = zmq.zmq_poll
# The Cython socket's own send. pyzmq's Python-level `Socket.send` only adds DRAFT routing_id /
# group handling (unused here) around it, and `send_multipart` a type check per part: together
# they cost as much as the rest of an ACK's way out (measured with callgrind).
send_part = getattr(zmq.backend, "Socket", zmq.Socket).send


def waiting(probe: list[tuple[zmq.Socket, int]]) -> bool:
    """Whether a frame waits on the socket of `probe` (`[(socket, POLLIN)]`).

    zmq_poll with no timeout asks the socket's ZMQ_EVENTS, which also takes the commands its
    descriptor announced. Through `zmq_poll` rather than `getsockopt(EVENTS)`: pyzmq's getsockopt
    builds an enum of the option on every call, which costs more than the syscall it saves
    (the figures are in `docs/performance.md`).
    """
    return bool(_zmq_poll(probe, 0))


class BindError(zmq.ZMQError):
    """An endpoint could not be bound (in use, or not a valid address): free it or configure another
    (`tcp://127.0.0.1:0` picks a free port and reports it). A `zmq.ZMQError`, with libzmq's errno."""


class RouterSocket:
    """One bound ROUTER socket of the broker, with its options set before it binds.

    Args:
        ctx: the broker's context; destroying it closes this socket too.
        endpoint: what to bind (`tcp://HOST:PORT`, port 0 for any free one, or `ipc://PATH`).
        config: gives `shutdown_linger_ms` (LINGER), `hwm` (SNDHWM and RCVHWM) and `max_frame_bytes`.
        keys: the broker's CURVE keys, or None (no CURVE: loopback only).
        role: whose endpoint this is, for CURVE: which authorized keys its ZAP domain accepts.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        config: BrokerConfig,
        keys: curve.ServerKeys | None = None,
        role: curve.Role = "worker",
    ) -> None:
        sock = ctx.socket(zmq.ROUTER)
        if keys is not None:
            keys.apply(sock, role)
        sock.setsockopt(zmq.LINGER, config.shutdown_linger_ms)
        sock.setsockopt(zmq.SNDHWM, config.hwm)
        sock.setsockopt(zmq.RCVHWM, config.hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, config.max_frame_bytes)
        # Unroutable replies raise instead of vanishing, so they are counted and logged.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            raise BindError(e.errno, f"cannot bind {endpoint}: {e.strerror}") from e
        self.sock = sock
        self.endpoint = str(sock.getsockopt_string(zmq.LAST_ENDPOINT))  # as bound: port 0 resolved

    def fd(self) -> int:
        """The socket's notification descriptor (ZMQ_FD): edge-triggered, readable when its mailbox gets a command."""
        return int(self.sock.getsockopt(zmq.FD))

    def close(self, linger: int | None = None) -> None:
        """Close the socket: unsent replies get `linger` ms (default: the LINGER it was set up with)."""
        self.sock.close(linger=linger)

    def __enter__(self) -> RouterSocket:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def bind_routers(ctx: zmq.Context, config: BrokerConfig) -> tuple[RouterSocket, RouterSocket, ZapHandler | None]:
    """The worker and control sockets, bound, and the ZAP handler that authorizes their CURVE clients (None
    without `config.curve_keys`).

    Raises `curve.CurveError` before anything is bound when an endpoint is not loopback and no keys are
    configured, or when the keys cannot be read; `BindError` if an endpoint cannot be bound.
    """
    curve.require_keys_off_loopback(config.worker_endpoint, config.curve_keys, "the worker endpoint")
    curve.require_keys_off_loopback(config.control_endpoint, config.curve_keys, "the control endpoint")
    keys = curve.load_server_keys(config.curve_keys) if config.curve_keys is not None else None
    zap = None
    bound: list[RouterSocket] = []
    try:
        if keys is not None:
            zap = ZapHandler(ctx, {curve.ZAP_DOMAINS[role]: path for role, path in keys.authorized.items()})
            zap.start()  # before the sockets bind: no handshake may come before the handler
        bound.append(RouterSocket(ctx, config.worker_endpoint, config, keys, "worker"))
        bound.append(RouterSocket(ctx, config.control_endpoint, config, keys, "trainer"))
    except BaseException:
        for router in bound:
            router.close(linger=0)
        if zap is not None:
            zap.stop()
        raise
    return bound[0], bound[1], zap
