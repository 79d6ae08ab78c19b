"""The one wire contract: every message that crosses a ZeroMQ socket, and its codec.

Workers and trainer clients import this module and nothing else from `broker`; it
imports only the stdlib and `msgpack` (no zmq), so importing it loads no sockets.

A frame is a msgpack array `[PROTOCOL_VERSION, TAG, request_id, *fields]`: every
message carries the version (a restarted peer needs no handshake) and a request id
that its reply repeats. Fields are positional in declaration order; new fields get
defaults and go last, so an older frame that lacks them still decodes. Token ids and
logprobs travel as packed little-endian int32 / float32 bytes, never as lists.
Receivers `match` on the decoded class; only `encode` and the `decode_*` functions
touch msgpack.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Union

import msgpack

from broker.codec import fast as fastcodec

PROTOCOL_VERSION = 1

DEFAULT_CONTROL_ENDPOINT = "tcp://127.0.0.1:5557"  # trainer clients connect here
DEFAULT_WORKER_ENDPOINT = "tcp://127.0.0.1:5558"  # gateway workers connect here

ErrorCode = Literal[
    "unknown_session",  # no such session (never opened, or already freed)
    "session_closed",  # finish was requested: no new turns
    "turn_cap",  # max_turns reached
    "duplicate_session",  # open_session with a key that is already in use
    "bad_request",  # a well-formed frame whose content makes no sense
    "protocol",  # garbage, unknown tag, wrong types
    "version_mismatch",  # peer speaks another PROTOCOL_VERSION
    "busy",  # a bounded resource is full; retry later
    "internal",  # a failure of the broker's own; logged there
    "unknown_turn",  # GetTurn: no committed turn with that id in that session
    "turn_pending",  # GetTurn: the turn is still in flight (its commit may be on its way); retry shortly
    "unknown_base",  # CommitTurn: a delta against a turn the broker does not hold; resend the turn in full
]


class ProtocolError(Exception):
    """A frame could not be decoded: garbage, an unknown tag or a field of the wrong type.

    `request_id` is set when the frame was readable enough to find it, so the receiver
    can answer the sender with a `Refused` it will match to its request.
    """

    def __init__(self, message: str, request_id: int | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class VersionMismatch(ProtocolError):
    """The peer speaks another PROTOCOL_VERSION: upgrade one side so both match."""

    def __init__(self, peer_version: object, request_id: int | None = None) -> None:
        super().__init__(
            f"peer speaks protocol version {peer_version!r}, this side speaks {PROTOCOL_VERSION}; "
            "run the same rollout-gateway release on broker, workers and trainer clients",
            request_id,
        )
        self.peer_version = peer_version


# --- packed arrays ---------------------------------------------------------------------

_LITTLE = sys.byteorder == "little"


def ids_array(values: Iterable[int] = ()) -> array:
    """Token ids as a packed int32 array (the in-memory and wire form)."""
    return array("i", values)


def logprobs_array(values: Iterable[float] = ()) -> array:
    """Logprobs as a packed float32 array: what the broker stores and trains on."""
    return array("f", values)


def _pack(a: array) -> bytes:
    if _LITTLE:
        return a.tobytes()
    swapped = array(a.typecode, a)
    swapped.byteswap()
    return swapped.tobytes()


def _unpacker(typecode: str) -> Callable[[object], array]:
    itemsize = array(typecode).itemsize

    def unpack(value: object) -> array:
        if not isinstance(value, (bytes, bytearray)) or len(value) % itemsize:
            raise TypeError(f"expected packed {typecode!r} bytes")
        a = array(typecode)
        a.frombytes(value)
        if not _LITTLE:
            a.byteswap()
        return a

    return unpack


# --- messages -----------------------------------------------------------------------------
# `field(metadata=IDS)` marks a packed int32 field, `LOGPROBS` a float32 one, `MASK` a uint8 one.
IDS = {"packed": "i"}
LOGPROBS = {"packed": "f"}
MASK = {"packed": "B"}
# `PACKED_MAPS` marks a message field (a map, or a list of maps) that travels as msgpack bins, each the
# encoding of one map: the broker keeps them as bytes and decodes them only when it needs the dicts.
PACKED_MAPS = {"packed_maps": True}


@dataclass(frozen=True, slots=True)
class Message:
    """Base of every wire message; `TAG` names it on the wire."""

    TAG: ClassVar[str] = ""
    request_id: int


# Worker -> broker


@dataclass(frozen=True, slots=True)
class OpenTurn(Message):
    """Ask to start a turn: the session must exist, be open and be under its turn cap."""

    TAG: ClassVar[str] = "open_turn"
    session_id: str
    turn_id: str


@dataclass(frozen=True, slots=True)
class CommitTurn(Message):
    """A turn whose reply reached the agent; retried until `TurnCommitted`, de-duplicated by turn_id.

    Canonical messages: dicts with `role`, `content` (str), optional `reasoning` (str),
    optional `tool_calls` ([{"name": str, "arguments": object}], no wire ids) and, for
    tool results, optional `name`. `flags` holds parse verdicts (`ill_formed`, ...).
    On the wire each message is a bin holding its own msgpack encoding (`pack_message`), so the
    broker stores it without decoding it; decoded, such a message is that `bytes` (a map from an
    older sender decodes as a dict, and either form is accepted on the way in).

    A delta commit names `base_turn_id`, a committed turn of the same session, and sends
    only what follows the shared prefix: the turn's context (prompt ids + output ids) is
    the base's context cut to `base_tokens`, then `prompt_ids`, then the output ids past
    `prompt_len` (all of `output_ids` when `base_tokens <= prompt_len`; `output_ids` and
    `logprobs` always travel whole). Its prompt messages are the base's (prompt messages +
    response) cut to `base_messages` (at most the turn's prompt message count), then
    `prompt_messages`. A base the broker does not hold is refused with unknown_base: the
    sender resends the turn in full. `base_crc32` is zlib.crc32 of the shared prefix's ids as
    int32 little-endian bytes: the broker checks it against the base it holds, so a wrong claim
    is refused (unknown_base) instead of training on tokens the engine never saw. With
    `base_turn_id == ""` (a full commit) `prompt_len` is 0 or `len(prompt_ids)` and the base
    fields are 0.
    """

    TAG: ClassVar[str] = "commit_turn"
    session_id: str
    turn_id: str
    prompt_ids: array = field(metadata=IDS)
    output_ids: array = field(metadata=IDS)
    logprobs: array = field(metadata=LOGPROBS)
    finish_reason: str
    prompt_messages: list[dict[str, Any] | bytes] = field(metadata=PACKED_MAPS)
    response_message: dict[str, Any] | bytes = field(metadata=PACKED_MAPS)
    flags: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    base_turn_id: str = ""
    base_tokens: int = 0
    base_messages: int = 0
    prompt_len: int = 0
    base_crc32: int = 0


@dataclass(frozen=True, slots=True)
class AbortTurn(Message):
    """The reply never reached the agent: forget the turn, never train on it."""

    TAG: ClassVar[str] = "abort_turn"
    session_id: str
    turn_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class GetTurn(Message):
    """Ask for a committed turn's canonical messages (an API's `previous_response_id`).

    Only turns of `session_id` are found, so a response id never leaks across sessions.
    An empty `turn_id` only checks that the session is open (`Refused` unknown_turn if it is).
    """

    TAG: ClassVar[str] = "get_turn"
    session_id: str
    turn_id: str


# Broker -> worker


@dataclass(frozen=True, slots=True)
class TurnOpened(Message):
    """The turn may proceed; `seq` orders it in the trajectory (never commit arrival)."""

    TAG: ClassVar[str] = "turn_opened"
    turn_id: str
    seq: int
    sampling_defaults: dict[str, Any]
    max_context_tokens: int | None


@dataclass(frozen=True, slots=True)
class TurnCommitted(Message):
    """ACK of a commit. `outcome`: stored, duplicate (already stored) or discarded (session gone)."""

    TAG: ClassVar[str] = "turn_committed"
    turn_id: str
    outcome: str


@dataclass(frozen=True, slots=True)
class TurnAborted(Message):
    """ACK of an abort."""

    TAG: ClassVar[str] = "turn_aborted"
    turn_id: str


@dataclass(frozen=True, slots=True)
class TurnFound(Message):
    """A committed turn's canonical prompt messages and response message (see `CommitTurn`)."""

    TAG: ClassVar[str] = "turn_found"
    turn_id: str
    prompt_messages: list[dict[str, Any]]
    response_message: dict[str, Any]


