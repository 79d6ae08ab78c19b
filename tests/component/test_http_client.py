"""The engines' own HTTP/1.1 client against a real local server: pooling, framing, failures, deadlines.

The server is a threaded raw-socket HTTP/1.1 server scripted per path, so each test controls
exactly what reaches the socket (split writes, chunking, Connection: close, HTTP/1.0, resets,
hangs) and counts connections, requests and client disconnects. It runs in its own threads, so
the client's event loop can be held still while the server closes a connection under it.
Given a server-side SSLContext it speaks TLS (test_http_client_tls.py runs the scenarios over it).
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
import ssl
import threading
import time
from typing import Any

import pytest

from gateway_workers.engines.base import EngineError, EngineTimeout
from gateway_workers.engines.config import EngineConfig
from gateway_workers.engines.http import connection as http_connection
from gateway_workers.engines.http.client import HttpConnectionError, HttpPool, parse_url
from gateway_workers.engines.vllm import VllmEngine

# Loop timers have millisecond resolution (uvloop rounds them): a deadline may fire up to a millisecond early.
TIMER_SLACK_S = 0.005

TEST_DEADLINE_S = 10.0  # bound on each scenario
WAIT_S = 5.0  # bound on waiting for the server to observe something
CONNECT_S = 2.0
ACCEPT_POLL_S = 0.05


class TinyServer:
    """A scripted HTTP/1.1 server on 127.0.0.1; behaviour is chosen by the request path."""

    def __init__(self, port: int = 0, tls: ssl.SSLContext | None = None) -> None:
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", port))
        self.listener.listen(64)
        self.listener.settimeout(ACCEPT_POLL_S)
        self.port = self.listener.getsockname()[1]
        self.tls = tls
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.lock = threading.Lock()
        self.handshakes: list[tuple[str | None, str | None]] = []  # TLS: (version, ALPN protocol) per connection
        self.handshake_errors: list[str] = []
        self.connections = 0
        self.requests: list[tuple[int, str, bytes, dict[str, str]]] = []  # (connection no, path, body, headers)
        self.disconnects = 0  # connections the client closed
        self.socks: list[socket.socket] = []
        self.barrier: threading.Barrier | None = None
        self.stopping = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def wait_for(self, predicate: Any, timeout: float = WAIT_S) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if predicate():
                    return True
            time.sleep(0.01)
        return False

    def stop(self) -> None:
        """Stop accepting and close every connection (a FIN to the client): the engine went away."""
        self.stopping = True
        self.thread.join(WAIT_S)
        self.listener.close()
        with self.lock:
            socks, self.socks = self.socks, []
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _accept(self) -> None:
        while not self.stopping:
            try:
                sock, _ = self.listener.accept()
            except OSError:  # includes the accept timeout
                continue
            with self.lock:
                self.connections += 1
                number = self.connections
                self.socks.append(sock)
            threading.Thread(target=self._serve, args=(sock, number), daemon=True).start()

    def _handshake(self, sock: socket.socket) -> socket.socket | None:
        """The TLS side of an accepted connection, or None (recorded) if the handshake failed."""
        assert self.tls is not None
        sock.settimeout(WAIT_S)
        try:
            tls_sock = self.tls.wrap_socket(sock, server_side=True)
        except OSError as e:  # ssl.SSLError included: the client refused our certificate, or spoke no TLS
            with self.lock:
                self.handshake_errors.append(str(e))
            sock.close()
            return None
        tls_sock.settimeout(None)
        with self.lock:
            self.handshakes.append((tls_sock.version(), tls_sock.selected_alpn_protocol()))
            if sock not in self.socks:  # stop() already ran
                tls_sock.close()
                return None
            self.socks[self.socks.index(sock)] = tls_sock  # wrapping took over the descriptor
        return tls_sock

    def _serve(self, sock: socket.socket, number: int) -> None:
        try:
            if self.tls is not None:
                wrapped = self._handshake(sock)
                if wrapped is None:
                    return
                sock = wrapped
            buffer = b""
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = sock.recv(65536)
                    if not data:
                        with self.lock:
                            self.disconnects += 1
                        return
                    buffer += data
                head, buffer = buffer.split(b"\r\n\r\n", 1)
                lines = head.decode("latin-1").split("\r\n")
                path = lines[0].split(" ")[1]
                headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
                length = int(headers.get("content-length", "0"))
                while len(buffer) < length:
                    buffer += sock.recv(65536)
                body, buffer = buffer[:length], buffer[length:]
                with self.lock:
                    self.requests.append((number, path, body, headers))
                if not self._answer(sock, number, path, body, headers):
                    return
        except (OSError, ValueError, threading.BrokenBarrierError):
            return  # stop() closed the socket under this thread (or the test's barrier broke): the exchange is over
        finally:
            sock.close()

    def _answer(self, sock: socket.socket, number: int, path: str, body: bytes, headers: dict[str, str]) -> bool:
        """Answer one request; False ends the connection."""
        echo = json.dumps({"conn": number, "path": path, "body": json.loads(body or b"null"), "headers": headers})
        if path == "/echo":
            sock.sendall(_response(200, echo.encode()))
        elif path == "/close":
            sock.sendall(_response(200, echo.encode(), b"Connection: close\r\n"))
            return False
        elif path == "/http10":  # no Content-Length: the body ends when the server closes
            sock.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n" + echo.encode())
            return False
        elif path == "/barrier":
            assert self.barrier is not None
            self.barrier.wait(WAIT_S)
            sock.sendall(_response(200, echo.encode()))
        elif path == "/hang":
            if not sock.recv(1):
                with self.lock:
                    self.disconnects += 1
            return False
        elif path == "/error":
            sock.sendall(_response(503, b"engine overloaded: " + b"x" * 1000))
        elif path == "/big":  # one body over many TCP writes
            payload = json.dumps({"ids": list(range(200_000))}).encode()
            head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(payload)
            for part in [head] + [payload[i : i + 50_000] for i in range(0, len(payload), 50_000)]:
                sock.sendall(part)
                time.sleep(0.002)
        elif path == "/bytes":  # a large plain body in many writes, for read back-pressure
            payload = bytes(range(256)) * 8192
            sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(payload))
            for i in range(0, len(payload), 65536):
                sock.sendall(payload[i : i + 65536])
        elif path in ("/sse", "/sse-slow"):
            return self._stream(sock, slow=path == "/sse-slow")
        elif path == "/rst-next":  # answer, then close with the next request unread: the kernel sends a reset
            sock.sendall(_response(200, echo.encode()))
            select.select([sock], [], [], WAIT_S)
            return False
        elif path == "/close-linger":  # Connection: close, then keep the socket open until the client closes it
            sock.sendall(_response(200, echo.encode(), b"Connection: close\r\n"))
            self._await_close(sock)
            return False
        elif path == "/eof-next":  # answer, then read the next request and close without answering it
            sock.sendall(_response(200, echo.encode()))
            data = sock.recv(65536)
            with self.lock:
                self.requests.append((number, "(read, unanswered)", data, {}))
            return False
        else:
            sock.sendall(_response(404, b"no such path"))
        return True

    def _await_close(self, sock: socket.socket) -> None:
        """Read raw bytes (a TLS close_notify among them, never answered) until the client's FIN or reset."""
        raw = socket.socket(fileno=socket.dup(sock.fileno()))  # under the TLS layer, which would stop at close_notify
        raw.settimeout(WAIT_S)
        try:
            while raw.recv(65536):
                pass
        except TimeoutError:
            return
        except OSError:
            pass
        finally:
            raw.close()
        with self.lock:
            self.disconnects += 1

    def _stream(self, sock: socket.socket, slow: bool) -> bool:
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        events = [json.dumps({"n": n}).encode() for n in range(50 if slow else 3)]
        events.append(json.dumps({"big": "y" * 300_000}).encode())  # one event over many chunks and reads
        wire = b"".join(b"data: " + e + b"\r\n\r\n" for e in events) + b"data: [DONE]\n\n"
        step = 7 if slow else 40_001  # events split at arbitrary chunk borders
        for i in range(0, len(wire), step):
            piece = wire[i : i + step]
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            except OSError:
                with self.lock:
                    self.disconnects += 1
                return False
            if slow:
                time.sleep(0.01)
        sock.sendall(b"0\r\n\r\n")
        return True


