"""A small HTTP/1.1 client for the engine backends: keep-alive pools on asyncio Protocols.

Owns the worker's connections to engine replicas (one unbounded keep-alive pool per host:port:tls),
URL checks, TLS contexts, request framing, deadlines, cancellation and the stale-connection retry;
each connection's protocol and httptools parsing is engines/http/connection.py. It replaces aiohttp,
whose generality cost several times the CPU per engine call (scripts/bench_engine_client.py;
docs/performance.md). Deliberately
narrow: http:// and https:// (verified), POST with a body, no redirects, proxies, compression or
pipelining. Failures are `HttpTimeout` and `HttpConnectionError`, which engines/http_engine.py maps to
EngineTimeout/EngineError.
Must not import anything from gateway_workers but engines/http/connection.py.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from gateway_workers.engines.http.connection import (
    Connection,
    HttpConnectionError,
    HttpTimeout,
    StaleConnection,
    StreamBody,
    StreamResponse,
)

logger = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 60.0  # a pooled connection idle this long is closed (what aiohttp's keepalive_timeout was)
IDLE_SWEEP_S = 15.0  # how often expired idle connections are closed while any are pooled
CLOSE_WAIT_S = 1.0  # bound on waiting for transports to report closed in `aclose`
_TARGET_CACHE_MAX = 1024  # distinct URLs remembered parsed (replicas x routes: a handful in practice)

_DEFAULT_PORTS = {"http": 80, "https": 443}
_CA_HINT = "a private CA or a self-signed engine certificate: pass it with --engine-ca-file"
_NAME_HINT = "the engine URL must use a host name or IP address the certificate was issued for"
# OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH and X509_V_ERR_IP_ADDRESS_MISMATCH: a CA file would not help there.
_VERIFY_HINTS = {62: _NAME_HINT, 64: _NAME_HINT}

__all__ = ["HttpConnectionError", "HttpPool", "HttpTimeout", "StreamResponse", "Target", "parse_url", "tls_context"]


@dataclass(frozen=True, slots=True)
class Target:
    """Where a URL points: the pool key (host, port, tls), the request path and the Host header."""

    host: str
    port: int
    path: str
    host_header: str
    tls: bool = False

    @property
    def key(self) -> tuple[str, int, bool]:
        return (self.host, self.port, self.tls)


def parse_url(url: str) -> Target:
    """A `Target` for an http:// or https:// URL; ValueError names the URL for anything else."""
    try:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        port = parts.port or _DEFAULT_PORTS.get(scheme, 0)
    except ValueError as e:
        raise ValueError(f"engine URL {url!r} is malformed: {e}") from e
    if scheme not in _DEFAULT_PORTS:
        raise ValueError(f"engine URL {url!r} must start with http:// or https://")
    if not parts.hostname:
        raise ValueError(f"engine URL {url!r} has no host")
    if parts.username is not None or parts.fragment:
        raise ValueError(f"engine URL {url!r}: credentials and fragments are not supported")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if not (path + parts.netloc).isascii() or any(c in path for c in " \r\n"):
        raise ValueError(f"engine URL {url!r} has characters that need percent-encoding")
    return Target(parts.hostname, port, path, parts.netloc, scheme == "https")


def tls_context(ca_file: str | None = None) -> ssl.SSLContext:
    """The client context for https:// engines: certificate chain and host name always verified.

    Trusts the system's CA store, or, with `ca_file` (a PEM bundle), only the CAs in that file (as
    curl's --cacert does): a private CA or a self-signed engine certificate goes there. There is
    deliberately no switch that turns verification off. ValueError names a file that cannot be used.
    """
    try:
        context = ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as e:  # a missing file is an OSError, a file without a PEM certificate an SSLError
        raise ValueError(f"engine CA file {ca_file!r} cannot be loaded: {e}") from e
    # Say HTTP/1.1 explicitly: a proxy that defaults to HTTP/2 when ALPN is absent would speak a framing we don't.
    context.set_alpn_protocols(["http/1.1"])
    return context