# Trainer -> broker


@dataclass(frozen=True, slots=True)
class OpenSession(Message):
    """Open a session; `session_id=None` lets the broker mint an unguessable key.

    `client_id` names the opening `TrainerClient` and `group` a batch of sessions: the two
    filters a subscriber may put on the episode stream (`FetchEpisodes`).
    """

    TAG: ClassVar[str] = "open_session"
    session_id: str | None
    sampling_defaults: dict[str, Any]
    max_context_tokens: int | None
    max_turns: int | None
    metadata: dict[str, Any] = field(default_factory=dict)
    client_id: str = ""
    group: str | None = None


@dataclass(frozen=True, slots=True)
class FinishSession(Message):
    """Close to new turns, drain in-flight turns up to `wait_timeout` s, build rows, free."""

    TAG: ClassVar[str] = "finish_session"
    session_id: str
    reward: float | None
    rollout_id: str | None
    metadata: dict[str, Any]
    wait_timeout: float


@dataclass(frozen=True, slots=True)
class DropSession(Message):
    """Free a session and everything it holds, building nothing."""

    TAG: ClassVar[str] = "drop_session"
    session_id: str


@dataclass(frozen=True, slots=True)
class GetStats(Message):
    """Ask for the broker's counters."""

    TAG: ClassVar[str] = "get_stats"


