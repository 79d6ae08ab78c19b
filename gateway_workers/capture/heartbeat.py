"""The worker's heartbeats to the broker, sent from a thread of their own on a socket of their own.

The broker abandons the in-flight turns of a worker it stops hearing from (`broker.sessions.workers`).
That must mean the process is gone or frozen, not that its event loop is behind: a worker saturated by
its agents still commits its turns, late, and a finish that gave up on them in the meantime would lose
turns the agents received. So the beats do not wait for the event loop: a thread sends one every
`interval_s` (it needs the GIL only for a moment, which the interpreter hands over within milliseconds).
The thread owns its DEALER from creation to close (a ZeroMQ socket must stay in one thread). Imports
`broker.protocol` and `broker.curve` only.
"""

from __future__ import annotations

import logging
import threading

import zmq

from broker import curve, protocol

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 2.0


class HeartbeatThread:
    """Sends `Heartbeat(worker_id)` to `endpoint` every `interval_s` until `stop()`."""

    def __init__(
        self, ctx: zmq.Context, endpoint: str, keys: curve.ClientKeys | None, worker_id: str, interval_s: float
    ) -> None:
        self._ctx, self._endpoint, self._keys = ctx, endpoint, keys
        self._frame = protocol.encode(protocol.Heartbeat(0, worker_id))
        self._interval_s = interval_s
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="broker-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            if self._keys is not None:
                self._keys.apply(sock)
            sock.connect(self._endpoint)
            while not self._stopping.wait(self._interval_s):
                try:
                    sock.send(self._frame, zmq.NOBLOCK)
                except zmq.Again:
                    pass  # the broker is not reading: it will not miss this beat
        except Exception:
            logger.exception("heartbeats to the broker at %s stopped: its turns will be given up", self._endpoint)
        finally:
            sock.close(linger=0)

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(STOP_TIMEOUT_S)
