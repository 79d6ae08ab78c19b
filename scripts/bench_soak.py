"""Soak benchmark: ~1,000 concurrent sessions x 20 turns, finishes interleaved, RSS over time.

Starts `rollout-gateway serve` (mock engine, 2 workers, built-in defaults; by default durable, on a
temporary --state-dir with --fsync interval) as a bench_procs.Service. --concurrency agent slots each
run one session at a time: open it (TrainerClient), --turns turns of a Chat Completions conversation
that grows every turn (bench_dialects.Chat over aiohttp: the previous messages, the reply, a new user
message), then `request_finish`, and the slot opens the next session. Slots start spread over --ramp
seconds so that finishes interleave instead of arriving as one wave. A trainer thread consumes the
episode stream (acknowledging each, so the outbox stays small) and checks every episode against its
agent: turns the agent received = turns committed = loss-masked spans in the rows, and trained tokens
= the tokens the agent was sent; anything else is a lost or phantom turn. A sampler thread reads
VmRSS / RssAnon / RssFile of serve, its broker and each worker from /proc/PID/status, with the
broker's gauges (`TrainerClient.stats()`), every --sample-every seconds.

Flat: over the samples taken while every slot was busy, the median of the last third over the median
of the second third, per process (target <= 1.1). Writes --out (JSON: every sample) and prints markdown.

    python scripts/bench_soak.py --sessions 1000 --concurrency 100 --turns 5 --ramp 2 --sample-every 0.5   # < 1 min
    python scripts/bench_soak.py --sessions 12000 --out bench-results/soak.json   # 1,000 x 20: ~13 min on 2 vCPUs
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
from agent_text import filler  # noqa: E402
from bench_dialects import Chat  # noqa: E402
from bench_hostile import GATEWAY_READY, _commit  # noqa: E402
from bench_procs import Service, children  # noqa: E402
from bench_report import write_results  # noqa: E402
from loadgen import SYSTEM, _summary  # noqa: E402

from trainer_client import BrokerBusy, Episode, EpisodeTimeout, TrainerClient  # noqa: E402

FLAT_TARGET = 1.1
TURN_TIMEOUT_S = 120.0  # one agent turn at full concurrency on a small box; past it the session ends early
CLIENT_TIMEOUT_S = 60.0
FINISH_WAIT_S = 5.0
BUSY_RETRY_S = 0.2  # a full outbox refuses request_finish: the trainer thread is catching up
EPISODE_POLL_S = 1.0
PROGRESS_EVERY_S = 30.0
DRAIN_TIMEOUT_S = 120.0  # after the last finish, for the last episodes to arrive
TRAINER_THREADS = 8  # opens and finishes are blocking calls; a handful in flight keep up with ~1,000 agents
# Why a turn an agent received could miss its episode: the finish's wait ran out, or its worker was given up
# for lost (unheard for ROLLOUT_BROKER_WORKER_SILENCE_S) before its commit landed.
_LOSS_GAUGES = ("turns_abandoned", "turns_worker_lost", "drain_timeouts", "commits_late", "turns_aborted")
GAUGES = ("sessions_open", "sessions_closing", "turns_in_flight", "turns_held", "tokens_held", "bytes_held",
          "outbox_episodes", "outbox_bytes", "subscribers", "wal_tail_bytes", "wal_bytes_written", "snapshots_written",
          "last_snapshot_bytes", "heap_trims", "heap_trim_released_bytes", "bytes_compacted",
          *_LOSS_GAUGES, "replies_dropped")  # fmt: skip
_MIB = 2**20
_META_ARGS = ("sessions", "concurrency", "turns", "duration", "ramp", "workers", "durable", "fsync", "user_tokens",
              "max_tokens", "sample_every", "serve_arg")  # fmt: skip


# --- what each agent did, and what the trainer got -----------------------------------------------


@dataclass
class Made:
    """What one session's agent received: the turns it can train on."""

    turns: int = 0
    tokens: int = 0


