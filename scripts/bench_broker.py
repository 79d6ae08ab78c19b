"""Broker benchmark: commit ingest rate, finish_session latency, and memory per session.

A thin CLI over public parts: the broker runs as `python -m broker` (a subprocess on
port 0), publishers are separate processes speaking `broker.protocol` over plain zmq
DEALERs like workers do, and the trainer side is `trainer_client.TrainerClient`.
Measures (the performance targets in docs/performance.md): commits/s of ~4k-token prompts with
100-token outputs from 4 concurrent publishers (growing sessions, so prefixes are shared as in real traffic) and
the broker's own CPU per commit (publishers share the cores, so commits/s alone understates
the broker; split into its main thread and the rest, libzmq's I/O thread), side by side with a
bare zmq echo fed the same frames by the same publishers; the broker's per-commit hot path
in-process (and the worker's cost of building the commit); finish_session latency of a 50-turn
session whose final context is 32k tokens; broker RSS per such session against its final token
count (from the broker at rest after a warm-up session; 20 sessions interleaved, each living 10x
the broker's compact_age_s, then a wait for their last bytes to age and be compressed, and for
the broker's next heap trim: the output says so). Commits are deltas against the sender's
previous turn, as a worker sends them (`gateway_workers.capture.commit_bases`); `--full-commits`
also measures whole-turn commits in the same run. Durability (`--state-dir`): `durable` runs the ingest
with no state directory and with one under each fsync policy side by side (and the commit path
in-process, steadier on a shared box; `--durable-prefill-mib` first fills the broker with live
sessions, so that snapshots rewrite a large state meanwhile), `recovery` kill -9s a durable broker
holding `--recovery-mib` MiB of live log and times its restart to READY, against an in-memory
broker's start. Prints medians of --runs runs.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from broker import protocol  # noqa: E402
from broker.config import BrokerConfig  # noqa: E402
from broker.sessions.compaction import AGE_BUCKETS  # noqa: E402
from gateway_workers.capture.commit_bases import CommitBases  # noqa: E402
from trainer_client import TrainerClient  # noqa: E402

READY_TIMEOUT_S = 30.0
REPLY_TIMEOUT_S = 30.0
IDLE_SETTLE_S = 0.5  # after the memory sessions: ample idle time for the broker's compaction to catch up
COMPACTION_TIMEOUT_S = 60.0  # the broker must have compressed the aged sessions by then
COMPACTION_POLL_S = 0.2
CHARS_PER_TOKEN = 4  # English BPE: message text size tracks token count like this
_READY = re.compile(r"BROKER READY worker=(\S+) control=(\S+)")


# --- synthetic episodes ----------------------------------------------------------------


def episode(seed: int, n_turns: int, first_prompt: int, tail: int, output: int) -> list[dict[str, Any]]:
    """A growing episode: prompt[k+1] = prompt[k] + output[k] + tail; messages grow alike."""
    rng = random.Random(seed)

    def ids(n: int) -> array:
        return array("i", rng.choices(range(1000, 150_000), k=n))

    def text(n_tokens: int) -> str:
        return "".join(rng.choices("abcdefghij klmnopqrst uvwxyz", k=n_tokens * CHARS_PER_TOKEN))

    prompt = ids(first_prompt)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": text(200)},
        {"role": "user", "content": text(first_prompt - 200)},
    ]
    turns = []
    for _ in range(n_turns):
        out = ids(output)
        response = {"role": "assistant", "content": text(output)}
        turns.append(
            {
                "prompt_ids": prompt,
                "output_ids": out,
                "logprobs": array("f", [-0.5] * output),
                "prompt_messages": list(messages),
                "response_message": response,
            }
        )
        prompt = prompt + out + ids(tail)
        messages = [*messages, response, {"role": "user", "content": text(tail)}]
    return turns


def commit_of(rid: int, sid: str, turn_id: str, t: dict[str, Any]) -> protocol.CommitTurn:
    """The full commit of one synthetic turn."""
    return protocol.CommitTurn(
        rid, sid, turn_id, t["prompt_ids"], t["output_ids"], t["logprobs"], "stop",
        t["prompt_messages"], t["response_message"],
    )  # fmt: skip


def as_sent(bases: CommitBases | None, commit: protocol.CommitTurn) -> protocol.CommitTurn:
    """What a worker sends for `commit`: a delta against its session's last turn (`bases`), or the full turn.

    The turn becomes its session's base at once: publishers send each session's next turn
    only after more than a window of other commits, so its base has been ACKed by then.
    """
    if bases is None:
        return commit
    delta, prompt_crc32 = bases.delta_and_crc(commit)  # as the worker's backplane does
    bases.remember(commit, prompt_crc32)
    return delta or commit


# --- broker subprocess -------------------------------------------------------------------


def start_broker(extra: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "broker", "--worker-endpoint", "tcp://127.0.0.1:0", "--control", "tcp://127.0.0.1:0"]
        + ["--log-level", "WARNING", *extra],
        cwd=Path(__file__).resolve().parent.parent,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        m = _READY.search(line)
        if m:
            return proc, m.group(1), m.group(2)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError("broker did not print its READY line")


def stop_broker(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU time each live thread has used so far, by thread id (schedstat: nanoseconds, not clock ticks)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[task.name] = int((task / "schedstat").read_text().split()[0]) / 1e9
        except (FileNotFoundError, ProcessLookupError):  # a thread that just exited
            continue
    return out


def cpu_seconds(pid: int) -> float:
    """CPU time the process's live threads have used so far."""
    return sum(thread_cpu_seconds(pid).values())


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