class HttpPool:
    """Keep-alive connections per (host, port, tls), unbounded: the engine, not our pool, limits concurrency.

    Bound to the running loop on first use. A request takes the most recently used idle connection
    that is still alive or opens one; a connection returns to the pool only after a complete
    response the server allows to keep alive (HTTP/1.1 without `Connection: close`). https://
    targets use `tls` (default: `tls_context()`, the system's CAs, built on first use).
    """

    def __init__(
        self, connect_timeout_s: float, idle_timeout_s: float = IDLE_TIMEOUT_S, tls: ssl.SSLContext | None = None
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.tls = tls
        self.loop: asyncio.AbstractEventLoop | None = None
        self._idle: dict[tuple[str, int, bool], list[Connection]] = {}
        self._all: set[Connection] = set()
        self._targets: dict[str, Target] = {}
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed = False

    def connections(self) -> int:
        """Open connections, idle or busy (for tests and metrics)."""
        return len(self._all)

    async def post(
        self, url: str, body: bytes, headers: dict[str, str], timeout: float, content_type: str = "application/json"
    ) -> tuple[int, bytes]:
        """POST `body`; (status, whole response body) within `timeout` seconds, connecting included."""
        result: tuple[int, bytes] = await self._request(url, body, headers, timeout, content_type, None)
        return result

    async def open_stream(
        self, url: str, body: bytes, headers: dict[str, str], timeout: float, content_type: str = "application/json"
    ) -> StreamResponse:
        """POST `body`; a StreamResponse once the headers arrived. `timeout` bounds the whole exchange."""
        return await self._request(url, body, headers, timeout, content_type, True)  # type: ignore[no-any-return]

    async def _request(
        self, url: str, body: bytes, headers: dict[str, str], timeout: float, content_type: str, stream: bool | None
    ) -> Any:
        if self._closed:
            raise HttpConnectionError("the HTTP client is closed")
        loop = self.loop
        if loop is None:
            loop = self.loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        target = self._targets.get(url) or self._parse(url)
        data = (_head(target, headers, len(body), content_type), body)
        conn = self._take(target, loop.time())
        for attempt in (1, 2):
            if conn is None:
                conn = await self._connect(target, deadline)
            sink = StreamBody(conn) if stream else None
            waiter = conn.start(data, deadline, sink)
            try:
                answer = await waiter
            except StaleConnection:
                # Retried once, on a fresh connection: a reset (not a FIN) before any response byte means the
                # server's kernel discarded our request unread (it closed the idle socket as the request
                # arrived, or with it unread in its buffer), so the engine never saw it. A plain EOF is not
                # retried: a server that read the request and then died also ends with one.
                if attempt == 2:
                    raise
                logger.debug("engine %s:%d reset a reused connection; retrying", target.host, target.port)
                conn = None
                continue
            except asyncio.CancelledError:
                conn.cancel(waiter)  # the caller went away: closing the connection is how vLLM learns to stop
                raise
            if sink is None:
                return answer
            return StreamResponse(answer, sink)
        raise AssertionError("unreachable")

    def _parse(self, url: str) -> Target:
        target = parse_url(url)
        if len(self._targets) >= _TARGET_CACHE_MAX:
            self._targets.clear()
        self._targets[url] = target
        return target

    def _take(self, target: Target, now: float) -> Connection | None:
        idle = self._idle.get(target.key)
        while idle:
            conn = idle.pop()
            conn.in_pool = False
            if conn.usable(now):
                return conn
            conn.abort()
        return None

    async def _connect(self, target: Target, deadline: float) -> Connection:
        assert self.loop is not None
        conn = Connection(self, self.loop, target.key)
        limit = min(self.connect_timeout_s, deadline - self.loop.time())
        tls = None
        if target.tls:
            if self.tls is None:
                self.tls = tls_context()
            tls = self.tls
        # server_hostname is what the certificate is checked against (and the SNI sent): the URL's host.
        opening = self.loop.create_connection(
            lambda: conn, target.host, target.port, ssl=tls, server_hostname=target.host if tls else None
        )
        try:
            # The limit covers the TLS handshake too: a server that accepts but never answers it is a timeout.
            await asyncio.wait_for(opening, limit)
        except asyncio.TimeoutError as e:
            raise HttpTimeout(f"connecting to {target.host}:{target.port} took over {limit:.3g}s") from e
        except ssl.SSLCertVerificationError as e:
            raise HttpConnectionError(
                f"the TLS certificate of {target.host}:{target.port} is not trusted: {e.verify_message} "
                f"({_VERIFY_HINTS.get(e.verify_code, _CA_HINT)})"
            ) from e
        except ssl.SSLError as e:
            raise HttpConnectionError(f"TLS handshake with {target.host}:{target.port} failed: {e}") from e
        except OSError as e:
            raise HttpConnectionError(f"cannot connect to {target.host}:{target.port}: {e}") from e
        if self._closed:
            conn.abort()
            raise HttpConnectionError("the HTTP client is closed")
        self._all.add(conn)
        return conn

    def release(self, conn: Connection) -> None:
        if self._closed or self.loop is None:
            conn.abort()
            return
        conn.idle_since = self.loop.time()
        conn.in_pool = True
        self._idle.setdefault(conn.key, []).append(conn)
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(IDLE_SWEEP_S, self._sweep)

    def forget(self, conn: Connection) -> None:
        self._all.discard(conn)
        if conn.in_pool:
            conn.in_pool = False
            self._idle[conn.key].remove(conn)

    def _sweep(self) -> None:
        """Close idle connections past their idle timeout; runs while any connection is pooled."""
        assert self.loop is not None
        self._sweeper = None
        now = self.loop.time()
        for idle in self._idle.values():
            for conn in [c for c in idle if now - c.idle_since >= self.idle_timeout_s]:
                conn.abort()  # connection_lost takes it out of the list
        if any(self._idle.values()):
            self._sweeper = self.loop.call_later(IDLE_SWEEP_S, self._sweep)

    async def aclose(self) -> None:
        """Close every connection, idle or busy (busy requests fail with HttpConnectionError)."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        conns = list(self._all)
        for conn in conns:
            conn.abort()
        if conns:
            # Transports close their sockets in a callback: wait for it, so nothing outlives the loop.
            await asyncio.wait([c.closed for c in conns], timeout=CLOSE_WAIT_S)


def _head(target: Target, headers: dict[str, str], length: int, content_type: str) -> bytes:
    lines = [
        f"POST {target.path} HTTP/1.1\r\nHost: {target.host_header}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {length}\r\nUser-Agent: rollout-gateway\r\n"
    ]
    for name, value in headers.items():
        if "\n" in value or "\r" in value or "\n" in name or ":" in name:
            raise ValueError(f"HTTP header {name!r} has a line break or a colon in its name")
        lines.append(f"{name}: {value}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")
