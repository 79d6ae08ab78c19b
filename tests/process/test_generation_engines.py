"""Each pause mode through a real `serve` (2 workers, 2 fake replicas of vLLM, then of SGLang) with the official
SDKs in all three dialects, streamed and not, as agents.

`wait` lets the generations in flight finish and holds the rest; `abort` stops each at its replica, which
answers with what it sampled (each engine in its own way), and resubmits the rest to the same replica at the
resume: one turn each, old then new version per token. (The replica-kill test comes last: it leaves one.)

`pause_generation("keep")` calls each replica's own pause exactly once (vLLM `/pause?mode=keep`, SGLang
`/pause_generation {"mode": "in_place"}`) and returns once each answered, with the generations in flight still
held inside the engines; nothing is sampled and no engine call is made until the resume, which sets SGLang's
version (without aborting anything) and resumes each replica once. Every agent gets its one reply, every turn
is one turn with exact fidelity, and each token's version is the one the fake engine sampled it under: exact on
SGLang, which says so per output; on vLLM, which does not, the tokens after the pause are -1 and the row is
flagged, never given a guessed version.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from assets import FakeEngine, wait_until
from dialects import fake_policy
from processes import launch_gateway
from test_generation_pause import _ask, _held
from test_serve_durability import RESTART_WITHIN_S, broker_pid

from gateway_workers.engines.routing import routing_key

TOKEN_S = 0.04  # the engines' pace: the pause catches every generation a few tokens in
KINDS = [(dialect, stream) for dialect in ("chat", "messages", "responses") for stream in (False, True)]
OLD, NEW = 4, 5


@pytest.fixture(scope="module", params=["vllm", "sglang"])
def two_replicas(request: Any, tmp_path_factory: Any, qwen3_tokenizer_dir: str) -> Any:
    state = tmp_path_factory.mktemp("engines") / "state"
    extra = ["--log-level", "warning", "--state-dir", str(state)]
    with FakeEngine(qwen3_tokenizer_dir) as e1, FakeEngine(qwen3_tokenizer_dir) as e2, launch_gateway(
        workers=2, engine_kind=request.param, engine_urls=[e1.url, e2.url], tokenizer=qwen3_tokenizer_dir,
        extra_args=extra,
    ) as gw:  # fmt: skip
        yield gw, (e1, e2), request.param


def _log(engines: tuple[FakeEngine, ...], sid: str) -> dict[str, list[dict[str, Any]]]:
    """Both replicas' logs for one session (it is routed to one of them)."""
    logs = [engine.log(routing_key(sid)) for engine in engines]
    return {part: [entry for log in logs for entry in log[part]] for part in ("requests", "sampled")}


def _paced(engines: tuple[FakeEngine, ...], sids: list[str]) -> None:
    """Fresh logs on every replica, and each session's generation paced at TOKEN_S a token."""
    for engine in engines:
        engine.configure(reset=True)
        for sid in sids:
            engine.configure(fault={"key": routing_key(sid), "token_delay": TOKEN_S})


def _start(pool: ThreadPoolExecutor, gw: Any, engines: tuple[FakeEngine, ...], sids: list[str]) -> list[Any]:
    """Each session's agent asks in its dialect (KINDS); returns once every generation is a few tokens in."""
    asked = zip(sids, KINDS, strict=True)
    replies = [pool.submit(_ask, gw, sid, dialect, stream) for sid, (dialect, stream) in asked]
    assert wait_until(lambda: all(len(_log(engines, sid)["requests"]) == 1 for sid in sids), 10)
    time.sleep(6 * TOKEN_S)
    return replies


def _sampled(engines: tuple[FakeEngine, ...]) -> int:
    return sum(len(s["resumes"]) for engine in engines for s in engine.log()["sampled"])


