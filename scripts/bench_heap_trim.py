"""Heap trim benchmark: how long the broker's `malloc_trim(0)` pauses its loop at a given heap size.

For each --heap-gib, a fresh child process holds that much RSS of sessions in a real
`SessionRegistry` (in-process, no sockets: this isolates the trim) in steady state: 50-turn
sessions growing to 32k tokens, staggered so every age is present, each committing one turn a
tick (deltas, as workers send them), finished at their last turn and replaced, the broker's
compaction run to completion after each tick (age 0). After each tick, once the live set is
full and every age present, it times one trim (the bytes a whole tick freed: more than a real
broker frees between two trims, so an upper bound) and then a second one at once (nothing freed:
the cost of walking the heap alone). Prints median and max pauses and what the trims gave back.
Takes minutes at 4 GiB (building the heap is the broker's real commit and compaction work).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_broker import as_sent, commit_of, episode  # noqa: E402

from broker.config import BrokerConfig  # noqa: E402
from broker.sessions.heap_trim import glibc_malloc_trim, rss_bytes  # noqa: E402
from broker.sessions.registry import SessionRegistry  # noqa: E402
from gateway_workers.capture.commit_bases import CommitBases  # noqa: E402

GIB = 2**30
MIB = 2**20
# RSS per live session at steady state (ages uniform over 50 turns of a 32k-token episode, compacted),
# measured here: sizes the live set for a --heap-gib target (the output reports the RSS actually held).
BYTES_PER_LIVE_SESSION = 124_000
CHILD_TIMEOUT_S = 3_600.0


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One heap size, in this (fresh) process."""
    trim = glibc_malloc_trim()
    if trim is None:
        raise SystemExit("no malloc_trim in this C library: nothing to measure")
    n = args.turns
    tail = (args.context - args.first_prompt - n * args.output) // (n - 1)
    templates = []  # a few distinct episodes, as each session's commits (deltas against its previous turn)
    for t in range(args.templates):
        bases = CommitBases()
        turns = episode(t, n, args.first_prompt, tail, args.output)
        templates.append([as_sent(bases, commit_of(k, "x", f"t{k}", turn)) for k, turn in enumerate(turns)])
        del turns
    live_target = args.sessions or max(n, round(args.heap_gib * GIB / BYTES_PER_LIVE_SESSION))
    per_tick = math.ceil(live_target / n)  # opened (and, once the first reach their last turn, finished) per tick
    config = BrokerConfig()
    reg = SessionRegistry(
        max_sessions=2 * live_target, compact=True, compact_min_bytes=config.compact_min_bytes, compact_age_s=0.0
    )
    trim()
    base = rss_bytes() or 0
    live: dict[str, int] = {}  # sid -> its next turn
    opened = tick = 0
    pauses: list[float] = []
    repeats: list[float] = []
    released: list[int] = []
    t0 = time.monotonic()
    while len(pauses) < args.trims:
        for _ in range(per_tick):
            sid = f"s{opened}"
            opened += 1
            reg.open_session(sid, {}, None, None, {})
            live[sid] = 0
        for sid, k in list(live.items()):
            reg.open_turn(sid, f"t{k}")
            reg.commit_turn(dataclasses.replace(templates[int(sid[1:]) % len(templates)][k], session_id=sid))
            if k + 1 == n:
                reg.close(sid)
                reg.finish(sid)
                del live[sid]
            else:
                live[sid] = k + 1
        while reg.compact_step():
            pass
        tick += 1
        if tick <= n:  # not yet every age present: no finishes yet, the heap still growing
            continue
        before = rss_bytes() or 0
        p0 = time.perf_counter()
        trim()
        pauses.append(time.perf_counter() - p0)
        after = rss_bytes() or 0
        released.append(before - after)
        p0 = time.perf_counter()
        trim()
        repeats.append(time.perf_counter() - p0)
        print(
            f"  heap {args.heap_gib:g} GiB, tick {tick}: RSS {(after - base) / GIB:.2f} GiB, {len(live)} live, "
            f"trim {1e3 * pauses[-1]:.2f} ms gave back {released[-1] / MIB:.1f} MiB, again {1e3 * repeats[-1]:.2f} ms",
            file=sys.stderr,
            flush=True,
        )
    return {
        "heap_gib_target": args.heap_gib,
        "rss_held_gib": ((rss_bytes() or 0) - base) / GIB,
        "live_sessions": len(live),
        "trim_pause_ms_median": 1e3 * statistics.median(pauses),
        "trim_pause_ms_max": 1e3 * max(pauses),
        "repeat_trim_pause_ms_median": 1e3 * statistics.median(repeats),
        "released_mib_per_trim_median": statistics.median(released) / MIB,
        "freed_mib_per_tick": reg.counters["bytes_freed"] / tick / MIB,
        "build_s": time.monotonic() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heap-gib", type=float, action="append", help="RSS of sessions to hold (repeat; default 1 and 4)")
    p.add_argument("--sessions", type=int, default=0, help="live sessions (default: sized from --heap-gib)")
    p.add_argument("--trims", type=int, default=9, help="timed trims per heap size (one per tick)")
    p.add_argument("--templates", type=int, default=4, help="distinct synthetic episodes")
    p.add_argument("--turns", type=int, default=50)
    p.add_argument("--context", type=int, default=32_768)
    p.add_argument("--first-prompt", type=int, default=2_000)
    p.add_argument("--output", type=int, default=100)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = p.parse_args(argv)
    if args.child:
        args.heap_gib = args.heap_gib[0]
        print(json.dumps(child(args)))
        return 0
    report = []
    for gib in args.heap_gib or [1.0, 4.0]:
        # a fresh process per size: the allocator's state from a smaller heap would shape the next
        cmd = [sys.executable, __file__, "--child", "--heap-gib", str(gib), "--trims", str(args.trims)]
        cmd += ["--sessions", str(args.sessions), "--templates", str(args.templates), "--turns", str(args.turns)]
        cmd += ["--context", str(args.context), "--first-prompt", str(args.first_prompt), "--output", str(args.output)]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True, timeout=CHILD_TIMEOUT_S)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        report.append(result)
        if not args.json:
            print(", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
