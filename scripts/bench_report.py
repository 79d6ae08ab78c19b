"""Benchmark harness: turn bench_gateway.py's results.json into report.md and PNG plots.

Every number is a median over the repetitions of one point. Tables: idle latency (gateway-added
= gateway - direct) and CPU per turn, the same after a pause between turns, the concurrency
sweep, the offered-load point, CPU per turn at saturation, worker scaling (turns per gateway
CPU-second), broker ingest, feature runs with their capture check, long episodes (CPU and added
latency per turn near 24k and at 128k, ours in both history modes), and the performance targets
(docs/performance.md) as ours vs the reference. Plots need matplotlib (the `bench` extra).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

Run = dict[str, Any]


def write_results(path: str, result: dict[str, Any], table: str) -> None:
    """A benchmark's results as JSON at `path` and its table beside it (`.md`), and the table on stdout."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(table)
    print(table)
    print(f"wrote {out} and {out.with_suffix('.md')}", file=sys.stderr)


def _median(runs: list[Run], key: Callable[[Run], float | None]) -> float:
    values = [v for v in (key(r) for r in runs) if v is not None]
    return statistics.median(values) if values else float("nan")


def _group(runs: list[Run], scenario: str, *keys: str) -> dict[tuple[Any, ...], list[Run]]:
    out: dict[tuple[Any, ...], list[Run]] = defaultdict(list)
    for r in runs:
        if r["scenario"] == scenario:
            out[tuple(r["config"].get(k, r.get(k)) for k in keys)].append(r)
    return out


def _fmt(x: float, digits: int = 2) -> str:
    return "-" if x != x else f"{x:,.{digits}f}"  # NaN check


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _capture(runs: list[Run]) -> str:
    caps: list[dict[str, Any]] = [r["capture"] for r in runs if r.get("capture")]
    if not caps:
        return "-"
    ok = all(c["ok"] for c in caps)
    return f"{'ok' if ok else 'FAIL'} ({_fmt(statistics.fmean(c['rows_per_session'] or 0 for c in caps), 2)} rows/ep)"


def summarize(runs: list[Run]) -> dict[str, Any]:
    """The headline numbers, keyed for the tables and the targets."""
    s: dict[str, Any] = {
        "idle": {}, "paused": {}, "sweep": {}, "offered": {}, "saturated": {}, "workers": {}, "ingest": {},
    }  # fmt: skip
    for scenario in ("idle", "paused"):
        for (context, system), rs in _group(runs, scenario, "context_tokens", "system").items():
            s[scenario][(context, system)] = {
                "mean": _median(rs, lambda r: r["latency_ms"].get("mean")),
                "last": _median(rs, lambda r: r["per_turn_mean_ms"][-1]),
                "cpu": _median(rs, lambda r: r["gateway_cpu_ms_per_turn"]),
                "pause_ms": 1000 * rs[0]["config"].get("pause_s", 0.0),
                "n": len(rs),
                "capture": _capture(rs),
            }
    for (agents, system), rs in _group(runs, "sweep", "agents", "system").items():
        s["sweep"][(agents, system)] = {
            "tput": _median(rs, lambda r: r["turns_per_s"]),
            "p50": _median(rs, lambda r: r["latency_ms"].get("p50")),
            "p99": _median(rs, lambda r: r["latency_ms"].get("p99")),
            "cpu": _median(rs, lambda r: r["gateway_cpu_ms_per_turn"]),
            "eff": _median(rs, lambda r: r["turns_done"] / max(1e-9, r["cpu"]["gateway"]["cpu_s"])),
            "rss": _median(rs, lambda r: r["cpu"]["gateway"]["peak_rss_mb"]),
            "n": len(rs),
            "capture": _capture(rs),
        }
    for (system,), rs in _group(runs, "offered", "system").items():
        s["offered"][system] = {
            "rate": rs[0]["config"]["rate"],
            "p50": _median(rs, lambda r: r["latency_ms"]["p50"]),
            "p99": _median(rs, lambda r: r["latency_ms"]["p99"]),
            "n": len(rs),
        }
    for (context, system), rs in _group(runs, "saturated", "context_tokens", "system").items():
        s["saturated"][(context, system)] = {
            "cpu": _median(rs, lambda r: r["gateway_cpu_ms_per_turn"]),
            "broker": _median(rs, lambda r: _role_ms(r, "broker")),
            "workers": _median(rs, lambda r: _role_ms(r, "workers")),
            "tput": _median(rs, lambda r: r["turns_per_s"]),
            "agents": rs[0]["config"]["agents"],
            "n": len(rs),
        }
    for (system,), rs in _group(runs, "workers", "system").items():
        s["workers"][system] = {
            "tput": _median(rs, lambda r: r["turns_per_s"]),
            "eff": _median(rs, lambda r: r["turns_done"] / max(1e-9, r["cpu"]["gateway"]["cpu_s"])),
            "p99": _median(rs, lambda r: r["latency_ms"].get("p99")),
            "cpu_share": _median(rs, lambda r: r["cpu"]["gateway"]["cpu_s"] / max(1e-9, r["elapsed_s"])),
            "n": len(rs),
        }
    ingest = [r["ingest"] for r in runs if r["scenario"] == "ingest"]
    if ingest:
        s["ingest"] = {
            "sustainable": statistics.median(r["sustainable_commits_per_s"] for r in ingest),
            "wall": statistics.median(r["commits_per_s"] for r in ingest),
            "cpu_us": statistics.median(r["broker_cpu_us_per_commit"] for r in ingest),
            "main_us": statistics.median(r["main_thread_us_per_commit"] for r in ingest),
            "other_us": statistics.median(r["other_threads_us_per_commit"] for r in ingest),
            "echo_us": statistics.median(r["baseline_echo_cpu_us_per_msg"] for r in ingest),
            "n": len(ingest),
        }
    return s


