"""Delta commits without sockets: the wire fields, the worker's prefix finder, and the broker's delta store.

The broker side is the real `SessionRegistry` (no sockets), the worker side the real
`gateway_workers.capture.commit_bases.CommitBases`. The central property: a session committed with
deltas (against the previous turn or an older one, any sharing pattern, any commit order)
materializes exactly the same `TurnRecord`s as the same session committed in full.
"""

from __future__ import annotations

import dataclasses
import random
import zlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wire_samples import unpacked

from broker import protocol
from broker.sessions.registry import Refusal, SessionRegistry
from gateway_workers.capture.commit_bases import CommitBases, shared_ids, shared_items


def full_commit(sid: str, turn_id: str, prompt, output, messages, response, flags=None) -> protocol.CommitTurn:
    return protocol.CommitTurn(
        0,
        sid,
        turn_id,
        protocol.ids_array(prompt),
        protocol.ids_array(output),
        protocol.logprobs_array(-(i % 9) / 8 for i in range(len(output))),
        "length" if len(output) % 3 == 0 else "stop",
        list(messages),
        response,
        flags if flags is not None else {"ill_formed": len(output) % 2 == 1},
    )


def registry(turn_ids) -> SessionRegistry:
    reg = SessionRegistry(max_sessions=4)
    reg.open_session("s", {}, None, None, {})
    for turn_id in turn_ids:
        reg.open_turn("s", turn_id)
    return reg


# --- wire -------------------------------------------------------------------------------


def test_delta_fields_round_trip_and_default_to_a_full_commit():
    full = full_commit("s", "t1", [5, 6, 7], [8], [{"role": "user", "content": "q"}], {"role": "assistant"})
    assert unpacked(protocol.decode_worker_to_broker(protocol.encode(full))) == full
    assert (full.base_turn_id, full.base_tokens, full.base_messages, full.prompt_len) == ("", 0, 0, 0)
    delta = dataclasses.replace(full, prompt_ids=protocol.ids_array([7]), base_turn_id="t0", base_tokens=2,
                                base_messages=1, prompt_len=3, prompt_messages=[], base_crc32=99)  # fmt: skip
    decoded = protocol.decode_worker_to_broker(protocol.encode(delta))
    assert unpacked(decoded) == delta
    assert (decoded.base_turn_id, decoded.base_tokens, decoded.base_messages, decoded.prompt_len) == ("t0", 2, 1, 3)
    # the new fields go last, after timings: an older broker's positional layout is untouched
    items = msgpack.unpackb(protocol.encode(delta), raw=False)
    assert items[-5:] == ["t0", 2, 1, 3, 99] and items[-6] == {}


@pytest.mark.parametrize("field_index, bad", [(-5, 7), (-4, "2"), (-3, None), (-2, 1.5), (-1, "crc")])
def test_delta_fields_are_type_checked(field_index, bad):
    items = msgpack.unpackb(protocol.encode(full_commit("s", "t", [1], [2], [], {})), raw=False)
    items[field_index] = bad
    with pytest.raises(protocol.ProtocolError, match="CommitTurn"):
        protocol.decode_worker_to_broker(msgpack.packb(items, use_bin_type=True))


# --- the worker's prefix finder -----------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=40), st.integers(0, 10))
def test_shared_ids_and_items_match_a_plain_scan(a, b, offset):
    offset = min(offset, len(a))
    naive = 0
    while offset + naive < len(a) and naive < len(b) and a[offset + naive] == b[naive]:
        naive += 1
    base = protocol.ids_array(a).tobytes()
    with memoryview(protocol.ids_array(b)) as view, view.cast("B") as new:
        assert shared_ids(base, offset * 4, new) == naive
    items_naive = 0
    while items_naive < min(len(a), len(b)) and a[items_naive] == b[items_naive]:
        items_naive += 1
    assert shared_items([{"v": x} for x in a], [{"v": x} for x in b]) == items_naive


