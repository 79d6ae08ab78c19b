"""Engine faults through a real `serve`, under load, driven by the official SDKs with their default retries on.

One gateway per engine wire format (vLLM, SGLang) on the fake engine, with one worker (so its /metrics
holds every count) and a short --engine-timeout. Each fault strikes one agent's session while healthy
agents run tool episodes on theirs. For each fault: what the agent sees (a real reply once its SDK's
retries outlast the fault, the SDK's exception when they do not, or, mid-stream, its dialect's error
event), that the trainer's rows hold exactly the replies the agents received, checked against the fake
engine's own log, that the worker counted the fault once against its replica and logged its cause once,
and that it stays healthy.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import anthropic
import httpx
import openai
import pytest
from assets import TOOLS, FakeEngine, wait_until
from dialects import engine_turns, fake_policy, text_policy
from fidelity import assert_fidelity
from processes import launch_gateway
from scrapes import scrape

from broker.protocol import session_tag
from gateway_workers.engines.routing import routing_key

ENGINE_TIMEOUT_S = 1.5
SDK_TIMEOUT_S = 30.0  # the agents' own bound, far above the gateway's
LOAD_AGENTS = 2
LOAD_JOIN_S = 60.0
ACCESS_LOGGER = "rollout_gateway.access"  # the one line per failed request, beside the cause
LOG_WAIT_S = 10.0
MID = 6  # mid-stream faults strike after this many tokens: the agent has had deltas by then
TOKEN_DELAY_S = 0.02  # mid-stream: the engine is still generating when the fault strikes
QUESTION = [{"role": "user", "content": "What is the capital of Peru?"}]

# Faults that strike before the first byte of the reply: (fault, stream, dialect, kind counted).
BEFORE_REPLY: dict[str, tuple[dict[str, Any], bool, str, str]] = {
    "status 500": ({"status": 500}, False, "chat", "status"),
    "status 503 to a stream": ({"status": 503}, True, "anthropic", "status"),
    "status 400": ({"status": 400}, False, "responses", "status"),  # the engine refused what we sent: ours, a 502
    "hang": ({"hang": True}, False, "chat", "timeout"),
    "hang before a stream's first token": ({"hang": True}, True, "anthropic", "timeout"),
    "drop": ({"drop_after": 0}, False, "anthropic", "connection"),
    "drop before a stream's first token": ({"drop_after": 0}, True, "chat", "connection"),
    "no finish reason": ({"answer": "no_finish"}, False, "chat", "incomplete"),
    "aborted by the engine": ({"answer": "aborted"}, False, "anthropic", "incomplete"),
    "aborted at a stream's first token": ({"answer": "aborted"}, True, "responses", "incomplete"),
    "json body to a stream": ({"answer": "json"}, True, "chat", "bad_answer"),
    "stream to a non-stream request": ({"answer": "sse"}, False, "chat", "bad_answer"),
    "garbage to a stream": ({"answer": "garbage"}, True, "anthropic", "incomplete"),
    "no ids": ({"answer": "no_ids"}, False, "chat", "bad_answer"),
    "no ids in a stream": ({"answer": "no_ids"}, True, "responses", "bad_answer"),
    "short logprobs": ({"answer": "short_logprobs"}, False, "anthropic", "bad_answer"),
    "short logprobs in a stream": ({"answer": "short_logprobs"}, True, "chat", "bad_answer"),
}
# Faults that strike once deltas were sent: (fault, dialect, kind counted, whether the engine is still generating).
MID_STREAM: dict[str, tuple[dict[str, Any], str, str, bool]] = {
    "error event": ({"error_after": MID}, "chat", "error_event", False),
    "drop": ({"drop_after": MID}, "anthropic", "connection", False),
    "hang": ({"hang_after": MID}, "responses", "timeout", True),
    "no finish reason": ({"answer": "no_finish"}, "chat", "incomplete", False),
    "aborted by the engine": ({"answer": "aborted", "answer_after": MID}, "anthropic", "incomplete", False),
    "garbage": ({"answer": "garbage", "answer_after": MID}, "responses", "incomplete", False),
    "short logprobs": ({"answer": "short_logprobs", "answer_after": MID}, "chat", "bad_answer", True),
}
# A degenerate model's reply: a 40k-space run in its text. The format's patterns took seconds on such a reply
# before 31b5bc3, holding the worker's event loop (docs/performance.md, "Degenerate replies").
DEGENERATE = "<think>\nr\n</think>\n\nx" + " " * 40_000 + "y"
DEGENERATE_REPLIES = 3
DEGENERATE_WITHIN_S = 3.0  # the verdict takes milliseconds, the reply's HTTP and capture a few more
OTHERS_WITHIN_S = 2.0  # another agent's one-turn request on the same worker meanwhile


class StreamFailed(Exception):
    """A Responses stream ended with `response.failed` (the SDK yields it as an event, never raises)."""


# What each dialect's SDK surfaces when the stream fails after it started.
MID_STREAM_ERRORS: dict[str, type[Exception]] = {
    "chat": openai.APIError,
    "anthropic": anthropic.APIStatusError,
    "responses": StreamFailed,
}


@pytest.fixture(scope="module", params=["vllm", "sglang"])
def engine_kind(request: Any) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def gateway(engine_kind: str, fake_engine: FakeEngine, qwen3_tokenizer_dir: str) -> Iterator[Any]:
    extra = ["--engine-timeout", str(ENGINE_TIMEOUT_S), "--log-level", "warning"]
    with launch_gateway(workers=1, engine_kind=engine_kind, engine_urls=[fake_engine.url],
                        tokenizer=qwen3_tokenizer_dir, extra_args=extra) as gw:
        yield gw


def _ask(gateway: Any, sid: str, dialect: str, stream: bool, seen: list[str]) -> str:
    """One request through the dialect's official SDK (default retries); the reply's text.

    Streamed reasoning and text deltas are appended to `seen` as they arrive; the SDK's exceptions propagate.
    """
    root = gateway.base_url.removesuffix("/v1")
    if dialect == "chat":
        with openai.OpenAI(base_url=gateway.base_url, api_key=sid, timeout=SDK_TIMEOUT_S) as client:
            if not stream:
                return client.chat.completions.create(model="q", messages=QUESTION).choices[0].message.content or ""
            text = ""
            for chunk in client.chat.completions.create(model="q", messages=QUESTION, stream=True):
                for choice in chunk.choices:
                    piece = choice.delta.content or getattr(choice.delta, "reasoning_content", None) or ""
                    seen.append(piece)
                    text += choice.delta.content or ""
            return text
    if dialect == "anthropic":
        with anthropic.Anthropic(base_url=root, api_key=sid, timeout=SDK_TIMEOUT_S) as claude:
            kwargs: dict[str, Any] = {"model": "q", "max_tokens": 256, "messages": QUESTION}
            if not stream:
                message = claude.messages.create(**kwargs)
            else:
                with claude.messages.stream(**kwargs) as events:
                    for event in events:
                        if event.type == "content_block_delta" and event.delta.type in ("text_delta", "thinking_delta"):
                            seen.append(getattr(event.delta, "text", None) or getattr(event.delta, "thinking", ""))
                    message = events.get_final_message()
            return "".join(block.text for block in message.content if block.type == "text")
    with openai.OpenAI(base_url=gateway.base_url, api_key=sid, timeout=SDK_TIMEOUT_S) as client:
        if not stream:
            return client.responses.create(model="q", input=QUESTION[0]["content"]).output_text
        text = ""
        for event in client.responses.create(model="q", input=QUESTION[0]["content"], stream=True):
            if event.type in ("response.reasoning_text.delta", "response.output_text.delta"):
                seen.append(event.delta)
            if event.type == "response.completed":
                text = event.response.output_text
            if event.type == "response.failed":
                raise StreamFailed(event.response.error.message if event.response.error else "")
        return text


def _episode(gateway: Any, sid: str, stream: bool) -> int:
    """A healthy agent's tool episode (tool calls until the final answer); the number of replies it received."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Quito and Lima?"}]
    with openai.OpenAI(base_url=gateway.base_url, api_key=sid, timeout=SDK_TIMEOUT_S) as client:
        for replies in range(1, 5):
            if stream:
                with client.chat.completions.stream(model="q", messages=messages, tools=TOOLS) as s:
                    message = s.get_final_completion().choices[0].message
            else:
                message = client.chat.completions.create(model="q", messages=messages, tools=TOOLS).choices[0].message
            echo: dict[str, Any] = {"role": "assistant", "content": message.content or "",
                                    "reasoning_content": getattr(message, "reasoning_content", None) or ""}
            if not message.tool_calls:
                return replies
            echo["tool_calls"] = [{"id": c.id, "type": "function",
                                   "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                  for c in message.tool_calls]
            messages += [echo] + [{"role": "tool", "tool_call_id": c.id, "content": '{"ok": true}'}
                                  for c in message.tool_calls]
    raise AssertionError("the fake engine's episode did not end")


@contextmanager
def _under_load(gateway: Any, fake_engine: FakeEngine, qwen3_tokenizer_dir: str) -> Iterator[None]:
    """Healthy agents run episodes back to back on their own sessions while the block runs; checked after."""
    stop = threading.Event()

    def agent(index: int) -> list[tuple[str, int]]:
        done = []
        while not stop.is_set() or not done:
            sid = gateway.client.open_session()
            done.append((sid, _episode(gateway, sid, stream=(index + len(done)) % 2 == 1)))
        return done

    with ThreadPoolExecutor(LOAD_AGENTS) as pool:
        agents: list[Future[list[tuple[str, int]]]] = [pool.submit(agent, i) for i in range(LOAD_AGENTS)]
        try:
            yield
        finally:
            stop.set()
        episodes = [episode for future in agents for episode in future.result(timeout=LOAD_JOIN_S)]
    policy = fake_policy(qwen3_tokenizer_dir)
    for sid, replies in episodes:  # every healthy reply trained exactly once, nothing else
        turns = engine_turns(fake_engine, sid, policy)
        assert len(fake_engine.log(routing_key(sid))["requests"]) == len(turns) == replies
        assert_fidelity(turns, gateway.client.finish_session(sid, wait_timeout=10.0))


def _faults(gateway: Any) -> Counter[tuple[str, str]]:
    samples = scrape(gateway.base_url.removesuffix("/v1"))
    return Counter({(labels["replica"], labels["kind"]): int(v) for (name, pairs), v in samples.items()
                    if name == "rollout_gateway_engine_errors_total" and (labels := dict(pairs))})


def _assert_healthy(gateway: Any) -> None:
    assert httpx.get(gateway.base_url.removesuffix("/v1") + "/healthz", timeout=10).json()["status"] == "ok"


@contextmanager
def _logged_once_per_fault(gateway: Any, fake_engine: FakeEngine, sid: str, faults: int) -> Iterator[None]:
    """The block's engine faults logged once each: one line naming the engine and the session by its tag (the
    cause), and the failed request's one access line, which names the session by its tag too.

    Around the whole test: any line naming the engine that the block added is counted, so a second line for
    the same failure (written right after the first, well before the block's last checks) is caught too.
    """
    tag = session_tag(sid)

    def engine_lines() -> list[str]:
        return [line for line in list(gateway.output) if fake_engine.url in line and ACCESS_LOGGER not in line]

    def access_lines() -> list[str]:
        return [line for line in list(gateway.output) if ACCESS_LOGGER in line and tag in line]

    earlier, earlier_access = len(engine_lines()), len(access_lines())  # far below the output's bound of kept lines
    yield
    assert wait_until(lambda: len(engine_lines()) - earlier >= faults, LOG_WAIT_S), engine_lines()[earlier:]
    added = engine_lines()[earlier:]
    assert len(added) == faults and all(tag in line for line in added), added
    assert wait_until(lambda: len(access_lines()) - earlier_access >= faults, LOG_WAIT_S)
    assert len(access_lines()) - earlier_access == faults, access_lines()[earlier_access:]
    assert not [line for line in list(gateway.output) if sid in line]  # the key itself is never logged


def _assert_trained_exactly(gateway: Any, fake_engine: FakeEngine, sid: str, replies: int, tokenizer_dir: str) -> None:
    """The rows hold exactly the replies the agent received: what the engine answered without a fault."""
    turns = engine_turns(fake_engine, sid, fake_policy(tokenizer_dir))
    assert len(turns) == replies
    rows = gateway.client.finish_session(sid, wait_timeout=10.0)
    assert_fidelity(turns, rows)
    assert sum(sum(row.loss_mask) for row in rows) == sum(len(t.output_ids) for t in turns)


@pytest.mark.parametrize("name", list(BEFORE_REPLY))
def test_a_fault_before_the_reply_is_a_5xx_the_sdk_retries_and_only_the_reply_is_trained(
    gateway: Any, fake_engine: FakeEngine, qwen3_tokenizer_dir: str, name: str
) -> None:
    fault, stream, dialect, kind = BEFORE_REPLY[name]
    sid = gateway.client.open_session()
    before = _faults(gateway)
    with _logged_once_per_fault(gateway, fake_engine, sid, 1):
        fake_engine.configure(fault={**fault, "times": 1, "key": routing_key(sid)})
        with _under_load(gateway, fake_engine, qwen3_tokenizer_dir):
            text = _ask(gateway, sid, dialect, stream, [])
        assert text.startswith("Final answer")  # the SDK retried the 5xx and got the engine's real reply
        assert [r["fault"] is None for r in fake_engine.log(routing_key(sid))["requests"]] == [False, True]
        _assert_trained_exactly(gateway, fake_engine, sid, 1, qwen3_tokenizer_dir)
        assert _faults(gateway) - before == Counter({(fake_engine.url, kind): 1})
        _assert_healthy(gateway)


@pytest.mark.parametrize("name", list(MID_STREAM))
def test_a_fault_mid_stream_is_the_dialects_error_event_and_nothing_of_it_is_trained(
    gateway: Any, engine_kind: str, fake_engine: FakeEngine, qwen3_tokenizer_dir: str, name: str
) -> None:
    fault, dialect, kind, generating = MID_STREAM[name]
    sid = gateway.client.open_session()
    key = routing_key(sid)
    before = _faults(gateway)
    seen: list[str] = []
    with _logged_once_per_fault(gateway, fake_engine, sid, 1):
        fake_engine.configure(fault={**fault, "token_delay": TOKEN_DELAY_S, "times": 1, "key": key})
        with _under_load(gateway, fake_engine, qwen3_tokenizer_dir):
            with pytest.raises(MID_STREAM_ERRORS[dialect], match="inference engine"):
                _ask(gateway, sid, dialect, True, seen)
            assert "".join(seen), "the fault struck before any delta reached the agent"
            (failed,) = fake_engine.log(key)["requests"]
            assert failed["fault"] is not None
            if generating:  # the engine request the gateway gave up on is stopped, not left generating
                stopped = "aborts" if engine_kind == "sglang" else "disconnects"
                assert wait_until(lambda: fake_engine.log(key)[stopped], LOG_WAIT_S), fake_engine.log(key)
                assert engine_kind == "sglang" or fake_engine.log(key)["streamed"] == []
            assert _ask(gateway, sid, dialect, True, []).startswith("Final answer")  # the agent asks again itself
        _assert_trained_exactly(gateway, fake_engine, sid, 1, qwen3_tokenizer_dir)
        assert _faults(gateway) - before == Counter({(fake_engine.url, kind): 1})
        _assert_healthy(gateway)


PERSISTENT: dict[str, tuple[dict[str, Any], str, bool, type[Exception], int]] = {
    "status 500": ({"status": 500}, "chat", False, openai.InternalServerError, 502),
    "hang": ({"hang": True}, "anthropic", False, anthropic.InternalServerError, 504),
    "json body to a stream": ({"answer": "json"}, "responses", True, openai.InternalServerError, 502),
}
SDK_ATTEMPTS = 3  # both SDKs: the first try and their default 2 retries
SDK_BACKOFF_S = 2.0  # both SDKs: at most 0.5 s then 1 s between tries


@pytest.mark.parametrize("name", list(PERSISTENT))
def test_a_fault_that_outlasts_the_retries_is_the_sdks_5xx_error_within_a_bound(
    gateway: Any, fake_engine: FakeEngine, name: str
) -> None:
    fault, dialect, stream, error, status = PERSISTENT[name]
    sid = gateway.client.open_session()
    key = routing_key(sid)
    with _logged_once_per_fault(gateway, fake_engine, sid, SDK_ATTEMPTS):
        fake_engine.configure(fault={**fault, "key": key})
        started = time.monotonic()
        with pytest.raises(error) as info:
            _ask(gateway, sid, dialect, stream, [])
        took = time.monotonic() - started
        assert info.value.status_code == status  # type: ignore[attr-defined]
        body: Any = info.value.body  # type: ignore[attr-defined]
        error_object = body["error"] if dialect == "anthropic" else body  # the openai SDK unwraps {"error": ...}
        assert error_object["type"] == "api_error" and "inference engine" in error_object["message"], body
        assert took < SDK_ATTEMPTS * (ENGINE_TIMEOUT_S + 1.0) + SDK_BACKOFF_S, took
        assert len(fake_engine.log(key)["requests"]) == SDK_ATTEMPTS  # retried, then given up: never a hang
        fake_engine.configure(fault={"key": key})
        assert gateway.client.finish_session(sid, wait_timeout=5.0) == []
        _assert_healthy(gateway)


@pytest.mark.parametrize("stream", [False, True])
def test_a_degenerate_reply_is_read_fast_while_other_agents_are_served(
    gateway: Any, fake_engine: FakeEngine, qwen3_tokenizer_dir: str, stream: bool
) -> None:
    """What a degenerate model samples is the engine's to answer and ours to read: the agent gets its text back
    within a bound, every other agent on the worker is served meanwhile, and the reply is trained as sampled."""
    sid = gateway.client.open_session()
    key = routing_key(sid)
    fake_engine.configure(fault={"text": DEGENERATE, "key": key})
    waits: list[float] = []
    stop = threading.Event()

    def other_agents() -> None:
        while not stop.is_set() or not waits:
            other = gateway.client.open_session()
            started = time.monotonic()
            assert _ask(gateway, other, "chat", False, []).startswith("Final answer")
            waits.append(time.monotonic() - started)
            gateway.client.finish_session(other, wait_timeout=10.0)

    took = []
    with ThreadPoolExecutor(1) as pool:
        others = pool.submit(other_agents)
        try:
            with openai.OpenAI(base_url=gateway.base_url, api_key=sid, timeout=SDK_TIMEOUT_S) as client:
                for _ in range(DEGENERATE_REPLIES):
                    started = time.monotonic()
                    if stream:
                        with client.chat.completions.stream(model="q", messages=QUESTION, tools=TOOLS) as events:
                            message = events.get_final_completion().choices[0].message
                    else:
                        reply = client.chat.completions.create(model="q", messages=QUESTION, tools=TOOLS)
                        message = reply.choices[0].message
                    took.append(time.monotonic() - started)
                    content = message.content or ""
                    assert content.startswith("x") and content.endswith("y") and len(content) > 40_000, content[:80]
                    assert not message.tool_calls and getattr(message, "reasoning_content", None) == "r"
        finally:
            stop.set()
            others.result(timeout=LOAD_JOIN_S)
    assert max(took) < DEGENERATE_WITHIN_S, took
    assert max(waits) < OTHERS_WITHIN_S, waits
    fake_engine.configure(fault={"key": key})
    turns = engine_turns(fake_engine, sid, text_policy(qwen3_tokenizer_dir, DEGENERATE), fault="text")
    rows = gateway.client.finish_session(sid, wait_timeout=10.0)
    assert len(turns) == DEGENERATE_REPLIES
    assert_fidelity(turns, rows)
    assert not any(row.metadata["ill_formed"] for row in rows)
    _assert_healthy(gateway)