# --- publishers ----------------------------------------------------------------------------


class Worker:
    """A blocking worker-side DEALER with a window of outstanding requests."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def recv(self) -> protocol.Message:
        if not self.sock.poll(int(REPLY_TIMEOUT_S * 1000)):
            raise TimeoutError("broker did not answer")
        return protocol.decode_broker_to_worker(self.sock.recv())

    def pipeline(self, frames: list[bytes], window: int) -> list[protocol.Message]:
        replies = []
        sent = 0
        while len(replies) < len(frames):
            while sent < len(frames) and sent - len(replies) < window:
                self.sock.send(frames[sent])
                sent += 1
            replies.append(self.recv())
        return replies


def publisher(
    endpoint: str, sids: list[str], seed: int, args: dict[str, Any], ready: Any, start: Any, results: Any
) -> None:
    ctx = zmq.Context()
    w = Worker(ctx, endpoint)
    n_turns = args["turns"]
    eps = [
        episode(seed * 100_000 + i, n_turns, args["first_prompt"], args["tail"], args["output"])
        for i in range(len(sids))
    ]
    rid = 0
    opens, commits = [], []
    bases = None if args["full"] else CommitBases(max_sessions=len(sids) + 1)
    # turn-major order: every session has a turn in flight, as with many concurrent agents
    for k in range(n_turns):
        for sid, ep in zip(sids, eps, strict=True):
            t = ep[k]
            rid += 1
            opens.append(protocol.encode(protocol.OpenTurn(rid, sid, f"{sid}-{k}")))
            rid += 1
            commits.append(protocol.encode(as_sent(bases, commit_of(rid, sid, f"{sid}-{k}", t))))
    if not args["baseline"]:
        replies = w.pipeline(opens, args["window"])
        assert all(isinstance(r, protocol.TurnOpened) for r in replies), replies[:3]
    ready.put(True)
    start.wait()
    t0 = time.monotonic()
    replies = w.pipeline(commits, args["window"])
    t1 = time.monotonic()
    stored = sum(1 for r in replies if isinstance(r, protocol.TurnCommitted) and r.outcome == "stored")
    results.put(
        {
            "t0": t0,
            "t1": t1,
            "commits": len(commits),
            "stored": stored,
            "bytes": sum(map(len, commits)),
            "prompt_tokens": sum(len(e[k]["prompt_ids"]) for e in eps for k in range(n_turns)),
        }
    )
    w.sock.close(0)
    ctx.term()


def echo_server(endpoint_out: Any, stop: Any) -> None:
    """The baseline: a bare ROUTER that answers every frame with a fixed small reply, decoding nothing."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    sock.bind("tcp://127.0.0.1:0")
    endpoint_out.put(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    reply = protocol.encode(protocol.TurnCommitted(0, "t", "stored"))
    send = zmq.backend.Socket.send  # the broker's own way of sending parts (broker/server.py)
    received = 0
    while not stop.is_set():
        if not sock.poll(100):
            continue
        peers = []
        for _ in range(64):  # the broker's batching and receive calls, so only the per-message work differs
            try:
                peer = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            part = sock.recv(zmq.NOBLOCK, copy=False)
            while part.more:
                part = sock.recv(zmq.NOBLOCK, copy=False)
            received += len(part.bytes)  # the payload is read as the broker reads it, then dropped
            peers.append(peer)
        for peer in peers:
            send(sock, peer, zmq.SNDMORE | zmq.NOBLOCK)
            send(sock, reply, zmq.NOBLOCK)
    ctx.destroy(linger=0)


def bench_ingest(args: argparse.Namespace) -> dict[str, float]:
    base = ingest_run(args, baseline=True, full=False)
    out = ingest_run(args, baseline=False, full=False)
    out["baseline_zmq_echo_msgs_per_s"] = base["commits_per_s"]
    out["baseline_echo_cpu_us_per_msg"] = base["broker_cpu_us_per_commit"]
    out["baseline_echo_main_thread_us_per_msg"] = base["main_thread_us_per_commit"]
    out["ratio_to_zmq_echo"] = out["commits_per_s"] / base["commits_per_s"]
    if args.full_commits:  # the old way, same run, same sessions and turns
        full = ingest_run(args, baseline=False, full=True)
        for key in (
            "commits_per_s",
            "broker_cpu_us_per_commit",
            "sustainable_commits_per_s",
            "broker_cpu_util",
            "mean_frame_kib",
            "tokens_held",
        ):
            out[f"full_{key}"] = full[key]
    return out


def ingest_run(
    args: argparse.Namespace, baseline: bool, full: bool, extra: list[str] | None = None, prefill: int = 0
) -> dict[str, float]:
    spawn = mp.get_context("spawn")
    stop = spawn.Event()
    if baseline:
        endpoints = spawn.Queue()
        server = spawn.Process(target=echo_server, args=(endpoints, stop))
        server.start()
        worker_ep, pid = endpoints.get(timeout=30), server.pid
    else:
        proc, worker_ep, control_ep = start_broker(extra or [], durable_env(args) if extra else None)
        pid = proc.pid
    try:
        per = args.sessions // args.publishers
        if per <= args.window:
            raise SystemExit("--sessions / --publishers must exceed --window (a delta's base must be ACKed first)")
        if baseline:
            sids = [[f"p{p}-s{i}" for i in range(per)] for p in range(args.publishers)]
        else:
            client = TrainerClient(control_ep, timeout=60)
            if prefill:  # live sessions the broker holds while the publishers commit (snapshots rewrite them)
                fill_ctx = zmq.Context()
                filler = Worker(fill_ctx, worker_ep)
                fill_sessions(client, filler, prefill, args)
                filler.sock.close(0)
                fill_ctx.term()
            deltas_before = client.stats()["commits_delta"]
            sids = [[client.open_session(session_id=f"p{p}-s{i}".ljust(22, "-")) for i in range(per)]
                    for p in range(args.publishers)]
        if baseline:
            deltas_before = 0
        start, ready, results = spawn.Event(), spawn.Queue(), spawn.Queue()
        params = {
            "turns": args.turns,
            "first_prompt": args.first_prompt,
            "tail": args.tail,
            "output": args.output,
            "window": args.window,
            "baseline": baseline,
            "full": full,
        }
        procs = [
            spawn.Process(target=publisher, args=(worker_ep, sids[p], p + 1, params, ready, start, results))
            for p in range(args.publishers)
        ]
        for p in procs:
            p.start()
        for _ in procs:  # every publisher has built its frames and opened its turns
            ready.get(timeout=600)
        rss0, threads0 = rss_bytes(pid), thread_cpu_seconds(pid)
        start.set()
        res = [results.get(timeout=600) for _ in procs]
        threads = thread_cpu_seconds(pid)
        cpu = sum(threads.values()) - sum(threads0.values())
        # the process's main thread (its id is the pid) runs the loop; libzmq's I/O thread moves the bytes
        main_cpu = threads.get(str(pid), 0.0) - threads0.get(str(pid), 0.0)
        rss1 = rss_bytes(pid)
        for p in procs:
            p.join(30)
        t0, t1 = min(r["t0"] for r in res), max(r["t1"] for r in res)
        commits = sum(r["commits"] for r in res)
        assert sum(r["stored"] for r in res) == commits
        stats = {"tokens_held": 0, "commits_delta": 0} if baseline else client.stats()
        if not baseline:
            deltas = commits - commits // args.turns  # every turn but each session's first
            assert stats["commits_delta"] - deltas_before == (0 if full else deltas), stats["commits_delta"]
        out = {
            "commits": commits,
            "seconds": t1 - t0,
            "commits_per_s": commits / (t1 - t0),
            # the publishers share this machine's cores with the broker (util < 1: they starve it),
            # so its CPU per commit is the primary figure, and the rate one fully busy core sustains
            "broker_cpu_us_per_commit": 1e6 * cpu / commits,
            "main_thread_us_per_commit": 1e6 * main_cpu / commits,
            "other_threads_us_per_commit": 1e6 * (cpu - main_cpu) / commits,
            "sustainable_commits_per_s": commits / cpu,
            "broker_cpu_util": cpu / (t1 - t0),
            "mean_prompt_tokens": sum(r["prompt_tokens"] for r in res) / commits,
            "mean_frame_kib": sum(r["bytes"] for r in res) / commits / 1024,
            "MiB_per_s": sum(r["bytes"] for r in res) / (t1 - t0) / 2**20,
            "broker_rss_growth_MiB": (rss1 - rss0) / 2**20,
            "tokens_held": stats["tokens_held"],
            "wal_MiB": stats.get("wal_bytes_written", 0) / 2**20,
            "wal_syncs": stats.get("wal_syncs", 0),
            "snapshots_written": stats.get("snapshots_written", 0),
        }
        if not baseline:
            client.close()
        return out
    finally:
        if baseline:
            stop.set()
            server.join(10)
        else:
            stop_broker(proc)


# --- durability: ingest with a state directory, recovery time -----------------------------------

DURABLE_MODES = ("none", "interval", "always", "never")


def bench_durable(args: argparse.Namespace) -> dict[str, float]:
    """The ingest run without a state directory and with one under each fsync policy, in one run."""
    out: dict[str, float] = durable_hot_path(args)
    for mode in DURABLE_MODES:
        state_dir = tempfile.mkdtemp(prefix="bench-state-", dir=args.state_parent)
        try:
            extra = [] if mode == "none" else ["--state-dir", state_dir, "--fsync", mode]
            r = ingest_run(args, baseline=False, full=False, extra=extra, prefill=args.durable_prefill_mib << 20)
        finally:
            shutil.rmtree(state_dir, ignore_errors=True)
        for key in (
            "commits_per_s", "broker_cpu_us_per_commit", "sustainable_commits_per_s", "wal_MiB", "wal_syncs",
            "snapshots_written",
        ):  # fmt: skip
            out[f"{mode}_{key}"] = r[key]
    for mode in DURABLE_MODES[1:]:
        out[f"{mode}_ratio"] = out[f"{mode}_commits_per_s"] / out["none_commits_per_s"]
        out[f"{mode}_cpu_ratio"] = out["none_broker_cpu_us_per_commit"] / out[f"{mode}_broker_cpu_us_per_commit"]
    return out


def durable_hot_path(args: argparse.Namespace) -> dict[str, float]:
    """The commit path in-process (thread CPU, no sockets): decode, store, ACK, and with a state directory the
    log's append per commit and its write per batch of DRAIN_BATCH, as the server does; the log's fsync
    policy's own thread (interval) or syncs (always) included. Far steadier than the socket runs on a shared box.
    """
    from broker.durability.journal import Journal  # in-process on purpose: this isolates the hot path
    from broker.durability.wal import LogWriter
    from broker.server import DRAIN_BATCH
    from broker.sessions.registry import SessionRegistry

    sessions = args.sessions
    eps = [episode(i, args.turns, args.first_prompt, args.tail, args.output) for i in range(sessions)]
    bases = CommitBases(max_sessions=sessions + 1)
    frames = [
        protocol.encode(as_sent(bases, commit_of(1, f"s{s}", f"t{k}", eps[s][k])))
        for k in range(args.turns)
        for s in range(sessions)
    ]
    del eps
    protocol.decode_worker_to_broker(frames[0])  # the decoder is generated on the first frame: not timed
    encode_committed = protocol.frame_encoder(protocol.TurnCommitted)
    out: dict[str, float] = {}
    for mode in DURABLE_MODES:
        reg = SessionRegistry(max_sessions=sessions)
        for s in range(sessions):
            reg.open_session(f"s{s}", {}, None, None, {})
            for k in range(args.turns):
                reg.open_turn(f"s{s}", f"t{k}")
        state_dir = tempfile.mkdtemp(prefix="bench-hot-", dir=args.state_parent)
        writer = None if mode == "none" else LogWriter(
            Path(state_dir), 0, fsync=mode, interval_s=BrokerConfig().fsync_interval_ms / 1000,  # type: ignore[arg-type]
            segment_bytes=BrokerConfig().wal_segment_bytes,
        )  # fmt: skip
        journal = Journal(writer) if writer is not None else None
        try:
            cpu0 = time.process_time()  # every thread of this process: the syncer's fsyncs count
            for i, frame in enumerate(frames):
                msg = protocol.decode_worker_to_broker(frame)
                outcome = reg.commit_turn(msg)
                if journal is not None and outcome == "stored":
                    journal.worker_frame(frame)
                encode_committed(request_id=msg.request_id, turn_id=msg.turn_id, outcome=outcome)
                if writer is not None and i % DRAIN_BATCH == DRAIN_BATCH - 1:
                    writer.commit()
            if writer is not None:
                writer.close()
            cpu = time.process_time() - cpu0
        finally:
            shutil.rmtree(state_dir, ignore_errors=True)
        out[f"{mode}_hot_path_us"] = 1e6 * cpu / len(frames)
    for mode in DURABLE_MODES[1:]:
        out[f"{mode}_hot_path_ratio"] = out["none_hot_path_us"] / out[f"{mode}_hot_path_us"]
    return out


def bench_recovery(args: argparse.Namespace) -> dict[str, float]:
    """kill -9 of a durable broker holding N MiB of live log, then the time from its restart to READY.

    The state is long sessions (--long-turns turns growing to --long-context tokens, delta commits) opened
    and committed in waves until the commit frames of live sessions add up to N MiB (what a broker without
    snapshots would have to replay); snapshots run as they would. Side by side: an in-memory broker's
    start to READY (the floor: the interpreter, imports, binding).
    """
    out: dict[str, float] = {}
    t0 = time.monotonic()
    proc, _, _ = start_broker([])
    out["in_memory_start_s"] = time.monotonic() - t0
    stop_broker(proc)
    for mib in args.recovery_mib:
        state_dir = tempfile.mkdtemp(prefix="bench-recovery-", dir=args.state_parent)
        try:
            out.update({f"{mib}MiB_{k}": v for k, v in recovery_run(args, state_dir, mib << 20).items()})
        finally:
            shutil.rmtree(state_dir, ignore_errors=True)
    return out


def durable_env(args: argparse.Namespace) -> dict[str, str]:
    """The broker's snapshot bounds for the durable and recovery parts (its defaults unless given)."""
    env = {}
    if args.snapshot_max_mib is not None:
        env["ROLLOUT_BROKER_SNAPSHOT_MAX_BYTES"] = str(args.snapshot_max_mib << 20)
        env["ROLLOUT_BROKER_SNAPSHOT_MIN_BYTES"] = str(min(args.snapshot_max_mib, 64) << 20)
    return env


def recovery_run(args: argparse.Namespace, state_dir: str, target: int) -> dict[str, float]:
    extra = ["--state-dir", state_dir]
    proc, worker_ep, control_ep = start_broker(extra, durable_env(args))
    ctx = zmq.Context()
    try:
        client = TrainerClient(control_ep, timeout=120)
        w = Worker(ctx, worker_ep)
        logged = fill_sessions(client, w, target, args)
        before = client.stats()
        client.close()
        os.killpg(proc.pid, signal.SIGKILL)  # at whatever point its log and snapshots are
        proc.wait(30)
        on_disk = sum(f.stat().st_size for f in Path(state_dir).iterdir())
        t0 = time.monotonic()
        proc, worker_ep, control_ep = start_broker(extra, durable_env(args))
        restart = time.monotonic() - t0
        client = TrainerClient(control_ep, timeout=120)
        after = client.stats()
        client.close()
        w.sock.close(0)
        for key in ("sessions_open", "turns_held", "tokens_held"):
            assert after[key] == before[key], (key, before[key], after[key])
        return {
            "live_log_MiB": logged / 2**20,
            "state_dir_MiB": on_disk / 2**20,
            "bytes_held_MiB": before["bytes_held"] / 2**20,
            "sessions": before["sessions_open"],
            "restart_to_ready_s": restart,
            "recovery_s": after["recovery_s"],
            "replayed_log_MiB": after["recovered_log_bytes"] / 2**20,
            "replayed_records": after["recovered_records"],
            "snapshot_MiB": after["last_snapshot_bytes"] / 2**20,
        }
    finally:
        ctx.term()
        stop_broker(proc)


def fill_sessions(client: TrainerClient, w: Worker, target: int, args: argparse.Namespace) -> int:
    """Open long sessions and commit their turns (waves of sessions, turn-major) until `target` bytes of commit
    frames are held; returns the bytes sent. One episode's commits are built once and sent for every session
    (each session stores its own copy: nothing is shared between sessions)."""
    _, frames, _ = session_frames(client, 7, args)  # encoded for one session: its commits as messages below
    template = [protocol.decode_worker_to_broker(commit) for _, commit in frames]
    per_session = sum(len(commit) for _, commit in frames)
    n_sessions = max(1, -(-target // per_session))
    sent, rid = 0, 0
    wave = args.recovery_wave
    for first in range(0, n_sessions, wave):
        n = min(wave, n_sessions - first)
        sids = [client.open_session(max_context_tokens=args.long_context + 1024) for _ in range(n)]
        for msg in template:
            batch = []
            for sid in sids:
                rid += 2
                batch.append(protocol.encode(protocol.OpenTurn(rid - 1, sid, msg.turn_id)))
                commit = protocol.encode(dataclasses.replace(msg, request_id=rid, session_id=sid))
                batch.append(commit)
                sent += len(commit)
            replies = w.pipeline(batch, args.window)
            bad = [r for r in replies if isinstance(r, protocol.Refused)]
            assert not bad, bad[:3]
    return sent


# --- finish latency and memory per session ---------------------------------------------------


def long_session(
    client: TrainerClient, w: Worker, seed: int, args: argparse.Namespace, full: bool = False
) -> tuple[str, int]:
    sid, frames, final = session_frames(client, seed, args, full)
    for f in frames:  # one turn after the other, like one agent
        send_turn(w, f)
    return sid, final


def session_frames(
    client: TrainerClient, seed: int, args: argparse.Namespace, full: bool = False
) -> tuple[str, list[tuple[bytes, bytes]], int]:
    """Open a long session; its turns' (OPEN, COMMIT) frames and its final context length."""
    n = args.long_turns
    output = args.output
    first = args.long_first_prompt
    tail = (args.long_context - first - n * output) // (n - 1)
    ep = episode(seed, n, first, tail, output)
    sid = client.open_session(max_context_tokens=args.long_context + 1024)
    frames = []
    bases = None if full else CommitBases()
    for k, t in enumerate(ep):
        opened = protocol.encode(protocol.OpenTurn(2 * k, sid, f"t{k}"))
        frames.append((opened, protocol.encode(as_sent(bases, commit_of(2 * k + 1, sid, f"t{k}", t)))))
    final = len(ep[-1]["prompt_ids"]) + output
    return sid, frames, final


def send_turn(w: Worker, frames: tuple[bytes, bytes]) -> None:
    for f in frames:
        w.sock.send(f)
        reply = w.recv()
        assert not isinstance(reply, protocol.Refused), reply


def bench_finish(args: argparse.Namespace) -> dict[str, float]:
    proc, worker_ep, control_ep = start_broker([])
    ctx = zmq.Context()
    try:
        client = TrainerClient(control_ep, timeout=60)
        w = Worker(ctx, worker_ep)
        latencies, rows = [], 0
        final = 0
        for i in range(args.finish_sessions):
            sid, final = long_session(client, w, 1000 + i, args)
            t0 = time.perf_counter()
            records = client.finish_session(sid, reward=1.0, wait_timeout=0)
            latencies.append(time.perf_counter() - t0)
            rows = len(records)
        client.close()
        w.sock.close(0)
        return {
            "finish_ms_median": 1000 * statistics.median(latencies),
            "finish_ms_max": 1000 * max(latencies),
            "final_context_tokens": final,
            "rows": rows,
        }
    finally:
        ctx.term()
        stop_broker(proc)


def bench_memory(args: argparse.Namespace) -> dict[str, float]:
    out = memory_run(args, full=False)
    # the same sessions with the broker's idle-time compaction off: its memory and CPU side by side
    plain = memory_run(args, full=False, compact=False)
    for key in ("rss_bytes_per_token", "gauge_bytes_per_token", "broker_cpu_us_per_commit"):
        out[f"no_compaction_{key}"] = plain[key]
    if args.full_commits:
        full = memory_run(args, full=True)
        for key in ("rss_bytes_per_token", "gauge_bytes_per_token", "tokens_held_per_session"):
            out[f"full_{key}"] = full[key]
    return out


def memory_run(args: argparse.Namespace, full: bool, compact: bool = True) -> dict[str, float]:
    env = {
        "ROLLOUT_BROKER_COMPACT_IDLE": "1" if compact else "0",
        "ROLLOUT_BROKER_COMPACT_AGE_S": str(args.compact_age),
    }
    proc, worker_ep, control_ep = start_broker([], env)
    ctx = zmq.Context()
    try:
        client = TrainerClient(control_ep, timeout=60)
        w = Worker(ctx, worker_ep)
        sid, _ = long_session(client, w, 1, args, full)  # warm up allocator and code paths
        client.drop_session(sid)
        # Built before the baseline: the frames live in this process, but building them takes time.
        sessions = [session_frames(client, 2000 + i, args, full) for i in range(args.memory_sessions)]
        final = sessions[0][2]
        # The baseline is the broker at rest: past its next heap trim, which gives back what the warm-up
        # freed (else the sessions would first refill those resident free pages, and seem to cost less).
        rest_s = IDLE_SETTLE_S + BrokerConfig().trim_interval_s
        time.sleep(rest_s)
        # Sessions live as long as agents' do, interleaved: the broker compresses a session's bytes
        # once they are compact_age_s old, so how long a session lives decides what it holds raw.
        # (Paced the same with compaction off, so that the broker CPU per commit compares like for like.)
        life = args.session_life * args.compact_age
        print(
            f"memory: {len(sessions)} sessions interleaved, each living {life:.1f} s "
            f"({args.session_life:g} x compact_age_s={args.compact_age:g}), compaction {'on' if compact else 'off'}",
            file=sys.stderr,
        )
        base, cpu0 = rss_bytes(proc.pid), cpu_seconds(proc.pid)
        t0 = time.monotonic()
        for k in range(args.long_turns):
            for _, frames, _ in sessions:
                send_turn(w, frames[k])
            time.sleep(max(0.0, t0 + life * (k + 1) / args.long_turns - time.monotonic()))
        waited = wait_for_compaction(client, args.compact_age) if compact else 0.0
        # idle time: the broker compacts what the last turns left due, and trims its heap after
        time.sleep(rest_s)
        grown = rss_bytes(proc.pid) - base
        cpu = cpu_seconds(proc.pid) - cpu0
        held = client.stats()
        per_session = grown / args.memory_sessions
        client.close()
        w.sock.close(0)
        return {
            "rss_per_session_KiB": per_session / 1024,
            "final_context_tokens": final,
            "rss_bytes_per_token": per_session / final,
            "goal_bytes_per_token": 8.0,
            "gauge_bytes_per_token": held["bytes_held"] / args.memory_sessions / final,
            "tokens_held_per_session": held["tokens_held"] / args.memory_sessions,
            # everything the broker spent on these sessions' turns (OPEN + COMMIT + idle-time compaction)
            "broker_cpu_us_per_commit": 1e6 * cpu / (args.memory_sessions * args.long_turns),
            "session_life_s": life,
            "waited_for_age_s": waited,
            # the broker giving freed heap pages back (ROLLOUT_BROKER_TRIM_MIN_BYTES=0 in the environment: off)
            "heap_trims": held.get("heap_trims", 0),
            "heap_trim_pause_ms_max": held.get("heap_trim_pause_ms_max", 0.0),
            "heap_trim_released_KiB_per_session": held.get("heap_trim_released_bytes", 0) / 1024 / args.memory_sessions,
            "freed_KiB_since_trim": held.get("bytes_freed_since_trim", 0) / 1024,
            "rss_base_MiB": base / 2**20,
            "rss_end_MiB": (base + grown) / 2**20,
        }
    finally:
        ctx.term()
        stop_broker(proc)


def wait_for_compaction(client: TrainerClient, age: float) -> float:
    """Wait until the sessions' last log bytes are old enough to compress, then until the broker has; returns seconds.

    The broker compresses only bytes held `compact_age_s` (plus up to an aging bucket), so the
    sessions' last turns are still raw when they end: the measurement waits for them.
    """
    t0 = time.monotonic()
    due = age * (1 + 1 / AGE_BUCKETS)
    print(f"memory: waiting {due:.2f} s for the last turns' bytes to age past compact_age_s={age:g}", file=sys.stderr)
    time.sleep(due)
    deadline = t0 + due + COMPACTION_TIMEOUT_S
    last = -1
    while (done := client.stats()["bytes_compacted"]) != last or not done:  # until a poll sees no progress
        if time.monotonic() > deadline:
            raise TimeoutError(f"the broker was still compressing after {COMPACTION_TIMEOUT_S} s")
        last = done
        time.sleep(COMPACTION_POLL_S)
    return time.monotonic() - t0


def bench_hotpath(args: argparse.Namespace) -> dict[str, float]:
    """The broker's per-commit work without sockets, delta and full side by side (thread CPU time).

    Broker: decode, dedup store, encode the ACK, for the same turns as the ingest run in the
    same turn-major order over many sessions (each session's log is cold in cache, as under
    real load). Worker: building the frame it sends (delta: find the shared prefix, encode,
    keep the turn as the next base; full: encode), with each turn's messages fresh dicts as a
    request body parses them.
    """
    from broker.sessions.registry import SessionRegistry  # in-process on purpose: this isolates the hot path

    sessions = args.sessions
    eps = [episode(i, args.turns, args.first_prompt, args.tail, args.output) for i in range(sessions)]
    order = [(s, k) for k in range(args.turns) for s in range(sessions)]
    full_msgs = [commit_of(1, f"s{s}", f"t{k}", eps[s][k]) for s, k in order]
    del eps
    for i, msg in enumerate(full_msgs):  # fresh dicts, as parsed from each request (no identity shortcut)
        full_msgs[i] = dataclasses.replace(msg, prompt_messages=copy.deepcopy(msg.prompt_messages))

    out: dict[str, float] = {}
    for mode in ("delta", "full"):
        bases = None if mode == "full" else CommitBases(max_sessions=sessions + 1)
        t0 = time.thread_time()
        frames = [protocol.encode(as_sent(bases, msg)) for msg in full_msgs]
        out[f"{mode}_worker_build_us"] = 1e6 * (time.thread_time() - t0) / len(frames)
        out[f"{mode}_frame_kib"] = sum(map(len, frames)) / len(frames) / 1024
        out.update({f"{mode}_{k}": v for k, v in _broker_hot_path(SessionRegistry, frames, sessions, args).items()})
    out["broker_speedup"] = out["full_total_us"] / out["delta_total_us"]
    return out


def _broker_hot_path(
    registry_class: Any, frames: list[bytes], sessions: int, args: argparse.Namespace
) -> dict[str, float]:
    config = BrokerConfig()

    def fresh_registry() -> Any:
        # configured as the broker's server configures it (compaction bookkeeping included)
        reg = registry_class(
            max_sessions=sessions,
            compact=config.compact_idle,
            compact_min_bytes=config.compact_min_bytes,
            compact_age_s=config.compact_age_s,
        )
        for s in range(sessions):
            reg.open_session(f"s{s}", {}, None, None, {})
            for k in range(args.turns):
                reg.open_turn(f"s{s}", f"t{k}")
        return reg

    protocol.decode_worker_to_broker(frames[0])  # the decoder is generated on the first frame: not timed
    encode_committed = protocol.frame_encoder(protocol.TurnCommitted)  # built once, as the server does
    # the whole path, untimed inside (per-stage clocks cost a syscall each)
    reg = fresh_registry()
    t0 = time.thread_time()
    for frame in frames:
        msg = protocol.decode_worker_to_broker(frame)
        outcome = reg.commit_turn(msg)
        encode_committed(request_id=msg.request_id, turn_id=msg.turn_id, outcome=outcome)  # as the server does
    n = len(frames)
    total = (time.thread_time() - t0) / n
    assert reg.counters["commits_stored"] == n
    # per stage (each includes a clock read)
    reg = fresh_registry()
    decode = store = encode = 0.0
    for frame in frames:
        t0 = time.thread_time()
        msg = protocol.decode_worker_to_broker(frame)
        t1 = time.thread_time()
        outcome = reg.commit_turn(msg)
        t2 = time.thread_time()
        encode_committed(request_id=msg.request_id, turn_id=msg.turn_id, outcome=outcome)  # as the server does
        t3 = time.thread_time()
        decode, store, encode = decode + t1 - t0, store + t2 - t1, encode + t3 - t2
    return {
        "total_us": 1e6 * total,
        "decode_us": 1e6 * decode / n,
        "store_us": 1e6 * store / n,
        "encode_ack_us": 1e6 * encode / n,
        "single_core_ceiling_commits_per_s": 1 / total,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """This script's options (`parse_args([])`: its defaults, for bench_gateway's ingest scenario)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--publishers", type=int, default=4)
    p.add_argument("--sessions", type=int, default=800, help="sessions across all publishers (ingest)")
    p.add_argument("--turns", type=int, default=8, help="turns per ingest session")
    p.add_argument("--first-prompt", type=int, default=3400, help="first prompt tokens (ingest); grows per turn")
    p.add_argument("--tail", type=int, default=60, help="new prompt tokens per turn besides the last output")
    p.add_argument("--output", type=int, default=100)
    p.add_argument("--window", type=int, default=64, help="outstanding commits per publisher")
    p.add_argument("--long-turns", type=int, default=50)
    p.add_argument("--long-context", type=int, default=32_768)
    p.add_argument("--long-first-prompt", type=int, default=2_000)
    p.add_argument("--finish-sessions", type=int, default=5)
    p.add_argument("--memory-sessions", type=int, default=20)
    p.add_argument(
        "--compact-age",
        type=float,
        default=BrokerConfig().compact_age_s,
        help="the broker's compact_age_s for the memory part (default: the broker's); the part waits this long",
    )
    p.add_argument(
        "--session-life",
        type=float,
        default=10.0,
        help="memory part: each session's turns are spread over this many times --compact-age (0: back to back); "
        "a real 50-turn episode lives minutes. The policy scales with the age: --compact-age 1 runs 5x faster",
    )
    p.add_argument(
        "--recovery-mib",
        type=int,
        action="append",
        default=None,
        help="recovery part: MiB of live log (commit frames of open sessions) at the kill -9; repeat "
        "(default 64, 256, 1024)",
    )
    p.add_argument("--recovery-wave", type=int, default=500, help="recovery part: sessions filled at a time")
    p.add_argument(
        "--snapshot-max-mib",
        type=int,
        default=None,
        help="durable and recovery parts: the broker's ROLLOUT_BROKER_SNAPSHOT_MAX_BYTES in MiB (default: its own)",
    )
    p.add_argument(
        "--durable-prefill-mib",
        type=int,
        default=0,
        help="durable part: the broker first holds this many MiB of live sessions (as the recovery part fills "
        "them), so that snapshots rewrite a large state during the measured ingest",
    )
    p.add_argument("--state-parent", default=None, help="where the state directories go (default: the system temp dir)")
    p.add_argument("--only", choices=["ingest", "hotpath", "finish", "memory", "durable", "recovery"], action="append")
    p.add_argument(
        "--full-commits", action="store_true", help="also measure whole-turn commits (the old way) in the same run"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.recovery_mib is None:
        args.recovery_mib = [64, 256, 1024]
    parts = args.only or ["ingest", "hotpath", "finish", "memory", "durable", "recovery"]
    report: dict[str, Any] = {}
    benches = {
        "ingest": bench_ingest,
        "hotpath": bench_hotpath,
        "finish": bench_finish,
        "memory": bench_memory,
        "durable": bench_durable,
        "recovery": bench_recovery,
    }
    for name, fn in benches.items():
        if name not in parts:
            continue
        runs = [fn(args) for _ in range(args.runs)]
        report[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        report[name]["runs"] = [{k: round(v, 2) for k, v in r.items()} for r in runs]
        if not args.json:
            print(
                f"{name} (median of {args.runs}): "
                + ", ".join(
                    f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in report[name].items()
                    if k != "runs"
                ),
                flush=True,
            )
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
