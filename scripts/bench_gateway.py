"""Side-by-side benchmark: our gateway vs the reference gateway (tree, linear) vs the engine alone.

Starts scripts/bench_engine.py (a fake vLLM engine), `rollout-gateway serve` (1 and 2 workers),
the reference (scripts/reference_gateway.py, in its own venv, both history modes), pins the
gateways to `--gateway-cores` and the engine + load generator to `--client-cores`, and runs the
load generator against all of them, interleaved, `--reps` times per point: idle latency at
concurrency 1 (4k/24k; gateway-added = gateway - direct), in a closed loop and with the agent
pausing `--pause-ms` between turns (every request then finds the gateway asleep), CPU per turn,
a concurrency sweep (throughput, p50/p99; closed loop and at one offered load), worker scaling,
feature runs (dialects, streaming, <think> or not, agents that drop reasoning), long episodes
(one agent, 40 turns up to a 128k context, the shape of coding agents: CPU and added latency per
turn as the context grows, ours in tree and linear history), and scripts/bench_broker.py's broker
ingest, so the report sets it against the reference measured in the same run. Every gateway run
ends with the capture check. Writes results.json, report.md and PNG plots to --out-dir.

    python scripts/bench_gateway.py --out-dir bench-results            # the full suite (~15-25 min)
    python scripts/bench_gateway.py --quick --out-dir /tmp/bench       # a smoke run
    python scripts/bench_gateway.py --scenarios long --workers 1 --out-dir /tmp/long   # long episodes only
    python scripts/bench_gateway.py --report-only bench-results/results.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import statistics
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "tests")]

import bench_report  # noqa: E402
import loadgen  # noqa: E402
import reference_gateway  # noqa: E402
from bench_procs import Sampler, Service, pin, pin_tree, thread_cpu  # noqa: E402

ENGINE_READY = r"BENCH ENGINE READY (\S+)"
REFERENCE_READY = r"REFERENCE READY base_url=(\S+) control=(\S+)"


@dataclass
class System:
    """One thing the load generator can drive, with the processes whose CPU counts as its own."""

    name: str
    target: Any  # a loadgen.Target
    pids: Callable[[], set[int]]
    dialects: tuple[str, ...] = ("chat", "messages", "responses")
    roles: dict[str, str] = field(default_factory=dict)  # sub-group name -> cmdline marker (CPU by role)
    root: int | None = None  # process tree root, for re-pinning
    workers: int = 1  # processes that share the agents' connections (each must be warmed up)


def _role_pids(pids: Callable[[], set[int]], marker: str) -> Callable[[], set[int]]:
    def select() -> set[int]:
        out = set()
        for pid in pids():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        out.add(pid)
            except OSError:
                continue
        return out

    return select


@dataclass
class Bench:
    args: argparse.Namespace
    tokenizer_dir: str
    engine: Service
    engine_url: str
    systems: dict[str, System] = field(default_factory=dict)
    runs: list[dict[str, Any]] = field(default_factory=list)
    counter: int = 0

    def configure_engine(self, **config: Any) -> None:
        body = json.dumps(config).encode()
        request = urllib.request.Request(self.engine_url + "/_bench/config", data=body, method="POST")
        urllib.request.urlopen(request, timeout=10).close()

    def reset_engine(self) -> None:
        request = urllib.request.Request(self.engine_url + "/_bench/reset", data=b"{}", method="POST")
        urllib.request.urlopen(request, timeout=10).close()

    def run(
        self,
        scenario: str,
        system: str,
        rep: int,
        cores: set[int] | None = None,
        per_turn_cpu: bool = False,
        **cfg: Any,
    ) -> dict[str, Any]:
        """One load run against one system, with CPU/RSS sampling; appended to `runs`.

        `cores` re-pins the system's process tree for this run only (worker scaling). `per_turn_cpu` (one agent)
        also records the system's CPU per turn, read as each reply arrives (`per_turn_cpu_ms`).
        """
        sys_ = self.systems[system]
        if cores is not None and sys_.root is not None:
            pin_tree(sys_.root, cores)
            try:
                return self.run(scenario, system, rep, per_turn_cpu=per_turn_cpu, **cfg)
            finally:
                pin_tree(sys_.root, globals()["cores"](self.args.gateway_cores))
        self.counter += 1
        config = loadgen.LoadConfig(
            progress=not self.args.no_progress,
            run_id=f"{time.time()}-{self.counter}",
            tool_text=self.args.tool_text,
            **cfg,
        )
        self.reset_engine()
        groups = {"gateway": sys_.pids, "engine": self.engine.pids, "loadgen": lambda: {os.getpid()}}
        groups.update({f"gateway.{role}": _role_pids(sys_.pids, marker) for role, marker in sys_.roles.items()})
        load_before = os.getloadavg()[0]
        marks: list[float] = []

        def mark(turn: int = -1) -> None:
            marks.append(sum(sum(thread_cpu(pid).values()) for pid in sys_.pids()))

        if per_turn_cpu:
            assert config.agents == 1, "CPU per turn is read between one agent's turns"
            mark()
        sampler = Sampler(groups).start()
        engine_url = None if system == "direct" else self.engine_url
        result = asyncio.run(loadgen.run_load(sys_.target, config, engine_url, mark if per_turn_cpu else None))
        stats = sampler.stop()
        turns = max(1, result["turns_done"])
        result.update(
            {
                "scenario": scenario,
                "system": system,
                "rep": rep,
                "load_avg_1m": round(load_before, 2),
                "cpu": {name: vars(s) for name, s in stats.items()},
                "gateway_cpu_ms_per_turn": round(1000 * stats["gateway"].cpu_s / turns, 3),
            }
        )
        if per_turn_cpu:
            result["per_turn_cpu_ms"] = [round(1000 * (b - a), 3) for a, b in zip(marks, marks[1:], strict=False)]
        self.runs.append(result)
        capture = result.get("capture", {})
        print(
            f"  {scenario:>9} {system + ('+' + config.history_mode if config.history_mode else ''):<11} rep {rep} "
            f"c={config.agents:<4} ctx={config.context_tokens:<6} "
            f"{config.dialect}{'/stream' if config.stream else ''}: {result['turns_per_s']:8.1f} turns/s  "
            f"mean {result['latency_ms'].get('mean', float('nan')):8.2f} ms  "
            f"p99 {result['latency_ms'].get('p99', float('nan')):8.2f} ms  "
            f"cpu/turn {result['gateway_cpu_ms_per_turn']:7.2f} ms  "
            f"capture {'ok' if capture.get('ok') else capture.get('problems', '-') if capture else '-'}",
            file=sys.stderr,
            flush=True,
        )
        return result

    def save(self) -> None:
        out = Path(self.args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        meta = {
            "argv": sys.argv,
            "cpus": os.cpu_count(),
            "gateway_cores": self.args.gateway_cores,
            "client_cores": self.args.client_cores,
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        (out / "results.json").write_text(json.dumps({"meta": meta, "runs": self.runs}, indent=1))


def cores(spec: str) -> set[int]:
    return {int(c) for c in spec.split(",") if c}


@contextlib.contextmanager
def start_systems(args: argparse.Namespace, tokenizer_dir: str, engine_url: str) -> Iterator[dict[str, System]]:
    from trainer_client import launch_gateway

    gateway_cores = cores(args.gateway_cores)
    systems: dict[str, System] = {
        "direct": System("direct", loadgen.DirectTarget(engine_url, tokenizer_dir), lambda: set(), dialects=("chat",)),
    }
    with contextlib.ExitStack() as stack:
        for workers in sorted({int(w) for w in args.workers.split(",")}):
            gw = stack.enter_context(
                launch_gateway(
                    workers=workers,
                    engine_kind="vllm",
                    engine_urls=[engine_url],
                    tokenizer=tokenizer_dir,
                    extra_args=["--log-level", "warning"],
                )
            )
            pin_tree(gw.process.pid, gateway_cores)
            root = gw.process.pid
            systems[f"ours-{workers}w"] = System(
                f"ours-{workers}w",
                loadgen.OursTarget(gw.base_url, gw.client),
                functools.partial(_tree, root),
                root=root,
                roles={"broker": "-m\0broker", "workers": "multiprocessing.spawn"},
                workers=workers,
            )
        if not args.no_reference:
            python = reference_gateway.ensure_venv(Path(args.ref_venv))
            for mode in ("tree", "linear"):
                ref = Service(
                    f"ref-{mode}",
                    [
                        str(python),
                        str(HERE / "reference_gateway.py"),
                        "serve",
                        "--tokenizer",
                        tokenizer_dir,
                        "--engine-url",
                        engine_url,
                        "--history-mode",
                        mode,
                        "--adapters",
                        "openai,anthropic",
                    ],
                    REFERENCE_READY,
                    cores=gateway_cores,
                )
                stack.callback(ref.stop)
                match = ref.wait_ready()
                systems[f"ref-{mode}"] = System(
                    f"ref-{mode}",
                    loadgen.ReferenceTarget(match.group(1), match.group(2), f"ref-{mode}"),
                    ref.pids,
                    dialects=("chat", "messages"),
                )
        yield systems
        for system in systems.values():
            asyncio.run(system.target.close())


def _tree(root: int) -> set[int]:
    from bench_procs import children

    return children(root)


def median_of(runs: list[dict[str, Any]], key: Callable[[dict[str, Any]], float]) -> float:
    values = [key(r) for r in runs]
    return statistics.median(values) if values else float("nan")


def warm_up(bench: Bench) -> None:
    """A short unrecorded run per system and dialect: lazy imports and loads (the broker's tokenizer on the
    first finish), compiled templates, pooled connections, and each worker's start-up checks of its twins
    (`twins.checks.VERIFY_FIRST` uses each, compared with the slow originals). Agents land on workers by
    the kernel's accept race, so each worker gets several agents' turns: past the checks with room to spare."""
    for name, system in bench.systems.items():
        engine = None if name == "direct" else bench.engine_url
        for dialect in system.dialects:
            config = loadgen.LoadConfig(
                agents=4 * system.workers,
                turns=8,
                context_tokens=2048,
                progress=False,
                dialect=dialect,
                tool_text=bench.args.tool_text,
                run_id=f"warm-{name}-{dialect}-{time.time()}",
            )
            asyncio.run(loadgen.run_load(system.target, config, engine))


SCENARIOS = ("idle", "paused", "sweep", "offered", "workers", "saturated", "features", "long", "ingest")


def suite(bench: Bench) -> None:
    args = bench.args
    wanted = set(args.scenarios.split(","))
    if wanted - set(SCENARIOS):
        raise SystemExit(f"unknown scenarios: {sorted(wanted - set(SCENARIOS))}")
    warm_up(bench)
    contexts = [int(c) for c in args.contexts.split(",")]
    concurrency = [int(c) for c in args.concurrency.split(",")]
    if "idle" in wanted:
        idle(bench, contexts)
    if "paused" in wanted:
        idle(bench, contexts, args.pause_ms)
    if "sweep" in wanted:
        sweep(bench, contexts, concurrency)
    if "offered" in wanted:
        offered(bench, contexts, concurrency)
    if "workers" in wanted:
        worker_scaling(bench, contexts)
    if "saturated" in wanted:
        saturated(bench, contexts)
    if "features" in wanted:
        features(bench, contexts)
    if "long" in wanted:
        long_episodes(bench)
    if "ingest" in wanted:
        ingest(bench)


def idle(bench: Bench, contexts: list[int], pause_ms: float = 0.0) -> None:
    """Concurrency 1: latency and CPU per turn. With `pause_ms` (the "paused" scenario) the agent waits that
    long between turns, as while its tool runs: each request finds the gateway's processes asleep."""
    args, reps = bench.args, bench.args.reps
    ours, refs = _systems(bench)
    scenario = "paused" if pause_ms else "idle"
    after = f" after a {pause_ms:g} ms pause" if pause_ms else ""
    print(f"== {scenario}: latency{after} and CPU per turn (concurrency 1, {args.turns} turns)", file=sys.stderr)
    for context in contexts:
        for rep in range(reps):
            for system in ["direct", ours[0], *refs]:
                bench.run(
                    scenario, system, rep, agents=1, turns=args.turns, context_tokens=context,
                    episodes=args.idle_episodes, pause_s=pause_ms / 1000,
                )  # fmt: skip


