"""`rollout-gateway status`: the gateway at a glance, live, from the broker.

Asks the broker for its stats (`TrainerClient.stats`, which carries the sums of every worker's metrics and
each worker's heartbeat) every `--interval` seconds and shows one screen: sessions, turns per second,
turns in flight, the p50 and p99 of a turn's time, rows per episode, errors, each worker and each engine
replica. Rates and percentiles are over the last interval (the first screen: since the broker started).
`--json` prints the same summary as one JSON object per refresh (a line each), for scripts; `--once` prints
one and exits. Blocking code, like the rest of `trainer_client`: no event loop.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from broker import protocol
from trainer_client.client import TrainerClient
from trainer_client.errors import GatewayError

OUTCOMES = ("committed", "aborted", "replayed", "refused", "failed")
_CLEAR = "\x1b[H\x1b[2J"


def quantile(q: float, bounds: Sequence[float], counts: Sequence[float]) -> float | None:
    """The q-quantile of a histogram (per-bucket counts; the last above every bound), interpolated within its
    bucket as Prometheus' histogram_quantile does; None without observations. Above the last bound: that bound."""
    n = sum(counts)
    if n <= 0:
        return None
    rank, below = q * n, 0.0
    for i, count in enumerate(counts):
        if below + count >= rank and count > 0:
            if i == len(bounds):
                return bounds[-1]
            low = bounds[i - 1] if i > 0 else 0.0
            return low + (bounds[i] - low) * (rank - below) / count
        below += count
    return bounds[-1]


def _series(stats: Mapping[str, Any], kind: str) -> dict[tuple[str, tuple[str, ...]], Any]:
    gateway = stats.get("gateway", {})
    if kind == "counters":
        return {(name, tuple(labels)): value for name, labels, value in gateway.get("counters", ())}
    return {(name, tuple(labels)): (counts, total) for name, labels, counts, total in gateway.get("histograms", ())}


def _sum(
    series: Mapping[tuple[str, tuple[str, ...]], float], name: str, at: int | None = None, value: str | None = None
) -> float:
    """The sum of `name`'s counters, or only of those whose label number `at` is `value`."""
    return sum(v for (n, labels), v in series.items() if n == name and (at is None or labels[at] == value))


def _delta(now: float, before: float | None) -> float:
    return now - before if before is not None else now


def summarize(stats: Mapping[str, Any], previous: Mapping[str, Any] | None, seconds: float) -> dict[str, Any]:
    """The status of the gateway from two stats `seconds` apart (`previous` None: since the broker started)."""
    if previous is not None and stats.get("uptime_s", 0.0) < previous.get("uptime_s", 0.0):
        previous = None  # the broker restarted: its counts start again
    if previous is None:
        seconds = max(float(stats.get("uptime_s", 0.0)), 1e-9)
    counters, before = _series(stats, "counters"), _series(previous or {}, "counters")
    histograms, hist_before = _series(stats, "histograms"), _series(previous or {}, "histograms")

    def rate(name: str, at: int | None = None, value: str | None = None) -> float:
        now = _sum(counters, name, at, value)
        return round(_delta(now, _sum(before, name, at, value) if previous is not None else None) / seconds, 3)

    bounds = stats.get("gateway", {}).get("seconds_buckets", list(protocol.SECONDS_BUCKETS))

    def percentiles(stage: str) -> dict[str, float | None]:
        counts, _ = histograms.get(("turn_duration_seconds", (stage,)), ([0] * (len(bounds) + 1), 0.0))
        old, _ = hist_before.get(("turn_duration_seconds", (stage,)), ([0] * len(counts), 0.0))
        window = [a - b for a, b in zip(counts, old, strict=True)]
        return {f"p{round(q * 100)}": quantile(q, bounds, window) for q in (0.5, 0.99)}

    rows_counts, rows_sum = stats.get("rows_per_episode", [[0], 0.0])
    prev_rows = (previous or {}).get("rows_per_episode", [[0] * len(rows_counts), 0.0])
    episodes = sum(rows_counts) - sum(prev_rows[0])
    # Each replica: the broker's routing view when it routes (health, sessions), and the workers' error counts.
    routed = stats.get("replicas", {})
    replicas: dict[str, dict[str, Any]] = {url: {"errors": {}, **routed.get(url, {})} for url in routed}
    for worker in stats.get("workers", {}).values():
        for url in worker.get("replicas", ()):
            replicas.setdefault(url, {"errors": {}})
    for (name, labels), value in counters.items():
        if name == "engine_errors":
            replica, kind = labels
            replicas.setdefault(replica, {"errors": {}})["errors"][kind] = value
    return {
        "interval_s": round(seconds, 3),
        "sessions_open": stats.get("sessions_open", 0),
        "sessions_closing": stats.get("sessions_closing", 0),
        "turns_in_flight": stats.get("turns_in_flight", 0),
        "turns_per_s": {outcome: rate("turns", 2, outcome) for outcome in OUTCOMES},
        "tokens_per_s": {kind: rate("tokens", 0, kind) for kind in ("prompt", "output")},
        "turn_seconds": percentiles("total"),
        "engine_seconds": percentiles("engine"),
        "commit_seconds": percentiles("commit"),
        "rows_per_episode": round((rows_sum - prev_rows[1]) / episodes, 3) if episodes > 0 else None,
        "episodes": episodes,
        "outbox_episodes": stats.get("outbox_episodes", 0),
        "errors": {
            "http_errors_per_s": rate("http_errors"),
            "engine_errors_per_s": rate("engine_errors"),
            "turns_abandoned": stats.get("turns_abandoned", 0),
            "refusals": stats.get("refusals", {}),
            "protocol_errors": stats.get("protocol_errors", 0),
        },
        "workers": stats.get("workers", {}),
        "replicas": replicas,
        "sessions_moved": stats.get("sessions_moved", 0),
        "durable": stats.get("state_dir") is not None,
        "uptime_s": stats.get("uptime_s", 0.0),
        "paused": stats.get("generation_paused", ""),
        "paused_since": stats.get("generation_paused_since", 0.0),
        "turns_held": stats.get("generation_turns_held", 0),
    }


