"""The messages of the control socket: sessions, finishes and the episode stream, and the broker's replies.

Trainer -> broker: `OpenSession`, `FinishSession`, `DropSession`, `GetStats`, `FetchEpisodes` (and
`RequestFinish`, in `common`); broker -> trainer: `SessionOpened`, `SessionFinished`, `SessionDropped`,
`Stats`, `EpisodesDelivered` (and `FinishAccepted`, `Refused`), with the nested `TraceRow` and
`DeliveredEpisode`. `broker.protocol` re-exports them and holds their unions; import them from there.
The codecs read each class's fields, so the names used in annotations must be imported here at run
time. Imports only the stdlib, `broker.codec.wire` (the field markers) and `common`; no sockets.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any, ClassVar

from broker.codec.wire import IDS, LOGPROBS, MASK
from broker.messages.common import Message

# Field markers (`broker.codec.wire`): `field(metadata=IDS)` is a packed int32 field, `LOGPROBS` a
# float32 one, `MASK` a uint8 one.

# Trainer -> broker

# A session's `history_mode` and `linear_fallback` (see `OpenSession` and `worker.TurnOpened`).
HISTORY_MODES = ("tree", "linear")
LINEAR_FALLBACKS = ("fork", "rerender", "reject")


def check_history(history_mode: str, linear_fallback: str) -> str | None:
    """What is wrong with a session's history settings, or None."""
    if history_mode not in HISTORY_MODES:
        return f"history_mode must be one of {', '.join(HISTORY_MODES)}, got {history_mode!r}"
    if linear_fallback not in LINEAR_FALLBACKS:
        return f"linear_fallback must be one of {', '.join(LINEAR_FALLBACKS)}, got {linear_fallback!r}"
    return None


@dataclass(frozen=True, slots=True)
class OpenSession(Message):
    """Open a session; `session_id=None` lets the broker mint an unguessable key.

    `client_id` names the opening `TrainerClient` and `group` a batch of sessions: the two
    filters a subscriber may put on the episode stream (`FetchEpisodes`). `history_mode` ("tree" or
    "linear") and `linear_fallback` ("fork", "rerender" or "reject"): how its prompts are built (see
    `TurnOpened`); "" takes the broker's default.
    """

    TAG: ClassVar[str] = "open_session"
    session_id: str | None
    sampling_defaults: dict[str, Any]
    max_context_tokens: int | None
    max_turns: int | None
    metadata: dict[str, Any] = field(default_factory=dict)
    client_id: str = ""
    group: str | None = None
    history_mode: str = ""
    linear_fallback: str = ""


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
class SetEngines(Message):
    """Replace the engine replicas sessions are routed to (base URLs, http:// or https://; an empty list gives
    routing back to the workers' own --engine-url lists). Kept replicas keep their sessions; a removed one's
    sessions move at their next turn. Answered with `EnginesSet`."""

    TAG: ClassVar[str] = "set_engines"
    urls: list[str]


@dataclass(frozen=True, slots=True)
class SetWeightVersion(Message):
    """The policy version the engines serve from now on (an int >= 0): every turn opened after it records it,
    and its sampled tokens carry it in their rows (`TraceRow.weight_versions`). Answered with `WeightVersionSet`."""

    TAG: ClassVar[str] = "set_weight_version"
    version: int


# How a pause treats the generations in flight: finish them (wait), stop them and keep what they sampled
# (abort), or freeze them inside the engines (keep).
PAUSE_MODES = ("wait", "abort", "keep")


@dataclass(frozen=True, slots=True)
class PauseGeneration(Message):
    """Stop sending to the engines (around a weight update): every worker holds new turns before their engine
    call until `ResumeGeneration`, and treats the generations in flight as `mode` says (`PAUSE_MODES`). Answered
    with `GenerationPaused` once every live worker reports it applied the pause and has no engine call left, or
    when `timeout` (seconds) runs out, whichever comes first; the pause stays in force either way. A pause while
    paused changes nothing and waits the same way (`already` says so)."""

    TAG: ClassVar[str] = "pause_generation"
    mode: str
    timeout: float


@dataclass(frozen=True, slots=True)
class ResumeGeneration(Message):
    """End the pause: set `weight_version` first (>= 0; -1 keeps the one in force), then release every held turn.
    Answered with `GenerationResumed`; a resume while not paused only sets the version."""

    TAG: ClassVar[str] = "resume_generation"
    weight_version: int = -1


@dataclass(frozen=True, slots=True)
class GetGeneration(Message):
    """Ask whether generation is paused; answered with `GenerationState`."""

    TAG: ClassVar[str] = "get_generation"


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
    `response_length` entries of `token_ids` (the row's first prompt is stripped). So does
    `weight_versions`: each sampled token's policy version (`SetWeightVersion` in force when its turn
    opened), -1 for context tokens and for turns opened before any version was set.
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
    weight_versions: array = field(metadata=IDS, default_factory=lambda: array("i"))


@dataclass(frozen=True, slots=True)
class SessionOpened(Message):
    TAG: ClassVar[str] = "session_opened"
    session_id: str


@dataclass(frozen=True, slots=True)
class SessionFinished(Message):
    """The session's rows. `status`: complete, drain_timeout if in-flight turns were cut off, or worker_lost
    if the only turns missing were given up with dead workers."""

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
class EnginesSet(Message):
    """The replicas now routed to, as the broker keeps them (in order, duplicates and trailing slashes folded)."""

    TAG: ClassVar[str] = "engines_set"
    urls: list[str]


@dataclass(frozen=True, slots=True)
class WeightVersionSet(Message):
    """The version is in force (`previous`: the one before it, -1 if none was set)."""

    TAG: ClassVar[str] = "weight_version_set"
    version: int
    previous: int


@dataclass(frozen=True, slots=True)
class GenerationPaused(Message):
    """The answer to `PauseGeneration`. `idle`: every live worker applied the pause and has no engine call left
    (False: the timeout ran out first; the pause is in force). `already`: it was paused before this request.
    `seconds_to_idle`: from the pause to the answer. `workers`: the live workers counted; `engine_calls`: their
    engine calls still running; `turns_held`: turns waiting for the resume; `tokens_kept`: sampled tokens kept
    from aborted generations."""

    TAG: ClassVar[str] = "generation_paused"
    mode: str
    idle: bool
    already: bool
    seconds_to_idle: float
    workers: int
    engine_calls: int
    turns_held: int
    tokens_kept: int
    resumed: bool = False  # a resume ended the pause before the workers were idle


@dataclass(frozen=True, slots=True)
class GenerationResumed(Message):
    """The answer to `ResumeGeneration`: whether it was paused, for how long, and the version now in force."""

    TAG: ClassVar[str] = "generation_resumed"
    was_paused: bool
    paused_seconds: float
    weight_version: int


@dataclass(frozen=True, slots=True)
class GenerationState(Message):
    """The answer to `GetGeneration`. `mode`: the pause's ("" when generating); `since`: when it began (Unix
    time; 0.0 when generating)."""

    TAG: ClassVar[str] = "generation_state"
    mode: str
    since: float


@dataclass(frozen=True, slots=True)
class DeliveredEpisode:
    """One finished episode handed to a subscriber; `trainer_client.Episode` is its public face.

    `status`: complete, drain_timeout (in-flight turns were cut off), worker_lost (the only turns missing
    were given up with dead workers) or failed (rows could not be
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
