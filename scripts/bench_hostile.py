"""Hostile input benchmark: the other agents' latency while one agent sends huge bodies.

Starts `rollout-gateway serve` with the built-in mock engine (bench_procs.Service: its own process
group, READY line, stopped by group whatever happens), opens sessions with `trainer_client`, and runs
K well-behaved agents for the whole run (multi-turn Chat Completions with a tool and a few KB of
context: scripts/bench_dialects.py's `Chat`, scripts/agent_text.py's text). Phases alternate: a
baseline (the agents alone), then a hostile phase (the same agents, plus one hostile agent in its own
process, so that its sending never stalls the agents' loop, looping as fast as it can):

  cl64              a 64 MiB body with its Content-Length (the worker should answer 413 before reading)
  chunked64         the same 64 MiB chunked (413 once the body outgrows the limit)
  largest_accepted  the largest body the default limits accept: two ~7.5 MB user messages in a session
                    with max_context_tokens=32768 (200: an empty reply with finish_reason "length")
  gib               a declared 1 GiB Content-Length (413); also timed on the idle gateway before the load

Every agent turn, a /healthz round trip every few ms (a fresh connection each: the event-loop lag
of whichever worker accepts it) and this process's own loop lag are recorded by the phase they
started in; turns that start between phases are not. Each hostile phase's p99 is set against the
mean of the baselines just before and after it; the tables give medians over --reps. One worker by
default: a new connection goes to whichever worker accepts first, mostly an idle one, so with
several workers the hostile agent seldom shares a loop with the agents (`--workers 2` measures that).
Writes --out (JSON) and the markdown beside it (.md), and prints the markdown.

    python scripts/bench_hostile.py --reps 3 --out bench-results/hostile.json
    python scripts/bench_hostile.py --source /tmp/base      # the gateway of another checkout (git worktree)
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
from agent_text import filler  # noqa: E402
from bench_dialects import Chat, Reply  # noqa: E402
from bench_procs import Sampler, Service  # noqa: E402
from bench_report import write_results  # noqa: E402
from loadgen import SYSTEM, _summary, percentile  # noqa: E402

GATEWAY_READY = r"GATEWAY READY base_url=(\S+) control=(\S+)"
KINDS = ("cl64", "chunked64", "largest_accepted", "gib")
TARGET_KINDS = ("cl64", "chunked64")  # the 2x target; the other two are informational
TARGET_RATIO = 2.0
GIB_TARGET_S = 0.100
MIB = 1 << 20
HOSTILE_BYTES = 64 * MIB
GIB_BYTES = 1 << 30
# Under the defaults (gateway_workers/http/limits.py: 16 MiB body, 8 Mi characters a string), with room
# for the JSON around two strings.
LARGEST_STRING_CHARS = 7_500_000
LARGEST_CONTEXT_TOKENS = 32_768
BLOCK = MIB  # the hostile agent writes its body a block at a time, draining between blocks
AGENT_TIMEOUT_S = 30.0  # one well-behaved turn; a slower one is an error, not a hang
HOSTILE_TIMEOUT_S = 60.0  # one hostile request (tokenizing 15 MB may take seconds on a small box)
HOSTILE_RESULT_SLACK_S = 30.0
CLIENT_TIMEOUT_S = 30.0
ERROR_PAUSE_S = 0.2
LAG_TICK_S = 0.01
METRICS_TRIES = 40


# --- the hostile agent (its own process) ------------------------------------------------------------


def _json_head(sid: str, host: str, path: str, length: int | None) -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {sid}\r\n"
        f"Content-Type: application/json\r\n{framing}\r\n\r\n"
    ).encode()


_PREFIX = b'{"model":"bench","max_tokens":16,"messages":[{"role":"user","content":"'
_SUFFIX = b'"}]}'
_PAD = b"a" * BLOCK


def _padded(total: int) -> Iterator[bytes]:
    """`total` bytes of one JSON body with a huge string, a block at a time (the same block reused)."""
    yield _PREFIX
    left = total - len(_PREFIX) - len(_SUFFIX)
    while left > 0:
        n = min(left, BLOCK)
        yield _PAD[:n] if n < BLOCK else _PAD
        left -= n
    yield _SUFFIX


def _chunked(parts: Iterator[bytes]) -> Iterator[bytes]:
    for part in parts:
        yield b"%x\r\n" % len(part)
        yield part
        yield b"\r\n"
    yield b"0\r\n\r\n"


class _Largest:
    """The largest accepted body: two user messages just under the string limit, unique per request."""

    def __init__(self) -> None:
        words = filler(LARGEST_STRING_CHARS // 5, "hostile-largest")
        self.text = words[: LARGEST_STRING_CHARS - 32]
        self.count = 0

    def body(self) -> bytes:
        self.count += 1
        # A new first character run per request, so no render cache can carry a request over.
        messages = [
            {"role": "user", "content": f"[{self.count} {time.time()}]" + self.text},
            {"role": "user", "content": f"[{self.count}b]" + self.text},
        ]
        return orjson.dumps({"model": "bench", "max_tokens": 16, "messages": messages})


@dataclass
class _Answer:
    status: int | str  # the HTTP status, or what happened instead ("closed", "timeout", "refused")
    first_byte_s: float
    total_s: float
    sent: int
    finish_reason: str | None = None


async def _request(host: str, port: int, head: bytes, body: Iterator[bytes], timeout: float) -> _Answer:
    """One raw HTTP/1.1 request whose body is written while the answer is awaited.

    A worker that answers and closes before the body is sent is seen as soon as it answers. Sends and
    receives are separate socket calls: a stream transport drops an answer it already received once a
    send fails, and the worker's close resets a connection whose body it did not read.
    """
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    answer = _Answer("timeout", math.nan, math.nan, 0)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)

    async def pump() -> None:
        await loop.sock_sendall(sock, head)
        for part in body:
            await loop.sock_sendall(sock, part)
            answer.sent += len(part)

    async def exchange() -> None:
        await loop.sock_connect(sock, (host, port))
        sender = asyncio.ensure_future(pump())
        try:
            received = bytearray()
            end, length = -1, 0
            while True:
                try:
                    data = await loop.sock_recv(sock, 1 << 16)
                except ConnectionError:
                    data = b""
                if not data:  # closed: with no status line, closed without an answer
                    if not isinstance(answer.status, int):
                        answer.status = "closed"
                    return
                if math.isnan(answer.first_byte_s):
                    answer.first_byte_s = time.perf_counter() - t0
                received += data
                if end < 0 and (end := received.find(b"\r\n\r\n")) >= 0:
                    lines = bytes(received[:end]).split(b"\r\n")
                    answer.status = int(lines[0].split()[1])
                    for line in lines[1:]:
                        name, _, value = line.partition(b":")
                        if name.strip().lower() == b"content-length":
                            length = int(value)
                if end >= 0 and len(received) >= end + 4 + length:
                    answer.total_s = time.perf_counter() - t0
                    if answer.status == 200:
                        reply = orjson.loads(bytes(received[end + 4 : end + 4 + length]))
                        answer.finish_reason = reply["choices"][0]["finish_reason"]
                    return
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)

    try:
        await asyncio.wait_for(exchange(), timeout)
    except asyncio.TimeoutError:
        answer.status = "timeout"
    except ConnectionError:
        answer.status = "refused"
    finally:
        sock.close()
    if math.isnan(answer.first_byte_s):
        answer.first_byte_s = time.perf_counter() - t0
    if math.isnan(answer.total_s):
        answer.total_s = answer.first_byte_s
    return answer


async def _hostile_loop(kind: str, url: str, sid: str, duration: float, count: int) -> dict[str, Any]:
    """As many `kind` requests one after the other as fit in `duration` (or `count` of them)."""
    host, _, port = url.split("//", 1)[1].split("/", 1)[0].partition(":")
    path = "/v1/chat/completions"
    largest = _Largest() if kind == "largest_accepted" else None
    answers: list[_Answer] = []
    deadline = time.perf_counter() + duration

    def more() -> bool:
        return len(answers) < count if count else time.perf_counter() < deadline

    while more():
        if kind == "cl64":
            head, body = _json_head(sid, host, path, HOSTILE_BYTES), _padded(HOSTILE_BYTES)
        elif kind == "chunked64":
            head, body = _json_head(sid, host, path, None), _chunked(_padded(HOSTILE_BYTES))
        elif kind == "gib":
            head, body = _json_head(sid, host, path, GIB_BYTES), _padded(GIB_BYTES)
        else:
            assert largest is not None
            raw = largest.body()
            head, body = _json_head(sid, host, path, len(raw)), (raw[i : i + BLOCK] for i in range(0, len(raw), BLOCK))
        answers.append(await _request(host, int(port), head, body, HOSTILE_TIMEOUT_S))
    return {
        "kind": kind,
        "requests": len(answers),
        "outcomes": dict(Counter(str(a.status) for a in answers)),
        "finish_reasons": dict(Counter(str(a.finish_reason) for a in answers if a.status == 200)),
        "first_byte_s": [round(a.first_byte_s, 6) for a in answers],
        "total_s": [round(a.total_s, 6) for a in answers],
        "sent_mb_median": round(statistics.median(a.sent for a in answers) / MIB, 2) if answers else None,
    }


def _hostile_main(conn: multiprocessing.connection.Connection) -> None:
    """The hostile process: runs each command from the pipe, sends back its result; None ends it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops it (Ctrl-C reaches the whole group)
    try:
        while (command := conn.recv()) is not None:
            conn.send(asyncio.run(_hostile_loop(**command)))
    except (EOFError, BrokenPipeError):
        pass  # the parent is gone


