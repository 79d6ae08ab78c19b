"""Every metric the gateway exposes: its Prometheus name, type, help and label names.

Two sources. The workers count what only they see (each turn's outcome, tokens and stage durations, HTTP
errors, engine failures, the render cache and the fast twins) and send the counts in their heartbeats,
under the names of `WORKER_METRICS` (`broker.protocol.SECONDS_BUCKETS` describes the shape). The broker
adds what it holds: the `stats()` counters and gauges named in `BROKER_STATS`, its commit latency, and
what finishes build (rows per episode, each turn's place in its rows). Pure data; imports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PREFIX = "rollout_gateway_"


@dataclass(frozen=True, slots=True)
class Metric:
    """One metric family. A counter's name has no `_total` (the exposition adds it)."""

    name: str
    kind: Literal["counter", "gauge", "histogram"]
    help: str
    labels: tuple[str, ...] = ()


def _catalog(*metrics: Metric) -> dict[str, Metric]:
    return {m.name: m for m in metrics}


# By the name a worker sends. Counters and histograms are summed over every worker that ever reported
# (a worker that exits keeps counting in the totals, so they never go backwards); gauges are per live
# worker, labelled with its id.
WORKER_METRICS = _catalog(
    Metric(
        "turns",
        "counter",
        "agent requests to the turn routes, by dialect, stream and outcome: committed (the "
        "reply reached the agent and the turn was recorded), aborted (it did not reach the agent: nothing "
        "recorded), replayed (a retry answered from the record), refused (a 4xx), failed (a 5xx)",
        ("dialect", "stream", "outcome"),
    ),
    Metric(
        "tokens", "counter", "tokens of the turns the engine generated: prompt ids sent, output ids sampled", ("kind",)
    ),
    Metric(
        "turn_duration_seconds",
        "histogram",
        "time a turn spent in each stage: render (request to prompt ids), "
        "engine (until the last token), parse, reply (sending it), commit (until the broker acknowledged the "
        "record), total (request to reply sent)",
        ("stage",),
    ),
    Metric("http_errors", "counter", "error responses (4xx, 5xx) by route, status and error code (the OpenAI "
           "API's code, e.g. unknown_parameter, invalid_type; the error's kind where the API has none)",
           ("route", "status", "code")),
    Metric("request_fields_ignored", "counter", "requests carrying a field the gateway accepts without effect on "
           "what is sampled (docs/request-fields.md), by dialect and field", ("dialect", "field")),
    Metric("hosted_tools_dropped", "counter", "tools the provider runs, left out of requests' prompts "
           "(--hosted-tools drop), by dialect and tool type", ("dialect", "type")),
    Metric(
        "ill_formed_turns",
        "counter",
        "committed turns whose reply the parser flagged ill-formed (recorded with "
        "the flag, its tokens trained as sampled)",
        ("dialect",),
    ),
    Metric("agent_finishes", "counter", "sessions finished by their agent (POST /rollout/v1/sessions/finish)"),
    Metric("engine_errors", "counter", "engine calls that failed, by replica and kind", ("replica", "kind")),
    Metric(
        "commits_sent",
        "counter",
        "turn commits sent to the broker, in full or as a delta of the session's previous turn",
        ("form",),
    ),
    Metric(
        "commit_deltas_refused", "counter", "delta commits the broker refused (its base was gone), then sent in full"
    ),
    Metric(
        "sessions_ended_told",
        "counter",
        "session ends the workers were told of (each worker is told of each, and drops what it keeps of the session)",
    ),
    Metric(
        "linear_history",
        "counter",
        "linear sessions' prompts on the worker: held_local / held_fetched (the "
        "held ids were this worker's / fetched from the broker), matched_local (matched without the broker's "
        "fingerprints), waits (waited for the echoed turn's commit)",
        ("event",),
    ),
    Metric("render_cache", "counter", "lookups in the workers' cache of rendered message pieces", ("result",)),
    Metric(
        "request_bodies",
        "counter",
        "agent request bodies by how they were decoded: extended (only what they added to the "
        "session's previous body was decoded), repeated (the same body again: a retry), whole",
        ("decoded",),
    ),
    Metric("twin_uses", "counter", "calls served by a fast twin of a library function", ("twin", "name")),
    Metric("twin_checks", "counter", "twin results checked against the library's", ("twin", "name")),
    Metric(
        "twin_mismatches",
        "counter",
        "twin results that differed from the library's (the twin is then dropped)",
        ("twin", "name"),
    ),
    Metric("worker_sessions_held", "gauge", "sessions a worker keeps something of, by what", ("what",)),
    Metric("render_cache_pieces", "gauge", "rendered pieces a worker's cache holds"),
    Metric("render_cache_bytes", "gauge", "bytes a worker's render cache holds"),
    Metric("render_bpe_twin", "gauge", "1 while a worker encodes new prompt text with its tiktoken twin"),
    Metric("twin_active", "gauge", "1 while a fast twin is in use on a worker", ("twin", "name")),
    Metric("engine_replica", "gauge", "1 per engine replica a worker sends to", ("replica",)),
    Metric("pause_holds", "counter", "turns a worker held at its generation gate while paused, by outcome: held "
           "(all of them), timed_out (held past --pause-hold-s: a 503)", ("outcome",)),
    Metric("pause_stops", "counter", "generations a pause in mode abort stopped at the engine"),
    Metric("pause_tokens_kept", "counter", "tokens those generations had sampled, kept for the resume"),
    Metric("pause_resubmits", "counter", "engine calls that asked for the rest of a generation a pause stopped (or "
           "whose replica died): per stopped generation, the resubmits per turn"),
    Metric("pause_failovers", "counter", "generations a pause held that went on at another replica, theirs dead"),
)

