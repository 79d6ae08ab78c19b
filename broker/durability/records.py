"""What the write-ahead log and the snapshots hold: the record kinds and the typed records, and their codec.

A record's kind byte (`broker.durability.wal`) says how to read its payload:
- `WORKER_FRAME`: a worker's OpenTurn, CommitTurn or AbortTurn frame exactly as it arrived (the
  cheapest durable form of a commit: it is msgpack already, and replaying it through the registry
  rebuilds the same store, delta commits included, since they are replayed in the order they were
  stored); read back with `protocol.decode_worker_to_broker`.
- `STATE`: one of the tagged dataclasses below, a frame `[WAL_FORMAT, TAG, *fields]` written and read
  by the broker's own codec (`broker.codec`: generated encoders, one typed decoder), as wire messages
  are, so a record of the wrong shape is an error, never a guess.
- `STATE_WITH_BLOBS`: a snapshot's session image whose large buffers (compressed log chunks) follow
  its frame as raw bytes, so that writing it copies none of them in the broker's thread (`image_parts`).
Records name sessions by their id (the API key: the state directory is as secret as the broker's
memory). Imports the stdlib, `broker.protocol` and `broker.codec` (its msgpack extension type marks
a blob); no sockets.
"""

from __future__ import annotations

import struct
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from broker import protocol
from broker.codec import fast, frames
from broker.codec.wire import ExtType

# The records' own format version, in every STATE frame: a broker never reads a state directory
# written in a format it does not know (it says so and refuses to start).
WAL_FORMAT = 1

WORKER_FRAME = 1
STATE = 2
# A snapshot image with its large buffers after it (`split_blobs`): a u32 length, the STATE frame, the blobs.
STATE_WITH_BLOBS = 3


class RecordError(Exception):
    """A record whose checksum holds but whose content is not a record this broker writes."""

    def __init__(self, message: str, request_id: int | None = None) -> None:
        super().__init__(message)


class FormatMismatch(RecordError):
    """The state directory was written in another record format."""

    def __init__(self, peer_version: object, request_id: int | None = None) -> None:
        super().__init__(f"record format {peer_version!r}, this broker reads format {WAL_FORMAT}")


@dataclass(frozen=True, slots=True)
class Record:
    """Base of the STATE records; `TAG` names each in its frame."""

    TAG: ClassVar[str] = ""


# --- the log: one record per change, appended before the change is acknowledged -------------------


@dataclass(frozen=True, slots=True)
class OpenRecord(Record):
    """A session opened, with its settings as the registry keeps them (a minted key included; a record from
    before history modes reads as a tree session).

    Its fields after `session_id` declare what a session is opened with (`SESSION_SETTINGS`): the snapshot's
    image holds the same, in this order, and recovery opens the session with them by name (`Session`'s and
    `SessionRegistry.open_session`'s). A new setting is a field here, with a default for older records.
    """

    TAG: ClassVar[str] = "open"
    session_id: str
    sampling_defaults: dict[str, Any]
    max_context_tokens: int | None
    max_turns: int | None
    metadata: dict[str, Any]
    client_id: str
    group: str | None
    history_mode: str = "tree"
    linear_fallback: str = "fork"


SESSION_SETTINGS: tuple[str, ...] = tuple(f.name for f in fields(OpenRecord) if f.name != "session_id")


def session_settings(session: Any) -> dict[str, Any]:
    """A session's (or an OpenRecord's) settings by name, in `SESSION_SETTINGS`' order."""
    return {name: getattr(session, name) for name in SESSION_SETTINGS}


def open_record(session: Any) -> OpenRecord:
    """The record of a session's opening: its id (`sid`) and its settings."""
    return OpenRecord(session.sid, **session_settings(session))


@dataclass(frozen=True, slots=True)
class CloseRecord(Record):
    """A session closed by a RequestFinish (trainer or agent): its episode is promised to the outbox.

    A FinishSession's close is not logged: its trainer waits for the rows, and a broker that restarts
    before they were sent finds the session open, so the trainer's retried finish gets them.
    `request_id`: the RequestFinish's, so that its repeat after a restart is accepted again (0: not known).
    """

    TAG: ClassVar[str] = "close"
    session_id: str
    origin: str
    reward: float | None
    rollout_id: str | None
    metadata: dict[str, Any]
    wait_timeout: float
    request_id: int = 0


@dataclass(frozen=True, slots=True)
class FinishRecord(Record):
    """A FinishSession's rows were built: the session is over (logged before its rows are sent).

    `answer`: the reply frame the rows went in, to request `request_id`, so that a repeat of that request
    after a restart gets the same rows (`episodes.answers`); None when the rows failed to build.
    """

    TAG: ClassVar[str] = "finish"
    session_id: str
    origin: str
    request_id: int = 0
    answer: bytes | None = None


@dataclass(frozen=True, slots=True)
class DropRecord(Record):
    TAG: ClassVar[str] = "drop"
    session_id: str


