"""`rollout-gateway serve` as real subprocesses, driven by the official openai SDK.

Broker + 2 uvicorn workers + the fake engine process (vLLM and SGLang wire formats),
the real Qwen BPE with trl's real qwen3.jinja. Agents run multi-turn tool episodes,
sync and async, streaming and not; the trainer finishes their sessions and every row is
checked against what the engine actually sampled (recomputed from the fake engine's
deterministic policy and its request log) with the shared fidelity checker.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from assets import TOOLS, FakeEngine, wait_until
from fidelity import assert_fidelity
from processes import launch_gateway

from broker.protocol import ids_array, logprobs_array
from broker.sessions.turn_record import TurnRecord
from gateway_workers.engines.routing import routing_key

FAKE_ENGINE = Path(__file__).resolve().parents[1] / "fake_engine.py"
ENGINE_TIMEOUT_S = 4.0
MAX_TURNS = 6


def _fake_policy(tokenizer_dir: str) -> Any:
    """The fake engine's own reply function, to recompute what it sampled for a prompt."""
    import importlib.util

    from tokenizers import Tokenizer

    spec = importlib.util.spec_from_file_location("fake_engine_policy", FAKE_ENGINE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    state = module.State(tokenizer=tok, eos_id=tok.token_to_id("<|im_end|>"), tool_rounds=2)
    return lambda prompt, max_tokens: module.reply(state, prompt, max_tokens)


@pytest.fixture(scope="module")
def gateway(fake_engine: FakeEngine, qwen3_tokenizer_dir: str) -> Iterator[Any]:
    extra = ["--engine-timeout", str(ENGINE_TIMEOUT_S), "--log-level", "warning"]
    with launch_gateway(workers=2, engine_kind="vllm", engine_urls=[fake_engine.url],
                        tokenizer=qwen3_tokenizer_dir, extra_args=extra) as gw:
        yield gw


def _engine_turns(fake_engine: FakeEngine, sid: str, policy: Any) -> list[TurnRecord]:
    """What the engine sampled for one session, in request order."""
    turns = []
    for i, req in enumerate(fake_engine.log(routing_key(sid))["requests"]):
        body = req["body"]
        prompt = body.get("token_ids") or body.get("input_ids")
        params = body["sampling_params"]
        ids, lps, finish = policy(prompt, int(params.get("max_tokens", params.get("max_new_tokens", 16))))
        turns.append(TurnRecord(turn_id=f"t{i}", seq=i, prompt_ids=ids_array(prompt), output_ids=ids_array(ids),
                                logprobs=logprobs_array(lps), finish_reason=finish, prompt_messages=[],
                                response_message={}))
    return turns


def _echo(message: Any, with_reasoning: bool) -> dict[str, Any]:
    echo: dict[str, Any] = {"role": "assistant", "content": message.content or ""}
    reasoning = getattr(message, "reasoning_content", None)
    if with_reasoning and reasoning:
        echo["reasoning_content"] = reasoning
    if message.tool_calls:
        echo["tool_calls"] = [{"id": c.id, "type": "function",
                               "function": {"name": c.function.name, "arguments": c.function.arguments}}
                              for c in message.tool_calls]
    return echo


def _next_messages(messages: list[dict[str, Any]], message: Any, with_reasoning: bool) -> bool:
    """Append the echo and tool results; False when the agent is done."""
    messages.append(_echo(message, with_reasoning))
    for call in message.tool_calls or []:
        args = json.loads(call.function.arguments)  # arguments are JSON strings on the wire
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"ok": True, **args})})
    return bool(message.tool_calls)


def _start(index: int) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You are a careful weather agent."},
            {"role": "user", "content": f"Agent {index}: what is the weather in city number {index}?"}]


def sync_agent(base_url: str, sid: str, index: int, stream: bool, with_reasoning: bool) -> list[Any]:
    client = openai.OpenAI(base_url=base_url, api_key=sid, max_retries=0, timeout=30)
    messages, received = _start(index), []
    for _ in range(MAX_TURNS):
        if stream:
            with client.chat.completions.stream(model="qwen3", messages=messages, tools=TOOLS) as s:
                message = s.get_final_completion().choices[0].message
        else:
            message = client.chat.completions.create(model="qwen3", messages=messages, tools=TOOLS).choices[0].message
        received.append(message)
        if not _next_messages(messages, message, with_reasoning):
            break
    return received