def test_bases_are_bounded_by_sessions_and_bytes():
    bases = CommitBases(max_sessions=3, max_bytes=10_000)
    for i in range(5):
        bases.remember(full_commit(f"s{i}", "t", [1] * 100, [2] * 10, [], {}))
    assert len(bases) == 3 and bases.get("s0") is None and bases.get("s4") is not None
    assert bases.bytes_held == 3 * 110 * 4
    bases.remember(full_commit("big", "t", [1] * 2400, [], [], {}))  # 9600 bytes: only it fits
    assert len(bases) == 1 and bases.bytes_held == 9600
    bases.forget("big", "another-turn")  # only the named base is dropped
    assert len(bases) == 1
    bases.forget("big")
    assert len(bases) == 0 and bases.bytes_held == 0


def test_a_delta_sends_only_the_tail_and_nothing_when_nothing_is_shared():
    bases = CommitBases()
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    first = full_commit("s", "t0", list(range(100)), [500, 501], msgs, {"role": "assistant", "content": "a"})
    assert bases.delta(first) is None  # no base yet
    bases.remember(first)
    nxt_msgs = [*msgs, {"role": "assistant", "content": "a"}, {"role": "tool", "content": "r"}]
    nxt = full_commit("s", "t1", [*range(100), 500, 501, 7, 8], [9], nxt_msgs, {"role": "assistant", "content": "b"})
    delta = bases.delta(nxt)
    assert delta is not None
    assert (delta.base_turn_id, delta.base_tokens, delta.base_messages, delta.prompt_len) == ("t0", 102, 3, 104)
    assert delta.prompt_ids.tolist() == [7, 8] and delta.output_ids.tolist() == [9]
    assert delta.prompt_messages == [{"role": "tool", "content": "r"}]
    other = full_commit("s", "t2", [9999], [1], [{"role": "user", "content": "new"}], {"role": "assistant"})
    assert bases.delta(other) is None  # nothing shared: the full turn is cheaper


# --- the broker's delta store -----------------------------------------------------------------


@st.composite
def sessions(draw):
    """Turns derived from earlier ones (extended, cut anywhere, regenerated), each with the base a delta names."""
    n = draw(st.integers(1, 10))
    vocab = st.integers(0, 3)  # a tiny vocabulary: accidental matches past every cut are common
    texts = st.sampled_from(["a", "b"])
    turns = []  # (turn_id, prompt, output, messages, response)
    for k in range(n):
        if turns and draw(st.booleans()):
            _, bp, bo, bm, br = turns[draw(st.integers(0, len(turns) - 1))]
            if draw(st.booleans()):  # a regenerated turn: same prompt, an output sharing a head
                prompt, messages = list(bp), list(bm)
                output = bo[: draw(st.integers(0, len(bo)))] + draw(st.lists(vocab, max_size=4))
            else:  # a continuation (or a rewrite, cut anywhere in the base's context)
                ctx, ctx_msgs = bp + bo, [*bm, br]
                prompt = ctx[: draw(st.integers(0, len(ctx)))] + draw(st.lists(vocab, max_size=8))
                messages = ctx_msgs[: draw(st.integers(0, len(ctx_msgs)))]
                if draw(st.booleans()):
                    messages = [*messages, {"role": "user", "content": draw(texts)}]
                output = draw(st.lists(vocab, max_size=6))
        else:
            prompt = draw(st.lists(vocab, max_size=12))
            messages = [{"role": "user", "content": draw(texts)}]
            output = draw(st.lists(vocab, max_size=6))
        response = {"role": "assistant", "content": draw(texts)}
        turns.append((f"t{k}", prompt, output, messages, response))
    order = draw(st.permutations(range(n)))
    # each commit's base: any turn committed before it (the previous one most often), or none
    bases = []
    for pos in range(n):
        earlier = order[:pos]
        choice = draw(st.one_of(st.none(), st.sampled_from(earlier))) if earlier else None
        if earlier and draw(st.booleans()):
            choice = earlier[-1]
        bases.append(choice)
    return turns, order, bases


