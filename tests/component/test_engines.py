"""Engine backends over real HTTP against the fake engine process (vLLM and SGLang formats), routing, mock."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time
import uuid
from array import array
from pathlib import Path

import fake_engine as fake
import pytest
from assets import TOOLS, FakeEngine, wait_until
from tokenizers import Tokenizer

from gateway_workers.engines import EngineConfig, EngineError, EngineTimeout, SamplingParams, create_engine
from gateway_workers.engines import sglang as sglang_backend
from gateway_workers.engines import vllm as vllm_backend
from gateway_workers.engines.mock import MockEngine
from gateway_workers.engines.routing import choose_replica, routing_headers, routing_key
from gateway_workers.formats import detect_parser
from gateway_workers.rendering.renderer import Renderer

PARAMS = SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9, top_k=20, seed=7)
TIMEOUT_S = 0.5  # the engine bound used by the fault tests
SLACK_S = 1.0  # scheduling + the abort round trip on top of the bound
LOG_WAIT_S = 5.0
CONVERSATION = [
    {"role": "system", "content": "Use tools when useful."},
    {"role": "user", "content": "Weather in Paris tomorrow?"},
]


@pytest.fixture(scope="module")
def prompt(qwen3_tokenizer) -> array:
    return Renderer(qwen3_tokenizer).render(CONVERSATION, TOOLS).prompt_ids


@pytest.fixture(scope="module")
def policy(qwen3_tokenizer_dir) -> fake.State:
    """The fake engine's own policy, to compute the exact reply it must have sent."""
    tokenizer = Tokenizer.from_file(str(Path(qwen3_tokenizer_dir) / "tokenizer.json"))
    return fake.State(tokenizer=tokenizer, eos_id=tokenizer.token_to_id("<|im_end|>"), tool_rounds=2)


def new_session() -> tuple[str, str]:
    """(session id, its routing key): unique per test, so faults and logs are scoped to the test."""
    sid = f"sk-{uuid.uuid4().hex}"
    return sid, routing_key(sid)


def engine(kind: str, urls: list[str], **overrides: object):
    return create_engine(EngineConfig(kind=kind, urls=tuple(urls), **overrides), None)  # type: ignore[arg-type]


async def generate(eng, prompt_ids, params: SamplingParams, sid: str, rid: str):
    try:
        return await eng.generate(prompt_ids, params, session_id=sid, request_id=rid)
    finally:
        await eng.aclose()


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_generate_returns_the_engines_exact_ids_and_logprobs(kind, fake_engine, prompt, policy, qwen3_tokenizer):
    sid, key = new_session()
    rid = f"turn-{uuid.uuid4().hex}"
    result = asyncio.run(generate(engine(kind, [fake_engine.url]), prompt, PARAMS, sid, rid))
    ids, logprobs, finish = fake.reply(policy, list(prompt), PARAMS.max_tokens)
    assert (result.output_ids, result.logprobs, result.finish_reason) == (ids, logprobs, "stop")
    assert result.output_ids[-1] == qwen3_tokenizer.eos_token_id
    assert array("f", result.logprobs).tolist() == result.logprobs  # exact in float32
    parsed = detect_parser(qwen3_tokenizer).parse(result.output_ids, prompt, TOOLS)
    assert not parsed.ill_formed and 1 <= len(parsed.tool_calls) <= 2 and parsed.reasoning

    (request,) = fake_engine.log(key)["requests"]
    headers = request["headers"]
    assert headers["x-session-id"] == headers["x-smg-routing-key"] == key
    assert all(sid not in value for value in headers.values())  # the API key never leaves the gateway
    if kind == "vllm":
        assert headers["x-request-id"] == rid
        assert request["body"] == {
            "request_id": rid,
            "token_ids": list(prompt),
            "sampling_params": {
                "max_tokens": 64,
                "logprobs": 0,
                "temperature": 0.7,
                "top_p": 0.9,
                "top_k": 20,
                "seed": 7,
                "detokenize": False,
            },
            "stream": False,
        }
    else:
        assert request["body"] == {
            "input_ids": list(prompt),
            "sampling_params": {
                "max_new_tokens": 64,
                "skip_special_tokens": False,
                "temperature": 0.7,
                "top_p": 0.9,
                "top_k": 20,
                "sampling_seed": 7,
            },
            "return_logprob": True,
            "logprob_start_len": -1,
            "rid": rid,
            "stream": False,
        }


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_max_tokens_cut_finishes_with_length(kind, fake_engine, prompt, policy):
    sid, _ = new_session()
    params = SamplingParams(max_tokens=5)
    result = asyncio.run(generate(engine(kind, [fake_engine.url]), prompt, params, sid, "r-len"))
    assert result.finish_reason == "length" and len(result.output_ids) == len(result.logprobs) == 5
    assert result.output_ids == fake.reply(policy, list(prompt), 5)[0]
    assert policy.eos_id not in result.output_ids


