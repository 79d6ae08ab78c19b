"""The engines' HTTP client over TLS (https:// engine URLs) against a real local TLS server.

The server is test_http_client.py's scripted TinyServer speaking TLS with a certificate that a
throwaway CA (trustme) issues at test time; the client trusts that CA through `--engine-ca-file`
(EngineConfig.ca_file), never through a switch that skips verification. Each scenario runs on
asyncio's own event loop and on uvloop (what the workers run): their TLS layers are separate code.
Covered: requests, SSE streams and keep-alive reuse, refused certificates (unknown CA, wrong host)
as a prompt EngineError, handshakes that never finish, idle connections the server closed, the
reset-retry, deadlines, cancellation, and the CA file from the CLI flag or env through to a request.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import trustme
import uvloop
from component.test_http_client import WAIT_S, TinyServer

from gateway_workers import cli
from gateway_workers.config import WorkerConfig
from gateway_workers.engines import create_engine
from gateway_workers.engines.base import EngineError, EngineTimeout
from gateway_workers.engines.config import ENGINE_CA_FILE_ENV, EngineConfig
from gateway_workers.engines.http.client import HttpPool, tls_context
from gateway_workers.engines.vllm import VllmEngine

# Loop timers have millisecond resolution (uvloop rounds them): a deadline may fire up to a millisecond early.
TIMER_SLACK_S = 0.005

TEST_DEADLINE_S = 10.0  # bound on each scenario
CONNECT_S = 2.0
REFUSAL_BOUND_S = 2.0  # a refused certificate must fail about as fast as a handshake, never wait for a timeout

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def ca_file(ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tls") / "engine-ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return str(path)


def server_context(ca: trustme.CA, *names: str) -> ssl.SSLContext:
    """A TLS server context with a certificate `ca` issued for `names` (host names or IP addresses)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(*names).configure_cert(context)
    context.set_alpn_protocols(["http/1.1"])
    return context


@pytest.fixture
def tls_server(ca: trustme.CA) -> Iterator[TinyServer]:
    srv = TinyServer(tls=server_context(ca, "127.0.0.1", "localhost"))
    yield srv
    srv.stop()


@pytest.fixture(params=sorted(LOOPS))
def run(request: pytest.FixtureRequest) -> Callable[[Awaitable[Any]], Any]:
    """Runs a scenario to completion, bounded, on the parametrized event loop; the loop is closed after."""

    def runner(scenario: Awaitable[Any]) -> Any:
        loop = LOOPS[request.param]()
        try:
            return loop.run_until_complete(asyncio.wait_for(scenario, TEST_DEADLINE_S))
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    return runner


def engine(url: str, ca_file: str | None, **overrides: Any) -> VllmEngine:
    return VllmEngine(EngineConfig(kind="vllm", urls=(url,), ca_file=ca_file, **overrides))


def test_requests_and_an_sse_stream_share_one_verified_connection(tls_server, ca_file, run):
    async def scenario() -> tuple[list[Any], list[Any], Any]:
        eng = engine(tls_server.url, ca_file)
        try:
            answers = [await eng.post_json(tls_server.url + "/echo", {"i": i}, {}) for i in range(3)]
            events = [e async for e in eng.stream_json(tls_server.url + "/sse", {"s": 1}, {})]
            after = await eng.post_json(tls_server.url + "/echo", {"i": 3}, {})
            assert eng.pool().connections() == 1
            return answers, events, after
        finally:
            await eng.aclose()

    answers, events, after = run(scenario())
    assert [a["body"] for a in answers] == [{"i": 0}, {"i": 1}, {"i": 2}] and after["body"] == {"i": 3}
    assert events == [{"n": 0}, {"n": 1}, {"n": 2}, {"big": "y" * 300_000}]
    assert {a["conn"] for a in [*answers, after]} == {1} and tls_server.connections == 1
    assert answers[0]["headers"]["host"] == f"127.0.0.1:{tls_server.port}"
    assert tls_server.handshakes == [("TLSv1.3", "http/1.1")]  # negotiated TLS, and HTTP/1.1 said explicitly
    assert tls_server.wait_for(lambda: tls_server.disconnects == 1)  # aclose closed it


