"""CPU instructions per turn of one gateway process, counted by callgrind: a yardstick that ignores machine load.

For each --source (a checkout; default this repo) it starts a broker (`python -m broker`) and one worker
(the uvicorn app factory, as `rollout-gateway` runs it) from that checkout, with the process under test
under `valgrind --tool=callgrind --instr-atstart=no`, against scripts/bench_engine.py. Per context it runs
one unmeasured warm-up pass of scripts/loadgen.py, then --reps measured passes (instrumentation on and
counters zeroed before each, a dump after), interleaving the sources, and checks capture after every pass.
Prints M instructions per turn (total instructions / turns) per process, context and source, and with
several sources the ratio to the first: that is how a change is judged (`git worktree add /tmp/old REV`).

    python scripts/bench_instructions.py --process both --contexts 4096 24576 --reps 2
    python scripts/bench_instructions.py --process worker --source /tmp/old . --out cg.json
    python scripts/bench_instructions.py --process worker --contexts 24576 --history-mode tree linear
    python scripts/bench_instructions.py --process broker --contexts 4096 --history-mode tree linear --no-think
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO), str(REPO / "tests")]

import loadgen  # noqa: E402
from bench_procs import Service, wait_http  # noqa: E402

PROCESSES = ("worker", "broker")
ENGINE_READY = r"BENCH ENGINE READY (\S+)"
BROKER_READY = r"BROKER READY worker=(\S+) control=(\S+)"
WORKER_READY = r"WORKER READY (\S+) (\S+)"
PLAIN_READY_TIMEOUT_S = 180.0
VALGRIND_READY_TIMEOUT_S = 900.0  # imports under valgrind take minutes on a loaded 2-core box
PASS_TIMEOUT_S = 1800.0  # one loadgen pass with a process under callgrind (24k: ~1-3 min measured)
CONTROL_TIMEOUT_S = 120.0  # one callgrind_control command (vgdb waits for the guest to reach a safe point)
DUMP_TIMEOUT_S = 60.0
SETTLE_S = 2.0  # after a pass, before the dump: the broker's finish and idle work land in the count
ENGINE_CALL_TIMEOUT_S = 10.0

# Runs inside the checkout under test (cwd and PYTHONPATH): builds that checkout's WorkerConfig, binds port 0,
# and serves one worker the way `rollout-gateway serve` does (app factory reading the config from the env).
_WORKER_PROGRAM = """
import dataclasses, os, sys, uvicorn, gateway_workers
from gateway_workers.config import WorkerConfig
from gateway_workers.engines.config import EngineConfig
broker, engine_url, tokenizer = sys.argv[1:4]
engine = dataclasses.replace(EngineConfig(), kind="vllm", urls=(engine_url,))
config = WorkerConfig(broker_endpoint=broker, engine=engine, tokenizer=tokenizer, log_level="warning")
os.environ.update(config.to_env())
uv = uvicorn.Config("gateway_workers.app:create_app_from_env", factory=True, host="127.0.0.1", port=0,
                    loop="uvloop", http="httptools", log_level="warning", access_log=False,
                    timeout_graceful_shutdown=5)
