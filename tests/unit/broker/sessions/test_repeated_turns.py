"""What a retried request finds in the registry: its committed turn (materialized exactly as the finish would
see it, compressed logs included), a turn_pending refusal while it is in flight, nothing once it was aborted;
and each session keeps only its latest request digests."""

from __future__ import annotations

import dataclasses

import pytest

from broker import protocol
from broker.sessions.registry import MAX_DIGESTS, Refusal, SessionRegistry

SID = "retry-session-key-xxxxxxxxxx"


def _commit(turn_id: str, prompt: list[int], output: list[int]) -> protocol.CommitTurn:
    return protocol.CommitTurn(
        0, SID, turn_id, protocol.ids_array(prompt), protocol.ids_array(output),
        protocol.logprobs_array([-0.25 * (i + 1) for i in range(len(output))]), "stop",
        [{"role": "user", "content": f"q{turn_id}"}], {"role": "assistant", "content": f"a{turn_id}"},
        {"ill_formed": False},
    )  # fmt: skip


def _registry() -> SessionRegistry:
    reg = SessionRegistry(max_sessions=2, compact_age_s=0.0, compact_min_bytes=0)
    reg.open_session(SID, {}, None, None, {})
    return reg


def test_a_retry_finds_its_committed_turn_exactly_as_stored():
    reg = _registry()
    prompt: list[int] = []
    for k in range(6):  # a growing episode: later turns share earlier ones' ids in the store
        prompt = [*prompt, *range(100 * k, 100 * k + 50)]
        reg.open_turn(SID, f"t{k}", "w", f"digest-{k}")
        reg.commit_turn(_commit(f"t{k}", prompt, [7, 8, 9 + k]))
        prompt += [7, 8, 9 + k]
    while reg.compact_step():  # older log bytes compressed: the replay reads through them
        pass
    stored = {r.turn_id: dataclasses.astuple(r) for r in reg.session(SID).committed.records()}
    for k in range(6):
        found = reg.repeated_turn(SID, f"digest-{k}")
        assert found is not None and dataclasses.astuple(found) == stored[f"t{k}"]
    assert reg.repeated_turn(SID, "never-seen") is None
    assert reg.counters["turns_replayed"] == 6


def test_a_retry_of_a_turn_in_flight_is_pending_and_of_an_aborted_one_samples():
    reg = _registry()
    reg.open_turn(SID, "t0", "w", "d")
    with pytest.raises(Refusal) as pending:
        reg.repeated_turn(SID, "d")
    assert pending.value.code == "turn_pending"
    reg.abort_turn(SID, "t0")
    assert reg.repeated_turn(SID, "d") is None
    reg.open_turn(SID, "t1", "w", "d")  # the retry's own turn now answers the digest
    reg.commit_turn(_commit("t1", [1, 2], [3]))
    found = reg.repeated_turn(SID, "d")
    assert found is not None and found.turn_id == "t1"


def test_a_resent_open_of_a_retry_gets_its_own_turn_again_not_a_wait_for_itself():
    reg = _registry()
    _, seq = reg.open_turn(SID, "t0", "w", "d")  # its answer was lost: the worker sends the same OPEN again
    assert reg.repeated_turn(SID, "d", asking="t0") is None
    assert reg.open_turn(SID, "t0", "w", "d") == (reg.session(SID), seq)
    assert reg.counters["turns_opened"] == 1
    with pytest.raises(Refusal) as pending:  # another attempt of the request still waits for it
        reg.repeated_turn(SID, "d", asking="t1")
    assert pending.value.code == "turn_pending"


def test_a_session_keeps_only_its_latest_digests():
    reg = _registry()
    for k in range(MAX_DIGESTS + 5):
        reg.open_turn(SID, f"t{k}", "w", f"d{k}")
    digests = reg.session(SID).digests
    assert len(digests) == MAX_DIGESTS and "d0" not in digests and f"d{MAX_DIGESTS + 4}" in digests
