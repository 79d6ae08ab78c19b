"""A small HTTP/1.1 client for the engine backends: keep-alive pools on asyncio Protocols, httptools parsing.

Owns the worker's connections to engine replicas (one unbounded keep-alive pool per host:port),
request framing, response parsing with httptools (uvicorn's llhttp binding), deadlines and
cancellation. It replaces aiohttp, whose generality cost ~3x the CPU per engine call
(scripts/bench_engine_client.py). Deliberately narrow: http:// only, POST with a body, no redirects,
proxies, compression or pipelining; the engine is a peer on a private network. Failures are two
types, `HttpTimeout` and `HttpConnectionError`, which engines/base.py maps to EngineTimeout/EngineError.
Must not import anything else from gateway_workers: this is plumbing the engine seam sits on.
"""

from __future__ import annotations

import asyncio
import logging
import select
from collections import deque
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httptools

logger = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 60.0  # a pooled connection idle this long is closed (what aiohttp's keepalive_timeout was)
IDLE_SWEEP_S = 15.0  # how often expired idle connections are closed while any are pooled
CLOSE_WAIT_S = 1.0  # bound on waiting for transports to report closed in `aclose`
# A stream's unread bytes above which we stop reading the socket, and below which we read again.
STREAM_HIGH_WATER = 4 * 1024 * 1024
STREAM_LOW_WATER = 1024 * 1024
_TARGET_CACHE_MAX = 1024  # distinct URLs remembered parsed (replicas x routes: a handful in practice)
_RESET_ERRORS = (ConnectionResetError, BrokenPipeError)


class HttpConnectionError(Exception):
    """Connecting failed, or the connection broke or carried garbage before the response was complete."""


class HttpTimeout(Exception):
    """The request's deadline passed (connecting included); its connection has been closed."""


class _StaleConnection(HttpConnectionError):
    """A reused connection was reset before any response byte: the server never read the request."""


@dataclass(frozen=True, slots=True)
class Target:
    """Where a URL points: the pool key (host, port), the request path and the Host header."""

    host: str
    port: int
    path: str
    host_header: str


def parse_url(url: str) -> Target:
    """A `Target` for an http:// URL; ValueError names the URL for anything else (https included)."""
    try:
        parts = urlsplit(url)
        port = parts.port or 80
    except ValueError as e:
        raise ValueError(f"engine URL {url!r} is malformed: {e}") from e
    if parts.scheme != "http":
        why = "TLS is not supported: reach the engine over a private network" if parts.scheme == "https" else ""
        raise ValueError(f"engine URL {url!r} must start with http:// {('(' + why + ')') if why else ''}".rstrip())
    if not parts.hostname:
        raise ValueError(f"engine URL {url!r} has no host")
    if parts.username is not None or parts.fragment:
        raise ValueError(f"engine URL {url!r}: credentials and fragments are not supported")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if not (path + parts.netloc).isascii() or any(c in path for c in " \r\n"):
        raise ValueError(f"engine URL {url!r} has characters that need percent-encoding")
    return Target(parts.hostname, port, path, parts.netloc)


class _StreamBody:
    """A streamed response body: chunks in arrival order, read with `async for`; closing it drops the connection."""

    def __init__(self, conn: _Connection) -> None:
        self._conn: _Connection | None = conn
        self._loop = conn.pool_loop
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._waiter: asyncio.Future[None] | None = None
        self._eof = False
        self._error: BaseException | None = None

    def feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        self._wake()
        if self._size > STREAM_HIGH_WATER and self._conn is not None:
            self._conn.pause_reading()  # a slow reader must not buffer a whole generation in memory

    def finish(self) -> None:
        self._eof, self._conn = True, None
        self._wake()

    def fail(self, exc: BaseException) -> None:
        self._error, self._conn = exc, None
        self._wake()

    def close(self) -> None:
        """Stop reading; a body not read to its end closes its connection (which is how vLLM learns to stop)."""
        if self._conn is not None:
            self._conn.abort()
            self._conn = None
        if not self._eof and self._error is None:
            self._error = HttpConnectionError("the stream was closed")
        self._chunks.clear()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> _StreamBody:
        return self

    async def __anext__(self) -> bytes:
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._size -= len(chunk)
                if self._conn is not None and self._size <= STREAM_LOW_WATER:
                    self._conn.resume_reading()
                return chunk
            if self._error is not None:
                raise self._error
            if self._eof:
                raise StopAsyncIteration
            self._waiter = self._loop.create_future()
            await self._waiter