def _role_ms(run: Run, role: str) -> float | None:
    stats = run["cpu"].get(f"gateway.{role}")
    return None if stats is None else 1000 * stats["cpu_s"] / max(1, run["turns_done"])


def _idle_table(points: dict[tuple[int, str], dict[str, Any]]) -> str:
    """Concurrency-1 latency per context and system; added = the system's mean minus direct's (same context)."""
    direct = {c: v["mean"] for (c, n), v in points.items() if n == "direct"}
    return _table(
        ["context", "system", "mean ms", "added ms", "last turn ms", "CPU ms/turn", "capture", "reps"],
        [
            [
                f"{c}",
                n,
                _fmt(v["mean"]),
                _fmt(v["mean"] - direct.get(c, float("nan"))),
                _fmt(v["last"]),
                _fmt(v["cpu"]),
                v["capture"],
                str(v["n"]),
            ]
            for (c, n), v in sorted(points.items())
        ],
    )


# Each target is stated as "a ratio measured side by side in one run", beside figures for the reference
# measured on another, faster machine. Where a target is an absolute number, its ratio is that number over the
# stated reference figure for the same quantity, and the report shows both readings.
ISSUE_REF_ADDED_MS = {4096: 4.4, 24576: 15.5}  # the reference's added latency (tree, mean), as stated
ISSUE_REF_CPU_MS = 4.8  # the reference's CPU per 4k turn (tree), as stated
ADDED_LIMIT_MS = {4096: 1.5, 24576: 3.0}
INGEST_TARGET = 20_000  # commits/s of 4k-token turns
# 20,000 commits/s against ~4.8 ms of reference CPU per turn: the broker ingests at least 96 turns
# in the CPU time the reference spends on one
INGEST_TURNS_PER_REF_TURN = INGEST_TARGET * ISSUE_REF_CPU_MS / 1000
WORKER_SCALING = 1.7  # 2 workers vs 1: throughput, or per core 1.7 / 2


