"""The backplane's resends over a real socket: a ZeroMQ ROUTER on a random port stands in for a slow broker.

A COMMIT or ABORT built with a fresh `Backplane.request_id()` goes out as it is the first time;
an unanswered attempt is resent under a new request id, and a late reply to the first attempt
answers nothing. A message with request id 0 gets a fresh id on its first send too.
"""

from __future__ import annotations

import asyncio
from array import array

import zmq

from broker import protocol
from gateway_workers.capture import commits as commits_module
from gateway_workers.capture.backplane import Backplane

DEADLINE_S = 10.0
ATTEMPT_S = 0.2
POLL_S = 0.005


async def frames(sock: zmq.Socket, count: int) -> list[tuple[bytes, protocol.WorkerToBroker]]:
    """The next `count` frames the backplane sent but heartbeats, with their senders (polled without blocking the
    loop)."""
    out = []
    while len(out) < count:
        if sock.poll(0):
            peer, frame = sock.recv_multipart()
            msg = protocol.decode_worker_to_broker(frame)
            if not isinstance(msg, protocol.Heartbeat):
                out.append((peer, msg))
        else:
            await asyncio.sleep(POLL_S)
    return out


def commit(request_id: int) -> protocol.CommitTurn:
    return protocol.CommitTurn(
        request_id, "s", "t0", array("i", [1, 2, 3]), array("i", [4]), array("f", [-0.5]), "stop",
        [{"role": "user", "content": "q"}], {"role": "assistant", "content": "a"}, {"ill_formed": False},
    )  # fmt: skip


def test_an_unanswered_commit_is_resent_under_a_new_id_and_a_late_reply_answers_nothing(router, monkeypatch):
    monkeypatch.setattr(commits_module, "ATTEMPT_TIMEOUT_S", ATTEMPT_S)
    sock, endpoint = router

    async def main() -> tuple[list[int], dict[str, int], int | None]:
        backplane = Backplane(endpoint)
        backplane.start()
        try:
            message = commit(backplane.request_id())
            backplane.commit_in_background(message)
            (peer, first), = await frames(sock, 1)  # fmt: skip
            assert (first.request_id, first.turn_id) == (message.request_id, "t0")  # the message itself, first
            (_, second), = await frames(sock, 1)  # fmt: skip  # unanswered for ATTEMPT_S: resent
            late = protocol.encode(protocol.TurnCommitted(first.request_id, "t0", "stored"))
            sock.send_multipart([peer, late])  # answers the first attempt: nobody waits for it any more
            await asyncio.sleep(ATTEMPT_S / 2)
            assert backplane._commits, "a late reply to an earlier attempt must not settle the commit"
            ack = protocol.encode(protocol.TurnCommitted(second.request_id, "t0", "stored"))
            sock.send_multipart([peer, ack])
            await backplane.drain(DEADLINE_S)
            base = backplane.bases.get("s")
            return [first.request_id, second.request_id], dict(backplane.counters), base and base.prompt_tokens
        finally:
            await backplane.close()

    ids, counters, base_tokens = asyncio.run(asyncio.wait_for(main(), DEADLINE_S))
    assert ids[0] != ids[1] and ids[0] > 0
    assert counters == {"commits_full": 1, "commits_delta": 0, "delta_refused": 0, "sessions_ended": 0}
    assert base_tokens == 3  # ACKed: the next turn's base


def test_messages_without_a_request_id_and_aborts_get_fresh_ids(router):
    sock, endpoint = router

    async def main() -> list[protocol.WorkerToBroker]:
        backplane = Backplane(endpoint)
        backplane.start()
        try:
            backplane.commit_in_background(commit(0))
            backplane.abort_in_background("s", "t1", "client disconnected")
            sent = [m for _, m in await frames(sock, 2)]
            for peer_message in sent:
                assert peer_message.request_id > 0
            return sent
        finally:
            await backplane.close()

    sent = asyncio.run(asyncio.wait_for(main(), DEADLINE_S))
    assert {type(m) for m in sent} == {protocol.CommitTurn, protocol.AbortTurn}
    assert len({m.request_id for m in sent}) == 2