def test_host_name_is_verified_and_sent(ca, ca_file, run):
    """A certificate for `localhost` verifies for https://localhost; `Host` keeps the URL's name and port."""
    names: list[str | None] = []
    context = server_context(ca, "localhost")
    context.sni_callback = lambda _sock, name, _ctx: names.append(name)  # type: ignore[assignment,misc,return-value]
    srv = TinyServer(tls=context)
    url = f"https://localhost:{srv.port}"

    async def scenario() -> Any:
        eng = engine(url, ca_file)
        try:
            return await eng.post_json(url + "/echo", {"x": 1}, {})
        finally:
            await eng.aclose()

    try:
        answer = run(scenario())
    finally:
        srv.stop()
    assert answer["body"] == {"x": 1} and answer["headers"]["host"] == f"localhost:{srv.port}"
    assert names == ["localhost"]  # SNI: a TLS-terminating proxy picks the engine's certificate by it


@pytest.mark.parametrize("trusted", ["system CAs", "another CA"])
def test_a_certificate_from_an_unknown_ca_is_a_prompt_engine_error(tls_server, trusted, tmp_path, run):
    other = None
    if trusted == "another CA":
        other = str(tmp_path / "other-ca.pem")
        trustme.CA().cert_pem.write_to_path(other)

    async def scenario() -> float:
        eng = engine(tls_server.url, other)
        started = time.monotonic()
        try:
            with pytest.raises(EngineError, match=r"certificate of 127\.0\.0\.1:\d+ is not trusted.*--engine-ca-file"):
                await eng.post_json(tls_server.url + "/echo", {}, {})
            with pytest.raises(EngineError, match="not trusted"):  # a stream fails the same way
                [e async for e in eng.stream_json(tls_server.url + "/sse", {}, {})]
            assert eng.pool().connections() == 0
            return time.monotonic() - started
        finally:
            await eng.aclose()

    took = run(scenario())
    assert took < REFUSAL_BOUND_S and tls_server.requests == []
    # Both attempts ended in the handshake (asyncio drops the connection without sending its alert).
    assert tls_server.wait_for(lambda: len(tls_server.handshake_errors) == 2) and tls_server.handshakes == []


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_a_certificate_for_another_host_is_refused(ca, ca_file, host, run):
    srv = TinyServer(tls=server_context(ca, "engine.example"))
    url = f"https://{host}:{srv.port}"

    async def scenario() -> None:
        eng = engine(url, ca_file)
        try:
            with pytest.raises(EngineError, match="not trusted.*mismatch.*host name or IP address"):
                await eng.post_json(url + "/echo", {}, {})
        finally:
            await eng.aclose()

    try:
        run(scenario())
    finally:
        srv.stop()
    assert srv.requests == []