def targets(s: dict[str, Any]) -> list[list[str]]:
    """The performance targets (docs/performance.md): (target, ours, reference, ratio, met?)."""
    rows = []
    idle, sat, sweep, offered = s["idle"], s["saturated"], s["sweep"], s["offered"]
    contexts = sorted({c for c, _ in idle})
    ours = next((n for _, n in sorted(idle) if n.startswith("ours")), "ours-1w")
    for c in contexts:
        direct = idle.get((c, "direct"), {}).get("mean", float("nan"))
        added = idle.get((c, ours), {}).get("mean", float("nan")) - direct
        ref_added = idle.get((c, "ref-tree"), {}).get("mean", float("nan")) - direct
        limit = ADDED_LIMIT_MS.get(c, float("nan"))
        bound = limit / ISSUE_REF_ADDED_MS.get(c, float("nan"))
        rows.append(
            [
                f"added latency, concurrency 1, {c // 1024}k (mean) <= {limit} ms "
                f"(the stated reference: {ISSUE_REF_ADDED_MS.get(c)} ms)",
                f"{_fmt(added)} ms",
                f"{_fmt(ref_added)} ms (tree)",
                _fmt(added / ref_added, 3) if ref_added else "-",
                _both(added / ref_added <= bound, bound, added <= limit),
            ]
        )
    for c, bound in ((4096, 1 / 4), (24576, 1 / 8)):
        cpu = _cpu(sat, idle, c, ours)
        ref = _cpu(sat, idle, c, "ref-tree")
        rows.append(
            [
                f"CPU per turn {c // 1024}k <= 1/{round(1 / bound)} of ref default (tree)",
                f"{_fmt(cpu)} ms",
                f"{_fmt(ref)} ms",
                _fmt(cpu / ref, 3),
                _met(cpu / ref <= bound),
            ]
        )
    # linear mode at its best: its lowest CPU per 4k turn of the run (at saturation or any point of the sweep),
    # against ours at that same point; the saturation pair beside it
    saturated = {n: v for (c, n), v in sat.items() if c == 4096}
    points = {(v["agents"], n): v["cpu"] for n, v in saturated.items()}
    points.update({(a, n): v["cpu"] for (a, n), v in sweep.items()})
    linear = {a: cpu for (a, n), cpu in points.items() if n == "ref-linear" and cpu == cpu}
    if linear:
        at = min(linear, key=linear.__getitem__)
        best, mine = linear[at], points.get((at, ours), float("nan"))
        a_sat = saturated.get(ours, {}).get("agents")
        mine_sat, linear_sat = points.get((a_sat, ours), float("nan")), linear.get(a_sat, float("nan"))
        at_sat = f"{a_sat} agents: {_fmt(mine_sat)} vs {_fmt(linear_sat)} ms, {_fmt(mine_sat / linear_sat, 3)}"
        rows.append(
            [
                "CPU per turn <= 1/3 of ref linear at its best (4k)",
                f"{_fmt(mine)} ms at {at} agents",
                f"{_fmt(best)} ms at {at} agents (linear's lowest in this run)",
                f"{_fmt(mine / best, 3)} ({at_sat})",
                _met(mine / best <= 1 / 3),
            ]
        )
    top = max((a for a, _ in sweep), default=None)
    if top is not None:
        p99, ref_p99 = (
            sweep.get((top, ours), {}).get("p99", float("nan")),
            sweep.get((top, "ref-tree"), {}).get("p99", float("nan")),
        )
        rows.append(
            [
                f"p99, {top} agents, 4k, engine 0 ms, closed loop <= 1/5 of ref",
                f"{_fmt(p99)} ms",
                f"{_fmt(ref_p99)} ms",
                _fmt(p99 / ref_p99, 3),
                _met(p99 / ref_p99 <= 0.2),
            ]
        )
    if offered:
        o, r = offered.get(ours, {}), offered.get("ref-tree", {})
        rate = o.get("rate", float("nan"))
        rows.append(
            [
                f"p99, {top} agents at {rate} turns/s offered <= 1/5 of ref",
                f"{_fmt(o.get('p99', float('nan')))} ms",
                f"{_fmt(r.get('p99', float('nan')))} ms",
                _fmt(o.get("p99", 0) / r.get("p99", float("nan")), 3),
                _met(o.get("p99", 0) / r.get("p99", float("nan")) <= 0.2),
            ]
        )
    one, two = s["workers"].get("ours-1w"), s["workers"].get("ours-2w")
    if one and two:
        per_core = WORKER_SCALING / 2
        rows.append(
            [
                f"2 workers vs 1 (64 agents, all cores): throughput >= {WORKER_SCALING}x, or per core >= {per_core}",
                f"{_fmt(two['tput'], 1)} vs {_fmt(one['tput'], 1)} turns/s",
                f"{_fmt(two['eff'], 1)} vs {_fmt(one['eff'], 1)} turns per gateway CPU-s",
                f"{_fmt(two['tput'] / one['tput'], 2)}x / {_fmt(two['eff'] / one['eff'], 2)} per core",
                f"per core {_met(two['eff'] / one['eff'] >= per_core)}; throughput "
                f"{_met(two['tput'] / one['tput'] >= WORKER_SCALING)} (the cores are shared with the load generator)",
            ]
        )
    ingest, ref = s["ingest"], _cpu(sat, idle, 4096, "ref-tree")
    if ingest:
        turns = ingest["sustainable"] * ref / 1000
        rows.append(
            [
                f"broker ingest >= {INGEST_TARGET:,} commits/s of 4k turns "
                f"(the stated reference: {ISSUE_REF_CPU_MS} ms CPU per 4k turn)",
                f"{_fmt(ingest['sustainable'], 0)} commits/s ({_fmt(ingest['cpu_us'], 1)} µs broker CPU per commit)",
                f"{_fmt(ref)} ms CPU per 4k turn (tree)",
                f"{_fmt(turns, 0)} commits per reference turn",
                _both(
                    turns >= INGEST_TURNS_PER_REF_TURN,
                    INGEST_TURNS_PER_REF_TURN,
                    ingest["sustainable"] >= INGEST_TARGET,
                ),
            ]
        )
    return rows