async def async_agent(base_url: str, sid: str, index: int, stream: bool, with_reasoning: bool) -> list[Any]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=sid, max_retries=0, timeout=30)
    messages, received = _start(index), []
    for _ in range(MAX_TURNS):
        if stream:
            chunks = await client.chat.completions.create(model="qwen3", messages=messages, tools=TOOLS, stream=True,
                                                          stream_options={"include_usage": True})
            message, usage = await _accumulate(chunks)
            assert usage is not None and usage.completion_tokens > 0
        else:
            reply = await client.chat.completions.create(model="qwen3", messages=messages, tools=TOOLS)
            message = reply.choices[0].message
        received.append(message)
        if not _next_messages(messages, message, with_reasoning):
            break
    await client.close()
    return received


async def _accumulate(chunks: Any) -> tuple[Any, Any]:
    """Fold raw chunks into a message the way agent loops do by hand."""
    content, reasoning, calls, usage = "", "", {}, None
    async for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
    tool_calls = [openai.types.chat.ChatCompletionMessageToolCall(
        id=c["id"], type="function", function={"name": c["name"], "arguments": c["arguments"]})
        for _, c in sorted(calls.items())] or None
    message = openai.types.chat.ChatCompletionMessage(role="assistant", content=content or None,
                                                      tool_calls=tool_calls, reasoning_content=reasoning or None)
    return message, usage


def test_sixteen_agents_capture_exactly_what_the_engine_sampled(gateway: Any, fake_engine: FakeEngine,
                                                                qwen3_tokenizer_dir: str) -> None:
    kinds = [(sync, stream, reasoning) for sync in (True, False) for stream in (False, True)
             for reasoning in (True, False) for _ in range(2)]
    sids = [gateway.client.open_session(sampling_defaults={"temperature": 1.0}) for _ in kinds]

    async def run_all() -> list[list[Any]]:
        jobs = []
        for i, ((sync, stream, reasoning), sid) in enumerate(zip(kinds, sids, strict=True)):
            if sync:
                jobs.append(asyncio.to_thread(sync_agent, gateway.base_url, sid, i, stream, reasoning))
            else:
                jobs.append(async_agent(gateway.base_url, sid, i, stream, reasoning))
        return await asyncio.gather(*jobs)

    received = asyncio.run(run_all())
    policy = _fake_policy(qwen3_tokenizer_dir)
    for (sync, stream, reasoning), sid, messages in zip(kinds, sids, received, strict=True):
        # The fake engine calls tools (one or two in parallel) until two results are in, then answers.
        assert 2 <= len(messages) <= 3
        assert messages[-1].content.startswith("Final answer after") and not messages[-1].tool_calls
        for message in messages[:-1]:
            assert message.tool_calls and message.reasoning_content
            assert len({c.id for c in message.tool_calls}) == len(message.tool_calls)
        records = gateway.client.finish_session(sid, reward=1.0, rollout_id=f"ep-{sid[:6]}", wait_timeout=10.0)
        turns = _engine_turns(fake_engine, sid, policy)
        assert len(turns) == len(messages)
        assert_fidelity(turns, records)
        for record in records:
            assert record.reward == 1.0 and record.rollout_id == f"ep-{sid[:6]}"
        # qwen3.jinja keeps the <think> blocks after the last user query only if the agent echoes them.
        assert len(records) == (1 if reasoning else len(messages)), (sync, stream, reasoning,
                                                                      [r.metadata for r in records])


