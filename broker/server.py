"""The broker's socket loop: two ROUTER sockets, one thread, one blocking zmq Poller.

Owns the ZeroMQ side of the broker: binds the worker and control endpoints (port 0
works; the bound addresses are reported), decodes each frame with `broker.protocol`,
dispatches it to `sessions.SessionRegistry` and `outbox.Outbox`, and answers every request
exactly once with the same request id (`Refused` on any error). Finishes that must wait
for in-flight turns, and subscribers' long polls, are parked, never blocking the loop.
Plain blocking pyzmq: no asyncio.
Imports `broker.*` only; never `gateway_workers` or `trainer_client`.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import zmq

from broker import protocol
from broker.config import BrokerConfig
from broker.outbox import Outbox, Reply
from broker.rows import RowBuilder
from broker.sessions import FinishedSession, FinishOrigin, Refusal, SessionRegistry

logger = logging.getLogger(__name__)

READY_LINE = "BROKER READY worker={worker} control={control}"
# The loop wakes at least this often to notice should_exit (signals only set a flag).
MAX_POLL_MS = 100
# Frames handled per socket before the loop looks at the other socket and the clock:
# batching amortizes the poll, the bound keeps the trainer side responsive under load.
DRAIN_BATCH = 64
# Protocol errors are logged individually up to this many, then at most once per interval.
PROTOCOL_LOG_BURST = 20
PROTOCOL_LOG_INTERVAL_S = 5.0


@dataclass(slots=True)
class _ParkedFinish:
    envelope: list[bytes] | None  # None: a RequestFinish, already answered; its episode goes to the outbox
    msg: protocol.FinishSession | protocol.RequestFinish
    deadline: float
    token: int


class BrokerServer:
    """Binds both ROUTER sockets and serves them until `request_exit`.

    Construct, `bind()` (returns the bound endpoints), then `run()` in the thread that
    will own the sockets; `run` closes everything on its way out.
    """

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.should_exit = False
        self.registry = SessionRegistry(
            max_sessions=config.max_sessions,
            max_turns_cap=config.max_turns_cap,
            finished_memory=config.finished_memory,
        )
        self._ctx: zmq.Context | None = None
        self._workers: zmq.Socket | None = None
        self._control: zmq.Socket | None = None
        self._parked: dict[str, _ParkedFinish] = {}
        self._deadlines: list[tuple[float, int, str]] = []
        self._tokens = itertools.count()
        self._rows = RowBuilder(config.tokenizer)
        self.outbox = Outbox(
            max_episodes=config.outbox_max_episodes,
            max_bytes=config.outbox_max_bytes,
            max_wait=config.max_poll_wait,
            max_lease=config.max_lease,
            max_credit=config.max_credit,
        )
        self._refusals: Counter[str] = Counter()
        self._counters: Counter[str] = Counter()
        self._last_protocol_log = 0.0
        self._started = time.monotonic()

    # --- startup ---------------------------------------------------------------------

    def bind(self) -> tuple[str, str]:
        """Bind both endpoints; returns (worker, control) as actually bound."""
        self._ctx = zmq.Context()
        try:
            self._workers = self._router(self.config.worker_endpoint)
            self._control = self._router(self.config.control_endpoint)
        except zmq.ZMQError:
            self._ctx.destroy(linger=0)
            raise
        return self.worker_endpoint, self.control_endpoint

    def _router(self, endpoint: str) -> zmq.Socket:
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, self.config.shutdown_linger_ms)
        sock.setsockopt(zmq.SNDHWM, self.config.hwm)
        sock.setsockopt(zmq.RCVHWM, self.config.hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_frame_bytes)
        # Unroutable replies raise instead of vanishing, so they are counted and logged.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            raise zmq.ZMQError(e.errno, f"cannot bind {endpoint}: {e.strerror}") from e
        return sock

    @property
    def worker_endpoint(self) -> str:
        assert self._workers is not None
        return str(self._workers.getsockopt_string(zmq.LAST_ENDPOINT))

    @property
    def control_endpoint(self) -> str:
        assert self._control is not None
        return str(self._control.getsockopt_string(zmq.LAST_ENDPOINT))

    def warm_up(self) -> None:
        """Load what the first finish would otherwise load inside the loop (the response tokenizer)."""
        self._rows.decode(protocol.ids_array([0]))

    def close(self) -> None:
        """Release the sockets of a server that will not `run()`."""
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def request_exit(self) -> None:
        """Ask the loop to stop; safe from a signal handler or another thread."""
        self.should_exit = True

    # --- main loop ---------------------------------------------------------------------

    def run(self) -> None:
        """Serve until `request_exit`, then shut down within the configured linger."""
        assert self._workers is not None and self._control is not None, "bind() first"
        poller = zmq.Poller()
        poller.register(self._workers, zmq.POLLIN)
        poller.register(self._control, zmq.POLLIN)
        try:
            while not self.should_exit:
                events = dict(poller.poll(self._poll_timeout_ms()))
                if self._workers in events:
                    self._drain(self._workers, self._handle_worker_frame)
                if self._control in events:
                    self._drain(self._control, self._handle_trainer_frame)
                now = time.monotonic()
                if self._deadlines:
                    self._expire_parked(now)
                outbox_due = self.outbox.next_deadline()
                if outbox_due is not None and outbox_due <= now:
                    self._send_all(self.outbox.expire(now))
        finally:
            self._shutdown()

    def _poll_timeout_ms(self) -> int:
        due = [d for d in (self._deadlines[0][0] if self._deadlines else None, self.outbox.next_deadline()) if d]
        if not due:
            return MAX_POLL_MS
        wait = min(due) - time.monotonic()
        return max(0, min(MAX_POLL_MS, math.ceil(wait * 1000)))

    def _drain(self, sock: zmq.Socket, handle: Callable[[list[bytes], bytes], protocol.Message | None]) -> None:
        replies: list[tuple[list[bytes], protocol.Message]] = []
        for _ in range(DRAIN_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            # ROUTER prepends the peer identity; a REQ peer adds an empty delimiter. Echo the
            # whole envelope so either kind of peer gets its reply.
            envelope, payload = frames[:-1], frames[-1]
            try:
                reply = handle(envelope, payload)
            except Exception:  # the handlers answer their own failures; this guards the loop itself
                logger.exception("unhandled failure on a %d-byte frame", len(payload))
                reply = protocol.Refused(-1, "internal", "the broker failed on this frame; see its log")
            if reply is not None:
                replies.append((envelope, reply))
        # Replies leave as one burst after the batch: libzmq wakes its I/O thread once per
        # burst instead of once per reply (measured: that wake-up dominated the send cost).
        for envelope, reply in replies:
            self._send(sock, envelope, reply)

    def _send_all(self, replies: list[Reply]) -> None:
        """Answers the outbox produced for parked long polls: they all go to trainer peers."""
        assert self._control is not None
        for envelope, reply in replies:
            self._send(self._control, envelope, reply)

    def _send(self, sock: zmq.Socket, envelope: list[bytes], reply: protocol.Message) -> None:
        try:
            frame = protocol.encode(reply)
        except Exception:
            logger.exception("cannot encode %s reply to request %s", reply.TAG, reply.request_id)
            reply = protocol.Refused(reply.request_id, "internal", "the broker could not encode its reply")
            frame = protocol.encode(reply)
        if isinstance(reply, protocol.Refused):
            self._refusals[reply.code] += 1
        try:
            sock.send_multipart([*envelope, frame], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            # EHOSTUNREACH: the peer disconnected; EAGAIN: its queue is full. Either way the
            # peer's own deadline will fire (workers retry commits until acknowledged).
            self._counters["replies_dropped"] += 1
            logger.warning("reply %s to request %s dropped: %s", reply.TAG, reply.request_id, e)

    # --- dispatch ----------------------------------------------------------------------

    def _decode(self, payload: bytes, decode: Callable[[bytes], Any], side: str) -> protocol.Message | protocol.Refused:
        try:
            msg: protocol.Message = decode(payload)
            return msg
        except protocol.VersionMismatch as e:
            return self._protocol_error(side, "version_mismatch", e)
        except protocol.ProtocolError as e:
            return self._protocol_error(side, "protocol", e)

    def _protocol_error(self, side: str, code: str, e: protocol.ProtocolError) -> protocol.Refused:
        self._counters["protocol_errors"] += 1
        n = self._counters["protocol_errors"]
        now = time.monotonic()
        if n <= PROTOCOL_LOG_BURST or now - self._last_protocol_log >= PROTOCOL_LOG_INTERVAL_S:
            self._last_protocol_log = now
            logger.warning("bad frame from a %s peer (%d so far): %s", side, n, e)
        rid = e.request_id if e.request_id is not None else -1
        return protocol.Refused(rid, code, str(e))

    def _handle_worker_frame(self, envelope: list[bytes], payload: bytes) -> protocol.Message | None:
        msg = self._decode(payload, protocol.decode_worker_to_broker, "worker")
        if isinstance(msg, protocol.Refused):
            return msg
        try:
            match msg:
                case protocol.CommitTurn():
                    outcome = self.registry.commit_turn(msg)
                    self._after_turn_ended(msg.session_id)
                    return protocol.TurnCommitted(msg.request_id, msg.turn_id, outcome)
                case protocol.OpenTurn():
                    session, seq = self.registry.open_turn(msg.session_id, msg.turn_id)
                    return protocol.TurnOpened(
                        msg.request_id, msg.turn_id, seq, session.sampling_defaults, session.max_context_tokens
                    )
                case protocol.AbortTurn():
                    self.registry.abort_turn(msg.session_id, msg.turn_id)
                    self._after_turn_ended(msg.session_id)
                    return protocol.TurnAborted(msg.request_id, msg.turn_id)
                case protocol.GetTurn():
                    return self.handle_get_turn(msg)
                case protocol.RequestFinish():
                    return self.handle_request_finish(msg, "agent")
            raise TypeError(f"no handler for {type(msg).__name__}")
        except Refusal as r:
            return protocol.Refused(msg.request_id, r.code, r.message)
        except Exception:
            logger.exception("%s for session %s failed", msg.TAG, getattr(msg, "session_id", None))
            return protocol.Refused(msg.request_id, "internal", f"the broker failed handling {msg.TAG}; see its log")

    def _handle_trainer_frame(self, envelope: list[bytes], payload: bytes) -> protocol.Message | None:
        msg = self._decode(payload, protocol.decode_trainer_to_broker, "trainer")
        if isinstance(msg, protocol.Refused):
            return msg
        try:
            match msg:
                case protocol.OpenSession():
                    session = self.registry.open_session(
                        msg.session_id,
                        msg.sampling_defaults,
                        msg.max_context_tokens,
                        msg.max_turns,
                        msg.metadata,
                        msg.client_id,
                        msg.group,
                    )
                    return protocol.SessionOpened(msg.request_id, session.sid)
                case protocol.FetchEpisodes():
                    reply, others = self.outbox.fetch(envelope, msg, time.monotonic())
                    self._send_all(others)
                    return reply
                case protocol.RequestFinish():
                    return self.handle_request_finish(msg, "trainer")
                case protocol.FinishSession():
                    return self.handle_finish(envelope, msg)
                case protocol.DropSession():
                    return self.handle_drop(msg)
                case protocol.GetStats():
                    return protocol.Stats(msg.request_id, self.stats())
            raise TypeError(f"no handler for {type(msg).__name__}")
        except Refusal as r:
            return protocol.Refused(msg.request_id, r.code, r.message)
        except Exception:
            logger.exception("%s for session %s failed", msg.TAG, getattr(msg, "session_id", None))
            return protocol.Refused(msg.request_id, "internal", f"the broker failed handling {msg.TAG}; see its log")

    def handle_get_turn(self, msg: protocol.GetTurn) -> protocol.Message:
        """A committed turn's canonical messages, looked up in that session only (ids never cross sessions)."""
        prompt_messages, response_message = self.registry.turn_messages(msg.session_id, msg.turn_id)
        return protocol.TurnFound(msg.request_id, msg.turn_id, prompt_messages, response_message)

    # --- finish / drop -----------------------------------------------------------------

    def handle_finish(self, envelope: list[bytes], msg: protocol.FinishSession) -> protocol.Message | None:
        """Close the session; answer now if nothing is in flight, else park until drained or the deadline."""
        _check_wait(msg.wait_timeout)
        session = self.registry.close(msg.session_id, "trainer")
        if not session.in_flight or msg.wait_timeout == 0:
            return self._complete_finish(msg)
        self._park(envelope, msg)
        return None

    def handle_request_finish(self, msg: protocol.RequestFinish, origin: FinishOrigin) -> protocol.Message:
        """Close the session and answer at once; its episode reaches the outbox when its turns have landed.

        Room in the outbox is reserved before the session closes: a full outbox refuses (busy) and
        leaves the session open, so a refused finish loses nothing and can be retried.
        """
        _check_wait(msg.wait_timeout)
        self.registry.closable(msg.session_id)  # "already finished" before "busy": the precise answer
        self.outbox.reserve()
        session = self.registry.close(msg.session_id, origin)
        if not session.in_flight or msg.wait_timeout == 0:
            self._complete_request_finish(msg)
        else:
            self._park(None, msg)
        return protocol.FinishAccepted(msg.request_id, msg.session_id)

    def _park(self, envelope: list[bytes] | None, msg: protocol.FinishSession | protocol.RequestFinish) -> None:
        token = next(self._tokens)
        deadline = time.monotonic() + min(msg.wait_timeout, self.config.max_wait_timeout)
        self._parked[msg.session_id] = _ParkedFinish(envelope, msg, deadline, token)
        heapq.heappush(self._deadlines, (deadline, token, msg.session_id))

    def handle_drop(self, msg: protocol.DropSession) -> protocol.Message:
        existed = self.registry.drop(msg.session_id)
        parked = self._parked.pop(msg.session_id, None)
        if parked is not None and parked.envelope is None:  # an accepted request_finish: no episode will come
            self.outbox.unreserve()
        elif parked is not None and parked.envelope is not None:  # its finisher waits: tell it, rather than time out
            assert self._control is not None
            self._send(
                self._control,
                parked.envelope,
                protocol.Refused(parked.msg.request_id, "unknown_session", f"session {msg.session_id!r} was dropped"),
            )
        return protocol.SessionDropped(msg.request_id, msg.session_id, existed)

    def _after_turn_ended(self, sid: str) -> None:
        """A commit or abort may have drained a closing session whose finish is parked."""
        parked = self._parked.get(sid)
        if parked is None or sid not in self.registry or self.registry.get(sid).in_flight:
            return
        del self._parked[sid]
        self._reply_parked(parked)

    def _expire_parked(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, token, sid = heapq.heappop(self._deadlines)
            parked = self._parked.get(sid)
            if parked is not None and parked.token == token:
                del self._parked[sid]
                self._reply_parked(parked)

    def _reply_parked(self, parked: _ParkedFinish) -> None:
        assert self._control is not None
        if isinstance(parked.msg, protocol.RequestFinish):
            self._complete_request_finish(parked.msg)
            return
        assert parked.envelope is not None
        try:
            reply = self._complete_finish(parked.msg)
        except Exception:  # _complete_finish already answers its own failures; this is a last guard
            logger.exception("finish of session %s failed", parked.msg.session_id)
            reply = protocol.Refused(parked.msg.request_id, "internal", "finish failed; see the broker log")
        self._send(self._control, parked.envelope, reply)

    def _complete_finish(self, msg: protocol.FinishSession) -> protocol.Message:
        finished = self.registry.finish(msg.session_id)
        try:
            trace_rows, status = self._rows.build(finished, msg)
        except Exception:
            self._counters["finish_failures"] += 1
            logger.exception("building rows of session %s failed (%d turns)", finished.sid, len(finished.turns))
            return protocol.Refused(
                msg.request_id, "internal", f"building rows of session {finished.sid!r} failed; see the broker log"
            )
        if finished.turns_abandoned:
            self._counters["drain_timeouts"] += 1
        return protocol.SessionFinished(
            msg.request_id, finished.sid, trace_rows, status, len(finished.turns), finished.turns_abandoned
        )

    def _complete_request_finish(self, msg: protocol.RequestFinish) -> None:
        """Build the rows of a session finished by request (once) and put the episode in the outbox."""
        finished = self.registry.finish(msg.session_id)
        episode = self._episode(finished, msg)
        self._send_all(self.outbox.add(episode, finished.client_id, time.monotonic()))

    def _episode(self, finished: FinishedSession, msg: protocol.RequestFinish) -> protocol.DeliveredEpisode:
        # The same row builder and inputs as finish_session, so both paths give identical rows.
        as_finish = protocol.FinishSession(
            msg.request_id, msg.session_id, msg.reward, msg.rollout_id, msg.metadata, msg.wait_timeout
        )
        metadata = {**finished.metadata, **msg.metadata}
        try:
            trace_rows, status = self._rows.build(finished, as_finish)
        except Exception:
            # No caller is waiting to be told: the episode carries the failure, never silently lost.
            self._counters["finish_failures"] += 1
            logger.exception("building rows of session %s failed (%d turns)", finished.sid, len(finished.turns))
            trace_rows, status = [], "failed"
            metadata["error"] = "building rows failed; see the broker log"
        if finished.turns_abandoned:
            self._counters["drain_timeouts"] += 1
        return protocol.DeliveredEpisode(
            0,
            finished.sid,
            trace_rows,
            msg.reward,
            msg.rollout_id,
            metadata,
            status,
            False,
            finished.group,
            finished.finished_by,
            len(finished.turns),
            finished.turns_abandoned,
        )

    # --- stats / shutdown --------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Registry gauges and counters plus the loop's own: refusals by code, protocol errors, drops."""
        return {
            **self.registry.stats(),
            **self.outbox.stats(),
            "finishes_parked": len(self._parked),
            "refusals": dict(self._refusals),
            "protocol_errors": self._counters["protocol_errors"],
            "replies_dropped": self._counters["replies_dropped"],
            "drain_timeouts": self._counters["drain_timeouts"],
            "finish_failures": self._counters["finish_failures"],
            "uptime_s": round(time.monotonic() - self._started, 3),
            "protocol_version": protocol.PROTOCOL_VERSION,
        }

    def _shutdown(self) -> None:
        # Parked finishers get what was committed (drain_timeout) instead of a dead socket.
        for sid in list(self._parked):
            self._reply_parked(self._parked.pop(sid))
        self._deadlines.clear()
        # Long polls are answered empty; unacknowledged episodes die with this process (documented).
        self._send_all(self.outbox.close())
        if self._ctx is not None:
            self._ctx.destroy(linger=self.config.shutdown_linger_ms)
            self._ctx = None
        logger.info("broker stopped")


def _check_wait(wait: float) -> None:
    if not math.isfinite(wait) or wait < 0:
        raise Refusal("bad_request", f"wait_timeout must be a finite number >= 0, got {wait!r}")


def run_broker(config: BrokerConfig, *, out: Any = None) -> int:
    """Bind, print the READY line, serve until SIGINT/SIGTERM; the process entry point. Returns an exit code."""
    server = BrokerServer(config)
    try:
        worker, control = server.bind()
    except zmq.ZMQError as e:
        logger.error("%s", e)
        return 1

    try:
        # Load the response tokenizer now: lazily, the first finish would stall the loop for
        # seconds (every worker's OPEN waiting behind it), and a bad file should fail at start.
        server.warm_up()
    except Exception:
        logger.exception("cannot load the response tokenizer %s", config.tokenizer)
        server.close()
        return 1

    def handle_signal(signum: int, frame: FrameType | None) -> None:
        server.request_exit()

    previous = {sig: signal.signal(sig, handle_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        logger.info("broker serving workers on %s, trainers on %s", worker, control)
        stream = out if out is not None else sys.stdout
        print(READY_LINE.format(worker=worker, control=control), file=stream, flush=True)
        server.run()
    except Exception:
        logger.exception("the broker loop failed")
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
