"""`POST /rollout/v1/sessions/finish` in-process: the real route, a real `Backplane`, a real broker on port 0.

The app here mounts only the finish route, with the state it reads (config, metrics and a
pipeline holding the backplane); the worker's full app is exercised through `serve` in
tests/process/test_serve_episode_stream.py. Covers the flag (404), auth (401), body validation
(400), exactly-once (410 after any other finish), a full outbox (503 with Retry-After, the
session left open) and the accepted episode reaching the trainer's stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from gateway_workers.capture.backplane import Backplane
from gateway_workers.config import WorkerConfig
from gateway_workers.http.errors import ApiError
from gateway_workers.http.finish_route import FINISH_PATH, finish_session, parse_finish_body
from gateway_workers.http.limits import RequestLimits
from gateway_workers.metrics import WorkerMetrics
from trainer_client import SessionClosed, TrainerClient


def finish_app(broker_endpoint: str, allow: bool) -> Starlette:
    config = WorkerConfig(broker_endpoint=broker_endpoint, allow_agent_finish=allow)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        backplane = Backplane(broker_endpoint)
        backplane.start()
        try:
            yield {"config": config, "metrics": WorkerMetrics(), "pipeline": SimpleNamespace(backplane=backplane)}
        finally:
            await backplane.close()

    return Starlette(routes=[Route(FINISH_PATH, finish_session, methods=["POST"])], lifespan=lifespan)


@pytest.fixture
def http(broker) -> Iterator[TestClient]:
    with TestClient(finish_app(broker.worker_endpoint, allow=True)) as client:
        yield client


def test_disabled_is_a_404_in_openai_shape(broker, client):
    sid = client.open_session()
    with TestClient(finish_app(broker.worker_endpoint, allow=False)) as http:
        reply = http.post(FINISH_PATH, json={"reward": 1.0}, headers={"authorization": f"Bearer {sid}"})
    assert reply.status_code == 404
    assert reply.json()["error"]["type"] == "not_found_error" and "--allow-agent-finish" in reply.text
    assert client.finish_session(sid) == []  # the session was untouched


def test_a_body_over_the_limit_is_a_413_and_finishes_nothing(broker, client):
    sid = client.open_session()
    app = finish_app(broker.worker_endpoint, allow=True)
    with TestClient(app) as small:
        big = b'{"reward": 1.0, "metadata": {"pad": "' + b"x" * (RequestLimits().max_body_bytes + 1) + b'"}}'
        reply = small.post(FINISH_PATH, content=big, headers={"authorization": f"Bearer {sid}"})
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"
    assert client.finish_session(sid) == []  # the session was still open: the trainer finishes it


def test_accepted_then_final_410_for_every_later_finish(http, client):
    sid = client.open_session(metadata={"task": "t"})
    reply = http.post(
        FINISH_PATH, json={"reward": 0.75, "metadata": {"judge": "h"}, "rollout_id": 12}, headers={"x-api-key": sid}
    )
    assert reply.status_code == 200 and reply.json() == {"object": "rollout.session.finish", "status": "accepted"}
    again = http.post(FINISH_PATH, json={"reward": 1.0}, headers={"authorization": f"Bearer {sid}"})
    assert again.status_code == 410
    error = again.json()["error"]
    assert error["code"] == "session_finished" and "finished by the agent" in error["message"]
    with pytest.raises(SessionClosed, match="finished by the agent"):
        client.request_finish(sid)
    with client.episodes(timeout=5) as stream:
        episode = next(stream)
    assert (episode.session_id, episode.reward, episode.rollout_id, episode.finished_by) == (sid, 0.75, "12", "agent")
    assert episode.metadata == {"task": "t", "judge": "h"}

    trainer_first = client.open_session()
    client.finish_session(trainer_first)
    late = http.post(FINISH_PATH, json={}, headers={"x-api-key": trainer_first})
    assert late.status_code == 410 and "finished by the trainer" in late.json()["error"]["message"]


def test_unknown_or_missing_keys_are_401(http):
    for headers in ({}, {"authorization": "Bearer "}, {"authorization": "Bearer no-such-session"}):
        reply = http.post(FINISH_PATH, json={"reward": 1.0}, headers=headers)
        assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"


def test_a_full_outbox_is_a_retryable_503_and_leaves_the_session_open(make_broker):
    broker = make_broker(outbox_max_episodes=1)
    with (
        TrainerClient(broker.control_endpoint, timeout=5) as client,
        TestClient(finish_app(broker.worker_endpoint, allow=True)) as http,
    ):
        first, second = client.open_session(), client.open_session()
        assert http.post(FINISH_PATH, json={}, headers={"x-api-key": first}).status_code == 200
        busy = http.post(FINISH_PATH, json={"reward": 1}, headers={"x-api-key": second})
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["code"] == "outbox_full" and "still open" in busy.json()["error"]["message"]
        with client.episodes(timeout=5) as stream:
            assert next(stream).session_id == first
        assert http.post(FINISH_PATH, json={"reward": 1}, headers={"x-api-key": second}).status_code == 200
        with client.episodes(timeout=5) as stream:
            assert next(stream).session_id == second


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b"{not json", None),
        (b"[1]", None),
        (b'{"rewards": 1}', "rewards"),
        (b'{"reward": "high"}', "reward"),
        (b'{"reward": true}', "reward"),
        (b'{"reward": 1e999}', None),  # orjson refuses infinity itself
        (b'{"metadata": [1]}', "metadata"),
        (b'{"rollout_id": {"a": 1}}', "rollout_id"),
        (b'{"rollout_id": "' + b"x" * 300 + b'"}', "rollout_id"),
    ],
)
def test_bad_bodies_are_400_naming_the_field(http, client, raw, param):
    with pytest.raises(ApiError) as e:
        parse_finish_body(raw)
    assert e.value.status == 400 and e.value.param == param
    sid = client.open_session()
    reply = http.post(FINISH_PATH, content=raw, headers={"x-api-key": sid, "content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param
    assert client.finish_session(sid) == []  # a refused body finished nothing


def test_good_bodies_parse():
    assert parse_finish_body(b"") == (None, None, {})
    assert parse_finish_body(b'{"reward": 1, "metadata": null, "rollout_id": 7}') == (1.0, "7", {})
    assert parse_finish_body(b'{"reward": -0.5, "metadata": {"k": [1]}}') == (-0.5, None, {"k": [1]})
