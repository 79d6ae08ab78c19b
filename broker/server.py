"""The broker's socket loop: two ROUTER sockets, one thread, one blocking poll(2) on their descriptors.

Owns the ZeroMQ side of the broker: binds the worker and control endpoints (a `sockets.RouterSocket`
each: port 0 works; the bound addresses are reported; with keys, CURVE servers behind `broker.zap`),
decodes each frame with `broker.protocol`, dispatches it (one `match` on the message class, for both
sockets) to `sessions.SessionRegistry`, `finishes.Finishes` and `outbox.Outbox`, and answers every
request exactly once with the same request id (`Refused` on any error); a worker's heartbeat is
answered only with the sessions that ended since its last one, and the turns of a worker unheard for a
while are abandoned (`sessions.workers`).
With a state directory (`broker.durability`), every change a reply acknowledges is appended to the
write-ahead log first: the log is committed before any reply of a pass is sent. The process around it (signals, READY
line) is `broker.__main__`. Finishes that wait for in-flight turns, and subscribers'
long polls, are parked there, never blocking the loop; their deadlines set the poll timeout. Plain
blocking pyzmq: no asyncio. Imports `broker.*` only; never `gateway_workers` or `trainer_client`.
"""

from __future__ import annotations

import logging
import math
import select
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Literal

import zmq

from broker import protocol
from broker.config import BrokerConfig
from broker.curve import CurveError
from broker.durability.journal import Journal
from broker.durability.store import DurableState
from broker.episodes.finishes import Finishes
from broker.episodes.outbox import Outbox, Reply
from broker.episodes.rows import RowBuilder
from broker.health import HealthChecker
from broker.metrics import exposition
from broker.metrics.gateway import GatewayMetrics
from broker.protocol import session_tag
from broker.sessions.heap_trim import HeapTrimmer, glibc_malloc_trim
from broker.sessions.registry import FinishOrigin, Refusal, SessionRegistry, check_chosen_key
from broker.sessions.replicas import ReplicaTable
from broker.sessions.workers import WorkerLiveness, abandon_turns_of
from broker.sockets import MORE_NOBLOCK, NOBLOCK, POLLIN, RouterSocket, bind_routers, send_part, waiting
from broker.zap import ZapHandler

logger = logging.getLogger(__name__)

# The loop wakes at least this often to notice should_exit (signals only set a flag).
MAX_POLL_MS = 100
# Frames handled per socket before the loop looks at the other socket and the clock:
# batching amortizes the poll, the bound keeps the trainer side responsive under load.
DRAIN_BATCH = 64
# The unknown_session refusals of an in-memory broker that replaced an earlier one (`BrokerConfig.restarted`).
LOST_ON_RESTART = (
    " (the broker restarted without a state directory (--state-dir), so sessions opened before the restart "
    "are lost: open a new session and rerun the episode)"
)
# SetEngines takes at most this many replicas.
MAX_REPLICAS = 1024
# Protocol errors are logged individually up to this many, then at most once per interval.
PROTOCOL_LOG_BURST = 20
PROTOCOL_LOG_INTERVAL_S = 5.0

# Which socket a frame came from: it picks the decoder (what each side may send), names the peer in
# logs, and says who finished a session on a RequestFinish (a worker relays an agent's).
Side = Literal["worker", "trainer"]
Decoder = Callable[[bytes], "protocol.WorkerToBroker | protocol.TrainerToBroker"]

# The worker side's replies are encoded straight from their fields: building the frozen message
# costs more than encoding it, and these answer every turn.
_encode_turn_opened = protocol.frame_encoder(protocol.TurnOpened)
_encode_turn_committed = protocol.frame_encoder(protocol.TurnCommitted)
_encode_turn_aborted = protocol.frame_encoder(protocol.TurnAborted)


def _tag_of(msg: object) -> str | None:
    """The tag of the session a message names, for the log (its id is an API key)."""
    sid = getattr(msg, "session_id", None)
    return session_tag(sid) if isinstance(sid, str) else None


