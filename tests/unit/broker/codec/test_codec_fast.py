"""broker.codec.fast: the generated per-class codecs give exactly what the generic codec gives, and are used.

The reference is the generic walk (`codec.generic`: `build` per field spec, `encode`), which the
generated decoders fall back to: for every message of `test_protocol`, for older peers' shorter
frames and for random field values (hypothesis), the decoded message, or the ProtocolError with its
text and request id, must be the same; every generated encoder must write the same bytes. Also pins
that valid frames take the fast path (the fallback is not called), and that `protocol.frame_encoder`
(the hot replies' shortcut) writes `encode`'s bytes for every message type and follows the field order.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import typing

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wire_samples import ALL, DECODERS, _values, unpacked

from broker import protocol
from broker.codec import fast as fastcodec
from broker.codec import generic


def generic_decode(direction: str, frame: bytes) -> protocol.Message:
    """The decoder as it was before code generation: every field through `_build`."""
    union = {
        "worker_to_broker": protocol.WorkerToBroker,
        "broker_to_worker": protocol.BrokerToWorker,
        "trainer_to_broker": protocol.TrainerToBroker,
        "broker_to_trainer": protocol.BrokerToTrainer,
    }[direction]
    by_tag = {cls.TAG: cls for cls in typing.get_args(union)}
    try:
        items = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as e:
        raise protocol.ProtocolError(f"undecodable frame ({type(e).__name__}: {e})") from e
    if not isinstance(items, list) or len(items) < 3:
        raise protocol.ProtocolError("a frame must be an array [version, tag, request_id, ...]")
    version, tag, request_id = items[0], items[1], items[2]
    rid = request_id if isinstance(request_id, int) and not isinstance(request_id, bool) else None
    if version != protocol.PROTOCOL_VERSION:
        raise protocol.VersionMismatch(version, rid)
    cls = by_tag.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise protocol.ProtocolError(f"unknown message {tag!r} for {direction}", rid)
    try:
        return generic.build(cls, items[2:])
    except TypeError as e:
        raise protocol.ProtocolError(f"malformed {tag}: {e}", rid) from e


def outcome(decode: typing.Callable[[bytes], object], frame: bytes) -> tuple[object, ...]:
    """What a decoder makes of a frame, comparable across decoders: the message, or the error's class, text and id."""
    try:
        msg = decode(frame)
    except protocol.ProtocolError as e:
        return ("error", type(e), str(e), e.request_id)
    return ("ok", type(msg), msg)


@pytest.mark.parametrize(("direction", "msg"), ALL, ids=lambda v: getattr(v, "TAG", v))
def test_generated_encoders_write_the_generic_frame(direction, msg):
    assert protocol.encode(msg) == generic.encode(msg, protocol.PROTOCOL_VERSION)


@pytest.mark.parametrize(("direction", "msg"), ALL, ids=lambda v: getattr(v, "TAG", v))
def test_valid_frames_take_the_fast_path_and_decode_like_the_generic_codec(direction, msg):
    cls = type(msg)
    fallbacks: list[object] = []

    def spy(cls_: type, values: list[object]) -> object:
        fallbacks.append(values)
        return generic.build(cls_, values)

    converters = generic.converters(cls)
    decode = fastcodec.build_decoder(cls, converters, spy, True)
    items = msgpack.unpackb(protocol.encode(msg), raw=False, strict_map_key=False)
    decoded = decode(items)
    assert fallbacks == [], f"{cls.__name__} fell back to the generic build"
    assert unpacked(decoded) == msg and type(decoded) is cls
    assert decoded == generic.build(cls, items[2:])
    with pytest.raises(AttributeError):  # still a frozen dataclass
        decoded.request_id = 0  # type: ignore[misc]
    # an older peer's frame, without the trailing defaulted fields, is the generic build's to decode
    n_required = sum(
        1 for f in dataclasses.fields(cls) if f.default is f.default_factory is dataclasses.MISSING
    )
    if n_required < len(items) - 2:
        assert decode(items[: 2 + n_required]) == generic.build(cls, items[2 : 2 + n_required])
        assert len(fallbacks) == 1


@pytest.mark.parametrize(("direction", "msg"), ALL, ids=lambda v: getattr(v, "TAG", v))
def test_each_field_of_the_wrong_type_fails_as_the_generic_codec_fails(direction, msg):
    items = msgpack.unpackb(protocol.encode(msg), raw=False, strict_map_key=False)
    for i in range(2, len(items)):
        for wrong in (None, True, 1, 1.5, "x", b"\x00\x00\x00", [1], {"k": 1}, [[1]]):
            bad = msgpack.packb([*items[:i], wrong, *items[i + 1 :]], use_bin_type=True)
            assert outcome(DECODERS[direction], bad) == outcome(lambda f: generic_decode(direction, f), bad)


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(sorted({type(m).TAG for _, m in ALL})),
    st.integers(-(2**63), 2**64 - 1) | st.booleans() | st.none(),
    st.lists(_values, max_size=18),
    st.sampled_from(sorted(DECODERS)),
)
def test_random_frames_decode_exactly_as_with_the_generic_codec(tag, rid, fields, direction):
    frame = msgpack.packb([protocol.PROTOCOL_VERSION, tag, rid, *fields], use_bin_type=True)
    assert outcome(DECODERS[direction], frame) == outcome(lambda f: generic_decode(direction, f), frame)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(ALL), st.data())
