"""Generation pause and resume: the pause in force, what each worker reports of it, and the trainers' pause
requests waiting for the workers to go idle.

A pause is one number and one mode: `epoch` grows with every pause and resume, and `mode` is the pause's
("" when generating). The broker tells every worker at once (`GenerationChanged` on its heartbeat socket), tells
again any worker whose beat reports an older epoch (a worker that started, or reconnected, during the pause),
and every OPEN's answer carries both. Each worker reports in its beats the epoch it was told and its engine calls
still running; a pause request is answered once every live worker applied this epoch with none left, or at its
deadline. In mode keep the engines' own pause holds the calls in flight where they are: the workers call it, each
on its share of the replicas (`GenerationChanged.engine_pausers`), and a pause is idle once every live worker was
told it and every replica's pause answered. With a state directory the pause is logged, so a restarted broker is
still paused.

Pure bookkeeping on the server's clock: no sockets; imports the stdlib and `broker.protocol` only.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass

from broker import protocol

Envelope = list[bytes]


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """One worker's `Heartbeat.generation`."""

    epoch: int
    engine_calls: int
    turns_held: int
    tokens_kept: int
    engines_pausing: int


def read_report(values: list[int]) -> WorkerReport | None:
    """A beat's report, or None when it has none (or not the five ints it should)."""
    if len(values) != 5 or not all(type(v) is int for v in values):
        return None
    return WorkerReport(*values)


@dataclass(slots=True)
class ParkedPause:
    """A trainer's PauseGeneration waiting for the workers to go idle."""

    envelope: Envelope
    request_id: int
    deadline: float
    already: bool


class Generation:
    """The pause in force, the workers' reports, and the pause requests that wait."""

    def __init__(self) -> None:
        self.epoch = 0
        self.mode = ""  # the pause's mode; "" when generating
        self.since = 0.0  # when the pause began (Unix time)
        self.paused_at = 0.0  # the same, on the server's clock
        self.reports: dict[str, WorkerReport] = {}
        self.envelopes: dict[str, Envelope] = {}  # each worker's heartbeat socket: where a change is told
        self.parked: list[ParkedPause] = []
        self.pauses = self.resumes = 0
        # The engines' own pause is in use: from a pause in mode keep until the next pause (its resume, and any
        # worker told it late, must resume the engines).
        self.engines_held = False

    @property
    def paused(self) -> bool:
        return bool(self.mode)

    def restore(self, epoch: int, mode: str, since: float) -> None:
        """The pause a log or snapshot recorded (its time paused counts from now on the server's clock)."""
        self.epoch, self.mode, self.since = epoch, mode, since
        self.paused_at = time.monotonic()
        self.engines_held = mode == "keep"

    def pause(self, mode: str, now: float) -> bool:
        """Pause in `mode`; False (nothing changes) when already paused."""
        if self.paused:
            return False
        self.epoch += 1
        self.mode, self.since, self.paused_at = mode, time.time(), now
        self.engines_held = mode == "keep"
        self.pauses += 1
        return True

    def resume(self, now: float) -> float | None:
        """End the pause; the seconds it lasted, or None when not paused."""
        if not self.paused:
            return None
        self.epoch += 1
        self.mode, self.since = "", 0.0
        self.resumes += 1
        return now - self.paused_at

    def changed(self, weight_version: int) -> protocol.GenerationChanged:
        pausers = sorted(self.envelopes) if self.engines_held else []
        return protocol.GenerationChanged(0, self.epoch, self.mode, weight_version, pausers)

    def heard(self, worker_id: str, values: list[int], envelope: Envelope) -> bool:
        """Take a beat's report; whether the worker must be told the pause again (it reports another epoch)."""
        report = read_report(values)
        if report is None:  # a beat without one (the first, sent on the worker's request socket)
            return False
        self.envelopes[worker_id] = envelope
        self.reports[worker_id] = report
        return report.epoch != self.epoch

    def forget(self, worker_ids: Collection[str]) -> bool:
        """Workers given up for silent: they no longer count for idle. Whether the others must be told again (the
        engines' pause is in use, and the lost workers' replicas go to those left)."""
        lost = False
        for worker_id in worker_ids:
            self.reports.pop(worker_id, None)
            lost |= self.envelopes.pop(worker_id, None) is not None
        return lost and self.engines_held

    def idle(self, live: Collection[str]) -> bool:
        """Whether every live worker applied this epoch and has no engine call left (in mode keep: the engines
        hold those, and every replica's pause answered)."""
        reports, keep = self.reports, self.mode == "keep"
        for worker_id in live:
            report = reports.get(worker_id)
            if report is None or report.epoch != self.epoch:
                return False
            if report.engines_pausing if keep else report.engine_calls:
                return False
        return True

    def park(self, envelope: Envelope, request_id: int, timeout: float, already: bool, now: float) -> None:
        self.parked.append(ParkedPause(envelope, request_id, now + timeout, already))

    def next_deadline(self) -> float | None:
        if not self.parked:
            return None
        return min(p.deadline for p in self.parked)

    def answers(
        self, live: Collection[str], now: float, flush: bool = False
    ) -> list[tuple[Envelope, protocol.Message]]:
        """The parked pause requests that are answered now: all of them once idle (or resumed, or `flush`: the
        broker stops), else those whose deadline passed."""
        if not self.parked:
            return []
        idle = self.idle(live)
        if idle or flush or not self.paused:
            due, self.parked = self.parked, []
        else:
            due = [p for p in self.parked if p.deadline <= now]
            self.parked = [p for p in self.parked if p.deadline > now]
        return [(p.envelope, self.report(p.request_id, p.already, idle, live, now)) for p in due]

    def report(
        self, request_id: int, already: bool, idle: bool, live: Collection[str], now: float
    ) -> protocol.GenerationPaused:
        reports = [r for w in live if (r := self.reports.get(w)) is not None and r.epoch == self.epoch]
        return protocol.GenerationPaused(
            request_id, self.mode, idle and self.paused, already, round(now - self.paused_at, 6), len(live),
            sum(r.engine_calls for r in reports), sum(r.turns_held for r in reports),
            sum(r.tokens_kept for r in reports), not self.paused,
        )  # fmt: skip

    def stats(self, now: float) -> dict[str, object]:
        return {
            "generation_paused": self.mode,
            "generation_paused_since": self.since,
            "generation_paused_s": round(now - self.paused_at, 3) if self.paused else 0.0,
            "generation_epoch": self.epoch,
            "generation_pauses": self.pauses,
            "generation_resumes": self.resumes,
            "generation_turns_held": sum(r.turns_held for r in self.reports.values() if r.epoch == self.epoch),
        }
