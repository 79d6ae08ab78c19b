"""Finishing sessions: the three ways in, parked drains, and rows built once per session.

Owns what happens between "finish this session" and its rows: `finish_session` (the trainer
waits for a `SessionFinished`), `RequestFinish` from a trainer or an agent (answered at once;
the episode goes to `outbox.Outbox`), parking while in-flight turns drain (up to each finish's
`wait_timeout`), and building rows exactly once whichever way came first. A FinishSession repeated
with the same request id (a trainer resends it after its connection dropped) is the same finish:
it takes over the parked one, or gets the reply the first one got (`answers`); a repeated
RequestFinish is accepted again. A durable broker
logs closes by request and finishes (with their replies) through `journal`, and resumes the
requests a restart found draining (`resume`). No sockets: it returns the replies to send (all to
trainer peers) with their envelopes, and takes `now` from the caller. Imports the stdlib and
`broker.*` only.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from dataclasses import dataclass
from typing import Any

from broker import protocol
from broker.episodes.answers import FinishAnswers
from broker.episodes.journal import NO_JOURNAL, EpisodeJournal
from broker.episodes.outbox import Envelope, Outbox, Reply
from broker.episodes.rows import RowBuilder
from broker.protocol import session_tag
from broker.sessions.registry import SessionRegistry
from broker.sessions.session import FinishedSession, FinishOrigin, Refusal

logger = logging.getLogger(__name__)

AnyFinish = protocol.FinishSession | protocol.RequestFinish


@dataclass(slots=True)
class _Parked:
    envelope: Envelope | None  # None: a RequestFinish, already answered; its episode goes to the outbox
    msg: AnyFinish
    deadline: float
    token: int


class Finishes:
    """Finishes in progress, and the step that turns a finished session into rows.

    Args:
        registry: the session registry (closes and frees sessions).
        rows: builds a finished session's rows (the same for every way of finishing).
        outbox: where episodes finished by request go.
        max_wait_timeout: ceiling on any finish's drain wait, seconds.
    """

    def __init__(self, registry: SessionRegistry, rows: RowBuilder, outbox: Outbox, max_wait_timeout: float) -> None:
        self._registry = registry
        self._rows = rows
        self._outbox = outbox
        self._max_wait = max_wait_timeout
        self._parked: dict[str, _Parked] = {}
        self._deadlines: list[tuple[float, int, str]] = []
        self._tokens = itertools.count()
        self.counters: dict[str, int] = {"drain_timeouts": 0, "finish_failures": 0}
        self.journal: EpisodeJournal = NO_JOURNAL  # a durable broker's log (`broker.durability`)
        self.answers = FinishAnswers()

    # --- the ways in ---------------------------------------------------------------------

    def finish(self, envelope: Envelope, msg: protocol.FinishSession, now: float) -> protocol.Message | bytes | None:
        """The trainer's blocking finish: its rows now if nothing is in flight, else None (parked).

        A repeat of a finish (same session, same request id) is that finish: parked, it now answers
        `envelope` (the first one's connection is gone); done, its reply is sent again.
        """
        _check_wait(msg.wait_timeout)
        parked = self._parked.get(msg.session_id)
        if parked is not None and parked.envelope is not None and parked.msg.request_id == msg.request_id:
            parked.envelope = envelope
            return None
        if msg.session_id not in self._registry:
            answer = self.answers.replay(msg.session_id, msg.request_id, now)
            if answer is not None:
                return answer
        session = self._registry.close(msg.session_id, "trainer")
        if not session.in_flight or msg.wait_timeout == 0:
            return self._complete(msg, now)
        self._park(envelope, msg, now)
        return None

    def request_finish(
        self, msg: protocol.RequestFinish, origin: FinishOrigin, now: float
    ) -> tuple[bytes, list[Reply]]:
        """Close the session and accept at once; its episode reaches the outbox when its turns have landed.

        Room in the outbox is reserved before the session closes: a full outbox refuses (busy) and
        leaves the session open, so a refused finish loses nothing and can be retried. A repeat (same
        session, same request id: a resend through a lost connection) is accepted again and changes nothing.
        """
        _check_wait(msg.wait_timeout)
        answer = self.answers.replay(msg.session_id, msg.request_id, now)
        if answer is not None:
            return answer, []
        self._registry.closable(msg.session_id)  # "already finished" before "busy": the precise answer
        self._outbox.reserve()
        self._registry.close(msg.session_id, origin)
        self.journal.finish_requested(msg, origin)
        return self.answers.accept(msg, now), self._drain_or_park(msg, now)

    def resume(self, msg: protocol.RequestFinish, now: float) -> list[Reply]:
        """A RequestFinish accepted before a restart (its session restored closing): keep its promise.

        Its room in the outbox is taken whatever the outbox holds; in-flight turns get its whole
        `wait_timeout` again from now, since their workers retry their commits after the restart.
        """
        self._outbox.reserve(force=True)
        return self._drain_or_park(msg, now)

    def pending_request(self, sid: str) -> protocol.RequestFinish | None:
        """The RequestFinish whose session waits for its in-flight turns, if one does (for snapshots)."""
        parked = self._parked.get(sid)
        return parked.msg if parked is not None and parked.envelope is None else None  # type: ignore[return-value]

    def _drain_or_park(self, msg: protocol.RequestFinish, now: float) -> list[Reply]:
        session = self._registry.get(msg.session_id)
        if not session.in_flight or msg.wait_timeout == 0:
            return self._complete_into_outbox(msg, now)
        self._park(None, msg, now)
        return []

    def dropped(self, sid: str) -> list[Reply]:
        """The session was dropped: a parked finisher is told; a promised episode will not come."""
        parked = self._parked.pop(sid, None)
        if parked is None:
            return []
        if parked.envelope is None:
            self._outbox.unreserve()
            return []
        refused = protocol.Refused(parked.msg.request_id, "unknown_session", f"session {session_tag(sid)} was dropped")
        return [(parked.envelope, refused)]

    # --- drains --------------------------------------------------------------------------

    def turn_ended(self, sid: str, now: float) -> list[Reply]:
        """A commit or abort may have drained a closing session whose finish is parked."""
        parked = self._parked.get(sid)
        if parked is None or sid not in self._registry or self._registry.get(sid).in_flight:
            return []
        del self._parked[sid]
        return self._settle(parked, now)

    def expire(self, now: float) -> list[Reply]:
        """Finish the parked sessions whose drain deadline passed (their cut-off turns are abandoned)."""
        out: list[Reply] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, token, sid = heapq.heappop(self._deadlines)
            parked = self._parked.get(sid)
            if parked is not None and parked.token == token:
                del self._parked[sid]
                out += self._settle(parked, now)
        return out

    def next_deadline(self) -> float | None:
        return self._deadlines[0][0] if self._deadlines else None

    def shutdown(self, now: float) -> list[Reply]:
        """Finish everything parked with what was committed (drain_timeout), rather than leave finishers hanging."""
        out: list[Reply] = []
        for sid in list(self._parked):
            out += self._settle(self._parked.pop(sid), now)
        self._deadlines.clear()
        return out

    def stats(self) -> dict[str, Any]:
        return {"finishes_parked": len(self._parked), **self.counters, **self.answers.stats()}

    # --- internals -----------------------------------------------------------------------

    def _park(self, envelope: Envelope | None, msg: AnyFinish, now: float) -> None:
        token = next(self._tokens)
        deadline = now + min(msg.wait_timeout, self._max_wait)
        self._parked[msg.session_id] = _Parked(envelope, msg, deadline, token)
        heapq.heappush(self._deadlines, (deadline, token, msg.session_id))

    def _settle(self, parked: _Parked, now: float) -> list[Reply]:
        if isinstance(parked.msg, protocol.RequestFinish):
            return self._complete_into_outbox(parked.msg, now)
        assert parked.envelope is not None
        try:
            reply = self._complete(parked.msg, now)
        except Exception:  # _complete answers its own failures; this is a last guard
            logger.exception("finish of session %s failed", session_tag(parked.msg.session_id))
            reply = protocol.Refused(parked.msg.request_id, "internal", "finish failed; see the broker log")
        return [(parked.envelope, reply)]

    def _complete(self, msg: protocol.FinishSession, now: float) -> protocol.Message:
        """Free the session and build its rows: the reply (its frame kept for a repeat, and logged), or a Refused."""
        finished = self._registry.finish(msg.session_id)
        tag = session_tag(finished.sid)
        try:
            trace_rows, status = self._rows.build(finished, msg)
            reply = protocol.SessionFinished(
                msg.request_id, finished.sid, trace_rows, status, len(finished.turns), finished.turns_abandoned
            )
            frame = protocol.encode(reply)
        except Exception:
            self.counters["finish_failures"] += 1
            logger.exception("building rows of session %s failed (%d turns)", tag, len(finished.turns))
            self.journal.session_finished(finished.sid, finished.finished_by)
            return protocol.Refused(msg.request_id, "internal", f"building rows of session {tag} failed; see the log")
        if finished.status == "drain_timeout":
            self.counters["drain_timeouts"] += 1
        self.answers.remember(finished.sid, msg.request_id, frame, now)
        self.journal.session_finished(finished.sid, finished.finished_by, msg.request_id, frame)
        return reply

    def _complete_into_outbox(self, msg: protocol.RequestFinish, now: float) -> list[Reply]:
        """Build the rows of a session finished by request (once) and put the episode in the outbox."""
        finished = self._registry.finish(msg.session_id)
        return self._outbox.add(self._episode(finished, msg), finished.client_id, now)

    def _episode(self, finished: FinishedSession, msg: protocol.RequestFinish) -> protocol.DeliveredEpisode:
        # The same row builder and inputs as finish_session, so both paths give identical rows.
        as_finish = protocol.FinishSession(
            msg.request_id, msg.session_id, msg.reward, msg.rollout_id, msg.metadata, msg.wait_timeout
        )
        metadata = {**finished.metadata, **msg.metadata}
        try:
            trace_rows, status = self._rows.build(finished, as_finish)
        except Exception:
            # No caller is waiting to be told: the episode carries the failure, never silently lost.
            self.counters["finish_failures"] += 1
            tag = session_tag(finished.sid)
            logger.exception("building rows of session %s failed (%d turns)", tag, len(finished.turns))
            trace_rows, status = [], "failed"
            metadata["error"] = "building rows failed; see the broker log"
        if finished.status == "drain_timeout":
            self.counters["drain_timeouts"] += 1
        return protocol.DeliveredEpisode(
            0,
            finished.sid,
            trace_rows,
            msg.reward,
            msg.rollout_id,
            metadata,
            status,
            False,
            finished.group,
            finished.finished_by,
            len(finished.turns),
            finished.turns_abandoned,
        )


def _check_wait(wait: float) -> None:
    if not math.isfinite(wait) or wait < 0:
        raise Refusal("bad_request", f"wait_timeout must be a finite number >= 0, got {wait!r}")
