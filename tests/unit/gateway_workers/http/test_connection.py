"""AgentConnection: a disconnect cancels only guarded work, and only its own cancellation is consumed."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway_workers.http.connection import AgentConnection, session_key

WAIT_S = 2.0


class Channel:
    """An ASGI receive channel the test disconnects by hand."""

    def __init__(self) -> None:
        self.left = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.left.wait()
        return {"type": "http.disconnect"}


async def _guarded(connection: AgentConnection, started: asyncio.Event) -> str:
    try:
        with connection.cancelled_on_disconnect():
            started.set()
            await asyncio.sleep(WAIT_S * 10)
        return "finished"
    except asyncio.CancelledError:
        if connection.took_cancel():
            return "agent left"
        raise


def test_an_agent_leaving_cancels_the_guarded_await_and_the_cancel_is_consumed() -> None:
    async def main() -> tuple[str, int]:
        channel = Channel()
        connection = AgentConnection(channel.receive)
        started = asyncio.Event()
        task = asyncio.ensure_future(_guarded(connection, started))
        await asyncio.wait_for(started.wait(), WAIT_S)
        channel.left.set()
        outcome = await asyncio.wait_for(task, WAIT_S)
        connection.stop()
        cancelling = task.cancelling() if hasattr(task, "cancelling") else 0
        return outcome, cancelling

    outcome, cancelling = asyncio.run(main())
    assert outcome == "agent left"
    assert cancelling == 0  # uncancelled: later timeouts in the task behave


def test_a_cancel_from_elsewhere_is_not_taken_for_the_agent_leaving() -> None:
    async def main() -> None:
        connection = AgentConnection(Channel().receive)
        started = asyncio.Event()
        task = asyncio.ensure_future(_guarded(connection, started))
        await asyncio.wait_for(started.wait(), WAIT_S)
        task.cancel()  # e.g. the server shutting down
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, WAIT_S)
        connection.stop()

    asyncio.run(main())


def test_work_for_an_agent_that_already_left_does_not_start() -> None:
    async def main() -> str:
        channel = Channel()
        channel.left.set()
        connection = AgentConnection(channel.receive)
        await asyncio.wait_for(connection.gone.wait(), WAIT_S)
        outcome = await asyncio.wait_for(_guarded(connection, asyncio.Event()), WAIT_S)
        connection.stop()
        return outcome

    assert asyncio.run(main()) == "agent left"


def test_leaving_outside_the_guarded_block_cancels_nothing() -> None:
    async def main() -> bool:
        channel = Channel()
        connection = AgentConnection(channel.receive)
        with connection.cancelled_on_disconnect():
            await asyncio.sleep(0)
        channel.left.set()
        await asyncio.wait_for(connection.gone.wait(), WAIT_S)
        await asyncio.sleep(0.01)  # a wrongly armed cancel would land here
        connection.stop()
        return True

    assert asyncio.run(main())


@pytest.mark.parametrize(
    ("headers", "key"),
    [
        ({"authorization": "Bearer abc"}, "abc"),
        ({"authorization": "bearer  abc "}, "abc"),
        ({"x-api-key": "k1"}, "k1"),
        ({"authorization": "Basic xyz", "x-api-key": "k2"}, "k2"),
        ({"authorization": "Bearer "}, None),
        ({}, None),
    ],
)
def test_the_session_key_is_the_bearer_token_or_the_x_api_key(headers: dict[str, str], key: str | None) -> None:
    assert session_key(headers) == key


def test_stop_cancels_a_waiting_watcher_a_loop_pass_later_and_leaves_a_woken_one_to_end() -> None:
    async def main() -> tuple[bool, bool, bool]:
        # uvicorn wakes `receive()` with a disconnect when the reply's last part is sent, before stop()
        finished = Channel()
        connection = AgentConnection(finished.receive)
        await asyncio.sleep(0)  # the watcher waits in receive()
        finished.left.set()
        connection.stop()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        woken = connection._watcher
        # a server whose receive() keeps waiting (no reply end signalled): the watcher is cancelled
        waiting = AgentConnection(Channel().receive)
        await asyncio.sleep(0)
        waiting.stop()
        still_running = not waiting._watcher.done()  # not cancelled within stop() itself
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return woken.done() and not woken.cancelled(), still_running, waiting._watcher.cancelled()

    ended_on_its_own, deferred, cancelled = asyncio.run(main())
    assert ended_on_its_own and deferred and cancelled
