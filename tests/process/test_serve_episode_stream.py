"""The episode stream with real processes: `serve` + fake engine + the openai SDK as agents, and a bare broker.

The batch test runs 64 tool-using agents (the official SDK) through a 2-worker `serve` whose
broker keeps at most 16 episodes in its outbox; half of the sessions are finished by their
agents over HTTP (`POST /rollout/v1/sessions/finish` through the SDK's own client), half by the
trainer's `request_finish`. Finishers see the full outbox as busy and retry; two subscriber
threads and one subscriber process share the stream. Every episode must arrive exactly once,
with rows identical to what `finish_session` returns for a control run of the same agent (the
fake engine is deterministic in the prompt; agents come in 8 variants, one control each; rows
are compared modulo the random turn ids their metadata names). The other tests use
`python -m broker` with a protocol-speaking test worker: a subscriber process killed
mid-stream, and a broker restart.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import zmq
from assets import TOOLS, FakeEngine
from component.peers import WorkerPeer, conversation
from processes import TestProcess, start_broker

from trainer_client import (
    BrokerBusy,
    BrokerTimeout,
    EpisodeTimeout,
    SessionClosed,
    TraceRecord,
    TrainerClient,
    launch_gateway,
)

SUBSCRIBER = Path(__file__).resolve().parent / "episode_subscriber.py"
FINISH_PATH = "/rollout/v1/sessions/finish"
OUTBOX_MAX = 16
N_SESSIONS = 64
VARIANTS = 8  # distinct agents (prompts); session i runs variant i % VARIANTS
MAX_TURNS = 6
FINISH_DEADLINE_S = 60.0
BUSY_RETRY_S = 0.25
CONSUME_DELAY_S = 0.01  # each consumer "trains" a little, so all three take part


@pytest.fixture
def zmq_ctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def engine(qwen3_tokenizer_dir: str) -> Iterator[FakeEngine]:
    with FakeEngine(qwen3_tokenizer_dir, tool_rounds=1) as fake:  # one tool round: two turns per agent
        yield fake


@pytest.fixture(scope="module")
def gateway(engine: FakeEngine, qwen3_tokenizer_dir: str) -> Iterator[Any]:
    extra = ["--engine-timeout", "6", "--log-level", "warning", "--allow-agent-finish"]
    env = {"ROLLOUT_BROKER_OUTBOX_MAX_EPISODES": str(OUTBOX_MAX)}
    with launch_gateway(
        workers=2,
        engine_kind="vllm",
        engine_urls=[engine.url],
        tokenizer=qwen3_tokenizer_dir,
        extra_args=extra,
        env=env,
    ) as gw:
        yield gw


def run_agent(base_url: str, sid: str, index: int) -> int:
    """A tool-using agent on the official SDK (retrying 5xx as it does by default); returns its number of turns."""
    with openai.OpenAI(base_url=base_url, api_key=sid, max_retries=2, timeout=30) as client:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a careful weather agent."},
            {"role": "user", "content": f"Agent {index}: what is the weather in city number {index}?"},
        ]
        for turn in range(1, MAX_TURNS + 1):
            message = client.chat.completions.create(model="qwen3", messages=messages, tools=TOOLS).choices[0].message
            echo: dict[str, Any] = {"role": "assistant", "content": message.content or ""}
            if getattr(message, "reasoning_content", None):
                echo["reasoning_content"] = message.reasoning_content
            if message.tool_calls:
                echo["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": c.function.arguments},
                    }
                    for c in message.tool_calls
                ]
            messages.append(echo)
            if not message.tool_calls:
                return turn
            for call in message.tool_calls:
                result = json.dumps({"ok": True, **json.loads(call.function.arguments)})
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return MAX_TURNS


class Busy:
    """Counts the busy answers finishers saw (and signals the first)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts = {"trainer": 0, "agent": 0}
        self.seen = threading.Event()

    def saw(self, who: str) -> None:
        with self.lock:
            self.counts[who] += 1
        self.seen.set()


