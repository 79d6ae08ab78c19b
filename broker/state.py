"""What one broker holds, built from its config: sessions, finishes, the outbox, workers, replicas, metrics and
the journal its changes are logged through.

The server's loop (`broker.server`) and the message handlers (`broker.handlers`) share one `BrokerState`.
`open_state` makes it durable (a state directory, recovered first); until then, and without one, its journal
logs nothing (`episodes.journal.NO_JOURNAL`). No sockets; imports `broker.*` only.
"""

from __future__ import annotations

import math
import time
from collections import Counter

from broker import protocol
from broker.config import BrokerConfig
from broker.durability.store import DurableState
from broker.episodes.finishes import Finishes
from broker.episodes.journal import NO_JOURNAL, BrokerJournal
from broker.episodes.outbox import Outbox, Reply
from broker.episodes.rows import RowBuilder
from broker.generation import Generation
from broker.health import HealthChecker
from broker.metrics.gateway import GatewayMetrics
from broker.protocol import ids_array
from broker.sessions.heap_trim import HeapTrimmer, glibc_malloc_trim
from broker.sessions.registry import SessionRegistry
from broker.sessions.replicas import ReplicaTable
from broker.sessions.workers import WorkerLiveness

# The unknown_session refusals of an in-memory broker that replaced an earlier one (`BrokerConfig.restarted`).
LOST_ON_RESTART = (
    " (the broker restarted without a state directory (--state-dir), so sessions opened before the restart "
    "are lost: open a new session and rerun the episode)"
)


class BrokerState:
    """The broker's parts, wired together."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        # A restarted in-memory broker says why a key the caller had is gone.
        lost = "" if config.state_dir is not None or not config.restarted else LOST_ON_RESTART
        same_names = ("max_sessions", "max_turns_cap", "finished_memory", "compact_min_bytes", "compact_age_s",
                      "history_mode", "linear_fallback")
        self.registry = SessionRegistry(unknown_hint=lost, compact=config.compact_idle,
                                        **{name: getattr(config, name) for name in same_names})
        self.trimmer = HeapTrimmer(
            min_bytes=config.trim_min_bytes,
            interval_s=config.trim_interval_s,
            trim=glibc_malloc_trim() if config.trim_min_bytes > 0 else None,
        )
        self.rows = RowBuilder(config.tokenizer)
        self.outbox = Outbox(
            max_episodes=config.outbox_max_episodes,
            max_bytes=config.outbox_max_bytes,
            max_wait=config.max_poll_wait,
            max_lease=config.max_lease,
            max_credit=config.max_credit,
        )
        self.finishes = Finishes(self.registry, self.rows, self.outbox, config.max_wait_timeout)
        self.workers = WorkerLiveness(config.worker_silence_s)
        self.replicas = ReplicaTable(config.engine_urls)  # which engine replica each session samples from
        self.registry.end_listeners.append(self.replicas.release)
        self.health = HealthChecker(config.engine_health_interval_s, config.engine_health_timeout_s)
        self.health.watch(self.replicas.urls)
        self.metrics = GatewayMetrics()  # the workers' reports (heartbeats), and the commit latency
        self.commits_received: list[float] = []  # when each commit of the batch being handled arrived
        self.refusals: Counter[str] = Counter()  # refusals sent, by code
        self.loop_counters: Counter[str] = Counter()  # protocol_errors, replies_dropped
        self.started = time.monotonic()
        self.durable: DurableState | None = None  # with a state directory, once `open_state` ran
        self.journal: BrokerJournal = NO_JOURNAL
        self.generation = Generation()  # the pause in force, and the pause requests waiting for idle workers
        self.to_workers: list[tuple[list[bytes], protocol.Message]] = []  # told unasked, after the log's write

    def open_state(self) -> DurableState | None:
        """With `config.state_dir`: lock it and recover its state (before the sockets bind); None without one.

        Raises what `DurableState.open` raises (another broker holds the directory, damage in the log).
        """
        if self.config.state_dir is None:
            return None
        durable = DurableState(self.config, self.registry, self.outbox, self.finishes, self.generation)
        durable.open()
        assert durable.journal is not None
        self.durable, self.journal = durable, durable.journal
        return durable

    def warm_up(self) -> None:
        """Load what the first finish would otherwise load inside the loop (the response tokenizer)."""
        self.rows.decode(ids_array([0]))

    def trim_start_up_heap(self) -> None:
        """Give back what start-up freed (the response tokenizer's load; docs/performance.md), before any frame
        waits."""
        if self.trimmer.enabled:
            self.trimmer.trim(self.registry.counters["bytes_freed"])

    def parked_at_shutdown(self, now: float) -> list[Reply]:
        """Parked finishers get what was committed (drain_timeout) instead of a dead socket. Long polls are
        answered empty: unacknowledged episodes die with an in-memory broker (documented), and wait in a durable
        broker's log for its next start."""
        return [*self.finishes.shutdown(now), *self.outbox.close(), *self.generation.answers(self.workers.heard, now,
                                                                                              flush=True)]

    # --- what the server's loop asks between frames ------------------------------------------------

    def expired(self, now: float) -> list[Reply]:
        """The answers of parked finishes and long polls whose deadline passed."""
        replies: list[Reply] = []
        for parked in (self.finishes, self.outbox):
            due = parked.next_deadline()
            if due is not None and due <= now:
                replies += parked.expire(now)
        if self.generation.parked:
            due = self.generation.next_deadline()
            if due is not None and due <= now:
                replies += self.generation.answers(self.workers.heard, now)
        return replies

    def poll_timeout_ms(self, most_ms: int) -> int:
        """How long the loop may sleep: until the next parked deadline, `most_ms` at most."""
        due = [d for d in (self.finishes.next_deadline(), self.outbox.next_deadline()) if d is not None]
        if self.generation.parked:  # rare: a pause waiting for idle workers
            due += [d for d in (self.generation.next_deadline(),) if d is not None]
        if not due:
            return most_ms
        return max(0, min(most_ms, math.ceil((min(due) - time.monotonic()) * 1000)))

    def idle_work_due(self) -> bool:
        """Whether idle time has work: freed heap pages to give back to the OS (`heap_trim`, rate-limited), or
        older session logs to compress (`compaction`)."""
        freed = self.registry.counters["bytes_freed"]
        return self.trimmer.due(freed) or (self.config.compact_idle and self.registry.compaction.pending)

    def idle_step(self) -> None:
        """One bounded step of idle work: a heap trim, or one compaction slice. Only when no frame waits, so it
        costs the commit path nothing."""
        freed = self.registry.counters["bytes_freed"]
        if self.trimmer.due(freed):
            self.trimmer.trim(freed)
        elif self.config.compact_idle and self.registry.compaction.pending:
            self.registry.compaction.step()