def test_a_keep_pause_holds_generations_in_the_engines_and_versions_each_token_as_the_engine_can_tell(
    two_replicas: Any, qwen3_tokenizer_dir: str
) -> None:
    gw, engines, kind = two_replicas
    client, policy = gw.client, fake_policy(qwen3_tokenizer_dir)
    client.set_weight_version(OLD)
    sids, held = [client.open_session() for _ in KINDS], [client.open_session() for _ in KINDS]
    _paced(engines, sids)
    with ThreadPoolExecutor(2 * len(KINDS)) as pool:
        replies = _start(pool, gw, engines, sids)
        started = time.monotonic()
        report = client.pause_generation("keep", timeout=10)
        assert time.monotonic() - started < 1.0  # the engines' pauses answered: nothing waited to finish
        assert (report.mode, report.workers, report.engine_calls) == ("keep", 2, len(KINDS))  # held in the engines
        controls = [engine.log()["controls"] for engine in engines]
        mode = "keep" if kind == "vllm" else "in_place"
        assert [[(c["call"], c["mode"]) for c in log] for log in controls] == [[("pause", mode)]] * 2  # once each
        sampled = _sampled(engines)
        asked = zip(held, KINDS, strict=True)
        later = [pool.submit(_ask, gw, sid, dialect, stream) for sid, (dialect, stream) in asked]
        assert wait_until(lambda: _held(gw) == len(KINDS), 10)
        time.sleep(10 * TOKEN_S)
        assert _sampled(engines) == sampled  # nothing sampled while paused
        assert all(not _log(engines, sid)["requests"] for sid in held)  # and no engine call made
        assert not any(f.done() for f in replies + later)
        assert client.resume_generation(weight_version=NEW)
        assert all(f.result(timeout=60) for f in replies + later)  # 0 agent errors
    for log in (engine.log()["controls"] for engine in engines):
        calls = [(c["call"], c.get("version"), c.get("aborted")) for c in log[1:]]
        assert calls == ([("resume", None, None)] if kind == "vllm" else [("version", str(NEW), False),
                                                                          ("resume", None, None)])  # fmt: skip
    unknown = 0
    for sid, (_, stream) in zip(sids, KINDS, strict=True):
        log = _log(engines, sid)
        (request,), (sampling,) = log["requests"], log["sampled"]  # one engine call: held, never resubmitted
        body, params = request["body"], request["body"]["sampling_params"]
        prompt = body.get("token_ids") or body["input_ids"]
        ids, logprobs, _ = policy(prompt, params.get("max_tokens", params.get("max_new_tokens")))
        (record,) = client.finish_session(sid, wait_timeout=10)  # one turn, one row
        assert record.token_ids == prompt + ids and record.logprobs == pytest.approx(logprobs, abs=0)
        truth = [OLD if resumes == 0 else NEW for resumes in sampling["resumes"]]
        assert len(truth) == len(ids) and OLD in truth and NEW in truth  # held across the update
        said = record.weight_versions
        assert all(v in (t, -1) for v, t in zip(said, truth, strict=True)), (said, truth)  # never a wrong one
        assert (-1 in said) == bool(record.metadata.get("weight_versions_unknown"))  # flagged where unknown
        unknown += said.count(-1)
        if kind == "sglang" and stream:
            assert said == truth  # SGLang says which version each streamed output came from: exact
    if kind == "vllm":
        assert unknown > 0  # vLLM cannot say: flagged rather than guessed
    for sid in held:
        (record,) = client.finish_session(sid, wait_timeout=10)
        assert set(record.weight_versions) == {NEW} and "weight_versions_unknown" not in record.metadata


@pytest.mark.parametrize("mode", ["wait", "abort"])
def test_wait_and_abort_on_two_replicas_give_every_agent_one_exact_turn(
    two_replicas: Any, qwen3_tokenizer_dir: str, mode: str
) -> None:
    gw, engines, kind = two_replicas
    client, policy = gw.client, fake_policy(qwen3_tokenizer_dir)
    client.set_weight_version(OLD)
    sids = [client.open_session() for _ in KINDS]
    _paced(engines, sids)
    with ThreadPoolExecutor(len(KINDS)) as pool:
        replies = _start(pool, gw, engines, sids)
        report = client.pause_generation(mode, timeout=30)
        assert (report.mode, report.engine_calls, report.workers) == (mode, 0, 2)
        if mode == "abort":
            assert not any(f.done() for f in replies)  # stopped, and held until the resume
        assert client.resume_generation(weight_version=NEW)
        assert all(f.result(timeout=60) for f in replies)  # 0 agent errors
    assert all(not engine.log()["controls"] for engine in engines)  # the engines' own pause is not used
    for sid in sids:
        (record,) = client.finish_session(sid, wait_timeout=10)  # one turn, one row
        per_engine = [engine.log(routing_key(sid))["requests"] for engine in engines]
        (requests,) = [r for r in per_engine if r]  # every part on the same replica
        first, last = requests[0]["body"], requests[-1]["body"]
        prompt, params = first.get("token_ids") or first["input_ids"], first["sampling_params"]
        budget = params.get("max_tokens", params.get("max_new_tokens"))
        sampled, logprobs, _ = policy(prompt, budget)
        if mode == "wait":
            assert len(requests) == 1 and record.token_ids == prompt + sampled
            assert record.weight_versions == [OLD] * len(sampled)
            continue
        assert len(requests) == 2  # stopped, then the rest asked for
        partial = (last.get("token_ids") or last["input_ids"])[len(prompt) :]
        assert partial and partial == sampled[: len(partial)]  # exactly what the replica had sampled
        tail, tail_logprobs, _ = policy(prompt + partial, budget - len(partial))
        assert record.token_ids == prompt + partial + tail
        assert record.logprobs == pytest.approx(logprobs[: len(partial)] + tail_logprobs, abs=0)
        assert record.weight_versions == [OLD] * len(partial) + [NEW] * len(tail)


