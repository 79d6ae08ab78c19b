"""Retry-safe turns through a real `serve` (2 workers) on the fake engine: replayed, coalesced, resampled.

A request carrying `x-stainless-retry-count >= 1` or an `Idempotency-Key`, with the body of an earlier
request of its session, gets that request's recorded reply again (same id, same content, streamed if
asked) and the engine samples nothing; while the earlier turn is still generating the retry waits for
it; an earlier turn that was aborted is sampled afresh; a first attempt (count 0) or a request with
neither header is always a new sample. The official OpenAI SDK (retries on) rides through a reply lost
on its way (a proxy drops it after the gateway sent it): the agent gets the recorded reply and the
session holds one turn, checked against the engine's own log.
"""

from __future__ import annotations

import re
import socket
import threading
from typing import Any

import httpx
import openai
import pytest
from assets import TOOLS, wait_until

from gateway_workers.engines.routing import routing_key

CHAT = "/chat/completions"
BODIES: dict[str, dict[str, Any]] = {
    "/chat/completions": {"model": "qwen3", "messages": [{"role": "user", "content": "tell me a story"}]},
    "/messages": {"model": "qwen3", "max_tokens": 64, "messages": [{"role": "user", "content": "tell me a story"}]},
    "/responses": {"model": "qwen3", "input": "tell me a story"},
}
_TIMES = re.compile(rb'"(?:created|created_at|completed_at)":\s*\d+')  # the reply's own clock: a replay is answered now


def _post(gw, key: str, path: str, body: dict[str, Any], headers: dict[str, str], timeout: float = 30.0) -> bytes:
    auth = {"authorization": f"Bearer {key}", "x-api-key": key}
    response = httpx.post(gw.base_url + path, json=body, headers={**auth, **headers}, timeout=timeout)
    assert response.status_code == 200, response.text
    return _TIMES.sub(b"", response.content)


_TEXT_KEYS = rb"content|text|thinking|reasoning_content|delta|partial_json|arguments"
_STRINGS = re.compile(rb'"(?:' + _TEXT_KEYS + rb')":"((?:[^"\\]|\\.)*)"')


def _ids(sse: bytes) -> set[bytes]:
    return set(re.findall(rb'"id":"([^"]+)"', sse))


def _text(sse: bytes) -> bytes:
    """Every text a stream carries, joined in order: what the agent assembles, whatever the chunking."""
    return b"".join(_STRINGS.findall(sse))


def _engine_requests(engine, key: str) -> int:
    return len(engine.log(routing_key(key))["requests"])


def _trained_turns(gw, key: str) -> list[str]:
    return [turn_id for row in gw.client.finish_session(key, wait_timeout=10) for turn_id in row.metadata["turn_ids"]]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", list(BODIES))
def test_a_retry_of_a_recorded_request_gets_the_same_reply_and_samples_nothing(dialect_gateway, dialect_engine,
                                                                               path, stream):
    gw = dialect_gateway
    key = gw.client.open_session()
    body = {**BODIES[path], "stream": stream}
    first = _post(gw, key, path, body, {"x-stainless-retry-count": "0"})
    again = _post(gw, key, path, body, {"x-stainless-retry-count": "1"})
    if stream:  # the same ids and text; the replay sends each part whole, where the first attempt sent tokens
        assert _ids(again) == _ids(first) and _text(again) == _text(first)
    else:
        assert again == first
    assert _engine_requests(dialect_engine, key) == 1
    (turn_id,) = _trained_turns(gw, key)
    assert turn_id.encode() in first


def test_a_streamed_retry_replays_tool_calls_with_their_ids(dialect_gateway, dialect_engine):
    gw = dialect_gateway
    key = gw.client.open_session()
    body = {**BODIES[CHAT], "tools": TOOLS, "stream": True}
    first = _post(gw, key, CHAT, body, {"x-stainless-retry-count": "0"})
    again = _post(gw, key, CHAT, body, {"x-stainless-retry-count": "1"})
    assert b'"tool_calls"' in first  # the fake engine calls a tool when tools are offered
    assert _ids(again) == _ids(first) and _text(again) == _text(first)  # call ids derive from the turn id
    assert _engine_requests(dialect_engine, key) == 1


def test_first_attempts_and_requests_without_a_signal_are_new_samples(dialect_gateway, dialect_engine):
    gw = dialect_gateway
    key = gw.client.open_session()
    body = BODIES[CHAT]
    replies = [_post(gw, key, CHAT, body, headers) for headers in ({"x-stainless-retry-count": "0"}, {},
                                                                  {"x-stainless-retry-count": "0"})]
    assert len({re.search(rb'"id":"([^"]+)"', r).group(1) for r in replies}) == 3
    assert _engine_requests(dialect_engine, key) == 3
    assert len(_trained_turns(gw, key)) == 3