class BrokerServer:
    """Binds both ROUTER sockets and serves them until `request_exit`.

    Construct, `bind()` (returns the bound endpoints), then `run()` in the thread that
    will own the sockets; `run` closes everything on its way out.
    """

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.should_exit = False
        # A restarted in-memory broker says why a key the caller had is gone.
        lost = "" if config.state_dir is not None or not config.restarted else LOST_ON_RESTART
        self.registry = SessionRegistry(
            unknown_hint=lost,
            max_sessions=config.max_sessions,
            max_turns_cap=config.max_turns_cap,
            finished_memory=config.finished_memory,
            compact=config.compact_idle,
            compact_min_bytes=config.compact_min_bytes,
            compact_age_s=config.compact_age_s,
            history_mode=config.history_mode,
            linear_fallback=config.linear_fallback,
        )
        self.trimmer = HeapTrimmer(
            min_bytes=config.trim_min_bytes,
            interval_s=config.trim_interval_s,
            trim=glibc_malloc_trim() if config.trim_min_bytes > 0 else None,
        )
        self._ctx: zmq.Context | None = None
        self._zap: ZapHandler | None = None  # authorizes CURVE clients, with curve_keys
        self._routers: tuple[RouterSocket, RouterSocket] | None = None  # (worker, control), once bound
        self._workers: zmq.Socket | None = None  # their raw sockets: what the per-frame calls take
        self._control: zmq.Socket | None = None
        self._rows = RowBuilder(config.tokenizer)
        self.outbox = Outbox(
            max_episodes=config.outbox_max_episodes,
            max_bytes=config.outbox_max_bytes,
            max_wait=config.max_poll_wait,
            max_lease=config.max_lease,
            max_credit=config.max_credit,
        )
        self.finishes = Finishes(self.registry, self._rows, self.outbox, config.max_wait_timeout)
        self.workers = WorkerLiveness(config.worker_silence_s)
        self.replicas = ReplicaTable(config.engine_urls)  # which engine replica each session samples from
        self.registry.end_listeners.append(self.replicas.release)
        self.health = HealthChecker(config.engine_health_interval_s, config.engine_health_timeout_s)
        self.health.watch(self.replicas.urls)
        self.metrics = GatewayMetrics()  # the workers' reports (heartbeats), and the commit latency
        self._commits_received: list[float] = []  # when each commit of the batch being handled arrived
        self._refusals: Counter[str] = Counter()
        self._counters: Counter[str] = Counter()
        self._last_protocol_log = 0.0
        self._control_sent = False  # replies went to trainer peers since the control socket's ZMQ_EVENTS
        self._started = time.monotonic()
        self.durable: DurableState | None = None  # with a state directory, once `open_state` ran
        self._journal: Journal | None = None  # its journal: the handlers log through it

    def open_state(self) -> DurableState | None:
        """With `config.state_dir`: lock it and recover its state (before `bind`); None without one.

        Raises what `DurableState.open` raises (another broker holds the directory, damage in the log).
        """
        if self.config.state_dir is None:
            return None
        durable = DurableState(self.config, self.registry, self.outbox, self.finishes)
        durable.open()
        self.durable, self._journal = durable, durable.journal
        return durable

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

    def warm_up(self) -> None:
        """Load what the first finish would otherwise load inside the loop (the response tokenizer)."""
        self._rows.decode(protocol.ids_array([0]))

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
            compact, compaction, trimmer = self.config.compact_idle, self.registry.compaction, self.trimmer
            counters = self.registry.counters
            durable = self.durable
            workers_ready = control_ready = True  # whatever arrived before the loop: look once
            # Recovered turns' workers get the silence bound from now, after the start-up's slow parts.
            self.workers.expect(self.registry, time.monotonic())
            self.health.start()
            health = self.health.results
            while not self.should_exit:
                if workers_ready:
                    workers_ready = self._drain(workers, protocol.decode_worker_to_broker, "worker")
                if control_ready:
                    control_ready = self._drain(control, protocol.decode_trainer_to_broker, "trainer")
                now = time.monotonic()
                if not health.empty():
                    self._health_checked()
                if not workers_ready and now >= self.workers.next_check:
                    # Only with the worker socket drained: a heartbeat waiting behind a backlog is not silence.
                    self._abandon_silent_workers(now)
                for parked in (self.finishes, self.outbox):
                    due = parked.next_deadline()
                    if due is not None and due <= now:
                        self._send_all(parked.expire(now))
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
                    # Idle time compresses older session logs, one bounded step per loop (`compaction.step`),
                    # and gives freed heap pages back to the OS (`heap_trim`: rate-limited, one call):
                    # a frame waiting always goes first, so this costs the commit path nothing.
                    trim = trimmer.due(counters["bytes_freed"])
                    idle_work = trim or (compact and compaction.pending) or snapshotting
                    events = poller.poll(0 if idle_work else self._poll_timeout_ms())
                    if idle_work and not events:
                        if trim:
                            trimmer.trim(counters["bytes_freed"])
                        elif compact and compaction.pending:
                            compaction.step()
                for fd, _ in events:
                    if fd == worker_fd:
                        workers_ready = True
                    else:
                        control_ready = True
        finally:
            self._shutdown()

    def _health_checked(self) -> None:
        """Take the health checks' verdicts: a replica that failed takes no new sessions, and its sessions move."""
        results = self.health.results
        while not results.empty():
            url, healthy, error = results.get_nowait()
            if self.replicas.health(url, healthy, error):
                if healthy:
                    logger.info("engine replica %s is healthy again: it takes sessions", url)
                else:
                    logger.warning("engine replica %s failed its health check (%s): its sessions move to the "
                                   "others at their next turn", url, error)  # fmt: skip

    def _abandon_silent_workers(self, now: float) -> None:
        """Give up the in-flight turns of workers unheard for `worker_silence_s` (logged as aborts), and release
        the finishes that waited for them."""
        for worker_id in self.workers.silent(now):
            abandoned = abandon_turns_of(self.registry, worker_id, self.workers.silence_s)
            if self._journal is not None:
                for sid, turn_id in abandoned:
                    self._journal.turn_abandoned(sid, turn_id)
            for sid in {sid for sid, _ in abandoned}:
                self._send_all(self.finishes.turn_ended(sid, now))

    def _poll_timeout_ms(self) -> int:
        due = [d for d in (self.finishes.next_deadline(), self.outbox.next_deadline()) if d is not None]
        if not due:
            return MAX_POLL_MS
        wait = min(due) - time.monotonic()
        return max(0, min(MAX_POLL_MS, math.ceil(wait * 1000)))

    def _drain(self, sock: zmq.Socket, decode: Decoder, side: Side) -> bool:
        """Handle the frames waiting on `sock` (up to DRAIN_BATCH) and send their replies.

        Returns whether frames may still be waiting: the batch bound stopped it, or some arrived
        meanwhile. False means ZMQ_EVENTS, asked after the last send, showed none: the socket's
        descriptor will wake the loop for the next one.
        """
        replies: list[tuple[list[bytes], protocol.Message | bytes]] = []
        recv, handle = sock.recv, self._handle_frame
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
        if self.durable is not None:
            self.durable.commit()
        for envelope, reply in replies:
            self._send(sock, envelope, reply)
        if self._commits_received:
            sent = time.perf_counter()
            for received in self._commits_received:
                self.metrics.commit_seconds.observe(sent - received)
            self._commits_received.clear()
        more = waiting(probe)  # after the sends: a send may have taken the command that announced a frame
        if sock is self._control:
            self._control_sent = False
        return more

    def _send_all(self, replies: list[Reply]) -> None:
        """Answers to parked requests (finishes, long polls): they all go to trainer peers."""
        assert self._control is not None
        if replies:
            self._control_sent = True
            if self.durable is not None:
                self.durable.commit()
        for envelope, reply in replies:
            self._send(self._control, envelope, reply)

    def _send(self, sock: zmq.Socket, envelope: list[bytes], reply: protocol.Message | bytes) -> None:
        """Send one reply: a message, or a frame a handler encoded itself (`protocol.frame_encoder`)."""
        if type(reply) is bytes:
            frame = reply
        else:
            assert isinstance(reply, protocol.Message)
            try:
                frame = protocol.encode(reply)
            except Exception:
                logger.exception("cannot encode %s reply to request %s", reply.TAG, reply.request_id)
                reply = protocol.Refused(reply.request_id, "internal", "the broker could not encode its reply")
                frame = protocol.encode(reply)
            if isinstance(reply, protocol.Refused):
                self._refusals[reply.code] += 1
        try:
            for part in envelope:
                send_part(sock, part, MORE_NOBLOCK)
            send_part(sock, frame, NOBLOCK)
        except zmq.ZMQError as e:
            # EHOSTUNREACH: the peer disconnected; EAGAIN: its queue is full (both raised by the
            # first part, so no half message is left behind). Either way the peer's own deadline
            # will fire (workers retry commits until acknowledged).
            self._counters["replies_dropped"] += 1
            if isinstance(reply, protocol.Message):
                logger.warning("reply %s to request %s dropped: %s", reply.TAG, reply.request_id, e)
            else:
                logger.warning("a %d-byte reply dropped: %s", len(reply), e)

    # --- dispatch ----------------------------------------------------------------------

    def _protocol_error(self, side: str, e: protocol.ProtocolError) -> protocol.Refused:
        """The Refused that answers an undecodable frame (logged, rate-limited)."""
        code = "version_mismatch" if isinstance(e, protocol.VersionMismatch) else "protocol"
        self._counters["protocol_errors"] += 1
        n = self._counters["protocol_errors"]
        now = time.monotonic()
        if n <= PROTOCOL_LOG_BURST or now - self._last_protocol_log >= PROTOCOL_LOG_INTERVAL_S:
            self._last_protocol_log = now
            logger.warning("bad frame from a %s peer (%d so far): %s", side, n, e)
        rid = e.request_id if e.request_id is not None else -1
        return protocol.Refused(rid, code, str(e))

    def _handle_frame(
        self, envelope: list[bytes], payload: bytes, decode: Decoder, side: Side
    ) -> protocol.Message | bytes | None:
        """Decode one frame of `side` and carry it out; the reply (or None when it is parked) repeats its request id."""
        try:
            msg = decode(payload)
        except protocol.ProtocolError as e:
            return self._protocol_error(side, e)
        try:
            match msg:
                # worker side, the hot cases first (a commit and an open per turn)
                case protocol.CommitTurn():
                    self._commits_received.append(time.perf_counter())
                    outcome = self.registry.commit_turn(msg)
                    if self._journal is not None and outcome == "stored":
                        self._journal.worker_frame(payload)  # the frame as received: replayed as it was stored
                    parked = self.finishes.turn_ended(msg.session_id, time.monotonic())
                    if parked:
                        self._send_all(parked)
                    return _encode_turn_committed(request_id=msg.request_id, turn_id=msg.turn_id, outcome=outcome)
                case protocol.OpenTurn():
                    # Its worker is heard by its heartbeats (the first goes out before any OPEN on the same socket).
                    if msg.retry:
                        replayed = self.registry.repeated_turn(msg.session_id, msg.request_digest)
                        if replayed is not None:
                            return protocol.TurnReplayed(
                                msg.request_id, replayed.turn_id, replayed.prompt_ids, replayed.output_ids,
                                replayed.finish_reason, replayed.response_message, replayed.flags,
                            )  # fmt: skip
                    session, seq = self.registry.open_turn(
                        msg.session_id, msg.turn_id, msg.worker_id, msg.request_digest
                    )
                    if self._journal is not None:
                        self._journal.worker_frame(payload)
                    linear = session.history_mode == "linear"
                    return _encode_turn_opened(
                        request_id=msg.request_id,
                        turn_id=msg.turn_id,
                        seq=seq,
                        sampling_defaults=session.sampling_defaults,
                        max_context_tokens=session.max_context_tokens,
                        history_mode=session.history_mode,
                        linear_fallback=session.linear_fallback if linear else "",
                        heads=session.heads if linear else [],
                        pending=len(session.in_flight) - 1 if linear else 0,
                        weight_version=self.registry.weight_version,
                        replica=self.replicas.assign(msg.session_id),
                    )
                case protocol.AbortTurn():
                    aborted = self.registry.abort_turn(msg.session_id, msg.turn_id, msg.reason)
                    if aborted is not None and self._journal is not None:
                        self._journal.worker_frame(payload)
                    parked = self.finishes.turn_ended(msg.session_id, time.monotonic())
                    if parked:
                        self._send_all(parked)
                    return _encode_turn_aborted(request_id=msg.request_id, turn_id=msg.turn_id)
                case protocol.GetTurn():
                    return self.handle_get_turn(msg)
                case protocol.Heartbeat():
                    self.workers.hear(msg.worker_id, time.monotonic())
                    self.metrics.heard(msg.worker_id, msg.metrics, self.workers.heard)
                    ended = self.workers.ended_since(msg.worker_id, self.registry)
                    return protocol.SessionsEnded(0, ended) if ended else None
                # either side: an agent's finish comes through its worker
                case protocol.RequestFinish():
                    origin: FinishOrigin = "agent" if side == "worker" else "trainer"
                    accepted, replies = self.finishes.request_finish(msg, origin, time.monotonic())
                    self._send_all(replies)
                    return accepted
                # trainer side
                case protocol.OpenSession():
                    check_chosen_key(msg.session_id)
                    session = self.registry.open_session(
                        msg.session_id, msg.sampling_defaults, msg.max_context_tokens, msg.max_turns,
                        msg.metadata, msg.client_id, msg.group, msg.history_mode, msg.linear_fallback,
                    )  # fmt: skip
                    if self._journal is not None:
                        self._journal.session_opened(session)
                    return protocol.SessionOpened(msg.request_id, session.sid)
                case protocol.FetchEpisodes():
                    reply, others = self.outbox.fetch(envelope, msg, time.monotonic())
                    self._send_all(others)
                    return reply
                case protocol.FinishSession():
                    return self.finishes.finish(envelope, msg, time.monotonic())
                case protocol.DropSession():
                    existed = self.registry.drop(msg.session_id)
                    if existed and self._journal is not None:
                        self._journal.session_dropped(msg.session_id)
                    self._send_all(self.finishes.dropped(msg.session_id))
                    return protocol.SessionDropped(msg.request_id, msg.session_id, existed)
                case protocol.GetStats():
                    return protocol.Stats(msg.request_id, self.stats())
                case protocol.SetEngines():
                    urls = msg.urls
                    if not isinstance(urls, list) or len(urls) > MAX_REPLICAS or not all(
                        isinstance(u, str) and u.startswith(("http://", "https://")) and len(u) <= 2048 for u in urls
                    ):
                        raise Refusal("bad_request", f"engines are at most {MAX_REPLICAS} http(s):// base URLs")
                    self.replicas.set(urls)
                    self.health.watch(self.replicas.urls)
                    logger.info("engine replicas set: %s", ", ".join(self.replicas.urls) or "none")
                    return protocol.EnginesSet(msg.request_id, list(self.replicas.urls))
                case protocol.SetWeightVersion():
                    version = msg.version
                    if type(version) is not int or not 0 <= version < 2**31:
                        raise Refusal("bad_request", f"a weight version is an int in [0, 2**31), not {version!r}")
                    previous, self.registry.weight_version = self.registry.weight_version, version
                    if self._journal is not None:
                        self._journal.weight_version_set(version)
                    return protocol.WeightVersionSet(msg.request_id, version, previous)
                case protocol.GetMetrics():  # either side: a worker's /metrics scrape sends its own counts along
                    if msg.worker_id:
                        self.metrics.heard(msg.worker_id, msg.metrics, self.workers.heard)
                    return protocol.MetricsText(msg.request_id, self.metrics_text())
            raise TypeError(f"no handler for {type(msg).__name__}")
        except Refusal as r:
            return protocol.Refused(msg.request_id, r.code, r.message)
        except Exception:
            logger.exception("%s for session %s failed", msg.TAG, _tag_of(msg))
            return protocol.Refused(msg.request_id, "internal", f"the broker failed handling {msg.TAG}; see its log")

    def handle_get_turn(self, msg: protocol.GetTurn) -> protocol.Message:
        """A committed turn's canonical messages, looked up in that session only (ids never cross sessions)."""
        if msg.with_ids:
            record = self.registry.turn_record(msg.session_id, msg.turn_id)
            return protocol.TurnFound(
                msg.request_id, msg.turn_id, record.prompt_messages, record.response_message, record.prompt_ids,
                record.output_ids,
            )  # fmt: skip
        prompt_messages, response_message = self.registry.turn_messages(msg.session_id, msg.turn_id)
        return protocol.TurnFound(msg.request_id, msg.turn_id, prompt_messages, response_message)

    def trim_start_up_heap(self) -> None:
        """Give back what start-up freed (the response tokenizer's load; docs/performance.md), before any frame
        waits."""
        if self.trimmer.enabled:
            self.trimmer.trim(self.registry.counters["bytes_freed"])

    # --- stats / shutdown --------------------------------------------------------------

    def metrics_text(self) -> str:
        """The whole gateway's metrics, Prometheus text (`broker.metrics.exposition`)."""
        return exposition.render(self.stats(), self.metrics, self.workers.heard, time.monotonic())

    def worker_stats(self) -> dict[str, dict[str, Any]]:
        """Each live worker: seconds since its last heartbeat, its pid, the turns it has in flight and the engine
        replicas it sends to."""
        in_flight: Counter[str] = Counter()
        for session in self.registry.sessions():
            in_flight.update(session.owners.values())
        now = time.monotonic()
        return {
            worker_id: {
                "heard_s_ago": round(now - heard, 3),
                "pid": report.pid if (report := self.metrics.reports.get(worker_id)) is not None else None,
                "turns_in_flight": in_flight[worker_id],
                "replicas": [labels[0] for name, labels in report.gauges if name == "engine_replica"]
                if report is not None
                else [],
            }
            for worker_id, heard in self.workers.heard.items()
        }

    def stats(self) -> dict[str, Any]:
        """Registry gauges and counters plus the loop's own: refusals by code, protocol errors, drops; the
        workers (`worker_stats`) and the sums of their metrics (`gateway`: `broker.metrics.gateway`)."""
        totals = self.metrics.totals()
        return {
            **self.registry.stats(),
            **self.outbox.stats(),
            **self.finishes.stats(),
            **self.trimmer.stats(self.registry.counters["bytes_freed"]),
            "workers_heard": len(self.workers.heard),
            "weight_version": self.registry.weight_version,
            **self.replicas.stats(),
            "workers": self.worker_stats(),
            **self._rows.stats(),
            "broker_commit_seconds": self.metrics.commit_seconds.wire(),
            "gateway": {
                "counters": [[name, list(labels), value] for (name, labels), value in totals.counters.items()],
                "histograms": [[name, list(labels), counts, total]
                               for (name, labels), (counts, total) in totals.histograms.items()],
                "seconds_buckets": list(protocol.SECONDS_BUCKETS),
            },
            **(self.durable.stats() if self.durable is not None else {"state_dir": None}),
            "refusals": dict(self._refusals),
            "protocol_errors": self._counters["protocol_errors"],
            "replies_dropped": self._counters["replies_dropped"],
            "uptime_s": round(time.monotonic() - self._started, 3),
            "protocol_version": protocol.PROTOCOL_VERSION,
        }

    def _shutdown(self) -> None:
        self.health.stop()
        if self.durable is None or not self.durable.failed:  # else nothing more may be acknowledged
            # Parked finishers get what was committed (drain_timeout) instead of a dead socket.
            self._send_all(self.finishes.shutdown(time.monotonic()))
            # Long polls are answered empty; unacknowledged episodes die with this process (documented),
            # unless the broker is durable: then they wait in the log for the next start.
            self._send_all(self.outbox.close())
        if self.durable is not None:
            self.durable.close()
        self.close(linger=self.config.shutdown_linger_ms)
        logger.info("broker stopped")
