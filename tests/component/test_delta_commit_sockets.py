"""Delta commits over real sockets: the worker's real `Backplane` (zmq.asyncio) against a real broker on port 0.

A session committed through the backplane goes delta after its first turn and trains exactly
like the same session committed in full (by the plain `WorkerPeer`); a delta whose base the
broker does not hold is refused with unknown_base and the backplane resends the turn in full,
so the turn still lands.
"""

from __future__ import annotations

import asyncio
import dataclasses
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

from component.peers import WorkerPeer, assert_linear_rows, conversation

from broker import protocol
from gateway_workers.capture.backplane import Backplane

DEADLINE_S = 20.0  # the whole async part of a test
DRAIN_S = 5.0


def run_with_backplane(endpoint: str, body: Callable[[Backplane], Awaitable[Any]]) -> tuple[Any, Backplane]:
    """Run `body(backplane)` on a fresh event loop with a started backplane, closed on the way out."""

    async def main() -> Any:
        backplane = Backplane(endpoint)
        backplane.start()
        try:
            return await asyncio.wait_for(body(backplane), DEADLINE_S), backplane
        finally:
            await backplane.close()

    return asyncio.run(main())


def full_commit(sid: str, turn_id: str, turn: Any) -> protocol.CommitTurn:
    return protocol.CommitTurn(
        0, sid, turn_id, turn.prompt_ids, turn.output_ids, turn.logprobs, "stop",
        turn.prompt_messages, turn.response_message, {"ill_formed": False},
    )  # fmt: skip


async def commit_and_wait(backplane: Backplane, commit: protocol.CommitTurn) -> None:
    backplane.commit_in_background(commit)
    await backplane.drain(DRAIN_S)  # like an agent: the next turn starts after this one's reply (and ACK)
    assert not backplane._commits, "commit not acknowledged within the deadline"


def test_a_session_goes_delta_after_its_first_turn_and_trains_like_full_commits(broker, client, worker: WorkerPeer):
    turns = conversation(7, 6, first_prompt=300, tail=20, output=12)
    sid = client.open_session()

    async def body(backplane: Backplane) -> None:
        for k, turn in enumerate(turns):
            opened = await backplane.open_turn(sid, f"t{k}")
            assert opened.seq == k
            await commit_and_wait(backplane, full_commit(sid, f"t{k}", turn))

    _, backplane = run_with_backplane(broker.worker_endpoint, body)
    assert backplane.counters == {"commits_full": 1, "commits_delta": 5, "delta_refused": 0, "sessions_ended": 0}
    stats = client.stats()
    assert stats["commits_stored"] == 6 and stats["commits_delta"] == 5 and stats["refusals"] == {}
    # each token once: the deltas shared the whole previous context, as full commits would
    final = len(turns[-1].prompt_ids) + len(turns[-1].output_ids)
    assert stats["tokens_held"] == final

    full_sid = client.open_session()  # the same episode, committed in full by a plain peer
    for k, turn in enumerate(turns):
        assert isinstance(worker.open_turn(full_sid, f"t{k}"), protocol.TurnOpened)
        assert worker.commit(full_sid, f"t{k}", turn).outcome == "stored"
    assert client.stats()["commits_delta"] == 5
    delta_rows = client.finish_session(sid, reward=1.0, rollout_id="r")
    full_rows = client.finish_session(full_sid, reward=1.0, rollout_id="r")
    assert_linear_rows(delta_rows, turns)
    assert [(r.token_ids, r.loss_mask, r.logprobs, r.response) for r in delta_rows] == [
        (r.token_ids, r.loss_mask, r.logprobs, r.response) for r in full_rows
    ]


def test_a_delta_against_a_base_the_broker_lacks_is_refused_then_committed_in_full(broker, client):
    turns = conversation(8, 2, first_prompt=200, tail=10, output=10)
    sid = client.open_session()

    async def body(backplane: Backplane) -> None:
        await backplane.open_turn(sid, "t0")
        backplane.abort_in_background(sid, "t0", "client_disconnect")  # the broker never stores t0
        await backplane.drain(DRAIN_S)
        # ...but this worker takes it for a base (as after a lost ACK race or a broker restart)
        backplane.bases.remember(full_commit(sid, "t0", turns[0]))
        await backplane.open_turn(sid, "t1")
        await commit_and_wait(backplane, full_commit(sid, "t1", turns[1]))

    _, backplane = run_with_backplane(broker.worker_endpoint, body)
    assert backplane.counters == {"commits_full": 1, "commits_delta": 1, "delta_refused": 1, "sessions_ended": 0}
    base = backplane.bases.get(sid)
    assert base is not None and base.turn_id == "t1"  # the turn that landed is the next base
    stats = client.stats()
    assert stats["refusals"] == {"unknown_base": 1}
    assert stats["commits_unknown_base"] == 1 and stats["commits_stored"] == 1 and stats["commits_delta"] == 0
    (row,) = client.finish_session(sid)
    # the first prompt is stripped: the row holds t1's prompt and trains on t1's output only
    assert row.prompt_ids == turns[1].prompt_ids.tolist()
    assert row.token_ids == (turns[1].prompt_ids + turns[1].output_ids).tolist()
    assert sum(row.loss_mask) == len(turns[1].output_ids)


def test_raw_deltas_over_the_socket_duplicate_and_unknown_base(broker, client, worker: WorkerPeer):
    turns = conversation(9, 2, first_prompt=50, tail=5, output=5)
    sid = client.open_session()
    for k in range(2):
        assert isinstance(worker.open_turn(sid, f"t{k}"), protocol.TurnOpened)
    assert worker.commit(sid, "t0", turns[0]).outcome == "stored"
    n0 = len(turns[0].prompt_ids) + len(turns[0].output_ids)
    delta = protocol.CommitTurn(
        worker.next_id(), sid, "t1", turns[1].prompt_ids[n0:], turns[1].output_ids, turns[1].logprobs, "stop",
        turns[1].prompt_messages[3:], turns[1].response_message,
        base_turn_id="t0", base_tokens=n0, base_messages=3, prompt_len=len(turns[1].prompt_ids),
        base_crc32=zlib.crc32(turns[0].prompt_ids.tobytes() + turns[0].output_ids.tobytes()),
    )  # fmt: skip
    unknown = worker.request(dataclasses.replace(delta, request_id=worker.next_id(), base_turn_id="nope"))
    assert isinstance(unknown, protocol.Refused) and unknown.code == "unknown_base"
    wrong = worker.request(dataclasses.replace(delta, request_id=worker.next_id(), base_crc32=delta.base_crc32 ^ 1))
    assert isinstance(wrong, protocol.Refused) and wrong.code == "unknown_base"  # a prefix the base does not have
    assert worker.request(delta) == protocol.TurnCommitted(delta.request_id, "t1", "stored")
    again = dataclasses.replace(delta, request_id=worker.next_id())
    assert worker.request(again).outcome == "duplicate"
    records = client.finish_session(sid)
    assert_linear_rows(records, turns)