def _response(status: int, body: bytes, extra: bytes = b"") -> bytes:
    head = b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" % (status, len(body))
    return head + extra + b"\r\n" + body


@pytest.fixture
def server():
    srv = TinyServer()
    yield srv
    srv.stop()


def run(scenario: Any) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(scenario, TEST_DEADLINE_S)

    return asyncio.run(bounded())


def engine(url: str, **overrides: Any) -> VllmEngine:
    return VllmEngine(EngineConfig(kind="vllm", urls=(url,), **overrides))


def test_sequential_requests_share_one_keep_alive_connection(server):
    async def scenario() -> list[Any]:
        eng = engine(server.url)
        try:
            answers = [await eng.post_json(server.url + "/echo", {"i": i}, {"X-Test": f"t{i}"}) for i in range(5)]
            assert eng.pool().connections() == 1
            return answers
        finally:
            await eng.aclose()

    answers = run(scenario())
    assert [a["body"] for a in answers] == [{"i": i} for i in range(5)]
    assert {a["conn"] for a in answers} == {1} and server.connections == 1
    headers = answers[0]["headers"]
    assert headers["x-test"] == "t0" and headers["host"] == f"127.0.0.1:{server.port}"
    assert headers["content-type"] == "application/json" and int(headers["content-length"]) == len(b'{"i":0}')
    assert server.wait_for(lambda: server.disconnects == 1)  # aclose closed it


