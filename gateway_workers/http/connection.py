"""The agent's HTTP connection: who it is (`session_key`) and whether it is still there (`AgentConnection`).

One watcher task per request reads the ASGI `receive` channel after the body; on
`http.disconnect` it sets `gone` and cancels the request's own task if that task is inside
`cancelled_on_disconnect()` (an engine call, a reply being sent). Engine calls and replies are
awaited directly in the request's task: no extra task and no wait on an Event per step.
Pure asyncio + ASGI callables: must not import Starlette, the app or the adapters.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]  # an ASGI receive channel


def session_key(headers: Mapping[str, str]) -> str | None:
    """The session key an agent sends as its API key: `Authorization: Bearer <key>` or `x-api-key`."""
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return headers.get("x-api-key") or None


class AgentConnection:
    """Watches one request's connection from when its body was read until `stop()`."""

    def __init__(self, receive: Receive) -> None:
        self.gone = asyncio.Event()
        self._armed: asyncio.Task[Any] | None = None
        self._cancelled: asyncio.Task[Any] | None = None
        self._watcher = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone.set()
        if self._armed is not None:
            self._cancelled = self._armed
            self._armed.cancel()

    def cancelled_on_disconnect(self) -> AgentConnection:
        """Inside (`with`), the current task is cancelled when the agent leaves (at once if it already left).

        The handler of that CancelledError asks `took_cancel()` whether it was ours. The connection is its own
        context manager: a turn enters one several times, and a generator-based one costs an object each.
        """
        return self

    def __enter__(self) -> None:
        if self.gone.is_set():
            raise _AgentLeft
        self._armed = asyncio.current_task()

    def __exit__(self, *exc: object) -> None:
        self._armed = None

    def took_cancel(self) -> bool:
        """Whether the CancelledError being handled came from the agent leaving; it is then consumed.

        Any other cancellation (e.g. the server shutting down) is the caller's to re-raise.
        """
        task = asyncio.current_task()
        if self._cancelled is not task:
            return self.gone.is_set() and isinstance(sys.exc_info()[1], _AgentLeft)
        self._cancelled = None
        uncancel = getattr(task, "uncancel", None)  # Python 3.11+: keep the task's cancel count honest
        if uncancel is not None:
            uncancel()
        return True

    def stop(self) -> None:
        """Stop watching. Once a reply is complete the server answers the watcher's `receive()` with a
        disconnect (uvicorn does, and wakes it as the reply's last part is sent), so the watcher is
        cancelled only if it is still waiting one loop pass later: a cancellation costs an exception
        thrown through `receive()` on every turn."""
        self._armed = None
        if not self._watcher.done():
            self._watcher.get_loop().call_soon(self._cancel_watcher)

    def _cancel_watcher(self) -> None:
        self._watcher.cancel()


class _AgentLeft(asyncio.CancelledError):
    """Raised instead of starting work for an agent that already left."""
