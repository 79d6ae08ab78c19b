"""`TraceRecord` and `Episode`: what a trainer consumes, free of torch and of any framework type.

`TraceRecord`'s shape follows the reference gateway's trace record: `token_ids` is the full
row; `loss_mask` and `logprobs` cover the response region only (the row's first prompt is
stripped), i.e. the last `response_length` ids. `Episode` is one finished session from the
episode stream: its rows plus how it finished. Both are built from wire messages
(`broker.protocol.TraceRow`, `DeliveredEpisode`); this module imports only the stdlib and that protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from broker import protocol


@dataclass(slots=True)
class TraceRecord:
    """One loss-masked training row of an episode; rows sharing `rollout_id` form one episode.

    `status` is "completed" or "truncated" (the row hit the session's context budget).
    `metadata` holds the builder's verdicts (`truncated`, `use_tool`, `ill_formed`), the policy versions
    of its turns (`weight_version_min`, `weight_version_max`, and `engine_weight_versions` when the engine
    reported its own) and the caller's metadata from `open_session` and `finish_session`.
    `weight_versions` is aligned with `loss_mask`: each sampled token's policy version (the one
    `TrainerClient.set_weight_version` had set when its turn opened), -1 for context tokens and for turns
    opened before any version was set (empty from a broker older than this field).
    """

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    response_length: int = 0
    response: str = ""
    rollout_id: str | None = None
    reward: float | None = None
    status: str = "completed"
    metadata: dict[str, Any] = field(default_factory=dict)
    weight_versions: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.loss_mask) != len(self.logprobs):
            raise ValueError(f"TraceRecord: {len(self.loss_mask)} loss_mask entries but {len(self.logprobs)} logprobs")
        if self.weight_versions and len(self.weight_versions) != len(self.loss_mask):
            raise ValueError(
                f"TraceRecord: {len(self.weight_versions)} weight_versions but {len(self.loss_mask)} loss_mask entries"
            )
        if self.response_length != len(self.loss_mask) or self.response_length > len(self.token_ids):
            raise ValueError(
                f"TraceRecord: response_length {self.response_length} does not fit "
                f"{len(self.loss_mask)} loss_mask entries and {len(self.token_ids)} token ids"
            )

    @property
    def prompt_ids(self) -> list[int]:
        """The row's first prompt: the ids before the response region."""
        return self.token_ids[: len(self.token_ids) - self.response_length]

    @property
    def response_ids(self) -> list[int]:
        """The response region: the last `response_length` ids (trained where `loss_mask` is 1)."""
        return self.token_ids[len(self.token_ids) - self.response_length :]

    @classmethod
    def from_wire(cls, row: protocol.TraceRow) -> TraceRecord:
        """Convert a decoded `protocol.TraceRow` (packed arrays) into plain Python lists."""
        return cls(
            token_ids=row.token_ids.tolist(),
            loss_mask=row.loss_mask.tolist(),
            logprobs=row.logprobs.tolist(),
            response_length=row.response_length,
            response=row.response,
            rollout_id=row.rollout_id,
            reward=row.reward,
            status=row.status,
            metadata=dict(row.metadata),
            weight_versions=row.weight_versions.tolist(),
        )


@dataclass(frozen=True, slots=True, eq=False)
class Episode:
    """One finished session from `TrainerClient.episodes()`: its rows, reward and how it finished.

    `status`: complete, drain_timeout (in-flight turns were cut off), worker_lost (the only turns missing
    were in flight on workers that died: their agents most likely never got those replies, so the
    episode is whole unless a worker died between sending a reply and committing it) or failed (the broker could
    not build rows; its log has the cause). `redelivered`: it was handed to a subscriber before
    that did not acknowledge it, so it may have been (partly) processed already. `finished_by`:
    trainer (`request_finish`) or agent (`POST /rollout/v1/sessions/finish`). `metadata` is the
    caller's (open_session's, then the finisher's); each row's metadata adds the builder's verdicts.
    """

    session_id: str
    rows: list[TraceRecord]
    reward: float | None
    metadata: dict[str, Any]
    status: str
    redelivered: bool = False
    rollout_id: str | None = None
    group: str | None = None
    finished_by: str = "trainer"
    turns_committed: int = 0
    turns_abandoned: int = 0
    delivery_id: int = 0
    _acker: Callable[[Episode], None] | None = field(default=None, repr=False)

    def ack(self) -> None:
        """Acknowledge it now: the broker forgets it and never hands it out again (a no-op if already done)."""
        if self._acker is not None:
            self._acker(self)

    @classmethod
    def from_wire(cls, episode: protocol.DeliveredEpisode, acker: Callable[[Episode], None] | None = None) -> Episode:
        """Convert a decoded `protocol.DeliveredEpisode`; `acker` is the stream that acknowledges it."""
        return cls(
            session_id=episode.session_id,
            rows=[TraceRecord.from_wire(row) for row in episode.rows],
            reward=episode.reward,
            metadata=dict(episode.metadata),
            status=episode.status,
            redelivered=episode.redelivered,
            rollout_id=episode.rollout_id,
            group=episode.group,
            finished_by=episode.finished_by,
            turns_committed=episode.turns_committed,
            turns_abandoned=episode.turns_abandoned,
            delivery_id=episode.delivery_id,
            _acker=acker,
        )


@dataclass(frozen=True, slots=True)
class PauseReport:
    """What `TrainerClient.pause_generation` found when the workers went idle.

    `mode`: the pause in force. `already`: generation was paused before this call (nothing changed).
    `seconds_to_idle`: from the pause to this report. `workers`: the live workers that applied it;
    `turns_held`: agent turns waiting for the resume; `tokens_kept`: tokens sampled before an `abort` that the
    resumed turns keep. `engine_calls` is 0 here (`PauseTimeout` carries a report where it is not).
    """

    mode: str
    already: bool
    seconds_to_idle: float
    workers: int
    turns_held: int
    tokens_kept: int
    engine_calls: int = 0

    @classmethod
    def from_wire(cls, reply: protocol.GenerationPaused) -> PauseReport:
        return cls(reply.mode, reply.already, reply.seconds_to_idle, reply.workers, reply.turns_held,
                   reply.tokens_kept, reply.engine_calls)  # fmt: skip
