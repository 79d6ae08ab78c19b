"""A worker's per-session memory follows its live sessions: what it keeps of a session goes when the session ends.

A real `serve` (2 workers, mock engine, the official openai SDK): 8 agents run 3 turns each, then the trainer
finishes 6 sessions (`finish_session` and `request_finish`) and drops one. Within a few heartbeats every worker
says, in its own snapshot (`/metrics/worker`), that it was told all 7 ends and keeps commit bases and last
renders for the one live session at most, its piece cache having let go of the ended sessions' own text.
"""

from __future__ import annotations

import openai
from assets import wait_until
from processes import launch_gateway
from scrapes import worker_snapshots

AGENTS, TURNS = 8, 3
TOLD_WITHIN_S = 15.0


def _agent(base_url: str, sid: str, k: int) -> None:
    client = openai.OpenAI(base_url=base_url, api_key=sid, max_retries=2)
    messages = [{"role": "system", "content": "You are a careful assistant. " * 40}]  # shared by every session
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"agent {k} turn {turn}: " + f"detail {k}-{turn} " * 60})
        reply = client.chat.completions.create(model="x", messages=messages)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})


def _metrics_by_worker(root: str) -> dict[int, dict[str, float]]:
    """Each worker's gauges and counters (its own snapshot), under the names this test reads."""
    names = {"worker_sessions_held:commit_bases": "commit_bases", "worker_sessions_held:session_renders":
             "session_renders", "sessions_ended_told": "sessions_ended", "render_cache:forgotten": "forgotten",
             "render_cache_bytes": "render_cache_bytes"}  # fmt: skip
    return {pid: {short: values.get(name, 0) for name, short in names.items()}
            for pid, values in worker_snapshots(root, 2).items()}


def test_a_worker_drops_what_it_keeps_of_ended_sessions():
    with launch_gateway(workers=2, extra_args=["--log-level", "warning"]) as gw:
        root = gw.base_url.removesuffix("/v1")
        sids = [gw.client.open_session() for _ in range(AGENTS)]
        for k, sid in enumerate(sids):
            _agent(gw.base_url, sid, k)
        before = _metrics_by_worker(root)
        assert len(before) == 2
        assert sum(w["commit_bases"] for w in before.values()) >= AGENTS  # each session's base, on some worker
        for sid in sids[:3]:
            assert gw.client.finish_session(sid)
        for sid in sids[3:6]:
            gw.client.request_finish(sid)
        assert gw.client.drop_session(sids[6])
        ended = AGENTS - 1

        def told() -> dict[int, dict[str, float]] | None:
            workers = _metrics_by_worker(root)
            done = len(workers) == 2 and all(w["sessions_ended"] == ended for w in workers.values())
            return workers if done else None

        assert wait_until(told, timeout=TOLD_WITHIN_S, interval=0.5), _metrics_by_worker(root)
        after = told()
        assert after is not None
        for pid, worker in after.items():
            assert worker["commit_bases"] <= 1 and worker["session_renders"] <= 1, (pid, worker)
            if before[pid]["session_renders"] > 1:  # it rendered ended sessions: their own pieces went with them
                assert worker["forgotten"] > 0 and worker["render_cache_bytes"] < before[pid][
                    "render_cache_bytes"], (pid, before[pid], worker)
        assert sum(w["commit_bases"] for w in after.values()) >= 1  # the live session's base is kept