# By the key of `BrokerServer.stats()`: the metric it is a sample of, and that sample's label values.
_SESSIONS = Metric("sessions", "counter", "sessions by what happened to them", ("event",))
_COMMITS = Metric(
    "broker_commits",
    "counter",
    "commits the broker received, by outcome: stored, duplicate (a "
    "resend), discarded (the session was gone), late (after its turn was given up), delta, "
    "unknown_base (a delta against a turn it does not hold)",
    ("outcome",),
)
_LINEAR = Metric(
    "linear_prompts",
    "counter",
    "linear sessions' turns by how the prompt was built: linear (the held ids extended), first, fork, rerender, reject",
    ("kind",),
)
_EPISODES = Metric(
    "episodes", "counter", "episodes through the outbox: added, delivered, redelivered, acked", ("event",)
)
_OUTBOX = Metric("outbox", "gauge", "episodes in the outbox: all held, ready, leased to a subscriber", ("state",))
_TURNS = Metric(
    "broker_turns",
    "counter",
    "turns as the broker saw them: opened, aborted, abandoned (their worker "
    "fell silent or the finish stopped waiting), worker_lost, replayed",
    ("event",),
)
_HELD = Metric(
    "held", "gauge", "what open sessions hold in the broker: committed turns, their tokens and bytes", ("what",)
)
_ROUTING = Metric(
    "engine_sessions_routed",
    "counter",
    "sessions given an engine replica by the broker: routed (a new session) "
    "or moved (its replica failed or was removed)",
    ("how",),
)
_WAL = Metric(
    "wal", "counter", "a durable broker's log: bytes written, syncs, snapshots written, snapshot failures", ("what",)
)


def _gauge(name: str, help: str) -> Metric:
    return Metric(name, "gauge", help)


def _counter(name: str, help: str) -> Metric:
    return Metric(name, "counter", help)


