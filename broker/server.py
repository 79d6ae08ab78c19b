"""The broker's socket loop: two ROUTER sockets, one thread, one blocking poll(2) on their descriptors.

Owns the ZeroMQ side of the broker: binds the worker and control endpoints (a `sockets.RouterSocket`
each: port 0 works; the bound addresses are reported; with keys, CURVE servers behind `broker.zap`),
decodes each frame with `broker.protocol`, routes it by its class to its handler (`broker.handlers`, over
the shared `state.BrokerState`), and sends every reply with the request's id (`Refused` on any error).
With a state directory (`broker.durability`), every change a reply acknowledges is appended to the
write-ahead log first: the log is committed before any reply of a pass is sent. Finishes that wait for
in-flight turns, and subscribers' long polls, are parked by their handlers, never blocking the loop; their
deadlines set the poll timeout. Idle time compacts session logs, trims the heap and writes snapshots. The
process around it (signals, READY line) is `broker.__main__`. Plain blocking pyzmq: no asyncio. Imports
`broker.*` only; never `gateway_workers` or `trainer_client`.
"""

from __future__ import annotations

import logging
import select
import time
from typing import Any

import zmq

from broker import handlers, protocol
from broker.config import BrokerConfig
from broker.curve import CurveError
from broker.dispatch import Decoder, Dispatch
from broker.durability.store import DurableState
from broker.episodes.outbox import Reply
from broker.handlers import control as control_handlers
from broker.handlers.base import Side
from broker.handlers.turns import TurnHandlers
from broker.sockets import MORE_NOBLOCK, NOBLOCK, POLLIN, RouterSocket, bind_routers, send_part, waiting
from broker.state import BrokerState
from broker.zap import ZapHandler

logger = logging.getLogger(__name__)