class StreamResponse:
    """A response whose body is read as it arrives. Read it to the end, or `close()` it."""

    def __init__(self, status: int, body: _StreamBody) -> None:
        self.status = status
        self._body = body

    def iter_any(self) -> _StreamBody:
        """The body's chunks as they arrive (any size; not lines)."""
        return self._body

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self._body])

    def close(self) -> None:
        self._body.close()


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection carrying one exchange at a time; httptools calls the on_* methods."""

    def __init__(self, pool: HttpPool, key: tuple[str, int]) -> None:
        self.pool = pool
        self.pool_loop: asyncio.AbstractEventLoop = pool.loop  # type: ignore[assignment]
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.closed: asyncio.Future[None] = self.pool_loop.create_future()
        self.reused = False  # has completed a response before: a candidate for the stale-connection retry
        self.in_pool = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._poll: Any = None
        self._paused = False
        # The current exchange.
        self._active = False
        self._stray = False
        self._waiter: asyncio.Future[Any] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._body: list[bytes] = []
        self._stream: _StreamBody | None = None
        self._got_bytes = False
        self._status = 0
        self._framed = False

    def start(self, data: tuple[bytes, bytes], deadline: float, stream: _StreamBody | None) -> asyncio.Future[Any]:
        """Send a request; the future gets (status, body), or for a stream the status once headers arrived."""
        assert self.transport is not None and not self._active
        self._active, self._stray, self._got_bytes, self._status, self._framed = True, False, False, 0, False
        self._stream = stream
        waiter = self._waiter = self.pool_loop.create_future()
        self._timer = self.pool_loop.call_at(deadline, self._expire)
        self.transport.writelines(data)
        return waiter

    def usable(self, now: float) -> bool:
        """Whether an idle connection can carry a request: open, not expired, and nothing to read on it.

        An idle connection has nothing owed to it, so anything readable (the server's FIN, a reset,
        stray bytes) means it is dead even if the loop has not processed that event yet. Checking the
        kernel here, before writing, is what makes the usual idle-close race harmless: no byte is sent.
        """
        transport = self.transport
        if transport is None or transport.is_closing() or now - self.idle_since >= self.pool.idle_timeout_s:
            return False
        return not (self._poll is not None and self._poll.poll(0))

    def abort(self) -> None:
        self._active = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()

    def pause_reading(self) -> None:
        if not self._paused and self.transport is not None and not self.transport.is_closing():
            self._paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._paused and self.transport is not None and not self.transport.is_closing():
            self._paused = False
            self.transport.resume_reading()

    # --- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self._poll = select.poll()
            self._poll.register(sock.fileno(), select.POLLIN)

    def data_received(self, data: bytes) -> None:
        if not self._active:
            self.abort()  # bytes nobody asked for: the connection's framing can no longer be trusted
            return
        self._got_bytes = True
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as e:
            self._fail(HttpConnectionError(f"malformed HTTP response: {e}"))
            return
        if self._stray:
            self.abort()

    def eof_received(self) -> bool:
        self._end_of_input(None)
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._end_of_input(exc)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.pool._forget(self)
        if not self.closed.done():
            self.closed.set_result(None)

    def _end_of_input(self, exc: Exception | None) -> None:
        if not self._active:
            return
        if self._status >= 200 and not self._framed:
            self._complete(False)  # no Content-Length, not chunked: the body ends when the server closes
        elif self.reused and not self._got_bytes and isinstance(exc, _RESET_ERRORS):
            self._fail(_StaleConnection(f"reused connection reset before any response byte: {exc}"))
        else:
            detail = f": {type(exc).__name__}: {exc}" if exc is not None else ""
            self._fail(HttpConnectionError(f"the engine closed the connection before a complete response{detail}"))

    def _expire(self) -> None:
        self._timer = None
        self._fail(HttpTimeout("the request deadline passed"))

    def _fail(self, exc: BaseException) -> None:
        waiter, stream = self._waiter, self._stream
        self._stream = None
        self.abort()
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        if stream is not None:
            stream.fail(exc)

    def _complete(self, keep_alive: bool) -> None:
        self._active = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiter, stream = self._waiter, self._stream
        self._stream = None
        if stream is not None:
            stream.finish()
        elif waiter is not None and not waiter.done():
            waiter.set_result((self._status, b"".join(self._body)))
        self._body = []
        self._waiter = None
        if keep_alive and self.transport is not None and not self.transport.is_closing():
            self.resume_reading()  # an idle connection must read, so a server's close is noticed
            self.reused = True
            self.pool._release(self)
        elif self.transport is not None:
            self.transport.close()

    # --- httptools callbacks ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if not self._active:
            self._stray = True  # a second response to one request

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) in (14, 17) and name.lower() in (b"content-length", b"transfer-encoding"):
            self._framed = True

    def on_headers_complete(self) -> None:
        if not self._active:
            return
        self._status = self._parser.get_status_code()
        waiter = self._waiter
        if self._stream is not None and self._status >= 200 and waiter is not None and not waiter.done():
            waiter.set_result(self._status)

    def on_body(self, body: bytes) -> None:
        if self._stream is not None:
            self._stream.feed(body)
        elif self._active:
            self._body.append(body)

    def on_message_complete(self) -> None:
        if not self._active:
            return
        if self._status < 200:  # an interim 1xx answer: the real one follows on the same connection
            self._status, self._framed, self._body = 0, False, []
            return
        self._complete(self._parser.should_keep_alive())


class HttpPool:
    """Keep-alive connections per (host, port), unbounded: the engine, not our pool, limits concurrency.

    Bound to the running loop on first use. A request takes the most recently used idle connection
    that is still alive or opens one; a connection returns to the pool only after a complete
    response the server allows to keep alive (HTTP/1.1 without `Connection: close`).
    """

    def __init__(self, connect_timeout_s: float, idle_timeout_s: float = IDLE_TIMEOUT_S) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._all: set[_Connection] = set()
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
            sink = _StreamBody(conn) if stream else None
            waiter = conn.start(data, deadline, sink)
            try:
                answer = await waiter
            except _StaleConnection:
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
                conn.abort()  # the caller went away: closing the connection is how vLLM learns to stop
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

    def _take(self, target: Target, now: float) -> _Connection | None:
        idle = self._idle.get((target.host, target.port))
        while idle:
            conn = idle.pop()
            conn.in_pool = False
            if conn.usable(now):
                return conn
            conn.abort()
        return None

    async def _connect(self, target: Target, deadline: float) -> _Connection:
        assert self.loop is not None
        conn = _Connection(self, (target.host, target.port))
        limit = min(self.connect_timeout_s, deadline - self.loop.time())
        try:
            await asyncio.wait_for(self.loop.create_connection(lambda: conn, target.host, target.port), limit)
        except asyncio.TimeoutError as e:
            raise HttpTimeout(f"connecting to {target.host}:{target.port} took over {limit:.3g}s") from e
        except OSError as e:
            raise HttpConnectionError(f"cannot connect to {target.host}:{target.port}: {e}") from e
        if self._closed:
            conn.abort()
            raise HttpConnectionError("the HTTP client is closed")
        self._all.add(conn)
        return conn

    def _release(self, conn: _Connection) -> None:
        if self._closed or self.loop is None:
            conn.abort()
            return
        conn.idle_since = self.loop.time()
        conn.in_pool = True
        self._idle.setdefault(conn.key, []).append(conn)
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(IDLE_SWEEP_S, self._sweep)

    def _forget(self, conn: _Connection) -> None:
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
