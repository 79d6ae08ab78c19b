"""A broker that does not answer an OPEN: the agent gets a 503 with Retry-After, in its dialect's error shape.

The worker's whole app (create_app, its lifespan: the real Backplane, the built-in tokenizer, the mock
engine) against a stand-in broker on port 0 that takes OPENs and never answers them, as a broker that is
down does; its hold bound (`--pause-hold-s`, the OPEN resent meanwhile) is shortened so the test does not
wait the real one. The OPEN that timed out is followed by an ABORT of the same turn, so a broker that gets
the OPEN late (it waited in the socket for the broker's return) leaves no turn in flight for a finish to
wait for. An agent that leaves while its OPEN is held ends the request at once, its turn aborted the same way.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from assets import wait_until
from starlette.testclient import TestClient

from broker import protocol
from gateway_workers.app import create_app
from gateway_workers.config import WorkerConfig
from gateway_workers.http.errors import BROKER_RETRY_AFTER_S

OPEN_BOUND_S = 0.3
HELD_S = 60.0  # far longer than the test waits: only the agent leaving ends the request
LEAVE_WITHIN_S = 10.0
POLL_MS = 50
SID = "unavailable-broker-session-xxxxxxxx"
USER = [{"role": "user", "content": "hello"}]


class SilentBroker:
    """A ROUTER that never answers OPENs and acknowledges ABORTs (so the worker's shutdown drain ends)."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.opened: list[str] = []
        self.aborted: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="silent-broker", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(POLL_MS):
                continue
            *envelope, frame = self.sock.recv_multipart()
            msg = protocol.decode_worker_to_broker(frame)
            if isinstance(msg, protocol.OpenTurn):
                self.opened.append(msg.turn_id)
            elif isinstance(msg, protocol.AbortTurn):
                self.aborted.append(msg.turn_id)
                reply = protocol.TurnAborted(msg.request_id, msg.turn_id)
                self.sock.send_multipart([*envelope, protocol.encode(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(linger=0)


@pytest.fixture(scope="module")
def silent_broker() -> Iterator[SilentBroker]:
    ctx = zmq.Context()
    broker = SilentBroker(ctx)
    yield broker
    broker.close()
    ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def http(silent_broker: SilentBroker) -> Iterator[TestClient]:
    """One worker app for the module: its start-up (tokenizer, render thread) is most of this module's time."""
    config = WorkerConfig(broker_endpoint=silent_broker.endpoint, commit_drain_s=2.0, pause_hold_s=OPEN_BOUND_S)
    with TestClient(create_app(config)) as client:
        yield client


def _chat(stream: bool) -> tuple[str, dict[str, Any], dict[str, str]]:
    body = {"model": "m", "messages": USER, "stream": stream}
    return "/v1/chat/completions", body, {"authorization": f"Bearer {SID}"}


def _messages(stream: bool) -> tuple[str, dict[str, Any], dict[str, str]]:
    body = {"model": "m", "max_tokens": 16, "messages": USER, "stream": stream}
    return "/v1/messages", body, {"x-api-key": SID}


def _responses(stream: bool) -> tuple[str, dict[str, Any], dict[str, str]]:
    body = {"model": "m", "input": "hello", "stream": stream}
    return "/v1/responses", body, {"authorization": f"Bearer {SID}"}


def _openai_shape(body: dict[str, Any]) -> bool:
    error = body["error"]
    return error["type"] == "api_error" and "broker is unavailable" in error["message"]


def _anthropic_shape(body: dict[str, Any]) -> bool:
    error = body["error"]
    return body["type"] == "error" and error["type"] == "overloaded_error" and "unavailable" in error["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize(
    ("request_of", "shape"),
    [(_chat, _openai_shape), (_messages, _anthropic_shape), (_responses, _openai_shape)],
    ids=["chat", "messages", "responses"],
)
def test_an_open_the_broker_does_not_answer_is_a_503_with_retry_after(http, silent_broker, request_of, shape, stream):
    path, body, headers = request_of(stream)
    silent_broker.opened.clear()
    silent_broker.aborted.clear()
    t0 = time.monotonic()
    reply = http.post(path, json=body, headers=headers)
    assert reply.status_code == 503, reply.text
    assert reply.headers["retry-after"] == str(BROKER_RETRY_AFTER_S)
    assert shape(reply.json()), reply.json()
    assert time.monotonic() - t0 >= OPEN_BOUND_S  # the OPEN had its whole bound first
    # the timed-out OPEN (one turn, however often it was sent) is followed by an ABORT of its turn
    assert len(set(silent_broker.opened)) == 1
    assert wait_until(lambda: silent_broker.aborted == silent_broker.opened[:1], timeout=5.0), silent_broker.aborted


def test_an_agent_that_leaves_while_its_open_is_held_ends_the_request_and_leaves_nothing_pending(silent_broker):
    config = WorkerConfig(broker_endpoint=silent_broker.endpoint, commit_drain_s=2.0, pause_hold_s=HELD_S)
    app = create_app(config)
    body = json.dumps({"model": "m", "messages": USER}).encode()
    headers = [(b"authorization", f"Bearer {SID}".encode()), (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]  # fmt: skip
    with TestClient(app) as client:
        silent_broker.opened.clear()
        silent_broker.aborted.clear()
        state = client.app_state.copy()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
                 "root_path": "", "query_string": b"", "headers": headers, "client": ("127.0.0.1", 1),
                 "server": ("127.0.0.1", 80), "state": state}  # fmt: skip
        sent: list[dict[str, Any]] = []
        requested = False

        async def receive() -> dict[str, Any]:
            nonlocal requested
            if not requested:
                requested = True
                return {"type": "http.request", "body": body, "more_body": False}
            while len(silent_broker.opened) < 2:  # held: its OPEN reached the (silent) broker, and was resent
                await asyncio.sleep(POLL_MS / 1000)
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        async def serve() -> float:
            t0 = time.monotonic()
            await asyncio.wait_for(app(scope, receive, send), LEAVE_WITHIN_S)
            return time.monotonic() - t0

        assert client.portal is not None
        assert client.portal.call(serve) < LEAVE_WITHIN_S
        assert sent and sent[0]["status"] == 499  # what uvicorn drops for an agent that is gone
        assert len(set(silent_broker.opened)) == 1
        assert wait_until(lambda: silent_broker.aborted == silent_broker.opened[:1], timeout=5.0), silent_broker.aborted
        backplane = state["pipeline"].backplane
        assert wait_until(lambda: not backplane._pending, timeout=5.0), backplane._pending  # the ABORT's answer too