def test_stop_strings_are_sent_and_keep_detokenizing():
    params = SamplingParams(max_tokens=8, stop=("END", "\n\n"))
    assert vllm_backend.sampling_body(params) == {"max_tokens": 8, "logprobs": 0, "stop": ["END", "\n\n"]}
    assert sglang_backend.sampling_body(params) == {
        "max_new_tokens": 8,
        "skip_special_tokens": False,
        "stop": ["END", "\n\n"],
    }


def test_penalties_min_p_and_logit_bias_go_under_the_engines_own_names():
    """vLLM's `SamplingParams` and SGLang's take the same names; logit_bias keys are token ids as JSON strings."""
    wanted = {"frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 1.1, "min_p": 0.05,
              "logit_bias": {"42": -100.0, "7": 2.5}}
    params = SamplingParams(max_tokens=8, more=wanted)
    assert vllm_backend.sampling_body(params) == {"max_tokens": 8, "logprobs": 0, "detokenize": False, **wanted}
    assert sglang_backend.sampling_body(params) == {"max_new_tokens": 8, "skip_special_tokens": False, **wanted}


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_http_500_is_an_engine_error_with_the_body(kind, fake_engine, prompt):
    sid, key = new_session()
    fake_engine.configure(fault={"key": key, "status": 500, "times": 1})
    with pytest.raises(EngineError, match="HTTP 500: .*injected fault") as info:
        asyncio.run(generate(engine(kind, [fake_engine.url]), prompt, PARAMS, sid, "r-500"))
    assert info.value.status == 500 and not isinstance(info.value, EngineTimeout)
    # Injected once: the next call goes through.
    result = asyncio.run(generate(engine(kind, [fake_engine.url]), prompt, PARAMS, sid, "r-500b"))
    assert result.finish_reason == "stop"


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_hung_engine_times_out_within_the_bound(kind, fake_engine, prompt):
    sid, key = new_session()
    fake_engine.configure(fault={"key": key, "hang": True})
    started = time.monotonic()
    with pytest.raises(EngineTimeout, match=f"within {TIMEOUT_S}s"):
        eng = engine(kind, [fake_engine.url], request_timeout_s=TIMEOUT_S)
        asyncio.run(generate(eng, prompt, PARAMS, sid, "r-hang"))
    assert TIMEOUT_S <= time.monotonic() - started < TIMEOUT_S + SLACK_S
    if kind == "sglang":  # a timed-out SGLang request is aborted, not left generating
        assert wait_until(lambda: fake_engine.log(key)["aborts"], LOG_WAIT_S)
        assert [a["rid"] for a in fake_engine.log(key)["aborts"]] == ["r-hang"]
    else:  # for vLLM the closed connection is the abort
        assert wait_until(lambda: fake_engine.log(key)["disconnects"], LOG_WAIT_S)


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_cancelled_generate_aborts_the_engine_request(kind, fake_engine, prompt):
    sid, key = new_session()
    fake_engine.configure(fault={"key": key, "hang": True})

    async def scenario() -> None:
        eng = engine(kind, [fake_engine.url])
        task = asyncio.create_task(eng.generate(prompt, PARAMS, session_id=sid, request_id="r-cancel"))
        try:
            arrived = await asyncio.to_thread(wait_until, lambda: fake_engine.log(key)["requests"], LOG_WAIT_S)
            assert arrived, "the request never reached the engine"
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            await eng.aclose()

    asyncio.run(scenario())
    if kind == "sglang":
        # The abort was sent (shielded) before the cancellation finished propagating.
        assert [a["rid"] for a in fake_engine.log(key)["aborts"]] == ["r-cancel"]
        assert fake_engine.log(key)["aborts"][0]["headers"]["x-smg-routing-key"] == key
    else:
        assert wait_until(lambda: fake_engine.log(key)["disconnects"], LOG_WAIT_S)
        assert fake_engine.log(key)["aborts"] == []


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_unreachable_engine_is_an_engine_error(kind, prompt):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again before use: nothing listens there
    started = time.monotonic()
    with pytest.raises(EngineError, match="request failed"):
        asyncio.run(generate(engine(kind, [f"http://127.0.0.1:{port}"]), prompt, PARAMS, "s", "r"))
    assert time.monotonic() - started < SLACK_S