@settings(max_examples=400, deadline=None)
@given(sessions())
def test_delta_commits_materialize_exactly_as_full_commits(data):
    turns, order, base_choice = data
    ids = [t[0] for t in turns]
    full_reg, delta_reg = registry(ids), registry(ids)
    commits = [full_commit("s", *t) for t in turns]
    deltas = 0
    for pos, i in enumerate(order):
        assert full_reg.commit_turn(commits[i]) == "stored"
        msg = commits[i]
        if base_choice[pos] is not None:
            bases = CommitBases()
            bases.remember(commits[base_choice[pos]])
            msg = bases.delta(msg) or msg
            deltas += msg.base_turn_id != ""
        wire = protocol.decode_worker_to_broker(protocol.encode(msg))  # as the broker sees it
        assert delta_reg.commit_turn(wire) == "stored"
        assert delta_reg.commit_turn(wire) == "duplicate"  # a retried delta is a duplicate
    assert delta_reg.counters["commits_delta"] == deltas
    store = delta_reg.get("s").committed
    assert store.tokens_held <= sum(len(p) + len(o) for _, p, o, _, _ in turns)
    for sid_reg in (full_reg, delta_reg):
        sid_reg.close("s")
    full_records, delta_records = full_reg.finish("s").turns, delta_reg.finish("s").turns
    assert delta_records == full_records  # ids, messages, logprobs, finish reasons, flags, seqs
    for rec, (_, prompt, output, messages, response) in zip(
        full_records, sorted(turns, key=lambda t: int(t[0][1:])), strict=True
    ):
        assert rec.prompt_ids.tolist() == prompt and rec.output_ids.tolist() == output
        assert rec.prompt_messages == messages and rec.response_message == response


def test_a_growing_session_of_deltas_holds_each_token_once():
    rng = random.Random(3)
    reg = registry([f"t{k}" for k in range(50)])
    bases = CommitBases()
    prompt = [rng.randrange(150_000) for _ in range(2000)]
    messages = [{"role": "user", "content": "q" * 100}]
    for k in range(50):
        output = [rng.randrange(150_000) for _ in range(100)]
        response = {"role": "assistant", "content": f"a{k}"}
        full = full_commit("s", f"t{k}", prompt, output, messages, response)
        delta = bases.delta(full)
        assert (delta is None) == (k == 0)
        assert reg.commit_turn(delta or full) == "stored"
        bases.remember(full)
        prompt = prompt + output + [rng.randrange(150_000) for _ in range(500)]
        messages = [*messages, response, {"role": "user", "content": f"q{k}"}]
    store = reg.get("s").committed
    final = len(prompt) - 500
    assert store.tokens_held == final  # every token exactly once, as with full commits
    assert store.msgs.held == len(messages) - 1
    assert reg.counters["commits_delta"] == 49


def test_a_delta_against_a_base_the_broker_does_not_hold_is_refused_unknown_base():
    reg = registry(["t0", "t1", "t2", "gone"])
    bases = CommitBases()
    t0 = full_commit("s", "t0", [1, 2, 3], [4], [{"role": "user", "content": "q"}], {"role": "assistant"})
    assert reg.commit_turn(t0) == "stored"
    reg.abort_turn("s", "gone")
    t1 = full_commit("s", "t1", [1, 2, 3, 4, 5], [6], [{"role": "user", "content": "q"}], {"role": "assistant"})
    bases.remember(t0)
    delta = bases.delta(t1)
    assert delta is not None and delta.base_tokens == 4
    for bad_base in (
        dataclasses.replace(delta, base_turn_id="gone"),  # aborted
        dataclasses.replace(delta, base_turn_id="never"),  # never committed
        dataclasses.replace(delta, base_turn_id="t2"),  # opened, not committed
        dataclasses.replace(delta, base_tokens=5, prompt_ids=protocol.ids_array()),  # longer than the base
        dataclasses.replace(delta, base_messages=3, prompt_messages=[]),  # more messages than the base
        dataclasses.replace(delta, base_crc32=delta.base_crc32 ^ 1),  # a prefix the base does not have
        dataclasses.replace(delta, base_tokens=3, prompt_ids=protocol.ids_array([4, 5])),  # crc of 4 ids claimed for 3
    ):
        with pytest.raises(Refusal) as e:
            reg.commit_turn(bad_base)
        assert e.value.code == "unknown_base", bad_base
    assert reg.counters["commits_unknown_base"] == 7
    for malformed in (
        dataclasses.replace(delta, prompt_ids=protocol.ids_array([5, 5])),  # tail length disagrees
        dataclasses.replace(delta, base_tokens=-1),
        dataclasses.replace(delta, base_turn_id="t1"),  # its own base
        dataclasses.replace(delta, base_tokens=9, prompt_ids=protocol.ids_array()),  # past its own context
        dataclasses.replace(t1, base_tokens=2),  # a full commit with delta numbers
        dataclasses.replace(t1, prompt_len=2),
    ):
        with pytest.raises(Refusal) as e:
            reg.commit_turn(malformed)
        assert e.value.code == "bad_request", malformed
    assert reg.commit_turn(delta) == "stored"  # nothing half-stored by the refusals
    assert reg.commit_turn(dataclasses.replace(t1, prompt_len=5)) == "duplicate"
    reg.close("s")
    rec = reg.finish("s").turns[1]
    assert rec.prompt_ids.tolist() == [1, 2, 3, 4, 5] and rec.output_ids.tolist() == [6]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 6), st.integers(0, 30)), min_size=1, max_size=12))