# The loop wakes at least this often to notice should_exit (signals only set a flag).
MAX_POLL_MS = 100
# Frames handled per socket before the loop looks at the other socket and the clock:
# batching amortizes the poll, the bound keeps the trainer side responsive under load.
DRAIN_BATCH = 64
class BrokerServer:
    """Binds both ROUTER sockets and serves them until `request_exit`.

    Construct, `open_state()` (with a state directory), `bind()` (returns the bound endpoints), then `run()` in
    the thread that will own the sockets; `run` closes everything on its way out.
    """

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.should_exit = False
        self.state = state = BrokerState(config)
        self.registry, self.outbox, self.finishes = state.registry, state.outbox, state.finishes
        self._turns = TurnHandlers(state, self._send_all)  # also gives up silent workers' turns, from the loop
        self._dispatch = Dispatch(state, handlers.routes(state, self._send_all, self._turns))
        self._ctx: zmq.Context | None = None
        self._zap: ZapHandler | None = None  # authorizes CURVE clients, with curve_keys
        self._routers: tuple[RouterSocket, RouterSocket] | None = None  # (worker, control), once bound
        self._workers: zmq.Socket | None = None  # their raw sockets: what the per-frame calls take
        self._control: zmq.Socket | None = None
        self._control_sent = False  # replies went to trainer peers since the control socket's ZMQ_EVENTS

    @property
    def durable(self) -> DurableState | None:
        return self.state.durable

    def open_state(self) -> DurableState | None:
        """With `config.state_dir`: lock it and recover its state (before `bind`); None without one."""
        return self.state.open_state()

    # --- startup ---------------------------------------------------------------------

    def bind(self) -> tuple[str, str]:
        """Bind both endpoints; returns (worker, control) as actually bound. `sockets.BindError` if one cannot be,
        `curve.CurveError` (before binding) if one is not loopback and no CURVE keys are configured."""
        ctx = self._ctx = zmq.Context()
        try:
            workers, control, self._zap = bind_routers(ctx, self.config)
        except (zmq.ZMQError, CurveError):
            self.close()
            raise
        self._routers = workers, control
        self._workers, self._control = workers.sock, control.sock
        return self.worker_endpoint, self.control_endpoint

    @property
    def worker_endpoint(self) -> str:
        assert self._routers is not None
        return self._routers[0].endpoint

    @property
    def control_endpoint(self) -> str:
        assert self._routers is not None
        return self._routers[1].endpoint

    def close(self, linger: int = 0) -> None:
        """Release the sockets (and the ZAP handler) of a server that will not `run()`, or has run."""
        if self._zap is not None:
            self._zap.stop()
            self._zap = None
        if self._ctx is not None:
            self._ctx.destroy(linger=linger)
            self._ctx = None

    def request_exit(self) -> None:
        """Ask the loop to stop; safe from a signal handler or another thread."""
        self.should_exit = True

    # --- main loop ---------------------------------------------------------------------

    def run(self) -> None:
        """Serve until `request_exit`, then shut down within the configured linger."""
        assert self._routers is not None, "bind() first"
        worker_router, control_router = self._routers
        workers, control = worker_router.sock, control_router.sock
        # The loop sleeps in one poll(2) on the sockets' notification descriptors (ZMQ_FD) rather
        # than in a blocking zmq_poll over both sockets, which first polls without sleeping and asks
        # every socket for ZMQ_EVENTS before and after it sleeps (two syscalls each: libzmq's fork
        # check and a poll of the socket's mailbox), many syscalls a wake-up (docs/performance.md,
        # "Figures behind code comments"). A ZMQ_FD is edge-triggered: it turns readable when the
        # socket's mailbox gets a command (e.g. "messages arrived"), so a socket is drained until a
        # probe (`waiting`) shows nothing waiting, and probed again after any send (libzmq may take
        # that command on a send) before the loop may sleep (`_drain`, `_control_sent`).
        poller = select.poll()
        worker_fd = worker_router.fd()
        poller.register(worker_fd, select.POLLIN)
        poller.register(control_router.fd(), select.POLLIN)
        try:
            state = self.state
            durable = state.durable
            workers_ready = control_ready = True  # whatever arrived before the loop: look once
            # Recovered turns' workers get the silence bound from now, after the start-up's slow parts.
            state.workers.expect(state.registry, time.monotonic())
            state.health.start()
            health = state.health.results
            while not self.should_exit:
                if workers_ready:
                    workers_ready = self._drain(workers, protocol.decode_worker_to_broker, "worker")
                if control_ready:
                    control_ready = self._drain(control, protocol.decode_trainer_to_broker, "trainer")
                now = time.monotonic()
                if not health.empty():
                    control_handlers.health_checked(state)
                if not workers_ready and now >= state.workers.next_check:
                    # Only with the worker socket drained: a heartbeat waiting behind a backlog is not silence.
                    self._turns.abandon_silent_workers(now)
                self._send_all(state.expired(now))
                if state.to_workers:
                    workers_ready = self._tell_workers() or workers_ready
                if self._control_sent:  # replies to parked requests went out since the control socket was asked
                    control_ready = control_ready or waiting([(control, POLLIN)])
                    self._control_sent = False
                # The log is written every pass (what was logged with no reply too), and a snapshot in progress
                # writes its next part (paced by the log's growth), idle or not.
                snapshotting = durable is not None and durable.tick()
                if workers_ready or control_ready:
                    # Frames still wait on one socket: a look at the other without sleeping, so a
                    # busy worker socket never keeps the trainers waiting (and the reverse).
                    events = poller.poll(0)
                else:
                    # Idle work (`BrokerState.idle_step`) only when a poll finds no frame waiting.
                    idle_work = snapshotting or state.idle_work_due()
                    events = poller.poll(0 if idle_work else state.poll_timeout_ms(MAX_POLL_MS))
                    if idle_work and not events:
                        state.idle_step()
                for fd, _ in events:
                    if fd == worker_fd:
                        workers_ready = True
                    else:
                        control_ready = True
        finally:
            self._shutdown()

    def _drain(self, sock: zmq.Socket, decode: Decoder, side: Side) -> bool:
        """Handle the frames waiting on `sock` (up to DRAIN_BATCH) and send their replies.

        Returns whether frames may still be waiting: the batch bound stopped it, or some arrived
        meanwhile. False means ZMQ_EVENTS, asked after the last send, showed none: the socket's
        descriptor will wake the loop for the next one.
        """
        replies: list[tuple[list[bytes], protocol.Message | bytes]] = []
        recv, handle = sock.recv, self._dispatch.handle
        probe = [(sock, POLLIN)]
        for n in range(1, DRAIN_BATCH + 1):
            # ROUTER prepends the peer identity; a REQ peer adds an empty delimiter. Echo the
            # whole envelope so either kind of peer gets its reply. The identity is always
            # followed by more parts; the others are received as frames only to read their MORE
            # flag (what `recv_multipart` asks a getsockopt for, at twice the cost of a recv).
            try:
                envelope = [recv(NOBLOCK)]
            except zmq.Again:  # the descriptor woke the loop for a command that brought no message
                break
            part = recv(NOBLOCK, copy=False)  # the parts of one message arrive together
            while part.more:
                envelope.append(part.bytes)
                part = recv(NOBLOCK, copy=False)
            payload = part.bytes
            try:
                reply = handle(envelope, payload, decode, side)
            except Exception:  # the handlers answer their own failures; this guards the loop itself
                logger.exception("unhandled failure on a %d-byte frame", len(payload))
                reply = protocol.Refused(-1, "internal", "the broker failed on this frame; see its log")
            if reply is not None:
                replies.append((envelope, reply))
            # Asked instead of a receive that fails: raising pyzmq's zmq.Again costs far more
            # (docs/performance.md, "Where a commit's time goes").
            if n == DRAIN_BATCH or not waiting(probe):
                break
        # Replies leave as one burst after the batch: libzmq wakes its I/O thread once per
        # burst instead of once per reply (measured: that wake-up dominated the send cost).
        # A durable broker first writes (and under fsync=always syncs) what the batch logged: one
        # write(2) per batch, and no reply acknowledges a change that is not in the log.
        state = self.state
        if state.durable is not None:
            state.durable.commit()
        for envelope, reply in replies:
            self._send(sock, envelope, reply)
        if state.commits_received:
            sent = time.perf_counter()
            for received in state.commits_received:
                state.metrics.commit_seconds.observe(sent - received)
            state.commits_received.clear()
        more = waiting(probe)  # after the sends: a send may have taken the command that announced a frame
        if sock is self._control:
            self._control_sent = False
        return more

    def _send_all(self, replies: list[Reply]) -> None:
        """Answers to parked requests (finishes, long polls): they all go to trainer peers."""
        assert self._control is not None
        if replies:
            self._control_sent = True
            if self.state.durable is not None:
                self.state.durable.commit()
        for envelope, reply in replies:
            self._send(self._control, envelope, reply)

    def _tell_workers(self) -> bool:
        """What workers are told unasked (a pause or its end), after the log holds it; whether frames may wait on
        the worker socket (a send may take the command that announced one)."""
        assert self._workers is not None
        if self.state.durable is not None:
            self.state.durable.commit()
        told, self.state.to_workers = self.state.to_workers, []
        for envelope, message in told:
            self._send(self._workers, envelope, message)
        return waiting([(self._workers, POLLIN)])

    def _send(self, sock: zmq.Socket, envelope: list[bytes], reply: protocol.Message | bytes) -> None:
        frame = self._dispatch.encode(reply)
        try:
            for part in envelope:
                send_part(sock, part, MORE_NOBLOCK)
            send_part(sock, frame, NOBLOCK)
        except zmq.ZMQError as e:
            # EHOSTUNREACH: the peer disconnected; EAGAIN: its queue is full (both raised by the
            # first part, so no half message is left behind). Either way the peer's own deadline
            # will fire (workers retry commits until acknowledged).
            self.state.loop_counters["replies_dropped"] += 1
            if isinstance(reply, protocol.Message):
                logger.warning("reply %s to request %s dropped: %s", reply.TAG, reply.request_id, e)
            else:
                logger.warning("a %d-byte reply dropped: %s", len(reply), e)

    # --- stats / shutdown --------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """What `GetStats` answers (`handlers.control.stats`)."""
        return control_handlers.stats(self.state)

    def _shutdown(self) -> None:
        state = self.state
        state.health.stop()
        if state.durable is None or not state.durable.failed:  # else nothing more may be acknowledged
            self._send_all(state.parked_at_shutdown(time.monotonic()))
        if state.durable is not None:
            state.durable.close()
        self.close(linger=self.config.shutdown_linger_ms)
        logger.info("broker stopped")
