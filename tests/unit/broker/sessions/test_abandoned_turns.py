"""Turns abandoned with a silent worker: a late commit lands only when it is valid and not superseded.

A late commit that is refused (its own fault) leaves the turn abandoned, so no finish waits for it; a retry
of the same request sampled afresh supersedes it, so its late commit cannot add a turn the agent never
used; abandoned turns still count against the session's turn cap.
"""

from __future__ import annotations

import dataclasses

import pytest

from broker import protocol
from broker.sessions.registry import Refusal, SessionRegistry

SID = "abandoned-session-key-xxxxxxx"


def _commit(turn_id: str) -> protocol.CommitTurn:
    return protocol.CommitTurn(
        0, SID, turn_id, protocol.ids_array([1, 2, 3]), protocol.ids_array([4, 5]),
        protocol.logprobs_array([-0.5, -0.25]), "stop", [{"role": "user", "content": "q"}],
        {"role": "assistant", "content": "a"},
    )  # fmt: skip


def _registry(max_turns: int | None = None) -> SessionRegistry:
    reg = SessionRegistry(max_sessions=2)
    reg.open_session(SID, {}, None, max_turns, {})
    return reg


def test_a_refused_late_commit_leaves_the_turn_abandoned_and_a_valid_one_lands():
    reg = _registry()
    reg.open_turn(SID, "t0", "w", "d0")
    assert reg.abandon_turn(SID, "t0")
    broken = dataclasses.replace(_commit("t0"), logprobs=protocol.logprobs_array([-0.5]))
    with pytest.raises(Refusal):
        reg.commit_turn(broken)
    session = reg.session(SID)
    assert session.in_flight == {} and session.abandoned == {"t0": 0}  # no finish waits for it
    assert reg.commit_turn(_commit("t0")) == "stored"
    assert session.abandoned == {} and reg.counters["commits_late"] == 1


def test_a_retry_sampled_afresh_supersedes_the_abandoned_attempt():
    reg = _registry()
    reg.open_turn(SID, "first", "w1", "d")
    reg.abandon_turn(SID, "first")
    assert reg.repeated_turn(SID, "d") is None  # neither committed nor in flight: sample again
    reg.open_turn(SID, "retry", "w2", "d")
    with pytest.raises(Refusal, match="was aborted"):
        reg.commit_turn(_commit("first"))  # the slow worker's reply was never used
    assert reg.commit_turn(_commit("retry")) == "stored"
    assert [r.turn_id for r in reg.session(SID).committed.records()] == ["retry"]


def test_abandoned_turns_count_against_the_turn_cap():
    reg = _registry(max_turns=1)
    reg.open_turn(SID, "t0", "w")
    reg.abandon_turn(SID, "t0")
    with pytest.raises(Refusal) as capped:
        reg.open_turn(SID, "t1", "w")
    assert capped.value.code == "turn_cap"