def agent_finish(root: str, sid: str, body: dict[str, Any], busy: Busy) -> None:
    """The agent finishes its own session through the SDK's client; a full outbox (503) is retried."""
    deadline = time.monotonic() + FINISH_DEADLINE_S
    with openai.OpenAI(base_url=root, api_key=sid, max_retries=0, timeout=30) as client:
        while True:
            try:
                reply = client.post(FINISH_PATH, body=body, cast_to=httpx.Response)
            except openai.APIStatusError as e:
                assert e.status_code == 503 and e.response.headers["retry-after"], e
                assert e.body["code"] == "outbox_full"
                busy.saw("agent")
                assert time.monotonic() < deadline
                time.sleep(BUSY_RETRY_S)
                continue
            assert reply.json() == {"object": "rollout.session.finish", "status": "accepted"}
            return


def trainer_finish(client: TrainerClient, sid: str, body: dict[str, Any], busy: Busy) -> None:
    deadline = time.monotonic() + FINISH_DEADLINE_S
    while True:
        try:
            client.request_finish(sid, **body)
            return
        except BrokerBusy:
            busy.saw("trainer")
            assert time.monotonic() < deadline
            time.sleep(BUSY_RETRY_S)


def normalized(rows: list[TraceRecord]) -> list[tuple[Any, ...]]:
    """What finish_session and the stream must agree on, less what differs per run by design:
    the random turn ids in the metadata, and the per-session reward, rollout id and metadata["i"]."""
    skip = {"turn_ids", "parent_turn_id", "i"}
    return [
        (
            r.token_ids,
            r.loss_mask,
            r.logprobs,
            r.response_length,
            r.response,
            r.status,
            {k: v for k, v in r.metadata.items() if k not in skip},
        )
        for r in rows
    ]