@dataclass(frozen=True, slots=True)
class RequestFinish(Message):
    """Finish a session without waiting for its rows: they go to the episode outbox (see `FetchEpisodes`).

    Sent by a trainer (`request_finish`), or by a worker for an agent's `POST /rollout/v1/sessions/finish`
    (then on the worker socket). Answered at once with `FinishAccepted`; in-flight turns still get up to
    `wait_timeout` s to land. A session finishes exactly once, whichever request comes first: the others
    are refused with session_closed. A full outbox refuses it with busy and leaves the session open.
    """

    TAG: ClassVar[str] = "request_finish"
    session_id: str
    reward: float | None
    rollout_id: str | None
    metadata: dict[str, Any]
    wait_timeout: float


@dataclass(frozen=True, slots=True)
class FetchEpisodes(Message):
    """A subscriber's one request: acknowledge, renew its lease, hand back, and ask for more episodes.

    Delivery ids belong to the broker's `epoch`; ids of another epoch (a restarted broker) are ignored.
    `credit`: new episodes it can take now. `acks`: ids it is done with. `held`: ids it still holds
    unacknowledged (yielded or buffered); anything else leased to it goes back to the queue marked
    redelivered. `release`: ids it returns unseen (not marked). `wait`: seconds the broker may park the
    request when nothing matches (long poll). `lease`: the subscriber polls again within this many
    seconds, or its episodes are requeued. Filters: `client_id` (sessions that client opened) and
    `group` (sessions opened with that group); None matches all.
    """

    TAG: ClassVar[str] = "fetch_episodes"
    subscriber_id: str
    epoch: str
    credit: int
    acks: list[int]
    held: list[int]
    release: list[int]
    wait: float
    lease: float
    client_id: str | None
    group: str | None


