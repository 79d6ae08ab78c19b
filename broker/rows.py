"""Finished session -> wire rows: run the trajectory builder, then add what the trainer sees.

`RowBuilder` turns a `sessions.FinishedSession` into `protocol.TraceRow`s: rows from
`trajectory.build_rows` (turns already in OPEN order), the decoded `response` text (with
the configured `tokenizers` tokenizer, loaded at first use; empty without one), reward,
rollout id, status and merged metadata. No sockets; imports the stdlib, `broker.*` and,
lazily, `tokenizers` (the Rust library: never transformers).
"""

from __future__ import annotations

import logging
import os
from array import array
from typing import Any

from broker import protocol
from broker.sessions import FinishedSession
from broker.trajectory import Row, build_rows

logger = logging.getLogger(__name__)


class RowBuilder:
    """Builds a finished session's `TraceRow`s; holds the (lazily loaded) response tokenizer."""

    def __init__(self, tokenizer_path: str | None) -> None:
        self._path = tokenizer_path
        self._tokenizer: Any = None

    def build(self, finished: FinishedSession, msg: protocol.FinishSession) -> tuple[list[protocol.TraceRow], str]:
        """The session's rows and its finish status: complete, or drain_timeout if turns were cut off."""
        rows = build_rows(finished.turns, max_context_tokens=finished.max_context_tokens)
        status = "drain_timeout" if finished.turns_abandoned else "complete"
        return [self._trace_row(row, msg, finished, status) for row in rows], status

    def _trace_row(
        self, row: Row, msg: protocol.FinishSession, finished: FinishedSession, status: str
    ) -> protocol.TraceRow:
        n = row.response_length
        # the builder's verdicts (truncated, use_tool, ill_formed) win over same-named caller keys
        metadata = {**finished.metadata, **msg.metadata, **row.metadata}
        if status != "complete":
            metadata["drain_status"] = status
            metadata["turns_abandoned"] = finished.turns_abandoned
        return protocol.TraceRow(
            token_ids=row.token_ids,
            loss_mask=row.loss_mask,
            logprobs=row.logprobs,
            response_length=n,
            response=self.decode(row.token_ids[len(row.token_ids) - n :] if n else row.token_ids[:0]),
            rollout_id=msg.rollout_id,
            reward=msg.reward,
            status="truncated" if row.metadata.get("truncated") else "completed",
            metadata=metadata,
        )

    def decode(self, ids: array) -> str:
        """Response text, special tokens kept; "" without a configured tokenizer."""
        if self._path is None or not len(ids):
            return ""
        if self._tokenizer is None:
            from tokenizers import Tokenizer  # lazy: a Rust extension, only when configured

            path = os.path.join(self._path, "tokenizer.json") if os.path.isdir(self._path) else self._path
            self._tokenizer = Tokenizer.from_file(path)
            logger.info("loaded tokenizer %s for response text", path)
        return str(self._tokenizer.decode(ids.tolist(), skip_special_tokens=False))
