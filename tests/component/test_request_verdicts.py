"""What the worker does with fields it ignores, tools it cannot run, and requests it refuses: counted, logged, shaped.

The worker's whole app (create_app and its lifespan: the real Backplane to a real broker on port 0, the built-in
tokenizer, the mock engine) through Starlette's TestClient, and the trainer client reading the recorded turn back.
A Claude-Code-shaped request (a system message after the first user message, cache_control, defer_loading,
`thinking`, `context_management`, a hosted tool) is served and its prompt renders the late system message where it
stands; its ignored fields and the hosted tool are counted by name. Under `--hosted-tools reject` the same
request is a 400. Every refusal is one warning line on `rollout_gateway.access` with the route, status, session
tag (never the key), error type, code, param, latency and message; `--access-log` adds a line for the others.
Unknown routes answer in the API's own shape.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from broker.protocol import session_tag
from gateway_workers.app import create_app
from gateway_workers.config import WorkerConfig
from gateway_workers.engines.config import EngineConfig

ACCESS = "rollout_gateway.access"
CLAUDE_CODE_LIKE: dict[str, Any] = {
    "model": "claude-opus-5-5",
    "max_tokens": 64,
    "stream": False,
    "system": [{"type": "text", "text": "You are an agent."},
               {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "List the files."}]},
        {"role": "system", "content": [{"type": "text", "text": "ENV-CONTEXT cwd=/repo",
                                        "cache_control": {"type": "ephemeral"}}]},
        {"role": "user", "content": "Go on."},
    ],
    "tools": [
        {"name": "Bash", "description": "Run a command.", "defer_loading": False,
         "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}},
        {"type": "web_search_20250305", "name": "web_search"},
    ],
    "metadata": {"user_id": "u"},
    "thinking": {"type": "adaptive", "display": "omitted"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "medium"},
}


def _app(broker: Any, **config: Any) -> TestClient:
    worker = WorkerConfig(broker_endpoint=broker.worker_endpoint, engine=EngineConfig(kind="mock"), **config)
    return TestClient(create_app(worker))


@pytest.fixture
def http(broker: Any) -> Iterator[TestClient]:
    with _app(broker) as client:
        yield client


def _counters(http: TestClient, name: str) -> dict[tuple[str, ...], float]:
    snapshot = http.get("/metrics/worker").json()
    return {tuple(labels): value for metric, labels, value in snapshot["counters"] if metric == name}


def test_a_claude_code_shaped_request_is_served_and_its_ignored_fields_and_hosted_tools_counted(http, client):
    sid = client.open_session()
    headers = {"x-api-key": sid, "anthropic-beta": "claude-code-20250219,context-management-2025-06-27"}
    reply = http.post("/v1/messages?beta=true", json=CLAUDE_CODE_LIKE, headers=headers)
    assert reply.status_code == 200, reply.text
    ignored = _counters(http, "request_fields_ignored")
    for field in ("model", "metadata", "thinking", "context_management", "system.cache_control",
                  "messages.content.cache_control", "tools.defer_loading"):
        assert ignored.get(("messages", field)) == 1, (field, ignored)
    assert ("messages", "output_config") not in ignored  # honoured: its effort is what is ignored
    assert _counters(http, "hosted_tools_dropped") == {("messages", "web_search_20250305"): 1}
    [row] = client.finish_session(sid)
    assert row.loss_mask.count(1) > 0  # the reply was recorded and trained


def test_the_late_system_message_is_rendered(http, client):
    sid = client.open_session()
    messages = CLAUDE_CODE_LIKE["messages"]
    without = {**CLAUDE_CODE_LIKE, "messages": [messages[0], messages[2]]}
    base = http.post("/v1/messages/count_tokens", json=without, headers={"x-api-key": sid}).json()["input_tokens"]
    both = http.post("/v1/messages/count_tokens", json=CLAUDE_CODE_LIKE, headers={"x-api-key": sid})
    # its text, and the system turn's markers around it
    assert both.status_code == 200 and both.json()["input_tokens"] >= base + len("ENV-CONTEXT cwd=/repo".split())
    client.drop_session(sid)


def test_hosted_tools_are_refused_under_reject(broker, client, caplog):
    sid = client.open_session()
    with _app(broker, hosted_tools="reject") as http, caplog.at_level(logging.WARNING, ACCESS):
        reply = http.post("/v1/messages", json=CLAUDE_CODE_LIKE, headers={"x-api-key": sid})
        assert reply.status_code == 400
        assert reply.json()["error"]["type"] == "invalid_request_error" and "web_search_20250305" in reply.text
        assert not _counters(http, "request_fields_ignored")  # refused before anything is counted
    [line] = [r.getMessage() for r in caplog.records if r.name == ACCESS]
    assert "POST /v1/messages 400" in line and "code=unsupported_value param=tools" in line
    client.drop_session(sid)


def test_a_refusal_is_one_warning_line_that_says_why_and_never_the_key(http, client, caplog):
    sid = client.open_session()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "foo": 1}
    with caplog.at_level(logging.INFO, ACCESS):
        reply = http.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {sid}"})
    assert reply.status_code == 400
    assert reply.json()["error"] == {"message": "Unknown parameter: 'foo'.", "type": "invalid_request_error",
                                     "param": "foo", "code": "unknown_parameter"}
    [record] = [r for r in caplog.records if r.name == ACCESS]
    line = record.getMessage()
    assert record.levelno == logging.WARNING
    assert line.startswith(f"POST /v1/chat/completions 400 session={session_tag(sid)} type=invalid_request_error "
                           "code=unknown_parameter param=foo ")
    assert " ms: Unknown parameter: 'foo'." in line and sid not in line
    counted = _counters(http, "http_errors")
    assert counted[("chat", "400", "unknown_parameter")] == 1
    client.drop_session(sid)


def test_an_unknown_key_is_logged_by_tag_alone(http, caplog):
    with caplog.at_level(logging.WARNING, ACCESS):
        reply = http.post("/v1/responses", json={"input": "hi"}, headers={"authorization": "Bearer not-a-session"})
    assert reply.status_code == 401
    [line] = [r.getMessage() for r in caplog.records if r.name == ACCESS]
    assert "POST /v1/responses 401" in line and "not-a-session" not in line and session_tag("not-a-session") in line


def test_the_access_log_adds_a_line_for_every_served_request(broker, client, caplog):
    sid = client.open_session()
    # caplog's handler takes every level: what reaches it is what the logger's own level (`--access-log`) lets by
    with _app(broker, access_log=True) as http:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        assert http.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {sid}"}).is_success
        assert http.get("/healthz").status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name == ACCESS and r.levelno == logging.INFO]
    assert any(line.startswith(f"POST /v1/chat/completions 200 session={session_tag(sid)}") and "committed" in line
               for line in lines), lines
    assert any(line.startswith("GET /healthz 200") for line in lines), lines
    client.drop_session(sid)


def test_without_the_access_log_a_served_request_logs_nothing(http, client, caplog):
    sid = client.open_session()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    assert http.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {sid}"}).is_success
    assert not [r for r in caplog.records if r.name == ACCESS]
    client.drop_session(sid)


@pytest.mark.parametrize(("path", "shape"), [("/v1/responses/compact", "openai"), ("/v1/embeddings", "openai"),
                                             ("/v1/messages/batches", "anthropic")])
def test_an_unknown_route_answers_in_the_api_shape_and_is_logged(http, caplog, path, shape):
    with caplog.at_level(logging.WARNING, ACCESS):
        reply = http.post(path, json={})
    assert reply.status_code == 404
    body = reply.json()
    if shape == "openai":
        assert body["error"]["code"] == "unknown_url" and path in body["error"]["message"]
    else:
        assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    assert any(f"POST {path} 404" in r.getMessage() for r in caplog.records if r.name == ACCESS)
