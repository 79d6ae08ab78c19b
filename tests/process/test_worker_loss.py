"""A worker killed under `serve` with a turn in flight: real processes, `kill -9`, the official SDK.

The mock engine takes long enough that a turn is surely in flight when the only worker is killed. The
broker stops hearing the worker's heartbeats and abandons the turn within its silence bound, so the
trainer's finish returns within 5 s of the kill, not after its wait_timeout; uvicorn starts a new
worker (a new worker to the broker), and an agent whose SDK retries gets its reply from it: the
episode holds exactly the reply the agent received, and nothing of the turn that died.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import openai
from assets import wait_until
from process.test_supervision import _descendants
from processes import launch_gateway

USER = [{"role": "user", "content": "hello"}]
ENGINE_DELAY_S = 1.5
ABANDONED_WITHIN_S = 5.0
AGENT_DONE_WITHIN_S = 150.0


def _worker_pids(serve_pid: int) -> list[int]:
    return [pid for pid, cmd in _descendants(serve_pid).items() if "spawn_main" in cmd]


def _kill_the_worker_mid_turn(gw, key: str, max_retries: int) -> tuple[list, float]:
    """Start one agent turn, kill -9 the worker once the turn is in flight; the agent's outcome, the kill time."""
    outcome: list = []

    def agent() -> None:
        with openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=max_retries, timeout=30) as client:
            try:
                outcome.append(client.chat.completions.create(model="qwen3", messages=USER))
            except openai.APIError as e:
                outcome.append(e)

    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    assert wait_until(lambda: gw.client.stats()["turns_in_flight"] == 1, timeout=20)
    (worker,) = _worker_pids(gw.process.pid)
    os.kill(worker, signal.SIGKILL)
    killed_at = time.monotonic()
    thread.join(AGENT_DONE_WITHIN_S)  # a new worker loads its tokenizer before it answers: slow on a busy box
    assert not thread.is_alive()
    return outcome, killed_at


def test_a_finish_does_not_wait_for_the_turn_of_a_killed_worker() -> None:
    extra = ["--log-level", "warning", "--mock-delay", str(ENGINE_DELAY_S * 20)]
    with launch_gateway(workers=1, engine_kind="mock", extra_args=extra) as gw:
        key = gw.client.open_session()
        (outcome,), killed_at = _kill_the_worker_mid_turn(gw, key, max_retries=0)
        assert isinstance(outcome, openai.APIConnectionError)  # no retries: the agent sees the lost connection
        rows = gw.client.finish_session(key, wait_timeout=60)
        waited = time.monotonic() - killed_at
        stats = gw.client.stats()
    assert rows == []
    assert waited < ABANDONED_WITHIN_S, waited
    assert stats["turns_worker_lost"] == 1
    assert "abandoned its 1 in-flight turns" in "".join(gw.output)


def test_an_agent_retrying_through_a_killed_worker_is_trained_on_the_reply_it_got() -> None:
    extra = ["--log-level", "warning", "--mock-delay", str(ENGINE_DELAY_S)]
    with launch_gateway(workers=1, engine_kind="mock", extra_args=extra) as gw:
        key = gw.client.open_session()
        (reply,), _ = _kill_the_worker_mid_turn(gw, key, max_retries=4)
        assert isinstance(reply, openai.types.chat.ChatCompletion), reply  # the SDK's retry reached the new worker
        (row,) = gw.client.finish_session(key, wait_timeout=30)
        stats = gw.client.stats()
    assert row.metadata["turn_ids"] == [reply.id.removeprefix("chatcmpl-")]
    assert reply.choices[0].message.content in row.response
    assert stats["turns_worker_lost"] == 1 and stats["commits_stored"] == 1
    # the SDK's retry of the request that died with its worker superseded that turn: the episode is complete
    assert "drain_status" not in row.metadata