class Hostile:
    """The hostile agent's process, driven over a pipe."""

    def __init__(self) -> None:
        self.conn, child = multiprocessing.get_context("spawn").Pipe()
        self.proc = multiprocessing.get_context("spawn").Process(
            target=_hostile_main, args=(child,), name="hostile", daemon=True
        )
        self.proc.start()
        child.close()

    def start(self, kind: str, url: str, sid: str, duration: float, count: int = 0) -> None:
        self.conn.send({"kind": kind, "url": url, "sid": sid, "duration": duration, "count": count})

    def result(self, timeout: float) -> dict[str, Any]:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"the hostile agent gave no result within {timeout:.0f}s")
        result: dict[str, Any] = self.conn.recv()
        return result

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(5.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5.0)
        self.conn.close()


# --- the well-behaved agents and the probes (this process) ---------------------------------------------


@dataclass
class Recorder:
    """Samples by the phase they started in (None: between phases, not recorded)."""

    phase: int | None = None
    turns: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    health: dict[int, list[tuple[float, int]]] = field(default_factory=lambda: defaultdict(list))
    lag: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    # phase (or "between") -> what went wrong: agents' turns, /healthz probes
    errors: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    probe_errors: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))

    def error(self, phase: int | None, what: str, probe: bool = False) -> None:
        (self.probe_errors if probe else self.errors)[str(phase) if phase is not None else "between"].append(what[:300])


