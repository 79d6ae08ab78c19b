"""Load generator: N simulated tool-using agents against our gateway, the reference gateway, or the engine.

Each agent opens a session, runs K turns of a growing tool-calling conversation in one of the
three dialects (tool results sized so the context reaches `--context-tokens` by the last turn),
echoing reasoning or not, streaming or not. Targets: `ours` (a running `rollout-gateway`, or
`--launch`), `reference` (scripts/reference_gateway.py), `direct` (the engine itself: the agent
renders the prompt untimed and times only the engine call, so gateway-added latency = gateway -
direct). After the run it finishes every session and checks the fidelity rule
(tests/fidelity.py) for every turn an agent received, against what scripts/bench_engine.py
recorded. Prints a JSON result. Thin CLI over public APIs: HTTP for agents, `trainer_client`.

    python scripts/loadgen.py --launch --engine-url http://127.0.0.1:PORT --agents 64 --context-tokens 4096
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import time
from array import array
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import msgpack
import orjson

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, ".."), os.path.join(HERE, "..", "tests")]
from agent_text import TOOL_TEXTS, filler, tool_result, use_vocabulary  # noqa: E402
from bench_dialects import DIALECTS, SEARCH, Dialect, Reply  # noqa: E402

SYSTEM = "You are a research agent. Use the search tool to gather evidence before you answer."
TEMPLATE_OVERHEAD_TOKENS = 250  # system prompt + tool catalogue
REPLY_TOKENS = 60  # an engine reply (bench_engine.py) plus its template wrapping
PROGRESS_EVERY_S = 0.25
FINISH_TIMEOUT_S = 30.0
_SERIAL = re.compile(r"q(\d+)")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class LoadConfig:
    """One load run."""

    agents: int = 64
    turns: int = 8
    context_tokens: int = 4096
    max_tokens: int = 256
    dialect: str = "chat"
    stream: bool = False
    echo_reasoning: bool = True
    progress: bool = True
    request_timeout_s: float = 600.0
    run_id: str = "0"  # seeds every message, so runs never share text (a cache must not carry over)
    rate: float = 0.0  # offered turns/s over all agents (each turn waits for its slot); 0 = closed loop
    episodes: int = 1  # episodes each agent runs one after the other (a new session each)
    tool_text: str = "prose"  # tool results: word salad ("prose") or JSON, code and prose ("mixed"); agent_text.py
    pause_s: float = 0.0  # each agent waits this long after a reply before its next turn (its tool running)
    history_mode: str = ""  # ours: the sessions' history mode, tree or linear ("": the gateway's default)

    @property
    def step_tokens(self) -> int:
        """Tokens per tool result (and in the first user message) so the last prompt is ~context_tokens."""
        return max(8, (self.context_tokens - TEMPLATE_OVERHEAD_TOKENS) // self.turns - REPLY_TOKENS)

    def prompt_tokens(self, turn: int) -> int:
        """About how many tokens the prompt of turn `turn` (from 0) holds."""
        return TEMPLATE_OVERHEAD_TOKENS + (turn + 1) * self.step_tokens + turn * REPLY_TOKENS


@dataclass
class AgentLog:
    serials: list[int] = field(default_factory=list)  # engine request serial of each received turn
    received_tokens: int = 0
    error: str | None = None


# --- targets ---------------------------------------------------------------------------------------


class Target:
    """Where agents send turns, and how their sessions open and finish."""

    name = "target"
    base_url = ""

    async def open_sessions(self, n: int, history_mode: str = "") -> list[str]:
        """`n` new sessions, in `history_mode` where the target has a choice of it."""
        return [f"direct-{i}" for i in range(n)]

    async def finish(self, sid: str) -> list[Any] | None:
        return None  # no capture (direct)

    async def turn(
        self, http: aiohttp.ClientSession, sid: str, dialect: Dialect, state: dict[str, Any], cfg: LoadConfig
    ) -> tuple[Reply, float]:
        body = orjson.dumps(dialect.body(state, cfg.max_tokens, cfg.stream))
        t0 = time.perf_counter()
        async with http.post(self.base_url + dialect.path, data=body, headers=dialect.headers(sid)) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
            reply = await dialect.read(resp, cfg.stream)
        return reply, time.perf_counter() - t0

    async def close(self) -> None:
        pass


class OursTarget(Target):
    """A running rollout-gateway: sessions through the synchronous TrainerClient, in threads."""

    name = "ours"

    def __init__(self, base_url: str, client: Any) -> None:
        self.base_url, self.client = base_url.rstrip("/"), client
        self.pool = ThreadPoolExecutor(max_workers=16)

    async def open_sessions(self, n: int, history_mode: str = "") -> list[str]:
        loop = asyncio.get_running_loop()
        options: dict[str, Any] = {"sampling_defaults": {"temperature": 1.0}, "max_context_tokens": None}
        if history_mode:
            options["history_mode"] = history_mode
        opened = [loop.run_in_executor(self.pool, lambda: self.client.open_session(**options)) for _ in range(n)]
        return list(await asyncio.gather(*opened))

    async def finish(self, sid: str) -> list[Any]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self.pool, lambda: self.client.finish_session(sid, reward=1.0, wait_timeout=FINISH_TIMEOUT_S)
        )

    async def close(self) -> None:
        self.pool.shutdown()


class ReferenceTarget(Target):
    """The reference gateway under scripts/reference_gateway.py: sessions over its benchmark routes."""

    def __init__(self, base_url: str, control: str, name: str = "reference") -> None:
        self.base_url, self.control, self.name = base_url.rstrip("/"), control.rstrip("/"), name

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        # A session per call: targets outlive the event loop of one run (bench_gateway runs many).
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=FINISH_TIMEOUT_S * 2)) as http:
            async with http.post(self.control + path, json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"reference {path}: HTTP {resp.status}: {(await resp.text())[:300]}")
                return await resp.json()

    async def open_sessions(self, n: int, history_mode: str = "") -> list[str]:  # a mode per server: ref-tree, ...
        return (await self._post("/open", {"count": n}))["sids"]

    async def finish(self, sid: str) -> list[Any]:
        return (await self._post("/finish", {"sid": sid, "reward": 1.0}))["rows"]


class DirectTarget(Target):
    """The engine itself: the agent renders (untimed) and times only the engine call."""

    name = "direct"

    def __init__(self, engine_url: str, tokenizer_dir: str) -> None:
        from tokenizers import Tokenizer
        from transformers import AutoTokenizer

        self.url = engine_url.rstrip("/") + "/inference/v1/generate"
        self.hf = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.fast = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
        self.tools: list[Any] = [{"type": "function", "function": SEARCH}]

    async def turn(
        self, http: aiohttp.ClientSession, sid: str, dialect: Dialect, state: dict[str, Any], cfg: LoadConfig
    ) -> tuple[Reply, float]:
        if dialect.name != "chat":
            raise ValueError("the direct target speaks only the chat dialect's conversation shape")
        prompt = await asyncio.to_thread(self._render, state["messages"])
        body = orjson.dumps(
            {
                "request_id": sid,
                "token_ids": prompt,
                "stream": False,
                "sampling_params": {"max_tokens": cfg.max_tokens, "logprobs": 0},
            }
        )
        t0 = time.perf_counter()
        async with http.post(self.url, data=body, headers={"Content-Type": "application/json"}) as resp:
            answer = orjson.loads(await resp.read())
        latency = time.perf_counter() - t0
        ids = answer["choices"][0]["token_ids"]
        text = self.fast.decode(ids, skip_special_tokens=False)
        reply = Reply(completion_tokens=len(ids))
        if "</think>" in text:
            reply.reasoning = text.split("</think>")[0].split("<think>")[-1].strip("\n")
        for k, raw in enumerate(re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.DOTALL)):
            call = json.loads(raw)
            reply.calls.append(
                (f"call_{sid}_{len(state['messages'])}_{k}", call["name"], json.dumps(call["arguments"]))
            )
        return reply, latency

    def _render(self, messages: list[dict[str, Any]]) -> list[int]:
        ids: Any = self.hf.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)


# --- the run ------------------------------------------------------------------------------------------


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.total, self.label, self.enabled = total, label, enabled
        self.done = self.errors = 0
        self.t0 = time.perf_counter()

    def draw(self, final: bool = False) -> None:
        if not self.enabled:
            return
        width = 30
        filled = int(width * self.done / max(1, self.total))
        rate = self.done / max(1e-9, time.perf_counter() - self.t0)
        line = (
            f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} turns "
            f"{rate:7.1f}/s errors {self.errors}"
        )
        sys.stderr.write(line + ("\n" if final else ""))
        sys.stderr.flush()

    async def run(self) -> None:
        while True:
            self.draw()
            await asyncio.sleep(PROGRESS_EVERY_S)


async def run_agent(
    index: int,
    sid: str,
    target: Target,
    dialect: Dialect,
    cfg: LoadConfig,
    http: aiohttp.ClientSession,
    latencies: list[list[float]],
    progress: Progress,
    on_turn: Callable[[int], None] | None = None,
) -> AgentLog:
    log = AgentLog()
    step = cfg.step_tokens
    seed = f"{cfg.run_id}/{index}"
    state = dialect.start(SYSTEM, f"Task {seed}:" + filler(step, seed))
    for turn in range(cfg.turns):
        if cfg.rate > 0:
            # Open loop: agent i's n-th turn (over its episodes) is due at (n * agents + i) / rate.
            agent_index, episode = divmod(index, cfg.episodes)
            due = progress.t0 + ((episode * cfg.turns + turn) * cfg.agents + agent_index) / cfg.rate
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
        try:
            reply, latency = await target.turn(http, sid, dialect, state, cfg)
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError, KeyError) as e:
            log.error = f"agent {index} turn {turn}: {type(e).__name__}: {e}"
            progress.errors += 1
            return log
        latencies[turn].append(latency)
        log.received_tokens += reply.completion_tokens
        for _, _, arguments in reply.calls[:1]:
            match = _SERIAL.search(arguments)
            if match:
                log.serials.append(int(match.group(1)))
        progress.done += 1
        if on_turn is not None:
            on_turn(turn)
        if cfg.pause_s:
            await asyncio.sleep(cfg.pause_s)
        dialect.advance(
            state,
            reply,
            tool_output=f"Result {seed}/{turn}:" + tool_result(step, f"{seed}/{turn}", cfg.tool_text),
            user_text=f"Continue {seed}/{turn}." + filler(step, f"{seed}/{turn}/u"),
        )
    return log


async def run_load(
    target: Target, cfg: LoadConfig, engine_url: str | None = None, on_turn: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """Run the agents, then (with a bench engine's log) check capture; returns the result record. `on_turn` is
    called with the turn's index as each agent receives a reply (before its pause)."""
    dialect = DIALECTS[cfg.dialect](cfg.echo_reasoning)
    sids = await target.open_sessions(cfg.agents * cfg.episodes, cfg.history_mode)
    latencies: list[list[float]] = [[] for _ in range(cfg.turns)]
    progress = Progress(len(sids) * cfg.turns, f"{target.name}/{cfg.dialect} c={cfg.agents}", cfg.progress)

    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)

    async def agent(i: int) -> list[AgentLog]:
        # One keep-alive connection per agent, like an SDK client per agent process: its turns reach
        # the same gateway worker (a shared pool would scatter them over the workers).
        connector = aiohttp.TCPConnector(limit=1)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            return [
                await run_agent(k, sids[k], target, dialect, cfg, http, latencies, progress, on_turn)
                for k in range(i * cfg.episodes, (i + 1) * cfg.episodes)
            ]

    ticker = asyncio.ensure_future(progress.run())
    try:
        t0 = time.perf_counter()
        logs = [log for logs in await asyncio.gather(*(agent(i) for i in range(cfg.agents))) for log in logs]
        elapsed = time.perf_counter() - t0
    finally:
        ticker.cancel()
        progress.draw(final=True)
    flat = [x for per_turn in latencies for x in per_turn]
    result: dict[str, Any] = {
        "target": target.name,
        "config": asdict(cfg),
        "turns_done": len(flat),
        "elapsed_s": round(elapsed, 4),
        "turns_per_s": round(len(flat) / elapsed, 2) if elapsed > 0 else 0.0,
        "errors": [log.error for log in logs if log.error][:10],
        "latency_ms": _summary(flat),
        "per_turn_mean_ms": [round(1000 * statistics.fmean(t), 3) if t else None for t in latencies],
        "per_turn_prompt_tokens": [cfg.prompt_tokens(turn) for turn in range(cfg.turns)],
    }
    if engine_url is not None and not isinstance(target, DirectTarget):
        result["capture"] = await check_capture(target, sids, logs, engine_url)
    return result


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ms = [1000 * v for v in values]
    return {
        "mean": round(statistics.fmean(ms), 3),
        "p50": round(percentile(ms, 0.5), 3),
        "p90": round(percentile(ms, 0.9), 3),
        "p99": round(percentile(ms, 0.99), 3),
        "max": round(max(ms), 3),
    }


