"""Bad requests against one real `serve` (2 workers, mock engine, the corpus' small limits), over raw HTTP.

The whole corpus (`tests/bad_requests.py`) goes through httpx without retries, each on a connection
of its own: every entry gets its status and code in its dialect's error JSON, within a bound, and
none is recorded. Then Hypothesis fuzzes the HTTP layer: random bytes as a body, valid bodies cut
short, bodies in the wrong content type, bodies that arrive slowly in pieces (while another agent is
served), and bodies shorter than their Content-Length before the agent hangs up. Never a 5xx, never
a connection dropped where a reply is due, never a traceback in the gateway's log, never a recorded
turn, and the workers keep serving good requests of all three dialects.
"""

from __future__ import annotations

import json
import random
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlencode, urlparse

import httpx
import orjson
import pytest
from bad_requests import CORPUS, GOOD, LIMIT_FLAGS, PATHS, mismatch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from processes import launch_gateway

REPLY_WITHIN_S = 5.0  # a 4xx takes milliseconds; anything near this bound is a hang
HEALTH_WITHIN_S = 1.0
SOCKET_TIMEOUT_S = 10.0
DIALECTS = list(PATHS)
HTTP_FUZZ = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
LOG_PROBLEMS = ("Traceback", "Exception in ASGI", "turn failed", "Internal Server Error")


@pytest.fixture(scope="module")
def gateway() -> Iterator[Any]:
    with launch_gateway(workers=2, engine_kind="mock", extra_args=[*LIMIT_FLAGS, "--log-level", "warning"]) as gw:
        yield gw


@pytest.fixture()
def http(gateway: Any) -> Iterator[httpx.Client]:
    root = gateway.base_url.removesuffix("/v1")
    with httpx.Client(base_url=root, timeout=REPLY_WITHIN_S, transport=httpx.HTTPTransport(retries=0)) as client:
        yield client


@pytest.fixture()
def quiet_log(gateway: Any) -> Iterator[None]:
    """The gateway logs nothing alarming while the test runs (a 5xx is always logged with its cause)."""
    before = len(gateway.output)
    yield
    time.sleep(0.2)  # the log lines of the last requests
    lines = list(gateway.output)[before:]
    problems = [line for line in lines if any(p in line for p in LOG_PROBLEMS)]
    assert not problems, "".join(lines[-80:])


def _headers(sid: str, dialect: str, content_type: str | None = "application/json") -> dict[str, str]:
    # a connection per request, so the corpus is spread over both workers
    headers = {"connection": "close"}
    if dialect == "messages":
        headers.update({"x-api-key": sid, "anthropic-version": "2023-06-01"})
    else:
        headers["authorization"] = f"Bearer {sid}"
    if content_type is not None:
        headers["content-type"] = content_type
    return headers


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


