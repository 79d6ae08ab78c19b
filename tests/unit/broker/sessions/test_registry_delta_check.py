"""The broker's prefix check of delta commits, where it resumes from a CRC it already knows.

A delta turn keeps the CRC of the prefix it was checked against, and a base checked as a whole
keeps its whole context's CRC, so the next check reads only ids past that point. These tests put
a delta's cut before, at, between and after those points on a chain of deltas (real
`SessionRegistry`, deltas from the worker's real `CommitBases`): a right claim is stored and
materializes exactly, a wrong one is refused with unknown_base at every cut.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from broker import protocol
from broker.sessions.registry import Refusal, SessionRegistry
from gateway_workers.capture.commit_bases import CommitBases

RNG = random.Random(11)


def ids(n: int) -> list[int]:
    return [RNG.randrange(1000, 150_000) for _ in range(n)]


def commit(turn_id: str, prompt: list[int], output: list[int], messages: list[dict]) -> protocol.CommitTurn:
    return protocol.CommitTurn(
        0,
        "s",
        turn_id,
        protocol.ids_array(prompt),
        protocol.ids_array(output),
        protocol.logprobs_array([-0.5] * len(output)),
        "stop",
        messages,
        {"role": "assistant", "content": turn_id},
    )


def delta_of(base: protocol.CommitTurn, full: protocol.CommitTurn) -> protocol.CommitTurn:
    bases = CommitBases()
    bases.remember(base)
    delta = bases.delta(full)
    assert delta is not None and delta.base_turn_id == base.turn_id
    return protocol.decode_worker_to_broker(protocol.encode(delta))  # as the broker sees it


@pytest.fixture
def chain() -> tuple[SessionRegistry, list[protocol.CommitTurn]]:
    """t0 full, t1 a delta of t0, t2 a delta of t1: each extends the previous context."""
    reg = SessionRegistry(max_sessions=2)
    reg.open_session("s", {}, None, None, {})
    for k in range(3):
        reg.open_turn("s", f"t{k}")
    msgs = [{"role": "user", "content": "q"}]
    turns = [commit("t0", ids(300), ids(40), msgs)]
    for k in (1, 2):
        prev = turns[-1]
        ctx = [*prev.prompt_ids, *prev.output_ids]
        msgs = [*prev.prompt_messages, prev.response_message, {"role": "user", "content": f"u{k}"}]
        turns.append(commit(f"t{k}", ctx + ids(30), ids(40), msgs))
    assert reg.commit_turn(turns[0]) == "stored"
    for k in (1, 2):
        assert reg.commit_turn(delta_of(turns[k - 1], turns[k])) == "stored"
    return reg, turns


def cuts(turns: list[protocol.CommitTurn]) -> dict[str, int]:
    """Where a delta of t2 may cut t2's context, relative to the prefixes whose CRC the broker knows."""
    t1, t2 = turns[1], turns[2]
    checked = len(t1.prompt_ids) + len(t1.output_ids)  # t2's checked prefix: t1's whole context
    whole = len(t2.prompt_ids) + len(t2.output_ids)
    return {
        "inside t0": 100,
        "before the checked prefix": checked - 5,
        "at the checked prefix": checked,
        "past the checked prefix": checked + 7,
        "inside the output": whole - 3,
        "the whole context": whole,
    }


@pytest.mark.parametrize(
    "where",
    [
        "inside t0",
        "before the checked prefix",
        "at the checked prefix",
        "past the checked prefix",
        "inside the output",
        "the whole context",
    ],
)
def test_a_delta_cut_anywhere_is_checked_against_the_right_prefix(chain, where):
    reg, turns = chain
    t2 = turns[2]
    n = cuts(turns)[where]
    ctx = [*t2.prompt_ids, *t2.output_ids]
    prompt = ctx[:n] + [7, 8, 9]  # ids no synthetic context holds: the shared prefix ends exactly at n
    t3 = commit("t3", prompt, ids(20), [*t2.prompt_messages[:1], {"role": "user", "content": "new"}])
    reg.open_turn("s", "t3")
    delta = delta_of(t2, t3)
    assert delta.base_tokens == n
    for wrong in (delta.base_crc32 ^ 1, delta.base_crc32 ^ 0x80000000):
        with pytest.raises(Refusal) as e:
            reg.commit_turn(dataclasses.replace(delta, base_crc32=wrong))
        assert e.value.code == "unknown_base"
    assert reg.commit_turn(delta) == "stored"
    # a later delta against the new turn checks again, from what is known of it
    t4 = commit("t4", [*prompt, *t3.output_ids, 5], ids(3), t3.prompt_messages)
    reg.open_turn("s", "t4")
    d4 = delta_of(t3, t4)
    with pytest.raises(Refusal):
        reg.commit_turn(dataclasses.replace(d4, base_crc32=d4.base_crc32 ^ 2))
    assert reg.commit_turn(d4) == "stored"
    reg.close("s")
    records = {r.turn_id: r for r in reg.finish("s").turns}
    for full in (*turns, t3, t4):
        rec = records[full.turn_id]
        assert rec.prompt_ids == full.prompt_ids and rec.output_ids == full.output_ids
        assert rec.prompt_messages == full.prompt_messages and rec.response_message == full.response_message


def test_the_whole_context_check_is_remembered_and_a_wrong_claim_after_it_still_fails(chain):
    reg, turns = chain
    t2 = turns[2]
    ctx = [*t2.prompt_ids, *t2.output_ids]
    for k, turn_id in enumerate(("t3", "t4", "t5")):  # three deltas of t2's whole context
        reg.open_turn("s", turn_id)
        full = commit(turn_id, ctx + [k + 1], [k + 2], [*t2.prompt_messages, t2.response_message])
        delta = delta_of(t2, full)
        assert delta.base_tokens == len(ctx)
        with pytest.raises(Refusal):
            reg.commit_turn(dataclasses.replace(delta, base_crc32=delta.base_crc32 + 1))
        assert reg.commit_turn(delta) == "stored"
    assert reg.counters["commits_unknown_base"] == 3 and reg.counters["commits_delta"] == 5
