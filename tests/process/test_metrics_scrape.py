"""One `/metrics` scrape of any worker sees the whole gateway: after a scripted load over two workers, its
counts equal the sums the agents saw.

A real `serve` (2 workers, the mock engine); agents on the official openai and anthropic SDKs, a connection
per request so that both workers serve them, run turns in every dialect, streamed and not, plus requests
the gateway refuses; the trainer finishes every session. Then each worker, scraped, says (within two
heartbeats) exactly: the turns by dialect, stream and outcome, the prompt and output tokens the agents were
billed, one observation per stage per turn, the broker's stored commits, sessions opened and finished, the
rows the trainer got, and both workers alive. `rollout-gateway status` shows the same from the broker,
once as JSON and live on screen.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections import Counter
from typing import Any

import anthropic
import openai
import pytest
from assets import wait_until
from processes import launch_gateway
from scrapes import Samples, scrape, total

SESSIONS = 4
SETTLE_S = 10.0  # the other worker's counts arrive with its next heartbeat (every second)
STAGES = ("render", "engine", "parse", "reply", "commit", "total")


def _agent(base_url: str, sid: str, k: int, seen: Counter[Any]) -> None:
    """Turns in every dialect, streamed and not; what the agent was billed is added to `seen`."""
    chat = openai.OpenAI(base_url=base_url, api_key=sid, max_retries=2, timeout=60,
                         default_headers={"Connection": "close"})
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"agent {k}: hello"}]
    reply = chat.chat.completions.create(model="x", messages=messages)
    assert reply.usage is not None
    seen["chat", "false"] += 1
    seen["prompt"] += reply.usage.prompt_tokens
    seen["output"] += reply.usage.completion_tokens
    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": "and then?"}]  # fmt: skip
    chunks = list(chat.chat.completions.create(model="x", messages=messages, stream=True,
                                               stream_options={"include_usage": True}))  # fmt: skip
    usage = chunks[-1].usage
    assert usage is not None
    seen["chat", "true"] += 1
    seen["prompt"] += usage.prompt_tokens
    seen["output"] += usage.completion_tokens

    claude = anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key=sid, max_retries=2,
                                 default_headers={"Connection": "close"})  # fmt: skip
    question = [{"role": "user", "content": f"agent {k}: what now?"}]
    message = claude.messages.create(model="x", max_tokens=64, messages=question)  # type: ignore[arg-type]
    seen["messages", "false"] += 1
    seen["prompt"] += message.usage.input_tokens
    seen["output"] += message.usage.output_tokens
    with claude.messages.stream(model="x", max_tokens=64, messages=question) as stream:  # type: ignore[arg-type]
        final = stream.get_final_message()
    seen["messages", "true"] += 1
    seen["prompt"] += final.usage.input_tokens
    seen["output"] += final.usage.output_tokens

    response = chat.responses.create(model="x", input=f"agent {k}: last question")
    assert response.usage is not None
    seen["responses", "false"] += 1
    seen["prompt"] += response.usage.input_tokens
    seen["output"] += response.usage.output_tokens

    with pytest.raises(openai.BadRequestError):  # refused: no messages
        chat.chat.completions.create(model="x", messages=[])
    seen["refused"] += 1


def _settled(root: str, seen: Counter[Any]) -> Samples | None:
    """A scrape once it counts every committed and refused turn (the other worker's last counts come with its
    next beat, and a refusal can come after the beat that carried the commits)."""
    samples = scrape(root)
    committed = total(samples, "rollout_gateway_turns_total", outcome="committed")
    refused = total(samples, "rollout_gateway_turns_total", outcome="refused")
    stages = [total(samples, "rollout_gateway_turn_duration_seconds_count", stage=s) for s in STAGES]
    turns = sum(n for key, n in seen.items() if isinstance(key, tuple))
    settled = committed == turns and refused == seen["refused"] and stages == [turns] * len(STAGES)
    return samples if settled else None


def test_one_scrape_of_any_worker_counts_the_whole_gateway() -> None:
    with launch_gateway(workers=2, extra_args=["--log-level", "warning"]) as gw:
        root = gw.base_url.removesuffix("/v1")
        sids = [gw.client.open_session() for _ in range(SESSIONS)]
        seen: Counter[Any] = Counter()
        for k, sid in enumerate(sids):
            _agent(gw.base_url, sid, k, seen)
        rows = sum(len(gw.client.finish_session(sid)) for sid in sids)
        turns = sum(n for key, n in seen.items() if isinstance(key, tuple))

        samples: Samples | None = None

        def settled() -> bool:
            nonlocal samples
            samples = _settled(root, seen)
            return samples is not None

        assert wait_until(settled, timeout=SETTLE_S, interval=0.25), (seen, scrape(root))
        assert samples is not None
        for (dialect, stream), n in ((k, n) for k, n in seen.items() if isinstance(k, tuple)):
            assert total(samples, "rollout_gateway_turns_total", dialect=dialect, stream=stream,
                         outcome="committed") == n, (dialect, stream)  # fmt: skip
        assert total(samples, "rollout_gateway_turns_total", outcome="refused") == seen["refused"]
        assert total(samples, "rollout_gateway_turns_total", outcome="aborted") == 0
        assert total(samples, "rollout_gateway_http_errors_total", route="chat", status="400") == seen["refused"]
        assert total(samples, "rollout_gateway_tokens_total", kind="prompt") == seen["prompt"] > 0
        assert total(samples, "rollout_gateway_tokens_total", kind="output") == seen["output"] > 0
        for stage in STAGES:  # each turn observed once per stage, and the +Inf bucket holds them all
            assert total(samples, "rollout_gateway_turn_duration_seconds_bucket", stage=stage, le="+Inf") == turns
            assert total(samples, "rollout_gateway_turn_duration_seconds_sum", stage=stage) > 0
        # the broker's side of the same load
        assert total(samples, "rollout_gateway_broker_commits_total", outcome="stored") == turns
        assert total(samples, "rollout_gateway_broker_commit_seconds_count") >= turns
        assert total(samples, "rollout_gateway_sessions_total", event="opened") == SESSIONS
        assert total(samples, "rollout_gateway_sessions_total", event="finished") == SESSIONS
        assert total(samples, "rollout_gateway_sessions_open") == 0
        assert total(samples, "rollout_gateway_turns_in_flight") == 0
        assert total(samples, "rollout_gateway_rows_per_episode_count") == SESSIONS
        assert total(samples, "rollout_gateway_rows_per_episode_sum") == rows
        decisions = {d: total(samples, "rollout_gateway_row_decisions_total", decision=d)
                     for d in ("clean", "first", "branch", "realign", "rewrite", "fork")}  # fmt: skip
        assert sum(decisions.values()) == turns, decisions  # every turn placed once
        # both workers alive (a worker that uvicorn restarted under a loaded machine is heard again in a beat)
        assert wait_until(lambda: total(scrape(root), "rollout_gateway_workers") == 2, timeout=SETTLE_S)
        live = scrape(root)
        pids = {dict(labels)["pid"] for (name, labels) in live if name == "rollout_gateway_worker_info"}
        assert len(pids) == 2
        ages = [v for (name, _), v in live.items() if name == "rollout_gateway_worker_heartbeat_age_seconds"]
        assert len(ages) == 2 and all(0 <= age < 5 for age in ages), ages

        # every scrape (each a new connection, so either worker answers) is the gateway's, not one worker's
        names = ("rollout_gateway_turns_total", "rollout_gateway_tokens_total", "rollout_gateway_broker_commits_total")
        counts = {key: v for key, v in samples.items() if key[0] in names}
        for _ in range(6):
            again = scrape(root)
            assert {key: again.get(key) for key in counts} == counts


def _status(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "gateway_workers.cli", "status", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def test_status_shows_the_gateway_once_as_json_and_live_on_screen() -> None:
    with launch_gateway(workers=1, extra_args=["--log-level", "warning"]) as gw:
        finished, _open = gw.client.open_session(), gw.client.open_session()
        chat = openai.OpenAI(base_url=gw.base_url, api_key=finished, max_retries=0)
        for k in range(3):
            chat.chat.completions.create(model="x", messages=[{"role": "user", "content": f"question {k}"}])
        rows = len(gw.client.finish_session(finished))
        control = gw.client.endpoint

        def committed() -> float:  # as of the worker's last heartbeat
            counters = gw.client.stats()["gateway"]["counters"]
            return sum(v for name, labels, v in counters if name == "turns" and labels[2] == "committed")

        assert wait_until(lambda: committed() == 3, timeout=SETTLE_S)

        done = _status("--control", control, "--once", "--json")
        assert done.returncode == 0, done.stderr
        summary = json.loads(done.stdout)
        assert summary["sessions_open"] == 1 and summary["episodes"] == 1
        assert summary["rows_per_episode"] == rows
        assert summary["turns_per_s"]["committed"] > 0 and summary["turns_per_s"]["refused"] == 0
        assert 0 < summary["turn_seconds"]["p50"] <= summary["turn_seconds"]["p99"]
        (worker,) = summary["workers"].values()
        assert worker["heard_s_ago"] < 5 and worker["pid"] > 0 and worker["turns_in_flight"] == 0

        # live: a screen per refresh, rates over the last interval (none: the gateway is idle)
        view = subprocess.Popen(
            [sys.executable, "-m", "gateway_workers.cli", "status", "--control", control, "--interval", "0.3"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        lines: list[str] = []
        assert view.stdout is not None
        reader = threading.Thread(target=lambda: lines.extend(view.stdout), daemon=True)  # type: ignore[arg-type]
        reader.start()
        header = f"rollout-gateway at {control}"
        try:
            assert wait_until(lambda: sum(line.startswith(header) for line in lines) >= 3, timeout=SETTLE_S), lines
            view.send_signal(signal.SIGINT)  # ends the view between two refreshes
            view.wait(10)
            reader.join(10)
            err = view.stderr.read() if view.stderr is not None else ""
        finally:
            view.kill()
            for pipe in (view.stdout, view.stderr):
                if pipe is not None:
                    pipe.close()
        assert view.returncode == 0, err
        out = "".join(lines)
        last = out.rsplit(f"rollout-gateway at {control}", 1)[1]
        assert "turns/s     0.0 committed" in last and "workers (1)" in last, last

    # the broker gone: a clear error, fast, and a failing exit
    gone = _status("--control", control, "--once", "--timeout", "1")
    assert gone.returncode == 1 and "did not answer" in gone.stderr, gone