sock = uv.bind_socket()
host, port = sock.getsockname()[:2]
print(f"WORKER READY http://{host}:{port} {gateway_workers.__file__}", flush=True)
uvicorn.Server(uv).run(sockets=[sock])
"""


@dataclass(frozen=True, slots=True)
class Source:
    """A checkout whose broker and worker are measured."""

    path: Path
    label: str
    history_mode: str = "tree"  # its broker's --history-mode (the sessions' default); tree passes no flag


@dataclass(frozen=True, slots=True)
class Pass:
    """One measured loadgen pass."""

    process: str
    source: str
    context: int
    rep: int
    instructions: int
    turns: int
    wall_s: float


def _source(path: str) -> Source:
    """Resolve a checkout and check that its own `broker` and `gateway_workers` are what a child imports."""
    root = Path(path).resolve()
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import broker, gateway_workers; print(broker.__file__); print(gateway_workers.__file__)",
        ],
        cwd=root,
        env=_env(root),
        capture_output=True,
        text=True,
        timeout=60,
    )
    files = probe.stdout.split()
    if probe.returncode != 0 or len(files) != 2 or not all(Path(f).is_relative_to(root) for f in files):
        raise SystemExit(f"--source {root}: its packages do not import from it ({probe.stdout}{probe.stderr})")
    rev = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return Source(root, f"{root.name}@{rev.stdout.strip()}" if rev.returncode == 0 else root.name)


def _env(root: Path) -> dict[str, str]:
    # cwd and PYTHONPATH both name the checkout: they come before the venv's editable install of this repo.
    return {**os.environ, "PYTHONPATH": str(root), "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


class Callgrind:
    """A process started under callgrind, instrumentation off until measured; counts read from its dumps."""

    def __init__(self, out_file: Path) -> None:
        self.out_file = out_file
        self.pid = 0

    def prefix(self) -> list[str]:
        return ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={self.out_file}"]

    def _control(self, option: str) -> None:
        # Always with an explicit pid: without one, callgrind_control acts on every callgrind run on the box.
        if self.pid <= 0:
            raise RuntimeError("callgrind process has no pid yet")
        done = subprocess.run(
            ["callgrind_control", option, str(self.pid)], capture_output=True, text=True, timeout=CONTROL_TIMEOUT_S
        )
        if done.returncode != 0 or "Error" in done.stdout + done.stderr:
            raise RuntimeError(f"callgrind_control {option} {self.pid} failed: {done.stdout}{done.stderr}")

    def start(self) -> None:
        self._control("--instr=on")
        self._control("--zero")  # drop what ran between the last dump and now

    def stop(self) -> int:
        """Dump (while still instrumented: a dump taken after `--instr=off` reports `summary: 0`), switch off,
        and return the instructions counted since `start`."""
        before = set(glob.glob(f"{self.out_file}.*"))
        self._control("--dump")
        self._control("--instr=off")
        deadline = time.monotonic() + DUMP_TIMEOUT_S
        while True:
            new = sorted(set(glob.glob(f"{self.out_file}.*")) - before)
            totals = [_totals(f) for f in new]
            if new and None not in totals:
                return sum(t for t in totals if t is not None)
            if time.monotonic() > deadline:
                raise RuntimeError(f"no complete callgrind dump of pid {self.pid} within {DUMP_TIMEOUT_S}s")
            time.sleep(0.2)


def _totals(path: str) -> int | None:
    """The `totals:` line of a finished dump (it is the file's last line), else None."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("totals:"):
                return int(line.split()[1])
    return None


class Setup:
    """A broker and one worker from one checkout, `process` under callgrind; `stop()` kills both groups."""

    def __init__(self, process: str, source: Source, engine_url: str, tokenizer_dir: str, out_file: Path) -> None:
        self.process, self.source, self.engine_url, self.tokenizer_dir = process, source, engine_url, tokenizer_dir
        self.callgrind = Callgrind(out_file)
        self.services: list[Service] = []
        self.base_url = self.control = ""
        self.client: Any = None
        self.target: Any = None
        python = sys.executable  # the venv's real binary: valgrind must not start a shim script
        cmd = [
            python,
            "-m",
            "broker",
            "--worker-endpoint",
            "tcp://127.0.0.1:0",
            "--control",
            "tcp://127.0.0.1:0",
            "--tokenizer",
            tokenizer_dir,
            "--log-level",
            "warning",
        ]
        if source.history_mode != "tree":
            cmd += ["--history-mode", source.history_mode]
        self.broker = self._start("broker", cmd, BROKER_READY)
        self.worker: Service | None = None

    def _start(self, role: str, cmd: list[str], ready: str) -> Service:
        measured = role == self.process
        if measured:
            cmd = self.callgrind.prefix() + cmd
        # `env -C` runs it in the checkout; exec keeps the pid, so the group leader is valgrind itself.
        service = Service(
            f"{role}@{self.source.label}", ["env", "-C", str(self.source.path), *cmd], ready, env=_env(self.source.path)
        )
        self.services.append(service)
        if measured:
            self.callgrind.pid = service.proc.pid
        return service

    def start_worker(self) -> None:
        match = self.broker.wait_ready(self._timeout("broker"))
        worker_endpoint, self.control = match.group(1), match.group(2)
        cmd = [sys.executable, "-c", _WORKER_PROGRAM, worker_endpoint, self.engine_url, self.tokenizer_dir]
        self.worker = self._start("worker", cmd, WORKER_READY)

    def wait_ready(self) -> None:
        from trainer_client import TrainerClient

        assert self.worker is not None
        match = self.worker.wait_ready(self._timeout("worker"))
        if not Path(match.group(2)).is_relative_to(self.source.path):
            raise RuntimeError(f"worker imported {match.group(2)}, not from {self.source.path}")
        wait_http(match.group(1) + "/healthz", self._timeout("worker"))
        self.base_url = match.group(1) + "/v1"
        self.client = TrainerClient(self.control)
        self.target = loadgen.OursTarget(self.base_url, self.client)

    def _timeout(self, role: str) -> float:
        return VALGRIND_READY_TIMEOUT_S if role == self.process else PLAIN_READY_TIMEOUT_S

    def stop(self) -> None:
        if self.target is not None:
            asyncio.run(self.target.close())
        if self.client is not None:
            self.client.close()
        for service in reversed(self.services):
            service.stop()


def _engine_post(engine_url: str, path: str) -> None:
    request = urllib.request.Request(engine_url + path, data=b"{}", method="POST")
    urllib.request.urlopen(request, timeout=ENGINE_CALL_TIMEOUT_S).close()


def load_pass(setup: Setup, args: argparse.Namespace, context: int, run_id: str) -> int:
    """One loadgen pass (capture checked); returns the turns done."""
    _engine_post(setup.engine_url, "/_bench/reset")  # the engine's request log feeds only this pass's check
    config = loadgen.LoadConfig(
        agents=args.agents,
        turns=args.turns,
        context_tokens=context,
        progress=False,
        run_id=run_id,
        tool_text=args.tool_text,
        echo_reasoning=args.echo_reasoning,
    )

    async def run() -> dict[str, Any]:
        return await asyncio.wait_for(loadgen.run_load(setup.target, config, setup.engine_url), PASS_TIMEOUT_S)

    result = asyncio.run(run())
    capture = result.get("capture", {})
    expected = args.agents * args.turns
    if result["errors"] or not capture.get("ok") or result["turns_done"] != expected:
        raise RuntimeError(
            f"{setup.process}@{setup.source.label} ctx {context}: {result['turns_done']}/{expected} turns, "
            f"errors {result['errors']}, capture {capture}"
        )
    print(f"  rows per session: {capture.get('rows_per_session')}", file=sys.stderr, flush=True)
    return int(result["turns_done"])


def measure(setup: Setup, args: argparse.Namespace, context: int, rep: int) -> Pass:
    t0 = time.monotonic()
    setup.callgrind.start()
    turns = load_pass(setup, args, context, f"{time.time()}-{setup.source.label}-{context}-{rep}")
    time.sleep(SETTLE_S)
    instructions = setup.callgrind.stop()
    done = Pass(setup.process, setup.source.label, context, rep, instructions, turns, round(time.monotonic() - t0, 1))
    print(
        f"  {setup.process:<6} {setup.source.label:<28} ctx {context:>6} rep {rep}: "
        f"{instructions / 1e6 / turns:8.3f} M instructions/turn ({done.wall_s:.0f} s)",
        file=sys.stderr,
        flush=True,
    )
    return done


def run_process(
    process: str, sources: list[Source], args: argparse.Namespace, engine_url: str, tokenizer_dir: str, workdir: Path
) -> list[Pass]:
    """All passes of one process under test: every source's setup up at once, sources interleaved."""
    passes: list[Pass] = []
    with contextlib.ExitStack() as stack:
        setups = []
        for k, source in enumerate(sources):
            setup = Setup(process, source, engine_url, tokenizer_dir, workdir / f"{process}-{k}.cg.out")
            stack.callback(setup.stop)
            setups.append(setup)
        for setup in setups:  # brokers start in parallel, then the workers
            setup.start_worker()
        for setup in setups:
            setup.wait_ready()
        t0 = time.monotonic()
        for context in args.contexts:
            for setup in setups:
                load_pass(setup, args, context, f"warm-{time.time()}-{context}")
        print(f"== {process}: warm-up passes done in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        for rep in range(args.reps):
            for context in args.contexts:
                for setup in setups:
                    passes.append(measure(setup, args, context, rep))
    return passes


def summarize(passes: list[Pass], sources: list[Source]) -> list[dict[str, Any]]:
    rows = []
    for process in dict.fromkeys(p.process for p in passes):
        for context in dict.fromkeys(p.context for p in passes):
            base = None
            for source in sources:
                mine = [p for p in passes if (p.process, p.context, p.source) == (process, context, source.label)]
                if not mine:
                    continue
                per_turn = sum(p.instructions for p in mine) / sum(p.turns for p in mine) / 1e6
                each = [p.instructions / p.turns / 1e6 for p in mine]
                base = per_turn if base is None else base
                rows.append(
                    {
                        "process": process,
                        "context": context,
                        "source": source.label,
                        "m_instr_per_turn": per_turn,
                        "spread_pct": 100 * (max(each) - min(each)) / statistics.fmean(each),
                        "passes": len(mine),
                        "turns": sum(p.turns for p in mine),
                        "ratio": per_turn / base,
                    }
                )
    return rows


def print_table(rows: list[dict[str, Any]], several: bool) -> None:
    head = f"{'process':<8} {'context':>7}  {'source':<28} {'M instr/turn':>12} {'spread':>7} {'turns':>6}"
    print(head + ("  ratio" if several else ""))
    for r in rows:
        line = (
            f"{r['process']:<8} {r['context']:>7}  {r['source']:<28} {r['m_instr_per_turn']:>12.3f} "
            f"{r['spread_pct']:>6.1f}% {r['turns']:>6}"
        )
        print(line + (f"  {r['ratio']:.3f}" if several else ""))


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM unwinds like Ctrl-C, so every process group is stopped on the way out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--process", choices=[*PROCESSES, "both"], default="both", help="the process under callgrind")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 24576], help="context tokens at the last turn")
    p.add_argument("--reps", type=int, default=2, help="measured passes per context and source")
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--tool-text", choices=loadgen.TOOL_TEXTS, default="prose", help="what tool results look like")
    p.add_argument("--source", nargs="+", default=[str(REPO)], help="checkouts to measure (the first is the base)")
    p.add_argument("--echo-reasoning", action=argparse.BooleanOptionalAction, default=True,
                   help="agents echo their replies' reasoning (--no-echo-reasoning: they strip it)")
    p.add_argument("--think", action=argparse.BooleanOptionalAction, default=True,
                   help="the engine's replies open with a <think> block (--no-think: tool calls alone)")
    p.add_argument("--history-mode", nargs="+", default=["tree"], choices=["tree", "linear"],
                   help="each source's sessions in each of these history modes (linear: a source that has it)")
    p.add_argument("--out", help="write every pass and the summary here as JSON")
    p.add_argument("--keep-dumps", metavar="DIR", help="keep the callgrind dumps here (for callgrind_annotate)")
    args = p.parse_args()
    missing = [tool for tool in ("valgrind", "callgrind_control", "vgdb") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(
            f"bench_instructions: {', '.join(missing)} not found; install valgrind "
            "(e.g. `apt-get install valgrind`), which provides all three"
        )
    if args.reps < 1 or args.agents < 1 or args.turns < 1 or min(args.contexts) < 512:
        raise SystemExit("--reps, --agents and --turns must be >= 1 and every context >= 512 tokens")
    sources = [
        Source(s.path, s.label if mode == "tree" else f"{s.label}+{mode}", mode)
        for s in map(_source, args.source)
        for mode in args.history_mode
    ]
    if len({s.label for s in sources}) != len(sources):
        raise SystemExit(f"--source names the same checkout twice: {[s.label for s in sources]}")
    processes = list(PROCESSES) if args.process == "both" else [args.process]
    signal.signal(signal.SIGTERM, _interrupt)
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # no torch needed, no warning about it

    from assets import trl_qwen3_template_path

    from gateway_workers.rendering.tokenizer import prepare_tokenizer_dir

    tokenizer_dir = prepare_tokenizer_dir(None, chat_template_path=str(trl_qwen3_template_path()))
    loadgen.use_vocabulary(tokenizer_dir)
    t0 = time.monotonic()
    passes: list[Pass] = []
    try:
        with contextlib.ExitStack() as stack:
            if args.keep_dumps:
                workdir = Path(args.keep_dumps)
                workdir.mkdir(parents=True, exist_ok=True)
            else:
                workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-cg-")))
            engine = Service(
                "engine",
                [sys.executable, str(HERE / "bench_engine.py"), "--tokenizer", tokenizer_dir,
                 *(["--no-think"] if not args.think else [])],
                ENGINE_READY,
            )
            stack.callback(engine.stop)
            engine_url = engine.wait_ready(PLAIN_READY_TIMEOUT_S).group(1)
            for process in processes:
                passes += run_process(process, sources, args, engine_url, tokenizer_dir, workdir)
    except KeyboardInterrupt:
        raise SystemExit("bench_instructions: interrupted; every process it started has been stopped") from None
    elapsed = time.monotonic() - t0
    rows = summarize(passes, sources)
    print(f"\n{args.agents} agents x {args.turns} turns, {args.reps} measured passes each; {elapsed:.0f} s in all")
    print_table(rows, len(sources) > 1)
    if args.out:
        meta = {"argv": sys.argv, "elapsed_s": round(elapsed, 1), "sources": [str(s.path) for s in sources]}
        Path(args.out).write_text(
            json.dumps({"meta": meta, "summary": rows, "passes": [asdict(x) for x in passes]}, indent=2)
        )


if __name__ == "__main__":
    main()
