"""Pausing generation around a weight update, through a real `serve` (2 workers, a durable broker, the fake vLLM
engine) with the official SDKs as agents.

`pause_generation("wait")` returns only once the turn in flight has finished, and its agent got its reply;
`pause_generation("abort")` stops every generation at once, keeps what each sampled and resubmits the rest at
the resume (one turn each, its tokens versioned old then new); while
paused, agents in all three dialects, streamed and not, are held with no engine call made; `resume_generation`
with a new version releases them, and their tokens carry that version. A turn held past `--pause-hold-s` gets a
retryable 503 with Retry-After and records nothing, as does one whose agent leaves while held. The pause
survives the broker's `kill -9`, and the CLI pauses and resumes like the client. A worker killed with turns
held loses them (never trained on); its agents' SDK retries are held again until the resume.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import openai
import pytest
from assets import FakeEngine, wait_until
from dialects import engine_turns, fake_policy
from fidelity import assert_fidelity
from processes import launch_gateway
from test_serve_durability import RESTART_WITHIN_S, broker_pid

from gateway_workers.engines.routing import routing_key
from trainer_client import PauseTimeout

HOLD_S = 15.0  # --pause-hold-s: short, so the hold timeout is tested within seconds, and past a broker restart
IN_FLIGHT_S = 1.5  # the engine's delay on the turn a pause waits for
TOKEN_S = 0.05  # the engine's pace on the generations an abort pause stops
QUESTION = "What is the capital of Peru?"


@pytest.fixture(scope="module")
def paused_gateway(tmp_path_factory: Any, qwen3_tokenizer_dir: str) -> Any:
    state = tmp_path_factory.mktemp("pause") / "state"
    extra = ["--log-level", "warning", "--pause-hold-s", str(HOLD_S), "--state-dir", str(state)]
    with FakeEngine(qwen3_tokenizer_dir) as engine, launch_gateway(
        workers=2, engine_kind="vllm", engine_urls=[engine.url], tokenizer=qwen3_tokenizer_dir, extra_args=extra
    ) as gw:
        yield gw, engine


def _ask(gw: Any, sid: str, dialect: str, stream: bool) -> str:
    """One turn in `dialect` through its official SDK (retries on, a connection of its own); the reply's text."""
    base = gw.base_url
    if dialect == "messages":
        with anthropic.Anthropic(base_url=base.removesuffix("/v1"), api_key=sid, max_retries=2, timeout=60) as claude:
            messages: Any = [{"role": "user", "content": QUESTION}]
            if stream:
                with claude.messages.stream(model="qwen3", max_tokens=64, messages=messages) as events:
                    return "".join(events.text_stream)
            reply = claude.messages.create(model="qwen3", max_tokens=64, messages=messages)
            return "".join(b.text for b in reply.content if b.type == "text")
    with openai.OpenAI(base_url=base, api_key=sid, max_retries=2, timeout=60) as agent:
        if dialect == "responses":
            if stream:
                with agent.responses.stream(model="qwen3", input=QUESTION) as events:
                    return events.get_final_response().output_text
            return agent.responses.create(model="qwen3", input=QUESTION).output_text
        messages = [{"role": "user", "content": QUESTION}]
        if stream:
            chunks = agent.chat.completions.create(model="qwen3", messages=messages, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return agent.chat.completions.create(model="qwen3", messages=messages).choices[0].message.content or ""


def _requests(engine: FakeEngine, sid: str) -> int:
    return len(engine.log(routing_key(sid))["requests"])


def _held(gw: Any) -> int:
    return int(gw.client.stats()["generation_turns_held"])


def test_a_wait_pause_lets_the_turn_in_flight_finish_holds_every_dialect_and_resumes_under_the_new_version(
    paused_gateway: Any, qwen3_tokenizer_dir: str
) -> None:
    gw, engine = paused_gateway
    client, policy = gw.client, fake_policy(qwen3_tokenizer_dir)
    assert client.generation_paused() is None
    busy = client.open_session()
    engine.configure(fault={"key": routing_key(busy), "delay": IN_FLIGHT_S})
    kinds = [(dialect, stream) for dialect in ("chat", "messages", "responses") for stream in (False, True)]
    held = [client.open_session() for _ in kinds]
    with ThreadPoolExecutor(len(kinds) + 1) as pool:
        in_flight = pool.submit(_ask, gw, busy, "chat", False)
        assert wait_until(lambda: _requests(engine, busy) == 1, 10)  # at the engine, generating
        started = time.monotonic()
        report = client.pause_generation("wait", timeout=30)
        waited = time.monotonic() - started
        assert in_flight.done() and in_flight.result()  # the pause returned after its reply, not before
        assert waited >= IN_FLIGHT_S / 3, waited
        assert (report.mode, report.already, report.workers, report.engine_calls) == ("wait", False, 2, 0)
        assert client.generation_paused() == "wait"

        asked = zip(held, kinds, strict=True)
        replies = [pool.submit(_ask, gw, sid, dialect, stream) for sid, (dialect, stream) in asked]
        assert wait_until(lambda: _held(gw) == len(kinds), 10), gw.client.stats()
        time.sleep(0.5)
        assert not any(f.done() for f in replies)  # their connections open, waiting
        assert all(_requests(engine, sid) == 0 for sid in held)  # no engine call while paused
        again = client.pause_generation("wait", timeout=5)
        assert again.already and again.turns_held == len(kinds)

        assert client.resume_generation(weight_version=5) is True
        assert all(f.result(timeout=30) for f in replies)  # 0 agent errors
    assert client.generation_paused() is None
    assert client.resume_generation() is False  # not paused: says so
    for sid in held:
        records = client.finish_session(sid, wait_timeout=10)
        turns = engine_turns(engine, sid, policy)
        assert len(turns) == 1 and len(records) == 1
        assert_fidelity(turns, records)
        sampled = {v for v, m in zip(records[0].weight_versions, records[0].loss_mask, strict=True) if m}
        assert sampled == {5}  # sampled after the resume: the version it set
    (before,) = client.finish_session(busy, wait_timeout=10)
    assert {v for v, m in zip(before.weight_versions, before.loss_mask, strict=True) if m} == {-1}


def test_a_turn_held_past_the_bound_gets_a_retryable_503_and_one_whose_agent_leaves_records_nothing(
    paused_gateway: Any,
) -> None:
    gw, engine = paused_gateway
    client = gw.client
    sid, gone, slow = client.open_session(), client.open_session(), client.open_session()
    engine.configure(fault={"key": routing_key(slow), "delay": 2 * IN_FLIGHT_S})
    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(_ask, gw, slow, "messages", True)
        assert wait_until(lambda: _requests(engine, slow) == 1, 10)
        with pytest.raises(PauseTimeout) as timed_out:  # not idle in time: says what still runs, stays paused
            client.pause_generation("wait", timeout=0.3)
        assert timed_out.value.report.engine_calls == 1 and client.generation_paused() == "wait"
        assert client.pause_generation("wait", timeout=30).already  # waits again, until idle
        assert in_flight.result(timeout=30)
    try:
        body = {"model": "qwen3", "messages": [{"role": "user", "content": QUESTION}]}
        with pytest.raises(httpx.ReadTimeout):  # the agent leaves while held
            httpx.post(f"{gw.base_url}/chat/completions", json=body, timeout=1.0,
                       headers={"authorization": f"Bearer {gone}"})  # fmt: skip
        assert wait_until(lambda: _held(gw) == 0, 10)
        started = time.monotonic()
        answer = httpx.post(f"{gw.base_url}/chat/completions", json=body, timeout=30,
                            headers={"authorization": f"Bearer {sid}"})  # fmt: skip
        held_s = time.monotonic() - started
        assert answer.status_code == 503, answer.text
        assert answer.headers["retry-after"] == "2" and HOLD_S <= held_s < HOLD_S + 3, held_s
        assert answer.json()["error"]["code"] == "generation_paused"
    finally:
        client.resume_generation()
    for key in (sid, gone):
        assert client.finish_session(key, wait_timeout=10) == []  # nothing recorded
        assert _requests(engine, key) == 0


def test_a_pause_survives_a_broker_kill_and_the_cli_pauses_and_resumes(paused_gateway: Any) -> None:
    gw, engine = paused_gateway
    client = gw.client
    cli = [sys.executable, "-m", "gateway_workers.cli"]
    out = subprocess.run([*cli, "pause", "--mode", "wait", "--control", gw.control, "--timeout", "10"],
                         capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    report = json.loads(out.stdout)
    assert report["idle"] and report["mode"] == "wait" and report["workers"] == 2
    first = broker_pid(gw.process.pid)
    assert first is not None
    os.kill(first, signal.SIGKILL)
    assert wait_until(lambda: broker_pid(gw.process.pid) not in (None, first), timeout=RESTART_WITHIN_S)
    assert wait_until(lambda: client.generation_paused() == "wait", timeout=RESTART_WITHIN_S)
    sid = client.open_session()
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(_ask, gw, sid, "chat", False)
        assert wait_until(lambda: _held(gw) == 1, 10)  # still paused after the restart: held
        assert _requests(engine, sid) == 0
        out = subprocess.run([*cli, "resume", "--control", gw.control, "--weight-version", "9"],
                             capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
        assert json.loads(out.stdout) == {"was_paused": True}
        assert reply.result(timeout=30)
    (record,) = client.finish_session(sid, wait_timeout=10)
    assert {v for v, m in zip(record.weight_versions, record.loss_mask, strict=True) if m} == {9}


def test_an_abort_pause_stops_every_generation_keeps_its_tokens_and_resumes_each_as_one_turn(
    paused_gateway: Any, qwen3_tokenizer_dir: str
) -> None:
    gw, engine = paused_gateway
    client, policy = gw.client, fake_policy(qwen3_tokenizer_dir)
    client.set_weight_version(6)
    kinds = [(dialect, stream) for dialect in ("chat", "messages", "responses") for stream in (False, True)]
    sids = [client.open_session() for _ in kinds]
    for sid in sids:
        engine.configure(fault={"key": routing_key(sid), "token_delay": TOKEN_S})
    with ThreadPoolExecutor(len(kinds)) as pool:
        asked = zip(sids, kinds, strict=True)
        replies = [pool.submit(_ask, gw, sid, dialect, stream) for sid, (dialect, stream) in asked]
        assert wait_until(lambda: all(_requests(engine, sid) == 1 for sid in sids), 10)
        time.sleep(8 * TOKEN_S)  # a few tokens in
        started = time.monotonic()
        report = client.pause_generation("abort", timeout=10)
        assert time.monotonic() - started < 1.0  # every generation stopped at once, not finished
        assert (report.mode, report.engine_calls, report.workers) == ("abort", 0, 2)
        assert report.tokens_kept > 0
        assert wait_until(lambda: _held(gw) == len(kinds), 10)  # each back at the gate, its tokens kept
        assert all(_requests(engine, sid) == 1 for sid in sids)  # nothing resubmitted while paused
        assert not any(f.done() for f in replies)
        assert client.resume_generation(weight_version=7)
        assert all(f.result(timeout=30) for f in replies)  # 0 agent errors: one reply each
    kept = 0
    for sid in sids:
        first, rest = engine.log(routing_key(sid))["requests"]  # stopped, then resubmitted on the same replica
        prompt = first["body"]["token_ids"]
        partial = rest["body"]["token_ids"][len(prompt) :]
        assert rest["body"]["token_ids"][: len(prompt)] == prompt and partial  # prompt + the tokens kept
        budget = first["body"]["sampling_params"]["max_tokens"]
        assert rest["body"]["sampling_params"]["max_tokens"] == budget - len(partial)
        sampled, logprobs, _ = policy(prompt, budget)
        assert partial == sampled[: len(partial)]  # exactly what the engine had sampled
        tail, tail_logprobs, _ = policy(prompt + partial, budget - len(partial))
        (record,) = client.finish_session(sid, wait_timeout=10)  # one turn, one row
        assert record.token_ids == prompt + partial + tail
        assert record.loss_mask == [1] * (len(partial) + len(tail))
        assert record.logprobs == pytest.approx(logprobs[: len(partial)] + tail_logprobs, abs=0)
        assert record.weight_versions == [6] * len(partial) + [7] * len(tail)  # old, then new, per token
        kept += len(partial)
    assert kept >= report.tokens_kept  # a stream's kept tokens are counted as it stopped


def test_an_abort_pause_outlives_a_broker_kill_and_a_stopped_turn_whose_agent_leaves_records_nothing(
    paused_gateway: Any,
) -> None:
    gw, engine = paused_gateway
    client = gw.client
    client.set_weight_version(2)
    kinds = [("chat", False), ("messages", True)]
    sids, gone = [client.open_session() for _ in kinds], client.open_session()
    for sid in [*sids, gone]:
        engine.configure(fault={"key": routing_key(sid), "token_delay": TOKEN_S})
    body = {"model": "qwen3", "messages": [{"role": "user", "content": QUESTION}]}
    with ThreadPoolExecutor(len(kinds) + 1) as pool:
        asked = zip(sids, kinds, strict=True)
        replies = [pool.submit(_ask, gw, sid, dialect, stream) for sid, (dialect, stream) in asked]
        leaving = pool.submit(httpx.post, f"{gw.base_url}/chat/completions", json=body, timeout=3.0,
                              headers={"authorization": f"Bearer {gone}"})  # fmt: skip
        assert wait_until(lambda: all(_requests(engine, sid) == 1 for sid in [*sids, gone]), 10)
        time.sleep(8 * TOKEN_S)
        assert client.pause_generation("abort", timeout=10).engine_calls == 0
        with pytest.raises(httpx.ReadTimeout):  # it leaves while its stopped turn waits for the resume
            leaving.result(timeout=30)
        first = broker_pid(gw.process.pid)
        assert first is not None
        os.kill(first, signal.SIGKILL)
        assert wait_until(lambda: broker_pid(gw.process.pid) not in (None, first), timeout=RESTART_WITHIN_S)
        assert wait_until(lambda: client.generation_paused() == "abort", timeout=RESTART_WITHIN_S)
        assert wait_until(lambda: _held(gw) == len(kinds), 10)  # still held, their tokens kept, through it
        assert client.resume_generation(weight_version=3)
        assert all(f.result(timeout=30) for f in replies)
    for sid in sids:
        (record,) = client.finish_session(sid, wait_timeout=10)
        sampled = [v for v, m in zip(record.weight_versions, record.loss_mask, strict=True) if m]
        assert sampled == sorted(sampled) and set(sampled) == {2, 3}  # old, then new
        assert len(engine.log(routing_key(sid))["requests"]) == 2
    assert client.finish_session(gone, wait_timeout=10) == []  # the agent left: nothing recorded
    assert _requests(engine, gone) == 1  # and nothing resubmitted for it


def test_a_worker_killed_with_turns_held_loses_them_and_its_agents_retries_are_held_until_the_resume(
    paused_gateway: Any,
) -> None:
    from process.test_worker_loss import _worker_pids

    gw, engine = paused_gateway
    client = gw.client
    client.pause_generation("wait", timeout=10)
    sids = [client.open_session() for _ in range(4)]
    try:
        with ThreadPoolExecutor(len(sids)) as pool:
            replies = [pool.submit(_ask, gw, sid, "chat", False) for sid in sids]  # retries on: 2
            assert wait_until(lambda: _held(gw) == len(sids), 10)
            workers = _worker_pids(gw.process.pid)
            assert len(workers) == 2
            os.kill(workers[0], signal.SIGKILL)  # its held turns go with it (its agents see a lost connection)
            assert wait_until(lambda: len(set(_worker_pids(gw.process.pid)) - set(workers)) == 1, 60)
            time.sleep(3.0)  # the successor is up, told the pause at its first beat; the retries are held again
            assert all(_requests(engine, sid) == 0 for sid in sids)  # no engine call while paused, on any worker
            assert not any(f.done() for f in replies)
            assert client.resume_generation()
            assert all(f.result(timeout=60) for f in replies)  # 0 agent errors: their SDKs retried
    finally:
        client.resume_generation()
    for sid in sids:
        assert len(client.finish_session(sid, wait_timeout=30)) == 1  # one turn each: the lost one never trained
        assert _requests(engine, sid) == 1
