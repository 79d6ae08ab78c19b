"""serve's READY line: printed once a worker answers /healthz, whatever the probes before that raised.

A launcher (`trainer_client.launch_gateway`, a test, an operator's script) waits for that line; a probe
whose error ended the announcing thread left a healthy serve that never said so.
"""

from __future__ import annotations

import logging
import socket
import threading

import pytest

from gateway_workers import cli

NOT_HTTP = b"SSH-2.0-OpenSSH_9.6\r\n"  # http.client: BadStatusLine, which is no OSError
UNAVAILABLE = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"


def test_a_probe_answered_with_garbage_is_logged_and_asked_again_until_a_worker_is_healthy(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cli, "WORKERS_START_TIMEOUT_S", 10.0)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(5)  # where the probes stop early, the server ends too
    port = listener.getsockname()[1]

    def answer_in_turn() -> None:
        for answer in (NOT_HTTP, UNAVAILABLE, OK):
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(answer)

    server = threading.Thread(target=answer_in_turn)
    server.start()
    try:
        with caplog.at_level(logging.ERROR, logger=cli.logger.name):
            cli._announce_when_healthy(f"http://127.0.0.1:{port}", "tcp://127.0.0.1:5555")
    finally:
        server.join(10)
        listener.close()
    assert not server.is_alive()
    assert capsys.readouterr().out == f"GATEWAY READY base_url=http://127.0.0.1:{port}/v1 control=tcp://127.0.0.1:5555\n"
    assert [r.getMessage() for r in caplog.records] == [f"asking http://127.0.0.1:{port}/healthz failed; asking again"]
