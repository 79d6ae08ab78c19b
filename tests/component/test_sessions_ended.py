"""Workers forget ended sessions: the broker answers heartbeats with the sessions that ended since the last one.

Two real `Backplane`s (their heartbeat threads included) against a real broker on port 0: a session whose turns
one of them committed holds a commit base there until the session finishes; within a couple of heartbeats both
workers are told (each once), the base is dropped and the listeners hear it; a dropped session is told too.
"""

from __future__ import annotations

import asyncio
import time

from component.peers import conversation
from test_delta_commit_sockets import commit_and_wait, full_commit

from gateway_workers.capture.backplane import HEARTBEAT_INTERVAL_S, Backplane

TOLD_WITHIN_S = 3 * HEARTBEAT_INTERVAL_S + 2.0
DEADLINE_S = 30.0


async def _until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return predicate()


def test_both_workers_are_told_each_end_once_and_drop_their_bases(broker, client):
    turns = conversation(5, 2, first_prompt=100, tail=10, output=8)
    kept, finished, dropped = client.open_session(), client.open_session(), client.open_session()
    heard: dict[str, list[str]] = {"a": [], "b": []}

    async def main() -> tuple[Backplane, Backplane]:
        a, b = Backplane(broker.worker_endpoint), Backplane(broker.worker_endpoint)
        a.ended_listeners.append(heard["a"].extend)
        b.ended_listeners.append(heard["b"].extend)
        a.start()
        b.start()
        try:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S * 1.5)  # both heard (by a beat from its thread), so not new
            for sid in (kept, finished):
                for k, turn in enumerate(turns):
                    await a.open_turn(sid, f"t{k}")
                    await commit_and_wait(a, full_commit(sid, f"t{k}", turn))
            assert a.bases.get(finished) is not None and len(a.bases) == 2
            rows = await asyncio.to_thread(client.finish_session, finished)
            assert rows and await asyncio.to_thread(client.drop_session, dropped)
            assert await _until(lambda: heard["a"] and heard["b"], TOLD_WITHIN_S), heard
            await asyncio.sleep(2 * HEARTBEAT_INTERVAL_S)  # later beats tell nothing again
            return a, b
        finally:
            await a.close()
            await b.close()

    a, b = asyncio.run(asyncio.wait_for(main(), DEADLINE_S))
    assert heard == {"a": [finished, dropped], "b": [finished, dropped]}
    assert a.bases.get(finished) is None and a.bases.get(kept) is not None  # the live session's base stays
    assert a.counters["sessions_ended"] == b.counters["sessions_ended"] == 2
