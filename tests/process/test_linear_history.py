"""Linear history through `rollout-gateway serve` with two workers, on Qwen3 (every family's linear tool episode
runs in `test_families`).

A tool episode whose agent strips the reasoning from its echoes is a row per turn in a tree session and one
row in a linear session, turns spread over both workers. Then the fallbacks: a sub-agent with its own system
prompt inside a linear session forks (two lines, both linear), `reject` answers a 400 naming the first
message that differs and records nothing, streamed replies and the messages and responses dialects are
one row too, and a broker killed mid-episode (`--state-dir`) comes back with the session's heads.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from assets import TOOLS, FakeEngine, wait_until
from dialects import SYSTEM
from fake_formats import FAMILIES
from fidelity import assert_fidelity
from scrapes import worker_snapshots
from test_families import (
    _engine_turns,
    _linear_episode_is_one_row,
    _policy,
    _run_agent,
    assert_held,
    connection_per_request,
    held_counts,
    held_since,
    serve_family,
)
from test_serve_durability import RESTART_WITHIN_S, broker_pid

MAX_TURNS = 6


def _episode(gw: Any, sid: str, tools: Any, **kwargs: Any) -> list[Any]:
    """A tool loop whose agent echoes each reply without its reasoning, a connection per request."""
    return _run_agent(connection_per_request(gw, sid), tools, False, echo_reasoning=False, **kwargs)


def test_an_append_only_episode_is_a_row_per_turn_in_tree_mode_and_one_row_in_linear_mode() -> None:
    """Qwen3's template re-renders a reply without its reasoning: in tree mode each echo starts a row. (Every
    family's linear episode runs in `test_families`.) The linear session's bodies are decoded by what they add."""
    with serve_family("qwen3", "vllm", workers=2) as (gw, engine, tokenizer_dir):
        _, policy = _policy(tokenizer_dir, FAMILIES["qwen3"].writer)
        sid = gw.client.open_session(sampling_defaults={"temperature": 1.0}, history_mode="tree")
        received = _episode(gw, sid, TOOLS)
        records = gw.client.finish_session(sid, reward=1.0, wait_timeout=10.0)
        turns, _ = _engine_turns(engine, sid, policy)
        assert_fidelity(turns, records)
        assert len(records) == len(turns) == len(received) >= 3, [r.metadata for r in records]
        linear = _linear_episode_is_one_row(gw, "qwen3", engine, policy, TOOLS)
        # Each worker decodes whole the first two bodies of a session it sees, then only what the next ones add.
        least_extended = max(0, len(linear[0].metadata["turn_ids"]) - 4) + max(0, len(received) - 4)
        snapshots = worker_snapshots(gw.base_url.removesuffix("/v1"), 2).values()
        extended = sum(w.get("request_bodies:extended", 0) for w in snapshots)
        assert extended >= least_extended, (extended, least_extended)


@pytest.fixture(scope="module")
def qwen3_gateway() -> Iterator[tuple[Any, FakeEngine, str]]:
    # no commit bases: every held turn comes from the broker, as when the other worker committed it
    with serve_family("qwen3", "vllm", 2, ["--history-mode", "linear", "--commit-base-sessions", "0"]) as served:
        yield served


def test_a_sub_agent_inside_a_linear_session_forks_and_both_lines_stay_linear(qwen3_gateway: Any) -> None:
    gw, engine, tokenizer_dir = qwen3_gateway
    _, policy = _policy(tokenizer_dir, FAMILIES["qwen3"].writer)
    before, held_before = gw.client.stats(), held_counts(gw)
    sid = gw.client.open_session()  # linear by the gateway's --history-mode
    main = _episode(gw, sid, TOOLS)
    sub = _episode(gw, sid, TOOLS, system="You are a sub-agent: look one city up.", question="Weather in Rome?")
    records = gw.client.finish_session(sid, wait_timeout=10.0)
    turns, _ = _engine_turns(engine, sid, policy)
    assert len(turns) == len(main) + len(sub)
    assert_fidelity(turns, records)
    assert len(records) == 2, [r.metadata for r in records]  # one row per line
    stats = gw.client.stats()
    assert stats["linear_forks"] - before["linear_forks"] == 1  # the sub-agent's first request
    assert stats["linear_turns"] - before["linear_turns"] == len(turns) - 2
    held = held_since(held_before, held_counts(gw))
    assert_held(held, len(turns) - 2)
    if not held["linear_waits"]:
        assert held["linear_held_local"] == 0, held


def test_concurrent_requests_extending_one_turn_each_extend_it_on_a_row_of_its_own(qwen3_gateway: Any) -> None:
    """Two requests that extend the same turn at once (an agent sampling two continuations) are both prompted
    with that turn's ids and land on two rows, each the turn and one continuation: never one interleaved row."""
    gw, engine, tokenizer_dir = qwen3_gateway
    _, policy = _policy(tokenizer_dir, FAMILIES["qwen3"].writer)
    before = gw.client.stats()
    sid = gw.client.open_session()
    asked: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather?"}]
    client = connection_per_request(gw, sid)
    reply = client.chat.completions.create(model="m", messages=asked, tools=TOOLS).choices[0].message
    echo: dict[str, Any] = {"role": "assistant", "content": reply.content or ""}
    calls = reply.tool_calls or []
    if calls:
        echo["tool_calls"] = [{"id": c.id, "type": "function", "function": c.function.model_dump()} for c in calls]

    def follow_up(answer: str) -> Any:
        new = [{"role": "tool", "tool_call_id": c.id, "content": answer} for c in calls] or [
            {"role": "user", "content": answer}
        ]
        return connection_per_request(gw, sid).chat.completions.create(
            model="m", messages=[*asked, echo, *new], tools=TOOLS
        )

    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(follow_up, ["sunny", "raining"]))
    records = gw.client.finish_session(sid, wait_timeout=10.0)
    turns, _ = _engine_turns(engine, sid, policy)
    assert len(turns) == 3 and all(r.choices for r in replies)
    assert_fidelity(turns, records)
    assert len(records) == 2, [r.metadata for r in records]
    first, *continuations = sorted(turns, key=lambda t: len(t.prompt_ids))
    held = [*first.prompt_ids, *first.output_ids]
    for turn in continuations:
        assert list(turn.prompt_ids[: len(held)]) == held  # both prompted with the first turn's ids
    rows = sorted(list(record.token_ids) for record in records)
    expected = sorted([*t.prompt_ids, *t.output_ids] for t in continuations)
    assert rows == expected  # each row: the first turn, then exactly one of the two continuations
    assert gw.client.stats()["linear_turns"] - before["linear_turns"] == 2