def _ms(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value * 1e3:.1f} ms"


def _paused(summary: Mapping[str, Any]) -> str:
    if not summary.get("paused"):
        return "generating"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(summary["paused_since"]))
    return f"PAUSED ({summary['paused']}) since {since}: {summary['turns_held']} turns held"


def render(summary: Mapping[str, Any], endpoint: str) -> str:
    """One screen of `summary`."""
    turns = summary["turns_per_s"]
    latency, engine, commit = summary["turn_seconds"], summary["engine_seconds"], summary["commit_seconds"]
    errors = summary["errors"]
    rows = summary["rows_per_episode"]
    lines = [
        f"rollout-gateway at {endpoint}: up {summary['uptime_s']:.0f} s, "
        f"{'durable' if summary['durable'] else 'in memory'}; over the last {summary['interval_s']:.1f} s",
        _paused(summary),
        "",
        f"sessions    {summary['sessions_open']} open, {summary['sessions_closing']} closing; "
        f"{summary['episodes']} finished (rows per episode {rows if rows is not None else '-'}), "
        f"{summary['outbox_episodes']} in the outbox",
        f"turns/s     {turns['committed']:.1f} committed, {turns['aborted']:.1f} aborted, {turns['replayed']:.1f} "
        f"replayed, {turns['refused']:.1f} refused, {turns['failed']:.1f} failed; {summary['turns_in_flight']} in "
        "flight",
        f"tokens/s    {summary['tokens_per_s']['prompt']:.0f} prompt, {summary['tokens_per_s']['output']:.0f} output",
        f"turn time   p50 {_ms(latency['p50'])}, p99 {_ms(latency['p99'])} (engine p50 {_ms(engine['p50'])}, "
        f"p99 {_ms(engine['p99'])}; commit p99 {_ms(commit['p99'])})",
        f"errors      {errors['http_errors_per_s']:.2f}/s HTTP, {errors['engine_errors_per_s']:.2f}/s engine; "
        f"{errors['turns_abandoned']} turns abandoned, {errors['protocol_errors']} bad frames, refusals "
        f"{errors['refusals'] or 'none'}",
        "",
        f"workers ({len(summary['workers'])})",
    ]
    for worker_id, worker in sorted(summary["workers"].items()):
        lines.append(
            f"  {worker_id:<40} pid {worker['pid'] or '?':<8} heartbeat {worker['heard_s_ago']:.1f} s ago, "
            f"{worker['turns_in_flight']} turns in flight"
        )
    replicas = summary["replicas"]
    lines.append(f"engine replicas ({len(replicas)}; {summary['sessions_moved']} sessions moved; errors since start)")
    for url, replica in sorted(replicas.items()):
        errors = ", ".join(f"{kind} {n:.0f}" for kind, n in sorted(replica["errors"].items())) or "no errors"
        routing = ""
        if "healthy" in replica:  # the broker routes over it
            health = "healthy" if replica["healthy"] else f"UNHEALTHY ({replica['last_error']})"
            routing = f"{health}, {replica['sessions']} sessions; "
        lines.append(f"  {url:<40} {routing}{errors}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout-gateway status", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--control",
        default=protocol.DEFAULT_CONTROL_ENDPOINT,
        metavar="ENDPOINT",
        help="the broker's control endpoint (default %(default)s)",
    )
    parser.add_argument(
        "--curve-keys",
        default=None,
        metavar="DIR",
        help="a key directory with broker.key and trainer.key_secret (default: "
        "$ROLLOUT_GATEWAY_CURVE_KEYS; none on loopback)",
    )
    parser.add_argument(
        "--interval", type=float, default=2.0, metavar="S", help="seconds between refreshes (default %(default)s)"
    )
    parser.add_argument("--json", action="store_true", help="print each refresh as one JSON object on a line")
    parser.add_argument("--once", action="store_true", help="print once (since the broker started) and exit")
    parser.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds to wait for the broker's answer (default %(default)s)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.interval > 0:
        raise SystemExit("rollout-gateway status: --interval must be > 0")
    try:
        client = TrainerClient(args.control, timeout=args.timeout, curve_keys=args.curve_keys)
    except ValueError as e:
        raise SystemExit(f"rollout-gateway status: {e}") from None
    previous: dict[str, Any] | None = None
    taken = 0.0
    screen = sys.stdout.isatty() and not args.json
    # Ctrl-C or SIGTERM ends the view between two refreshes: an interrupt inside a call would leave its socket
    # open, and closing the client would then wait for it.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.set())
    try:
        while not stop.is_set():
            try:
                stats, now = client.stats(), time.monotonic()
            except GatewayError as e:
                print(f"rollout-gateway status: the broker at {args.control} did not answer: {e}", file=sys.stderr,
                      flush=True)  # fmt: skip
                if args.once:
                    return 1
                stop.wait(args.interval)
                continue
            summary = summarize(stats, previous, now - taken)
            previous, taken = stats, now
            if args.json:
                print(json.dumps(summary, sort_keys=True), flush=True)
            else:
                print((_CLEAR if screen else "") + render(summary, args.control), flush=True)
            if args.once:
                return 0
            stop.wait(args.interval)
        return 0
    finally:
        client.close()

if __name__ == "__main__":
    sys.exit(main())
