"""The write-ahead log's files: records read back as written, torn tails dropped, damage named, segments rotated.

Real files in a temporary directory and real fdatasync calls; no broker. A torn last record is tried
at every byte offset it could be cut at, and a flipped byte in every part of a record.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from broker import config
from broker.durability import wal
from broker.durability.wal import CorruptLog, LogWriter, SegmentReader, list_segments, segment_path

SYNC_WAIT_S = 5.0


def payloads(n: int, size: int = 40) -> list[bytes]:
    return [bytes([i % 251]) * (size + i) for i in range(n)]


def write_records(directory: Path, items: list[bytes], *, fsync: config.FsyncPolicy = "never", **kw) -> LogWriter:
    writer = LogWriter(directory, 0, fsync=fsync, interval_s=0.01, segment_bytes=kw.get("segment_bytes", 1 << 30))
    for i, p in enumerate(items):
        writer.append(1 + i % 3, p)
        if kw.get("commit_each", True):
            writer.commit()
    writer.commit()
    return writer


def read_all(path: Path, *, tail: bool = True) -> tuple[list[tuple[int, int, bytes]], SegmentReader]:
    reader = SegmentReader(path, tail=tail)
    return [(off, kind, bytes(p)) for off, kind, p in reader], reader


def test_records_read_back_in_order_with_their_kinds_and_offsets(tmp_path):
    items = payloads(20)
    writer = write_records(tmp_path, items)
    end = writer.position
    writer.close()
    got, reader = read_all(segment_path(tmp_path, 0))
    assert [p for _, _, p in got] == items
    assert [k for _, k, _ in got] == [1 + i % 3 for i in range(20)]
    offsets = [off for off, _, _ in got]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert reader.torn is None and reader.end == wal.offset_of(end) == os.path.getsize(segment_path(tmp_path, 0))


def test_append_record_lays_out_what_the_writer_writes(tmp_path):
    writer = write_records(tmp_path, [b"abc", b""])
    writer.close()
    buf = bytearray()
    wal.append_record(buf, 1, b"abc")
    wal.append_record(buf, 2, b"")
    assert segment_path(tmp_path, 0).read_bytes() == bytes(buf)
    assert len(buf) == 2 * wal.HEADER_BYTES + 3 + 2  # header + kind byte + payload each


def test_position_names_segment_and_offset():
    pos = wal.position(7, 12345)
    assert (wal.segment_of(pos), wal.offset_of(pos)) == (7, 12345)
    assert wal.position(7, 1 << 39) < wal.position(8, 0)


def test_buffered_records_reach_the_file_only_at_commit(tmp_path):
    writer = LogWriter(tmp_path, 0, fsync="never", interval_s=1.0, segment_bytes=1 << 30)
    writer.append(1, b"x" * 100)
    assert writer.pending and os.path.getsize(segment_path(tmp_path, 0)) == 0
    assert wal.offset_of(writer.position) == wal.HEADER_BYTES + 101  # buffered records count as appended
    writer.commit()
    assert not writer.pending and os.path.getsize(segment_path(tmp_path, 0)) == wal.HEADER_BYTES + 101
    writer.close()


def test_a_torn_last_record_is_dropped_at_every_byte_it_can_be_cut_at(tmp_path):
    items = payloads(5, size=30)
    write_records(tmp_path, items).close()
    path = segment_path(tmp_path, 0)
    data = path.read_bytes()
    last_start = [off for off, _, _ in read_all(path)[0]][-1]
    cut_file = tmp_path / "cut.log"
    for cut in range(last_start + 1, len(data)):  # every prefix that ends inside the last record
        cut_file.write_bytes(data[:cut])
        got, reader = read_all(cut_file)
        assert [p for _, _, p in got] == items[:-1], cut
        assert reader.end == last_start and reader.torn is not None, cut
        # a sealed segment is never torn: the same bytes there are damage, named by file and offset
        with pytest.raises(CorruptLog) as e:
            read_all(cut_file, tail=False)
        assert e.value.offset == last_start and e.value.path == cut_file
    cut_file.write_bytes(data[:last_start])  # cut at the record boundary: a clean end, nothing torn
    got, reader = read_all(cut_file)
    assert [p for _, _, p in got] == items[:-1] and reader.torn is None


def test_a_flipped_byte_in_the_last_record_is_a_torn_tail(tmp_path):
    items = payloads(4)
    write_records(tmp_path, items).close()
    path = segment_path(tmp_path, 0)
    data = path.read_bytes()
    last_start = [off for off, _, _ in read_all(path)[0]][-1]
    for at in (last_start + wal.HEADER_BYTES, len(data) - 1):  # its kind byte, its last payload byte
        damaged = bytearray(data)
        damaged[at] ^= 0x40
        path.write_bytes(damaged)
        got, reader = read_all(path)
        assert [p for _, _, p in got] == items[:-1] and "checksum" in (reader.torn or "")


@pytest.mark.parametrize("part", ["length", "body_crc", "header_crc", "kind", "payload"])
def test_a_flipped_byte_in_a_middle_record_is_corruption_naming_file_and_offset(tmp_path, part):
    items = payloads(6)
    write_records(tmp_path, items).close()
    path = segment_path(tmp_path, 0)
    offsets = [off for off, _, _ in read_all(path)[0]]
    victim = offsets[2]
    at = victim + {"length": 0, "body_crc": 5, "header_crc": 9, "kind": 12, "payload": 20}[part]
    damaged = bytearray(path.read_bytes())
    damaged[at] ^= 0x01
    path.write_bytes(damaged)
    with pytest.raises(CorruptLog) as e:
        read_all(path)
    assert e.value.offset == victim and str(path) in str(e.value)
    assert f"offset {victim}" in str(e.value)


def test_zeros_after_the_last_record_are_a_torn_tail(tmp_path):
    # what a power loss can leave: the file's size grew, but its last blocks never reached the disk
    items = payloads(3)
    write_records(tmp_path, items).close()
    path = segment_path(tmp_path, 0)
    good = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"\0" * 4096)
    got, reader = read_all(path)
    assert [p for _, _, p in got] == items and reader.end == good and reader.torn is not None
    with open(path, "ab") as f:  # ...but zeros with data after them are damage
        f.write(b"\x01")
    with pytest.raises(CorruptLog) as e:
        read_all(path)
    assert e.value.offset == good


def test_segments_rotate_at_their_size_and_never_split_a_record(tmp_path):
    items = payloads(60, size=200)
    writer = write_records(tmp_path, items, segment_bytes=2_000)
    writer.close()
    seqs = list_segments(tmp_path)
    assert len(seqs) > 5 and seqs == list(range(len(seqs)))
    got = []
    for seq in seqs:
        path = segment_path(tmp_path, seq)
        records, reader = read_all(path, tail=seq == seqs[-1])
        assert reader.torn is None
        # a segment is sealed once it reaches its size: it holds at most one record past it
        assert path.stat().st_size < 2_000 + wal.HEADER_BYTES + 1 + 260
        got += [p for _, _, p in records]
    assert got == items


def test_a_segment_is_never_overwritten(tmp_path):
    write_records(tmp_path, payloads(2)).close()
    with pytest.raises(FileExistsError):
        LogWriter(tmp_path, 0, fsync="never", interval_s=1.0, segment_bytes=1 << 20)


def test_fsync_policies_count_their_syncs(tmp_path):
    counts = {}
    for policy in ("always", "interval", "never"):
        d = tmp_path / policy
        d.mkdir()
        writer = LogWriter(d, 0, fsync=policy, interval_s=0.01, segment_bytes=1 << 30)
        for p in payloads(5):
            writer.append(1, p)
            writer.commit()
        writer.commit()  # nothing buffered: no write, no sync
        if policy == "interval":  # the syncer thread catches up within a few periods
            deadline = time.monotonic() + SYNC_WAIT_S
            while writer.interval_syncs == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
        counts[policy] = (writer.syncs, writer.interval_syncs)
        writer.close()
    assert counts["always"] == (5, 0)  # one per commit that wrote
    assert counts["interval"][0] == 0 and counts["interval"][1] >= 1
    assert counts["never"] == (0, 0)


def test_the_config_and_the_log_know_the_same_policies():
    assert config.FSYNC_POLICIES == wal.FSYNC_POLICIES
    with pytest.raises(ValueError, match="fsync"):
        config.BrokerConfig(fsync="sometimes")  # type: ignore[arg-type]