BROKER_STATS: dict[str, tuple[Metric, tuple[str, ...]]] = {
    "sessions_open": (_gauge("sessions_open", "sessions open for turns"), ()),
    "sessions_closing": (_gauge("sessions_closing", "sessions whose finish waits for turns in flight"), ()),
    "turns_in_flight": (_gauge("turns_in_flight", "turns opened and not yet committed or aborted"), ()),
    "turns_held": (_HELD, ("turns",)),
    "tokens_held": (_HELD, ("tokens",)),
    "bytes_held": (_HELD, ("bytes",)),
    "sessions_opened": (_SESSIONS, ("opened",)),
    "sessions_finished": (_SESSIONS, ("finished",)),
    "sessions_dropped": (_SESSIONS, ("dropped",)),
    "turns_opened": (_TURNS, ("opened",)),
    "turns_aborted": (_TURNS, ("aborted",)),
    "turns_abandoned": (_TURNS, ("abandoned",)),
    "turns_worker_lost": (_TURNS, ("worker_lost",)),
    "turns_replayed": (_TURNS, ("replayed",)),
    "commits_stored": (_COMMITS, ("stored",)),
    "commits_duplicate": (_COMMITS, ("duplicate",)),
    "commits_discarded": (_COMMITS, ("discarded",)),
    "commits_late": (_COMMITS, ("late",)),
    "commits_delta": (_COMMITS, ("delta",)),
    "commits_unknown_base": (_COMMITS, ("unknown_base",)),
    "linear_turns": (_LINEAR, ("linear",)),
    "linear_first": (_LINEAR, ("first",)),
    "linear_forks": (_LINEAR, ("fork",)),
    "linear_rerenders": (_LINEAR, ("rerender",)),
    "linear_rejects": (_LINEAR, ("reject",)),
    "outbox_episodes": (_OUTBOX, ("held",)),
    "outbox_ready": (_OUTBOX, ("ready",)),
    "outbox_leased": (_OUTBOX, ("leased",)),
    "outbox_bytes": (_gauge("outbox_bytes", "bytes of the episodes in the outbox"), ()),
    "subscribers": (_gauge("subscribers", "episode subscribers the broker knows"), ()),
    "episodes_added": (_EPISODES, ("added",)),
    "episodes_delivered": (_EPISODES, ("delivered",)),
    "episodes_redelivered": (_EPISODES, ("redelivered",)),
    "episodes_acked": (_EPISODES, ("acked",)),
    "leases_expired": (_counter("leases_expired", "episode leases that expired (the episode went back)"), ()),
    "outbox_full_refusals": (_counter("outbox_full_refusals", "finishes refused because the outbox was full"), ()),
    "finishes_parked": (_gauge("finishes_parked", "finishes waiting for turns in flight"), ()),
    "drain_timeouts": (_counter("drain_timeouts", "finishes that stopped waiting for turns in flight"), ()),
    "finish_failures": (_counter("finish_failures", "finishes whose rows could not be built (logged)"), ()),
    "workers_heard": (_gauge("workers", "workers heard from within the silence bound"), ()),
    "protocol_errors": (_counter("protocol_errors", "undecodable frames the broker refused"), ()),
    "replies_dropped": (_counter("replies_dropped", "replies the broker could not send (peer gone or full)"), ()),
    "uptime_s": (_gauge("broker_uptime_seconds", "seconds since the broker started"), ()),
    "weight_version": (_gauge("weight_version", "the policy version set last (set_weight_version; -1: none)"), ()),
    "generation_paused_s": (_gauge("generation_paused_seconds", "how long the pause in force has lasted (0 while "
                                   "generating)"), ()),
    "generation_pauses": (_counter("generation_pauses", "pause_generation calls that paused generation"), ()),
    "generation_turns_held": (_gauge("generation_turns_held", "turns the workers hold for the resume"), ()),
    "sessions_routed": (_ROUTING, ("routed",)),
    "sessions_moved": (_ROUTING, ("moved",)),
    "replicas_down": (
        _counter("engine_replicas_down", "times a replica failed its health check and was taken out"),
        (),
    ),
    "wal_bytes_written": (_WAL, ("bytes_written",)),
    "wal_syncs": (_WAL, ("syncs",)),
    "snapshots_written": (_WAL, ("snapshots_written",)),
    "snapshot_failures": (_WAL, ("snapshot_failures",)),
}

REFUSALS = Metric("broker_refusals", "counter", "requests the broker refused, by error code", ("code",))
COMMIT_SECONDS = Metric(
    "broker_commit_seconds",
    "histogram",
    "a commit's time in the broker, from its frame's receipt to its acknowledgement's send (the log written first)",
)
ROWS_PER_EPISODE = Metric("rows_per_episode", "histogram", "training rows a finished episode gave")
ROW_DECISIONS = Metric(
    "row_decisions",
    "counter",
    "each finished turn's place in its episode's rows: clean "
    "(continued a row), first, branch, realign, rewrite, fork (started one, and why), empty, "
    "dropped",
    ("decision",),
)
REPLICA_HEALTHY = Metric(
    "engine_replica_healthy", "gauge", "1 while an engine replica passes its health checks", ("replica",)
)
REPLICA_SESSIONS = Metric("engine_replica_sessions", "gauge", "sessions routed to each engine replica", ("replica",))
HEARTBEAT_AGE = Metric("worker_heartbeat_age_seconds", "gauge", "seconds since each live worker's last heartbeat")
WORKER_INFO = Metric("worker_info", "gauge", "1 per live worker, labelled with its process id", ("pid",))

# Rows per episode: upper bounds of its histogram's buckets.
ROWS_BUCKETS: tuple[float, ...] = (1, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30, 50, 100)
