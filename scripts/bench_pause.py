"""Pause/update/resume under load: 256 agents mid-generation on 2 workers, one weight update, each pause mode.

Starts `rollout-gateway serve` (2 workers, the built-in mock engine sampling at a fixed pace per token, so every
generation is long and in flight when the pause comes), opens one session per agent, and starts every agent's
one Chat Completions turn at once through the official `openai` SDK (async, retries on, half of them
streamed). Once every generation has been running for --mid-s, the trainer pauses in the mode measured, waits
--update-s (the weight update), and resumes under version 1. Per mode and repetition it records:

  pause_s        pause_generation's time to return (every worker idle)
  errors         agent requests that ended in an exception (the target: 0)
  kept           tokens sampled before the pause that the episodes keep (abort: all of them; keep: those known to
                 be, received before the pause; the engine keeps every token either way)
  resampled      tokens sampled twice: 0 here by construction; an abort at the engine with the agents' SDKs
                 retrying the 5xx (the only alternative without the gateway's help) samples every token sampled
                 before the pause again, which is what `kept` counts for it
  added_s        the agents' median turn time less the unpaused round's: what one update cost an agent (abort:
                 about the time to idle plus the update; wait: the turns in flight lose nothing)
  version_split  whether every row's tokens carry version 0 before the pause and 1 after it (abort), or one
                 version throughout (wait: the turns in flight finish under 0, those held sample under 1), or
                 (keep, whose mock engine, like vLLM, does not say) 0 then -1 where unknown, those rows flagged
  flagged        rows flagged `weight_versions_unknown` (keep: the turns the engines held)

Medians over --reps. Writes --out (JSON) and the markdown beside it, and prints the markdown.

    python scripts/bench_pause.py --agents 256 --reps 3 --out bench-results/pause.json
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
from bench_report import write_results  # noqa: E402

from trainer_client import launch_gateway  # noqa: E402

MODES = ("wait", "abort", "keep")


async def _agent(agent: openai.AsyncOpenAI, stream: bool, max_tokens: int) -> tuple[float, bool]:
    """One turn; its time and whether it failed."""
    started = time.monotonic()
    try:
        messages: Any = [{"role": "user", "content": "Write a long story."}]
        if stream:
            chunks = await agent.chat.completions.create(model="qwen3", messages=messages, stream=True,
                                                         max_tokens=max_tokens)  # fmt: skip
            async for _ in chunks:
                pass
        else:
            await agent.chat.completions.create(model="qwen3", messages=messages, max_tokens=max_tokens)
        return time.monotonic() - started, False
    except Exception as e:  # counted: the target is none
        print(f"agent error: {type(e).__name__}: {e}", file=sys.stderr)
        return time.monotonic() - started, True


def _run(gw: Any, mode: str | None, args: argparse.Namespace) -> dict[str, Any]:
    """One round: every agent's turn, with a pause in `mode` mid-generation (None: no pause, the baseline)."""
    client = gw.client
    client.set_weight_version(0)
    sids = [client.open_session() for _ in range(args.agents)]
    timings: dict[str, float] = {}

    def trainer() -> None:
        # Every turn opened (at the engine a moment later), then --mid-s into the generations.
        while client.stats()["turns_in_flight"] < args.agents:
            time.sleep(0.01)
        time.sleep(args.mid_s)
        if mode is None:
            return
        started = time.monotonic()
        report = client.pause_generation(mode, timeout=120)
        timings["pause_s"] = time.monotonic() - started
        timings["held"] = report.turns_held
        time.sleep(args.update_s)
        client.resume_generation(weight_version=1)
        timings["paused_s"] = time.monotonic() - started

    async def agents() -> list[tuple[float, bool]]:
        limits = httpx.Limits(max_connections=args.agents, max_keepalive_connections=args.agents)
        async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="-", max_retries=2, timeout=600,
                                      http_client=httpx.AsyncClient(limits=limits)) as shared:  # fmt: skip
            turns = [_agent(shared.with_options(api_key=sid), k % 2 == 1, args.tokens) for k, sid in enumerate(sids)]
            return await asyncio.gather(*turns)

    thread = threading.Thread(target=trainer)
    thread.start()
    results = asyncio.run(agents())
    thread.join()
    kept = split = flagged = 0
    for sid in sids:
        for record in client.finish_session(sid, wait_timeout=30):
            sampled = [v for v, m in zip(record.weight_versions, record.loss_mask, strict=True) if m]
            kept += sampled.count(0) if mode in ("abort", "keep") else 0
            runs = [v for k, v in enumerate(sampled) if k == 0 or sampled[k - 1] != v]
            unknown = bool(record.metadata.get("weight_versions_unknown"))
            flagged += unknown
            if mode == "keep":
                split += runs in ([0, -1], [-1], [1]) and unknown == (-1 in runs)
            else:
                split += runs in ([0, 1], [0], [1]) if mode is not None else runs == [0]
    times = sorted(t for t, _ in results)
    return {"turn_s": statistics.median(times), "errors": sum(failed for _, failed in results), "kept": kept,
            "version_split": split == len(sids), "flagged": flagged, **timings}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=400, help="each turn's output tokens")
    parser.add_argument("--token-s", type=float, default=0.01, help="the mock engine's seconds per token")
    parser.add_argument("--mid-s", type=float, default=2.0, help="seconds into the generations the pause comes")
    parser.add_argument("--update-s", type=float, default=2.0, help="the weight update's length, seconds")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="bench-results/pause.json")
    args = parser.parse_args()
    env = {"ROLLOUT_GATEWAY_ENGINE_MOCK_PER_TOKEN_S": str(args.token_s),
           "ROLLOUT_GATEWAY_ENGINE_MOCK_OUTPUT_TOKENS": str(args.tokens)}  # fmt: skip
    rounds: dict[str, list[dict[str, Any]]] = {"none": [], **{mode: [] for mode in MODES}}
    with launch_gateway(workers=2, engine_kind="mock", env=env, extra_args=["--log-level", "warning"]) as gw:
        for _ in range(args.reps):
            for mode in (None, *MODES):
                rounds[mode or "none"].append(_run(gw, mode, args))
    base = statistics.median(r["turn_s"] for r in rounds["none"])
    rows = []
    for mode in MODES:
        runs = rounds[mode]
        added = statistics.median(r["turn_s"] - base for r in runs)
        kept = statistics.median(r["kept"] for r in runs)
        rows.append({"mode": mode, "pause_s": statistics.median(r["pause_s"] for r in runs),
                     "errors": sum(r["errors"] for r in runs), "kept": kept,
                     "resampled": 0, "retry_resampled": kept if mode == "abort" else 0, "added_s": added,
                     "version_split": all(r["version_split"] for r in runs),
                     "flagged": statistics.median(r["flagged"] for r in runs)})  # fmt: skip
    table = [f"{args.agents} agents, {args.tokens} tokens at {args.token_s * 1000:g} ms each, pause at "
             f"{args.mid_s:g} s, update {args.update_s:g} s; unpaused turn {base:.2f} s; medians of {args.reps}",
             "", "| mode | pause returns (s) | agent errors | tokens kept | re-sampled | re-sampled by abort-and-retry "
             "| added agent latency (s) | versions exact | rows flagged |", "|---" * 9 + "|"]  # fmt: skip
    for r in rows:
        table.append(f"| {r['mode']} | {r['pause_s']:.3f} | {r['errors']} | {r['kept']:.0f} | {r['resampled']} | "
                     f"{r['retry_resampled']:.0f} | {r['added_s']:.3f} | {r['version_split']} | {r['flagged']:.0f} |")
    write_results(args.out, {"args": vars(args), "unpaused_turn_s": base, "modes": rows, "rounds": rounds},
                  "\n".join(table) + "\n")


if __name__ == "__main__":
    main()