async def agent(
    index: int, sid: str, base_url: str, rec: Recorder, stop: asyncio.Event, args: argparse.Namespace
) -> None:
    dialect = Chat(echo_reasoning=True)
    timeout = aiohttp.ClientTimeout(total=AGENT_TIMEOUT_S)
    step = max(8, args.step_tokens)
    # One keep-alive connection per agent, as an SDK client keeps it.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1), timeout=timeout) as http:
        episode = 0
        while not stop.is_set():
            seed = f"{args.run_id}/{index}/{episode}"
            state = dialect.start(SYSTEM, f"Task {seed}:" + filler(step, seed))
            for turn in range(args.turns):
                if stop.is_set():
                    return
                body = orjson.dumps(dialect.body(state, args.max_tokens, False))
                phase = rec.phase
                t0 = time.perf_counter()
                try:
                    async with http.post(base_url + dialect.path, data=body, headers=dialect.headers(sid)) as resp:
                        if resp.status != 200:
                            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                        reply: Reply = await dialect.read(resp, False)
                except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, KeyError, ValueError) as e:
                    rec.error(phase, f"agent {index}: {type(e).__name__}: {e}")
                    await asyncio.sleep(ERROR_PAUSE_S)
                    break  # a new episode: this conversation's state is unknown
                if phase is not None:
                    rec.turns[phase].append(time.perf_counter() - t0)
                dialect.advance(
                    state, reply,
                    tool_output=f"Result {seed}/{turn}:" + filler(step, f"{seed}/{turn}"),
                    user_text=f"Continue {seed}/{turn}." + filler(step, f"{seed}/{turn}/u"),
                )  # fmt: skip
            episode += 1


