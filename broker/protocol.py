"""The one wire contract: every message that crosses a ZeroMQ socket, and the functions that encode and decode it.

Workers and trainer clients import this module and nothing else from `broker`; it imports only
the stdlib, `msgpack`, `broker.messages` and `broker.codec` (no zmq), so importing it loads no sockets.

A frame is a msgpack array `[PROTOCOL_VERSION, TAG, request_id, *fields]`: every
message carries the version (a restarted peer needs no handshake) and a request id
that its reply repeats. Fields are positional in declaration order; new fields get
defaults and go last, so an older frame that lacks them still decodes. Token ids and
logprobs travel as packed little-endian int32 / float32 bytes, never as lists.
Receivers `match` on the decoded class. The message dataclasses are defined by socket in
`broker.messages` (`worker`, `trainer`, and `common` for both) and re-exported here with the
union per direction. The codecs live behind the functions at the end (`broker.codec`: `generic`
walks the fields, `fast` generates code per class, `frames` decodes a direction); only those
functions touch msgpack.
"""

from __future__ import annotations

import hashlib
import typing
from array import array
from collections.abc import Callable, Iterable
from typing import Any, Literal

import msgpack

from broker.codec import fast, frames, generic
from broker.codec.wire import is_packed_map, pack_message
from broker.messages.common import FinishAccepted, GetMetrics, Message, MetricsText, Refused, RequestFinish
from broker.messages.trainer import (
    HISTORY_MODES,
    LINEAR_FALLBACKS,
    PAUSE_MODES,
    DeliveredEpisode,
    DropSession,
    EnginesSet,
    EpisodesDelivered,
    FetchEpisodes,
    FinishSession,
    GenerationPaused,
    GenerationResumed,
    GenerationState,
    GetGeneration,
    GetStats,
    OpenSession,
    PauseGeneration,
    ResumeGeneration,
    SessionDropped,
    SessionFinished,
    SessionOpened,
    SetEngines,
    SetWeightVersion,
    Stats,
    TraceRow,
    WeightVersionSet,
    check_history,
)
from broker.messages.worker import (
    NOT_LINEAR,
    SECONDS_BUCKETS,
    AbortTurn,
    CommitTurn,
    GenerationChanged,
    GetTurn,
    Heartbeat,
    OpenTurn,
    SessionsEnded,
    TurnAborted,
    TurnCommitted,
    TurnFound,
    TurnOpened,
    TurnReplayed,
)

# The contract's public names: everything workers and trainer clients may use of `broker`.
__all__ = [
    "PROTOCOL_VERSION", "DEFAULT_CONTROL_ENDPOINT", "DEFAULT_WORKER_ENDPOINT", "session_tag",
    "ErrorCode", "ProtocolError", "VersionMismatch",
    "ids_array", "logprobs_array", "pack_message", "is_packed_map", "unpack_messages",
    "Message", "RequestFinish", "FinishAccepted", "Refused", "GetMetrics", "MetricsText", "SECONDS_BUCKETS",
    "OpenTurn", "CommitTurn", "AbortTurn", "NOT_LINEAR", "GetTurn", "Heartbeat",
    "TurnOpened", "TurnReplayed", "TurnCommitted", "TurnAborted", "TurnFound", "SessionsEnded",
    "OpenSession", "HISTORY_MODES", "LINEAR_FALLBACKS", "check_history",
    "FinishSession", "DropSession", "GetStats", "FetchEpisodes", "SetWeightVersion", "WeightVersionSet",
    "SetEngines", "EnginesSet", "PAUSE_MODES", "PauseGeneration", "ResumeGeneration", "GetGeneration",
    "GenerationPaused", "GenerationResumed", "GenerationState", "GenerationChanged",
    "TraceRow", "SessionOpened", "SessionFinished", "SessionDropped", "Stats", "DeliveredEpisode", "EpisodesDelivered",
    "WorkerToBroker", "BrokerToWorker", "TrainerToBroker", "BrokerToTrainer",
    "encode", "frame_encoder",
    "decode_worker_to_broker", "decode_broker_to_worker", "decode_trainer_to_broker", "decode_broker_to_trainer",
]  # fmt: skip


# Kept while changes only add defaulted fields and messages: a durable broker's log holds frames as received,
# and a newer broker reads an older one's. A newer worker needs a broker at least as new (upgrade it first).
PROTOCOL_VERSION = 1

DEFAULT_CONTROL_ENDPOINT = "tcp://127.0.0.1:5557"  # trainer clients connect here
DEFAULT_WORKER_ENDPOINT = "tcp://127.0.0.1:5558"  # gateway workers connect here


def session_tag(session_id: str) -> str:
    """A session's stable, non-secret name (128 bits of its key's SHA-256), for logs, error messages and engine
    routers. The session id is the agent's API key: it is never logged or echoed, only this tag."""
    return hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest()[:32]

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
    "turn_pending",  # GetTurn, a retry's OpenTurn: the turn is still in flight (its commit may be on its way)
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


# --- the messages, by direction (defined in `broker.messages`) ------------------------------------

WorkerToBroker = OpenTurn | CommitTurn | AbortTurn | GetTurn | Heartbeat | RequestFinish | GetMetrics
BrokerToWorker = (
    TurnOpened | TurnReplayed | TurnCommitted | TurnAborted | TurnFound | SessionsEnded | FinishAccepted | Refused
    | MetricsText | GenerationChanged
)
TrainerToBroker = (
    OpenSession | FinishSession | DropSession | GetStats | RequestFinish | FetchEpisodes | GetMetrics | SetWeightVersion
    | SetEngines | PauseGeneration | ResumeGeneration | GetGeneration
)
BrokerToTrainer = (
    SessionOpened | SessionFinished | SessionDropped | Stats | FinishAccepted | EpisodesDelivered | Refused
    | MetricsText | WeightVersionSet | EnginesSet | GenerationPaused | GenerationResumed | GenerationState
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
