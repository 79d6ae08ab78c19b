"""The worker's heartbeats to the broker, sent from a thread of their own on a socket of their own.

The broker abandons the in-flight turns of a worker it stops hearing from (`broker.sessions.workers`).
That must mean the process is gone or frozen, not that its event loop is behind: a worker saturated by
its agents still commits its turns, late, and a finish that gave up on them in the meantime would lose
turns the agents received. So the beats do not wait for the event loop: a thread sends one every
`interval_s` (it needs the GIL only for a moment, which the interpreter hands over within milliseconds).
The broker answers a beat with the sessions that ended since the last one (`SessionsEnded`), and tells a pause
or its end here unasked (`GenerationChanged`); the thread hands either to `on_answer` (which must be
thread-safe). Each beat carries the worker's pause report (`generation`), and `beat_soon` sends one within a
wait slice instead of the interval, for a report a waiting pause needs. The thread owns its DEALER from creation to
close (a ZeroMQ socket must stay in one thread). A failure on the thread is logged and the beats start
again on a fresh socket: a worker that serves but does not beat would have its turns given up. Imports
`broker.protocol` and `broker.curve` only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from broker import curve, protocol

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 2.0
# After a failure, the beats start again this much later (a failure that repeats is logged at this rate).
RESTART_DELAY_S = 1.0
# Between beats the thread waits for the broker's answers in slices this long, so that `stop` is prompt.
_WAIT_SLICE_S = 0.1


class HeartbeatThread:
    """Sends `Heartbeat(worker_id, snapshot(), generation())` to `endpoint` every `interval_s` until `stop()`;
    passes each answer (`SessionsEnded`, `GenerationChanged`) to `on_answer`. `snapshot` (the worker's metrics)
    and `generation` run on this thread."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        keys: curve.ClientKeys | None,
        worker_id: str,
        interval_s: float,
        on_answer: Callable[[protocol.BrokerToWorker], None],
        snapshot: Callable[[], dict[str, Any]] | None = None,
        generation: Callable[[], list[int]] = list,
    ) -> None:
        self._ctx, self._endpoint, self._keys = ctx, endpoint, keys
        self._worker_id = worker_id
        self._snapshot = snapshot
        self._generation = generation
        self._soon = threading.Event()
        self._snapshot_failed = False
        self._interval_s = interval_s
        self._on_answer = on_answer
        self._stopping = threading.Event()
        self.restarts = 0  # how often the beats failed and started again
        self._thread = threading.Thread(target=self._run, name="broker-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        # A failure (a socket error, an `on_answer` that raised) must not end the beats while the worker serves:
        # the broker would give up its turns. So the beats start over on a fresh socket, after a pause.
        while not self._stopping.is_set():
            try:
                self._beat_until_stopped()
            except Exception:
                logger.exception("heartbeats to the broker at %s failed; they start again in %.1fs",
                                 self._endpoint, RESTART_DELAY_S)
                self.restarts += 1
                self._stopping.wait(RESTART_DELAY_S)

    def _beat_until_stopped(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            if self._keys is not None:
                self._keys.apply(sock)
            sock.connect(self._endpoint)
            next_beat = time.monotonic()  # at once: a restart may follow a long gap
            while not self._stopping.is_set():
                if self._soon.is_set():
                    self._soon.clear()
                    next_beat = time.monotonic()
                wait = min(next_beat - time.monotonic(), _WAIT_SLICE_S)
                if wait > 0 and sock.poll(wait * 1000):
                    self._answered(sock.recv())
                elif (now := time.monotonic()) >= next_beat:
                    next_beat = now + self._interval_s  # after a stall, one beat, not the missed ones
                    try:
                        sock.send(self._beat(), zmq.NOBLOCK)
                    except zmq.Again:
                        pass  # the broker is not reading: it will not miss this beat
        finally:
            sock.close(linger=0)

    def _beat(self) -> bytes:
        """A heartbeat frame with the worker's metrics; without them if taking or encoding them failed (logged
        once): the beat itself, which keeps the worker's turns alive, must go out."""
        generation = self._generation()
        if self._snapshot is not None:
            try:
                return protocol.encode(protocol.Heartbeat(0, self._worker_id, self._snapshot(), generation))
            except Exception:
                if not self._snapshot_failed:
                    logger.exception("this worker's metrics could not be taken; heartbeats go without them")
                    self._snapshot_failed = True
        return protocol.encode(protocol.Heartbeat(0, self._worker_id, {}, generation))

    def _answered(self, frame: bytes) -> None:
        try:
            answer = protocol.decode_broker_to_worker(frame)
        except protocol.ProtocolError:
            logger.exception("undecodable answer to a heartbeat from the broker at %s", self._endpoint)
            return
        self._on_answer(answer)

    def beat_soon(self) -> None:
        """Send the next beat within a wait slice (thread-safe)."""
        self._soon.set()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(STOP_TIMEOUT_S)