def test_parallel_requests_open_one_connection_each_then_reuse_them(server):
    n = 8
    server.barrier = threading.Barrier(n)  # all n must be in flight at once for any to be answered

    async def scenario() -> tuple[list[Any], list[Any]]:
        eng = engine(server.url)
        try:
            first = await asyncio.gather(*(eng.post_json(server.url + "/barrier", {"i": i}, {}) for i in range(n)))
            again = await asyncio.gather(*(eng.post_json(server.url + "/echo", {"i": i}, {}) for i in range(n)))
            assert eng.pool().connections() == n
            return first, again
        finally:
            await eng.aclose()

    first, again = run(scenario())
    assert [a["body"]["i"] for a in first] == list(range(n)) and len({a["conn"] for a in first}) == n
    assert [a["body"]["i"] for a in again] == list(range(n)) and server.connections == n


def test_connection_close_and_http10_answers_are_not_reused(server):
    async def scenario() -> list[Any]:
        eng = engine(server.url)
        try:
            out = [await eng.post_json(server.url + path, {"p": path}, {}) for path in ("/close", "/http10", "/echo")]
            out.append(await eng.post_json(server.url + "/echo", {"p": "again"}, {}))
            return out
        finally:
            await eng.aclose()

    answers = run(scenario())
    assert [a["body"]["p"] for a in answers] == ["/close", "/http10", "/echo", "again"]
    assert [a["conn"] for a in answers] == [1, 2, 3, 3]  # only the HTTP/1.1 keep-alive answer is reused


def test_engine_restarted_between_requests(server):
    """A pooled connection whose server went away is dropped before anything is written on it."""
    port = server.port

    async def scenario() -> None:
        eng = engine(server.url)
        try:
            assert (await eng.post_json(server.url + "/echo", {"i": 1}, {}))["conn"] == 1
            server.stop()
            with pytest.raises(EngineError, match="request failed"):
                await eng.post_json(server.url + "/echo", {"i": 2}, {})  # nothing listens: a clean error
            assert eng.pool().connections() == 0
            again = TinyServer(port)
            try:
                assert (await eng.post_json(again.url + "/echo", {"i": 3}, {}))["body"] == {"i": 3}
                again.stop()
                # The loop is held still while the FIN arrives: only the kernel knows the connection died.
                time.sleep(0.1)
                third = TinyServer(port)
                try:
                    assert (await eng.post_json(third.url + "/echo", {"i": 4}, {}))["body"] == {"i": 4}
                    assert [r[2] for r in third.requests] == [b'{"i":4}']
                finally:
                    third.stop()
                assert [r[2] for r in again.requests] == [b'{"i":3}']  # nothing was sent on the dead one
            finally:
                again.stop()
        finally:
            await eng.aclose()

    run(scenario())


