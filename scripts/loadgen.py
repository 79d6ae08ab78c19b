"""Load generator: N simulated tool-using agents against a running or self-launched gateway.

Each agent opens a session over the trainer client, runs K turns of a growing
conversation (tool results or user messages padded so the context reaches
`--context-tokens` by the last turn), then finishes the session and checks capture:
the rows train exactly the completion tokens the agent was told about, once. Reports
turns/s and latency percentiles as JSON (stdout or --out). Thin CLI over public APIs:
the gateway is driven over HTTP, the trainer side through `trainer_client`.

    python scripts/loadgen.py --launch --workers 2 --agents 64 --turns 8 --context-tokens 4096
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from trainer_client import TrainerClient, launch_gateway  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "search", "description": "Search the corpus.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()
TOKENS_PER_WORD = 1.0  # these words are single Qwen BPE tokens with their leading space


def filler(tokens: int, seed: int) -> str:
    return " ".join(WORDS[(seed + i * 7) % len(WORDS)] for i in range(max(1, int(tokens / TOKENS_PER_WORD))))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run_agent(index: int, http: aiohttp.ClientSession, base_url: str, sid: str, args: argparse.Namespace,
                    latencies: list[float]) -> int:
    """One episode; returns the completion tokens the gateway reported."""
    step = max(1, args.context_tokens // max(1, args.turns))
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a research agent. Use the search tool."},
        {"role": "user", "content": f"Task {index}: " + filler(step, index)},
    ]
    completion_tokens = 0
    headers = {"Authorization": f"Bearer {sid}"}
    for turn in range(args.turns):
        body = {"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": args.max_tokens,
                "stream": args.stream}
        t0 = time.perf_counter()
        async with http.post(f"{base_url}/chat/completions", json=body, headers=headers) as reply:
            if reply.status != 200:
                raise RuntimeError(f"agent {index} turn {turn}: HTTP {reply.status}: {await reply.text()}")
            if args.stream:
                message, usage = await _read_stream(reply)
            else:
                data = await reply.json()
                message, usage = data["choices"][0]["message"], data["usage"]
        latencies.append(time.perf_counter() - t0)
        completion_tokens += usage["completion_tokens"]
        echo = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("reasoning_content"):
            echo["reasoning_content"] = message["reasoning_content"]
        if message.get("tool_calls"):
            echo["tool_calls"] = message["tool_calls"]
            messages.append(echo)
            for call in message["tool_calls"]:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": filler(step, turn)})
        else:
            messages.append(echo)
            messages.append({"role": "user", "content": "Continue. " + filler(step, turn)})
    return completion_tokens


async def _read_stream(reply: aiohttp.ClientResponse) -> tuple[dict[str, Any], dict[str, int]]:
    message: dict[str, Any] = {"content": "", "reasoning_content": "", "tool_calls": []}
    usage: dict[str, int] = {}
    async for raw in reply.content:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices", []):
            delta = choice["delta"]
            message["content"] += delta.get("content") or ""
            message["reasoning_content"] += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                message["tool_calls"].append({k: call[k] for k in ("id", "type", "function")})
    return message, usage


async def run(args: argparse.Namespace, base_url: str, client: TrainerClient) -> dict[str, Any]:
    pool = ThreadPoolExecutor(max_workers=16)
    loop = asyncio.get_running_loop()
    sids = await asyncio.gather(*(loop.run_in_executor(pool, lambda: client.open_session(max_context_tokens=None))
                                  for _ in range(args.agents)))
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:
        t0 = time.perf_counter()
        completions = await asyncio.gather(*(run_agent(i, http, base_url, sid, args, latencies)
                                             for i, sid in enumerate(sids)))
        elapsed = time.perf_counter() - t0

    def finish(sid: str) -> list[Any]:
        return client.finish_session(sid, reward=1.0, wait_timeout=10.0)

    rows_per_session = await asyncio.gather(*(loop.run_in_executor(pool, finish, sid) for sid in sids))
    problems = []
    for sid, rows, expected in zip(sids, rows_per_session, completions):
        trained = sum(sum(r.loss_mask) for r in rows)
        if trained != expected:
            problems.append(f"session {sid[:8]}: trained {trained} tokens, agents received {expected}")
    pool.shutdown()
    turns = args.agents * args.turns
    return {
        "agents": args.agents, "turns_per_agent": args.turns, "context_tokens": args.context_tokens,
        "stream": args.stream, "turns": turns, "elapsed_s": round(elapsed, 3),
        "turns_per_s": round(turns / elapsed, 1),
        "latency_ms": {"mean": round(1000 * statistics.fmean(latencies), 2),
                       "p50": round(1000 * percentile(latencies, 0.50), 2),
                       "p99": round(1000 * percentile(latencies, 0.99), 2)},
        "rows": sum(len(r) for r in rows_per_session),
        "capture_ok": not problems, "capture_problems": problems[:10],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", help="a running gateway's /v1 URL (else --launch)")
    p.add_argument("--control", help="its trainer control endpoint")
    p.add_argument("--launch", action="store_true", help="start `rollout-gateway serve` for the run")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--mock-delay", type=float, default=0.0, help="mock engine seconds per call (with --launch)")
    p.add_argument("--agents", type=int, default=64)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--context-tokens", type=int, default=4096)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--out", help="write the JSON result here too")
    args = p.parse_args()
    if args.launch:
        extra = ["--mock-delay", str(args.mock_delay), "--log-level", "warning"]
        with launch_gateway(workers=args.workers, extra_args=extra) as gw:
            result = asyncio.run(run(args, gw.base_url, gw.client))
    else:
        if not (args.base_url and args.control):
            p.error("give --base-url and --control, or --launch")
        with TrainerClient(args.control) as client:
            result = asyncio.run(run(args, args.base_url, client))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
