"""Trajectory builder: a finished session's committed turns -> loss-masked training rows.

Pure computation: no sockets, no clocks, no imports from the rest of `broker` except
`protocol` (for the packed-array helpers). `sessions.py` hands it the turns in OPEN
sequence order and `server.py` ships the rows as `protocol.TraceRow`s.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
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


@dataclass(slots=True)
class Row:
    """One training row; `loss_mask`/`logprobs` cover the last `response_length` ids."""

    token_ids: array
    loss_mask: array  # typecode "B"
    logprobs: array  # typecode "f"
    response_length: int
    metadata: dict[str, Any]


def build_rows(
    turns: Sequence[TurnRecord],
    *,
    max_context_tokens: int | None = None,
) -> list[Row]:
    """Build the session's rows from its committed turns, given in OPEN sequence order."""
    raise NotImplementedError