async def healthz_probe(root: str, rec: Recorder, stop: asyncio.Event, every_s: float) -> None:
    timeout = aiohttp.ClientTimeout(total=AGENT_TIMEOUT_S)
    # A fresh connection per probe: the kernel hands it to either worker, as it does a new agent's.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True), timeout=timeout) as http:
        while not stop.is_set():
            phase = rec.phase
            t0 = time.perf_counter()
            try:
                async with http.get(root + "/healthz") as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}")
                    pid = (await resp.json())["pid"]
            except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, KeyError, ValueError) as e:
                rec.error(phase, f"healthz: {type(e).__name__}: {e}", probe=True)
            else:
                if phase is not None:
                    rec.health[phase].append((time.perf_counter() - t0, pid))
            await asyncio.sleep(every_s)


async def worker_counters(root: str, workers: int) -> dict[str, dict[str, int]]:
    """Each worker's request and 413 counts (its own snapshot, /metrics/worker): which worker took whose requests.

    New connections reach whichever worker accepts first, so it asks until it has heard every worker
    or gives up after a bounded number of tries.
    """
    seen: dict[str, dict[str, int]] = {}
    timeout = aiohttp.ClientTimeout(total=AGENT_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True), timeout=timeout) as http:
        for _ in range(METRICS_TRIES):
            try:
                async with http.get(root + "/metrics/worker") as resp:
                    snapshot = await resp.json()
            except (aiohttp.ClientError, asyncio.TimeoutError):
                continue
            counters = snapshot["counters"]
            seen[str(snapshot["pid"])] = {
                "requests": int(sum(value for name, _, value in counters if name == "turns")),
                "http_413": int(sum(value for name, labels, value in counters
                                    if name == "http_errors" and labels[1] == "413")),
            }
            if len(seen) >= workers:
                break
    return seen


async def loop_lag(rec: Recorder, stop: asyncio.Event) -> None:
    """How late this process's own loop wakes: what of the agents' latency is the load generator's."""
    while not stop.is_set():
        phase, t0 = rec.phase, time.perf_counter()
        await asyncio.sleep(LAG_TICK_S)
        if phase is not None:
            rec.lag[phase].append(max(0.0, time.perf_counter() - t0 - LAG_TICK_S))


# --- the run -----------------------------------------------------------------------------------------------


@dataclass
class Phase:
    index: int
    kind: str  # "baseline" or a hostile kind
    pair: str  # the hostile kind this phase belongs to (a baseline: the one after it, or "end")
    rep: int
    hostile: dict[str, Any] | None = None
    by_worker: dict[str, dict[str, int]] = field(default_factory=dict)  # counters at the phase's end
    cores: dict[str, float] = field(default_factory=dict)  # CPU seconds per second of the phase, by process group