def test_unusable_answers_are_engine_errors():
    url = "http://engine"
    good_choice = {
        "token_ids": [1, 2],
        "finish_reason": "stop",
        "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -1.0}]},
    }
    assert vllm_backend.parse_answer(url, {"choices": [good_choice]}).logprobs == [-0.5, -1.0]
    ints = {**good_choice, "logprobs": {"content": [{"logprob": 0}, {"logprob": -1.0}]}}
    assert [type(v) for v in vllm_backend.parse_answer(url, {"choices": [ints]}).logprobs] == [float, float]
    bad_vllm = [
        {},
        {"choices": []},
        {"choices": [{**good_choice, "logprobs": None}]},
        {"choices": [{**good_choice, "token_ids": [1]}]},
        {"choices": [{**good_choice, "token_ids": [1, "2"]}]},
        {"choices": [{**good_choice, "token_ids": [1, True]}]},
        {"choices": [{**good_choice, "logprobs": {"content": [{"logprob": -0.5}, {"logprob": "-1"}]}}]},
        {"choices": [{**good_choice, "logprobs": {"content": [{"logprob": -0.5}, {"p": -1.0}]}}]},
        {"choices": [{**good_choice, "logprobs": {"content": [{"logprob": -0.5}, [-1.0]]}}]},
        {"choices": [{**good_choice, "finish_reason": "error"}]},
    ]
    for answer in bad_vllm:
        with pytest.raises(EngineError):
            vllm_backend.parse_answer(url, answer)
    meta = {"finish_reason": {"type": "stop", "matched": 7}, "output_token_logprobs": [[-0.25, 9, None]]}
    stopped = sglang_backend.parse_answer(url, {"output_ids": [9], "meta_info": meta})
    assert (stopped.output_ids, stopped.logprobs, stopped.finish_reason) == ([9], [-0.25], "stop")
    two = sglang_backend.parse_answer(url, {"meta_info": {**meta, "output_token_logprobs": [[0, 9, "a"], (-1.5, 7)]}})
    assert (two.output_ids, two.logprobs) == ([9, 7], [0.0, -1.5])
    assert [type(v) for v in two.logprobs] == [float, float]
    bad_sglang = [
        {"output_ids": [9]},
        {"meta_info": {**meta, "output_token_logprobs": None}},
        {"output_ids": [8], "meta_info": meta},
        {"meta_info": {**meta, "finish_reason": {"type": "weird"}}},
    ] + [
        {"meta_info": {**meta, "output_token_logprobs": [[-0.5, 8, None], entry]}}
        for entry in ([None, 9, None], [-0.5, True, None], [False, 9, None], [-0.5, 9.0, None], [-0.5, "9", None],
                      ["-0.5", 9, None], [-0.5], {"logprob": -0.5, "id": 9}, None)
    ]
    for answer in bad_sglang:
        with pytest.raises(EngineError):
            sglang_backend.parse_answer(url, answer)