async def _answer_in_plain_text(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """What an HTTP server (uvicorn) does with a TLS hello: a plain-text 400, then close."""
    await reader.read(1)
    writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    await writer.drain()
    writer.close()


def test_https_to_a_server_without_tls_is_a_timeout_or_a_tls_error_never_a_hang(run):
    silent = TinyServer()  # a plain HTTP server reading the hello as a request head that never ends
    connect_s = 0.3

    async def scenario() -> float:
        eng = engine(f"https://127.0.0.1:{silent.port}", None, connect_timeout_s=connect_s)
        started = time.monotonic()
        try:
            with pytest.raises(EngineTimeout):
                await eng.post_json(f"https://127.0.0.1:{silent.port}/echo", {}, {})
            took = time.monotonic() - started
        finally:
            await eng.aclose()
        plain = await asyncio.start_server(_answer_in_plain_text, "127.0.0.1", 0)
        url = f"https://127.0.0.1:{plain.sockets[0].getsockname()[1]}"
        eng = engine(url, None)
        try:
            with pytest.raises(EngineError, match=r"TLS handshake with 127\.0\.0\.1:\d+ failed"):
                await eng.post_json(url + "/echo", {}, {})
        finally:
            await eng.aclose()
            plain.close()
            await plain.wait_closed()
        return took

    try:
        took = run(scenario())
    finally:
        silent.stop()
    assert connect_s - TIMER_SLACK_S <= took < connect_s + 1.0  # the connect bound covers the handshake


def test_server_closing_idle_connections_and_the_reset_retry(tls_server, ca_file, run):
    """A pooled TLS connection the server closed is dropped before writing; a reset request is retried once."""
    port = tls_server.port

    async def scenario() -> None:
        eng = engine(tls_server.url, ca_file)
        try:
            await eng.post_json(tls_server.url + "/rst-next", {"i": 1}, {})
            answer = await eng.post_json(tls_server.url + "/echo", {"i": 2}, {})  # written to conn 1, reset unread
            assert answer["conn"] == 2 and answer["body"] == {"i": 2}
            tls_server.stop()
            # The loop is held still while the FIN arrives: only the kernel knows the connection died.
            time.sleep(0.1)
            again = TinyServer(port, tls=tls_server.tls)
            try:
                assert (await eng.post_json(again.url + "/echo", {"i": 3}, {}))["body"] == {"i": 3}
                assert [r[2] for r in again.requests] == [b'{"i":3}'] and again.connections == 1
            finally:
                again.stop()
        finally:
            await eng.aclose()

    run(scenario())
    assert [(r[0], r[1]) for r in tls_server.requests] == [(1, "/rst-next"), (2, "/echo")]  # processed once


def test_deadline_and_cancel_close_the_tls_connection(tls_server, ca_file, run):
    bound = 0.3

    async def scenario() -> tuple[float, int]:
        eng = engine(tls_server.url, ca_file, request_timeout_s=bound)
        try:
            started = time.monotonic()
            with pytest.raises(EngineTimeout, match=f"within {bound}s"):
                await eng.post_json(tls_server.url + "/hang", {}, {})
            took = time.monotonic() - started
            assert await asyncio.to_thread(tls_server.wait_for, lambda: tls_server.disconnects == 1)
            task = asyncio.create_task(eng.post_json(tls_server.url + "/hang", {}, {}, timeout=WAIT_S * 10))
            assert await asyncio.to_thread(tls_server.wait_for, lambda: len(tls_server.requests) == 2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await asyncio.to_thread(tls_server.wait_for, lambda: tls_server.disconnects == 2)
            return took, eng.pool().connections()
        finally:
            await eng.aclose()

    took, connections = run(scenario())
    assert bound - TIMER_SLACK_S <= took < bound + 1.0 and connections == 0


def test_closing_the_pool_ends_a_tls_shutdown_the_server_never_answers(tls_server, ca_file, run):
    """After `Connection: close` our TLS close waits for the server's close_notify; aclose must not."""

    async def scenario() -> None:
        pool = HttpPool(CONNECT_S, tls=tls_context(ca_file))
        status, _ = await pool.post(tls_server.url + "/close-linger", b"{}", {}, WAIT_S)
        assert status == 200 and pool.connections() == 1  # closing: sent close_notify, waiting for the server's
        started = time.monotonic()
        await pool.aclose()
        assert time.monotonic() - started < 0.5 and pool.connections() == 0

    run(scenario())
    assert tls_server.wait_for(lambda: tls_server.disconnects == 1)


def test_ca_file_from_the_cli_flag_or_env_reaches_the_engine_client(tls_server, ca_file, monkeypatch, run):
    monkeypatch.delenv(ENGINE_CA_FILE_ENV, raising=False)
    base = ["serve", "--engine-kind", "vllm", "--engine-url", tls_server.url]

    def through_workers(argv: list[str]) -> EngineConfig:
        """The flags as a spawned worker sees them: WorkerConfig through its environment variable."""
        worker = cli._settings(cli._parser().parse_args(argv))[0].worker
        config = replace(worker, engine=replace(worker.engine, ca_file=cli._engine_ca_file(worker.engine)))
        for name, value in config.to_env().items():
            monkeypatch.setenv(name, value)
        return WorkerConfig.from_env().engine

    from_flag = through_workers([*base, "--engine-ca-file", ca_file])
    monkeypatch.setenv(ENGINE_CA_FILE_ENV, ca_file)
    from_env = through_workers(base)
    assert from_flag.ca_file == from_env.ca_file == str(Path(ca_file).resolve())
    monkeypatch.delenv(ENGINE_CA_FILE_ENV)
    assert through_workers(base).ca_file is None

    async def scenario() -> Any:
        eng = create_engine(from_flag, tokenizer=None)
        try:
            return await eng.post_json(tls_server.url + "/echo", {"via": "cli"}, {})  # type: ignore[attr-defined]
        finally:
            await eng.aclose()

    assert run(scenario())["body"] == {"via": "cli"}
    with pytest.raises(SystemExit, match="engine CA file .*missing.pem.* cannot be loaded"):
        through_workers([*base, "--engine-ca-file", "missing.pem"])
    with pytest.raises(SystemExit, match="must start with http:// or https://"):
        through_workers([*base[:-1], "ws://engine:1"])
