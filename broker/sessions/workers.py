"""Worker liveness: which workers were heard from lately, and giving up the turns of one that fell silent.

A worker names itself in every OpenTurn and sends a Heartbeat every second or so, the first before any
OPEN (`worker_id`: fresh per worker process, so a restarted worker is a new worker). A worker unheard
for `silence_s` is given up for lost: each turn it opened and has not committed or aborted is
abandoned (`SessionRegistry.abandon_turn`), so a finish stops waiting for turns that cannot arrive.
A worker that was only slow and commits later still lands its turn while the session lives, unless a
retry of its request was sampled afresh meanwhile (`SessionRegistry.commit_turn`, `open_turn`). Each
heartbeat is also when a worker is told which sessions ended since its last one (`ended_since`), so that
it drops what it caches of them. Pure bookkeeping on the server's clock: no sockets; imports only the
stdlib, `broker.protocol` and `broker.sessions`.
"""

from __future__ import annotations

import itertools
import logging

from broker.protocol import session_tag
from broker.sessions.registry import SessionRegistry

logger = logging.getLogger(__name__)

# The reason of the AbortTurn a durable broker logs for an abandoned turn: replayed as an abandonment.
WORKER_LOST = "worker_lost"
# How often the server looks for silent workers: the abandonment bound is silence_s plus this.
CHECK_INTERVAL_S = 0.25


class WorkerLiveness:
    """When each named worker was last heard from, and the turns of those silent past `silence_s`."""

    def __init__(self, silence_s: float) -> None:
        if not silence_s > 0:
            raise ValueError(f"silence_s must be positive, got {silence_s!r}")
        self.silence_s = silence_s
        self.heard: dict[str, float] = {}  # worker id -> when last heard (server clock)
        self.told: dict[str, int] = {}  # worker id -> the registry's `ended_total` when last told
        self.next_check = 0.0

    def hear(self, worker_id: str, now: float) -> None:
        self.heard[worker_id] = now

    def ended_since(self, worker_id: str, registry: SessionRegistry) -> list[str]:
        """The sessions that ended since `worker_id` was last told, oldest first (none for a worker new here: it
        holds nothing of sessions that ended before it was heard, or it was told by the broker before a restart).
        """
        total, ended = registry.ended_total, registry.ended
        told = self.told.get(worker_id)
        self.told[worker_id] = total
        if told is None or told >= total:
            return []
        return list(itertools.islice(ended, len(ended) - min(total - told, len(ended)), None))

    def expect(self, registry: SessionRegistry, now: float) -> None:
        """Hear from every owner of a recovered in-flight turn now: a restarted broker gives them `silence_s` to
        show up before their turns are abandoned."""
        for session in registry.sessions():
            for worker_id in session.owners.values():
                self.heard[worker_id] = now

    def silent(self, now: float) -> list[str]:
        """The workers unheard for more than `silence_s` (forgotten here: heard again, one is a worker anew)."""
        self.next_check = now + CHECK_INTERVAL_S
        cutoff = now - self.silence_s
        lost = [w for w, t in self.heard.items() if t < cutoff]
        for worker_id in lost:
            del self.heard[worker_id]
            self.told.pop(worker_id, None)
        return lost


def abandon_turns_of(registry: SessionRegistry, worker_id: str, silence_s: float) -> list[tuple[str, str]]:
    """Abandon every in-flight turn `worker_id` opened; returns them as (session id, turn id)."""
    abandoned: list[tuple[str, str]] = []
    for session in registry.sessions():
        mine = [turn_id for turn_id, owner in session.owners.items() if owner == worker_id]
        for turn_id in mine:
            if registry.abandon_turn(session.sid, turn_id):
                abandoned.append((session.sid, turn_id))
    if abandoned:
        tags = sorted({session_tag(sid) for sid, _ in abandoned})
        logger.warning(
            "worker %s silent for over %.1fs: abandoned its %d in-flight turns (sessions %s)",
            worker_id, silence_s, len(abandoned), ", ".join(tags[:8]) + (" ..." if len(tags) > 8 else ""),
        )  # fmt: skip
    return abandoned
