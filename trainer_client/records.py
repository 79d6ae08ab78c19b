"""`TraceRecord`: the training row a trainer consumes, free of torch and of any framework type.

Its shape follows the reference gateway's trace record: `token_ids` is the full row;
`loss_mask` and `logprobs` cover the response region only (the row's first prompt is
stripped), i.e. the last `response_length` ids. It is built from the wire message
`broker.protocol.TraceRow`; this module imports only the stdlib and that protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from broker import protocol


@dataclass(slots=True)
class TraceRecord:
    """One loss-masked training row of an episode; rows sharing `rollout_id` form one episode.

    `status` is "completed" or "truncated" (the row hit the session's context budget).
    `metadata` holds the builder's verdicts (`truncated`, `use_tool`, `ill_formed`) and the
    caller's metadata from `open_session` and `finish_session`.
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

    def __post_init__(self) -> None:
        if len(self.loss_mask) != len(self.logprobs):
            raise ValueError(f"TraceRecord: {len(self.loss_mask)} loss_mask entries but {len(self.logprobs)} logprobs")
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
        )
