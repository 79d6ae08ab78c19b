"""A worker's COMMITs and ABORTs to the broker, each sent by a task of its own until acknowledged.

A COMMIT goes after the reply was sent: as a delta against the session's last acknowledged turn when
`commit_bases` has one, in full if the broker no longer holds that base; an ABORT when a turn ends without a
reply. An attempt unanswered in ATTEMPT_TIMEOUT_S is resent as a copy with a fresh request id (the broker
de-duplicates by turn id) until COMMIT_DEADLINE_S, then given up loudly. The backplane (`capture.backplane`)
owns the socket; this sends through its request functions. Nothing here blocks the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from broker import protocol
from broker.protocol import session_tag
from gateway_workers.capture.commit_bases import CommitBases
from gateway_workers.metrics import WorkerMetrics

logger = logging.getLogger(__name__)

ATTEMPT_TIMEOUT_S = 2.0  # one COMMIT/ABORT attempt; then resend (the broker de-duplicates)
COMMIT_DEADLINE_S = 300.0  # give up (and log loudly) after retrying this long

Send = Callable[..., "asyncio.Future[Any]"]


class CommitSender:
    """Sends COMMITs and ABORTs through a backplane's `send` (build a message with a fresh id) and `send_message`
    (a message with its id), request ids from `ids`; `tasks` are those still unacknowledged."""

    def __init__(
        self, send: Send, send_message: Send, ids: Iterator[int], bases: CommitBases, counters: dict[str, int],
        metrics: WorkerMetrics,
    ) -> None:  # fmt: skip
        self._send, self._send_message, self._ids = send, send_message, ids
        self.bases, self.counters, self.metrics = bases, counters, metrics
        self.tasks: set[asyncio.Task[Any]] = set()

    def commit_in_background(self, commit: protocol.CommitTurn) -> None:
        """Hand a (full) COMMIT to a task that sends it, as a delta where it can, until ACKed.

        The HTTP handler does not wait. A commit built with `request_id()` is sent as it is the
        first time; one with request id 0 is copied with a fresh id.
        """
        task = asyncio.get_running_loop().create_task(self._commit(commit))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def abort_in_background(self, session_id: str, turn_id: str, reason: str) -> None:
        abort = protocol.AbortTurn(request_id=next(self._ids), session_id=session_id, turn_id=turn_id, reason=reason)
        task = asyncio.get_running_loop().create_task(self._retry(abort))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _commit(self, full: protocol.CommitTurn) -> None:
        """Send the delta (if any), fall back to the full turn if it is refused, and remember ACKed turns as bases."""
        t_sent = time.perf_counter()
        prompt_crc32: int | None = None
        try:
            delta, prompt_crc32 = self.bases.delta_and_crc(full, next(self._ids))
        except Exception:  # a bug of ours must not cost the turn: send it in full
            logger.exception("cannot build a delta commit of turn %s (session %s)", full.turn_id,
                             session_tag(full.session_id))
            delta = None
        reply: protocol.BrokerToWorker | None = None
        if delta is not None:
            self.counters["commits_delta"] += 1
            reply = await self._retry(delta, log_refusal=False)
            if reply is None:  # gave up (logged): the full turn would meet the same broker
                return
            if isinstance(reply, protocol.Refused):
                # unknown_base: the base is gone (e.g. its turn was never stored); anything else
                # would be our own delta bug. Either way the full turn must still land.
                self.counters["delta_refused"] += 1
                self.bases.forget(full.session_id, delta.base_turn_id)
                prompt_crc32 = None
                log = logger.debug if reply.code == "unknown_base" else logger.warning
                log("delta commit of turn %s (session %s) refused (%s: %s); resending in full",
                    full.turn_id, session_tag(full.session_id), reply.code, reply.message)
                reply = None
        if reply is None:
            self.counters["commits_full"] += 1
            reply = await self._retry(full)
        if isinstance(reply, protocol.TurnCommitted):
            self.metrics.observe("turn_duration_seconds", ("commit",), time.perf_counter() - t_sent)
            if reply.outcome in ("stored", "duplicate"):
                self.bases.remember(full, prompt_crc32)
            else:  # discarded: the session is gone
                self.bases.forget(full.session_id)

    async def _retry(
        self, message: protocol.CommitTurn | protocol.AbortTurn, log_refusal: bool = True
    ) -> protocol.BrokerToWorker | None:
        """Send until answered (or the deadline); returns the reply, None when given up or failed.

        The first attempt sends `message` itself when its request id is set (fresh from `request_id()`);
        a resend is a copy with a new id, so a late reply to an earlier attempt cannot answer it.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + COMMIT_DEADLINE_S
        attempt = 0
        while True:
            attempt += 1
            try:
                if attempt == 1 and message.request_id:
                    sent = self._send_message(message, ATTEMPT_TIMEOUT_S)
                else:
                    sent = self._send(lambda rid: dataclasses.replace(message, request_id=rid), ATTEMPT_TIMEOUT_S)
                reply = await sent
            except asyncio.CancelledError:
                raise
            except asyncio.TimeoutError:
                if loop.time() > deadline:
                    logger.error(
                        "gave up on %s of turn %s (session %s) after %d attempts: broker unreachable",
                        message.TAG, message.turn_id, session_tag(message.session_id), attempt,
                    )
                    return None
                logger.warning("%s of turn %s not acknowledged yet (attempt %d); resending",
                               message.TAG, message.turn_id, attempt)
                continue
            except Exception:
                logger.exception("%s of turn %s (session %s) failed", message.TAG, message.turn_id,
                                 session_tag(message.session_id))
                return None
            if isinstance(reply, protocol.Refused) and log_refusal:
                logger.error("broker refused %s of turn %s (session %s): %s %s",
                             message.TAG, message.turn_id, session_tag(message.session_id), reply.code, reply.message)
            return reply

    async def drain(self, timeout: float) -> None:
        """Wait (bounded) for outstanding COMMITs/ABORTs before the worker exits."""
        if self.tasks:
            done, pending = await asyncio.wait(set(self.tasks), timeout=timeout)
            if pending:
                logger.error("%d commits/aborts still unacknowledged at shutdown", len(pending))