def _both(ratio_ok: bool, bound: float, absolute_ok: bool) -> str:
    """Met as a ratio (bound: the absolute target over the stated reference figure), and as the absolute figure."""
    return f"as a ratio {_met(ratio_ok)} (bound {_fmt(bound, 3)}); absolute {_met(absolute_ok)}"


def _cpu(sat: dict[Any, Any], idle: dict[Any, Any], context: int, system: str) -> float:
    value = sat.get((context, system), {}).get("cpu")
    return value if value is not None else idle.get((context, system), {}).get("cpu", float("nan"))


def _met(ok: bool) -> str:
    return "yes" if ok else "no"


def write(results: Path, out_dir: Path) -> None:
    data = json.loads(results.read_text())
    runs: list[Run] = data["runs"]
    for r in runs:
        r["config"]["system"] = r["system"]
    s = summarize(runs)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Gateway benchmark",
        "",
        f"`{' '.join(data['meta']['argv'])}` — finished {data['meta']['finished']}, "
        f"{data['meta']['cpus']} CPUs, gateways on cores {data['meta']['gateway_cores']}, engine + load "
        f"generator on {data['meta']['client_cores']}; load average during runs "
        f"{_fmt(statistics.fmean(r['load_avg_1m'] for r in runs), 1)} (median of repetitions everywhere).",
        "",
        "## Targets",
        "",
        _table(["target", "ours", "reference", "ratio", "met"], targets(s)),
        "",
        "## Idle latency and CPU per turn (concurrency 1)",
        "",
        _idle_table(s["idle"]),
    ]
    if s["paused"]:
        pause = next(iter(s["paused"].values()))["pause_ms"]
        lines += [
            "",
            f"## Latency after a pause (concurrency 1, the agent waits {pause:g} ms between turns)",
            "",
            "Each request finds the gateway idle, its processes asleep: the cost of waking them is in these times.",
            "",
            _idle_table(s["paused"]),
        ]
    lines += ["", "## Concurrency sweep (4k, engine 0 ms, closed loop)", ""]
    lines.append(
        _table(
            [
                "agents",
                "system",
                "turns/s",
                "p50 ms",
                "p99 ms",
                "CPU ms/turn",
                "turns/CPU-s",
                "peak RSS MB",
                "capture",
                "reps",
            ],
            [
                [
                    str(a),
                    n,
                    _fmt(v["tput"], 1),
                    _fmt(v["p50"]),
                    _fmt(v["p99"]),
                    _fmt(v["cpu"]),
                    _fmt(v["eff"], 1),
                    _fmt(v["rss"], 0),
                    v["capture"],
                    str(v["n"]),
                ]
                for (a, n), v in sorted(s["sweep"].items())
            ],
        )
    )
    if s["offered"]:
        lines += ["", "## One offered load (open loop)", ""]
        lines.append(
            _table(
                ["system", "offered turns/s", "p50 ms", "p99 ms", "reps"],
                [
                    [n, _fmt(v["rate"], 1), _fmt(v["p50"]), _fmt(v["p99"]), str(v["n"])]
                    for n, v in sorted(s["offered"].items())
                ],
            )
        )
    lines += ["", "## CPU per turn at saturation (8 agents)", ""]
    lines.append(
        _table(
            ["context", "system", "CPU ms/turn", "of which workers", "of which broker", "turns/s", "reps"],
            [
                [str(c), n, _fmt(v["cpu"]), _fmt(v["workers"]), _fmt(v["broker"]), _fmt(v["tput"], 1), str(v["n"])]
                for (c, n), v in sorted(s["saturated"].items())
            ],
        )
    )
    if s["workers"]:
        lines += ["", "## Worker scaling (64 agents, 4k, our gateway on all cores)", ""]
        lines.append(
            _table(
                ["system", "turns/s", "turns per gateway CPU-s", "gateway cores busy", "p99 ms", "reps"],
                [
                    [n, _fmt(v["tput"], 1), _fmt(v["eff"], 1), _fmt(v["cpu_share"], 2), _fmt(v["p99"]), str(v["n"])]
                    for n, v in sorted(s["workers"].items())
                ],
            )
        )
    if s["ingest"]:
        v = s["ingest"]
        lines += [
            "",
            "## Broker ingest (scripts/bench_broker.py's ingest, its defaults, all cores)",
            "",
            "Delta commits of ~4k-token turns from 4 publisher processes; the publishers share the cores, so the "
            "broker's CPU per commit gives the rate one busy core sustains.",
            "",
            _table(
                ["sustainable commits/s", "measured commits/s", "broker CPU µs/commit", "main thread",
                 "other threads", "zmq echo µs/msg", "reps"],
                [[_fmt(v["sustainable"], 0), _fmt(v["wall"], 0), _fmt(v["cpu_us"], 1), _fmt(v["main_us"], 1),
                  _fmt(v["other_us"], 1), _fmt(v["echo_us"], 1), str(v["n"])]],
            ),
        ]  # fmt: skip
    features = [r for r in runs if r["scenario"].startswith(("think", "no-echo"))]
    if features:
        lines += ["", "## Features (16 agents, 4k): dialects, streaming, <think>, agents that drop reasoning", ""]
        lines.append(
            _table(
                ["run", "system", "dialect", "stream", "turns/s", "mean ms", "p99 ms", "CPU ms/turn", "capture"],
                [
                    [
                        r["scenario"],
                        r["system"],
                        r["config"]["dialect"],
                        "yes" if r["config"]["stream"] else "no",
                        _fmt(r["turns_per_s"], 1),
                        _fmt(r["latency_ms"].get("mean", float("nan"))),
                        _fmt(r["latency_ms"].get("p99", float("nan"))),
                        _fmt(r["gateway_cpu_ms_per_turn"]),
                        _capture([r]),
                    ]
                    for r in features
                ],
            )
        )
    long_runs = [r for r in runs if r["scenario"] == "long"]
    if long_runs:
        config = long_runs[0]["config"]
        lines += [
            "",
            f"## Long episodes (1 agent, {config['turns']} turns up to {config['context_tokens']:,} tokens, "
            "reasoning stripped on echo)",
            "",
            "CPU per turn of the gateway's processes (read between the agent's turns) and latency added to the "
            "engine's (gateway - direct), at 24k and 128k on a least-squares line through every turn (all "
            "repetitions) against its prompt's size; the episode's mean CPU per turn is the median of repetitions.",
            "",
            _long_table(long_runs),
        ]
    errors = [e for r in runs for e in r.get("errors", [])]
    if errors:
        lines += ["", "## Errors", "", *[f"- {e}" for e in errors[:20]]]
    plots = _plots(s, out_dir)
    if plots:
        lines += ["", "## Plots", "", *[f"![{p.stem}]({p.name})" for p in plots]]
    (out_dir / "report.md").write_text("\n".join(lines) + "\n")


