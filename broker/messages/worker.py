"""The messages of the worker socket: a turn's open, commit, abort and lookup, and the broker's replies.

Worker -> broker: `OpenTurn`, `CommitTurn`, `AbortTurn`, `GetTurn`, `Heartbeat` (and `RequestFinish`, in `common`);
broker -> worker: `TurnOpened`, `TurnReplayed`, `TurnCommitted`, `TurnAborted`, `TurnFound`, `SessionsEnded` (and
`FinishAccepted`, `Refused`). `broker.protocol` re-exports them and holds their unions; import them from there. The
codecs read each class's fields, so the names used in annotations (`array`, `Any`) must be imported
here at run time. Imports only the stdlib, `broker.codec.wire` (the field markers) and `common`; no sockets.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any, ClassVar

from broker.codec.wire import IDS, LOGPROBS, PACKED_MAPS
from broker.messages.common import Message

# Field markers (`broker.codec.wire`): `field(metadata=IDS)` is a packed int32 field, `LOGPROBS` a
# float32 one; `PACKED_MAPS` a map (or list of maps) sent as msgpack bins.

# Worker -> broker

NOT_LINEAR = "not_linear"

# A worker's metrics snapshot (`Heartbeat.metrics`, `GetMetrics.metrics`) is a map:
#   "seq": a number that grows with every snapshot the process takes (an older one arriving late is ignored),
#   "pid": the worker's process id,
#   "counters": [[name, [label values...], value], ...]   cumulative since the worker started,
#   "histograms": [[name, [label values...], [count per bucket..., count above the last], sum], ...]  cumulative,
#   "gauges": [[name, [label values...], value], ...]     what the worker holds now.
# Label names and help text are the broker's (`broker.metrics.catalog`); every histogram's buckets are these
# upper bounds (seconds), so that the workers' counts add up.
SECONDS_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)


@dataclass(frozen=True, slots=True)
class OpenTurn(Message):
    """Ask to start a turn: the session must exist, be open and be under its turn cap.

    `worker_id` names the worker that will commit or abort it (its `Heartbeat`s carry the same id):
    when that worker falls silent the broker abandons the turn, so no finish waits for it.

    `request_digest` (a digest of the agent's HTTP request, when it carried a retry signal) is kept with
    the turn. With `retry` set, an earlier turn of the session with the same digest answers instead:
    committed, it is replayed (`TurnReplayed`, no new turn); in flight, the OPEN is refused with
    turn_pending (ask again: the retry waits for it); aborted, or none, this turn opens as usual.
    """

    TAG: ClassVar[str] = "open_turn"
    session_id: str
    turn_id: str
    worker_id: str = ""
    request_digest: str = ""
    retry: bool = False


@dataclass(frozen=True, slots=True)
class CommitTurn(Message):
    """A turn whose reply reached the agent; retried until `TurnCommitted`, de-duplicated by turn_id.

    Canonical messages: dicts with `role`, `content` (str), optional `reasoning` (str),
    optional `tool_calls` ([{"name": str, "arguments": object}], no wire ids) and, for
    tool results, optional `name`. `flags` holds parse verdicts (`ill_formed`, ...) and, in a linear
    session, `history` (how its prompt was built: linear, first, fork or rerender) and `echo`
    (`[message_count, fingerprint]`: the message count of its prompt messages + response, and the
    `broker.message_keys.EchoDigest` of its tools context + response, for the next request to be matched
    against; the broker lists it among the session's heads).
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
    """The reply never reached the agent: forget the turn, never train on it.

    `reason` is free text for the log, except `NOT_LINEAR`: a linear session's request that its `reject`
    fallback refused (the broker counts them)."""

    TAG: ClassVar[str] = "abort_turn"
    session_id: str
    turn_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class GetTurn(Message):
    """Ask for a committed turn's canonical messages (an API's `previous_response_id`).

    Only turns of `session_id` are found, so a response id never leaks across sessions.
    An empty `turn_id` only checks that the session is open (`Refused` unknown_turn if it is).
    A turn still in flight is refused with turn_pending (ask again).
    """

    TAG: ClassVar[str] = "get_turn"
    session_id: str
    turn_id: str
    with_ids: bool = False  # also its prompt and output ids (a linear session's held ids)


@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    """A worker is alive (sent every second or so); its turns outlive it by a bounded silence.

    `metrics` is the worker's snapshot of what it counted since it started (`WorkerSnapshot`): the broker
    sums the workers' snapshots into the gateway's metrics. Answered only when sessions ended since the
    worker's last beat (`SessionsEnded`)."""

    TAG: ClassVar[str] = "heartbeat"
    worker_id: str
    metrics: dict[str, Any] = field(default_factory=dict)
    # How the worker stands with the pause (`GenerationChanged`): [the generation epoch it was told, its engine
    # calls in flight, its turns held, the sampled tokens it keeps from aborted generations, the engine replicas
    # it was told to pause whose pause has not answered yet]; empty from a worker that does not report it.
    generation: list[int] = field(default_factory=list)


# Broker -> worker


@dataclass(frozen=True, slots=True)
class TurnOpened(Message):
    """The turn may proceed; `seq` orders it in the trajectory (never commit arrival).

    `history_mode` is the session's: "tree" (render the messages) or "linear" (extend a held turn's ids).
    A linear session also names its `linear_fallback` (fork, rerender or reject: what a request that extends
    none of its heads gets), its `heads`, `[turn_id, message_count, echo_digest]` of the committed turns a
    request may extend, newest first (see `CommitTurn` flags), and `pending`: its other turns in flight,
    one of which may be the turn whose reply this request echoes (re-send the OPEN, same turn id, to ask again).
    `weight_version`: the policy version in force (`SetWeightVersion`; -1: none set), which its commit
    records (`flags["weight_version"]`). `replica`: the engine replica the session is routed to
    (`broker.sessions.replicas`); "" leaves the choice to the worker. `generation_epoch` and `paused`: the
    pause in force, as `GenerationChanged` tells it (a worker that missed that message learns it here).
    """

    TAG: ClassVar[str] = "turn_opened"
    turn_id: str
    seq: int
    sampling_defaults: dict[str, Any]
    max_context_tokens: int | None
    history_mode: str = "tree"
    linear_fallback: str = ""
    heads: list[list[Any]] = field(default_factory=list)
    pending: int = 0
    weight_version: int = -1
    replica: str = ""
    generation_epoch: int = 0
    paused: str = ""


@dataclass(frozen=True, slots=True)
class TurnReplayed(Message):
    """A retried request's earlier turn, already committed: its reply is sent again; no turn opens.

    The turn as stored: its prompt and output ids, engine finish reason, canonical response message
    (see `CommitTurn`) and flags.
    """

    TAG: ClassVar[str] = "turn_replayed"
    turn_id: str
    prompt_ids: array = field(metadata=IDS)
    output_ids: array = field(metadata=IDS)
    finish_reason: str
    response_message: dict[str, Any]
    flags: dict[str, Any]


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
    """A committed turn's canonical prompt messages and response message (see `CommitTurn`), and its ids when
    `GetTurn.with_ids` asked for them (else empty)."""

    TAG: ClassVar[str] = "turn_found"
    turn_id: str
    prompt_messages: list[dict[str, Any]]
    response_message: dict[str, Any]
    prompt_ids: array = field(metadata=IDS, default_factory=lambda: array("i"))
    output_ids: array = field(metadata=IDS, default_factory=lambda: array("i"))


@dataclass(frozen=True, slots=True)
class SessionsEnded(Message):
    """The sessions that ended (finished or dropped) since the worker's last `Heartbeat`, oldest first, sent on
    that heartbeat's socket (request id 0): a worker drops what it keeps of them (commit bases, last renders),
    so its memory follows its live sessions. Best effort: a worker that misses one evicts by LRU."""

    TAG: ClassVar[str] = "sessions_ended"
    session_ids: list[str]


@dataclass(frozen=True, slots=True)
class GenerationChanged(Message):
    """A pause began or ended (`PauseGeneration`, `ResumeGeneration`), sent unasked on a worker's heartbeat
    socket (request id 0), and again in answer to any beat that reports an older `epoch`. `epoch` grows with
    every change; `paused` is the pause's mode, "" when generating. The worker applies it (holds new engine
    calls, treats those in flight as the mode says) and reports in its next beats (`Heartbeat.generation`).

    `engine_pausers`, when the engines' own pause is used (mode keep, and the resume that ends it), are the workers
    that call it, in order: the i-th pauses, and at the resume resumes, the engine replicas whose index in its
    --engine-url list is i modulo their number, so each replica is called once. Told again, same epoch, when that
    list changes during the pause (a worker lost: another takes its replicas)."""

    TAG: ClassVar[str] = "generation_changed"
    epoch: int
    paused: str
    weight_version: int = -1  # the policy version in force: what a turn held through the pause samples under
    engine_pausers: list[str] = field(default_factory=list)
