"""The pause as this worker knows it: the gate every engine call passes, and what the worker reports of it.

The broker tells a pause and its end (`protocol.GenerationChanged`) on the heartbeat socket, unasked, and in
every OPEN's answer (`TurnOpened.generation_epoch`, `paused`); whichever arrives first is applied. An OPEN's
answer counts only when its epoch is higher; what the broker tells is taken as it is (a broker restarted without
its state counts epochs from zero again). While paused, an engine call waits at the gate (`held`) until the
resume or its hold bound; the calls already past it finish (wait), or are stopped at the engine (abort: each
call's `stoppers` entry), keeping what they sampled (`turns.gated_engine`). The worker reports [epoch, engine
calls, turns held, tokens kept] in every beat, and asks for a beat at once when that report matters to a
waiting pause (the pause applied, the last engine call done), so the broker sees it idle without waiting out
a beat interval.

The event loop's thread only, except `report`, which the heartbeat thread reads (four ints; a report one
change late is corrected by the next beat). Imports the stdlib only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

logger = logging.getLogger(__name__)


class GenerationGate:
    """Whether engine calls may start, the engine calls in flight and the turns held."""

    def __init__(self) -> None:
        self.epoch = 0
        self.paused = ""  # the pause's mode; "" when generating
        self.weight_version = -1  # as the last change or OPEN told it: what a held turn samples under
        self.engine_calls = 0
        self.turns_held = 0
        self.tokens_kept = 0
        self.counters = {"pauses_applied": 0, "held": 0, "hold_timeouts": 0, "stopped": 0, "tokens_kept": 0}
        self._open: asyncio.Event | None = None  # set while generating; made on the loop's thread
        self.beat_soon: Callable[[], None] = lambda: None  # set by the backplane: a beat now
        # The engine calls in flight, by engine request id: (session id, replica), what `stop` (set by the gated
        # engine) needs to stop one at the engine (a pause in mode abort).
        self.stoppers: dict[str, tuple[str, str]] = {}
        self.stop: Callable[[str, str, str], Coroutine[Any, Any, None]] | None = None
        self._stopping: set[asyncio.Task[None]] = set()

    def _event(self) -> asyncio.Event:
        if self._open is None:
            self._open = asyncio.Event()
            if not self.paused:
                self._open.set()
        return self._open

    def apply(self, epoch: int, paused: str, weight_version: int, told: bool = False) -> None:
        """A change an OPEN's answer showed (older ones are ignored), or one the broker `told` on the heartbeat
        socket, taken whatever its epoch: a broker restarted without its state counts from its own start."""
        if epoch < self.epoch and told:
            self.epoch = epoch - 1  # taken as new below
        if epoch <= self.epoch:
            if epoch == self.epoch and weight_version >= 0:
                self.weight_version = weight_version
            return
        was = self.paused
        self.epoch, self.paused = epoch, paused
        if weight_version >= 0:
            self.weight_version = weight_version
        if paused:
            self._event().clear()
            if not was:
                self.counters["pauses_applied"] += 1
                self.tokens_kept = 0  # reported per pause
                logger.info("generation paused (%s): new engine calls wait for the resume", paused)
            if paused == "abort":
                self._stop_all()
        else:
            self._event().set()
            if was:
                logger.info("generation resumed: %d held turns go on", self.turns_held)
        self.beat_soon()

    def _stop_all(self) -> None:
        """Stop every engine call in flight at the engine; each comes back with what it sampled."""
        if self.stop is None:
            return
        loop = asyncio.get_running_loop()
        for request_id, (session_id, replica) in self.stoppers.items():
            task = loop.create_task(self.stop(request_id, session_id, replica))
            self._stopping.add(task)
            task.add_done_callback(self._stop_done)
        self.counters["stopped"] += len(self.stoppers)

    def _stop_done(self, task: asyncio.Task[None]) -> None:
        self._stopping.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("stopping a generation for the pause failed", exc_info=task.exception())

    def kept(self, tokens: int) -> None:
        """A stopped call kept `tokens` sampled before the pause."""
        self.tokens_kept += tokens
        self.counters["tokens_kept"] += tokens

    def report(self) -> list[int]:
        return [self.epoch, self.engine_calls, self.turns_held, self.tokens_kept]

    async def enter(self, hold_s: float) -> bool:
        """Pass the gate for an engine call (counted in flight until `leave`): at once while generating, else
        after the resume. Whether the call waited; raises HoldTimeout after `hold_s` held (cancelled: the
        agent left)."""
        event = self._event()
        if event.is_set():
            self.engine_calls += 1
            return False
        self.turns_held += 1
        self.counters["held"] += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + hold_s
        try:
            # Again after each wake-up: a resume and the next pause may both be applied before it runs.
            while not event.is_set():
                await asyncio.wait_for(event.wait(), max(deadline - loop.time(), 0))
        except asyncio.TimeoutError:
            self.counters["hold_timeouts"] += 1
            raise HoldTimeout(hold_s) from None
        finally:
            self.turns_held -= 1
        self.engine_calls += 1
        return True

    def leave(self) -> None:
        self.engine_calls -= 1
        if self.paused and not self.engine_calls:
            self.beat_soon()  # the pause may be waiting for this worker to go idle


class HoldTimeout(Exception):
    """A turn held longer than its bound while generation was paused."""

    def __init__(self, hold_s: float) -> None:
        super().__init__(f"generation stayed paused for {hold_s:g}s")
        self.hold_s = hold_s