def test_mutated_valid_frames_decode_exactly_as_with_the_generic_codec(case, data):
    direction, msg = case
    items = msgpack.unpackb(protocol.encode(msg), raw=False, strict_map_key=False)
    i = data.draw(st.integers(0, len(items) - 1))
    items[i] = data.draw(_values)
    frame = msgpack.packb(items, use_bin_type=True)
    assert outcome(DECODERS[direction], frame) == outcome(lambda f: generic_decode(direction, f), frame)


def test_packed_arrays_keep_their_typecode_and_values():
    lps = protocol.logprobs_array([-0.25, -3.5])
    msg = protocol.CommitTurn(1, "s", "t", protocol.ids_array([1, -2, 2**31 - 1]), protocol.ids_array([7, 8]), lps,
                              "stop", [], {"role": "assistant", "content": ""})  # fmt: skip
    decoded = protocol.decode_worker_to_broker(protocol.encode(msg))
    assert [decoded.prompt_ids.typecode, decoded.output_ids.typecode, decoded.logprobs.typecode] == ["i", "i", "f"]
    assert decoded.prompt_ids.tolist() == [1, -2, 2**31 - 1] and decoded.logprobs.tolist() == [-0.25, -3.5]
    assert decoded.prompt_ids is not msg.prompt_ids


def test_frame_encoder_writes_the_frame_of_the_built_message():
    committed = protocol.frame_encoder(protocol.TurnCommitted)
    assert committed(request_id=7, turn_id="t-1", outcome="stored") == protocol.encode(
        protocol.TurnCommitted(7, "t-1", "stored")
    )
    heads = [["t-1", 2, "ab"]]
    opened = protocol.TurnOpened(
        8, "t-2", 3, {"temperature": 0.7}, None, "linear", "fork", heads, 1, 4, "http://e:1", 2, "wait"
    )
    frame = protocol.frame_encoder(protocol.TurnOpened)(
        request_id=8, turn_id="t-2", seq=3, sampling_defaults={"temperature": 0.7}, max_context_tokens=None,
        history_mode="linear", linear_fallback="fork", heads=[["t-1", 2, "ab"]], pending=1, weight_version=4,
        replica="http://e:1", generation_epoch=2, paused="wait",
    )
    assert frame == protocol.encode(opened)
    aborted = protocol.frame_encoder(protocol.TurnAborted)(request_id=9, turn_id="t-3")
    assert protocol.decode_broker_to_worker(aborted) == protocol.TurnAborted(9, "t-3")


@pytest.mark.parametrize(("direction", "msg"), ALL, ids=lambda v: getattr(v, "TAG", v))
def test_every_message_type_frame_encoded_from_its_fields_is_encodes_frame_and_round_trips(direction, msg):
    # ALL holds every class of every direction (test_protocol's coverage test), so this covers each type
    fields = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    frame = protocol.frame_encoder(type(msg))(**fields)
    assert frame == protocol.encode(msg) == generic.encode(msg, protocol.PROTOCOL_VERSION)
    decoded = DECODERS[direction](frame)
    assert type(decoded) is type(msg) and unpacked(decoded) == msg


@dataclasses.dataclass(frozen=True, slots=True)
class _Pair(protocol.Message):
    TAG: typing.ClassVar[str] = "pair"
    first: str
    second: str


@dataclasses.dataclass(frozen=True, slots=True)
class _PairReordered(protocol.Message):  # _Pair with its two fields swapped
    TAG: typing.ClassVar[str] = "pair"
    second: str
    first: str


def test_frame_encoder_follows_the_dataclass_field_order_and_takes_fields_only_by_name():
    for cls in (_Pair, _PairReordered):
        frame = protocol.frame_encoder(cls)(request_id=1, first="a", second="b")
        assert frame == protocol.encode(cls(request_id=1, first="a", second="b"))  # the wire follows the class
    items = msgpack.unpackb(protocol.frame_encoder(_PairReordered)(request_id=1, first="a", second="b"))
    assert items[3:] == ["b", "a"]
    encode_pair = protocol.frame_encoder(_Pair)
    with pytest.raises(TypeError):
        encode_pair(1, "a", "b")  # positional: the order could silently drift
    with pytest.raises(TypeError):
        encode_pair(request_id=1, first="a")  # every field given
    with pytest.raises(TypeError):
        encode_pair(request_id=1, first="a", second="b", third="c")


@pytest.mark.parametrize(("direction", "msg"), ALL, ids=lambda v: getattr(v, "TAG", v))
def test_a_decoded_message_is_an_ordinary_instance_of_its_class(direction, msg):
    """Filled as a subclass and then re-classed (`fastcodec._fill_class`): nothing of the subclass may show."""
    decoded = DECODERS[direction](protocol.encode(msg))
    cls = type(msg)
    assert decoded.__class__ is cls and not hasattr(decoded, "__dict__")
    assert dataclasses.replace(decoded) == decoded and type(dataclasses.replace(decoded)) is cls
    assert copy.copy(decoded) == decoded and pickle.loads(pickle.dumps(decoded)) == decoded
    with pytest.raises(AttributeError):  # frozen: neither set nor deleted
        del decoded.request_id
    assert protocol.encode(decoded) == protocol.encode(msg)