@dataclass
class Ledger:
    """Agents' sessions against the trainer's episodes; shared by the loop and the trainer thread."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    made: dict[str, Made] = field(default_factory=dict)  # finish requested, episode not seen yet
    opened: int = 0
    active: int = 0
    turns_done: int = 0
    finish_requested: int = 0
    episodes: int = 0
    ok_episodes: int = 0
    lost_turns: int = 0
    lost_unflagged: int = 0  # lost turns in an episode that says it is complete with none abandoned: silent loss
    phantom_turns: int = 0
    token_mismatches: int = 0
    unknown_episodes: int = 0  # a session we never finished, or delivered twice
    redelivered: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    agent_errors: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    first_turn_latencies: list[float] = field(default_factory=list)  # a new connection and a new session's render

    def expect(self, sid: str, made: Made) -> None:
        with self.lock:
            self.made[sid] = made
            self.finish_requested += 1

    def check(self, episode: Episode) -> None:
        """An episode must hold exactly the turns its agent received, by three independent counts."""
        spans = sum(_masked_spans(row.loss_mask) for row in episode.rows)
        trained = sum(sum(row.loss_mask) for row in episode.rows)
        with self.lock:
            self.episodes += 1
            self.statuses[episode.status] += 1
            self.redelivered += episode.redelivered
            made = self.made.pop(episode.session_id, None)
            if made is None:
                self.unknown_episodes += 1
                self._problem(f"episode of {episode.session_id[:12]}: not a session awaiting its episode")
                return
            counts = (episode.turns_committed, spans)
            lost = max(0, made.turns - min(counts))
            self.lost_turns += lost
            if episode.status == "complete" and not episode.turns_abandoned:
                self.lost_unflagged += lost
            self.phantom_turns += max(0, max(counts) - made.turns)
            self.token_mismatches += trained != made.tokens
            if counts == (made.turns, made.turns) and trained == made.tokens and not episode.turns_abandoned:
                self.ok_episodes += 1
            else:
                self._problem(
                    f"session {episode.session_id[:12]}: agent {made.turns} turns / {made.tokens} tokens, episode "
                    f"{episode.turns_committed} committed, {spans} spans, {trained} trained tokens, "
                    f"{episode.turns_abandoned} abandoned, status {episode.status}"
                )

    def _problem(self, text: str) -> None:
        if len(self.problems) < 20:
            self.problems.append(text)


def _masked_spans(mask: list[int]) -> int:
    """Runs of 1 in a loss mask: one per assistant turn (prompt tokens, masked 0, separate two replies)."""
    return sum(1 for i, bit in enumerate(mask) if bit and (i == 0 or not mask[i - 1]))


def consume_episodes(client: TrainerClient, ledger: Ledger, load_done: threading.Event, stop: threading.Event) -> None:
    """The trainer: every episode until the load is over and none is awaited, or `stop` (an abort)."""
    with client.episodes(timeout=EPISODE_POLL_S, max_pending=64) as stream:
        while not stop.is_set():
            try:
                episode = next(stream)
            except EpisodeTimeout:
                with ledger.lock:
                    if load_done.is_set() and not ledger.made:
                        return
                continue
            ledger.check(episode)  # acknowledged by the next `next()`


# --- memory over time -----------------------------------------------------------------------------


def process_memory(pid: int) -> dict[str, float] | None:
    """VmRSS and its anonymous / file-backed parts, in MiB (None: the process is gone)."""
    wanted = {b"VmRSS:": "rss_mb", b"RssAnon:": "anon_mb", b"RssFile:": "file_mb"}
    out: dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                key, _, value = line.partition(b"\t")
                if key in wanted:
                    out[wanted[key]] = round(int(value.split()[0]) / 1024, 2)  # the kernel prints kB
    except (OSError, ValueError, IndexError):
        return None
    return out or None


class MemorySampler:
    """Samples serve's processes and the broker's gauges in a thread; names each process once, by role."""

    def __init__(
        self, serve_pid: int, client: TrainerClient, ledger: Ledger, every_s: float, state_dir: str | None
    ) -> None:
        self.serve_pid, self.client, self.ledger, self.every_s = serve_pid, client, ledger, every_s
        self.state_dir = state_dir
        self.names: dict[int, str] = {}
        self.samples: list[dict[str, Any]] = []
        self.t0 = time.monotonic()
        self.load_started: float | None = None
        self.steady = False  # set by the load: every slot holds a session
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="memory-sampler", daemon=True)

    def _name(self, pid: int) -> str | None:
        if pid not in self.names:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                return None
            if pid == self.serve_pid:
                self.names[pid] = "serve"
            elif b"broker" in argv[:3]:  # python -m broker; a restarted broker keeps the name
                self.names[pid] = "broker"
            elif any(b"spawn_main" in a for a in argv):  # uvicorn's spawned workers; a restart is a new number
                self.names[pid] = f"worker-{sum(n.startswith('worker') for n in self.names.values()) + 1}"
            else:
                self.names[pid] = ""  # multiprocessing's resource tracker: not ours to measure
        return self.names[pid] or None

    def sample(self, phase: str) -> dict[str, Any]:
        procs: dict[str, dict[str, Any]] = {}
        for pid in sorted(children(self.serve_pid)):
            name = self._name(pid)
            memory = process_memory(pid) if name else None
            if name and memory:
                procs[name] = {"pid": pid, **memory}
        try:
            stats = self.client.stats()
        except Exception as e:  # a sample without gauges says why, and the soak goes on
            stats = {"error": f"{type(e).__name__}: {e}"}
        with self.ledger.lock:
            progress = {"active": self.ledger.active, "opened": self.ledger.opened, "turns": self.ledger.turns_done,
                        "finish_requested": self.ledger.finish_requested, "episodes": self.ledger.episodes}  # fmt: skip
        now = time.monotonic()
        record = {
            "t_s": round(now - self.t0, 2),
            "load_s": round(now - self.load_started, 2) if self.load_started is not None else None,
            "phase": phase,
            "steady": self.steady and phase == "load",
            "procs": procs,
            "gauges": {k: stats[k] for k in GAUGES if k in stats} if "error" not in stats else stats,
            "progress": progress,
            # The log must stay bounded too: snapshots let the broker delete the segments they cover.
            "state_dir_mb": round(_tree_bytes(self.state_dir) / _MIB, 1) if self.state_dir else None,
        }
        self.samples.append(record)
        return record

    def start(self) -> None:
        self.load_started = time.monotonic()
        self._thread.start()

    def _loop(self) -> None:
        last_report = time.monotonic()
        while not self._stop.wait(self.every_s):
            record = self.sample("load")
            if time.monotonic() - last_report >= PROGRESS_EVERY_S:  # a soak runs for minutes: show it is alive
                last_report = time.monotonic()
                rss = " ".join(f"{name} {p['rss_mb']:.0f}" for name, p in record["procs"].items())
                progress = record["progress"]
                print(f"  {record['load_s']:6.0f} s: {progress['opened']} sessions, {progress['turns']} turns, "
                      f"{progress['episodes']} episodes; RSS MiB {rss}", file=sys.stderr, flush=True)  # fmt: skip

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(CLIENT_TIMEOUT_S)


def _tree_bytes(root: str) -> int:
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                total += os.stat(os.path.join(folder, name)).st_blocks * 512  # on disk, as du counts it
            except OSError:
                pass  # a segment deleted by the broker while we walked
    return total


# --- the agents ------------------------------------------------------------------------------------


class Load:
    """The agent slots: each runs sessions one after another until the budget or the time is spent."""

    def __init__(self, args: argparse.Namespace, base_url: str, client: TrainerClient, ledger: Ledger,
                 sampler: MemorySampler) -> None:  # fmt: skip
        self.args, self.base_url, self.client, self.ledger, self.sampler = args, base_url, client, ledger, sampler
        self.pool = concurrent.futures.ThreadPoolExecutor(TRAINER_THREADS, thread_name_prefix="trainer")
        self.sessions_left = args.sessions
        self.deadline = time.monotonic() + args.duration if args.duration else None
        self.started = 0

    async def _blocking(self, fn: Any, *fn_args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, lambda: fn(*fn_args, **kwargs))

    def _take_session(self) -> bool:
        if self.sessions_left <= 0 or (self.deadline is not None and time.monotonic() >= self.deadline):
            return False
        self.sessions_left -= 1
        return True

    async def slot(self, index: int) -> None:
        await asyncio.sleep(self.args.ramp * index / self.args.concurrency)
        self.started += 1
        if self.started == self.args.concurrency:
            self.sampler.steady = True
        sequence = 0
        while self._take_session():
            sid = await self._blocking(self.client.open_session, sampling_defaults={"temperature": 1.0})
            with self.ledger.lock:
                self.ledger.opened += 1
                self.ledger.active += 1
            made = await self.session(sid, f"{self.args.run_id}/{index}/{sequence}")
            self.ledger.expect(sid, made)  # before the finish: its episode may arrive before the call returns
            await self._finish(sid)
            with self.ledger.lock:
                self.ledger.active -= 1
            sequence += 1
        self.sampler.steady = False  # a slot with no session left: the load is draining

    async def session(self, sid: str, seed: str) -> Made:
        args, made, dialect = self.args, Made(), Chat(echo_reasoning=True)
        state = dialect.start(SYSTEM, f"Task {seed}:" + filler(args.user_tokens, seed))
        timeout = aiohttp.ClientTimeout(total=TURN_TIMEOUT_S)
        # A connection per session, as a new agent process opens one: it lands on whichever worker accepts.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1), timeout=timeout) as http:
            for turn in range(args.turns):
                body = orjson.dumps(dialect.body(state, args.max_tokens, False))
                t0 = time.perf_counter()
                try:
                    async with http.post(self.base_url + dialect.path, data=body, headers=dialect.headers(sid)) as r:
                        if r.status != 200:
                            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
                        reply = await dialect.read(r, False)
                except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, KeyError, ValueError) as e:
                    # The session ends here; its episode must hold exactly the turns received so far.
                    with self.ledger.lock:
                        self.ledger.agent_errors.append(f"{sid[:12]} turn {turn}: {type(e).__name__}: {e}"[:300])
                    break
                made.turns += 1
                made.tokens += reply.completion_tokens
                with self.ledger.lock:
                    self.ledger.turns_done += 1
                    self.ledger.latencies.append(time.perf_counter() - t0)
                    if turn == 0:
                        self.ledger.first_turn_latencies.append(self.ledger.latencies[-1])
                user_text = f"Continue {seed}/{turn}." + filler(args.user_tokens, f"{seed}/{turn}")
                dialect.advance(state, reply, tool_output="", user_text=user_text)
        return made

    async def _finish(self, sid: str) -> None:
        while True:
            try:
                await self._blocking(self.client.request_finish, sid, reward=1.0, wait_timeout=FINISH_WAIT_S)
                return
            except BrokerBusy:
                await asyncio.sleep(BUSY_RETRY_S)

    async def run(self) -> float:
        t0 = time.perf_counter()
        try:
            await asyncio.gather(*(self.slot(i) for i in range(self.args.concurrency)))
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)  # no trainer call outlives the client
        return time.perf_counter() - t0


# --- results ---------------------------------------------------------------------------------------


def flatness(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per process: RSS before the load, after warm-up (median of the steady samples' second third),
    at the end (median of the last third), peak and after the drain, and end / warm-up."""
    steady = [s for s in samples if s["steady"]]
    idle = next((s for s in samples if s["phase"] == "idle"), None)
    final = next((s for s in reversed(samples) if s["phase"] == "drained"), None)
    third = len(steady) // 3
    names = sorted({name for s in samples for name in s["procs"]}, key=lambda n: (n != "broker", n))
    out: dict[str, Any] = {}
    for name in names:

        def rss(group: list[dict[str, Any]], proc: str = name) -> list[float]:
            return [s["procs"][proc]["rss_mb"] for s in group if proc in s["procs"]]

        warm, end = rss(steady[third : 2 * third]), rss(steady[2 * third :])
        row: dict[str, Any] = {
            "start_mb": rss([idle])[0] if idle and rss([idle]) else None,
            "warm_mb": round(statistics.median(warm), 1) if warm else None,
            "end_mb": round(statistics.median(end), 1) if end else None,
            "peak_mb": max(rss(samples), default=None),
            "drained_mb": rss([final])[0] if final and rss([final]) else None,
            "pids": sorted({s["procs"][name]["pid"] for s in samples if name in s["procs"]}),
        }
        row["ratio"] = round(row["end_mb"] / row["warm_mb"], 3) if warm and end else None
        # A ratio under the target can still hide a steady climb: the slope against sessions served tells them apart.
        points = [(s["progress"]["opened"], s["procs"][name]["rss_mb"]) for s in steady if name in s["procs"]]
        if len({x for x, _ in points}) >= 2:
            fit = statistics.linear_regression([x for x, _ in points], [y for _, y in points])
            row["slope_mb_per_1k_sessions"] = round(1000 * fit.slope, 2)
        row["flat"] = row["ratio"] is not None and row["ratio"] <= FLAT_TARGET
        out[name] = row
    return {"steady_samples": len(steady), "by_process": out}


