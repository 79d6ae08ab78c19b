"""An OPEN the broker does not answer is held and resent: a ZeroMQ ROUTER on a random port stands in for a
broker that lost the first copy (as one killed and restarted does).

The resend is the same frame (same request id, same turn id: the broker answers a repeated OPEN as it
answered the first), so the answer to any copy opens the turn. Past the backplane's `hold_s` the caller
gets BrokerUnavailable; a refusal is final at once; a caller that gives up leaves nothing pending and
stops the resends.
"""

from __future__ import annotations

import asyncio
import time
from array import array

import pytest
import zmq

from broker import protocol
from gateway_workers.capture import backplane as backplane_module
from gateway_workers.capture.backplane import Backplane, BrokerUnavailable, TurnRefused

DEADLINE_S = 10.0
RESEND_S = 0.1
POLL_S = 0.005
SID = "held-open-session-key-xxxxxxxx"


@pytest.fixture(autouse=True)
def _short_resends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backplane_module, "OPEN_RESEND_FIRST_S", RESEND_S)
    monkeypatch.setattr(backplane_module, "OPEN_RESEND_MAX_S", 2 * RESEND_S)


async def opens(sock: zmq.Socket, count: int, within: float = DEADLINE_S) -> list[tuple[bytes, protocol.OpenTurn]]:
    """The next `count` OPENs the backplane sent (heartbeats skipped), with their senders; fewer if none is
    waiting once `within` has passed (polled without blocking the loop)."""
    out: list[tuple[bytes, protocol.OpenTurn]] = []
    deadline = time.monotonic() + within
    while len(out) < count:
        if sock.poll(0):
            peer, frame = sock.recv_multipart()
            msg = protocol.decode_worker_to_broker(frame)
            if isinstance(msg, protocol.OpenTurn):
                out.append((peer, msg))
        elif time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        else:
            break
    return out


def opened(request: protocol.OpenTurn) -> bytes:
    return protocol.encode(protocol.TurnOpened(request.request_id, request.turn_id, 3, {}, None))


def test_an_open_whose_first_copy_is_lost_is_resent_and_opens_on_the_answer_to_the_resend(router):
    sock, endpoint = router

    async def main() -> tuple[protocol.BrokerToWorker, list[protocol.OpenTurn], int]:
        backplane = Backplane(endpoint, hold_s=DEADLINE_S)
        backplane.start()
        try:
            opening = asyncio.ensure_future(backplane.open_turn(SID, "t0"))
            [(_, lost)] = await opens(sock, 1)  # the broker died with it: never answered
            [(peer, again)] = await opens(sock, 1)
            sock.send_multipart([peer, opened(again)])
            reply = await asyncio.wait_for(opening, DEADLINE_S)
            return reply, [lost, again], len(backplane._pending)
        finally:
            await backplane.close()

    reply, (lost, again), pending = asyncio.run(asyncio.wait_for(main(), DEADLINE_S))
    assert (again.session_id, again.turn_id, again.request_id) == (lost.session_id, lost.turn_id, lost.request_id)
    assert isinstance(reply, protocol.TurnOpened) and (reply.turn_id, reply.seq) == ("t0", 3)
    assert pending == 0


def test_an_open_unanswered_for_the_hold_bound_is_broker_unavailable(router):
    sock, endpoint = router
    hold_s = 6 * RESEND_S

    async def main() -> tuple[float, list[protocol.OpenTurn], list[protocol.OpenTurn], int]:
        backplane = Backplane(endpoint, hold_s=hold_s)
        backplane.start()
        try:
            t0 = time.monotonic()
            opening = asyncio.ensure_future(backplane.open_turn(SID, "t0"))
            with pytest.raises(BrokerUnavailable, match="did not answer"):
                await asyncio.wait_for(opening, DEADLINE_S)
            waited = time.monotonic() - t0
            sent = [m for _, m in await opens(sock, 100, within=0)]
            later = [m for _, m in await opens(sock, 1, within=4 * RESEND_S)]  # given up: no more copies
            return waited, sent, later, len(backplane._pending)
        finally:
            await backplane.close()

    waited, sent, later, pending = asyncio.run(asyncio.wait_for(main(), DEADLINE_S))
    assert hold_s <= waited < hold_s + DEADLINE_S / 2
    # sent at 0, then after 0.1, 0.2 and 0.2 s: the intervals double up to their bound
    assert len(sent) >= 3 and {(m.turn_id, m.request_id) for m in sent} == {("t0", sent[0].request_id)}
    assert later == [] and pending == 0


