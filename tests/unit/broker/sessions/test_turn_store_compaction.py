"""TurnStore idle-time compaction: compressed logs give back exactly what uncompressed ones hold.

Two registries take the same commits (full and delta, growing, forked, out of order); one
compacts between commits with tiny chunks and slices, a chunk often left half-compressed while
the next commits arrive, so every read path (a delta's prefix check, a full commit's comparison,
GET, finish) meets cold bytes and bytes being compressed. Records and turn messages must be
equal. Sessions under the registry's size threshold are never compacted.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker import protocol
from broker.sessions import turn_store
from broker.sessions.compaction import COMPACT_CHUNK_BYTES
from broker.sessions.registry import SessionRegistry
from gateway_workers.capture.commit_bases import CommitBases


@pytest.fixture(autouse=True)
def tiny_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(turn_store, "MIN_CHUNK", 8)


def _commit(turn_id: str, prompt: list[int], output: list[int], messages: list[dict], response: dict):
    return protocol.CommitTurn(
        0, "s", turn_id, protocol.ids_array(prompt), protocol.ids_array(output),
        protocol.logprobs_array([-k / 8 for k in range(len(output))]), "stop", messages, response,
    )  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32), st.integers(2, 14), st.booleans())
def test_compacted_sessions_materialize_exactly_like_uncompacted_ones(seed, n_turns, deltas):
    rng = random.Random(seed)
    plain, cold = SessionRegistry(max_sessions=1), SessionRegistry(max_sessions=1)
    for reg in (plain, cold):
        reg.open_session("s", {}, None, None, {})
        for k in range(n_turns):
            reg.open_turn("s", f"t{k}")
    bases = CommitBases()
    contexts: list[tuple[list[int], list[dict]]] = [([], [])]
    order = list(range(n_turns))
    if not deltas:
        rng.shuffle(order)  # full commits may arrive in any order
    compacted = 0
    for k in order:
        base_ids, base_msgs = contexts[-1] if rng.random() < 0.8 else rng.choice(contexts)
        cut = len(base_ids) if rng.random() < 0.7 else rng.randrange(len(base_ids) + 1)
        prompt = base_ids[:cut] + [rng.randrange(60) for _ in range(rng.randrange(1, 40))]
        user = {"role": "user", "content": "u" * rng.randrange(30)}
        messages = base_msgs[: rng.randrange(len(base_msgs) + 1)] + [user]
        output = [rng.randrange(60) for _ in range(rng.randrange(0, 12))]
        response = {"role": "assistant", "content": f"r{k}", "tool_calls": [{"name": "f", "arguments": {"k": k}}]}
        full = _commit(f"t{k}", prompt, output, messages, response)
        sent = (bases.delta(full) if deltas else None) or full
        wire = protocol.decode_worker_to_broker(protocol.encode(sent))  # messages as the broker gets them
        assert plain.commit_turn(wire) == cold.commit_turn(wire) == "stored"
        bases.remember(full)
        contexts.append((prompt + output, messages + [response]))
        chunk = rng.choice([8, 64, 1 << 20])
        for _ in range(rng.choice([1, 3, 1 << 20])):  # often stops mid-chunk: commits meet a pending chunk
            if not cold.compact_step(slice_bytes=rng.choice([1, 5, 64, 1 << 20]), chunk_bytes=chunk):
                break
            compacted += 1
        t = f"t{rng.choice(order[: order.index(k) + 1])}"
        assert cold.turn_messages("s", t) == plain.turn_messages("s", t)
    assert plain.stats()["tokens_held"] == cold.stats()["tokens_held"]
    assert compacted > 0 or n_turns < 4 or len(cold.get("s").committed.ids.hot) < 8 * 4  # cold bytes were met
    for a, b in zip(plain.finish("s").turns, cold.finish("s").turns, strict=True):
        assert a == b


def test_a_long_session_compacts_to_fewer_bytes_and_keeps_the_recent_tail_hot():
    reg = SessionRegistry(max_sessions=1)  # age 0: compresses at once, but never counts as idle
    reg.open_session("s", {}, None, None, {})
    rng = random.Random(5)
    bases = CommitBases()
    prompt, messages = [rng.randrange(1000) for _ in range(500)], [{"role": "user", "content": "x" * 2000}]
    for k in range(20):
        reg.open_turn("s", f"t{k}")
        output = [rng.randrange(1000) for _ in range(50)]
        response = {"role": "assistant", "content": "y" * 400}
        full = _commit(f"t{k}", prompt, output, messages, response)
        assert reg.commit_turn(protocol.decode_worker_to_broker(protocol.encode(bases.delta(full) or full))) == "stored"
        bases.remember(full)
        prompt = prompt + output + [rng.randrange(1000) for _ in range(100)]
        messages = [*messages, response, {"role": "user", "content": "z" * 300}]
    before = reg.stats()["bytes_held"]
    steps = 0
    while reg.compact_step():
        steps += 1
    store = reg.get("s").committed
    assert steps > 0 and reg.stats()["bytes_held"] < before / 2  # text of one letter compresses well
    assert len(store.ids.hot) > 0 and store.msgs.hot  # the last commits' bytes stay uncompressed
    assert not reg.compaction_pending
    records = reg.finish("s").turns
    assert records[-1].response_message == {"role": "assistant", "content": "y" * 400}
    assert records[-1].prompt_messages[0] == {"role": "user", "content": "x" * 2000}


def _grow(reg: SessionRegistry, sid: str, n_turns: int, tokens_per_turn: int) -> None:
    """`n_turns` delta commits, each adding `tokens_per_turn` ids and a 1 KB message."""
    reg.open_session(sid, {}, None, None, {})
    rng = random.Random(sid)
    bases = CommitBases()
    prompt, messages = [rng.randrange(1000) for _ in range(tokens_per_turn)], [{"role": "user", "content": "x"}]
    for k in range(n_turns):
        reg.open_turn(sid, f"t{k}")
        output = [rng.randrange(1000) for _ in range(20)]
        response = {"role": "assistant", "content": "y" * 1000}
        full = _commit(f"t{k}", prompt, output, messages, response)
        full = protocol.CommitTurn(0, sid, *dataclasses.astuple(full)[2:])
        wire = protocol.decode_worker_to_broker(protocol.encode(bases.delta(full) or full))
        assert reg.commit_turn(wire) == "stored"
        bases.remember(full)
        prompt = prompt + output + [rng.randrange(1000) for _ in range(tokens_per_turn)]
        messages = [*messages, response, {"role": "user", "content": "z" * 100}]


def test_sessions_under_the_size_threshold_are_never_compacted_and_larger_ones_are():
    reg = SessionRegistry(max_sessions=4, compact_min_bytes=200_000)
    _grow(reg, "small", 12, 500)  # ~12 x (2 KB ids + 1.1 KB messages): under the threshold
    small = reg.get("small").committed
    assert 0 < small.raw_bytes < 200_000
    # chunks are due, but the session is too small to be worth it
    assert small.start_compaction(COMPACT_CHUNK_BYTES) is not None
    assert not reg.compaction_pending and not reg.compact_step()
    assert small.bytes_held() >= small.raw_bytes  # nothing compressed

    _grow(reg, "large", 40, 1000)  # ~40 x (4 KB ids + 1.1 KB messages): past it
    large = reg.get("large").committed
    assert large.raw_bytes >= 200_000 and reg.compaction_pending
    steps = 0
    while reg.compact_step():
        steps += 1
    assert steps > 0 and large.bytes_held() < large.raw_bytes  # the large one was compressed...
    assert small.bytes_held() >= small.raw_bytes  # ...and the small one still was not
    before = [r.prompt_ids for r in reg.finish("large").turns]
    plain = SessionRegistry(max_sessions=1)
    _grow(plain, "large", 40, 1000)
    assert before == [r.prompt_ids for r in plain.finish("large").turns]


def test_raw_bytes_count_ids_and_distinct_messages_once():
    reg = SessionRegistry(max_sessions=1)
    _grow(reg, "s", 5, 100)
    store = reg.get("s").committed
    assert store.raw_bytes == 4 * store.tokens_held + sum(map(len, store.msgs.hot))
    while reg.compact_step(slice_bytes=8, chunk_bytes=8):
        pass
    assert store.raw_bytes == 4 * store.tokens_held + store.msgs.cold.size + sum(map(len, store.msgs.hot))