def test_64_sessions_finished_by_trainer_and_agents_reach_three_subscribers_exactly_once(gateway, tmp_path):
    root = gateway.base_url.removesuffix("/v1")
    trainer = gateway.client
    before = trainer.stats()
    sids = [trainer.open_session(sampling_defaults={"temperature": 1.0}) for _ in range(N_SESSIONS)]
    controls = [trainer.open_session(sampling_defaults={"temperature": 1.0}) for _ in range(VARIANTS)]
    bodies = [{"reward": i / 8, "rollout_id": f"ep-{i}", "metadata": {"i": i}} for i in range(N_SESSIONS)]
    busy = Busy()
    expected: dict[int, list[tuple[Any, ...]]] = {}

    def episode(i: int) -> None:
        run_agent(gateway.base_url, sids[i], i % VARIANTS)
        if i % 2:
            trainer_finish(trainer, sids[i], bodies[i], busy)
        else:
            agent_finish(root, sids[i], bodies[i], busy)

    def control(v: int) -> None:
        run_agent(gateway.base_url, controls[v], v)
        expected[v] = normalized(trainer.finish_session(controls[v], wait_timeout=10, **bodies[v]))

    stop_file, out_file = tmp_path / "stop", tmp_path / "episodes.jsonl"
    subscriber = TestProcess(
        [
            sys.executable,
            "-u",
            str(SUBSCRIBER),
            "--control",
            gateway.control,
            "--stop-file",
            str(stop_file),
            "--out",
            str(out_file),
            "--delay",
            str(CONSUME_DELAY_S),
        ],
        name="subscriber",
    )
    delivered: dict[str, list[tuple[str, Any]]] = {}
    lock = threading.Lock()
    all_in = threading.Event()
    errors: list[BaseException] = []

    def consume(name: str) -> None:
        try:
            with trainer.episodes(timeout=0.2, max_pending=2) as stream:
                while not all_in.is_set():
                    try:
                        got = next(stream)
                    except EpisodeTimeout:
                        continue
                    record(name, got.session_id, got)
                    time.sleep(CONSUME_DELAY_S)
        except BaseException as e:
            errors.append(e)

    def record(name: str, sid: str, got: Any) -> None:
        with lock:
            delivered.setdefault(sid, []).append((name, got))
            if len(delivered) == N_SESSIONS:
                all_in.set()

    threads = [threading.Thread(target=consume, args=(f"thread-{k}",)) for k in range(2)]
    with ThreadPoolExecutor(16) as pool, contextlib.ExitStack() as stack:
        jobs = [pool.submit(control, v) for v in range(VARIANTS)] + [pool.submit(episode, i) for i in range(N_SESSIONS)]
        # nobody consumes until the outbox is full: every finisher after that must see backpressure
        deadline = time.monotonic() + 80
        while not busy.seen.wait(0.05):
            for job in jobs:
                if job.done():
                    job.result()  # an agent's or finisher's failure surfaces here
            assert time.monotonic() < deadline, "the outbox never filled up"
        stack.enter_context(subscriber).expect("SUBSCRIBER READY", 30)  # started now; stopped on the way out
        for t in threads:
            t.start()
        seen_lines = 0
        deadline = time.monotonic() + 90
        while not all_in.is_set():
            assert time.monotonic() < deadline, f"{len(delivered)} of {N_SESSIONS} episodes arrived"
            # only whole lines: a line longer than the writer's buffer reaches the file in pieces
            text = out_file.read_text() if out_file.exists() else ""
            lines = text[: text.rfind("\n") + 1].splitlines()
            for line in lines[seen_lines:]:
                data = json.loads(line)
                record("process", data["session_id"], data)
            seen_lines = len(lines)
            time.sleep(0.02)
        for job in jobs:
            job.result(timeout=60)  # an agent's or finisher's failure surfaces here
        stop_file.touch()
        subscriber.expect("SUBSCRIBER DONE", 30)
        for t in threads:
            t.join(10)
    assert not errors, errors
    assert len(out_file.read_text().splitlines()) == seen_lines  # nothing reached the process after the count

    # every episode exactly once, never redelivered, rows identical to finish_session's
    assert set(delivered) == set(sids)
    consumers = {name for got in delivered.values() for name, _ in got}
    assert consumers == {"thread-0", "thread-1", "process"}, consumers
    for i, sid in enumerate(sids):
        ((name, got),) = delivered[sid]
        if name == "process":
            rows = [TraceRecord(**r) for r in got["rows"]]
            meta = (got["redelivered"], got["status"], got["reward"], got["finished_by"])
        else:
            rows = got.rows
            meta = (got.redelivered, got.status, got.reward, got.finished_by)
        assert meta == (False, "complete", i / 8, "trainer" if i % 2 else "agent")
        assert normalized(rows) == expected[i % VARIANTS] and rows, (i, name)
        assert all((r.reward, r.rollout_id, r.metadata["i"]) == (i / 8, f"ep-{i}", i) for r in rows)
    after = trainer.stats()
    delta = {k: after[k] - before[k] for k in ("episodes_delivered", "episodes_acked", "outbox_full_refusals")}
    assert delta["episodes_delivered"] == delta["episodes_acked"] == N_SESSIONS
    assert after["episodes_redelivered"] == before["episodes_redelivered"]
    assert delta["outbox_full_refusals"] == sum(busy.counts.values()) > 0
    assert after["outbox_episodes"] == 0 and after["outbox_reserved"] == 0


def test_through_serve_a_second_finish_is_a_final_410_the_sdk_does_not_retry(gateway):
    root = gateway.base_url.removesuffix("/v1")
    sid = gateway.client.open_session()
    run_agent(gateway.base_url, sid, 1)
    gateway.client.finish_session(sid)
    closed_before = gateway.client.stats()["refusals"].get("session_closed", 0)
    with openai.OpenAI(base_url=root, api_key=sid, max_retries=3) as sdk, pytest.raises(openai.APIStatusError) as e:
        sdk.post(FINISH_PATH, body={"reward": 1.0}, cast_to=httpx.Response)
    assert e.value.status_code == 410 and e.value.body["code"] == "session_finished"
    assert "finished by the trainer" in e.value.body["message"]
    # the broker refused exactly one finish: the SDK did not retry the 410
    assert gateway.client.stats()["refusals"]["session_closed"] == closed_before + 1

    # the agent first: the trainer's finish is refused, the episode reaches the stream
    sid = gateway.client.open_session(group="agent-first")
    run_agent(gateway.base_url, sid, 2)
    with openai.OpenAI(base_url=root, api_key=sid, max_retries=0) as sdk:
        sdk.post(FINISH_PATH, body={"reward": 0.5, "rollout_id": 7}, cast_to=httpx.Response)
    with pytest.raises(SessionClosed, match="finished by the agent"):
        gateway.client.finish_session(sid)
    with gateway.client.episodes(group="agent-first", timeout=10) as stream:
        got = next(stream)
    assert (got.session_id, got.reward, got.rollout_id, got.finished_by) == (sid, 0.5, "7", "agent")
    assert got.rows and got.status == "complete"