def test_reset_of_a_reused_connection_before_any_answer_is_retried_once(server):
    async def scenario() -> Any:
        eng = engine(server.url)
        try:
            await eng.post_json(server.url + "/rst-next", {"i": 1}, {})
            return await eng.post_json(server.url + "/echo", {"i": 2}, {})  # written to conn 1, reset unread
        finally:
            await eng.aclose()

    answer = run(scenario())
    assert answer["conn"] == 2 and answer["body"] == {"i": 2}
    assert [(r[0], r[1]) for r in server.requests] == [(1, "/rst-next"), (2, "/echo")]  # processed once


def test_close_after_reading_the_request_is_an_error_not_a_retry(server):
    async def scenario() -> None:
        eng = engine(server.url)
        try:
            await eng.post_json(server.url + "/eof-next", {"i": 1}, {})
            with pytest.raises(EngineError, match="request failed.*closed the connection"):
                await eng.post_json(server.url + "/echo", {"i": 2}, {})
        finally:
            await eng.aclose()

    run(scenario())
    assert server.wait_for(lambda: len(server.requests) == 2)
    assert [r[1] for r in server.requests] == ["/eof-next", "(read, unanswered)"] and server.connections == 1


def test_deadline_is_an_engine_timeout_and_closes_the_connection(server):
    bound = 0.3

    async def scenario() -> float:
        eng = engine(server.url, request_timeout_s=bound)
        started = time.monotonic()
        try:
            with pytest.raises(EngineTimeout, match=f"within {bound}s"):
                await eng.post_json(server.url + "/hang", {}, {})
            return time.monotonic() - started
        finally:
            await eng.aclose()

    took = run(scenario())
    assert bound - TIMER_SLACK_S <= took < bound + 1.0
    assert server.wait_for(lambda: server.disconnects == 1)


def test_cancelled_request_closes_its_connection(server):
    async def scenario() -> int:
        eng = engine(server.url)
        try:
            task = asyncio.create_task(eng.post_json(server.url + "/hang", {}, {}))
            assert await asyncio.to_thread(server.wait_for, lambda: server.requests)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await asyncio.to_thread(server.wait_for, lambda: server.disconnects == 1)
            return eng.pool().connections()
        finally:
            await eng.aclose()

    assert run(scenario()) == 0


def test_chunked_sse_stream_is_split_into_events_and_the_connection_reused(server):
    async def scenario() -> tuple[list[Any], Any]:
        eng = engine(server.url)
        try:
            events = [e async for e in eng.stream_json(server.url + "/sse", {"s": 1}, {})]
            after = await eng.post_json(server.url + "/echo", {}, {})
            return events, after
        finally:
            await eng.aclose()

    events, after = run(scenario())
    assert events == [{"n": 0}, {"n": 1}, {"n": 2}, {"big": "y" * 300_000}]
    assert after["conn"] == 1  # the stream ended cleanly, so its connection went back to the pool


def test_closing_a_stream_early_closes_its_connection(server):
    async def scenario() -> int:
        eng = engine(server.url)
        try:
            stream = eng.stream_json(server.url + "/sse-slow", {}, {})
            assert await stream.__anext__() == {"n": 0}
            await stream.aclose()
            assert await asyncio.to_thread(server.wait_for, lambda: server.disconnects == 1)
            return eng.pool().connections()
        finally:
            await eng.aclose()

    assert run(scenario()) == 0


def test_body_over_many_reads_and_non_2xx_snippet(server):
    async def scenario() -> Any:
        eng = engine(server.url)
        try:
            big = await eng.post_json(server.url + "/big", {}, {})
            with pytest.raises(EngineError, match=r"HTTP 503: engine overloaded: x+$") as info:
                await eng.post_json(server.url + "/error", {}, {})
            assert info.value.status == 503 and not isinstance(info.value, EngineTimeout)
            assert len(str(info.value).split(": ", 1)[1]) < 400  # a snippet, not the whole body
            with pytest.raises(EngineError, match="HTTP 503"):
                [e async for e in eng.stream_json(server.url + "/error", {}, {})]
            return big, eng.pool().connections()
        finally:
            await eng.aclose()

    big, connections = run(scenario())
    assert big == {"ids": list(range(200_000))}
    assert connections == 1 and server.connections == 1  # error answers with a body keep the connection