def test_an_idempotency_key_replays_its_request_and_another_key_samples(dialect_gateway, dialect_engine):
    gw = dialect_gateway
    key = gw.client.open_session()
    body = BODIES[CHAT]
    first = _post(gw, key, CHAT, body, {"idempotency-key": "job-1"})
    assert _post(gw, key, CHAT, body, {"idempotency-key": "job-1"}) == first
    assert _post(gw, key, CHAT, body, {"idempotency-key": "job-2"}) != first
    assert _engine_requests(dialect_engine, key) == 2


def test_a_retry_while_the_first_attempt_generates_waits_for_its_reply(dialect_gateway, dialect_engine):
    gw = dialect_gateway
    key = gw.client.open_session()
    dialect_engine.configure(fault={"key": routing_key(key), "delay": 1.5, "times": 1})
    body = BODIES[CHAT]
    replies: list[bytes] = []
    first_attempt = {"x-stainless-retry-count": "0"}
    first = threading.Thread(target=lambda: replies.append(_post(gw, key, CHAT, body, first_attempt)))
    first.start()
    assert wait_until(lambda: _engine_requests(dialect_engine, key) == 1, timeout=10)
    again = _post(gw, key, CHAT, body, {"x-stainless-retry-count": "1"})  # coalesced: waits for the first
    first.join(30)
    assert replies == [again]
    assert _engine_requests(dialect_engine, key) == 1
    assert len(_trained_turns(gw, key)) == 1


def test_a_retry_of_an_aborted_attempt_is_sampled_afresh(dialect_gateway, dialect_engine):
    gw = dialect_gateway
    key = gw.client.open_session()
    dialect_engine.configure(fault={"key": routing_key(key), "delay": 3.0, "times": 1})
    body = BODIES[CHAT]
    with pytest.raises(httpx.ReadTimeout):  # the agent gives up: the gateway aborts the turn
        _post(gw, key, CHAT, body, {"x-stainless-retry-count": "0"}, timeout=0.5)
    assert wait_until(lambda: gw.client.stats()["turns_aborted"] >= 1 and not gw.client.stats()["turns_in_flight"],
                      timeout=10)
    again = _post(gw, key, CHAT, body, {"x-stainless-retry-count": "1"})
    assert _engine_requests(dialect_engine, key) == 2
    (turn_id,) = _trained_turns(gw, key)  # only the retry's turn: the agent never saw the first
    assert turn_id.encode() in again


class ReplyDroppingProxy:
    """A TCP proxy to the gateway that lets the first request through, reads its whole reply and drops it
    (closes the agent's connection instead): a reply lost on its way, after the gateway sent it."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.dropped = 0
        self._threads: list[threading.Thread] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                agent, _ = self.listener.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(agent,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, agent: socket.socket) -> None:
        drop = self.dropped == 0
        self.dropped += drop
        with agent, socket.create_connection(self.target) as gateway:
            agent.settimeout(30)
            gateway.settimeout(30)
            threading.Thread(target=_pump, args=(agent, gateway), daemon=True).start()  # the request, however split
            # The agent asks to close after the reply (Connection: close), so the gateway's EOF ends it; a dropped
            # reply was sent whole (the gateway commits its turn), and the agent gets nothing of it.
            try:
                while chunk := gateway.recv(1 << 16):
                    if not drop:
                        agent.sendall(chunk)
            except OSError:
                pass  # either side gave up: the exchange is over (an error here would surface in a later test)

    def close(self) -> None:
        self.listener.close()
        for thread in self._threads:
            thread.join(35)  # past the sockets' 30 s timeouts


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while chunk := source.recv(1 << 16):
            sink.sendall(chunk)
    except OSError:
        pass  # either side closed: the exchange is over


def test_the_openai_sdk_rides_through_a_lost_reply_and_is_trained_once(dialect_gateway, dialect_engine):
    gw = dialect_gateway
    key = gw.client.open_session()
    url = httpx.URL(gw.base_url)
    proxy = ReplyDroppingProxy((url.host, url.port))
    try:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{proxy.port}/v1", api_key=key, max_retries=2, timeout=30,
                           http_client=httpx.Client(headers={"connection": "close"})) as agent:
            reply = agent.chat.completions.create(model="qwen3", messages=BODIES[CHAT]["messages"])
    finally:
        proxy.close()
    assert proxy.dropped == 1
    assert _engine_requests(dialect_engine, key) == 1  # the SDK's resend was answered from the record
    assert wait_until(lambda: gw.client.stats()["turns_in_flight"] == 0, timeout=10)
    assert _trained_turns(gw, key) == [reply.id.removeprefix("chatcmpl-")]
