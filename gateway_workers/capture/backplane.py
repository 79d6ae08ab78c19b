"""The worker side of the backplane: one ZeroMQ DEALER from this worker to the broker.

Owns the socket (created in the Starlette lifespan, never at import), a reader on the
event loop that resolves futures keyed by request id, and the turn requests: OPEN (before
rendering; resent while unanswered, for up to `hold_s`, so a request outlives a broker restart),
COMMIT and ABORT (sent in the background until acknowledged: `commits.CommitSender`), GET (a
committed turn's messages, for `previous_response_id`) and an agent's FINISH
(`request_finish`). Every OPEN names this worker (`worker_id`, fresh per process), and a heartbeat
says it is alive every HEARTBEAT_INTERVAL_S (the first on this socket, before any OPEN; the rest from
`heartbeat.HeartbeatThread`): the broker abandons the open turns of a worker it stops hearing from,
and answers beats with the sessions that ended, whose commit bases are then dropped (and
`ended_listeners` told), so a worker's memory follows its live sessions.
With a CURVE key directory the socket authenticates and encrypts (`broker.curve`), and a handshake
the broker refuses is logged as an error (`handshake_log`). Imports
`broker.protocol` and `broker.curve` and nothing else from `broker`; nothing here blocks
the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import socket
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import zmq

from broker import curve, protocol
from gateway_workers.capture.commit_bases import CommitBases
from gateway_workers.capture.commits import CommitSender
from gateway_workers.capture.generation import GenerationGate
from gateway_workers.capture.handshake_log import HandshakeLog
from gateway_workers.capture.heartbeat import HeartbeatThread
from gateway_workers.metrics import WorkerMetrics

logger = logging.getLogger(__name__)
_Reply = TypeVar("_Reply", bound=protocol.BrokerToWorker)

CALL_TIMEOUT_S = 5.0  # a GET or an agent's FINISH waits this long for the broker before the agent gets a 503
# An OPEN the broker does not answer is resent as the same frame (same request id, same turn id: the broker
# answers a repeated OPEN as it answered the first) after OPEN_RESEND_FIRST_S, then at doubling intervals up to
# OPEN_RESEND_MAX_S, until it is answered or the backplane's `hold_s` has passed. A live broker answers in a
# millisecond or so, so a second of silence means it is gone (a supervised one is back in 1-2 s). Only a copy
# sent into the dead connection is lost: what is sent while ZeroMQ reconnects waits in the socket and reaches
# the restarted broker, so more copies would only be duplicates for it to answer (and log, with a state dir).
OPEN_RESEND_FIRST_S = 1.0
OPEN_RESEND_MAX_S = 4.0
DEFAULT_HOLD_S = 300.0  # as the worker's `--pause-hold-s`, which sets it
GET_TURN_PENDING_S = 3.0  # how long a turn whose COMMIT is still on its way is waited for
GET_TURN_RETRY_S = 0.02
# A retried request whose earlier attempt is still in flight asks the broker again at growing intervals
# until that turn commits (its reply is replayed) or aborts (sampled afresh). The turn's engine timeout
# ends it long before this bound, which only guards against a turn no one settles.
RETRY_WAIT_S = 900.0
RETRY_ASK_FIRST_S = 0.05
RETRY_ASK_MAX_S = 1.0
FIRST_ID_RANGE = 1 << 48
# Well inside the broker's silence bound (`broker.config.WORKER_SILENCE_S`): a few beats may be late.
HEARTBEAT_INTERVAL_S = 1.0
LINGER_MS = 1000
SEND_HWM = 100_000
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_zmq_poll = zmq.zmq_poll
# The Cython socket's own send: pyzmq's Python-level `Socket.send` only adds DRAFT routing_id/group
# handling (unused here) around it, and another call with keywords.
_send_frame = getattr(zmq.backend, "Socket", zmq.Socket).send


class BrokerUnavailable(Exception):
    """The broker did not answer in time; the agent gets a 503 and may retry."""


class TurnRefused(Exception):
    """The broker refused the turn; `code` is a `protocol.ErrorCode`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Backplane:
    """DEALER socket to the broker with request/reply matching by request id.

    A plain (blocking-API) pyzmq socket used without ever blocking: sends are NOBLOCK (a full
    queue, 100k frames behind, counts as an unanswered attempt), and replies are read by a
    callback on the socket's file descriptor. zmq.asyncio did the same with a future per send
    and per receive, which was a visible part of a turn's CPU.

    `curve_keys` (a directory with `broker.key` and `worker.key_secret`) makes it a CURVE client;
    without it, a non-loopback endpoint raises `curve.CurveError`. `hold_s` bounds how long an OPEN
    waits for an absent broker (resent meanwhile) before it raises BrokerUnavailable.
    """

    def __init__(
        self,
        endpoint: str,
        bases: CommitBases | None = None,
        curve_keys: str | None = None,
        metrics: WorkerMetrics | None = None,
        hold_s: float = DEFAULT_HOLD_S,
    ) -> None:
        curve.require_keys_off_loopback(endpoint, curve_keys, "the broker endpoint")
        keys = curve.load_client_keys(curve_keys, "worker") if curve_keys is not None else None
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, LINGER_MS)
        self._sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._sock.setsockopt(zmq.RCVHWM, SEND_HWM)
        self._handshakes: HandshakeLog | None = None
        if keys is not None:
            keys.apply(self._sock)
            # before connect: the first handshake too
            self._handshakes = HandshakeLog(curve.HandshakeWatch(self._sock, endpoint, "worker"), endpoint)
        self._sock.connect(endpoint)
        # From a random point, as a trainer's: the broker takes a RequestFinish with the session and request
        # id of an accepted one for its resend, so another worker's must not meet it by chance.
        self._ids = itertools.count(1 + secrets.randbelow(FIRST_ID_RANGE))
        self._pending: dict[int, asyncio.Future[protocol.BrokerToWorker]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._keys = keys
        self._heartbeats: HeartbeatThread | None = None
        # A restarted worker must be a new worker to the broker (its predecessor's turns are abandoned), so the
        # pid alone (reused across restarts, and across hosts) does not name it.
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.endpoint = endpoint
        self.hold_s = hold_s
        self.bases = bases if bases is not None else CommitBases()
        # Told the sessions that ended, as the broker says at heartbeats, to drop what they keep of them.
        self.ended_listeners: list[Callable[[list[str]], None]] = []
        self.counters: dict[str, int] = dict.fromkeys(
            ("commits_full", "commits_delta", "delta_refused", "sessions_ended"), 0
        )
        self.metrics = metrics if metrics is not None else WorkerMetrics()  # the commits' latency goes there
        # COMMITs and ABORTs, each sent by a task of its own until acknowledged.
        commits = CommitSender(self._send, self._send_message, self._ids, self.bases, self.counters, self.metrics)
        self.commit_in_background, self.abort_in_background = commits.commit_in_background, commits.abort_in_background
        self.drain, self._commits = commits.drain, commits.tasks
        self.generation = GenerationGate()  # the pause as the broker tells it
        self.generation.worker_id = self.worker_id

    def start(self, snapshot: Callable[[], dict[str, Any]] | None = None) -> None:
        """Start reading replies, and the heartbeats, each carrying `snapshot()` (this worker's metrics)."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._sock.FD, self._read_replies)
        try:  # on this socket, so the broker hears it before this worker's first OPEN
            _send_frame(self._sock, protocol.encode(protocol.Heartbeat(0, self.worker_id)), _NOBLOCK)
        except zmq.Again:
            pass
        self._heartbeats = HeartbeatThread(
            self._ctx, self.endpoint, self._keys, self.worker_id, HEARTBEAT_INTERVAL_S, self._told_elsewhere,
            snapshot, self.generation.report,
        )
        self.generation.beat_soon = self._heartbeats.beat_soon
        self._heartbeats.start()
        if self._handshakes is not None:
            self._loop.add_reader(self._handshakes.watch.monitor.FD, self._handshakes.read)
            self._handshakes.read()  # events from before the reader was added

    def _read_replies(self) -> None:
        # The descriptor is edge-triggered (it signals a change, not a level): read until EVENTS says
        # nothing is left, here and after every send (a send can consume the signal of a reply).
        sock = self._sock
        while _readable(sock):
            frame = sock.recv(_NOBLOCK)
            try:
                reply = protocol.decode_broker_to_worker(frame)
            except protocol.ProtocolError:
                logger.exception("undecodable reply from the broker at %s", self.endpoint)
                continue
            if isinstance(reply, (protocol.SessionsEnded, protocol.GenerationChanged)):
                self._told(reply)
                continue
            future = self._pending.pop(reply.request_id, None)
            if future is not None and not future.done():
                future.set_result(reply)  # a late reply to a retried request finds no future: fine

    def _told(self, message: protocol.BrokerToWorker) -> None:
        """What the broker says unasked: the sessions that ended, or a pause or its end."""
        if isinstance(message, protocol.SessionsEnded):
            self._sessions_ended(message.session_ids)
        elif isinstance(message, protocol.GenerationChanged):
            self.generation.apply(message.epoch, message.paused, message.weight_version, True, message.engine_pausers)

    def _told_elsewhere(self, message: protocol.BrokerToWorker) -> None:
        """The heartbeat thread's `on_answer`: hands it to the event loop, which owns the caches and the gate."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nothing left to free
                loop.call_soon_threadsafe(self._told, message)

    def _sessions_ended(self, session_ids: list[str]) -> None:
        """Sessions that ended (finished or dropped): drop their commit bases, then tell `ended_listeners`."""
        self.counters["sessions_ended"] += len(session_ids)
        for sid in session_ids:
            self.bases.forget(sid)
        for listener in self.ended_listeners:
            listener(session_ids)

    def request_id(self) -> int:
        """A fresh request id, for a message handed to `commit_in_background` (else its first send makes a copy)."""
        return next(self._ids)

    def _send(
        self, build: Callable[[int], protocol.WorkerToBroker], timeout: float, resend: bool = False
    ) -> asyncio.Future[Any]:
        """Send `build(request_id)` now; the future gets the reply with that id, or asyncio.TimeoutError.

        With `resend`, the frame goes again while it is unanswered (see OPEN_RESEND_FIRST_S), and `timeout`
        bounds all of its sends: only for a request the broker answers alike however often it comes."""
        return self._send_message(build(next(self._ids)), timeout, resend)

    def _send_message(
        self, message: protocol.WorkerToBroker, timeout: float, resend: bool = False
    ) -> asyncio.Future[Any]:
        """Send `message`, whose request id is fresh from `request_id()`; the future is as `_send`'s."""
        loop = self._loop
        assert loop is not None, "Backplane.start() was not called"
        request_id = message.request_id
        future: asyncio.Future[Any] = loop.create_future()
        self._pending[request_id] = future
        frame = protocol.encode(message)
        if resend and timeout > OPEN_RESEND_FIRST_S:
            give_up = loop.time() + timeout
            expiry = loop.call_later(OPEN_RESEND_FIRST_S, self._resend, request_id, frame, give_up, OPEN_RESEND_FIRST_S)
        else:
            expiry = loop.call_later(timeout, _expire, future)
        pending = self._pending

        def forget(_: asyncio.Future[Any]) -> None:  # answered, timed out or cancelled by its waiter
            expiry.cancel()
            pending.pop(request_id, None)

        future.add_done_callback(forget)
        try:
            _send_frame(self._sock, frame, _NOBLOCK)
        except zmq.Again:
            pass  # 100k frames queued: the broker is not reading; this attempt goes unanswered
        if _readable(self._sock):
            loop.call_soon(self._read_replies)
        return future

    def _resend(self, request_id: int, frame: bytes, give_up: float, interval: float) -> None:
        """Send a request's frame again while it is unanswered; past `give_up`, it times out.

        Its timers are not cancelled when it is answered (only the first is, by `_send_message`): each finds it
        gone from `_pending` and does nothing, which keeps an answered request's cost what it was."""
        future = self._pending.get(request_id)
        if future is None or future.done():  # answered, or its waiter gave up
            return
        if self._handshakes is not None and self._handshakes.watch.refusal:
            _expire(future)  # a refused CURVE key is no restart: waiting would not get an answer
            return
        loop = future.get_loop()
        try:
            _send_frame(self._sock, frame, _NOBLOCK)
        except zmq.Again:
            pass  # as the first send's
        if _readable(self._sock):
            loop.call_soon(self._read_replies)
        interval, left = min(2 * interval, OPEN_RESEND_MAX_S), give_up - loop.time()
        if interval < left:
            loop.call_later(interval, self._resend, request_id, frame, give_up, interval)
        else:
            loop.call_later(left, _expire, future)

    async def _answer(
        self, sent: asyncio.Future[Any], expect: type[_Reply] | tuple[type[_Reply], ...], timeout: float
    ) -> _Reply:
        """The reply to a request, if it is `expect`: raises TurnRefused on a refusal, BrokerUnavailable otherwise."""
        try:
            reply = await sent
        except asyncio.TimeoutError:
            refusal = self._handshakes.watch.refusal if self._handshakes is not None else None
            why = f": {refusal}" if refusal else ""
            raise BrokerUnavailable(f"broker at {self.endpoint} did not answer in {timeout}s{why}") from None
        if isinstance(reply, expect):
            return reply
        if isinstance(reply, protocol.Refused):
            raise TurnRefused(reply.code, reply.message)
        raise BrokerUnavailable(f"unexpected reply {type(reply).__name__} to a request for {expect!r}")

    async def _call(
        self, build: Callable[[int], protocol.WorkerToBroker], expect: type[_Reply], timeout: float = CALL_TIMEOUT_S
    ) -> _Reply:
        return await self._answer(self._send(build, timeout), expect, timeout)

    def open_turn(
        self, session_id: str, turn_id: str, digest: str = "", retry: bool = False
    ) -> Coroutine[Any, Any, protocol.TurnOpened | protocol.TurnReplayed]:
        """OPEN, sent before this returns: await the result for the TurnOpened (or TurnRefused: unknown
        session, closed, cap; or BrokerUnavailable once the broker was silent for `hold_s`, the OPEN resent
        meanwhile). A caller that gives up must close() it; cancelling the await stops the resends.

        `digest` names the agent's request for its retries; a `retry` of it may get the earlier turn
        instead (`TurnReplayed`), after waiting for it while it is in flight."""

        def build(rid: int) -> protocol.OpenTurn:
            return protocol.OpenTurn(rid, session_id, turn_id, self.worker_id, digest, retry)

        sent = self._send(build, self.hold_s, resend=True)
        if retry:
            return self._open_retried(sent, build)
        return self._answer(sent, protocol.TurnOpened, self.hold_s)

    async def _open_retried(
        self, sent: asyncio.Future[Any], build: Callable[[int], protocol.OpenTurn]
    ) -> protocol.TurnOpened | protocol.TurnReplayed:
        loop = asyncio.get_running_loop()
        deadline, pause = loop.time() + RETRY_WAIT_S, RETRY_ASK_FIRST_S
        while True:
            try:
                reply: protocol.TurnOpened | protocol.TurnReplayed = await self._answer(
                    sent, (protocol.TurnOpened, protocol.TurnReplayed), self.hold_s
                )
                return reply
            except TurnRefused as e:
                if e.code != "turn_pending" or loop.time() > deadline:
                    raise
            await asyncio.sleep(pause)
            pause = min(2 * pause, RETRY_ASK_MAX_S)
            sent = self._send(build, self.hold_s, resend=True)

    async def get_turn(self, session_id: str, turn_id: str, with_ids: bool = False) -> protocol.TurnFound:
        """A committed turn's canonical messages (`previous_response_id`), and its ids `with_ids` (a linear
        session's held turn); raises TurnRefused or BrokerUnavailable.

        A turn still in flight is asked for again for a short while: its reply can reach the agent
        (and the agent's follow-up reach us) before its COMMIT reaches the broker.
        """
        deadline = asyncio.get_running_loop().time() + GET_TURN_PENDING_S
        while True:
            try:
                return await self._call(
                    lambda rid: protocol.GetTurn(rid, session_id, turn_id, with_ids),
                    protocol.TurnFound,
                )
            except TurnRefused as e:
                if e.code != "turn_pending" or asyncio.get_running_loop().time() > deadline:
                    raise
            await asyncio.sleep(GET_TURN_RETRY_S)

    async def request_finish(
        self,
        session_id: str,
        reward: float | None,
        rollout_id: str | None,
        metadata: dict[str, Any],
        wait_timeout: float,
    ) -> protocol.FinishAccepted:
        """An agent finishes its session: raises TurnRefused (already finished, unknown, busy) or BrokerUnavailable.

        Sent once, not retried: a retry after a lost reply would be refused as already finished.
        """
        return await self._call(
            lambda rid: protocol.RequestFinish(rid, session_id, reward, rollout_id, metadata, wait_timeout),
            protocol.FinishAccepted,
        )

    async def metrics_text(self, snapshot: dict[str, Any], timeout: float) -> str:
        """The whole gateway's metrics in the Prometheus text format, this worker's as of `snapshot`;
        BrokerUnavailable if the broker does not answer within `timeout`."""
        reply = await self._call(lambda rid: protocol.GetMetrics(rid, self.worker_id, snapshot), protocol.MetricsText,
                                 timeout)
        return reply.text

    async def close(self) -> None:
        for future in list(self._pending.values()):  # an OPEN still held: its agent gets the 503 now
            _expire(future)
        if self._heartbeats is not None:
            self._heartbeats.stop()
        if self._loop is not None:
            self._loop.remove_reader(self._sock.FD)
        if self._handshakes is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._handshakes.watch.monitor.FD)
            self._handshakes.watch.close()
        self._sock.close(linger=LINGER_MS)
        self._ctx.term()


def _readable(sock: zmq.Socket[bytes]) -> bool:
    # zmq_poll without a timeout reads ZMQ_EVENTS like getsockopt(EVENTS), which pyzmq wraps in
    # an enum on every call (and `& zmq.POLLIN` in another): about a third of the instructions (docs/performance.md).
    return bool(_zmq_poll([(sock, _POLLIN)], 0))


def _expire(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_exception(asyncio.TimeoutError())
