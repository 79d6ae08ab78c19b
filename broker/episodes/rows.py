"""Finished session -> wire rows: run the trajectory builder, then add what the trainer sees.

`RowBuilder` turns a `sessions.FinishedSession` into `protocol.TraceRow`s: rows from
`trajectory.build_rows` (turns already in OPEN order), the decoded `response` text (with
the configured `tokenizers` tokenizer, loaded at first use; empty without one), reward,
rollout id, status and merged metadata. No sockets; imports the stdlib, `broker.*` and,
lazily, `tokenizers` (the Rust library: never transformers) and `numpy`.

Decoding a row is most of a finish (docs/performance.md): a byte-level
BPE's text is the UTF-8 decode of its tokens' bytes, so such tokenizers decode by gathering their
tokens' bytes from one table (`_ByteTable`, far fewer instructions than `tokenizers`), and fall
back to the tokenizer for anything that is not valid UTF-8. The table comes from `broker.token_ids`
(the one the workers decode replies with), validated against the tokenizer when it is loaded.
"""

from __future__ import annotations

import codecs
import logging
import os
from array import array
from collections.abc import Sequence
from typing import Any

from broker import protocol, token_ids
from broker.episodes.trajectory import DECISIONS, Row, build_rows
from broker.metrics.catalog import ROWS_BUCKETS
from broker.metrics.gateway import Histogram
from broker.sessions.session import FinishedSession

logger = logging.getLogger(__name__)


class RowBuilder:
    """Builds a finished session's `TraceRow`s; holds the (lazily loaded) response tokenizer, and counts the
    rows per episode and each turn's place in them (`stats`)."""

    def __init__(self, tokenizer_path: str | None) -> None:
        self._path = tokenizer_path
        self._tokenizer: Any = None
        self._token_bytes: _ByteTable | None = None  # id -> bytes, for byte-level BPE tokenizers
        self.rows_per_episode = Histogram(ROWS_BUCKETS)
        self.decisions = dict.fromkeys(DECISIONS, 0)

    def build(self, finished: FinishedSession, msg: protocol.FinishSession) -> tuple[list[protocol.TraceRow], str]:
        """The session's rows and its finish status (`FinishedSession.status`)."""
        rows = build_rows(finished.turns, max_context_tokens=finished.max_context_tokens)
        self.rows_per_episode.observe(len(rows))
        if rows:  # every row carries the session-wide decisions
            for decision, n in rows[0].metadata["decisions"].items():
                self.decisions[decision] = self.decisions.get(decision, 0) + n
        status = finished.status
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
            if finished.turns_worker_lost:
                metadata["turns_worker_lost"] = finished.turns_worker_lost
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
            weight_versions=row.weight_versions,
        )

    def stats(self) -> dict[str, Any]:
        return {"rows_per_episode": self.rows_per_episode.wire(), "row_decisions": dict(self.decisions)}

    def decode(self, ids: array) -> str:
        """Response text, special tokens kept; "" without a configured tokenizer."""
        if self._path is None or not len(ids):
            return ""
        if self._tokenizer is None:
            self._load()
        table = self._token_bytes
        if table is not None:
            try:
                # Valid UTF-8 as a whole: every run between added tokens is too (their text is not a
                # continuation byte), so this is exactly the tokenizer's run-by-run decode.
                return table.decode(ids)
            except (UnicodeDecodeError, IndexError):
                pass  # broken UTF-8 or an id outside the vocabulary: the tokenizer decides
        return str(self._tokenizer.decode(ids.tolist(), skip_special_tokens=False))

    def _load(self) -> None:
        from tokenizers import Tokenizer  # lazy: a Rust extension, only when configured

        assert self._path is not None
        path = os.path.join(self._path, "tokenizer.json") if os.path.isdir(self._path) else self._path
        tokenizer = self._tokenizer = Tokenizer.from_file(path)

        def exact(ids: Sequence[int]) -> str:
            return str(tokenizer.decode(list(ids), skip_special_tokens=False))

        table, why = token_ids.byte_table(tokenizer, exact)
        self._token_bytes = None if table is None else _ByteTable(table)
        logger.info("loaded tokenizer %s for response text (byte table: %s)", path, why or "yes")


class _ByteTable:
    """Every id's bytes back to back, and each one's offset and length: a row's bytes are one gather.

    Joining per-id `bytes` objects costs an int object, a call and a list slot per id; numpy gathers the
    bytes of all ids at once, about half the instructions (docs/performance.md). Ids index
    the way a list does: negative ones from the end, anything else out of range raises IndexError.
    """

    __slots__ = ("_np", "_bytes", "_starts", "_lens", "_positions")

    def __init__(self, token_bytes: list[bytes]) -> None:
        import numpy as np  # lazy: only a broker with a byte-level tokenizer needs it

        self._np = np
        self._lens = np.fromiter(map(len, token_bytes), dtype=np.intp, count=len(token_bytes))
        self._starts = np.cumsum(self._lens) - self._lens
        self._bytes = np.frombuffer(b"".join(token_bytes), dtype=np.uint8)
        self._positions = np.arange(0)  # 0, 1, 2, ...: grown to the longest row's byte count, then reused

    def __len__(self) -> int:
        return len(self._lens)

    def raw(self, ids: array) -> bytes:
        """The ids' bytes joined (what `b"".join(table[i] for i in ids)` gives)."""
        return bytes(self._gather(ids))

    def decode(self, ids: array) -> str:
        """The ids' bytes joined and decoded as UTF-8 (strict: UnicodeDecodeError when they are not)."""
        return codecs.utf_8_decode(self._gather(ids), "strict", True)[0]

    def _gather(self, ids: array) -> Any:
        np = self._np
        which = np.frombuffer(ids, dtype=np.intc) if ids.typecode == "i" else np.asarray(ids)  # "i": a C int
        lens = self._lens.take(which)
        ends = np.cumsum(lens)
        # Output byte k of id j comes from table byte starts[j] + (k - its first output byte): one
        # offset repeated over each id's bytes, plus the output position.
        index = np.repeat(self._starts.take(which) - (ends - lens), lens)
        n = len(index)
        if n > len(self._positions):
            self._positions = np.arange(max(n, 2 * len(self._positions)))
        index += self._positions[:n]
        return self._bytes.take(index)