def test_mock_engine_default_serve_and_clean_shutdown(qwen3_tokenizer_dir: str) -> None:
    with launch_gateway(workers=1, extra_args=["--log-level", "warning"]) as gw:
        sid = gw.client.open_session()
        client = openai.OpenAI(base_url=gw.base_url, api_key=sid, max_retries=0)
        reply = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].finish_reason == "stop" and reply.choices[0].message.content
        assert [m.id for m in client.models.list()] == [reply.model]
        root = gw.base_url.removesuffix("/v1")
        assert httpx.get(f"{root}/healthz").json()["status"] == "ok"
        assert 'rollout_gateway_turns_total{dialect="chat",outcome="committed",stream="false"}' in httpx.get(
            f"{root}/metrics").text
        answer = reply.choices[0].message.content
        follow_up = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": answer},
                     {"role": "user", "content": "and then?"}]  # fmt: skip
        second = client.chat.completions.create(model="x", messages=follow_up)
        delta_sent = re.compile(r'rollout_gateway_commits_sent_total\{form="delta"\} [1-9]')
        # the second turn's commit extends the first: it travels as a delta
        assert wait_until(lambda: delta_sent.search(httpx.get(f"{root}/metrics").text), timeout=10)
        text = httpx.get(f"{root}/metrics").text
        assert re.search(r"rollout_gateway_render_bpe_twin\{[^}]*\} 1", text)  # the built-in Qwen BPE has a twin
        # every fast twin reports itself; the BPE encode twin has run and been checked, and agreed
        for kind in ("template", "bpe_encode", "token_decode"):
            assert re.search(rf'rollout_gateway_twin_active\{{[^}}]*twin="{kind}"[^}}]*\}} 1', text), kind
        uses = re.search(r'rollout_gateway_twin_checks_total\{[^}]*twin="bpe_encode"[^}]*\} (\d+)', text)
        assert uses is not None and int(uses.group(1)) >= 1
        assert not re.search(r'rollout_gateway_twin_mismatches_total\{[^}]*\} [1-9]', text)
        records = gw.client.finish_session(sid)
        assert sum(sum(r.loss_mask) for r in records) == (
            reply.usage.completion_tokens + second.usage.completion_tokens
        )
        group = os.getpgid(gw.process.pid)
        gw.process.send_signal(signal.SIGTERM)  # serve itself must stop its broker and workers
        gw.process.wait(30)
        assert gw.process.returncode == 0, "".join(gw.output)
        assert wait_until(lambda: not _group_alive(group), 10), "serve left processes behind"


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def _post(gateway: Any, sid: str | None, body: Any, timeout: float = 30) -> httpx.Response:
    headers = {"Authorization": f"Bearer {sid}"} if sid else {}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{gateway.base_url}/chat/completions", content=content, timeout=timeout,
                      headers={**headers, "content-type": "application/json"})


GOOD = {"model": "qwen3", "messages": [{"role": "user", "content": "hello"}]}


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    ({"model": "qwen3"}, "messages"),
    ({"model": "qwen3", "messages": []}, "messages"),
    ({"model": "qwen3", "messages": "hello"}, "messages"),
    ({**GOOD, "temperature": "hot"}, "temperature"),
    ({**GOOD, "n": 2}, "n"),
    ({**GOOD, "logit_bias": {"one": 5}}, "logit_bias"),
    ({**GOOD, "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({**GOOD, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
    ({**GOOD, "max_tokens": 0}, "max_tokens"),
])
def test_bad_input_is_a_400_in_openai_shape_and_records_nothing(gateway: Any, body: Any, param: str | None) -> None:
    sid = gateway.client.open_session()
    reply = _post(gateway, sid, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param:
        assert error["param"] == param
    assert _post(gateway, sid, GOOD).status_code == 200  # the worker is still healthy
    records = gateway.client.finish_session(sid)
    assert len(records) == 1 and records[0].metadata["turn_ids"].__len__() == 1


def test_keys_finished_sessions_and_turn_caps_are_final_4xx(gateway: Any, fake_engine: FakeEngine) -> None:
    assert _post(gateway, None, GOOD).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gateway.base_url, api_key="no-such-session").chat.completions.create(**GOOD)
    capped = gateway.client.open_session(max_turns=1)
    client = openai.OpenAI(base_url=gateway.base_url, api_key=capped)  # default retries: 4xx must not be retried
    client.chat.completions.create(**GOOD)
    with pytest.raises(openai.PermissionDeniedError) as info:
        client.chat.completions.create(**GOOD)
    assert info.value.body["code"] == "turn_cap"
    gateway.client.finish_session(capped)
    before = len(fake_engine.log(routing_key(capped))["requests"])
    started = time.monotonic()
    with pytest.raises(openai.PermissionDeniedError):
        client.chat.completions.create(**GOOD)
    assert time.monotonic() - started < 2, "a finished session must not be retried by the SDK"
    assert len(fake_engine.log(routing_key(capped))["requests"]) == before


def test_penalties_min_p_and_logit_bias_reach_the_engine_the_sessions_under_the_requests(
    gateway: Any, fake_engine: FakeEngine
) -> None:
    """The official SDK's frequency_penalty and logit_bias, and vLLM's min_p (through extra_body), go into the
    engine's sampling params; the session's own defaults fill what the request leaves out."""
    sid = gateway.client.open_session(sampling_defaults={"repetition_penalty": 1.1, "frequency_penalty": 0.1})
    client = openai.OpenAI(base_url=gateway.base_url, api_key=sid)
    client.chat.completions.create(**GOOD, frequency_penalty=0.5, logit_bias={"42": -100}, extra_body={"min_p": 0.05})
    [request] = fake_engine.log(routing_key(sid))["requests"]
    params = request["body"]["sampling_params"]
    assert (params["frequency_penalty"], params["repetition_penalty"], params["min_p"]) == (0.5, 1.1, 0.05)
    assert params["logit_bias"] == {"42": -100.0} and "presence_penalty" not in params
    gateway.client.drop_session(sid)