def test_a_retried_open_is_held_too_and_its_wait_for_the_earlier_attempt_goes_on(router):
    sock, endpoint = router

    async def main() -> tuple[protocol.BrokerToWorker, list[protocol.OpenTurn]]:
        backplane = Backplane(endpoint, hold_s=DEADLINE_S)
        backplane.start()
        try:
            opening = asyncio.ensure_future(backplane.open_turn(SID, "t1", "digest", retry=True))
            [(peer, first)] = await opens(sock, 1)
            pending = protocol.Refused(first.request_id, "turn_pending", "the earlier attempt is in flight")
            sock.send_multipart([peer, protocol.encode(pending)])  # asked again, under a new request id
            [(_, lost), (peer, again)] = await opens(sock, 2)  # that ask is lost, its resend answered
            replayed = protocol.TurnReplayed(
                again.request_id, "t0", array("i", [1, 2]), array("i", [3]), "stop", {"role": "assistant"}, {}
            )
            sock.send_multipart([peer, protocol.encode(replayed)])
            return await asyncio.wait_for(opening, DEADLINE_S), [first, lost, again]
        finally:
            await backplane.close()

    reply, (first, lost, again) = asyncio.run(asyncio.wait_for(main(), DEADLINE_S))
    assert isinstance(reply, protocol.TurnReplayed) and reply.turn_id == "t0"
    assert all((m.turn_id, m.request_digest, m.retry) == ("t1", "digest", True) for m in (first, lost, again))
    assert lost.request_id == again.request_id != first.request_id


def test_a_refused_open_is_final_and_not_resent(router):
    sock, endpoint = router

    async def main() -> list[protocol.OpenTurn]:
        backplane = Backplane(endpoint, hold_s=DEADLINE_S)
        backplane.start()
        try:
            opening = asyncio.ensure_future(backplane.open_turn(SID, "t0"))
            [(peer, first)] = await opens(sock, 1)
            refused = protocol.Refused(first.request_id, "session_closed", "finishing")
            sock.send_multipart([peer, protocol.encode(refused)])
            with pytest.raises(TurnRefused, match="finishing"):
                await asyncio.wait_for(opening, DEADLINE_S)
            return [m for _, m in await opens(sock, 1, within=4 * RESEND_S)]
        finally:
            await backplane.close()

    assert asyncio.run(asyncio.wait_for(main(), DEADLINE_S)) == []


def test_a_held_open_its_caller_gives_up_leaves_nothing_pending_and_stops_its_resends(router):
    sock, endpoint = router

    async def main() -> tuple[int, list[protocol.OpenTurn]]:
        backplane = Backplane(endpoint, hold_s=DEADLINE_S)
        backplane.start()
        try:
            opening = asyncio.ensure_future(backplane.open_turn(SID, "t0"))
            await opens(sock, 2)  # held: sent and resent
            opening.cancel()  # the agent left
            with pytest.raises(asyncio.CancelledError):
                await opening
            await asyncio.sleep(0)  # the done callbacks
            return len(backplane._pending), [m for _, m in await opens(sock, 1, within=4 * RESEND_S)]
        finally:
            await backplane.close()

    pending, later = asyncio.run(asyncio.wait_for(main(), DEADLINE_S))
    assert pending == 0 and later == []