def test_rendezvous_routing_is_sticky_balanced_and_minimal():
    urls = ["http://a:1", "http://b:2", "http://c:3"]
    keys = [routing_key(f"session-{i}") for i in range(300)]
    placement = {k: choose_replica(urls, k) for k in keys}
    assert all(choose_replica(list(reversed(urls)), k) == placement[k] for k in keys)  # order-free, stable
    counts = {u: list(placement.values()).count(u) for u in urls}
    assert min(counts.values()) >= 60, counts
    # Dropping a replica moves only the sessions that were on it.
    survivors = [u for u in urls if u != "http://b:2"]
    for k in keys:
        if placement[k] != "http://b:2":
            assert choose_replica(survivors, k) == placement[k]
    key = routing_key("sk-secret")
    assert "sk-secret" not in key and len(key) == 32
    assert routing_headers(key) == {"X-Session-ID": key, "X-SMG-Routing-Key": key}


def test_sessions_stick_to_one_replica_over_http(fake_engine, qwen3_tokenizer_dir, prompt):
    with FakeEngine(qwen3_tokenizer_dir) as second:
        replicas = [fake_engine.url, second.url]
        sessions = [new_session() for _ in range(12)]

        async def traffic() -> None:
            eng = engine("vllm", replicas)
            try:
                for turn in range(2):
                    calls = [eng.generate(prompt, PARAMS, session_id=s, request_id=f"{s}-{turn}") for s, _ in sessions]
                    await asyncio.gather(*calls)
            finally:
                await eng.aclose()

        asyncio.run(traffic())
        used = set()
        for sid, key in sessions:
            hits = [len(e.log(key)["requests"]) for e in (fake_engine, second)]
            assert sorted(hits) == [0, 2], (sid, hits)  # both turns on one replica
            expected = choose_replica(replicas, key)
            assert hits[replicas.index(expected)] == 2
            used.add(expected)
        assert used == set(replicas)


# --- the built-in mock engine --------------------------------------------------------------------


def mock(tokenizer, **overrides: object) -> MockEngine:
    return create_engine(EngineConfig(kind="mock", **overrides), tokenizer)  # type: ignore[arg-type,return-value]


def test_mock_is_deterministic_and_seeded(builtin_tokenizer):
    prompt_ids = Renderer(builtin_tokenizer).render(CONVERSATION).prompt_ids

    def run(eng: MockEngine, ids, params: SamplingParams = PARAMS):
        return asyncio.run(eng.generate(ids, params, session_id="a", request_id="1"))

    first = run(mock(builtin_tokenizer), prompt_ids)
    again = asyncio.run(mock(builtin_tokenizer).generate(list(prompt_ids), PARAMS, session_id="b", request_id="2"))
    assert first == again
    other_seed = run(mock(builtin_tokenizer, seed=1), prompt_ids)
    other_prompt = run(mock(builtin_tokenizer), prompt_ids[:-1])
    assert other_seed.output_ids != first.output_ids and other_prompt.output_ids != first.output_ids
    assert first.finish_reason == "stop" and first.output_ids[-1] == builtin_tokenizer.eos_token_id
    assert len(first.logprobs) == len(first.output_ids)
    assert array("f", first.logprobs).tolist() == first.logprobs and all(lp < 0 for lp in first.logprobs)
    parsed = detect_parser(builtin_tokenizer).parse(first.output_ids, prompt_ids)
    assert not parsed.ill_formed and parsed.reasoning and parsed.content and not parsed.tool_calls
    cut = run(mock(builtin_tokenizer), prompt_ids, dataclasses.replace(PARAMS, max_tokens=4))
    assert cut.finish_reason == "length" and cut.output_ids == first.output_ids[:4]