def sweep(bench: Bench, contexts: list[int], concurrency: list[int]) -> None:
    args, reps = bench.args, bench.args.reps
    ours, refs = _systems(bench)
    print("== concurrency sweep (4k context, engine 0 ms, closed loop)", file=sys.stderr)
    for agents in concurrency:
        for rep in range(reps if agents == max(concurrency) or not args.quick else 1):
            for system in [*ours, *refs]:
                bench.run("sweep", system, rep, agents=agents, turns=args.turns, context_tokens=contexts[0])


def offered(bench: Bench, contexts: list[int], concurrency: list[int]) -> None:
    """Every system at 80% of ref-tree's closed-loop rate at the top concurrency (from this run's sweep)."""
    args, reps = bench.args, bench.args.reps
    ours, refs = _systems(bench)
    one = ours[0]
    top = max(concurrency)
    ref_tput = [
        r["turns_per_s"]
        for r in bench.runs
        if r["scenario"] == "sweep" and r["system"] == "ref-tree" and r["config"]["agents"] == top
    ]
    if ref_tput:
        rate = round(0.8 * statistics.median(ref_tput), 1)
        print(
            f"== {top} agents at one offered load: {rate} turns/s (80% of ref-tree's closed-loop rate)", file=sys.stderr
        )
        for rep in range(reps):
            for system in [one, *refs]:
                bench.run(
                    "offered",
                    system,
                    rep,
                    agents=top,
                    turns=max(2, args.turns // 2),
                    context_tokens=contexts[0],
                    rate=rate,
                )


def worker_scaling(bench: Bench, contexts: list[int]) -> None:
    args, reps = bench.args, bench.args.reps
    ours, refs = _systems(bench)
    if len(ours) > 1:
        everything = set(range(os.cpu_count() or 1))
        print(
            f"== worker scaling: our gateway on all cores {sorted(everything)} (shared with the load generator "
            "and engine), 64 agents",
            file=sys.stderr,
        )
        # the noisiest scenario here (it shares the cores with the load generator): at least 5 repetitions
        for rep in range(max(reps, 5)):
            for system in ours:
                bench.run(
                    "workers", system, rep, cores=everything, agents=64, turns=args.turns, context_tokens=contexts[0]
                )


def saturated(bench: Bench, contexts: list[int]) -> None:
    args, reps = bench.args, bench.args.reps
    ours, refs = _systems(bench)
    print("== CPU per turn at saturation (concurrency 8)", file=sys.stderr)
    for context in contexts:
        for rep in range(reps):
            for system in [*ours, *refs]:
                bench.run(
                    "saturated",
                    system,
                    rep,
                    agents=8,
                    turns=args.turns,
                    context_tokens=context,
                    episodes=args.idle_episodes,
                )


def features(bench: Bench, contexts: list[int]) -> None:
    args = bench.args
    ours, refs = _systems(bench)
    one = ours[0]
    print("== features: dialects, streaming, <think> or not, agents that drop reasoning", file=sys.stderr)
    for think in (True, False):
        bench.configure_engine(think=think)
        for system in [one, *refs]:
            for dialect in bench.systems[system].dialects:
                for stream in (False, True):
                    bench.run(
                        f"think={int(think)}",
                        system,
                        0,
                        agents=16,
                        turns=args.turns,
                        context_tokens=contexts[0],
                        dialect=dialect,
                        stream=stream,
                    )
    bench.configure_engine(think=True)
    for system in [one, *refs]:
        bench.run("no-echo", system, 0, agents=16, turns=args.turns, context_tokens=contexts[0], echo_reasoning=False)


def ingest(bench: Bench) -> None:
    """scripts/bench_broker.py's ingest (its defaults; its own broker and publishers, on all cores) in this run,
    so the report can set it against the reference's CPU per turn measured beside it."""
    import bench_broker

    args = bench_broker.parse_args([])
    mine = os.sched_getaffinity(0)
    print("== broker ingest (bench_broker.py's, all cores)", file=sys.stderr)
    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))  # its broker and publishers inherit this
    try:
        for rep in range(bench.args.reps):
            load = round(os.getloadavg()[0], 2)
            result = bench_broker.bench_ingest(args)
            bench.runs.append(
                {
                    "scenario": "ingest",
                    "system": "broker",
                    "rep": rep,
                    "config": {},
                    "load_avg_1m": load,
                    "ingest": result,
                }
            )
            print(
                f"     ingest broker      rep {rep}: {result['sustainable_commits_per_s']:8.0f} commits/s sustainable "
                f"({result['broker_cpu_us_per_commit']:.1f} µs/commit), {result['commits_per_s']:8.0f} measured",
                file=sys.stderr,
                flush=True,
            )
    finally:
        os.sched_setaffinity(0, mine)


