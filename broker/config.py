"""BrokerConfig: every setting of the broker process, each declared once with its default, variable, flag, help
and check (`broker.settings`), in one picklable record.

The CLI (`python -m broker`, or the lead's `rollout-gateway broker`) builds it once from flags over
`ROLLOUT_BROKER_*` environment variables over defaults and hands it to `__main__.run_broker`; `serve` builds it
in its own process and hands it to the broker it starts (`settings.to_json`). Nothing here reads the environment
at import time. Imports only the stdlib, `broker.protocol` (the default endpoints and the history modes) and
`broker.settings`; never zmq, never the other packages.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from broker import protocol
from broker.settings import CURVE_KEYS_ENV, SettingError, build, check, not_negative, positive, setting

logger = logging.getLogger(__name__)

ENV_PREFIX = "ROLLOUT_BROKER_"
# A broker that `serve` starts gets its whole config here (`settings.to_json`), not from flags and variables.
CONFIG_ENV = ENV_PREFIX + "CONFIG"

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


def _log_level(value: str) -> str | None:
    return None if isinstance(logging.getLevelName(value.upper()), int) else "must be a logging level"


def _http_urls(urls: tuple[str, ...]) -> str | None:
    bad = [url for url in urls if not url.startswith(("http://", "https://"))]
    return f"must be http:// or https:// URLs, not {', '.join(map(repr, bad))}" if bad else None


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    """Settings of one broker process, each declared with its help, variable, flag and check (`broker.settings`)."""

    ENV_PREFIX: ClassVar[str] = ENV_PREFIX

    worker_endpoint: str = setting(
        protocol.DEFAULT_WORKER_ENDPOINT, "the ZeroMQ endpoint between broker and workers, bound by the broker "
        "(port 0 allowed)", metavar="ENDPOINT")
    control_endpoint: str = setting(
        protocol.DEFAULT_CONTROL_ENDPOINT, "the ZeroMQ endpoint trainers connect to, bound by the broker (port 0 "
        "allowed)", flag="--control", metavar="ENDPOINT")
    tokenizer: str | None = setting(
        None, "a local `tokenizer.json` or its directory, to decode rows' `response` text (without it `response` "
        "is empty)", metavar="PATH")
    log_level: str = setting("INFO", "`DEBUG`, `INFO`, `WARNING` or `ERROR`", metavar="LEVEL", check=_log_level)
    max_sessions: int = setting(100_000, "open sessions at most; further opens are refused as busy", metavar="N",
                                check=positive)
    max_turns_cap: int | None = setting(None, "hard cap on turns per session, whatever the trainer asks",
                                        metavar="N", check=positive)
    max_wait_timeout: float = setting(MAX_WAIT_TIMEOUT_S, "ceiling on a finish's `wait_timeout`, seconds",
                                      metavar="S", check=not_negative)
    finished_memory: int = setting(
        FINISHED_MEMORY, "finished session ids remembered, so that a straggler gets `session_closed` instead of "
        "`unknown_session`", flag=None, check=positive)
    shutdown_linger_ms: int = setting(
        SHUTDOWN_LINGER_MS, "at shutdown, how long queued replies may still be flushed to peers, ms", flag=None,
        check=not_negative)
    max_frame_bytes: int = setting(
        MAX_FRAME_BYTES, "inbound frame size limit (libzmq `MAXMSGSIZE`): a larger frame drops its connection",
        flag=None, check=positive, shown="256 MiB")
    hwm: int = setting(100_000, "send and receive high-water mark of each socket", flag=None, check=positive)
    outbox_max_episodes: int = setting(
        OUTBOX_MAX_EPISODES, "finished episodes held for subscribers; further finishes (`request_finish`, agent "
        "finishes) are refused as busy until subscribers acknowledge some", metavar="N", check=positive)
    outbox_max_bytes: int = setting(
        OUTBOX_MAX_BYTES, "approximate row bytes held for subscribers; further finishes are refused as busy",
        metavar="BYTES", check=positive, shown="2 GiB")
    max_poll_wait: float = setting(MAX_POLL_WAIT_S, "ceiling on a subscriber's long-poll wait, seconds", flag=None,
                                   check=positive)
    max_lease: float = setting(MAX_LEASE_S, "ceiling on a subscriber's lease, seconds", flag=None, check=positive)
    max_credit: int = setting(MAX_CREDIT, "episodes one `FetchEpisodes` reply carries at most", flag=None,
                              check=positive)
    compact_idle: bool = setting(
        True, "compress older session log bytes (raw deflate) while no frame waits; `0`: no idle compaction",
        flag=None)
    compact_age_s: float = setting(
        COMPACT_AGE_S, "only log bytes committed at least this many seconds ago are compressed (once they are, the "
        "loop's idle time does it, a slice at a time)", flag=None, check=not_negative)
    compact_min_bytes: int = setting(
        COMPACT_MIN_SESSION_BYTES, "only sessions holding at least this many raw log bytes (token ids and message "
        "bytes) are compressed", flag=None, check=not_negative, shown="64 KiB")
    trim_min_bytes: int = setting(
        TRIM_MIN_BYTES, "give free heap pages back to the OS (glibc `malloc_trim`, in idle time) once this many "
        "bytes were freed since the last trim; 0: never trim the heap", flag=None, check=not_negative,
        shown="256 KiB")
    trim_interval_s: float = setting(TRIM_INTERVAL_S, "at least this many seconds between two trims", flag=None,
                                     check=not_negative)
    curve_keys: str | None = setting(
        None, "the key directory of `rollout-gateway keys` (`broker.key_secret`, `authorized_workers/`, "
        "`authorized_trainers/`): both endpoints use CURVE and accept only the authorized keys; required for a "
        "non-loopback endpoint", metavar="DIR", env=(CURVE_KEYS_ENV, ENV_PREFIX + "CURVE_KEYS"))
    state_dir: str | None = setting(
        None, "a durable broker: its write-ahead log and snapshots in `DIR` (created if missing, one broker per "
        "directory), from which a restarted broker recovers every open session, acknowledged turn and "
        "unacknowledged episode (default: in memory)", metavar="DIR", shown="in memory")
    fsync: FsyncPolicy = setting(
        "interval", "with a state directory, when the log is synced to disk: `always` (before each batch of "
        "replies: a power loss loses nothing acknowledged), `interval` (every `FSYNC_INTERVAL_MS`: a power loss "
        "loses up to that), `never` (the OS decides); a process crash loses nothing acknowledged under any")
    fsync_interval_ms: int = setting(FSYNC_INTERVAL_MS, "the `interval` policy's period, ms", flag=None,
                                     check=positive)
    wal_segment_bytes: int = setting(WAL_SEGMENT_BYTES, "log segments are sealed at this size", flag=None,
                                     check=positive, shown="64 MiB")
    snapshot_min_bytes: int = setting(
        SNAPSHOT_MIN_BYTES, "a snapshot begins once the log since the last one reaches the last snapshot's size, "
        "at least this", flag=None, check=positive, shown="64 MiB")
    snapshot_max_bytes: int = setting(
        SNAPSHOT_MAX_BYTES, "... and at most this (it bounds what a restart replays)", flag=None, check=positive,
        shown="128 MiB")
    wal_truncate_corrupt: bool = setting(
        False, "at start, cut the log at a damaged record (losing what follows it) instead of refusing to start",
        flag=None)
    worker_silence_s: float = setting(
        WORKER_SILENCE_S, "a worker unheard (no heartbeat) this long is given up for lost: its in-flight turns are "
        "abandoned, so finishes stop waiting for them (a late commit still lands)", flag=None, check=positive)
    history_mode: str = setting(
        "tree", "how sessions that do not choose build their prompts: `tree` (the chat template renders the "
        "request's messages) or `linear` (a request that extends the session's previous turn is prompted with the "
        "ids the engine saw plus the rendering of only the new messages: one row per append-only episode)",
        choices=protocol.HISTORY_MODES)
    linear_fallback: str = setting(
        "fork", "what a linear session's request that extends none of its turns gets: `fork` (a full render "
        "starting a new line), `rerender` (a full render that becomes its one line) or `reject` (a 400 naming the "
        "first message that differs)", choices=protocol.LINEAR_FALLBACKS)
    engine_urls: tuple[str, ...] = setting(
        (), "an engine replica sessions are routed to (repeat it; the variable: space- or comma-separated): a new "
        "session goes to the least-loaded healthy one and stays there until it ends; replicas failing their "
        "`/health` check are taken out, and `TrainerClient.set_engines` replaces the list at run time (none: the "
        "workers route by their own lists)", flag="--engine-url", metavar="URL", check=_http_urls)
    engine_health_interval_s: float = setting(
        ENGINE_HEALTH_INTERVAL_S, "seconds between health checks (`GET /health`) of each engine replica the broker "
        "routes to", flag=None, check=positive)
    engine_health_timeout_s: float = setting(
        ENGINE_HEALTH_TIMEOUT_S, "seconds one health check may take (longer: the replica is unhealthy)", flag=None,
        check=positive)
    restarted: bool = setting(
        False, "this broker replaces one that ran before (`serve`'s supervisor sets it): without a state "
        "directory, requests for sessions it never saw are refused saying the earlier state was not durable")

    def __post_init__(self) -> None:
        check(self)  # the history settings' choices are the protocol's (`protocol.check_history`)
        if self.snapshot_max_bytes < self.snapshot_min_bytes:
            raise SettingError("BrokerConfig.snapshot_max_bytes must be >= snapshot_min_bytes")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> BrokerConfig:
        """Defaults, then `ROLLOUT_BROKER_<FIELD>` variables, then explicit `overrides` (non-None only)."""
        return build(cls, None, environ, **{k: v for k, v in overrides.items() if v is not None})  # type: ignore[no-any-return]