async def run(
    args: argparse.Namespace, gateway: Service, base_url: str, client: Any, hostile: Hostile
) -> dict[str, Any]:
    sids = [client.open_session(sampling_defaults={"temperature": 1.0}) for _ in range(args.agents)]
    hostile_sid = client.open_session(sampling_defaults={"temperature": 1.0})
    root = base_url.removesuffix("/v1")
    hostile.start("gib", base_url, hostile_sid, 0.0, args.gib_samples)  # on the idle gateway, before any load
    gib_idle = await asyncio.to_thread(hostile.result, HOSTILE_TIMEOUT_S * args.gib_samples)

    rec, stop = Recorder(), asyncio.Event()
    tasks = [asyncio.ensure_future(agent(i, sid, base_url, rec, stop, args)) for i, sid in enumerate(sids)]
    tasks += [
        asyncio.ensure_future(healthz_probe(root, rec, stop, args.healthz_ms / 1000)),
        asyncio.ensure_future(loop_lag(rec, stop)),
    ]
    phases: list[Phase] = []
    # The hostile agent and the load generator share this box's cores with the gateway: their CPU is shown too.
    groups = {"gateway": gateway.pids, "agents": lambda: {os.getpid()}, "hostile": lambda: {hostile.proc.pid or 0}}
    try:
        await asyncio.sleep(args.warmup)  # every worker's start-up twin checks, lazy loads, connections
        # Each hostile phase between two baselines, and one more baseline to close the last bracket.
        schedule = [
            (rep, phase_kind, kind)
            for rep in range(args.reps)
            for kind in args.kinds
            for phase_kind in ("baseline", kind)
        ]
        schedule.append((args.reps - 1, "baseline", "end"))
        for rep, phase_kind, pair in schedule:
            phase = Phase(len(phases), phase_kind, pair, rep)
            phases.append(phase)
            sid = hostile_sid
            if phase_kind == "largest_accepted":
                sid = await asyncio.to_thread(
                    client.open_session, sampling_defaults={"temperature": 1.0},
                    max_context_tokens=LARGEST_CONTEXT_TOKENS,
                )  # fmt: skip
            print(f"  rep {rep} {phase_kind:<16} ({args.duration:g} s)", file=sys.stderr, flush=True)
            sampler = Sampler(groups).start()
            t0 = time.perf_counter()
            if phase_kind != "baseline":
                hostile.start(phase_kind, base_url, sid, args.duration)
            rec.phase = phase.index
            await asyncio.sleep(args.duration)
            rec.phase = None
            if phase_kind != "baseline":
                phase.hostile = await asyncio.to_thread(hostile.result, HOSTILE_TIMEOUT_S + HOSTILE_RESULT_SLACK_S)
            elapsed = time.perf_counter() - t0
            phase.cores = {name: round(s.cpu_s / elapsed, 3) for name, s in sampler.stop().items()}
            phase.by_worker = await worker_counters(root, args.workers)
            if sid != hostile_sid:  # the broker holds tens of MB for each of its turns
                await asyncio.to_thread(client.drop_session, sid)
            await asyncio.sleep(args.settle)
    finally:
        stop.set()
        done, _ = await asyncio.wait(tasks, timeout=AGENT_TIMEOUT_S + 5)
        for task in tasks:
            task.cancel()
    failed = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
    if failed:  # a bug in an agent or a probe: its samples would be missing without a word
        raise RuntimeError(f"{len(failed)} agent or probe tasks failed") from failed[0]
    return summarize(args, phases, rec, gib_idle, gateway)


# --- results ------------------------------------------------------------------------------------------------


def _ms(values: list[float]) -> dict[str, float]:
    return {"count": len(values), **_summary(values)}


def _median(values: list[float]) -> float | None:
    clean = [v for v in values if not math.isnan(v)]
    return round(statistics.median(clean), 3) if clean else None


_META_ARGS = ("agents", "workers", "duration", "reps", "turns", "step_tokens", "max_tokens", "warmup", "settle",
              "healthz_ms")  # fmt: skip


