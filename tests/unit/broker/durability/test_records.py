"""The durable broker's records and session images: round trips, garbage refused, blobs beside their frame.

A large real session (its turn store with compressed chunks and a raw tail) is imaged, split into a
frame and blobs as a snapshot writes it, read back as a restart reads it and rebuilt: it holds the
same turns, and changing the live session after the image was taken changes nothing of what was
written. Records of the wrong shape are a `RecordError`, never a guess.
"""

from __future__ import annotations

import dataclasses
import random
from array import array

import msgpack
import pytest

from broker import protocol
from broker.durability import records
from broker.durability.images import restore_session, session_image
from broker.sessions.registry import SessionRegistry

LOG_RECORDS = [
    records.OpenRecord("sid-xxxxxxxxxxxxxxxxxxxxxx", {"temperature": 0.5}, 4096, None, {"m": [1, 2]}, "c", None),
    records.CloseRecord("s", "agent", 1.0, "ep-1", {"k": "v"}, 5.0, 42),
    records.CloseRecord("s", "trainer", None, None, {}, 0.0),
    records.FinishRecord("s", "trainer"),
    records.DropRecord("s"),
    records.EpisodeRecord(7, "s", "client", b"\x01\x02"),
    records.LeaseRecord("sub", 30.0, [1, 2, 3]),
    records.AckRecord([4]),
    records.RequeueRecord([5, 6], True),
]


@pytest.mark.parametrize("record", LOG_RECORDS, ids=lambda r: type(r).__name__)
def test_log_records_round_trip(record):
    assert records.decode_log(memoryview(records.encode(record))) == record


def test_snapshot_records_round_trip():
    for record in (
        records.SnapshotHeader(1 << 40, "little", "ab12", 9, ["a", "b"], ["trainer", "dropped"]),
        records.EpisodeImage(5, 3, "s", "c", "sub", 30.0, True, b"episode"),
        records.EpisodeImage(5, 3, "s", "c", None, 0.0, False, b"episode"),
        records.SnapshotTrailer(2, 1),
        records.SessionImage(5, [1, [b"x"], {"a": 1}], None),
    ):
        assert records.decode_snapshot(records.encode(record)) == record


def test_garbage_and_wrong_shapes_are_record_errors():
    with pytest.raises(records.RecordError):
        records.decode_log(b"\xc1 not msgpack")
    with pytest.raises(records.RecordError):
        records.decode_log(records.encode(records.SnapshotTrailer(1, 1)))  # a snapshot record is no log record
    with pytest.raises(records.FormatMismatch):
        records.decode_log(protocol.encode(protocol.GetStats(1)).replace(b"\x01", b"\x09", 1))
    bad = [records.WAL_FORMAT, "drop", 17]  # a session id that is no string
    with pytest.raises(records.RecordError, match="drop"):
        records.decode_log(msgpack.packb(bad))
    with pytest.raises(records.RecordError):
        records.decode_image(memoryview(b"\x00\x00"))


def test_episodes_are_kept_as_their_wire_encoding():
    row = protocol.TraceRow(
        protocol.ids_array([1, 2, 3]), array("B", [0, 1]), protocol.logprobs_array([-0.5, -1.0]),
        2, "hi", "ep", 1.0, "completed", {"turn_ids": ["t0"]},
    )  # fmt: skip
    episode = protocol.DeliveredEpisode(4, "s", [row], 1.0, "ep", {}, "complete", False, None, "agent", 1, 0)
    assert records.decode_episode(records.encode_episode(episode)) == episode


def big_session(reg: SessionRegistry, sid: str, turns: int = 12, seed: int = 0) -> None:
    """A session whose logs exceed the blob size, part of them compressed by idle-time compaction."""
    rng = random.Random(seed)
    reg.open_session(sid, {"t": 1}, None, None, {"m": 1})
    prompt: list[int] = []
    messages: list[dict] = [{"role": "system", "content": "s"}]
    for k in range(turns):
        prompt += [rng.randrange(100_000) for _ in range(700)]
        messages.append({"role": "user", "content": "".join(rng.choices("abcdef ", k=3000))})
        reg.open_turn(sid, f"t{k}")
        out = [rng.randrange(100_000) for _ in range(50)]
        msg = protocol.CommitTurn(
            0, sid, f"t{k}", protocol.ids_array(prompt), protocol.ids_array(out), protocol.logprobs_array([-0.25] * 50),
            "stop", list(messages), {"role": "assistant", "content": f"r{k}"}, flags={"k": k},
        )  # fmt: skip
        assert reg.commit_turn(msg) == "stored"
        prompt += out
        if k == turns - 3:  # older bytes compressed, the last turns raw
            while reg.compact_step():
                pass
    reg.open_turn(sid, "in-flight")


