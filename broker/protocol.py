"""The one wire contract: every message that crosses a ZeroMQ socket, and the functions that encode and decode it.

Workers and trainer clients import this module and nothing else from `broker`; it imports only
the stdlib, `msgpack` and `broker.codec` (no zmq), so importing it loads no sockets.

A frame is a msgpack array `[PROTOCOL_VERSION, TAG, request_id, *fields]`: every
message carries the version (a restarted peer needs no handshake) and a request id
that its reply repeats. Fields are positional in declaration order; new fields get
defaults and go last, so an older frame that lacks them still decodes. Token ids and
logprobs travel as packed little-endian int32 / float32 bytes, never as lists.
Receivers `match` on the decoded class. The codecs live behind the functions at the end
(`broker.codec`: `generic` walks the fields, `fast` generates code per class, `frames` decodes
a direction); only those functions touch msgpack.
"""

from __future__ import annotations

import typing
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import msgpack

from broker.codec import fast, frames, generic
from broker.codec.wire import IDS, LOGPROBS, MASK, PACKED_MAPS
from broker.codec.wire import is_packed_map as is_packed_map
from broker.codec.wire import pack_message as pack_message

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


def ids_array(values: Iterable[int] = ()) -> array:
    """Token ids as a packed int32 array (the in-memory and wire form)."""
    return array("i", values)


def logprobs_array(values: Iterable[float] = ()) -> array:
    """Logprobs as a packed float32 array: what the broker stores and trains on."""
    return array("f", values)


# --- messages -----------------------------------------------------------------------------
# Field markers (`broker.codec.wire`): `field(metadata=IDS)` is a packed int32 field, `LOGPROBS` a
# float32 one, `MASK` a uint8 one; `PACKED_MAPS` a map (or list of maps) sent as msgpack bins.


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


# --- encode / decode ---------------------------------------------------------------------------

_MESSAGE_CLASSES = frozenset(
    cls
    for union in (WorkerToBroker, BrokerToWorker, TrainerToBroker, BrokerToTrainer)
    for cls in typing.get_args(union)
)
# One generated encoder per message class (`codec.fast`), built on its first use (generating all
# of them would add to every process's import): the same frame as the generic walk.
_ENCODERS: dict[type, Callable[[Any], bytes]] = {}


def encode(msg: Message) -> bytes:
    """Message -> one frame."""
    encoder = _ENCODERS.get(type(msg))
    if encoder is None:
        if type(msg) not in _MESSAGE_CLASSES:
            return generic.encode(msg, PROTOCOL_VERSION)
        encoder = _ENCODERS[type(msg)] = fast.build_encoder(type(msg), PROTOCOL_VERSION)
    return encoder(msg)


def frame_encoder(cls: type[Message]) -> Callable[..., bytes]:
    """A function of `cls`'s fields, all by keyword, giving the frame `encode(cls(**fields))` gives.

    A hot reply's shortcut: the broker answers every commit this way (building the frozen ACK
    costs more than encoding it). Generated from the dataclass's fields, so it cannot put them
    out of order. Build it once (at import), not per call.
    """
    return fast.build_frame_encoder(cls, PROTOCOL_VERSION)


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


_ERRORS = frames.ErrorTypes(ProtocolError, VersionMismatch)


def _decoder(direction: str, union: Any) -> Callable[[bytes], Any]:
    return frames.direction_decoder(direction, union, PROTOCOL_VERSION, _ERRORS)


decode_worker_to_broker: Callable[[bytes], WorkerToBroker] = _decoder("worker_to_broker", WorkerToBroker)
decode_broker_to_worker: Callable[[bytes], BrokerToWorker] = _decoder("broker_to_worker", BrokerToWorker)
decode_trainer_to_broker: Callable[[bytes], TrainerToBroker] = _decoder("trainer_to_broker", TrainerToBroker)
decode_broker_to_trainer: Callable[[bytes], BrokerToTrainer] = _decoder("broker_to_trainer", BrokerToTrainer)
