"""Session isolation on a real `serve` (2 workers, the fake vLLM engine): a session key is an API key.

A key reaches only its own session on every route that reads one (`previous_response_id`, token counting,
the agent finish route); the public routes (/metrics, /metrics/worker, /healthz, /v1/models) name no session; and the
logs of a whole run, debug level, through engine faults, refusals and finishes, never hold a key: they
name sessions by their tag (`protocol.session_tag`), the key engine routers see too.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from assets import FakeEngine, wait_until
from processes import launch_gateway

from broker.protocol import session_tag
from gateway_workers.engines.routing import routing_key

USER = [{"role": "user", "content": "hello"}]
FINISH_ROUTE = "/rollout/v1/sessions/finish"


@pytest.fixture(scope="module")
def gateway(fake_engine: FakeEngine, qwen3_tokenizer_dir: str) -> Iterator[Any]:
    extra = ["--allow-agent-finish", "--log-level", "debug", "--engine-timeout", "5"]
    with launch_gateway(workers=2, engine_kind="vllm", engine_urls=[fake_engine.url],
                        tokenizer=qwen3_tokenizer_dir, extra_args=extra) as gw:
        yield gw


def _openai(gateway: Any, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=key, max_retries=0, timeout=30)


def _anthropic(gateway: Any, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.base_url.removesuffix("/v1"), api_key=key, max_retries=0, timeout=30)


def test_a_key_reads_and_writes_only_its_own_session(gateway: Any) -> None:
    alice, bob = gateway.client.open_session(), gateway.client.open_session()
    with _openai(gateway, alice) as a, _openai(gateway, bob) as b:
        first = a.responses.create(model="qwen3", input="hello")
        assert a.responses.create(model="qwen3", input="and then?", previous_response_id=first.id).id
        with pytest.raises(openai.BadRequestError) as refused:  # alice's response, named by bob
            b.responses.create(model="qwen3", input="and then?", previous_response_id=first.id)
        assert refused.value.body["param"] == "previous_response_id" and alice not in str(refused.value.body)
        with pytest.raises(openai.AuthenticationError):  # a key no session holds
            _openai(gateway, alice + "x").chat.completions.create(model="qwen3", messages=USER)
    with _anthropic(gateway, bob) as b, _anthropic(gateway, "rg-" + "0" * 32) as nobody:
        assert b.messages.count_tokens(model="qwen3", messages=USER).input_tokens > 0
        with pytest.raises(anthropic.AuthenticationError):
            nobody.messages.count_tokens(model="qwen3", messages=USER)
    # an agent's finish closes its own session and nobody else's
    finished = httpx.post(gateway.base_url.removesuffix("/v1") + FINISH_ROUTE, json={"reward": 1.0},
                          headers={"authorization": f"Bearer {bob}"}, timeout=30)
    assert finished.status_code == 200, finished.text
    with _openai(gateway, alice) as a:
        assert a.chat.completions.create(model="qwen3", messages=USER).choices[0].message is not None
    with _openai(gateway, bob) as b, pytest.raises(openai.PermissionDeniedError):
        b.chat.completions.create(model="qwen3", messages=USER)
    rows = gateway.client.finish_session(alice)
    assert len({turn for r in rows for turn in r.metadata["turn_ids"]}) == 3  # alice's own three turns


def test_public_routes_name_no_session(gateway: Any) -> None:
    key = gateway.client.open_session()
    with _openai(gateway, key) as agent:
        agent.chat.completions.create(model="qwen3", messages=USER)
    for route in ("/metrics", "/metrics/worker", "/healthz", "/v1/models"):
        body = httpx.get(gateway.base_url.removesuffix("/v1") + route, timeout=30).text
        assert key not in body and session_tag(key) not in body, route
    gateway.client.finish_session(key)


def test_the_logs_of_a_run_hold_no_key(gateway: Any, fake_engine: FakeEngine) -> None:
    keys = [gateway.client.open_session() for _ in range(3)]
    faulty, refused, finished = keys
    fake_engine.configure(fault={"status": 500, "times": 1, "key": routing_key(faulty)})
    with _openai(gateway, faulty) as agent, pytest.raises(openai.InternalServerError):
        agent.chat.completions.create(model="qwen3", messages=USER)  # logged: the engine failed (ours, a 502)
    gateway.client.finish_session(refused)
    with _openai(gateway, refused) as agent, pytest.raises(openai.PermissionDeniedError):
        agent.chat.completions.create(model="qwen3", messages=USER)  # a finished session: refused
    with _anthropic(gateway, finished) as agent:
        agent.messages.create(model="qwen3", max_tokens=16, messages=USER)
    httpx.post(gateway.base_url.removesuffix("/v1") + FINISH_ROUTE, json={"reward": 0.0, "rollout_id": "r1"},
               headers={"x-api-key": finished}, timeout=30).raise_for_status()
    with _anthropic(gateway, finished) as agent, pytest.raises(anthropic.PermissionDeniedError):
        agent.messages.create(model="qwen3", max_tokens=16, messages=USER)
    gateway.client.finish_session(faulty)
    tag = session_tag(faulty)
    wait_until(lambda: any(tag in line for line in list(gateway.output)), timeout=10)  # the engine failure's line
    log = "".join(gateway.output)
    assert "engine failed" in log
    leaked = [key for key in keys if key in log]
    assert not leaked, [line for line in gateway.output if any(key in line for key in leaked)][:5]