# Broker -> trainer


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One loss-masked training row; `trainer_client.TraceRecord` is its public face.

    `loss_mask` and `logprobs` cover the response region only: the last
    `response_length` entries of `token_ids` (the row's first prompt is stripped).
    """

    token_ids: array = field(metadata=IDS)
    loss_mask: array = field(metadata=MASK)
    logprobs: array = field(metadata=LOGPROBS)
    response_length: int
    response: str
    rollout_id: str | None
    reward: float | None
    status: str
    metadata: dict[str, Any]


@dataclass(frozen=True, slots=True)
class SessionOpened(Message):
    TAG: ClassVar[str] = "session_opened"
    session_id: str


@dataclass(frozen=True, slots=True)
class SessionFinished(Message):
    """The session's rows. `status`: complete, or drain_timeout if in-flight turns were cut off."""

    TAG: ClassVar[str] = "session_finished"
    session_id: str
    rows: list[TraceRow]
    status: str
    turns_committed: int
    turns_abandoned: int


@dataclass(frozen=True, slots=True)
class SessionDropped(Message):
    TAG: ClassVar[str] = "session_dropped"
    session_id: str
    existed: bool


@dataclass(frozen=True, slots=True)
class Stats(Message):
    TAG: ClassVar[str] = "stats"
    stats: dict[str, Any]


@dataclass(frozen=True, slots=True)
class FinishAccepted(Message):
    """A `RequestFinish` was accepted: the session is closed and its episode will reach the outbox."""

    TAG: ClassVar[str] = "finish_accepted"
    session_id: str


@dataclass(frozen=True, slots=True)
class DeliveredEpisode:
    """One finished episode handed to a subscriber; `trainer_client.Episode` is its public face.

    `status`: complete, drain_timeout (in-flight turns were cut off) or failed (rows could not be
    built; the broker log has the cause). `redelivered`: it was handed out before and not
    acknowledged, so it may have been (partly) processed. `finished_by`: trainer or agent.
    """

    delivery_id: int
    session_id: str
    rows: list[TraceRow]
    reward: float | None
    rollout_id: str | None
    metadata: dict[str, Any]
    status: str
    redelivered: bool
    group: str | None
    finished_by: str
    turns_committed: int
    turns_abandoned: int


@dataclass(frozen=True, slots=True)
class EpisodesDelivered(Message):
    """The answer to `FetchEpisodes`: new episodes (up to its credit), the held ids no longer leased to
    the subscriber (`revoked`: drop them unprocessed), and how many of its acks were applied."""

    TAG: ClassVar[str] = "episodes_delivered"
    epoch: str
    episodes: list[DeliveredEpisode]
    revoked: list[int]
    acked: int


# Either direction from the broker


@dataclass(frozen=True, slots=True)
class Refused(Message):
    """The request was not carried out; `code` says why (see ErrorCode)."""

    TAG: ClassVar[str] = "refused"
    code: str
    message: str


WorkerToBroker = OpenTurn | CommitTurn | AbortTurn | GetTurn | RequestFinish
BrokerToWorker = TurnOpened | TurnCommitted | TurnAborted | TurnFound | FinishAccepted | Refused
TrainerToBroker = OpenSession | FinishSession | DropSession | GetStats | RequestFinish | FetchEpisodes
BrokerToTrainer = (
    SessionOpened | SessionFinished | SessionDropped | Stats | FinishAccepted | EpisodesDelivered | Refused
)


# --- codec ----------------------------------------------------------------------------------


def _check(kind: type | tuple[type, ...], name: str) -> Callable[[object], object]:
    def check(value: object) -> object:
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
            raise TypeError(f"expected {name}")
        return value

    return check


def _as_float(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError("expected float")
    return float(value)


def _optional(inner: Callable[[object], object]) -> Callable[[object], object]:
    return lambda value: None if value is None else inner(value)


def _list_of(inner: Callable[[object], object]) -> Callable[[object], object]:
    def decode_list(value: object) -> list[object]:
        if not isinstance(value, list):
            raise TypeError("expected list")
        return [inner(v) for v in value]

    return decode_list


def _converter(hint: Any) -> Callable[[object], object]:
    """Turn a field's type hint into a validating decoder of its msgpack value."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) > 1 and all(a in (dict, bytes) or typing.get_origin(a) is dict for a in args):
            kinds = tuple(typing.get_origin(a) or a for a in args)
            return _check(kinds, " or ".join("map" if k is dict else k.__name__ for k in kinds))
        if len(args) != 1:
            raise TypeError(f"unsupported union {hint!r}")
        return _optional(_converter(args[0]))
    if origin is list:
        (item,) = typing.get_args(hint)
        if isinstance(item, type) and dataclasses.is_dataclass(item):
            return _list_of(_struct_decoder(item))
        if item in (int, str):  # e.g. delivery ids: each element is checked too
            return _list_of(_converter(item))
        return _check(list, "list")
    if hint is float:
        return _as_float
    simple = {str: "str", int: "int", bool: "bool", bytes: "bytes"}
    if hint in simple:
        return _check(hint, simple[hint])
    if hint is dict or origin is dict:
        return _check(dict, "map")
    if hint is Any:
        return lambda value: value
    raise TypeError(f"unsupported field type {hint!r}")


_Spec = list[tuple[str, Callable[[object], object], bool]]  # (name, decoder, packed)
_SPECS: dict[type, _Spec] = {}


def _spec(cls: type) -> _Spec:
    spec = _SPECS.get(cls)
    if spec is None:
        hints = typing.get_type_hints(cls)
        spec = []
        for f in dataclasses.fields(cls):
            packed = f.metadata.get("packed")
            decoder = _unpacker(packed) if packed else _converter(hints[f.name])
            spec.append((f.name, decoder, bool(packed)))
        _SPECS[cls] = spec
    return spec


def _fields_out(obj: object) -> list[object]:
    out: list[object] = []
    maps = _PACKED_MAP_FIELDS.get(type(obj), ())
    for name, _, packed in _spec(type(obj)):
        value = getattr(obj, name)
        if packed:
            value = _pack(value)
        elif name in maps:
            value = [pack_message(v) for v in value] if type(value) is list else pack_message(value)
        elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            value = [_fields_out(v) for v in value]
        out.append(value)
    return out


def _build(cls: type, values: list[object]) -> Any:
    spec = _spec(cls)
    if len(values) > len(spec):
        raise TypeError(f"{len(values)} fields, {cls.__name__} has {len(spec)}")
    kwargs = {}
    for (name, decoder, _), value in zip(spec, values, strict=False):  # older peers send fewer
        try:
            kwargs[name] = decoder(value)
        except TypeError as e:
            raise TypeError(f"{cls.__name__}.{name}: {e}") from None
    try:
        return cls(**kwargs)  # fields missing from an older peer take their defaults
    except TypeError as e:
        raise TypeError(f"{cls.__name__}: {e}") from None


def _struct_decoder(cls: type) -> Callable[[object], object]:
    def decode_struct(value: object) -> object:
        if not isinstance(value, list):
            raise TypeError(f"expected {cls.__name__} as array")
        return _build(cls, value)

    return decode_struct


_packer = msgpack.Packer(use_bin_type=True)
_PACKED_MAP_FIELDS: dict[type, frozenset[str]] = {
    cls: frozenset(f.name for f in dataclasses.fields(cls) if f.metadata.get("packed_maps"))
    for cls in (CommitTurn,)
}
# First byte of a msgpack map: fixmap (0x80-0x8f), map 16 (0xde), map 32 (0xdf).
_MAP_MARKERS = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])


def pack_message(message: dict[str, Any] | bytes) -> bytes:
    """A message's msgpack encoding, the form `CommitTurn` carries and the broker keeps (bytes pass through)."""
    if type(message) is bytes:
        return message
    if not isinstance(message, dict):
        raise TypeError(f"a message is a map, not {type(message).__name__}")
    return _packer.pack(message)


def is_packed_map(value: object) -> bool:
    """Whether `value` is bytes that start like a msgpack map (the cheap check a stored message gets on arrival)."""
    return type(value) is bytes and len(value) > 0 and value[0] in _MAP_MARKERS


def unpack_messages(buf: bytes | bytearray | memoryview) -> list[dict[str, Any]]:
    """Messages packed back to back (`pack_message`) -> dicts; ProtocolError if any is not a whole map."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(buf), 1))
    unpacker.feed(buf)
    out = []
    try:
        while unpacker.tell() < len(buf):  # the start of the next message (a truncated one raises OutOfData)
            out.append(unpacker.unpack())
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(f"undecodable stored message ({type(e).__name__}: {e})") from e
    if any(type(m) is not dict for m in out):
        raise ProtocolError("a stored message is not a msgpack map")
    return out


def _encode_generic(msg: Message) -> bytes:
    return _packer.pack([PROTOCOL_VERSION, msg.TAG, *_fields_out(msg)])


_STRUCT_FIELDS: dict[type, Callable[[Any], list[object]]] = {}


def _struct_fields(cls: type) -> Callable[[Any], list[object]]:
    fields = _STRUCT_FIELDS.get(cls)
    if fields is None:
        fields = _STRUCT_FIELDS[cls] = fastcodec.build_fields(cls, _pack, _struct_fields)
    return fields


_MESSAGE_CLASSES = frozenset(
    cls
    for union in (WorkerToBroker, BrokerToWorker, TrainerToBroker, BrokerToTrainer)
    for cls in typing.get_args(union)
)
# One generated encoder per message class (see `fastcodec`), built on its first use (generating all
# of them would add ~30 ms to every process's import): the same frame as the generic walk.
_ENCODERS: dict[type, Callable[[Any], bytes]] = {}


def encode(msg: Message) -> bytes:
    """Message -> one frame."""
    encoder = _ENCODERS.get(type(msg))
    if encoder is None:
        if type(msg) not in _MESSAGE_CLASSES:
            return _encode_generic(msg)
        encoder = _ENCODERS[type(msg)] = fastcodec.build_encoder(
            type(msg), PROTOCOL_VERSION, _packer.pack, _pack, _struct_fields, pack_message
        )
    return encoder(msg)


def encode_as(cls: type[Message], *fields: object) -> bytes:
    """The frame `encode(cls(*fields))` gives, without building the message: a hot reply's shortcut.

    Only for messages whose fields all travel as they are (no packed arrays, no nested structs),
    given in full; the broker answers every commit this way (building the frozen ACK costs more
    than encoding it).
    """
    return _packer.pack([PROTOCOL_VERSION, cls.TAG, *fields])


def _fast_decoder(cls: type) -> Callable[[list[object]], Any]:
    """`fastcodec`'s decoder of `cls`; it falls back to `_build` for anything it does not accept at once."""
    converters = {name: decoder for name, decoder, _ in _spec(cls)}
    return fastcodec.build_decoder(cls, converters, _build, _LITTLE)


def _lazy_decoder(cls: type, table: dict[str, Callable[[list[object]], Any]]) -> Callable[[list[object]], Any]:
    """A stand-in that generates `cls`'s decoder on its first frame and puts it in `table` in its place."""

    def first(items: list[object]) -> Any:
        decode = table[cls.TAG] = _fast_decoder(cls)  # type: ignore[attr-defined]
        return decode(items)

    return first


def _request_id(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _bad_frame(items: object, direction: str) -> ProtocolError:
    """Why a frame that decoded as msgpack is not a message of this direction."""
    if not isinstance(items, list) or len(items) < 3:
        return ProtocolError("a frame must be an array [version, tag, request_id, ...]")
    version, tag, rid = items[0], items[1], _request_id(items[2])
    if version != PROTOCOL_VERSION:
        return VersionMismatch(version, rid)
    return ProtocolError(f"unknown message {tag!r} for {direction}", rid)


def _decoder(direction: str, union: Any) -> Callable[[bytes], Any]:
    by_tag: dict[str, Callable[[list[object]], Any]] = {}
    by_tag.update((cls.TAG, _lazy_decoder(cls, by_tag)) for cls in typing.get_args(union))
    unpackb = msgpack.unpackb

    def decode(frame: bytes) -> Any:
        try:
            items = unpackb(frame, raw=False, strict_map_key=False)
        except Exception as e:  # msgpack raises several unrelated types for garbage
            raise ProtocolError(f"undecodable frame ({type(e).__name__}: {e})") from e
        # The usual frame passes these four checks; anything unusual is sorted out by `_bad_frame`.
        if type(items) is list and len(items) > 2 and items[0] == PROTOCOL_VERSION and type(items[1]) is str:
            build = by_tag.get(items[1])  # type: ignore[arg-type]
            if build is not None:
                try:
                    return build(items)
                except TypeError as e:
                    raise ProtocolError(f"malformed {items[1]}: {e}", _request_id(items[2])) from e
        raise _bad_frame(items, direction)

    decode.__name__ = f"decode_{direction}"
    return decode


decode_worker_to_broker: Callable[[bytes], WorkerToBroker] = _decoder("worker_to_broker", WorkerToBroker)
decode_broker_to_worker: Callable[[bytes], BrokerToWorker] = _decoder("broker_to_worker", BrokerToWorker)
decode_trainer_to_broker: Callable[[bytes], TrainerToBroker] = _decoder("trainer_to_broker", TrainerToBroker)
decode_broker_to_trainer: Callable[[bytes], BrokerToTrainer] = _decoder("broker_to_trainer", BrokerToTrainer)
