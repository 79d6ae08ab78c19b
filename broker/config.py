"""BrokerConfig: every setting of the broker process, with defaults, in one picklable record.

The CLI (`python -m broker`, or the lead's `rollout-gateway broker`) builds it once from
flags and `ROLLOUT_BROKER_*` environment variables and hands it to `__main__.run_broker`.
Nothing here reads the environment at import time. Imports only the stdlib and
`broker.protocol` (for the default endpoints and the history modes); never zmq, never the other packages.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from broker import protocol

logger = logging.getLogger(__name__)

ENV_PREFIX = "ROLLOUT_BROKER_"

# A FinishSession may ask to wait this long at most: a longer drain is almost surely a
# trainer bug, and the broker would hold the session's memory meanwhile.
MAX_WAIT_TIMEOUT_S = 600.0
# Sessions that finished recently are remembered (ids only) so that a straggler gets the
# precise "session_closed" instead of "unknown_session".
FINISHED_MEMORY = 65_536
# Shutdown: how long queued replies may still be flushed to peers before sockets close.
SHUTDOWN_LINGER_MS = 1_000
# Inbound frames larger than this make libzmq drop the connection (a 128k-token commit
# with its messages is ~1.5 MiB; this leaves two orders of magnitude of room).
MAX_FRAME_BYTES = 256 * 1024 * 1024
# The episode outbox (request_finish / agent finishes) holds at most this many episodes and
# about this many bytes of rows; past either, new finishes are refused with "busy".
OUTBOX_MAX_EPISODES = 10_000
OUTBOX_MAX_BYTES = 2 * 1024**3
# Ceilings on what a subscriber may ask: how long its long poll may be parked, how long its
# lease may run between polls, and how many episodes one reply may carry.
MAX_POLL_WAIT_S = 60.0
MAX_LEASE_S = 3_600.0
MAX_CREDIT = 1_024
# Idle-time compaction (see `sessions`) compresses a session's log bytes once they have been held
# this long: bytes of an episode that finishes sooner are never compressed (its finish would only
# decompress them again), and uncompressed memory beyond the compressed state stays bounded by
# what the broker ingests in this time. Real engines take seconds per turn, so a long episode's
# older turns still compress while it runs.
COMPACT_AGE_S = 5.0
# ...and only in sessions whose logs hold this many raw bytes: tiny sessions never pay.
COMPACT_MIN_SESSION_BYTES = 64 * 1024
# Heap trimming (see `heap_trim`): glibc keeps the pages that compaction and finished sessions free,
# so once the broker has freed TRIM_MIN_BYTES since its last trim, malloc_trim(0) gives them back in
# the loop's idle time, at most once per TRIM_INTERVAL_S (and at most 0.5% of the time: the next trim
# waits 200x the last pause, `heap_trim.PAUSE_SPACING`). A trim's pause grows with the heap
# (scripts/bench_heap_trim.py; figures in docs/performance.md), so memory goes back within seconds of
# compaction; a quarter MiB is a small fraction of a byte per token of the memory benchmark's sessions
# (a small broker's last wave is worth it too); and a busy broker never trims more than once a second.
TRIM_MIN_BYTES = 256 * 1024
TRIM_INTERVAL_S = 1.0
# A durable broker (`state_dir`, see `broker.durability`): under the default fsync policy, `interval`,
# a syncer thread fdatasyncs the log this often, so a power loss loses at most about this much of
# acknowledged work (a process crash loses nothing: replies are sent after the log's write(2)).
FSYNC_INTERVAL_MS = 100
# Log segments are sealed at this size; snapshots remove the ones before them.
WAL_SEGMENT_BYTES = 64 * 1024**2
# A snapshot begins once the log since the last one is about the live state's size, and at least
# SNAPSHOT_MIN_BYTES (small states are not rewritten over and over) and at most SNAPSHOT_MAX_BYTES
# (what a restart may have to replay on top of loading the snapshot: replay is the slow part;
# docs/performance.md has the recovery times behind this).
SNAPSHOT_MIN_BYTES = 64 * 1024**2
SNAPSHOT_MAX_BYTES = 128 * 1024**2
# A worker heartbeats every second (`gateway_workers.capture.backplane`); one unheard for this long is given
# up for lost and its in-flight turns abandoned: three missed beats, so a stalled event loop or a burst of
# load does not cost live turns, and a finish waits at most this (plus a check interval) for a dead worker.
WORKER_SILENCE_S = 3.0
# Engine replicas are checked this often (`broker.health`); a failed check takes one out of routing at once.
ENGINE_HEALTH_INTERVAL_S = 1.0
ENGINE_HEALTH_TIMEOUT_S = 1.0
FsyncPolicy = Literal["always", "interval", "never"]
FSYNC_POLICIES: tuple[FsyncPolicy, ...] = ("always", "interval", "never")


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    """Settings of one broker process.

    Args:
        worker_endpoint: ZeroMQ endpoint bound for gateway workers (port 0 allowed).
        control_endpoint: ZeroMQ endpoint bound for trainer clients (port 0 allowed).
        tokenizer: a `tokenizer.json` (or a directory holding one) used to decode each row's
            `response` text; None leaves `response` empty.
        log_level: Python logging level name.
        max_sessions: open sessions at most; further opens are refused with "busy".
        max_turns_cap: hard cap on turns per session whatever the trainer asks (None: none).
        max_wait_timeout: ceiling on a FinishSession's `wait_timeout`, seconds.
        finished_memory: how many finished session ids are remembered for precise refusals.
        shutdown_linger_ms: bounded flush of pending replies at shutdown.
        max_frame_bytes: inbound frame size limit (libzmq MAXMSGSIZE).
        hwm: send/receive high-water mark per socket.
        outbox_max_episodes: episodes held for subscribers at most (finishes past it: "busy").
        outbox_max_bytes: approximate row bytes held for subscribers at most (finishes past it: "busy").
        max_poll_wait: ceiling on a subscriber's long-poll wait, seconds.
        max_lease: ceiling on a subscriber's lease, seconds.
        max_credit: episodes one FetchEpisodes reply carries at most.
        compact_idle: compress older session log bytes (raw deflate) while no frame waits.
        compact_age_s: only log bytes committed at least this many seconds ago are compressed
            (once they are, the next steps of the loop's idle time do it, a slice at a time).
        compact_min_bytes: only sessions holding at least this many raw log bytes (token ids plus
            message bytes) are compressed; smaller ones hold little.
        trim_min_bytes: give free heap pages back to the OS (glibc `malloc_trim`, in idle time) once
            this many bytes were freed since the last trim; 0 never trims.
        trim_interval_s: at least this many seconds between two trims.
        curve_keys: the key directory of `rollout-gateway keys` (`broker.key_secret`, `authorized_workers/`,
            `authorized_trainers/`): both endpoints use CURVE and accept only the authorized keys. None: no
            CURVE, and both endpoints must be loopback (or ipc://).
        state_dir: make the broker durable: a write-ahead log and snapshots in this directory (created if
            missing; one broker per directory), recovered on start (`broker.durability`). None: in memory.
        fsync: when the log is synced to the disk: "always" (before each pass's replies: a power loss
            loses nothing acknowledged), "interval" (every `fsync_interval_ms`: a power loss loses up to
            that much), "never" (the OS decides; a power loss may lose the last ~30 s). A process crash
            loses nothing acknowledged under any of them.
        fsync_interval_ms: the "interval" policy's period.
        wal_segment_bytes: log segments are sealed at this size.
        snapshot_min_bytes, snapshot_max_bytes: a snapshot begins once the log since the last one reaches
            the last snapshot's size, kept within these bounds (the max bounds what a restart replays).
        wal_truncate_corrupt: at start, cut the log at a damaged record (losing what follows it) instead of
            refusing to start.
        worker_silence_s: a worker whose heartbeats stop for this long is given up for lost: its
            in-flight turns are abandoned (finishes stop waiting for them; a late commit still lands).
        history_mode: how sessions that do not choose build their prompts: "tree" (the template renders the
            request's messages) or "linear" (a request that extends a committed turn is prompted with that turn's
            ids and the rendering of only the new messages: one row per append-only episode).
        linear_fallback: what a linear session's request that extends none of its turns gets: "fork" (a full
            render that starts a new line; later requests may extend either), "rerender" (a full render that
            becomes the session's one line) or "reject" (a 400 naming the first message that differs).
        engine_urls: the engine replicas sessions are routed to (`broker.sessions.replicas`: least-loaded
            healthy, sticky until the session ends); `SetEngines` replaces them at run time. Empty: the
            workers route by their own --engine-url lists.
        engine_health_interval_s, engine_health_timeout_s: how often each replica's /health is checked, and
            how long one check may take (`broker.health`).
        restarted: this broker replaces one that ran before (`serve`'s supervisor sets it); without a
            state directory, refusals of unknown sessions then say the earlier sessions were lost.
    """

    worker_endpoint: str = protocol.DEFAULT_WORKER_ENDPOINT
    control_endpoint: str = protocol.DEFAULT_CONTROL_ENDPOINT
    tokenizer: str | None = None
    log_level: str = "INFO"
    max_sessions: int = 100_000
    max_turns_cap: int | None = None
    max_wait_timeout: float = MAX_WAIT_TIMEOUT_S
    finished_memory: int = FINISHED_MEMORY
    shutdown_linger_ms: int = SHUTDOWN_LINGER_MS
    max_frame_bytes: int = MAX_FRAME_BYTES
    hwm: int = 100_000
    outbox_max_episodes: int = OUTBOX_MAX_EPISODES
    outbox_max_bytes: int = OUTBOX_MAX_BYTES
    max_poll_wait: float = MAX_POLL_WAIT_S
    max_lease: float = MAX_LEASE_S
    max_credit: int = MAX_CREDIT
    compact_idle: bool = True
    compact_age_s: float = COMPACT_AGE_S
    compact_min_bytes: int = COMPACT_MIN_SESSION_BYTES
    trim_min_bytes: int = TRIM_MIN_BYTES
    trim_interval_s: float = TRIM_INTERVAL_S
    curve_keys: str | None = None
    state_dir: str | None = None
    fsync: FsyncPolicy = "interval"
    fsync_interval_ms: int = FSYNC_INTERVAL_MS
    wal_segment_bytes: int = WAL_SEGMENT_BYTES
    snapshot_min_bytes: int = SNAPSHOT_MIN_BYTES
    snapshot_max_bytes: int = SNAPSHOT_MAX_BYTES
    wal_truncate_corrupt: bool = False
    worker_silence_s: float = WORKER_SILENCE_S
    history_mode: str = "tree"
    linear_fallback: str = "fork"
    engine_urls: tuple[str, ...] = ()
    engine_health_interval_s: float = ENGINE_HEALTH_INTERVAL_S
    engine_health_timeout_s: float = ENGINE_HEALTH_TIMEOUT_S
    restarted: bool = False

    def __post_init__(self) -> None:
        for name in (
            "max_sessions",
            "finished_memory",
            "max_frame_bytes",
            "hwm",
            "outbox_max_episodes",
            "outbox_max_bytes",
            "max_poll_wait",
            "max_lease",
            "max_credit",
            "fsync_interval_ms",
            "wal_segment_bytes",
            "snapshot_min_bytes",
            "snapshot_max_bytes",
            "worker_silence_s",
            "engine_health_interval_s",
            "engine_health_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"BrokerConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_turns_cap is not None and self.max_turns_cap <= 0:
            raise ValueError(f"BrokerConfig.max_turns_cap must be > 0 or None, got {self.max_turns_cap!r}")
        for name in (
            "max_wait_timeout",
            "shutdown_linger_ms",
            "compact_age_s",
            "compact_min_bytes",
            "trim_min_bytes",
            "trim_interval_s",
        ):
            if not getattr(self, name) >= 0:  # `not >=`: NaN fails too
                raise ValueError(f"BrokerConfig.{name} must be >= 0, got {getattr(self, name)!r}")
        for url in self.engine_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"BrokerConfig.engine_urls: {url!r} is not an http:// or https:// URL")
        if self.fsync not in FSYNC_POLICIES:
            raise ValueError(f"BrokerConfig.fsync must be one of {', '.join(FSYNC_POLICIES)}, got {self.fsync!r}")
        problem = protocol.check_history(self.history_mode, self.linear_fallback)
        if problem is not None:
            raise ValueError(f"BrokerConfig.{problem}")
        if self.snapshot_max_bytes < self.snapshot_min_bytes:
            raise ValueError("BrokerConfig.snapshot_max_bytes must be >= snapshot_min_bytes")
        if not isinstance(logging.getLevelName(self.log_level.upper()), int):
            raise ValueError(f"BrokerConfig.log_level: unknown level {self.log_level!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> BrokerConfig:
        """Defaults, then `ROLLOUT_BROKER_<FIELD>` variables, then explicit `overrides` (non-None only)."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            key = ENV_PREFIX + f.name.upper()
            if key in env:
                values[f.name] = _cast(key, env[key], _CASTS[f.name])
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _optional_int(text: str) -> int | None:
    return None if text.strip().lower() in ("", "none") else int(text)


def _optional_str(text: str) -> str | None:
    return text or None


def _flag(text: str) -> bool:
    return text.strip().lower() not in ("0", "false", "no", "off")


_CASTS: dict[str, Callable[[str], Any]] = {
    "worker_endpoint": str,
    "control_endpoint": str,
    "tokenizer": _optional_str,
    "log_level": str,
    "max_sessions": int,
    "max_turns_cap": _optional_int,
    "max_wait_timeout": float,
    "finished_memory": int,
    "shutdown_linger_ms": int,
    "max_frame_bytes": int,
    "hwm": int,
    "outbox_max_episodes": int,
    "outbox_max_bytes": int,
    "max_poll_wait": float,
    "max_lease": float,
    "max_credit": int,
    "compact_idle": _flag,
    "compact_age_s": float,
    "compact_min_bytes": int,
    "trim_min_bytes": int,
    "trim_interval_s": float,
    "curve_keys": _optional_str,
    "state_dir": _optional_str,
    "fsync": str,
    "fsync_interval_ms": int,
    "wal_segment_bytes": int,
    "snapshot_min_bytes": int,
    "snapshot_max_bytes": int,
    "wal_truncate_corrupt": _flag,
    "worker_silence_s": float,
    "history_mode": str,
    "linear_fallback": str,
    "engine_urls": lambda text: tuple(url for url in text.replace(",", " ").split() if url),
    "engine_health_interval_s": float,
    "engine_health_timeout_s": float,
    "restarted": _flag,
}


def _cast(key: str, text: str, cast: Callable[[str], Any]) -> Any:
    try:
        return cast(text)
    except ValueError as e:
        # name the variable: "invalid literal for int()" alone does not say which one
        raise ValueError(f"environment variable {key}={text!r}: {e}") from None
