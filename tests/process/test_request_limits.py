"""Request limits on a real `serve` (2 workers, mock engine): oversized bodies, headers and shapes get a fast 4xx.

Raw sockets send what no SDK would (a 1 GiB Content-Length, a body that keeps coming, a 200 KB
header); the official SDKs send the shape violations. Every refusal is in the dialect's error shape,
records nothing (the session finishes with no rows), and the workers keep serving everyone else.
"""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import anthropic
import openai
import pytest
from processes import launch_gateway

BODY_LIMIT = 1 << 20
LIMITS = ["--max-body-bytes", str(BODY_LIMIT), "--max-messages", "64", "--max-tools", "8",
          "--max-content-parts", "16", "--max-string-chars", "100000", "--max-json-depth", "16"]
REFUSE_WITHIN_S = 0.1
SOCKET_TIMEOUT_S = 10.0
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def gateway() -> Iterator[Any]:
    with launch_gateway(workers=2, engine_kind="mock", extra_args=[*LIMITS, "--log-level", "warning"]) as gw:
        yield gw


def _address(gateway: Any) -> tuple[str, int]:
    url = urlparse(gateway.base_url)
    return url.hostname, url.port


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of one HTTP/1.1 response; reads until the server closes or the body is complete."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, headers, body


def _closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(SOCKET_TIMEOUT_S)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


def _post_head(path: str, key: str, extra: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: gateway\r\nauthorization: Bearer {key}\r\n"
            f"content-type: application/json\r\n{extra}\r\n").encode()


def _chat(gateway: Any, sid: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=sid, max_retries=2, timeout=30)


def _still_serving(gateway: Any) -> None:
    sid = gateway.client.open_session()
    with _chat(gateway, sid) as client:  # closed: an SDK client left to the GC warns of its open socket
        reply = client.chat.completions.create(model="m", messages=USER, max_tokens=8)
    assert reply.choices[0].message is not None
    assert len(gateway.client.finish_session(sid, reward=0.0, wait_timeout=5.0)) == 1


def test_a_declared_1_gib_body_is_refused_before_it_is_read(gateway):
    sid = gateway.client.open_session()
    with socket.create_connection(_address(gateway), timeout=SOCKET_TIMEOUT_S) as sock:
        started = time.perf_counter()
        sock.sendall(_post_head("/v1/chat/completions", sid, f"content-length: {1 << 30}\r\n") + b'{"messages": [')
        status, headers, body = _read_response(sock)
        elapsed = time.perf_counter() - started
        assert status == 413 and headers.get("connection") == "close"
        error = json.loads(body)["error"]
        assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
        assert _closed_by_server(sock)
    assert elapsed < REFUSE_WITHIN_S, f"413 took {elapsed * 1000:.1f} ms"
    assert gateway.client.finish_session(sid, wait_timeout=1.0) == []
    _still_serving(gateway)


def test_a_chunked_body_is_cut_off_once_it_outgrows_the_limit(gateway):
    sid = gateway.client.open_session()
    chunk = b" " * 65536
    with socket.create_connection(_address(gateway), timeout=SOCKET_TIMEOUT_S) as sock:
        sock.sendall(_post_head("/v1/messages", sid, "transfer-encoding: chunked\r\n"))
        sent = 0
        # keep sending well past the limit: the answer must come while the body is still arriving
        while sent < 64 * BODY_LIMIT and not select.select([sock], [], [], 0)[0]:
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(chunk)
        status, _, body = _read_response(sock)
    assert status == 413
    error = json.loads(body)
    assert error["type"] == "error" and error["error"]["type"] == "request_too_large"
    assert sent < 8 * BODY_LIMIT, f"the gateway read {sent} bytes before refusing"
    assert gateway.client.finish_session(sid, wait_timeout=1.0) == []
    _still_serving(gateway)