@dataclass(frozen=True, slots=True)
class VersionRecord(Record):
    """The trainer set the policy version (`protocol.SetWeightVersion`): turns opened after it record it."""

    TAG: ClassVar[str] = "weight_version"
    version: int


@dataclass(frozen=True, slots=True)
class PauseRecord(Record):
    """Generation paused or resumed (`broker.generation`): the epoch, the pause's mode ("" once resumed) and
    when it began (Unix time)."""

    TAG: ClassVar[str] = "generation"
    epoch: int
    paused: str
    since: float


@dataclass(frozen=True, slots=True)
class EpisodeRecord(Record):
    """A finished-by-request session's episode entered the outbox (and the session is over).

    `episode` is the episode's encoding (`encode_episode`): what a restart redelivers, rows included.
    """

    TAG: ClassVar[str] = "episode"
    delivery_id: int
    session_id: str
    client_id: str
    episode: bytes


@dataclass(frozen=True, slots=True)
class LeaseRecord(Record):
    """Episodes leased to a subscriber (its lease, seconds, renewed from the restart on)."""

    TAG: ClassVar[str] = "lease"
    subscriber_id: str
    lease: float
    delivery_ids: list[int]


@dataclass(frozen=True, slots=True)
class AckRecord(Record):
    TAG: ClassVar[str] = "ack"
    delivery_ids: list[int]


@dataclass(frozen=True, slots=True)
class RequeueRecord(Record):
    """Leased episodes back in the ready queue (a lease ran out, or a subscriber handed them back)."""

    TAG: ClassVar[str] = "requeue"
    delivery_ids: list[int]
    redelivered: bool


# --- a snapshot: the live state, object by object, each as of its own log position ----------------


@dataclass(frozen=True, slots=True)
class SnapshotHeader(Record):
    """A snapshot's first record: the outbox's epoch and next delivery id, the finished-session memory and the
    finish answers, as of `position` (the start of the segment it was begun with). `byteorder`: the machine's, since
    session images hold native arrays."""

    TAG: ClassVar[str] = "snapshot"
    position: int
    byteorder: str
    epoch: str
    next_delivery_id: int
    finished_ids: list[str]
    finished_origins: list[str]
    # The finish answers kept for repeats (`episodes.answers`), oldest first: session id, request id, reply frame.
    answer_ids: list[str] = field(default_factory=list)
    answer_request_ids: list[int] = field(default_factory=list)
    answer_frames: list[bytes] = field(default_factory=list)
    weight_version: int = -1  # the policy version in force (`VersionRecord`)
    generation: list[Any] = field(default_factory=list)  # the pause in force, [epoch, paused, since] (`PauseRecord`)


@dataclass(frozen=True, slots=True)
class SessionImage(Record):
    """One live session as of log `position` (`durability.images`); `pending`: the encoded CloseRecord of the
    RequestFinish that is closing it, if one is."""

    TAG: ClassVar[str] = "session"
    position: int
    image: list[Any]
    pending: bytes | None
    blob_paths: list[Any] = field(default_factory=list)  # where `split_blobs` put its references (index paths)


@dataclass(frozen=True, slots=True)
class EpisodeImage(Record):
    """One unacknowledged episode as of log `position`: its holder (None: ready) and whether it was delivered."""

    TAG: ClassVar[str] = "episode_image"
    position: int
    delivery_id: int
    session_id: str
    client_id: str
    holder: str | None
    lease: float
    redelivered: bool
    episode: bytes


@dataclass(frozen=True, slots=True)
class SnapshotTrailer(Record):
    """A snapshot's last record: how many images it holds (a snapshot without it is incomplete)."""

    TAG: ClassVar[str] = "snapshot_end"
    sessions: int
    episodes: int


LogRecord = (
    OpenRecord | CloseRecord | FinishRecord | DropRecord | EpisodeRecord | LeaseRecord | AckRecord | RequeueRecord
    | VersionRecord | PauseRecord
)
SnapshotRecord = SnapshotHeader | SessionImage | EpisodeImage | SnapshotTrailer

_ENCODERS: dict[type, Callable[[Any], bytes]] = {}


def encode(record: Record) -> bytes:
    """A STATE record's payload."""
    encoder = _ENCODERS.get(type(record))
    if encoder is None:
        encoder = _ENCODERS[type(record)] = fast.build_encoder(type(record), WAL_FORMAT)
    return encoder(record)


_ERRORS = frames.ErrorTypes(RecordError, FormatMismatch)
# msgpack reads any buffer: the payloads are memoryviews into a segment read whole.
_decode_log = typing.cast(
    Callable[[bytes | memoryview], Any], frames.direction_decoder("log", LogRecord, WAL_FORMAT, _ERRORS)
)
_decode_snapshot = typing.cast(
    Callable[[bytes | memoryview], Any], frames.direction_decoder("snapshot", SnapshotRecord, WAL_FORMAT, _ERRORS)
)


def decode_log(payload: bytes | memoryview) -> LogRecord:
    """A log STATE record; RecordError if it is none."""
    record: LogRecord = _decode_log(payload)
    return record


