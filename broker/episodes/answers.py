"""Finish answers: the replies of recent FinishSessions, kept so that a repeat of one gets the same rows.

A trainer whose connection to the broker ends while it waits in `finish_session` resends the same
request, with the same request id, once it is connected again (`trainer_client`). By then the first
attempt may have finished the session: its rows were built once and sent to a connection that is gone.
`Finishes` keeps each trainer finish's encoded reply here, by session id, and answers a repeat (same
session, same request id) with it, so the rows reach the trainer once: neither lost nor built twice. A
different request id is another finish, refused as already finished. A RequestFinish's acceptance is
kept the same way (`accept`), so its resend is accepted again rather than refused. A durable broker logs
the reply with its finish (`FinishRecord.answer`; a RequestFinish's request id with its close) and
carries this memory in its snapshots, so a repeat that arrives after a restart is answered too. Bounded
by age and bytes. No sockets and no clock of its own (callers pass `now`); imports the stdlib and
`broker.protocol` only.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from broker import protocol

# A repeat comes once the trainer's connection is back: after a broker restart (recovery, the supervisor's
# backoff) and within the trainer's own call timeout. Kept well past both.
ANSWER_KEEP_S = 300.0
# Rows of recent finishes held at most (oldest dropped first): a repeat is for one of the last few finishes.
ANSWER_MAX_BYTES = 32 * 1024 * 1024

# (session id, request id, reply frame): what a snapshot or a recovery carries.
AnswerItem = tuple[str, int, bytes]


@dataclass(slots=True, eq=False)
class _Answer:
    request_id: int
    frame: bytes
    at: float


class FinishAnswers:
    """The encoded replies of recent trainer finishes, by session id, oldest first.

    Args:
        keep_s: how long an answer is kept after its finish.
        max_bytes: reply bytes kept at most.
    """

    def __init__(self, *, keep_s: float = ANSWER_KEEP_S, max_bytes: int = ANSWER_MAX_BYTES) -> None:
        self._keep_s = keep_s
        self._max_bytes = max_bytes
        self._answers: OrderedDict[str, _Answer] = OrderedDict()
        self._bytes = 0
        self.counters: dict[str, int] = {"finish_repeats_answered": 0}

    def remember(self, sid: str, request_id: int, frame: bytes, now: float) -> None:
        """Keep the reply `frame` that answered request `request_id`, which finished session `sid`."""
        old = self._answers.pop(sid, None)  # a reused session id: only its latest finish can be repeated
        if old is not None:
            self._bytes -= len(old.frame)
        self._answers[sid] = _Answer(request_id, frame, now)
        self._bytes += len(frame)
        self._trim(now)

    def accept(self, msg: protocol.RequestFinish, now: float) -> bytes:
        """The reply that accepts `msg`, kept for its repeat."""
        frame = protocol.encode(protocol.FinishAccepted(msg.request_id, msg.session_id))
        self.remember(msg.session_id, msg.request_id, frame, now)
        return frame

    def replay(self, sid: str, request_id: int, now: float) -> bytes | None:
        """The reply to repeat for request `request_id` on the finished session `sid`; None if it is no repeat."""
        self._trim(now)
        answer = self._answers.get(sid)
        if answer is None or answer.request_id != request_id:
            return None
        self.counters["finish_repeats_answered"] += 1
        return answer.frame

    def items(self) -> list[AnswerItem]:
        """Every answer kept, oldest first (for a snapshot)."""
        return [(sid, a.request_id, a.frame) for sid, a in self._answers.items()]

    def restore(self, items: list[AnswerItem], now: float) -> None:
        """Keep the answers a recovery found (oldest first), as if given now: their repeats are still to come."""
        for sid, request_id, frame in items:
            self.remember(sid, request_id, frame, now)

    def stats(self) -> dict[str, int]:
        return {"finish_answers_kept": len(self._answers), "finish_answer_bytes": self._bytes, **self.counters}

    def _trim(self, now: float) -> None:
        answers = self._answers
        while answers:
            oldest = next(iter(answers.values()))
            # The newest answer stays however large it is: its repeat is the likeliest to come.
            over = self._bytes > self._max_bytes and len(answers) > 1
            if not over and now - oldest.at < self._keep_s:
                return
            answers.popitem(last=False)
            self._bytes -= len(oldest.frame)