def summarize(args: argparse.Namespace, ledger: Ledger, sampler: MemorySampler, elapsed: float,
              missing: int) -> dict[str, Any]:  # fmt: skip
    steady = [s for s in sampler.samples if s["steady"]]
    steady_rate = None
    if len(steady) >= 2 and steady[-1]["load_s"] > steady[0]["load_s"]:
        span = steady[-1]["load_s"] - steady[0]["load_s"]
        steady_rate = round((steady[-1]["progress"]["turns"] - steady[0]["progress"]["turns"]) / span, 1)
    return {
        "meta": {
            "argv": sys.argv,
            "cpus": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0],
            "commit": _commit(str(HERE.parent)),
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
            **{k: getattr(args, k) for k in _META_ARGS},
        },
        "load": {
            "elapsed_s": round(elapsed, 1),
            "sessions": ledger.opened,
            "turns": ledger.turns_done,
            "turns_per_s": round(ledger.turns_done / elapsed, 1) if elapsed else None,
            "turns_per_s_steady": steady_rate,
            "latency_ms": _summary(ledger.latencies),
            "first_turn_latency_ms": _summary(ledger.first_turn_latencies),
            "agent_errors": len(ledger.agent_errors),
        },
        "capture": {
            "finish_requested": ledger.finish_requested,
            "episodes": ledger.episodes,
            "episodes_ok": ledger.ok_episodes,
            "episodes_missing": missing,
            "episodes_unknown": ledger.unknown_episodes,
            "episodes_redelivered": ledger.redelivered,
            "lost_turns": ledger.lost_turns,
            "lost_turns_unflagged": ledger.lost_unflagged,
            "phantom_turns": ledger.phantom_turns,
            "token_mismatches": ledger.token_mismatches,
            "statuses": dict(ledger.statuses),
            "ok": missing == 0 and ledger.ok_episodes == ledger.finish_requested == ledger.episodes,
        },
        "memory": flatness(sampler.samples),
        "problems": ledger.problems,
        "agent_errors": ledger.agent_errors[:20],
        "samples": sampler.samples,
    }


