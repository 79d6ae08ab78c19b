"""Benchmark: worker CPU per engine call, our HTTP client (gateway_workers/engines/http/client.py) against aiohttp.

Starts scripts/bench_engine.py (a near-free vLLM token-in/token-out engine) in a subprocess and
POSTs pre-encoded `/inference/v1/generate` bodies of a 4k- and a 24k-token prompt to it, one at a
time over keep-alive connections, reading each whole answer. Reports the client process's CPU
time per request (time.process_time; the engine's CPU is in its own process) and the mean wall
time, for both clients side by side in one run, as the median of --reps alternating repetitions.
Usage: python scripts/bench_engine_client.py [--requests 1000] [--reps 3] [--sizes 4096,24576]
Needs the `bench` extra (aiohttp, the baseline); uses uvloop like the workers do.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import orjson
import uvloop

from gateway_workers.engines.http.client import HttpPool
from gateway_workers.rendering.tokenizer import prepare_tokenizer_dir

HERE = Path(__file__).resolve().parent
ENGINE_START_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 5.0
WARMUP_REQUESTS = 50
HEADERS = {"X-Session-ID": "0" * 32, "X-SMG-Routing-Key": "0" * 32}

Post = Callable[[str, bytes, dict[str, str]], Awaitable[bytes]]


def body_for(tokens: int, serial: int) -> bytes:
    rng = random.Random(tokens)
    ids = [rng.randrange(1000, 150_000) for _ in range(tokens)]
    params = {"max_tokens": 64, "logprobs": 0, "temperature": 1.0, "detokenize": False}
    return orjson.dumps({"request_id": f"r{serial}", "token_ids": ids, "sampling_params": params, "stream": False})


async def measure(client: str, url: str, body: bytes, requests: int) -> tuple[float, float]:
    """(CPU µs per request, wall µs per request) for `requests` sequential POSTs with one client."""
    headers = {**HEADERS, "X-Request-Id": "r"}
    if client == "aiohttp":
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0)
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S, sock_connect=CONNECT_TIMEOUT_S)
        session = aiohttp.ClientSession(connector=connector, timeout=timeout)

        async def post(data: bytes) -> bytes:
            async with session.post(url, data=data, headers={"Content-Type": "application/json", **headers}) as r:
                raw = await r.read()
                assert r.status == 200, raw[:200]
                return raw

        close = session.close
    else:
        pool = HttpPool(CONNECT_TIMEOUT_S)

        async def post(data: bytes) -> bytes:
            status, raw = await pool.post(url, data, headers, REQUEST_TIMEOUT_S)
            assert status == 200, raw[:200]
            return raw

        close = pool.aclose
    try:
        for _ in range(WARMUP_REQUESTS):
            await post(body)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(requests):
            await post(body)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    finally:
        await close()
    return cpu / requests * 1e6, wall / requests * 1e6


def control(base: str, path: str) -> None:
    request = urllib.request.Request(base + path, data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as resp:
        resp.read()


def start_engine(tokenizer_dir: str, cpu: int | None) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-u", str(HERE / "bench_engine.py"), "--tokenizer", tokenizer_dir, "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    if cpu is not None:
        os.sched_setaffinity(proc.pid, {cpu})
    deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        match = re.search(r"BENCH ENGINE READY (\S+)", line)
        if match:
            return proc, match.group(1)
    proc.kill()
    raise SystemExit("bench engine did not start")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1000, help="measured requests per client and repetition")
    p.add_argument("--reps", type=int, default=3, help="repetitions; the median is reported")
    p.add_argument("--sizes", default="4096,24576", help="prompt sizes in tokens, comma-separated")
    args = p.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    # Client and engine on different cores when there are two, so neither's CPU shows up in the other's.
    engine_cpu = cpus[-1] if len(cpus) > 1 else None
    if engine_cpu is not None:
        os.sched_setaffinity(0, {cpus[0]})
    proc, base = start_engine(prepare_tokenizer_dir(None), engine_cpu)
    url = base + "/inference/v1/generate"
    try:
        print(f"{args.requests} sequential keep-alive POSTs per client and repetition, median of {args.reps}")
        print(f"{'prompt':>8} {'client':>8} {'CPU µs/req':>11} {'wall µs/req':>12}  runs (CPU µs)")
        for tokens in (int(s) for s in args.sizes.split(",")):
            body = body_for(tokens, 0)
            results: dict[str, list[tuple[float, float]]] = {"aiohttp": [], "ours": []}
            for _ in range(args.reps):
                for client in results:  # alternating, so drift hits both alike
                    results[client].append(uvloop.run(measure(client, url, body, args.requests)))
                    control(base, "/_bench/reset")  # the engine logs every prompt: keep its memory flat
            medians = {}
            for client, runs in results.items():
                cpu = statistics.median(r[0] for r in runs)
                wall = statistics.median(r[1] for r in runs)
                medians[client] = cpu
                spread = ", ".join(f"{r[0]:.0f}" for r in runs)
                print(f"{tokens:>8} {client:>8} {cpu:>11.0f} {wall:>12.0f}  {spread}")
            print(f"{tokens:>8} {'ratio':>8} {medians['aiohttp'] / medians['ours']:>10.2f}x  (aiohttp / ours, CPU)")
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