def summarize(
    args: argparse.Namespace, phases: list[Phase], rec: Recorder, gib_idle: dict[str, Any], gateway: Service
) -> dict[str, Any]:
    records = []
    last: dict[str, dict[str, int]] = {}  # each worker's counters when it was last heard
    for p in phases:
        # Only a worker heard at both ends has a delta: one that never answered a new connection is left out.
        delta = {
            pid: {name: value - last[pid].get(name, 0) for name, value in counters.items()}
            for pid, counters in p.by_worker.items()
            if pid in last
        }
        last.update(p.by_worker)
        health = rec.health.get(p.index, [])
        per_worker: dict[int, list[float]] = defaultdict(list)
        for latency, pid in health:
            per_worker[pid].append(latency)
        record: dict[str, Any] = {
            "index": p.index, "kind": p.kind, "pair": p.pair, "rep": p.rep, "cores_busy": p.cores,
            "turns_ms": _ms(rec.turns.get(p.index, [])),
            "healthz_ms": _ms([h for h, _ in health]),
            "healthz_by_worker": {str(pid): _ms(v) for pid, v in sorted(per_worker.items())},
            "counters_by_worker": delta,  # since the last scrape (the settle time before the phase included)
            "healthz_worst_worker_p99_ms": max(
                (round(1000 * percentile(v, 0.99), 3) for v in per_worker.values()), default=None
            ),
            "client_loop_lag_ms": _ms(rec.lag.get(p.index, [])),
            "errors": len(rec.errors.get(str(p.index), [])),
            "probe_errors": len(rec.probe_errors.get(str(p.index), [])),
        }  # fmt: skip
        if p.hostile is not None:
            record["hostile"] = {
                **p.hostile,
                "first_byte_ms_median": _median([1000 * t for t in p.hostile["first_byte_s"]]),
            }
        records.append(record)
    by_index = {r["index"]: r for r in records}
    rows = []
    for kind in [*args.kinds, "end"]:
        for phase_kind in ("baseline",) if kind == "end" else ("baseline", kind):
            mine = [r for r in records if r["pair"] == kind and r["kind"] == phase_kind]
            row: dict[str, Any] = {
                "pair": kind, "phase": phase_kind,
                "turns": sum(r["turns_ms"]["count"] for r in mine),
                "errors": sum(r["errors"] for r in mine),
                "p50_ms": _median([r["turns_ms"].get("p50", math.nan) for r in mine]),
                "p99_ms": _median([r["turns_ms"].get("p99", math.nan) for r in mine]),
                "healthz_p50_ms": _median([r["healthz_ms"].get("p50", math.nan) for r in mine]),
                "healthz_p99_ms": _median([r["healthz_ms"].get("p99", math.nan) for r in mine]),
                "healthz_worst_worker_p99_ms": _median(
                    [r["healthz_worst_worker_p99_ms"] or math.nan for r in mine]),
                "client_lag_p99_ms": _median([r["client_loop_lag_ms"].get("p99", math.nan) for r in mine]),
                "cores_busy": {g: _median([r["cores_busy"].get(g, math.nan) for r in mine])
                               for g in ("gateway", "agents", "hostile")},
            }  # fmt: skip
            if phase_kind != "baseline":
                # Each hostile phase against the mean of the baselines just before and after it: the same
                # minute of the same box, so a drift of the neighbours' load cancels.
                ratios = [
                    r["turns_ms"].get("p99", math.nan)
                    / statistics.fmean(
                        by_index[i]["turns_ms"].get("p99", math.nan) for i in (r["index"] - 1, r["index"] + 1)
                    )
                    for r in mine
                ]
                row["p99_ratio_per_rep"] = [round(x, 3) for x in ratios]
                row["p99_ratio"] = _median(ratios)
                row["hostile_requests"] = sum(r["hostile"]["requests"] for r in mine)
                outcomes: Counter[str] = Counter()
                finishes: Counter[str] = Counter()
                for r in mine:
                    outcomes.update(r["hostile"]["outcomes"])
                    finishes.update(r["hostile"]["finish_reasons"])
                row["hostile_outcomes"] = dict(outcomes)
                row["hostile_finish_reasons"] = dict(finishes)
                row["hostile_worker"] = _hostile_worker(mine, args.workers)
                row["hostile_first_byte_ms"] = _median([1000 * t for r in mine for t in r["hostile"]["first_byte_s"]])
            rows.append(row)
    gib_idle_ms = _median([1000 * t for t in gib_idle["first_byte_s"]])
    gib_row = next((r for r in rows if r["phase"] == "gib"), None)
    targets = {
        f"{kind}_p99_within_{TARGET_RATIO:g}x": (r["p99_ratio"] is not None and r["p99_ratio"] <= TARGET_RATIO)
        for kind in TARGET_KINDS
        for r in rows
        if r["phase"] == kind
    }
    targets["agents_errors_zero"] = not any(rec.errors.values())
    targets["gib_idle_413_under_100ms"] = (
        gib_idle_ms is not None and gib_idle_ms < 1000 * GIB_TARGET_S and set(gib_idle["outcomes"]) == {"413"}
    )
    if gib_row is not None:
        targets["gib_under_load_413_under_100ms"] = (
            gib_row["hostile_first_byte_ms"] is not None and gib_row["hostile_first_byte_ms"] < 1000 * GIB_TARGET_S
        )
    log = list(gateway.output)
    return {
        "meta": {
            "argv": sys.argv,
            "cpus": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0],
            "commit": _commit(args.source),
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
            "source": args.source,
            **{k: getattr(args, k) for k in _META_ARGS},
        },
        "gib_idle": {**gib_idle, "first_byte_ms_median": gib_idle_ms},
        "rows": rows,
        "targets": targets,
        "errors": {k: v[:10] for k, v in rec.errors.items()},
        "probe_errors": {k: v[:10] for k, v in rec.probe_errors.items()},
        # At --log-level warning a healthy run logs nothing past start-up: every line is worth reading.
        "gateway_log": [line.rstrip() for line in log if "READY" not in line and "agents use" not in line][-50:],
        "phases": records,
    }