def test_prompt_over_budget_is_an_empty_length_turn(gateway: Any, fake_engine: FakeEngine) -> None:
    sid = gateway.client.open_session(max_context_tokens=8)
    reply = openai.OpenAI(base_url=gateway.base_url, api_key=sid).chat.completions.create(**GOOD)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 0
    assert fake_engine.log(routing_key(sid))["requests"] == []
    assert sum(sum(r.loss_mask) for r in gateway.client.finish_session(sid)) == 0


def test_a_prompt_proven_over_budget_answers_at_once_and_is_recorded_empty(gateway: Any,
                                                                         fake_engine: FakeEngine) -> None:
    """Far over the budget by its size alone: never tokenized (which would hold the render thread for seconds)."""
    sid = gateway.client.open_session(max_context_tokens=4096)
    agent = openai.OpenAI(base_url=gateway.base_url, api_key=sid)
    first = agent.chat.completions.create(**GOOD)
    assert first.choices[0].finish_reason == "stop"
    huge = {**GOOD, "messages": [*GOOD["messages"], {"role": "assistant", "content": first.choices[0].message.content},
                                 {"role": "user", "content": "a long paste of words " * 300_000}]}  # 6.6 MB
    started = time.monotonic()
    reply = agent.chat.completions.create(**huge)
    took = time.monotonic() - started
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.content in ("", None)
    assert took < 2.0, f"{took:.2f}s: the prompt was tokenized"
    assert len(fake_engine.log(routing_key(sid))["requests"]) == 1  # the engine saw only the first turn
    rows = gateway.client.finish_session(sid)
    assert len(rows) == 1 and rows[0].metadata["decisions"]["empty"] == 1, [r.metadata for r in rows]


def test_engine_500_is_502_and_nothing_is_recorded(gateway: Any, fake_engine: FakeEngine) -> None:
    sid = gateway.client.open_session()
    fake_engine.configure(fault={"status": 500, "times": 1, "key": routing_key(sid)})
    reply = _post(gateway, sid, GOOD)
    assert reply.status_code == 502 and reply.json()["error"]["type"] == "api_error"
    assert gateway.client.finish_session(sid) == []


def test_engine_hang_is_504_within_the_bound(gateway: Any, fake_engine: FakeEngine) -> None:
    sid = gateway.client.open_session()
    fake_engine.configure(fault={"hang": True, "key": routing_key(sid)})
    started = time.monotonic()
    reply = _post(gateway, sid, GOOD)
    assert reply.status_code == 504
    assert time.monotonic() - started < ENGINE_TIMEOUT_S + 3
    assert gateway.client.finish_session(sid) == []


def test_sglang_disconnect_aborts_the_engine_request_and_records_nothing(fake_engine: FakeEngine,
                                                                        qwen3_tokenizer_dir: str) -> None:
    with launch_gateway(workers=1, engine_kind="sglang", engine_urls=[fake_engine.url],
                        tokenizer=qwen3_tokenizer_dir, extra_args=["--log-level", "warning"]) as gw:
        sid = gw.client.open_session()
        client = openai.OpenAI(base_url=gw.base_url, api_key=sid, max_retries=0)
        ok = client.chat.completions.create(model="q", messages=[{"role": "user", "content": "hi"}], tools=TOOLS)
        assert ok.choices[0].message.tool_calls  # the SGLang wire format carries a full tool turn
        key = routing_key(sid)
        fake_engine.configure(fault={"delay": 5.0, "key": key})
        with pytest.raises(openai.APITimeoutError):
            client.with_options(timeout=0.5).chat.completions.create(model="q", messages=[
                {"role": "user", "content": "slow"}])
        assert wait_until(lambda: len(fake_engine.log(key)["aborts"]) == 1, 10), fake_engine.log(key)
        rid = fake_engine.log(key)["aborts"][0]["rid"]
        assert rid == fake_engine.log(key)["requests"][-1]["rid"]
        records = gw.client.finish_session(sid, wait_timeout=5.0)
        assert len(records) == 1 and len(records[0].metadata["turn_ids"]) == 1  # only the first turn
