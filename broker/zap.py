"""The broker's ZAP handler (ZeroMQ RFC 27): the thread that accepts or refuses each CURVE handshake.

libzmq asks the handler bound at `inproc://zeromq.zap.01` of the broker's context about every handshake
on its CURVE sockets, with the socket's ZAP domain (`curve.ZAP_DOMAINS`): a client key is accepted on
the worker endpoint only if it is in `authorized_workers/`, on the control endpoint only if it is in
`authorized_trainers/`. The directory is read at each handshake (once per connection, never per
message), so a key dropped in or removed counts from the next connection on. Blocking pyzmq in its own
thread, not pyzmq's `ThreadAuthenticator` (an asyncio loop in a thread; the broker has no asyncio).
Imports zmq, the stdlib and `broker.curve` only.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from pathlib import Path

import zmq
from zmq.auth.certs import load_certificates
from zmq.utils import z85

from broker import curve

logger = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by RFC 27: libzmq connects here
ZAP_VERSION = b"1.0"
STOP_TIMEOUT_S = 2.0
# A refused client retries its connection every few hundred ms: one warning per key and endpoint
# this often is enough to find it.
REFUSAL_LOG_INTERVAL_S = 60.0
_REFUSALS_REMEMBERED = 1_024
_stop_ids = itertools.count()


class ZapHandler:
    """Answers libzmq's ZAP requests for the broker's CURVE sockets, in a thread, until `stop()`.

    Args:
        ctx: the broker's context (ZAP is per context: the handler must share it with the sockets).
        authorized: per ZAP domain, the directory whose `*.key` files hold the public keys accepted.
    """

    def __init__(self, ctx: zmq.Context, authorized: dict[str, Path]) -> None:
        self._ctx = ctx
        self._authorized = dict(authorized)
        self._last_refusal_log: dict[tuple[str, bytes], float] = {}
        self._zap: zmq.Socket | None = None
        self._stop_send: zmq.Socket | None = None
        self._stop_recv: zmq.Socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind the ZAP endpoint (before any CURVE socket binds) and start answering; ZMQError if bound already."""
        stop_endpoint = f"inproc://rollout-gateway-zap-stop-{os.getpid()}-{next(_stop_ids)}"
        zap = self._ctx.socket(zmq.REP)
        zap.setsockopt(zmq.LINGER, 0)
        try:
            zap.bind(ZAP_ENDPOINT)
        except zmq.ZMQError:
            zap.close()
            raise
        self._stop_recv = self._ctx.socket(zmq.PAIR)
        self._stop_recv.bind(stop_endpoint)
        self._stop_send = self._ctx.socket(zmq.PAIR)
        self._stop_send.setsockopt(zmq.LINGER, 0)
        self._stop_send.connect(stop_endpoint)
        self._zap = zap
        for domain, directory in self._authorized.items():
            if not list(directory.glob("*" + curve.PUBLIC_SUFFIX)):
                logger.warning(
                    "%s holds no public key yet: no client can connect to the %s endpoint", directory, domain
                )
        # The sockets move to the thread here: Thread.start is the memory barrier pyzmq asks for.
        self._thread = threading.Thread(target=self._run, name="broker-zap", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and close its sockets (before the context is destroyed)."""
        if self._thread is None:
            return
        assert self._stop_send is not None
        try:
            self._stop_send.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass  # the thread has ended already (and closed its end)
        self._thread.join(STOP_TIMEOUT_S)
        if self._thread.is_alive():
            logger.error("the ZAP handler did not stop within %ss", STOP_TIMEOUT_S)
        self._stop_send.close(linger=0)
        self._thread = None

    def _run(self) -> None:
        zap, stop = self._zap, self._stop_recv
        assert zap is not None and stop is not None
        try:
            while True:
                ready = dict(zmq.zmq_poll([(zap, zmq.POLLIN), (stop, zmq.POLLIN)], -1))
                if stop in ready:
                    return
                request = zap.recv_multipart()
                try:
                    reply = self.handle_request(request)
                except Exception:  # a bug of ours refuses that one client, and the handler keeps answering
                    logger.exception("the ZAP handler failed on a request; refusing it")
                    reply = [ZAP_VERSION, request[1] if len(request) > 1 else b"", b"500", b"internal", b"", b""]
                zap.send_multipart(reply)
        except zmq.ContextTerminated:
            return
        except Exception:
            # ZAP_ENFORCE_DOMAIN makes libzmq refuse every handshake once no handler answers: fail closed.
            logger.exception("the ZAP handler stopped: new CURVE connections are refused from now on")
        finally:
            zap.close(linger=0)
            stop.close(linger=0)

    def handle_request(self, request: list[bytes]) -> list[bytes]:
        """The reply frames to one ZAP request: 200 for an authorized CURVE key, 400 for anything else."""
        if len(request) < 6:
            return [ZAP_VERSION, request[1] if len(request) > 1 else b"", b"400", b"malformed ZAP request", b"", b""]
        version, request_id, domain_bytes, address_bytes, _routing_id, mechanism, *credentials = request
        domain = domain_bytes.decode("utf-8", "replace")
        directory = self._authorized.get(domain)
        if version != ZAP_VERSION or directory is None or mechanism != b"CURVE" or len(credentials) != 1:
            logger.warning(
                "refused a %s handshake from %s on ZAP domain %r",
                mechanism.decode("ascii", "replace"),
                address_bytes.decode("utf-8", "replace"),
                domain,
            )
            return [ZAP_VERSION, request_id, b"400", b"not a CURVE client of this endpoint", b"", b""]
        public = z85.encode(credentials[0])
        try:
            accepted = load_certificates(directory)
        except (OSError, ValueError) as e:
            logger.error("cannot read the authorized keys in %s: %s", directory, e)
            return [ZAP_VERSION, request_id, b"500", b"authorized keys unreadable", b"", b""]
        if public in accepted:
            return [ZAP_VERSION, request_id, b"200", b"OK", public, b""]
        self._log_refusal(domain, public, address_bytes.decode("utf-8", "replace"), directory)
        return [ZAP_VERSION, request_id, b"400", b"key not authorized", b"", b""]

    def _log_refusal(self, domain: str, public: bytes, address: str, directory: Path) -> None:
        now = time.monotonic()
        key = (domain, public)
        last = self._last_refusal_log.get(key)
        if last is not None and now - last < REFUSAL_LOG_INTERVAL_S:
            return
        if len(self._last_refusal_log) >= _REFUSALS_REMEMBERED:
            self._last_refusal_log.clear()
        self._last_refusal_log[key] = now
        logger.warning(
            "refused CURVE key %s from %s on the %s endpoint: not in %s",
            public.decode("ascii"),
            address,
            domain,
            directory,
        )