@dataclass(frozen=True, slots=True)
class _EngineTurn:
    """What the engine sampled for one request (the fields tests/fidelity.py reads)."""

    turn_id: str
    prompt_ids: array
    output_ids: array
    logprobs: array


async def fetch_engine_log(engine_url: str) -> dict[int, _EngineTurn]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=FINISH_TIMEOUT_S)) as http:
        async with http.get(engine_url.rstrip("/") + "/_bench/log") as resp:
            entries = msgpack.unpackb(await resp.read())
    out = {}
    for serial, prompt, output, lps in entries:
        out[serial] = _EngineTurn(str(serial), array("i", prompt), array("i", output), array("f", lps))
    return out


async def check_capture(target: Target, sids: list[str], logs: list[AgentLog], engine_url: str) -> dict[str, Any]:
    """Finish every session; every turn an agent received must be trained exactly once (tests/fidelity.py)."""
    from fidelity import assert_fidelity

    engine = await fetch_engine_log(engine_url)
    problems: list[str] = []
    rows_per_session: list[int] = []
    trained = sampled = received = 0
    all_rows = await asyncio.gather(*(target.finish(sid) for sid in sids), return_exceptions=True)
    for sid, log, rows in zip(sids, logs, all_rows, strict=True):
        if isinstance(rows, BaseException):
            problems.append(f"session {sid[:10]}: finish failed: {rows}")
            continue
        turns = [engine[s] for s in log.serials if s in engine]
        if len(turns) != len(log.serials):
            problems.append(f"session {sid[:10]}: {len(log.serials) - len(turns)} received turns not in the engine log")
        received += log.received_tokens
        sampled += sum(len(t.output_ids) for t in turns)
        rows_per_session.append(len(rows or []))
        trained += sum(sum(_field(r, "loss_mask")) for r in rows or [])
        try:
            assert_fidelity(turns, rows or [])
        except AssertionError as e:
            problems.append(f"session {sid[:10]}: {str(e)[:300]}")
    return {
        "sessions": len(sids),
        "ok": not problems and received == sampled,
        "problems": problems[:10],
        "received_tokens": received,
        "sampled_tokens": sampled,
        "trained_tokens": trained,
        "rows": sum(rows_per_session),
        "rows_per_session": round(statistics.fmean(rows_per_session), 3) if rows_per_session else None,
    }


