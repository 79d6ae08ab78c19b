"""FinishAnswers: a repeated FinishSession (same session, same request id) gets the reply its first attempt got.

Bounded by age and bytes (oldest first, the newest kept whatever its size), one answer per session id
(a reused id keeps only its latest finish), and carried by the durable broker's records: a FinishRecord
holds its reply, a snapshot header the whole memory, and both decode records written before they did.
"""

from __future__ import annotations

import msgpack

from broker.durability import records
from broker.episodes.answers import FinishAnswers


def test_only_the_same_request_on_the_same_session_is_a_repeat():
    answers = FinishAnswers()
    answers.remember("s1", 7, b"rows-1", now=0.0)
    assert answers.replay("s1", 7, now=1.0) == b"rows-1"
    assert answers.replay("s1", 8, now=1.0) is None  # another request: another finish
    assert answers.replay("s2", 7, now=1.0) is None
    assert answers.stats() == {"finish_answers_kept": 1, "finish_answer_bytes": 6, "finish_repeats_answered": 1}


def test_answers_expire_by_age_and_by_bytes_oldest_first_and_the_newest_stays():
    answers = FinishAnswers(keep_s=10.0, max_bytes=10)
    answers.remember("a", 1, b"xxxx", now=0.0)
    answers.remember("b", 2, b"yyyy", now=5.0)
    assert answers.replay("a", 1, now=9.0) == b"xxxx"
    assert answers.replay("a", 1, now=10.0) is None and answers.replay("b", 2, now=10.0) == b"yyyy"
    answers.remember("c", 3, b"z" * 8, now=11.0)  # over the bytes bound: b goes
    assert answers.items() == [("c", 3, b"z" * 8)]
    answers.remember("d", 4, b"w" * 50, now=12.0)  # alone over the bound: kept, its repeat is the likeliest
    assert answers.items() == [("d", 4, b"w" * 50)]


def test_a_reused_session_id_keeps_its_latest_finish_only():
    answers = FinishAnswers()
    answers.remember("s", 1, b"first", now=0.0)
    answers.remember("s", 2, b"second", now=1.0)
    assert answers.replay("s", 1, now=2.0) is None and answers.replay("s", 2, now=2.0) == b"second"
    assert answers.stats()["finish_answer_bytes"] == len(b"second")


def test_restore_keeps_the_order_and_gives_the_answers_a_new_lease_of_life():
    answers = FinishAnswers(keep_s=10.0)
    answers.restore([("a", 1, b"1"), ("b", 2, b"2")], now=100.0)
    assert answers.items() == [("a", 1, b"1"), ("b", 2, b"2")]
    assert answers.replay("a", 1, now=109.0) == b"1"


def test_records_carry_the_answers_and_read_those_written_before_them():
    finish = records.FinishRecord("s", "trainer", 42, b"\x93frame")
    assert records.decode_log(records.encode(finish)) == finish
    older = msgpack.packb([records.WAL_FORMAT, "finish", "s", "trainer"])
    assert records.decode_log(older) == records.FinishRecord("s", "trainer", 0, None)
    header = records.SnapshotHeader(1 << 40, "little", "ab", 3, ["f"], ["trainer"], ["s"], [42], [b"x" * 5000])
    assert records.decode_snapshot(records.encode(header)) == header
    older_header = msgpack.packb([records.WAL_FORMAT, "snapshot", 1, "little", "ab", 3, ["f"], ["trainer"]])
    decoded = records.decode_snapshot(older_header)
    assert isinstance(decoded, records.SnapshotHeader) and decoded.answer_ids == decoded.answer_frames == []
