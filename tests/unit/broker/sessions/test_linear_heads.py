"""A linear session's heads (`broker.sessions.history`): what the registry lists for a worker to extend."""

from __future__ import annotations

import pytest

from broker import protocol
from broker.sessions.history import FORK_HEADS, note_head
from broker.sessions.registry import Refusal, SessionRegistry

SID = "linear-session-key-xxxxxxx"


def _commit(turn_id: str, flags: dict) -> protocol.CommitTurn:
    return protocol.CommitTurn(
        0, SID, turn_id, protocol.ids_array([1, 2]), protocol.ids_array([3]), protocol.logprobs_array([-0.5]), "stop",
        [{"role": "user", "content": turn_id}], {"role": "assistant", "content": "ok"}, flags=flags,
    )  # fmt: skip


def _linear(fallback: str = "fork", **kwargs) -> SessionRegistry:
    reg = SessionRegistry(max_sessions=4, **kwargs)
    reg.open_session(SID, {}, None, None, {}, history_mode="linear", linear_fallback=fallback)
    return reg


def test_heads_are_the_newest_by_seq_whatever_order_commits_arrive_in():
    reg = _linear()
    for n in range(3):
        reg.open_turn(SID, f"t{n}")
    for n in (2, 0, 1):  # commits land out of OPEN order
        kind = "first" if n == 0 else "linear"
        assert reg.commit_turn(_commit(f"t{n}", {"history": kind, "echo": [2 * n + 2, f"d{n}"]})) == "stored"
    session = reg.session(SID)
    assert (session.heads, session.head_seqs) == ([["t2", 6, "d2"], ["t1", 4, "d1"], ["t0", 2, "d0"]], [2, 1, 0])
    assert (reg.counters["linear_first"], reg.counters["linear_turns"]) == (1, 2)


def test_a_forking_session_keeps_a_bounded_number_of_heads_the_others_one():
    heads: list = []
    seqs: list = []
    for seq in range(FORK_HEADS + 3):
        note_head(heads, seqs, seq, f"t{seq}", {"echo": [1, "d"]}, FORK_HEADS)
    assert seqs == list(range(FORK_HEADS + 2, 2, -1)) and [h[0] for h in heads] == [f"t{s}" for s in seqs]
    note_head(heads, seqs, 0, "old", {"echo": [1, "d"]}, FORK_HEADS)  # older than all it keeps: left out
    assert len(heads) == len(seqs) == FORK_HEADS and "old" not in [h[0] for h in heads]
    note_head(heads, seqs, 5, "again", {"echo": [1, "d"]}, FORK_HEADS)  # a late commit goes in by its seq
    assert seqs == [10, 9, 8, 7, 6, 5, 5, 4] and heads[6][0] == "again" and heads[5][0] == "t5"
    reg = _linear("reject")
    for n in range(2):
        reg.open_turn(SID, f"t{n}")
        reg.commit_turn(_commit(f"t{n}", {"history": "linear", "echo": [2, "d"]}))
    assert reg.session(SID).heads == [["t1", 2, "d"]]


def test_a_turn_without_an_echo_or_of_a_tree_session_is_no_head():
    reg = _linear()
    reg.open_turn(SID, "t0")
    reg.commit_turn(_commit("t0", {"ill_formed": False}))
    assert reg.session(SID).heads == []
    tree = SessionRegistry(max_sessions=2)
    tree.open_session(SID, {}, None, None, {})
    tree.open_turn(SID, "t0")
    tree.commit_turn(_commit("t0", {"history": "linear", "echo": [2, "d"]}))
    assert tree.session(SID).heads == [] and tree.counters["linear_turns"] == 0


def test_history_settings_default_to_the_registrys_and_are_checked():
    reg = SessionRegistry(max_sessions=4, history_mode="linear", linear_fallback="reject")
    session = reg.open_session(None, {}, None, None, {})
    assert (session.history_mode, session.linear_fallback) == ("linear", "reject")
    assert reg.open_session(None, {}, None, None, {}, history_mode="tree").history_mode == "tree"
    with pytest.raises(Refusal, match="history_mode must be one of tree, linear") as e:
        reg.open_session(None, {}, None, None, {}, history_mode="flat")
    assert e.value.code == "bad_request"
    with pytest.raises(Refusal, match="linear_fallback"):
        reg.open_session(None, {}, None, None, {}, linear_fallback="guess")
    with pytest.raises(ValueError):
        SessionRegistry(max_sessions=1, history_mode="flat")


def test_a_rejected_request_is_counted_and_its_turn_gone():
    reg = _linear("reject")
    reg.open_turn(SID, "t0")
    reg.abort_turn(SID, "t0", protocol.NOT_LINEAR)
    reg.open_turn(SID, "t1")
    reg.abort_turn(SID, "t1", "client_disconnect")
    assert reg.counters["linear_rejects"] == 1 and reg.session(SID).in_flight == {}