def layout_4(image: list) -> list:
    """An image as a broker of layout 4 wrote it: its history settings after the digests."""
    assert image[0] == 5
    return [4, *image[1:8], *image[10:18], image[8], image[9], image[18]]


def test_a_large_session_survives_its_image_split_into_blobs_and_back():
    reg = SessionRegistry(max_sessions=4, compact_age_s=0.0, compact_min_bytes=0)
    big_session(reg, "big-session-key-xxxxxxxxxx")
    session = reg.session("big-session-key-xxxxxxxxxx")
    assert session is not None and session.committed.ids.cold.size > 0 and len(session.committed.ids.hot) > 4096
    before = [dataclasses.astuple(r) for r in session.committed.records()]
    parts = records.image_parts(records.SessionImage(77, session_image(session, closing=False), None))
    assert len(parts) > 2  # the frame, and blobs beside it
    written = b"".join(bytes(p) for p in parts)
    # the live session moves on: what was written must not (its raw tail was copied, chunks are immutable)
    reg.open_turn("big-session-key-xxxxxxxxxx", "later")
    more = protocol.CommitTurn(
        0, "big-session-key-xxxxxxxxxx", "later", protocol.ids_array([1] * 9000), protocol.ids_array([2]),
        protocol.logprobs_array([-1.0]), "stop", [{"role": "user", "content": "x"}],
        {"role": "assistant", "content": "y"},
    )  # fmt: skip
    reg.commit_turn(more)
    assert b"".join(bytes(p) for p in parts) == written
    image = records.decode_image(memoryview(written))
    assert image.position == 77 and image.pending is None
    restored = restore_session(image.image)
    assert [dataclasses.astuple(r) for r in restored.committed.records()] == before
    assert restored.in_flight == {"in-flight": session.in_flight["in-flight"]} and restored.state == "open"
    # compressed chunks and the raw tails come back as read-only views of what was read (no copy)...
    assert any(type(c) is memoryview for c in restored.committed.ids.cold._chunks)
    assert type(restored.committed.ids.hot) is memoryview and restored.committed.ids.hot.readonly
    assert restored.committed.msgs.hot and all(type(m) is memoryview for m in restored.committed.msgs.hot)
    # ...and a restored session stores on: its next commit copies its tails out and extends them
    reg2 = SessionRegistry(max_sessions=4)
    reg2.restore(restored)
    assert reg2.commit_turn(dataclasses.replace(more, turn_id="in-flight")) == "stored"
    assert len(restored.committed) == len(before) + 1
    assert type(restored.committed.ids.hot) is bytearray
    assert b"".join(bytes(p) for p in parts) == written  # what it was restored from is untouched
    assert [dataclasses.astuple(r) for r in restored.committed.records()][:-1] == before


def test_an_image_of_layout_2_with_its_raw_messages_one_item_each_still_loads():
    reg = SessionRegistry(max_sessions=4, compact_age_s=0.0, compact_min_bytes=0)
    big_session(reg, "big-session-key-xxxxxxxxxx", turns=6)
    session = reg.session("big-session-key-xxxxxxxxxx")
    assert session is not None and session.committed.msgs.hot
    image = layout_4(session_image(session, closing=False))
    store = list(image[12])
    joined, ends, cold, cold_ends, raw_bytes = store[1]
    bounds = [0, *array("q", ends)]
    store[1] = [[joined[a:b] for a, b in zip(bounds, bounds[1:], strict=False)], cold, cold_ends, raw_bytes]
    old = [2, *image[1:12], store, *image[13:16]]  # layout 2 had no history settings either
    written = b"".join(bytes(p) for p in records.image_parts(records.SessionImage(1, old, None)))
    restored = restore_session(records.decode_image(memoryview(written)).image)
    assert [dataclasses.astuple(r) for r in restored.committed.records()] == [
        dataclasses.astuple(r) for r in session.committed.records()
    ]


def test_an_image_of_a_session_closing_by_request_stays_closing():
    reg = SessionRegistry(max_sessions=2)
    reg.open_session("closing-session-key-xxxxx", {}, None, None, {})
    reg.open_turn("closing-session-key-xxxxx", "t0")
    session = reg.close("closing-session-key-xxxxx", "agent")
    assert restore_session(session_image(session, closing=True)).finished_by == "agent"
    reopened = restore_session(session_image(session, closing=False))  # a FinishSession's close: open again
    assert reopened.state == "open" and reopened.finished_by is None and reopened.in_flight == {"t0": 0}