LONG_AT = (24576, 131072)  # the contexts the long-episode table reads CPU and latency at


def _long_table(runs: list[Run]) -> str:
    """Per system and history mode: CPU and added latency per turn near 24k and at the episode's end, read off a
    least-squares line through every turn of every repetition (one turn's CPU swings by a fifth on a shared box)."""

    def line(group: list[Run], key: str) -> Callable[[int], float]:
        pairs = [zip(r["per_turn_prompt_tokens"], r[key], strict=True) for r in group if r.get(key)]
        points = [(x, y) for turns in pairs for x, y in turns if y]
        if len(points) < 2:
            return lambda context: float("nan")
        slope, intercept = statistics.linear_regression([p[0] for p in points], [p[1] for p in points])
        return lambda context: intercept + slope * context

    groups: dict[str, list[Run]] = defaultdict(list)
    for r in runs:
        mode = r["config"].get("history_mode")
        groups[r["system"] + (f" ({mode})" if mode else "")].append(r)
    direct = line(groups.pop("direct", []), "per_turn_mean_ms")
    header = ["system", "rows/ep"]
    header += [f"CPU ms/turn at {c // 1024}k" for c in LONG_AT] + [f"{LONG_AT[1] // 1024}k / {LONG_AT[0] // 1024}k"]
    header += [f"added ms at {c // 1024}k" for c in LONG_AT] + ["CPU ms/turn, episode", "capture"]
    rows = []
    for name, group in groups.items():
        cpu, latency = line(group, "per_turn_cpu_ms"), line(group, "per_turn_mean_ms")
        caps = [r["capture"] for r in group if r.get("capture")]
        rows_per_episode = statistics.fmean(c["rows_per_session"] or 0 for c in caps) if caps else float("nan")
        rows.append(
            [name, _fmt(rows_per_episode, 1), *(_fmt(cpu(c)) for c in LONG_AT), _fmt(cpu(LONG_AT[1]) / cpu(LONG_AT[0])),
             *(_fmt(latency(c) - direct(c)) for c in LONG_AT),
             _fmt(_median(group, lambda r: r["gateway_cpu_ms_per_turn"])), _capture(group)]
        )  # fmt: skip
    return _table(header, rows)