def long_episodes(bench: Bench) -> None:
    """One agent at a time runs `--long-turns` turns up to `--long-context` tokens, stripping its replies'
    reasoning on echo (as most agent frameworks do; the Qwen3 template then re-renders each reply differently):
    CPU and latency per turn as the context grows, ours in both history modes, the reference in both of its."""
    args = bench.args
    ours, refs = _systems(bench)
    runs = [("direct", ""), (ours[0], "tree"), (ours[0], "linear"), *((ref, "") for ref in refs)]
    print(f"== long episodes: {args.long_turns} turns up to {args.long_context} tokens, 1 agent", file=sys.stderr)
    for rep in range(args.reps):
        for system, mode in runs:
            bench.run(
                "long", system, rep, per_turn_cpu=system != "direct", agents=1, turns=args.long_turns,
                context_tokens=args.long_context, echo_reasoning=False, history_mode=mode,
            )  # fmt: skip


def _systems(bench: Bench) -> tuple[list[str], list[str]]:
    """(our gateways, the reference's modes) in this run."""
    names = list(bench.systems)
    return [n for n in names if n.startswith("ours")], [n for n in names if n.startswith("ref")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default="bench-results")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--contexts", default="4096,24576")
    p.add_argument("--concurrency", default="1,4,16,64,256")
    p.add_argument("--idle-episodes", type=int, default=3, help="episodes per agent in the idle/saturated runs")
    p.add_argument("--pause-ms", type=float, default=20.0, help="the agent's pause between turns (paused scenario)")
    p.add_argument("--long-turns", type=int, default=40, help="turns of a long episode (long scenario)")
    p.add_argument("--long-context", type=int, default=131072, help="a long episode's last prompt, in tokens")
    p.add_argument("--workers", default="1,2", help="our gateway's worker counts to run")
    p.add_argument("--gateway-cores", default="0", help="cores for the gateways under test")
    p.add_argument("--client-cores", default="1", help="cores for the engine and the load generator")
    p.add_argument("--no-reference", action="store_true", help="skip the reference gateway")
    p.add_argument("--ref-venv", default=str(reference_gateway.DEFAULT_VENV))
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 rep, small sweep")
    p.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"which parts of the suite to run (comma-separated; default all): {', '.join(SCENARIOS)}",
    )
    p.add_argument(
        "--tool-text", choices=loadgen.TOOL_TEXTS, default="prose",
        help="tool results: one-token words (prose) or JSON, code and prose (mixed); scripts/agent_text.py",
    )  # fmt: skip
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--report-only", help="rebuild report.md and plots from this results.json")
    args = p.parse_args()
    if args.report_only:
        bench_report.write(Path(args.report_only), Path(args.out_dir))
        return
    if args.quick:
        args.reps, args.concurrency, args.turns, args.idle_episodes = 1, "1,16,64", 4, 1
    from assets import trl_qwen3_template_path

    from gateway_workers.rendering.tokenizer import prepare_tokenizer_dir

    tokenizer_dir = prepare_tokenizer_dir(None, chat_template_path=str(trl_qwen3_template_path()))
    loadgen.use_vocabulary(tokenizer_dir)
    client_cores = cores(args.client_cores)
    engine = Service(
        "engine",
        [sys.executable, str(HERE / "bench_engine.py"), "--tokenizer", tokenizer_dir],
        ENGINE_READY,
        cores=client_cores,
    )
    try:
        engine_url = engine.wait_ready().group(1)
        with start_systems(args, tokenizer_dir, engine_url) as systems:
            pin(os.getpid(), client_cores)
            bench = Bench(args, tokenizer_dir, engine, engine_url, systems)
            try:
                suite(bench)
            finally:
                bench.save()
    finally:
        engine.stop()
    bench_report.write(Path(args.out_dir) / "results.json", Path(args.out_dir))
    print(f"wrote {args.out_dir}/results.json, report.md and plots", file=sys.stderr)


if __name__ == "__main__":
    main()
