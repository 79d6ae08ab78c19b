"""The session registry's deduplicated turn store: what goes in comes out exactly, at about unique-token cost.

`sessions.SessionRegistry` has no sockets, so these tests drive it directly: turns whose
contexts share prefixes in every way traffic produces (growth, forks, rewrites, replays,
shrinking histories, commits in any order) must materialize bit-exact, and a growing
session must hold each token once.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker import protocol
from broker.sessions.registry import Refusal, SessionRegistry


def commit(reg: SessionRegistry, sid: str, turn_id: str, prompt, output, messages, response, lps=None):
    if lps is None:
        lps = [-(i % 7) / 8 for i in range(len(output))]
    msg = protocol.CommitTurn(
        0,
        sid,
        turn_id,
        protocol.ids_array(prompt),
        protocol.ids_array(output),
        protocol.logprobs_array(lps),
        "stop",
        messages,
        response,
    )
    return reg.commit_turn(msg)


def check_exact(reg: SessionRegistry, sid: str, expected: dict) -> None:
    finished = reg.finish(sid)
    assert [t.seq for t in finished.turns] == sorted(t.seq for t in finished.turns)
    assert {t.turn_id for t in finished.turns} == set(expected)
    for t in finished.turns:
        prompt, output, messages, response = expected[t.turn_id]
        assert t.prompt_ids.tolist() == prompt
        assert t.output_ids.tolist() == output
        assert len(t.logprobs) == len(output)
        assert t.prompt_messages == messages
        assert t.response_message == response


@st.composite
def sessions(draw):
    """Turns whose contexts derive from earlier ones: cut anywhere, extended with fresh ids."""
    n = draw(st.integers(1, 12))
    vocab = st.integers(0, 50)  # a small vocabulary makes accidental partial matches common
    contexts: list[tuple[list[int], list[dict]]] = []
    turns = []
    for k in range(n):
        if contexts and draw(st.booleans()):
            base_ids, base_msgs = draw(st.sampled_from(contexts))
            cut = draw(st.integers(0, len(base_ids)))
            mcut = draw(st.integers(0, len(base_msgs)))
            prompt = base_ids[:cut] + draw(st.lists(vocab, max_size=20))
            messages = base_msgs[:mcut]
        else:
            prompt = draw(st.lists(vocab, max_size=30))
            messages = []
        messages = messages + [{"role": "user", "content": draw(st.sampled_from(["a", "b", "c"]))}]
        output = draw(st.lists(vocab, max_size=10))
        response = {"role": "assistant", "content": draw(st.sampled_from(["x", "y"]))}
        contexts.append((prompt + output, messages + [response]))
        turns.append((f"t{k}", prompt, output, messages, response))
    order = draw(st.permutations(range(n)))
    return turns, order


@settings(max_examples=300, deadline=None)
@given(sessions())
def test_any_sharing_pattern_in_any_commit_order_materializes_exactly(data):
    turns, order = data
    reg = SessionRegistry(max_sessions=10)
    reg.open_session("s", {}, None, None, {})
    for turn_id, *_ in turns:
        reg.open_turn("s", turn_id)
    for i in order:
        turn_id, prompt, output, messages, response = turns[i]
        assert commit(reg, "s", turn_id, prompt, output, messages, response) == "stored"
    assert reg.get("s").committed.tokens_held <= sum(len(p) + len(o) for _, p, o, _, _ in turns)
    check_exact(reg, "s", {t[0]: t[1:] for t in turns})


def test_a_growing_session_holds_each_token_once():
    rng = random.Random(0)
    reg = SessionRegistry(max_sessions=10)
    reg.open_session("s", {}, None, None, {})
    prompt = [rng.randrange(150_000) for _ in range(2000)]
    messages = [{"role": "user", "content": "q" * 100}]
    expected = {}
    for k in range(50):
        reg.open_turn("s", f"t{k}")
        output = [rng.randrange(150_000) for _ in range(100)]
        response = {"role": "assistant", "content": f"a{k}"}
        commit(reg, "s", f"t{k}", prompt, output, messages, response)
        expected[f"t{k}"] = (prompt, output, messages, response)
        prompt = prompt + output + [rng.randrange(150_000) for _ in range(500)]
        messages = [*messages, response, {"role": "user", "content": f"q{k}"}]
    store = reg.get("s").committed
    final = len(expected["t49"][0]) + 100
    assert store.tokens_held == final  # every token exactly once
    assert store.msgs.held == len(expected["t49"][2]) + 1
    assert store.bytes_held() < 2 * 4 * final  # tokens + logprobs + message text
    check_exact(reg, "s", expected)


def test_commits_validate_their_shape():
    reg = SessionRegistry(max_sessions=10)
    reg.open_session("s", {}, None, None, {})
    reg.open_turn("s", "t0")
    with pytest.raises(Refusal) as e:
        commit(reg, "s", "t0", [1, 2], [3, 4], [], {"role": "assistant"}, lps=[-1.0])
    assert e.value.code == "bad_request" and "logprobs" in e.value.message
    with pytest.raises(Refusal) as e:
        commit(reg, "s", "t0", [1, 2], [3], ["not a map"], {"role": "assistant"})
    assert e.value.code == "bad_request"
    with pytest.raises(Refusal) as e:
        commit(reg, "s", "t-never-opened", [1], [2], [], {"role": "assistant"})
    assert e.value.code == "bad_request"
    assert commit(reg, "s", "t0", [1, 2], [3], [], {"role": "assistant"}) == "stored"  # nothing half-stored


def test_finished_ids_are_remembered_boundedly():
    reg = SessionRegistry(max_sessions=10, finished_memory=2)
    for sid in ("a", "b", "c"):
        reg.open_session(sid, {}, None, None, {})
        reg.close(sid)
        reg.finish(sid)
    with pytest.raises(Refusal) as e:
        reg.open_turn("c", "t")
    assert e.value.code == "session_closed"
    with pytest.raises(Refusal) as e:
        reg.open_turn("a", "t")  # forgotten: the oldest of three with room for two
    assert e.value.code == "unknown_session"
    reg.open_session("c", {}, None, None, {})  # an id may be reused once its session is over
    assert reg.open_turn("c", "t")[1] == 0


def test_max_turns_cap_applies_over_the_callers_request():
    reg = SessionRegistry(max_sessions=10, max_turns_cap=2)
    assert reg.open_session("s", {}, None, None, {}).max_turns == 2
    assert reg.open_session("u", {}, None, 5, {}).max_turns == 2
    assert reg.open_session("v", {}, None, 1, {}).max_turns == 1