def _field(row: Any, name: str) -> Any:
    return row[name] if isinstance(row, dict) else getattr(row, name)


# --- CLI -------------------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", choices=["ours", "reference", "direct"], default="ours")
    p.add_argument("--base-url", help="the gateway's /v1 URL (ours or reference)")
    p.add_argument("--control", help="ours: trainer control endpoint; reference: its /_bench URL")
    p.add_argument("--launch", action="store_true", help="ours: start `rollout-gateway serve` for the run")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--engine-url", help="a scripts/bench_engine.py URL: the engine, and the capture check's log")
    p.add_argument("--tokenizer", help="tokenizer directory (direct target; --launch with an engine)")
    p.add_argument("--agents", type=int, default=64)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--context-tokens", type=int, default=4096)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--dialect", choices=sorted(DIALECTS), default="chat")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--no-echo-reasoning", action="store_true", help="agents drop reasoning from their echo")
    p.add_argument("--tool-text", choices=TOOL_TEXTS, default="prose", help="what tool results look like")
    p.add_argument("--rate", type=float, default=0.0, help="offered turns/s (open loop); 0 = closed loop")
    p.add_argument("--pause-ms", type=float, default=0.0, help="each agent's pause between a reply and its next turn")
    p.add_argument("--history-mode", choices=["tree", "linear"], help="ours: the sessions' history mode")
    p.add_argument("--out", help="write the JSON result here too")
    args = p.parse_args()
    if args.tokenizer:
        use_vocabulary(args.tokenizer)
    cfg = LoadConfig(
        agents=args.agents,
        turns=args.turns,
        context_tokens=args.context_tokens,
        max_tokens=args.max_tokens,
        dialect=args.dialect,
        stream=args.stream,
        echo_reasoning=not args.no_echo_reasoning,
        progress=sys.stderr.isatty(),
        rate=args.rate,
        tool_text=args.tool_text,
        pause_s=args.pause_ms / 1000,
        history_mode=args.history_mode or "",
        run_id=str(time.time()),
    )
    result = asyncio.run(_cli(args, cfg))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