def _hostile_worker(records: list[dict[str, Any]], workers: int) -> dict[str, float] | None:
    """The worker that answered most 413s in these phases: its share of them, and of the agents' turns
    (None unless every worker was heard before and after each phase)."""
    refused: Counter[str] = Counter()
    turns: Counter[str] = Counter()
    if any(len(r["counters_by_worker"]) < workers for r in records):
        return None
    for r in records:
        for pid, counters in r["counters_by_worker"].items():
            refused[pid] += counters.get("http_413", 0)
            turns[pid] += counters.get("requests", 0) - counters.get("http_413", 0)  # the agents get no 413s
    if not refused or not sum(refused.values()):
        return None
    pid, n = refused.most_common(1)[0]
    return {
        "pid": int(pid),
        "share_of_413": round(n / sum(refused.values()), 3),
        "share_of_agent_turns": round(turns[pid] / max(1, sum(turns.values())), 3),
    }


def _commit(source: str) -> str:
    """The source checkout's commit, with "+dirty" when its tracked files differ from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=source, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=source,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "?"


def _f(value: Any, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = [
        f"Hostile input: {meta['agents']} agents, {meta['workers']} workers, {meta['duration']:g} s a phase, "
        f"{meta['reps']} reps (commit {meta['commit']}, load {meta['load_avg_1m']:.2f}); medians over reps.",
        "",
        "| phase | agents' turns | errors | p50 ms | p99 ms | p99 / baseline (per rep) | /healthz p50 / p99 ms "
        "| client loop lag p99 ms | cores busy: gateway / agents / hostile | hostile requests | hostile answers "
        "| hostile median time to answer ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        hostile = r["phase"] != "baseline"
        name = r["phase"] if hostile else "baseline (last)" if r["pair"] == "end" else f"baseline (before {r['pair']})"
        ratio = answers = answer_ms = ""
        if hostile:
            ratio = f"{_f(r['p99_ratio'], 2)} ({', '.join(f'{x:.2f}' for x in r['p99_ratio_per_rep'])})"
            answers = ", ".join(f"{k}: {v}" for k, v in sorted(r["hostile_outcomes"].items()))
            if r["hostile_finish_reasons"]:
                answers += " (finish " + ", ".join(f"{k}: {v}" for k, v in r["hostile_finish_reasons"].items()) + ")"
            answer_ms = _f(r["hostile_first_byte_ms"])
        cores = " / ".join(_f(r["cores_busy"][g], 2) for g in ("gateway", "agents", "hostile"))
        lines.append(
            f"| {name} | {r['turns']} | {r['errors']} | {_f(r['p50_ms'])} | {_f(r['p99_ms'])} | {ratio} "
            f"| {_f(r['healthz_p50_ms'])} / {_f(r['healthz_p99_ms'])} | {_f(r['client_lag_p99_ms'])} | {cores} "
            f"| {r.get('hostile_requests', '')} | {answers} | {answer_ms} |"
        )
    gib = result["gib_idle"]
    lines += [
        "",
        f"1 GiB Content-Length on the idle gateway: median {_f(gib['first_byte_ms_median'], 2)} ms to the answer "
        f"over {gib['requests']} requests ({', '.join(f'{k}: {v}' for k, v in gib['outcomes'].items())}).",
    ]
    shares = [
        f"{r['phase']} {100 * w['share_of_413']:.0f}% of the 413s and served {100 * w['share_of_agent_turns']:.0f}% "
        "of the agents' turns"
        for r in result["rows"]
        if r["phase"] != "baseline" and (w := r.get("hostile_worker"))
    ]
    if shares and meta["workers"] > 1:
        lines += ["", "The worker that refused most of the hostile's requests took: " + "; ".join(shares) + "."]
    lines += [
        "",
        "Targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in result["targets"].items()) + ".",
    ]
    if result["gateway_log"]:
        lines += [
            "",
            f"The gateway logged {len(result['gateway_log'])} lines at warning level or above (see the JSON).",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench-results/hostile.json", help="the JSON result; the markdown goes beside it")
    p.add_argument("--reps", type=int, default=3, help="baseline/hostile pairs per kind")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per phase")
    p.add_argument("--agents", type=int, default=16, help="well-behaved agents")
    p.add_argument("--workers", type=int, default=1, help="the gateway's worker processes")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"hostile phases, comma-separated: {', '.join(KINDS)}")
    p.add_argument("--turns", type=int, default=8, help="turns per agent episode (then a new conversation)")
    p.add_argument("--step-tokens", type=int, default=120, help="tokens each tool result / user message adds")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--warmup", type=float, default=4.0, help="seconds of unrecorded load before the first phase")
    p.add_argument("--settle", type=float, default=1.0, help="unrecorded seconds after each phase")
    p.add_argument("--healthz-ms", type=float, default=20.0, help="pause between two /healthz probes")
    p.add_argument("--gib-samples", type=int, default=7, help="1 GiB requests timed on the idle gateway")
    p.add_argument(
        "--source",
        default=str(HERE.parent),
        help="the checkout whose gateway runs (e.g. a `git worktree` of an older commit); default this one",
    )
    args = p.parse_args()
    args.kinds = [k for k in args.kinds.split(",") if k]
    if set(args.kinds) - set(KINDS) or not args.kinds:
        raise SystemExit(f"--kinds: choose from {', '.join(KINDS)}")
    args.run_id = str(time.time())
    # SIGTERM unwinds like Ctrl-C, so the `finally` below stops the gateway's process group.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from trainer_client import TrainerClient

    source = Path(args.source).resolve()
    # Started in the checkout, so `-m` puts it first on sys.path: `serve` and the broker it starts
    # import that checkout, not an installed copy.
    cmd = [sys.executable, "-u", "-m", "gateway_workers.cli", "serve", "--host", "127.0.0.1", "--port", "0",
           "--control", "tcp://127.0.0.1:0", "--workers", str(args.workers), "--engine-kind", "mock",
           "--log-level", "warning"]  # fmt: skip
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(source), os.environ.get("PYTHONPATH")]))}
    hostile: Hostile | None = None
    gateway: Service | None = None
    here = os.getcwd()
    try:
        os.chdir(source)  # Popen starts the child in the current directory
        try:
            gateway = Service("serve", cmd, GATEWAY_READY, env=env)
        finally:
            os.chdir(here)
        match = gateway.wait_ready()
        print(f"gateway ready: {match.group(1)}, process group {gateway.proc.pid} (for a profiler)", file=sys.stderr)
        hostile = Hostile()
        with TrainerClient(match.group(2), timeout=CLIENT_TIMEOUT_S) as client:
            result = asyncio.run(run(args, gateway, match.group(1), client, hostile))
    finally:
        if hostile is not None:
            hostile.close()
        if gateway is not None:
            gateway.stop()
    write_results(args.out, result, markdown(result))


if __name__ == "__main__":
    main()
