"""Engine routing across replicas, decided at the broker: affinity, release, failover, replicas changed at run time.

A real `serve` (2 workers, the vLLM wire format) over real fake-engine processes. Agents use the official
openai SDK with its default retries and a new connection per request, so consecutive turns of a session
land on either worker. Every session's turns reach one replica (the engines' own logs say so), sessions
spread evenly, and a finish frees its slot. A replica killed with SIGKILL under the agents fails its
health check; its sessions go on on the other replica, no turn lost (rows checked against what each agent
got). Replicas added with `set_engines` take new sessions, and removed ones give theirs up.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from assets import FakeEngine, wait_until
from processes import launch_gateway

from gateway_workers.engines.routing import routing_key

HEALTH_INTERVAL_S = "0.3"
LOAD_TURNS = 3
SLOW_S = 1.0  # the killed replica's answers take this long: the kill finds them in flight
LOAD_JOIN_S = 60.0


def _turn(gw: Any, sid: str, k: int) -> int:
    """One turn on a new connection (either worker); the completion tokens the agent was billed."""
    with openai.OpenAI(base_url=gw.base_url, api_key=sid, timeout=30,
                       default_headers={"Connection": "close"}) as agent:  # fmt: skip
        reply = agent.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": f"question {k}"}])
    assert reply.usage is not None
    return reply.usage.completion_tokens


def _replicas_of(engines: list[FakeEngine], sid: str) -> set[str]:
    """The engines that served `sid` (by the routing key in their own request logs)."""
    key = routing_key(sid)
    return {e.url for e in engines if e.log(key)["requests"]}


@pytest.fixture
def engines(qwen3_tokenizer_dir: str) -> Iterator[list[FakeEngine]]:
    started: list[FakeEngine] = []
    try:
        for _ in range(3):
            started.append(FakeEngine(qwen3_tokenizer_dir))
        yield started
    finally:
        for engine in started:
            engine.stop()


def test_sessions_stick_to_the_least_loaded_replica_fail_over_and_follow_set_engines(
    engines: list[FakeEngine], qwen3_tokenizer_dir: str
) -> None:
    e1, e2, e3 = engines
    env = {"ROLLOUT_BROKER_ENGINE_HEALTH_INTERVAL_S": HEALTH_INTERVAL_S}
    with launch_gateway(workers=2, engine_kind="vllm", engine_urls=[e1.url, e2.url], tokenizer=qwen3_tokenizer_dir,
                        extra_args=["--log-level", "warning"], env=env) as gw:  # fmt: skip
        # affinity: each session's turns, on either worker, reach one replica; sessions spread evenly
        sids = [gw.client.open_session() for _ in range(6)]
        for k in range(3):
            for sid in sids:
                _turn(gw, sid, k)
        served = {sid: _replicas_of([e1, e2], sid) for sid in sids}
        assert all(len(urls) == 1 for urls in served.values()), served
        assert Counter(next(iter(urls)) for urls in served.values()) == {e1.url: 3, e2.url: 3}
        replicas = gw.client.stats()["replicas"]
        assert {url: r["sessions"] for url, r in replicas.items()} == {e1.url: 3, e2.url: 3}
        for sid in sids:  # a finish frees the slot
            gw.client.finish_session(sid)
        replicas = gw.client.stats()["replicas"]
        assert {url: r["sessions"] for url, r in replicas.items()} == {e1.url: 0, e2.url: 0}

        # failover under load: the agents run on while a replica is killed with requests in flight on it; they
        # go on on the other one, no turn lost
        sids = [gw.client.open_session() for _ in range(4)]
        billed = Counter({sid: _turn(gw, sid, 0) for sid in sids})
        on_e1 = [sid for sid in sids if _replicas_of([e1], sid)]
        assert len(on_e1) == 2
        for sid in on_e1:  # slow answers: the kill finds requests in flight
            e1.configure(fault={"delay": SLOW_S, "key": routing_key(sid)})

        def agent(sid: str) -> int:
            return sum(_turn(gw, sid, k) for k in range(1, 1 + LOAD_TURNS))

        before = len(e1.log()["requests"])
        with ThreadPoolExecutor(len(sids)) as pool:
            running = {sid: pool.submit(agent, sid) for sid in sids}
            # both of its sessions' slow requests are in flight on it
            assert wait_until(lambda: len(e1.log()["requests"]) >= before + len(on_e1), timeout=10)
            os.killpg(os.getpgid(e1.process.pid), signal.SIGKILL)
            for sid, done in running.items():
                billed[sid] += done.result(timeout=LOAD_JOIN_S)  # the SDK's own retries ride through the failures
        stats = gw.client.stats()
        assert stats["replicas"][e1.url]["healthy"] is False and stats["sessions_moved"] >= len(on_e1)
        assert all(e2.url in _replicas_of([e2], sid) for sid in sids)
        for sid in sids:
            rows = gw.client.finish_session(sid)
            assert sum(len(r.metadata["turn_ids"]) for r in rows) == 1 + LOAD_TURNS  # every reply the agent got, once
            assert sum(sum(r.loss_mask) for r in rows) == billed[sid]

        # replicas changed at run time: an added one takes new sessions (the least loaded), a removed one's
        # sessions move to the others at their next turn
        kept = [gw.client.open_session() for _ in range(2)]
        for sid in kept:
            _turn(gw, sid, 0)  # both on e2, the only healthy replica
        assert gw.client.set_engines([e2.url, e3.url + "/"]) == [e2.url, e3.url]
        fresh = [gw.client.open_session() for _ in range(2)]
        for sid in fresh:
            _turn(gw, sid, 0)
        assert all(_replicas_of([e2, e3], sid) == {e3.url} for sid in fresh)
        moved = gw.client.stats()["sessions_moved"]
        gw.client.set_engines([e3.url])
        for sid in kept:
            _turn(gw, sid, 1)
        assert all(_replicas_of([e3], sid) == {e3.url} for sid in kept)
        stats = gw.client.stats()
        assert stats["sessions_moved"] == moved + 2 and set(stats["replicas"]) == {e3.url}
        assert wait_until(lambda: gw.client.stats()["replicas"][e3.url]["healthy"], timeout=5)
        for sid in kept + fresh:
            rows = gw.client.finish_session(sid)
            assert sum(len(r.metadata["turn_ids"]) for r in rows) == (2 if sid in kept else 1)