def test_oversized_headers_get_a_431(gateway):
    sid = gateway.client.open_session()
    body = json.dumps({"model": "m", "messages": USER}).encode()
    extra = f"content-length: {len(body)}\r\nx-padding: {'a' * 200_000}\r\n"
    with socket.create_connection(_address(gateway), timeout=SOCKET_TIMEOUT_S) as sock:
        sock.sendall(_post_head("/v1/chat/completions", sid, extra) + body)
        status, _, reply = _read_response(sock)
    assert status == 431
    assert json.loads(reply)["error"]["code"] == "request_header_fields_too_large"
    assert gateway.client.finish_session(sid, wait_timeout=1.0) == []
    _still_serving(gateway)


def _deep(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"x": value}}
    return value


def _tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


SHAPES = {
    "messages": ({"messages": USER * 65}, "array_above_max_length", "messages"),
    "tools": ({"messages": USER, "tools": [_tool(f"t{i}", {"type": "object"}) for i in range(9)]},
              "array_above_max_length", "tools"),
    "parts": ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 17}]},
              "array_above_max_length", "messages"),
    "string": ({"messages": [{"role": "user", "content": "x" * 100_001}]}, "string_above_max_length",
               "messages.[0].content"),
    "schema_depth": ({"messages": USER, "tools": [_tool("deep", _deep(20))]}, "nested_too_deep", "tools"),
    "arguments_depth": (
        {"messages": [*USER, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps(_deep(20))}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]},
        "nested_too_deep", "messages"),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_shape_limits_are_400s_that_name_the_field(gateway, name):
    body, code, param = SHAPES[name]
    sid = gateway.client.open_session()
    with _chat(gateway, sid) as client, pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", max_tokens=8, **body)
    error = info.value.body
    assert error["code"] == code and error["param"] == param
    assert gateway.client.finish_session(sid, wait_timeout=1.0) == []


def test_a_refused_string_stays_refused_in_the_requests_that_extend_its_body(gateway):
    """Workers decode a body by what it adds to the session's previous one; a body refused for a long string
    is not one a later body may share unchecked. One connection, so every attempt reaches one worker."""
    sid = gateway.client.open_session()
    history = [*USER, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "go on"}]
    with _chat(gateway, sid) as client:
        for n in (1, 3):  # the worker learns where the history ends in this session's bodies
            client.chat.completions.create(model="m", max_tokens=8, messages=history[:n])
        long = [*history, {"role": "assistant", "content": "x" * 100_001}]
        for messages in (long, [*long, {"role": "user", "content": "and?"}]):
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(model="m", max_tokens=8, messages=messages)
            assert info.value.body["code"] == "string_above_max_length"
            assert info.value.body["param"] == "messages.[3].content"
    records = gateway.client.finish_session(sid, wait_timeout=5.0)
    assert len({turn for record in records for turn in record.metadata["turn_ids"]}) == 2  # the refused: none


def test_anthropic_limits_use_its_own_error_shape(gateway):
    sid = gateway.client.open_session()
    client = anthropic.Anthropic(base_url=gateway.base_url.removesuffix("/v1"), api_key=sid, max_retries=2)
    with client, pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="m", max_tokens=8, messages=USER * 65)
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"
    assert "at most 64" in info.value.body["error"]["message"]
    assert gateway.client.finish_session(sid, wait_timeout=1.0) == []


def test_the_model_context_window_bounds_sessions_without_a_smaller_budget():
    """`--max-context-tokens`: the budget of sessions that set none (or more), applied like their own."""
    with launch_gateway(workers=1, engine_kind="mock", extra_args=["--max-context-tokens", "64"]) as gw:
        medium = [{"role": "user", "content": "a few words more " * 8}]  # ~40 tokens rendered
        huge = [{"role": "user", "content": "many words in a row " * 250_000}]  # 5 MB: over by its size
        unbounded, generous, tight = (gw.client.open_session(max_context_tokens=n) for n in (None, 10**6, 16))
        for sid, messages, fits in ((unbounded, medium, True), (generous, medium, True), (tight, medium, False),
                                    (unbounded, huge, False)):
            with _chat(gw, sid) as agent:
                started = time.monotonic()
                reply = agent.chat.completions.create(model="qwen3", messages=messages, max_tokens=8)
            sampled = reply.usage.completion_tokens
            assert (sampled > 0) == fits and (fits or reply.choices[0].finish_reason == "length"), (sid, sampled)
            assert time.monotonic() - started < 5.0