def test_a_slow_stream_reader_pauses_the_socket_and_loses_nothing(server, monkeypatch):
    monkeypatch.setattr(http_connection, "STREAM_HIGH_WATER", 64 * 1024)
    monkeypatch.setattr(http_connection, "STREAM_LOW_WATER", 16 * 1024)

    async def scenario() -> tuple[bytes, bool, bool]:
        pool = HttpPool(CONNECT_S)
        try:
            resp = await pool.open_stream(server.url + "/bytes", b"{}", {}, WAIT_S)
            (conn,) = pool._all
            chunks = []
            async for chunk in resp.iter_any():
                if not chunks:
                    await asyncio.sleep(0.2)  # the server keeps writing; we must stop reading, not buffer it all
                    paused = conn._paused
                chunks.append(chunk)
            return b"".join(chunks), paused, conn._paused
        finally:
            await pool.aclose()

    data, paused_while_slow, paused_at_end = run(scenario())
    assert data == bytes(range(256)) * 8192
    assert paused_while_slow and not paused_at_end


def test_closing_the_pool_fails_requests_in_flight(server):
    async def scenario() -> None:
        pool = HttpPool(CONNECT_S)
        busy = asyncio.create_task(pool.post(server.url + "/hang", b"{}", {}, WAIT_S * 10))
        assert await asyncio.to_thread(server.wait_for, lambda: server.requests)
        await pool.aclose()
        with pytest.raises(HttpConnectionError, match="closed by the client"):
            await asyncio.wait_for(busy, WAIT_S)  # fails at once, not at its own (long) deadline

    run(scenario())
    assert server.wait_for(lambda: server.disconnects == 1)


def test_idle_connections_expire(server):
    async def scenario() -> None:
        pool = HttpPool(CONNECT_S, idle_timeout_s=0.05)
        try:
            await pool.post(server.url + "/echo", b"{}", {}, WAIT_S)
            await asyncio.sleep(0.1)
            status, body = await pool.post(server.url + "/echo", b"{}", {}, WAIT_S)
            assert status == 200 and json.loads(body)["conn"] == 2
        finally:
            await pool.aclose()

    run(scenario())


def test_only_http_and_https_urls_are_accepted():
    with pytest.raises(ValueError, match="'ftp://engine:8000' must start with http:// or https://"):
        EngineConfig(kind="vllm", urls=("ftp://engine:8000",))
    with pytest.raises(ValueError, match="must start with http:// or https://"):
        EngineConfig(kind="sglang", urls=("engine:8000",))
    secure = parse_url("https://engine/v1")
    assert (secure.port, secure.tls, secure.key, secure.host_header) == (443, True, ("engine", 443, True), "engine")
    assert parse_url("HTTPS://engine:8443").port == 8443 and not parse_url("http://engine:443").tls
    with pytest.raises(ValueError, match="no host"):
        parse_url("http:///generate")
    with pytest.raises(ValueError, match="credentials"):
        parse_url("http://user:pw@engine/")
    target = parse_url("http://[::1]:8000/v1/generate?x=1")
    assert (target.host, target.port, target.path) == ("::1", 8000, "/v1/generate?x=1")
    assert target.host_header == "[::1]:8000"
    assert parse_url("http://engine").port == 80


def test_closed_pool_refuses_and_header_injection_is_refused(server):
    async def scenario() -> None:
        pool = HttpPool(CONNECT_S)
        with pytest.raises(ValueError, match="line break"):
            await pool.post(server.url + "/echo", b"{}", {"X-Evil": "a\r\nHost: other"}, WAIT_S)
        await pool.aclose()
        with pytest.raises(HttpConnectionError, match="closed"):
            await pool.post(server.url + "/echo", b"{}", {}, WAIT_S)

    run(scenario())
    assert server.requests == []