def decode_snapshot(payload: bytes | memoryview) -> SnapshotRecord:
    """A snapshot record; RecordError if it is none."""
    record: SnapshotRecord = _decode_snapshot(payload)
    return record


# --- blobs: an image's large immutable buffers written beside its frame, not copied into it ------------

BLOB_EXT = 1  # the msgpack extension type of a blob reference: (offset, length) into the blobs
BLOB_MIN_BYTES = 4096
_BLOB_REF = struct.Struct("<QQ")
_META_LENGTH = struct.Struct("<I")


def split_blobs(
    value: list[Any], blobs: list[bytes | memoryview], paths: list[list[int]], at: list[int], path: list[int]
) -> list[Any]:
    """The list `value` (an image: nested lists, maps, scalars, buffers) with each buffer of at least BLOB_MIN_BYTES
    replaced by a reference into `blobs` (appended; `at[0]`: their total length so far), and each reference's index
    path (from the image's root) appended to `paths`, so that `join_blobs` goes straight to them.

    A blob must not change while a writer thread may still be writing it: `bytes` and read-only views (of a
    snapshot's mapping) go as they are, a `bytearray` (a log's raw tail) as a copy, which costs what packing it
    into the frame would and leaves a restart nothing to copy (it keeps the blob as a view). Lists are copied
    where they change, never changed: an image shares them with the live state.
    """
    out = value
    for i, v in enumerate(value):
        kind = type(v)
        if kind is list:
            inner = split_blobs(v, blobs, paths, at, [*path, i])
            if inner is v:
                continue
            ref: Any = inner
        elif (kind is bytes or kind is memoryview or kind is bytearray) and len(v) >= BLOB_MIN_BYTES:
            if kind is bytearray:  # a log's raw tail, which changes as commits come: its bytes as of now
                v = bytes(v)
            ref = ExtType(BLOB_EXT, _BLOB_REF.pack(at[0], len(v)))
            blobs.append(v)
            paths.append([*path, i])
            at[0] += len(v)
        else:
            continue
        if out is value:
            out = list(value)
        out[i] = ref
    return out


def join_blobs(image: list[Any], paths: list[Any], blobs: memoryview) -> list[Any]:
    """The image `split_blobs` took apart (freshly decoded: changed in place): each reference at `paths`
    replaced by a read-only view of its bytes in `blobs`.

    Views, not copies: `blobs` is a view of the snapshot file's mapping, so restoring a session copies
    none of its logs (the page cache holds them; a read decompresses or slices them from there).
    Whoever changes a buffer copies it first (`ItemLog.tail`)."""
    try:
        for path in paths:
            node = image
            for i in path[:-1]:
                node = node[i]
            ref = node[path[-1]]
            if type(ref) is not ExtType or ref.code != BLOB_EXT or len(ref.data) != _BLOB_REF.size:
                raise RecordError(f"no blob reference at {path} of an image")
            offset, length = _BLOB_REF.unpack(ref.data)
            if offset + length > len(blobs):
                raise RecordError("a blob reference past the end of its record")
            node[path[-1]] = blobs[offset : offset + length]
    except (IndexError, TypeError) as e:
        raise RecordError(f"a blob path that is not in its image: {e}") from e
    return image


def image_parts(record: SessionImage) -> list[bytes | memoryview]:
    """A STATE_WITH_BLOBS payload as parts: the frame's length and the frame, then the blobs (by reference)."""
    blobs: list[bytes | memoryview] = []
    paths: list[list[int]] = []
    image = split_blobs(record.image, blobs, paths, [0], [])
    frame = encode(SessionImage(record.position, image, record.pending, paths))
    return [_META_LENGTH.pack(len(frame)) + frame, *blobs]


def decode_image(payload: memoryview) -> SessionImage:
    """A STATE_WITH_BLOBS payload back to its SessionImage."""
    if len(payload) < _META_LENGTH.size:
        raise RecordError("an image record shorter than its length field")
    (n,) = _META_LENGTH.unpack_from(payload)
    frame, blobs = payload[_META_LENGTH.size : _META_LENGTH.size + n], payload[_META_LENGTH.size + n :]
    record = decode_snapshot(frame)
    if not isinstance(record, SessionImage):
        raise RecordError(f"a {type(record).__name__} where a session image with blobs belongs")
    return SessionImage(record.position, join_blobs(record.image, record.blob_paths, blobs), record.pending)


def encode_episode(episode: protocol.DeliveredEpisode) -> bytes:
    """An episode as the log keeps it: the frame of a reply carrying just it (the wire codec, rows and all)."""
    return protocol.encode(protocol.EpisodesDelivered(0, "", [episode], [], 0))


def decode_episode(data: bytes) -> protocol.DeliveredEpisode:
    reply = protocol.decode_broker_to_trainer(data)
    if not isinstance(reply, protocol.EpisodesDelivered) or len(reply.episodes) != 1:
        raise RecordError("an episode record holds no episode")
    return reply.episodes[0]