def _assert_error_reply(dialect: str, response: httpx.Response) -> None:
    """A 4xx in the dialect's own error JSON."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    error = _json(response)
    assert isinstance(error, dict) and isinstance(error.get("error"), dict), response.text[:300]
    assert isinstance(error["error"].get("message"), str)
    if dialect == "messages":
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    else:
        assert error["error"]["type"] == "invalid_request_error"


def _nothing_recorded(gateway: Any, sid: str) -> None:
    assert gateway.client.finish_session(sid, wait_timeout=2.0) == []


def _still_serving(gateway: Any, http: httpx.Client) -> None:
    """Good requests of every dialect still get their reply, and each is recorded once."""
    sid = gateway.client.open_session()
    for dialect in DIALECTS:
        for body in GOOD[dialect][:2]:
            response = http.post(PATHS[dialect], content=orjson.dumps(body), headers=_headers(sid, dialect))
            assert response.status_code == 200, (dialect, response.text[:300])
    assert len(gateway.client.finish_session(sid, reward=0.0, wait_timeout=5.0)) == 2 * len(DIALECTS)


def test_the_whole_corpus_gets_its_answers_fast_and_records_nothing(gateway, http, quiet_log):
    sid = gateway.client.open_session()
    failures, slowest = [], (0.0, "")
    for entry in CORPUS:
        started = time.perf_counter()
        response = http.post(PATHS[entry.dialect], content=orjson.dumps(entry.body),
                             headers=_headers(sid, entry.dialect))
        elapsed = time.perf_counter() - started
        slowest = max(slowest, (elapsed, entry.name))
        problem = mismatch(entry, response.status_code, _json(response))
        if problem is not None:
            failures.append(f"{entry.name}: {problem}")
    assert not failures, f"{len(failures)} of {len(CORPUS)} wrong:\n" + "\n".join(failures)
    assert slowest[0] < REPLY_WITHIN_S / 2, f"{slowest[1]} took {slowest[0]:.2f} s"
    _nothing_recorded(gateway, sid)
    _still_serving(gateway, http)


def test_random_bytes_truncated_bodies_and_wrong_content_types_get_a_4xx(gateway, http, quiet_log):
    sid = gateway.client.open_session()
    goods = [(dialect, orjson.dumps(body)) for dialect in DIALECTS for body in GOOD[dialect]]

    @settings(HTTP_FUZZ, max_examples=90)
    @given(dialect=st.sampled_from(DIALECTS), body=st.binary(max_size=512))
    def random_bytes(dialect: str, body: bytes) -> None:
        _assert_error_reply(dialect, http.post(PATHS[dialect], content=body, headers=_headers(sid, dialect)))

    @settings(HTTP_FUZZ, max_examples=60)
    @given(good=st.sampled_from(goods), cut=st.floats(0.0, 1.0, exclude_max=True))
    def truncated(good: tuple[str, bytes], cut: float) -> None:
        dialect, body = good
        response = http.post(PATHS[dialect], content=body[: int(len(body) * cut)], headers=_headers(sid, dialect))
        assert response.status_code == 400
        _assert_error_reply(dialect, response)

    content_types = [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=b",
                     "application/xml", "application/json; charset=utf-16", "image/png", "*/*", "application/jsonl"]

    @settings(HTTP_FUZZ, max_examples=60)
    @given(good=st.sampled_from(goods), content_type=st.sampled_from(content_types),
           shape=st.sampled_from(["form", "multipart", "utf-16", "bytes"]), noise=st.binary(max_size=64))
    def wrong_type(good: tuple[str, bytes], content_type: str | None, shape: str, noise: bytes) -> None:
        # a body as that content type would carry it: never JSON the gateway can take
        dialect, body = good
        payload = {
            "form": urlencode({"body": body.decode()}).encode(),
            "multipart": b"--b\r\ncontent-disposition: form-data; name=\"body\"\r\n\r\n" + body + b"\r\n--b--\r\n",
            "utf-16": body.decode().encode("utf-16"),
            "bytes": b"\x89PNG\r\n\x1a\n" + noise,
        }[shape]
        response = http.post(PATHS[dialect], content=payload, headers=_headers(sid, dialect, content_type))
        _assert_error_reply(dialect, response)

    random_bytes()
    truncated()
    wrong_type()
    _nothing_recorded(gateway, sid)
    _still_serving(gateway, http)


# --- raw sockets: slow bodies and bodies cut off ---------------------------------------------------


def _address(gateway: Any) -> tuple[str, int]:
    url = urlparse(gateway.base_url)
    assert url.hostname is not None and url.port is not None
    return url.hostname, url.port


def _head(dialect: str, sid: str, framing: str) -> bytes:
    return (f"POST {PATHS[dialect]} HTTP/1.1\r\nhost: gateway\r\nauthorization: Bearer {sid}\r\n"
            f"content-type: application/json\r\nconnection: close\r\n{framing}\r\n").encode()


def _read_reply(sock: socket.socket) -> tuple[int, Any]:
    """The status and JSON body of the one reply on a `connection: close` socket (read to EOF)."""
    sock.settimeout(REPLY_WITHIN_S)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, sep, body = data.partition(b"\r\n\r\n")
    assert sep, f"the connection closed without a reply: {data!r:.200}"
    if b"transfer-encoding: chunked" in head.lower():
        body = _dechunk(body)
    return int(head.split()[1]), json.loads(body)


def _dechunk(data: bytes) -> bytes:
    out = b""
    while True:
        size, _, rest = data.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return out
        out, data = out + rest[:n], rest[n + 2:]


def _pieces(body: bytes, cuts: list[float]) -> list[bytes]:
    points = sorted({int(len(body) * c) for c in cuts} | {0, len(body)})
    return [body[a:b] for a, b in zip(points, points[1:], strict=False) if b > a]


def test_slow_bodies_get_their_answer_and_never_stall_other_agents(gateway, http, quiet_log):
    sid = gateway.client.open_session()
    entries = [e for e in CORPUS if e.status == 400][::7]  # a spread over the dialects and kinds

    @settings(HTTP_FUZZ, max_examples=6)
    @given(entry=st.sampled_from(entries), chunked=st.booleans(),
           cuts=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=4), pause=st.floats(0.02, 0.15))
    def slow(entry: Any, chunked: bool, cuts: list[float], pause: float) -> None:
        body = orjson.dumps(entry.body)
        framing = "transfer-encoding: chunked\r\n" if chunked else f"content-length: {len(body)}\r\n"
        with socket.create_connection(_address(gateway), timeout=SOCKET_TIMEOUT_S) as sock:
            sock.sendall(_head(entry.dialect, sid, framing))
            for piece in _pieces(body, cuts):
                started = time.perf_counter()
                health = http.get("/healthz")  # another agent, while this body is still coming
                assert health.status_code == 200 and time.perf_counter() - started < HEALTH_WITHIN_S
                time.sleep(pause)
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
            status, reply = _read_reply(sock)
        problem = mismatch(entry, status, reply)
        assert problem is None, f"{entry.name}: {problem}"

    slow()
    _nothing_recorded(gateway, sid)
    _still_serving(gateway, http)


def test_a_body_shorter_than_its_content_length_then_a_hang_up_is_dropped_quietly(gateway, http, quiet_log):
    sid = gateway.client.open_session()
    goods = [(dialect, orjson.dumps(body)) for dialect in DIALECTS for body in GOOD[dialect]]

    @settings(HTTP_FUZZ, max_examples=12)
    @given(good=st.sampled_from(goods), cut=st.floats(0.0, 1.0, exclude_max=True), half_close=st.booleans())
    def cut_off(good: tuple[str, bytes], cut: float, half_close: bool) -> None:
        dialect, body = good
        sent = body[: int(len(body) * cut)]
        with socket.create_connection(_address(gateway), timeout=SOCKET_TIMEOUT_S) as sock:
            sock.sendall(_head(dialect, sid, f"content-length: {len(body)}\r\n") + sent)
            if not half_close:
                return  # closed with the body unfinished: nobody is left to answer
            sock.shutdown(socket.SHUT_WR)  # "done sending": the gateway must not wait for the rest forever
            sock.settimeout(REPLY_WITHIN_S)
            data = b""
            while chunk := sock.recv(65536):  # a timeout here is a hang
                data += chunk
        # nobody is owed a reply, but one that comes is no 5xx
        assert not data or data.split()[1].startswith(b"4"), data[:200]

    cut_off()
    time.sleep(0.2)  # anything the gateway did with the cut bodies, before the session is finished
    _nothing_recorded(gateway, sid)
    _still_serving(gateway, http)


def test_the_fuzzed_pieces_cover_the_whole_body():
    body = bytes(range(200))
    rng = random.Random(7)
    for _ in range(50):
        cuts = [rng.random() for _ in range(rng.randint(1, 4))]
        assert b"".join(_pieces(body, cuts)) == body