def _plots(s: dict[str, Any], out_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    sweep = s["sweep"]
    systems = sorted({n for _, n in sweep})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for n in systems:
        points = sorted((a, v) for (a, m), v in sweep.items() if m == n)
        xs = [a for a, _ in points]
        ax1.plot(xs, [v["tput"] for _, v in points], marker="o", label=n)
        line = ax2.plot(xs, [v["p50"] for _, v in points], marker="o", label=f"{n} p50")[0]
        ax2.plot(
            xs, [v["p99"] for _, v in points], marker="x", linestyle="--", color=line.get_color(), label=f"{n} p99"
        )
    for ax, title, ylabel in (
        (ax1, "throughput vs concurrency (4k)", "turns/s"),
        (ax2, "latency vs concurrency (4k)", "ms"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent agents")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    ax2.set_yscale("log")
    fig.tight_layout()
    first = out_dir / "concurrency.png"
    fig.savefig(first, dpi=110)
    plt.close(fig)
    workers = sorted({int(n.split("-")[1][:-1]) for n in systems if n.startswith("ours-")})
    if len(workers) < 2:
        return [first]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.5))
    for agents in sorted({a for a, _ in sweep}):
        vals = [sweep.get((agents, f"ours-{w}w")) for w in workers]
        if all(vals):
            ax1.plot(workers, [v["tput"] for v in vals], marker="o", label=f"{agents} agents")
            ax2.plot(workers, [v["p99"] for v in vals], marker="o", label=f"{agents} agents")
    scaling = s["workers"]
    names = [f"ours-{w}w" for w in workers if f"ours-{w}w" in scaling]
    if names:
        ax3.bar([n + "\nturns/s" for n in names], [scaling[n]["tput"] for n in names], color="tab:blue")
        ax3.bar([n + "\nturns/CPU-s" for n in names], [scaling[n]["eff"] for n in names], color="tab:gray")
    for ax, title, ylabel in (
        (ax1, "throughput vs workers (4k, gateway cores only)", "turns/s"),
        (ax2, "p99 vs workers (4k, gateway cores only)", "ms"),
    ):
        ax.set_xticks(workers)
        ax.set_xlabel("uvicorn workers")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    ax3.set_title("64 agents, gateway on all cores")
    ax3.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    second = out_dir / "workers.png"
    fig.savefig(second, dpi=110)
    plt.close(fig)
    return [first, second]