async def _cli(args: argparse.Namespace, cfg: LoadConfig) -> dict[str, Any]:
    if args.target == "direct":
        if not (args.engine_url and args.tokenizer):
            raise SystemExit("--target direct needs --engine-url and --tokenizer")
        return await run_load(DirectTarget(args.engine_url, args.tokenizer), cfg)
    if args.target == "reference":
        if not (args.base_url and args.control):
            raise SystemExit("--target reference needs --base-url and --control")
        target: Target = ReferenceTarget(args.base_url, args.control)
        try:
            return await run_load(target, cfg, args.engine_url)
        finally:
            await target.close()
    from trainer_client import TrainerClient, launch_gateway

    if args.launch:
        kind, urls = ("vllm", [args.engine_url]) if args.engine_url else ("mock", [])
        with launch_gateway(
            workers=args.workers,
            engine_kind=kind,
            engine_urls=urls,
            tokenizer=args.tokenizer,
            extra_args=["--log-level", "warning"],
        ) as gw:
            return await _run_ours(gw.base_url, gw.client, cfg, args.engine_url)
    if not (args.base_url and args.control):
        raise SystemExit("give --base-url and --control, or --launch")
    with TrainerClient(args.control) as client:
        return await _run_ours(args.base_url, client, cfg, args.engine_url)


async def _run_ours(base_url: str, client: Any, cfg: LoadConfig, engine_url: str | None) -> dict[str, Any]:
    target = OursTarget(base_url, client)
    try:
        return await run_load(target, cfg, engine_url)
    finally:
        await target.close()


if __name__ == "__main__":
    main()