def test_a_blob_reference_out_of_its_record_is_refused():
    parts = records.image_parts(records.SessionImage(1, [b"z" * 5000], None))
    short = b"".join(bytes(p) for p in parts)[:-10]
    with pytest.raises(records.RecordError, match="past the end"):
        records.decode_image(memoryview(short))


def test_an_image_keeps_who_owns_each_in_flight_turn_what_was_abandoned_and_request_digests():
    reg = SessionRegistry(max_sessions=2)
    sid = "owned-session-key-xxxxxxxx"
    reg.open_session(sid, {}, None, None, {})
    reg.open_turn(sid, "owned", "worker-a", "digest-of-its-request")
    reg.open_turn(sid, "lost", "worker-b")
    assert reg.abandon_turn(sid, "lost")
    session = reg.session(sid)
    image = records.decode_image(memoryview(b"".join(
        bytes(p) for p in records.image_parts(records.SessionImage(1, session_image(session, closing=False), None))
    )))  # fmt: skip
    restored = restore_session(image.image)
    assert restored.in_flight == {"owned": 0} and restored.abandoned == {"lost": 1}
    assert restored.owners == {"owned": "worker-a"} and restored.digests == {"digest-of-its-request": "owned"}
    # an image written before turns named their workers (layout 1: no owners, nothing abandoned) still loads
    old = [1, *layout_4(session_image(session, closing=False))[1:-6]]
    assert restore_session(old).in_flight == {"owned": 0} and restore_session(old).owners == {}
    assert (restore_session(old).history_mode, restore_session(old).heads) == ("tree", [])


def test_an_image_keeps_a_linear_sessions_settings_and_heads():
    reg = SessionRegistry(max_sessions=2)
    sid = "linear-session-key-xxxxxxx"
    reg.open_session(sid, {}, None, None, {}, history_mode="linear", linear_fallback="reject")
    reg.open_turn(sid, "t0")
    commit = protocol.CommitTurn(
        0, sid, "t0", protocol.ids_array([1, 2]), protocol.ids_array([3]), protocol.logprobs_array([-0.5]), "stop",
        [{"role": "user", "content": "hi"}], {"role": "assistant", "content": "yo"},
        flags={"history": "first", "echo": [2, "ab" * 16]},
    )  # fmt: skip
    assert reg.commit_turn(commit) == "stored"
    restored = restore_session(session_image(reg.session(sid), closing=False))
    assert (restored.history_mode, restored.linear_fallback) == ("linear", "reject")
    assert (restored.heads, restored.head_seqs) == ([["t0", 2, "ab" * 16]], [0])
    assert session_image(restored, closing=False)[-1] == [[0, "t0", 2, "ab" * 16]]  # the layout is unchanged
    # as a broker of layout 4 wrote it (its history settings after the digests), it loads the same
    old = restore_session(layout_4(session_image(reg.session(sid), closing=False)))
    assert (old.history_mode, old.linear_fallback, old.heads, old.head_seqs) == (
        "linear", "reject", [["t0", 2, "ab" * 16]], [0]
    )
    assert session_image(old, closing=False) == session_image(restored, closing=False)


def test_an_image_holds_the_settings_the_log_opens_a_session_with():
    reg = SessionRegistry(max_sessions=2)
    reg.open_session(
        "settings-session-key-xxxxx", {"temperature": 0.5}, 4096, 9, {"task": "t"}, "client-7", "group-3",
        history_mode="linear", linear_fallback="reject",
    )  # fmt: skip
    session = reg.session("settings-session-key-xxxxx")
    record = records.open_record(session)
    restored = restore_session(session_image(session, closing=False))
    assert records.session_settings(restored) == records.session_settings(record) == {
        "sampling_defaults": {"temperature": 0.5}, "max_context_tokens": 4096, "max_turns": 9,
        "metadata": {"task": "t"}, "client_id": "client-7", "group": "group-3", "history_mode": "linear",
        "linear_fallback": "reject",
    }  # fmt: skip
    assert records.decode_log(records.encode(record)) == record
    # the log's open opens the same session again
    again = SessionRegistry(max_sessions=2).open_session(record.session_id, **records.session_settings(record))
    assert records.session_settings(again) == records.session_settings(session)
