"""broker.protocol: every message round-trips; garbage, unknown tags, wrong types and versions raise ProtocolError.

Real msgpack throughout. Also pins the wire form the other side of each socket relies
on: the frame layout, packed little-endian arrays, and schema evolution (an older
peer's frame without trailing defaulted fields still decodes).
"""

from __future__ import annotations

import dataclasses
import typing
from array import array

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wire_samples import ALL, DECODERS, IDS, MESSAGES, _values, unpacked

from broker import protocol
from broker.protocol import (
    OpenSession,
    ProtocolError,
    VersionMismatch,
)


def _union_classes(direction: str) -> set[type]:
    name = {
        "worker_to_broker": "WorkerToBroker",
        "broker_to_worker": "BrokerToWorker",
        "trainer_to_broker": "TrainerToBroker",
        "broker_to_trainer": "BrokerToTrainer",
    }[direction]
    return set(typing.get_args(getattr(protocol, name)))


def test_every_message_of_every_direction_is_covered():
    for direction, msgs in MESSAGES.items():
        assert {type(m) for m in msgs} == _union_classes(direction)


def test_the_contract_re_exports_every_message_under_its_own_name():
    # defined by socket in broker.messages, imported by everyone from broker.protocol
    nested = {protocol.TraceRow, protocol.DeliveredEpisode, protocol.Message}
    for cls in set().union(*map(_union_classes, MESSAGES)) | nested:
        assert getattr(protocol, cls.__name__) is cls and cls.__name__ in protocol.__all__
        assert cls.__module__.startswith("broker.messages.")
    assert all(hasattr(protocol, name) for name in protocol.__all__)


@pytest.mark.parametrize(("direction", "msg"), ALL, ids=lambda v: getattr(v, "TAG", v))
def test_round_trip(direction, msg):
    frame = protocol.encode(msg)
    assert isinstance(frame, bytes)
    decoded = DECODERS[direction](frame)
    assert unpacked(decoded) == msg
    assert type(decoded) is type(msg)
    for f in dataclasses.fields(msg):  # packed fields come back as arrays of the same typecode
        value = getattr(msg, f.name)
        if isinstance(value, array):
            assert getattr(decoded, f.name).typecode == value.typecode


def test_frame_layout_and_packed_arrays_are_little_endian():
    items = msgpack.unpackb(protocol.encode(MESSAGES["worker_to_broker"][1]), raw=False)
    assert items[:5] == [protocol.PROTOCOL_VERSION, "commit_turn", 2, "sess", "turn-1"]
    assert items[5] == b"".join(v.to_bytes(4, "little", signed=True) for v in IDS)  # bytes, not a list
    assert isinstance(items[7], bytes) and len(items[7]) == 8  # two float32


def test_commit_messages_travel_as_packed_bins_and_decode_as_bytes_and_older_maps_still_decode():
    commit = MESSAGES["worker_to_broker"][1]
    items = msgpack.unpackb(protocol.encode(commit), raw=False)
    assert all(isinstance(m, bytes) for m in items[9]) and isinstance(items[10], bytes)
    assert [msgpack.unpackb(m, raw=False) for m in items[9]] == commit.prompt_messages
    assert msgpack.unpackb(items[10], raw=False) == commit.response_message
    decoded = protocol.decode_worker_to_broker(protocol.encode(commit))
    assert decoded.prompt_messages == [protocol.pack_message(m) for m in commit.prompt_messages]
    assert all(protocol.is_packed_map(m) for m in [*decoded.prompt_messages, decoded.response_message])
    assert protocol.unpack_messages(b"".join(decoded.prompt_messages)) == commit.prompt_messages
    # an older worker's frame, messages as maps: still a commit, the maps as dicts
    items[9], items[10] = commit.prompt_messages, commit.response_message
    older = protocol.decode_worker_to_broker(msgpack.packb(items, use_bin_type=True))
    assert older == commit
    # encoding an already packed commit sends the same frame (bytes pass through)
    assert protocol.encode(decoded) == protocol.encode(commit)


@pytest.mark.parametrize("buf", [b"\x01", b"\x81\xa1a", b"\x81\xa1a\x01\x02", b"\x92\x01\x02"])
def test_unpack_messages_refuses_what_is_not_whole_maps(buf):
    with pytest.raises(ProtocolError):
        protocol.unpack_messages(buf)


def test_an_older_trainer_without_client_id_and_group_still_opens_sessions():
    full = msgpack.unpackb(protocol.encode(OpenSession(26, None, {}, None, None, {}, "c", "g", "linear")), raw=False)
    # no metadata, client_id, group, history_mode or linear_fallback
    older = protocol.decode_trainer_to_broker(msgpack.packb(full[:-5], use_bin_type=True))
    assert older == OpenSession(26, None, {}, None, None)
    assert (older.metadata, older.client_id, older.group, older.history_mode) == ({}, "", None, "")


@pytest.mark.parametrize("bad", [["1"], [1.5], [True], [None], "12"])
def test_delivery_id_lists_are_checked_element_by_element(bad):
    items = [protocol.PROTOCOL_VERSION, "fetch_episodes", 6, "sub", "", 1, bad, [], [], 1.0, 5.0, None, None]
    with pytest.raises(ProtocolError, match="FetchEpisodes.acks") as e:
        protocol.decode_trainer_to_broker(msgpack.packb(items))
    assert e.value.request_id == 6


def test_an_older_peer_without_trailing_default_fields_still_decodes():
    full = msgpack.unpackb(protocol.encode(MESSAGES["worker_to_broker"][1]), raw=False)
    older = msgpack.packb(full[:-7], use_bin_type=True)  # no flags, no timings, no delta fields
    decoded = protocol.decode_worker_to_broker(older)
    assert decoded.flags == {} and decoded.timings == {}
    assert (decoded.base_turn_id, decoded.base_tokens, decoded.base_messages, decoded.prompt_len) == ("", 0, 0, 0)
    assert decoded.base_crc32 == 0
    assert decoded.prompt_ids == IDS