def test_chained_prompt_crcs_equal_a_fresh_crc_and_every_delta_is_accepted(steps):
    """Each turn keeps (prompt rewritten from `cut` on, then `grow` new ids) and the worker's way:
    delta_and_crc, then remember with the CRC it returned: the CRC held is always the prompt's own."""
    rng = random.Random(len(steps))
    reg = registry([f"t{k}" for k in range(len(steps))])
    bases = CommitBases()
    context: list[int] = [rng.randrange(1000) for _ in range(5)]
    for k, (cut, output_len, grow) in enumerate(steps):
        prompt = context[: max(len(context) - cut, 0)] + [rng.randrange(1000) for _ in range(grow)]
        output = [rng.randrange(1000) for _ in range(output_len)]
        full = full_commit("s", f"t{k}", prompt, output, [{"role": "user", "content": "q"}], {"role": "assistant"})
        delta, prompt_crc = bases.delta_and_crc(full, request_id=k + 1)
        if delta is not None:
            assert delta.request_id == k + 1
            # the base is the previous turn, whose context (prompt + output) is `context`
            assert delta.base_crc32 == zlib.crc32(protocol.ids_array(context)[: delta.base_tokens].tobytes())
        assert reg.commit_turn(protocol.decode_worker_to_broker(protocol.encode(delta or full))) == "stored"
        bases.remember(full, prompt_crc)
        base = bases.get("s")
        assert base is not None and base.prompt_tokens == len(prompt)
        assert base.prompt_crc32 == zlib.crc32(full.prompt_ids.tobytes())
        context = prompt + output
    reg.close("s")
    assert [r.prompt_ids.tolist() for r in reg.finish("s").turns][-1] == prompt


def test_a_delta_carries_every_other_field_of_the_full_commit():
    bases = CommitBases()
    bases.remember(full_commit("s", "t0", [1, 2, 3], [4], [{"role": "user", "content": "q"}], {"role": "assistant"}))
    full = dataclasses.replace(
        full_commit("s", "t1", [1, 2, 3, 4, 5], [6, 7], [{"role": "user", "content": "q"}], {"role": "assistant"}),
        flags={"ill_formed": True, "x": 1},
        timings={"render_s": 0.5},
    )
    delta = bases.delta(full, request_id=7)
    assert delta is not None
    made_by_delta = {"request_id", "prompt_ids", "prompt_messages", "base_turn_id", "base_tokens", "base_messages",
                     "prompt_len", "base_crc32"}  # fmt: skip
    names = {f.name for f in dataclasses.fields(protocol.CommitTurn)}
    assert made_by_delta <= names
    for name in names - made_by_delta:
        assert getattr(delta, name) == getattr(full, name), name  # a field added to the protocol must travel
    assert (delta.request_id, delta.base_tokens, delta.prompt_ids.tolist(), delta.prompt_len) == (7, 4, [5], 5)
