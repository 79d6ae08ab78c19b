"""The pause as this worker knows it: the gate every engine call passes, and what the worker reports of it.

The broker tells a pause and its end (`protocol.GenerationChanged`) on the heartbeat socket, unasked, and in
every OPEN's answer (`TurnOpened.generation_epoch`, `paused`); whichever arrives first is applied. An OPEN's
answer counts only when its epoch is higher; what the broker tells is taken as it is (a broker restarted without
its state counts epochs from zero again). While paused, an engine call waits at the gate (`held`) until the
resume or its hold bound; the calls already past it finish (wait), are stopped at the engine (abort: each
call's `stoppers` entry), keeping what they sampled (`turns.gated_engine`), or are held by the engines' own
pause (keep), which this worker calls on its share of the replicas (`GenerationChanged.engine_pausers`; an
engine without replicas, the mock, is each worker's own) and, at the resume, resumes them with the new version.
The worker reports [epoch told, engine calls, turns held, tokens kept, replica pauses not yet answered] in
every beat, and asks for a beat at once when that report matters to a waiting pause (the pause applied, the
last engine call done, the last replica paused), so the broker sees it idle without waiting out a beat
interval.

The event loop's thread only, except `report`, which the heartbeat thread reads (four ints; a report one
change late is corrected by the next beat). Imports the stdlib only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

logger = logging.getLogger(__name__)

# A replica whose pause failed is asked again this often, for as long as the pause lasts (the pause is not idle
# until it answers: a replica still sampling must not have its weights changed under it); one whose resume failed,
# this many times (a replica that died comes back unpaused).
ENGINE_PAUSE_RETRY_S = 1.0
ENGINE_RESUME_TRIES = 30


class GenerationGate:
    """Whether engine calls may start, the engine calls in flight and the turns held."""

    def __init__(self) -> None:
        self.epoch = 0
        self.told_epoch = 0  # the last epoch the broker told (what the beats report: a lower one is told again)
        self.paused = ""  # the pause's mode; "" when generating
        self.weight_version = -1  # as the last change or OPEN told it: what a held turn samples under
        self.engine_calls = 0
        self.turns_held = 0
        self.tokens_kept = 0
        self.counters = dict.fromkeys(
            ("pauses_applied", "held", "hold_timeouts", "stopped", "tokens_kept", "resubmits", "failovers"), 0
        )
        self._open: asyncio.Event | None = None  # set while generating; made on the loop's thread
        self.beat_soon: Callable[[], None] = lambda: None  # set by the backplane: a beat now
        # The engine calls in flight, by engine request id: (session id, replica), what `stop` (set by the gated
        # engine) needs to stop one at the engine (a pause in mode abort).
        self.stoppers: dict[str, tuple[str, str]] = {}
        self.stop: Callable[[str, str, str], Coroutine[Any, Any, None]] | None = None
        self._stopping: set[asyncio.Task[None]] = set()
        # The engines' own pause (mode keep), set by the gated engine: its replicas, and the calls that pause one
        # and resume one (with the new weight version, or None when the pause did not change it).
        self.worker_id = ""
        self.replicas: tuple[str, ...] = ()
        self.pause_engine: Callable[[str], Coroutine[Any, Any, None]] | None = None
        self.resume_engine: Callable[[str, int | None], Coroutine[Any, Any, None]] | None = None
        self.engines_pausing = 0
        self.engines_paused: set[str] = set()  # replicas this worker paused and has not resumed
        self.keep_pauses = 0  # pauses in mode keep applied: a call that sees it change was held by the engine
        self._keep_version = -1  # the weight version when the engines were paused
        self._engine_calls: dict[str, asyncio.Task[None]] = {}  # each replica's last pause or resume, in order

    def _event(self) -> asyncio.Event:
        if self._open is None:
            self._open = asyncio.Event()
            if not self.paused:
                self._open.set()
        return self._open

    def apply(
        self, epoch: int, paused: str, weight_version: int, told: bool = False, engine_pausers: list[str] | None = None
    ) -> None:
        """A change an OPEN's answer showed (older ones are ignored), or one the broker `told` on the heartbeat
        socket, taken whatever its epoch (a broker restarted without its state counts from its own start), with
        the workers that pause and resume the engines (`engine_pausers`)."""
        if told:
            if epoch < self.epoch:
                self.epoch = epoch - 1  # taken as new below
            self.told_epoch = epoch
        if epoch <= self.epoch:
            if epoch == self.epoch and weight_version >= 0:
                self.weight_version = weight_version
            if told:
                self._engines(engine_pausers or [])
                self.beat_soon()
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
            elif paused == "keep" and was != "keep":
                self.keep_pauses += 1
                self._keep_version = self.weight_version
        else:
            self._event().set()
            if was:
                logger.info("generation resumed: %d held turns go on", self.turns_held)
        self._engines(engine_pausers or [])
        self.beat_soon()

    def _engines(self, pausers: list[str]) -> None:
        """Pause this worker's share of the replicas (mode keep), or resume them and any it paused (generating)."""
        if self.pause_engine is None or self.resume_engine is None:
            return
        replicas = self.replicas or ("",)  # no replicas: the engine is this worker's own
        mine: set[str] = set(replicas) if not self.replicas else set()
        if self.worker_id in pausers:
            at, n = pausers.index(self.worker_id), len(pausers)
            mine.update(r for i, r in enumerate(replicas) if i % n == at)
        if self.paused == "keep":
            for replica in sorted(mine - self.engines_paused):
                self.engines_paused.add(replica)
                self.engines_pausing += 1
                self._call_engine(replica, True, None)
        elif not self.paused and (self.engines_paused or pausers):
            version = self.weight_version if self.weight_version != self._keep_version else None
            for replica in sorted(self.engines_paused | (mine if pausers else set())):
                self._call_engine(replica, False, version)
            self.engines_paused.clear()

    def _call_engine(self, replica: str, pause: bool, version: int | None) -> None:
        """Pause or resume a replica, after its call before (a resume must not overtake its pause)."""
        before = self._engine_calls.get(replica)
        task = asyncio.get_running_loop().create_task(self._engine_call(before, replica, pause, version))
        self._engine_calls[replica] = task
        task.add_done_callback(lambda t: self._engine_calls.get(replica) is t and self._engine_calls.pop(replica))

    async def _engine_call(
        self, before: asyncio.Task[None] | None, replica: str, pause: bool, version: int | None
    ) -> None:
        """Asked again while it fails, for as long as it is still wanted (the pause, or the end of it, lasts)."""
        assert self.pause_engine is not None and self.resume_engine is not None
        what, tries = "pause" if pause else "resume", 0
        try:
            if before is not None:
                with contextlib.suppress(Exception):
                    await before
            while (self.paused == "keep") == pause and (pause or tries < ENGINE_RESUME_TRIES):
                try:
                    await (self.pause_engine(replica) if pause else self.resume_engine(replica, version))
                    return
                except Exception as e:  # noqa: BLE001 - any failure: asked again while still wanted
                    tries += 1
                    if tries == 1 or tries % 30 == 0:
                        logger.warning("the engine at %s did not %s (%d tries; asked again every %gs): %s",
                                       replica or "(built in)", what, tries, ENGINE_PAUSE_RETRY_S, e)  # fmt: skip
                await asyncio.sleep(ENGINE_PAUSE_RETRY_S)
        finally:
            if pause:
                self.engines_pausing -= 1
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
        return [self.told_epoch, self.engine_calls, self.turns_held, self.tokens_kept, self.engines_pausing]

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

    async def resumed(self, timeout: float) -> None:
        """Wait, at most `timeout`, for the pause to end (a call an engine pause held, to know the new version)."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._event().wait(), timeout)

    def leave(self) -> None:
        self.engine_calls -= 1
        if self.paused and not self.engine_calls:
            self.beat_soon()  # the pause may be waiting for this worker to go idle


class HoldTimeout(Exception):
    """A turn held longer than its bound while generation was paused."""

    def __init__(self, hold_s: float) -> None:
        super().__init__(f"generation stayed paused for {hold_s:g}s")
        self.hold_s = hold_s