GARBAGE = [
    b"",
    b"\xc1",  # never-used msgpack byte
    b"\x92\x01",  # truncated array
    msgpack.packb(7),
    msgpack.packb({"version": 1}),
    msgpack.packb([protocol.PROTOCOL_VERSION, "open_turn"]),  # too short
    msgpack.packb([protocol.PROTOCOL_VERSION, "open_turn", 1, "s", "t"]) + b"\x00",  # trailing bytes
]


@pytest.mark.parametrize("frame", GARBAGE)
@pytest.mark.parametrize("direction", list(DECODERS))
def test_garbage_raises_protocol_error_without_a_request_id(direction, frame):
    with pytest.raises(ProtocolError) as e:
        DECODERS[direction](frame)
    assert e.value.request_id is None
    assert not isinstance(e.value, VersionMismatch)


@pytest.mark.parametrize(
    ("items", "fragment"),
    [
        ([protocol.PROTOCOL_VERSION, "no_such_tag", 5], "unknown message"),
        ([protocol.PROTOCOL_VERSION, 3, 5], "unknown message"),
        ([protocol.PROTOCOL_VERSION, "turn_opened", 5, "t", 1, {}, None], "unknown message"),  # other direction
        ([protocol.PROTOCOL_VERSION, "open_turn", 5, 123, "t"], "OpenTurn.session_id: expected str"),
        ([protocol.PROTOCOL_VERSION, "open_turn", 5, "s"], "OpenTurn"),  # missing a field
        ([protocol.PROTOCOL_VERSION, "open_turn", 5, "s", "t", "w", "d", True, "extra"], "OpenTurn has 6"),
        ([protocol.PROTOCOL_VERSION, "abort_turn", 5, "s", "t", None], "AbortTurn.reason"),
        ([protocol.PROTOCOL_VERSION, "commit_turn", 5, "s", "t", b"\x00" * 5, b"", b"", "stop", [], {}], "packed"),
        ([protocol.PROTOCOL_VERSION, "commit_turn", 5, "s", "t", [1, 2], b"", b"", "stop", [], {}], "packed"),
        ([protocol.PROTOCOL_VERSION, "commit_turn", 5, "s", "t", b"", b"", b"", "stop", {}, {}], "prompt_messages"),
        ([protocol.PROTOCOL_VERSION, "commit_turn", 5, "s", "t", b"", b"", b"", "stop", [], []], "response_message"),
    ],
)
def test_wrong_tags_and_types_raise_protocol_error_with_the_request_id(items, fragment):
    with pytest.raises(ProtocolError, match=fragment) as e:
        protocol.decode_worker_to_broker(msgpack.packb(items, use_bin_type=True))
    assert e.value.request_id == 5


@pytest.mark.parametrize(
    "items",
    [
        [protocol.PROTOCOL_VERSION, "finish_session", 6, "s", "high", None, {}, 1.0],  # reward: str
        [protocol.PROTOCOL_VERSION, "finish_session", 6, "s", None, None, {}, True],  # a bool is no float
        [protocol.PROTOCOL_VERSION, "open_session", 6, None, {}, "4096", None],  # max_context_tokens: str
        [protocol.PROTOCOL_VERSION, "open_session", 6, None, {}, True, None],  # a bool is no int
        [protocol.PROTOCOL_VERSION, "drop_session", 6, None],
    ],
)
def test_trainer_side_type_errors(items):
    with pytest.raises(ProtocolError) as e:
        protocol.decode_trainer_to_broker(msgpack.packb(items))
    assert e.value.request_id == 6


def test_ints_are_accepted_where_floats_are_expected():
    frame = msgpack.packb([protocol.PROTOCOL_VERSION, "finish_session", 6, "s", 1, None, {}, 5])
    msg = protocol.decode_trainer_to_broker(frame)
    assert (msg.reward, msg.wait_timeout) == (1.0, 5.0) and isinstance(msg.wait_timeout, float)


@pytest.mark.parametrize("version", [0, protocol.PROTOCOL_VERSION + 1, "1", None])
def test_wrong_version_is_a_version_mismatch_naming_both_versions(version):
    frame = msgpack.packb([version, "get_stats", 9])
    with pytest.raises(VersionMismatch) as e:
        protocol.decode_trainer_to_broker(frame)
    assert e.value.request_id == 9 and e.value.peer_version == version
    assert str(protocol.PROTOCOL_VERSION) in str(e.value)
    assert isinstance(e.value, ProtocolError)


def test_request_id_is_only_trusted_when_it_is_an_int():
    with pytest.raises(ProtocolError) as e:
        protocol.decode_trainer_to_broker(msgpack.packb([protocol.PROTOCOL_VERSION, "nope", True]))
    assert e.value.request_id is None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_never_raise_anything_but_protocol_error(frame):
    for decode in DECODERS.values():
        try:
            decode(frame)
        except ProtocolError:
            pass


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([cls.TAG for _, m in ALL for cls in [type(m)]]),
    st.integers(-(2**63), 2**64 - 1),
    st.lists(_values, max_size=12),
)
def test_well_formed_frames_with_random_fields_decode_or_raise_protocol_error(tag, rid, fields):
    frame = msgpack.packb([protocol.PROTOCOL_VERSION, tag, rid, *fields], use_bin_type=True)
    for decode in DECODERS.values():
        try:
            msg = decode(frame)
        except ProtocolError as e:
            assert e.request_id == rid
        else:
            assert msg.request_id == rid
