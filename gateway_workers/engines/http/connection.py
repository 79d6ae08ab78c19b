"""One engine connection: an asyncio Protocol (over TCP or TLS) that sends a request, parses the answer with httptools.

Owns the per-connection state machine of engines/http/client.py's pool: one exchange at a time
(no pipelining), a deadline timer per exchange, buffered or streamed bodies (with read
back-pressure), end-of-body at close for unframed answers, the liveness check of an idle
connection, and the failure types (`HttpTimeout`, `HttpConnectionError`). The pool decides
reuse; this module only reports back through the small `Owner` Protocol.
Must not import anything else from gateway_workers.
"""

from __future__ import annotations

import asyncio
import select
from collections import deque
from typing import Any, Protocol

import httptools

# A stream's unread bytes above which we stop reading the socket, and below which we read again.
STREAM_HIGH_WATER = 4 * 1024 * 1024
STREAM_LOW_WATER = 1024 * 1024
_RESET_ERRORS = (ConnectionResetError, BrokenPipeError)


class HttpConnectionError(Exception):
    """Connecting failed, or the connection broke or carried garbage before the response was complete."""


class HttpTimeout(Exception):
    """The request's deadline passed (connecting included); its connection has been closed."""


class StaleConnection(HttpConnectionError):
    """A reused connection was reset before any response byte: the server never read the request."""


class Owner(Protocol):
    """What a connection needs from its pool."""

    idle_timeout_s: float

    def release(self, conn: Connection) -> None: ...

    def forget(self, conn: Connection) -> None: ...


class StreamBody:
    """A streamed response body: chunks in arrival order, read with `async for`; closing it drops the connection."""

    def __init__(self, conn: Connection) -> None:
        self._conn: Connection | None = conn
        self._loop = conn.pool_loop
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._waiter: asyncio.Future[None] | None = None
        self._eof = False
        self._error: BaseException | None = None
        self.content_type = b""  # the response's Content-Type, lowercased (set when the headers arrive)

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

    def __aiter__(self) -> StreamBody:
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

    def __init__(self, status: int, body: StreamBody) -> None:
        self.status = status
        self._body = body

    @property
    def content_type(self) -> bytes:
        """The Content-Type header's value, lowercased (empty if absent)."""
        return self._body.content_type

    def iter_any(self) -> StreamBody:
        """The body's chunks as they arrive (any size; not lines)."""
        return self._body

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self._body])

    def close(self) -> None:
        self._body.close()


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection carrying one exchange at a time; httptools calls the on_* methods."""

    def __init__(self, pool: Owner, loop: asyncio.AbstractEventLoop, key: tuple[str, int, bool]) -> None:
        self.pool = pool
        self.pool_loop = loop
        self.key = key
        self.transport: asyncio.Transport | None = None
        self._lost = False  # connection_lost ran: the transport is gone
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
        self._stream: StreamBody | None = None
        self._got_bytes = False
        self._status = 0
        self._framed = False

    def start(self, data: tuple[bytes, bytes], deadline: float, stream: StreamBody | None) -> asyncio.Future[Any]:
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
        Over TLS the poll watches the raw socket under the TLS layer, which holds nothing back: it
        decrypts whatever the socket delivers as it arrives. A server's close_notify is readable there
        like a FIN; TLS 1.3 session tickets arrive before the first response ends, so they never make
        a pooled connection look dead (a rare KeyUpdate would, costing one new connection, not a retry).
        """
        transport = self.transport
        if transport is None or transport.is_closing() or now - self.idle_since >= self.pool.idle_timeout_s:
            return False
        return not (self._poll is not None and self._poll.poll(0))

    def abort(self) -> None:
        """Close the connection now; an exchange in progress fails with HttpConnectionError (never hangs)."""
        if self._active:
            self._fail(HttpConnectionError("the connection was closed by the client"))
        else:
            self._kill()

    def cancel(self, waiter: asyncio.Future[Any]) -> None:
        """The caller of the exchange `waiter` belongs to went away: close the connection if it is still ours.

        The answer may have completed (and the connection gone back to the pool, even to another request)
        between the waiter's result and the cancellation reaching its caller; that connection is left alone.
        """
        if self._waiter is waiter:
            self.abort()

    def _kill(self) -> None:
        self._active = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        # Even a transport already closing: a TLS close() waits for the server's close_notify (up to 30 s),
        # and abort() is what ends that wait (harmless on a plain transport that is already closing).
        if self.transport is not None and not self._lost:
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
        self._lost = True
        self._end_of_input(exc)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.pool.forget(self)
        if not self.closed.done():
            self.closed.set_result(None)

    def _end_of_input(self, exc: Exception | None) -> None:
        if not self._active:
            return
        if self._status >= 200 and not self._framed and exc is None:
            self._complete(False)  # no Content-Length, not chunked: a clean close ends the body (HTTP/1.0 style)
        elif self.reused and not self._got_bytes and isinstance(exc, _RESET_ERRORS):
            self._fail(StaleConnection(f"reused connection reset before any response byte: {exc}"))
        else:
            detail = f": {type(exc).__name__}: {exc}" if exc is not None else ""
            self._fail(HttpConnectionError(f"the engine closed the connection before a complete response{detail}"))

    def _expire(self) -> None:
        self._timer = None
        self._fail(HttpTimeout("the request deadline passed"))

    def _fail(self, exc: BaseException) -> None:
        waiter, stream = self._waiter, self._stream
        self._stream = None
        self._kill()
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
            self.pool.release(self)
        elif self.transport is not None:
            self.transport.close()

    # --- httptools callbacks ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if not self._active:
            self._stray = True  # a second response to one request

    def on_header(self, name: bytes, value: bytes) -> None:
        size = len(name)
        if size in (14, 17) and name.lower() in (b"content-length", b"transfer-encoding"):
            self._framed = True
        elif size == 12 and self._stream is not None and name.lower() == b"content-type":
            self._stream.content_type = value.lower()

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