def markdown(result: dict[str, Any]) -> str:
    meta, load, cap, mem = result["meta"], result["load"], result["capture"], result["memory"]
    last_gauges = result["samples"][-1]["gauges"]
    durable = f"--state-dir (temp), --fsync {meta['fsync']}" if meta["durable"] else "in memory"
    lines = [
        f"Soak: {load['sessions']} sessions, {meta['concurrency']} concurrent x {meta['turns']} turns, "
        f"{meta['workers']} workers, {durable} (commit {meta['commit']}, {meta['cpus']} CPUs, "
        f"load {meta['load_avg_1m']:.2f}).",
        "",
        f"Load: {load['turns']} turns in {load['elapsed_s']:g} s = {load['turns_per_s']} turns/s "
        f"({load['turns_per_s_steady']} while every slot was busy); latency p50 {load['latency_ms'].get('p50')} ms, "
        f"p99 {load['latency_ms'].get('p99')} ms (first turns: p50 {load['first_turn_latency_ms'].get('p50')}, "
        f"p99 {load['first_turn_latency_ms'].get('p99')} ms); {load['agent_errors']} agent errors.",
        f"Capture: {cap['episodes']} episodes of {cap['finish_requested']} finishes, {cap['episodes_ok']} exact; "
        f"lost turns {cap['lost_turns']} ({cap['lost_turns_unflagged']} in episodes flagged complete), phantom "
        f"turns {cap['phantom_turns']}, token mismatches {cap['token_mismatches']}, missing episodes "
        f"{cap['episodes_missing']}, unknown {cap['episodes_unknown']}, redelivered {cap['episodes_redelivered']}: "
        f"{'OK' if cap['ok'] else 'NOT OK'}. Episode statuses: "
        + ", ".join(f"{k} {v}" for k, v in sorted(cap["statuses"].items()))
        + ".",
        "Broker at the end: "
        + ", ".join(f"{k} {last_gauges[k]}" for k in _LOSS_GAUGES if k in last_gauges)
        + f"; the gateway logged {len(result['gateway_log'])} lines at warning level or above (see the JSON).",
        "",
        f"RSS (MiB; warm-up / end = medians of the 2nd / 3rd third of {mem['steady_samples']} steady samples):",
        "",
        "| process | before load | after warm-up | end | end / warm-up | MiB per 1k sessions | peak | after drain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in mem["by_process"].items():
        verdict = "too few steady samples" if r["ratio"] is None else "flat" if r["flat"] else "NOT flat"
        lines.append(f"| {name} | {r['start_mb']} | {r['warm_mb']} | {r['end_mb']} | {r['ratio']} ({verdict}) "
                     f"| {r.get('slope_mb_per_1k_sessions')} | {r['peak_mb']} | {r['drained_mb']} |")  # fmt: skip
    names = list(mem["by_process"])
    samples = result["samples"]
    stride = max(1, len(samples) // 12)
    columns = [*names, "broker bytes_held MiB", "outbox", "state dir MiB", "sessions", "turns"]
    lines += ["", "RSS over time (MiB; " + (f"one sample in {stride}" if stride > 1 else "every sample") + "):", "",
              "| t s | phase | " + " | ".join(columns) + " |", "|---|---|" + "---|" * len(columns)]  # fmt: skip
    for s in samples[::stride] + ([samples[-1]] if (len(samples) - 1) % stride else []):
        cells = [str(s["procs"].get(n, {}).get("rss_mb", "—")) for n in names]
        gauges, progress = s["gauges"], s["progress"]
        held = round(gauges["bytes_held"] / _MIB, 1) if "bytes_held" in gauges else "—"
        state_dir = s["state_dir_mb"] if s["state_dir_mb"] is not None else "—"
        cells += [str(held), str(gauges.get("outbox_episodes", "—")), str(state_dir), str(progress["opened"]),
                  str(progress["turns"])]  # fmt: skip
        lines.append(f"| {s['t_s']} | {s['phase']}{' (steady)' if s['steady'] else ''} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# --- the run ---------------------------------------------------------------------------------------


def soak(args: argparse.Namespace, state_dir: str | None) -> dict[str, Any]:
    cmd = [sys.executable, "-u", "-m", "gateway_workers.cli", "serve", "--host", "127.0.0.1", "--port", "0",
           "--control", "tcp://127.0.0.1:0", "--workers", str(args.workers), "--engine-kind", "mock",
           "--log-level", "warning"]  # fmt: skip
    if state_dir is not None:
        cmd += ["--state-dir", state_dir, "--fsync", args.fsync]
    cmd += [part for extra in args.serve_arg for part in extra.split()]
    # Started in this script's checkout: `-m` puts the working directory first on sys.path, so serve and
    # the broker it spawns import this checkout, whatever directory the script was run from.
    here = os.getcwd()
    os.chdir(HERE.parent)
    try:
        gateway = Service("serve", cmd, GATEWAY_READY, env={"PYTHONPATH": str(HERE.parent)})
    finally:
        os.chdir(here)
    try:
        match = gateway.wait_ready()
        print(f"gateway ready: {match.group(1)}, process group {gateway.proc.pid}", file=sys.stderr)
        with TrainerClient(match.group(2), timeout=CLIENT_TIMEOUT_S) as client:
            result = _drive(args, match.group(1), client, gateway.proc.pid, state_dir)
    finally:
        gateway.stop()
    # At --log-level warning a healthy run logs nothing past start-up: every line is worth reading.
    result["gateway_log"] = [
        line.rstrip() for line in gateway.output if "READY" not in line and "agents use" not in line
    ]
    return result


def _drive(
    args: argparse.Namespace, base_url: str, client: TrainerClient, serve_pid: int, state_dir: str | None
) -> dict[str, Any]:
    """The load, the trainer and the sampler; every thread that uses `client` has ended when this returns."""
    ledger, load_done, stop = Ledger(), threading.Event(), threading.Event()
    sampler = MemorySampler(serve_pid, client, ledger, args.sample_every, state_dir)
    sampler.sample("idle")
    trainer = threading.Thread(target=consume_episodes, args=(client, ledger, load_done, stop),
                               name="trainer-episodes", daemon=True)  # fmt: skip
    trainer.start()
    sampler.start()
    load = Load(args, base_url, client, ledger, sampler)
    try:
        elapsed = _run_async(load.run())
        load_done.set()
        trainer.join(DRAIN_TIMEOUT_S)  # the last episodes
    finally:
        load_done.set()
        stop.set()
        sampler.stop()
        trainer.join(CLIENT_TIMEOUT_S)
    sampler.sample("drained")
    with ledger.lock:
        missing = len(ledger.made)
    return summarize(args, ledger, sampler, elapsed, missing)


def _run_async(main: Coroutine[Any, Any, float]) -> float:
    try:
        import uvloop  # the gateway's own dependency: a cheaper client loop leaves more of 2 vCPUs to the gateway
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=5000, help="sessions in all (each slot opens the next)")
    p.add_argument("--concurrency", type=int, default=1000, help="sessions open at once (agent slots)")
    p.add_argument("--turns", type=int, default=20, help="turns per session, then the trainer finishes it")
    p.add_argument("--duration", type=float, default=0.0, help="stop opening sessions after this many s (0: never)")
    p.add_argument("--ramp", type=float, default=30.0, help="slots start spread over this many s (finishes interleave)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--durable", action=argparse.BooleanOptionalAction, default=True,
                   help="serve --state-dir on a temporary directory (--no-durable: in memory)")  # fmt: skip
    p.add_argument("--fsync", choices=["always", "interval", "never"], default="interval")
    p.add_argument("--serve-arg", action="append", default=[], metavar="FLAGS",
                   help="more serve flags, e.g. --serve-arg='--commit-base-sessions 256' (repeatable)")  # fmt: skip
    p.add_argument("--user-tokens", type=int, default=24, help="tokens in each new user message")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--sample-every", type=float, default=2.0, help="seconds between two RSS samples")
    p.add_argument("--out", default="bench-results/soak.json", help="the JSON result; the markdown goes beside it")
    args = p.parse_args()
    args.run_id = str(time.time())
    # SIGTERM unwinds like Ctrl-C, so every `finally` runs: the gateway's group is stopped, the temp dir removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        with tempfile.TemporaryDirectory(prefix="soak-state-") as tmp:
            result = soak(args, tmp if args.durable else None)
    except KeyboardInterrupt:
        sys.exit("interrupted: the gateway is stopped and its state directory removed; no results written")
    write_results(args.out, result, markdown(result))
    if not result["capture"]["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