# --- a bare broker process ---------------------------------------------------------------------


def finished_sessions(client: TrainerClient, worker: WorkerPeer, n: int, seed: int = 0) -> list[str]:
    sids = []
    for i in range(n):
        sid = client.open_session()
        for k, turn in enumerate(conversation(seed + i, 2, first_prompt=16, tail=4, output=4)):
            worker.open_turn(sid, f"t{k}")
            worker.commit(sid, f"t{k}", turn)
        client.request_finish(sid, reward=float(i))
        sids.append(sid)
    return sids


def test_a_killed_subscriber_process_loses_its_unacked_episodes_to_the_survivor(zmq_ctx):
    proc, worker_ep, control_ep = start_broker()
    worker = WorkerPeer(zmq_ctx, worker_ep)
    with proc, TrainerClient(control_ep, timeout=10) as client:
        sids = finished_sessions(client, worker, 10)
        victim = TestProcess(
            [
                sys.executable,
                "-u",
                str(SUBSCRIBER),
                "--control",
                control_ep,
                "--max-pending",
                "3",
                "--lease",
                "1",
                "--hold-after",
                "2",
            ],
            name="victim",
        ).start()
        with victim:
            assert victim.expect(r"HOLDING (\d+)", 30).group(1) == "3"  # one yielded, two prefetched
            lines = [ln.split()[1] for ln in victim.output.splitlines() if ln.startswith("EPISODE ")]
            first, held = lines
            assert client.stats()["outbox_leased"] == 3
            victim.kill()  # SIGKILL: no goodbye, the lease must run out
            victim.wait(10)
        t0 = time.monotonic()
        got = []
        with client.episodes(timeout=5, max_pending=8) as survivor:
            while len(got) < 9:
                got.append(next(survivor))
        redelivered = {e.session_id for e in got if e.redelivered}
        assert len(redelivered) == 3 and held in redelivered  # the yielded-unacked one and the two prefetched
        assert first not in {e.session_id for e in got}  # acknowledged by moving on: never handed out again
        assert sorted([first] + [e.session_id for e in got]) == sorted(sids)
        assert time.monotonic() - t0 < 4.0  # about one lease
        stats = client.stats()
        assert (stats["leases_expired"], stats["episodes_redelivered"], stats["episodes_acked"]) == (1, 3, 10)
        assert stats["outbox_episodes"] == 0
    worker.close()


def test_the_stream_reconnects_after_a_broker_restart_and_says_what_was_lost(zmq_ctx, caplog):
    proc, worker_ep, control_ep = start_broker()
    try:
        with TrainerClient(control_ep, timeout=1.0) as client:
            worker = WorkerPeer(zmq_ctx, worker_ep)
            finished_sessions(client, worker, 2)
            worker.close()
            stream = client.episodes(timeout=5, max_pending=2)
            next(stream)  # one yielded, one prefetched: both die with the broker (documented)
            proc.kill()
            proc.wait(10)
            t0 = time.monotonic()
            with pytest.raises(BrokerTimeout):
                next(stream)
            assert time.monotonic() - t0 < 3.0
            proc, _, _ = start_broker(worker=worker_ep, control=control_ep)
            worker = WorkerPeer(zmq_ctx, worker_ep)
            (sid,) = finished_sessions(client, worker, 1, seed=50)
            worker.close()
            with caplog.at_level("WARNING", logger="trainer_client.subscriber"):
                got = next(stream)  # the same stream, reconnected: the new broker's episode
            assert got.session_id == sid and not got.redelivered
            assert any("broker restarted" in r.message for r in caplog.records)
            stream.close()
            assert client.stats()["episodes_acked"] == 1
    finally:
        proc.stop()
