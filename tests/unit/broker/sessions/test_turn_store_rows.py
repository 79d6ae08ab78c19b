"""TurnStore's packed turns: every field a commit carried comes back exactly, compacted or not.

Turns are rows of ints (with their ranges in a shared array) and their logprobs go to a
per-session log that compaction deflates byte-shuffled; so each record's turn id, seq, finish
reason, flags and the logprobs' exact float32 bit patterns (NaN payloads, infinities, -0.0)
must survive any commit order, full and delta commits, and compaction between commits.
"""

from __future__ import annotations

import random
import struct
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker import protocol
from broker.sessions import turn_store
from broker.sessions.registry import SessionRegistry
from gateway_workers.capture.commit_bases import CommitBases

_REASONS = ["stop", "length", "tool_calls", "abort"]
_ODD_FLOATS = [0x7FC00001, 0xFFC12345, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001, 0xBF000000]


@pytest.fixture(autouse=True)
def tiny_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(turn_store, "MIN_CHUNK", 8)


def _logprobs(rng: random.Random, n: int) -> array:
    """float32 logprobs with odd bit patterns mixed in (array('f') keeps the bits it is given)."""
    bits = [rng.choice(_ODD_FLOATS) if rng.random() < 0.2 else rng.getrandbits(32) & 0xBFFFFFFF for _ in range(n)]
    out = protocol.logprobs_array()
    out.frombytes(struct.pack(f"={n}I", *bits))
    return out


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 16), st.booleans(), st.booleans())
def test_records_give_back_every_committed_field_bit_exact(seed, n_turns, deltas, compact):
    rng = random.Random(seed)
    reg = SessionRegistry(max_sessions=1)
    reg.open_session("s", {}, None, None, {})
    ids = [f"turn-{rng.getrandbits(64):x}-{k}" for k in range(n_turns)]
    for tid in ids:
        reg.open_turn("s", tid)
    order = list(range(n_turns))
    if not deltas:
        rng.shuffle(order)  # full commits may arrive in any order: seqs are then inserted mid-way
    bases = CommitBases()
    sent: dict[str, protocol.CommitTurn] = {}
    prompt: list[int] = []
    messages: list[dict] = []
    for k in order:
        prompt = prompt + [rng.randrange(200_000) for _ in range(rng.randrange(1, 30))]
        messages = messages + [{"role": "user", "content": f"u{k}"}]
        n_out = rng.randrange(0, 12)
        full = protocol.CommitTurn(
            0, "s", ids[k], protocol.ids_array(prompt), protocol.ids_array(rng.randrange(9) for _ in range(n_out)),
            _logprobs(rng, n_out), rng.choice(_REASONS), list(messages), {"role": "assistant", "content": f"a{k}"},
            flags={"ill_formed": True, "k": k} if rng.random() < 0.3 else {},
        )  # fmt: skip
        wire = protocol.decode_worker_to_broker(protocol.encode((bases.delta(full) if deltas else None) or full))
        assert reg.commit_turn(wire) == "stored"
        bases.remember(full)
        sent[ids[k]] = full
        prompt = prompt + full.output_ids.tolist()
        messages = messages + [full.response_message]
        while compact and reg.compact_step(slice_bytes=rng.choice([1, 7, 1 << 20]), chunk_bytes=rng.choice([8, 64])):
            pass
    store = reg.get("s").committed
    if compact and sum(len(c.logprobs) for c in sent.values()) > 16 * 4:
        assert store.lps.cold.size > 0  # logprobs were compressed too
    records = reg.finish("s").turns
    assert [r.seq for r in records] == list(range(n_turns))  # OPEN order, whatever the arrival order
    for r in records:
        c = sent[r.turn_id]
        assert r.turn_id == ids[r.seq]
        assert r.logprobs.typecode == "f" and r.logprobs.tobytes() == c.logprobs.tobytes()
        assert r.prompt_ids.tolist() == c.prompt_ids.tolist() and r.output_ids.tolist() == c.output_ids.tolist()
        assert r.finish_reason == c.finish_reason and r.flags == c.flags
        assert r.prompt_messages == c.prompt_messages and r.response_message == c.response_message


def test_a_turn_costs_a_row_of_ints_not_objects():
    reg = SessionRegistry(max_sessions=1)
    reg.open_session("s", {}, None, None, {})
    bases = CommitBases()
    prompt = list(range(100))
    messages = [{"role": "user", "content": "q"}]
    for k in range(40):
        reg.open_turn("s", f"t{k}")
        full = protocol.CommitTurn(
            0, "s", f"t{k}", protocol.ids_array(prompt), protocol.ids_array([k, k + 1]),
            protocol.logprobs_array([-0.5, -0.25]), "stop", list(messages), {"role": "assistant", "content": f"a{k}"},
        )  # fmt: skip
        assert reg.commit_turn(protocol.decode_worker_to_broker(protocol.encode(bases.delta(full) or full))) == "stored"
        bases.remember(full)
        prompt = prompt + [k, k + 1, 7]
        messages = [*messages, full.response_message, {"role": "user", "content": f"q{k}"}]
    store = reg.get("s").committed
    assert len(store._rec) == 40 * turn_store._ROW.size
    # a growing session's turns each spell one run of ids (and of messages): 4 ints of ranges a turn
    assert len(store._ranges) <= 4 * 40 + 4
    assert store._flags == {} and store._reasons == ["stop"]
