"""Retry-safe turns: a retried agent request gets the reply its earlier attempt already recorded.

The official SDKs resend a request that failed or timed out with `x-stainless-retry-count: N` (N >= 1);
any client may send an `Idempotency-Key`. A request with either header is named by a digest of its
route, key and body (`retry_key`), which its OPEN carries to the broker; the broker keeps each
session's recent digests, so a retry finds its earlier turn whichever worker took either attempt. A
committed earlier turn comes back as `TurnReplayed` (what `TurnPipeline.prepare` returns then) and is
answered again as it was (`replayed_turn`: same turn id, so the same reply and tool-call ids, same
content; streamed if this attempt asks for a stream, `ReplayedLive`), and nothing new is recorded. An
earlier turn still in flight is waited for (`Backplane.open_turn`); an aborted one is sampled afresh.
Retry count 0 (a first attempt) and no header at all are always new samples: an agent may resample
on purpose. Must not import the app or the adapters.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from broker import protocol
from gateway_workers.engines.base import EngineResult, FinishReason
from gateway_workers.formats import ParsedResponse
from gateway_workers.formats.parsed import LiveDelta, reply_deltas
from gateway_workers.turns.captured import CapturedTurn, TurnRequest

RETRY_COUNT_HEADER = "x-stainless-retry-count"
IDEMPOTENCY_HEADER = "idempotency-key"


@dataclass(frozen=True, slots=True)
class RetryKey:
    """A request's name for its retries (`digest`), and whether this attempt is one (`retry`)."""

    digest: str
    retry: bool


def retry_key(path: str, idempotency_key: str | None, retry_count: str | None, body_bytes: int,
              body_crc32: int) -> RetryKey | None:
    """The key of a request that carries a retry signal; None for one that carries neither header.

    `body_crc32`: zlib.crc32 of the body's `body_bytes` bytes, seeded with nothing, so that a session's next
    body can continue it from the part it shares with this one (`http.bodies`); the route and key follow it.
    """
    if idempotency_key is None and retry_count is None:
        return None
    # CRC-32 and the lengths, not a cryptographic hash: every SDK request pays this over its whole body, and
    # CRC-32 costs a third of SHA-1's instructions (docs/performance.md). Two requests are confused only if
    # both are among the recent requests the broker keeps for one session, their parts have exactly the
    # same lengths and they share the CRC; then one is replayed to the very agent that sent both.
    key = (idempotency_key or "").encode("utf-8", "surrogateescape")
    crc = zlib.crc32(key, zlib.crc32(path.encode(), body_crc32))
    digest = f"{len(path)}.{len(key)}.{body_bytes}.{crc:08x}"
    again = idempotency_key is not None or (retry_count or "0").strip() not in ("", "0")
    return RetryKey(digest, again)


def replayed_turn(session_id: str, request: TurnRequest, recorded: protocol.TurnReplayed) -> CapturedTurn:
    """A recorded turn as a reply to send again; it commits nothing: it is recorded already."""
    message, flags = recorded.response_message, recorded.flags
    parsed = ParsedResponse(
        content=message.get("content") or "",
        reasoning=message.get("reasoning"),
        tool_calls=[dict(call) for call in message.get("tool_calls") or ()],
        ill_formed=bool(flags.get("ill_formed", False)),
        error=flags.get("parse_error"),
    )
    finish: FinishReason = "length" if recorded.finish_reason == "length" else "stop"
    result = EngineResult(output_ids=recorded.output_ids.tolist(), logprobs=[], finish_reason=finish)
    return CapturedTurn(session_id, recorded.turn_id, request, recorded.prompt_ids, result, parsed, int(time.time()),
                        replayed=True)


class ReplayedLive:
    """A replayed turn streamed: its whole reply as the deltas a live turn would have yielded."""

    replayed = True

    def __init__(self, turn: CapturedTurn) -> None:
        self.turn: CapturedTurn | None = turn
        self.session_id, self.turn_id = turn.session_id, turn.turn_id
        self.prompt_ids, self.created = turn.prompt_ids, turn.created

    async def deltas(self) -> AsyncIterator[LiveDelta]:
        assert self.turn is not None
        for delta in reply_deltas(self.turn.parsed):
            yield delta

    def commit(self) -> None:
        """Already recorded."""

    def abort(self, reason: str) -> None:
        """Nothing to forget: the earlier attempt's turn stays recorded (its reply reached this agent before)."""

    async def close(self) -> None:
        """Nothing runs."""