def test_a_streamed_episode_is_one_row_too(qwen3_gateway: Any) -> None:
    gw, engine, tokenizer_dir = qwen3_gateway
    _, policy = _policy(tokenizer_dir, FAMILIES["qwen3"].writer)
    sid = gw.client.open_session()
    received = _run_agent(connection_per_request(gw, sid), TOOLS, True, echo_reasoning=False)
    records = gw.client.finish_session(sid, wait_timeout=10.0)
    turns, _ = _engine_turns(engine, sid, policy)
    assert len(turns) == len(received) >= 3
    assert_fidelity(turns, records)
    assert len(records) == 1, [r.metadata for r in records]


def test_reject_answers_a_400_naming_the_first_message_that_differs_and_records_nothing(qwen3_gateway: Any) -> None:
    gw, _, _ = qwen3_gateway
    before = gw.client.stats()
    sid = gw.client.open_session(linear_fallback="reject")
    client = connection_per_request(gw, sid)
    asked = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    first = client.chat.completions.create(model="m", messages=asked).choices[0].message
    edited = [
        asked[0],
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": "And?"},
    ]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=edited)
    assert e.value.body["param"] == "messages[1]" and e.value.body["code"] == "not_linear", e.value.body
    records = gw.client.finish_session(sid, wait_timeout=10.0)
    assert len(records) == 1 and len(records[0].metadata["turn_ids"]) == 1  # the refused request left no turn
    assert gw.client.stats()["linear_rejects"] - before["linear_rejects"] == 1


def test_the_messages_and_responses_dialects_are_one_row_too_with_reasoning_stripped(qwen3_gateway: Any) -> None:
    gw, engine, tokenizer_dir = qwen3_gateway
    _, policy = _policy(tokenizer_dir, FAMILIES["qwen3"].writer)
    _linear_episode_is_one_row(gw, "qwen3", engine, policy, TOOLS, ("messages", "responses"))


def test_a_linear_episode_stays_one_row_through_a_broker_killed_mid_episode(tmp_path: Path) -> None:
    """The heads come back from the state directory: the episode goes on linearly after the restart."""
    with serve_family("qwen3", "vllm", 2, ["--state-dir", str(tmp_path / "state")]) as (gw, engine, tokenizer_dir):
        _, policy = _policy(tokenizer_dir, FAMILIES["qwen3"].writer)
        sid = gw.client.open_session(history_mode="linear")

        def kill_the_broker() -> None:
            first = broker_pid(gw.process.pid)
            assert first is not None
            os.kill(first, signal.SIGKILL)
            assert wait_until(lambda: broker_pid(gw.process.pid) not in (None, first), timeout=RESTART_WITHIN_S)
            assert wait_until(lambda: any("the broker is back" in line for line in list(gw.output)), timeout=30)

        received = _episode(gw, sid, TOOLS, between=kill_the_broker)
        records = gw.client.finish_session(sid, wait_timeout=10.0)
        turns, _ = _engine_turns(engine, sid, policy)
        assert len(turns) == len(received) >= 3
        assert_fidelity(turns, records)
        assert len(records) == 1, [r.metadata for r in records]
        assert gw.client.stats()["linear_turns"] == len(turns) - 1  # the second extended the recovered head
