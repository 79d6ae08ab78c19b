"""TurnRecord: one committed turn, materialized at finish, as the trajectory builder reads it.

Made by `turn_store.TurnStore`, consumed by `broker.episodes.trajectory`; defined here so the sessions
package never imports the episodes package. Imports only the stdlib.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """One committed turn as the builder sees it (prompt already materialized).

    `logprobs[i]` is the sampled logprob of `output_ids[i]`. Messages are canonical
    (see `protocol.CommitTurn`).
    """

    turn_id: str
    seq: int
    prompt_ids: array
    output_ids: array
    logprobs: array
    finish_reason: str
    prompt_messages: list[dict[str, Any]]
    response_message: dict[str, Any]
    flags: dict[str, Any] = field(default_factory=dict)