def test_mock_emits_parseable_tool_calls_on_schedule(builtin_tokenizer):
    renderer, parser = Renderer(builtin_tokenizer), detect_parser(builtin_tokenizer)
    eng = mock(builtin_tokenizer, mock_tool_call_every=2, mock_output_tokens=8)
    conversation = list(CONVERSATION)
    kinds = []
    for turn in range(4):
        rendered = renderer.render(conversation, TOOLS)
        result = asyncio.run(eng.generate(rendered.prompt_ids, PARAMS, session_id="s", request_id=str(turn)))
        parsed = parser.parse(result.output_ids, rendered.text, TOOLS)
        assert not parsed.ill_formed, parsed.error
        kinds.append("call" if parsed.tool_calls else "text")
        for call in parsed.tool_calls:
            assert call["name"] in {"get_weather", "search"}
            if call["name"] == "get_weather":
                assert isinstance(call["arguments"]["city"], str) and isinstance(call["arguments"]["days"], int)
        conversation.append(parsed.canonical_message())
        conversation += [{"role": "tool", "content": "ok"} for _ in parsed.tool_calls]
        if not parsed.tool_calls:
            conversation.append({"role": "user", "content": "go on"})
    assert kinds == ["text", "call", "text", "call"]  # every 2nd assistant turn calls a tool
    # No tools offered: never a call.
    plain = asyncio.run(eng.generate(renderer.render(CONVERSATION).prompt_ids, PARAMS, session_id="s", request_id="x"))
    assert not parser.parse(plain.output_ids, "").tool_calls


def test_mock_reads_the_tools_of_a_hostile_prompt_in_linear_time(builtin_tokenizer):
    """A client controls the prompt: thousands of unclosed `<tools>` must not stall the worker's event loop."""
    eng = mock(builtin_tokenizer, mock_tool_call_every=1, mock_output_tokens=8)
    hostile = builtin_tokenizer.encode("<tools>\n" * 4000, add_special_tokens=False)[:8000]
    started = time.perf_counter()
    result = asyncio.run(eng.generate(hostile, PARAMS, session_id="s", request_id="h"))
    assert time.perf_counter() - started < 0.3  # rescanning the rest from every open took seconds
    assert "<tool_call>" not in builtin_tokenizer.decode(result.output_ids)  # no tools were declared


def test_mock_delay_is_honoured_and_cancellable(builtin_tokenizer):
    prompt_ids = Renderer(builtin_tokenizer).render(CONVERSATION).prompt_ids
    eng = mock(builtin_tokenizer, mock_delay_s=0.2, mock_per_token_s=0.001, mock_output_tokens=10)
    started = time.monotonic()
    result = asyncio.run(eng.generate(prompt_ids, PARAMS, session_id="s", request_id="1"))
    assert time.monotonic() - started >= 0.2 + 0.001 * len(result.output_ids)

    async def cancel_early() -> float:
        slow = mock(builtin_tokenizer, mock_delay_s=30.0)
        task = asyncio.create_task(slow.generate(prompt_ids, PARAMS, session_id="s", request_id="2"))
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic() - t0

    assert asyncio.run(cancel_early()) < 0.5


def test_engine_config_is_validated():
    with pytest.raises(ValueError, match="needs at least one engine URL"):
        EngineConfig(kind="vllm")
    with pytest.raises(ValueError, match="mock, vllm or sglang"):
        EngineConfig(kind="tgi")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive"):
        EngineConfig(kind="mock", request_timeout_s=0)
    assert type(engine("sglang", ["http://x"])).__name__ == "SglangEngine"
    assert type(engine("vllm", ["http://x/"])).__name__ == "VllmEngine"
