"""Engine routing: which replica each session samples from, decided where every worker sees it.

A session's first OPEN assigns it the least-loaded healthy replica (the fewest sessions assigned), and
every later turn, on whichever worker, goes to the same one: its prefix cache keeps the session's
context. The session keeps its slot until it ends (finished or dropped). A replica found unhealthy
(`health`: a failed check of `broker.health`) takes no new sessions, and its sessions move to the
least-loaded healthy one at their next turn (counted: `sessions_moved`). The trainer replaces the
replica list at run time (`protocol.SetEngines`: weight-sync loops restart engines). A removed replica's
sessions move the same way, and a replica added back counts the sessions still assigned to it. With no
healthy replica a session keeps (or gets) one anyway, and the engine's failure reaches the agent as a
retryable 5xx. With no replicas at all (`assign` gives ""), the workers route by their own
`--engine-url` list. Pure bookkeeping: no sockets, no clock; imports only the stdlib.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Replica:
    url: str
    healthy: bool = True  # until a check says otherwise: a new replica takes sessions at once
    sessions: int = 0
    last_error: str = ""


class ReplicaTable:
    """The replicas, the session each is serving, and each session's replica."""

    def __init__(self, urls: Iterable[str] = ()) -> None:
        self.replicas: dict[str, Replica] = {}
        self.assigned: dict[str, str] = {}  # session id -> replica url (possibly one since removed)
        self.counters = {"sessions_routed": 0, "sessions_moved": 0, "replicas_down": 0}
        self.set(urls)

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(self.replicas)

    def set(self, urls: Iterable[str]) -> None:
        """Replace the replica list (in order; duplicates and trailing slashes folded). Replicas kept keep their
        health and sessions; added ones start healthy."""
        wanted = list(dict.fromkeys(url.rstrip("/") for url in urls))
        kept = {url: self.replicas[url] for url in wanted if url in self.replicas}
        self.replicas = {url: kept.get(url) or self._added(url) for url in wanted}

    def _added(self, url: str) -> Replica:
        return Replica(url, sessions=sum(1 for held in self.assigned.values() if held == url))

    def assign(self, sid: str) -> str:
        """The replica of `sid`'s next turn: its own while that one is listed and healthy, else the least-loaded
        healthy one (the list's first among equals); "" with no replicas."""
        if not self.replicas:
            return ""
        held = self.assigned.get(sid)
        current = self.replicas.get(held) if held is not None else None
        if current is not None and current.healthy:
            return current.url
        candidates = [r for r in self.replicas.values() if r.healthy] or list(self.replicas.values())
        best = min(candidates, key=lambda r: r.sessions)
        if best is current:
            return best.url  # none healthy: it stays
        if current is not None:
            current.sessions -= 1
        if held is not None:
            self.counters["sessions_moved"] += 1
        else:
            self.counters["sessions_routed"] += 1
        best.sessions += 1
        self.assigned[sid] = best.url
        return best.url

    def release(self, sid: str) -> None:
        """`sid` ended: its replica's slot is free."""
        url = self.assigned.pop(sid, None)
        replica = self.replicas.get(url) if url is not None else None
        if replica is not None:
            replica.sessions -= 1

    def health(self, url: str, healthy: bool, error: str = "") -> bool:
        """A check's verdict on `url` (ignored for a replica no longer listed); whether it changed its state."""
        replica = self.replicas.get(url)
        if replica is None or replica.healthy == healthy:
            if replica is not None and not healthy:
                replica.last_error = error
            return False
        replica.healthy = healthy
        replica.last_error = error
        if not healthy:
            self.counters["replicas_down"] += 1
        return True

    def stats(self) -> dict[str, Any]:
        return {
            "replicas": {
                r.url: {"healthy": r.healthy, "sessions": r.sessions, "last_error": r.last_error}
                for r in self.replicas.values()
            },
            **self.counters,
        }