def test_a_keep_pause_outlives_a_broker_kill_and_its_resume_resumes_every_replica(two_replicas: Any) -> None:
    gw, engines, kind = two_replicas
    client = gw.client
    sids = [client.open_session() for _ in range(4)]
    _paced(engines, sids)
    with ThreadPoolExecutor(len(sids)) as pool:
        replies = [pool.submit(_ask, gw, sid, "chat", k % 2 == 1) for k, sid in enumerate(sids)]
        assert wait_until(lambda: all(len(_log(engines, sid)["requests"]) == 1 for sid in sids), 10)
        client.pause_generation("keep", timeout=10)
        first = broker_pid(gw.process.pid)
        assert first is not None
        os.kill(first, signal.SIGKILL)
        assert wait_until(lambda: broker_pid(gw.process.pid) not in (None, first), timeout=RESTART_WITHIN_S)
        assert wait_until(lambda: client.generation_paused() == "keep", timeout=RESTART_WITHIN_S)  # logged
        assert all(engine.log()["paused"] for engine in engines)
        assert client.resume_generation(weight_version=NEW + 2)
        assert all(f.result(timeout=60) for f in replies)  # 0 agent errors
    assert not any(engine.log()["paused"] for engine in engines)  # every replica resumed
    for sid in sids:
        assert len(client.finish_session(sid, wait_timeout=10)) == 1


def test_a_replica_killed_during_a_keep_pause_loses_no_turn_each_goes_on_at_the_other(
    two_replicas: Any, qwen3_tokenizer_dir: str
) -> None:
    gw, (dying, living), kind = two_replicas
    client, policy = gw.client, fake_policy(qwen3_tokenizer_dir)
    sids, held = [client.open_session() for _ in KINDS], [client.open_session() for _ in KINDS]
    _paced((dying, living), sids)
    with ThreadPoolExecutor(2 * len(KINDS)) as pool:
        replies = _start(pool, gw, (dying, living), sids)
        client.pause_generation("keep", timeout=10)
        on_dying = {sid: r[0]["body"] for sid in sids if (r := dying.log(routing_key(sid))["requests"])}
        asked = zip(held, KINDS, strict=True)
        later = [pool.submit(_ask, gw, sid, dialect, stream) for sid, (dialect, stream) in asked]
        assert wait_until(lambda: _held(gw) == len(KINDS), 10)
        dying.process.kill()  # kill -9, its generations held inside it
        dying.process.wait(10)
        assert client.resume_generation(weight_version=NEW + 1)
        assert all(f.result(timeout=60) for f in replies + later)  # 0 agent errors
    assert on_dying and len(on_dying) < len(sids)  # some turns were on each replica
    for sid in sids:
        (request,) = living.log(routing_key(sid))["requests"]  # the rest, or all of it, from the replica left
        (record,) = client.finish_session(sid, wait_timeout=10)  # one turn, one row
        body, params = request["body"], request["body"]["sampling_params"]
        prompt = body.get("token_ids") or body["input_ids"]
        rest, _, _ = policy(prompt, params.get("max_tokens", params.get("max_new_tokens")))
        assert record.token_ids == prompt + rest  # the replica left sampled after exactly what the row holds
        if sid in on_dying:  # what the dead replica streamed before it died is kept, the rest asked for
            first = on_dying[sid].get("token_ids") or on_dying[sid]["input_ids"]
            partial = prompt[len(first) :]
            assert prompt[: len(first)] == first
            limit = on_dying[sid]["sampling_params"]
            assert partial == policy(first, limit.get("max_tokens", limit.get("max_new_tokens")))[0][: len(partial)]
    for sid in held:
        (record,) = client.finish_session(sid, wait_timeout=10)
        assert set(record.weight_versions) == {NEW + 1} and living.log(routing_key(sid))["requests"]
