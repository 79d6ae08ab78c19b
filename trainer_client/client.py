"""`TrainerClient`: the synchronous trainer-side API over blocking ZeroMQ DEALERs.

Owns the public calls and which of them may be resent through a broker restart. Request ids,
encoding, the socket pool that lets many trainer threads call at once, socket reset after a
timeout and the reply's check are `control_socket.ControlChannel`'s; one socket's request and
reply, and its connection watch, `control_socket.ControlSocket`'s. `episodes()` hands out an
`EpisodeStream` (subscriber.py) over the same channel, which keeps a socket of its own. With
CURVE keys every socket authenticates and encrypts. Imports plain `zmq`, `broker.protocol` and
`broker.curve` only: never zmq.asyncio, asyncio, uvloop, starlette, transformers or `gateway_workers`.
"""

from __future__ import annotations

import logging
import math
import secrets
from types import TracebackType
from typing import Any

from broker import curve, protocol
from trainer_client.control_socket import ControlChannel
from trainer_client.errors import InvalidRequest, PauseTimeout
from trainer_client.records import PauseReport, TraceRecord
from trainer_client.subscriber import DEFAULT_LEASE_S, DEFAULT_MAX_PENDING, EpisodeStream

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_WAIT_TIMEOUT_S = 5.0
DEFAULT_PAUSE_TIMEOUT_S = 60.0
_MAX_ID_LEN = 256


class TrainerClient:
    """Blocking client of the broker's control endpoint; safe to call from many threads.

    Through a broker restart (or a dropped connection) the sockets reconnect by themselves. A call whose
    connection ends while it waits is noticed at once: the calls the broker recognises when repeated are
    sent again once it answers (`stats`, `drop_session`, `finish_session`, `open_session` with your own
    `session_id`, the episode stream's steps), the others raise `BrokerDisconnected` (see it for what to do).

    Args:
        endpoint: the broker's control endpoint, e.g. "tcp://127.0.0.1:5557".
        timeout: seconds each call may wait for the broker's reply (finish_session adds its
            `wait_timeout`); past it the call raises `BrokerTimeout`.
        client_id: names this client's sessions for `episodes(only_mine=True)`; minted (random)
            unless given. Give the same id to several clients (e.g. one trainer's processes) to
            let each subscribe to all of their sessions.
        curve_keys: a key directory holding `broker.key` and `trainer.key_secret` (`rollout-gateway
            keys`): the connection uses CURVE. None reads $ROLLOUT_GATEWAY_CURVE_KEYS; "" means none.
            Without keys a non-loopback endpoint raises `CurveError` (a ValueError) here.
    """

    def __init__(
        self,
        endpoint: str = protocol.DEFAULT_CONTROL_ENDPOINT,
        timeout: float = DEFAULT_TIMEOUT_S,
        client_id: str | None = None,
        curve_keys: str | None = None,
    ) -> None:
        if not (isinstance(timeout, (int, float)) and timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if client_id is not None and not (isinstance(client_id, str) and 0 < len(client_id) <= _MAX_ID_LEN - 16):
            raise ValueError(f"client_id must be a non-empty string of at most {_MAX_ID_LEN - 16} characters")
        keys_dir = curve.keys_from_env(curve_keys)
        curve.require_keys_off_loopback(endpoint, keys_dir, "the control endpoint")
        keys = curve.load_client_keys(keys_dir, "trainer") if keys_dir is not None else None
        self.endpoint = endpoint
        self.timeout = float(timeout)
        self.client_id = client_id or f"tc-{secrets.token_hex(8)}"
        self._channel = ControlChannel(endpoint, keys)

    # --- public API ------------------------------------------------------------------

    def open_session(
        self,
        sampling_defaults: dict[str, Any] | None = None,
        max_context_tokens: int | None = None,
        max_turns: int | None = None,
        session_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        group: str | None = None,
        history_mode: str | None = None,
        linear_fallback: str | None = None,
    ) -> str:
        """Open a session and return its key (the agent's API key); minted by the broker unless given.

        `group` names a batch of sessions (e.g. one training step's): `episodes(group=...)` yields
        only the episodes of that group. `history_mode`: "tree" (each prompt is the chat template's
        rendering of the request) or "linear" (a request that extends the previous turn is prompted with
        the ids the engine saw plus the rendering of the new messages: one row per append-only episode);
        `linear_fallback`: what a linear request that extends nothing gets ("fork", "rerender" or "reject").
        None takes the gateway's `--history-mode` / `--linear-fallback`.
        With your own `session_id` the call is resent through a broker
        restart (the key open already then means the first attempt opened it: the key is returned);
        without one it raises `BrokerDisconnected` instead, since a repeat would open a second session.
        """
        reply = self._channel.call(
            lambda rid: protocol.OpenSession(
                rid,
                session_id,
                dict(sampling_defaults or {}),
                max_context_tokens,
                max_turns,
                dict(metadata or {}),
                self.client_id,
                group,
                history_mode or "",
                linear_fallback or "",
            ),
            protocol.SessionOpened,
            self.timeout,
            resend=session_id is not None,
        )
        return reply.session_id

    def finish_session(
        self,
        sid: str,
        reward: float | None = None,
        rollout_id: str | int | None = None,
        metadata: dict[str, Any] | None = None,
        wait_timeout: float = DEFAULT_WAIT_TIMEOUT_S,
    ) -> list[TraceRecord]:
        """Close the session, let in-flight turns land for up to `wait_timeout` s, and return its rows.

        The session is freed afterwards. `rollout_id` is stored as a string (ints are converted).
        A session finishes once: `SessionClosed` if `request_finish` or its agent finished it first.

        Through a broker restart the finish is resent (same request id) and the broker answers it as the
        same finish: with the rows its first attempt built if it got that far (kept, and logged by a
        `--state-dir` broker), else by finishing the session now (a durable broker recovered it open).
        A broker without a state directory lost the session: `UnknownSession` (rerun the episode).
        """
        args = _finish_args(sid, reward, rollout_id, metadata, wait_timeout)
        reply = self._channel.call(
            lambda rid: protocol.FinishSession(rid, *args),
            protocol.SessionFinished,
            self.timeout + wait_timeout,
            resend=True,
        )
        if reply.status == "drain_timeout":
            logger.warning("session %s finished with in-flight turns cut off after %.1fs (%d abandoned in all)",
                           protocol.session_tag(sid), wait_timeout, reply.turns_abandoned)
        elif reply.status == "worker_lost":
            logger.warning("session %s finished without %d turn(s) given up with dead workers",
                           protocol.session_tag(sid), reply.turns_abandoned)
        return [TraceRecord.from_wire(row) for row in reply.rows]

    def request_finish(
        self,
        sid: str,
        reward: float | None = None,
        rollout_id: str | int | None = None,
        metadata: dict[str, Any] | None = None,
        wait_timeout: float = DEFAULT_WAIT_TIMEOUT_S,
    ) -> None:
        """Finish the session without waiting for its rows: returns once the broker accepted the finish.

        The episode (rows built exactly as `finish_session` builds them, after in-flight turns had up
        to `wait_timeout` s to land) arrives on `episodes()`. Raises `SessionClosed` if the session
        already finished (by any path), `UnknownSession`, or `BrokerBusy` when the episode outbox is
        full (the session stays open: consume episodes, then retry). The outbox is in the broker's
        memory: episodes not yet acknowledged when the broker restarts are lost with it, unless it runs
        with `--state-dir`. Through a broker restart the request is resent (same request id), and a
        repeat of an accepted finish is accepted again, not refused; a broker without a state directory
        lost the session: `UnknownSession`.
        """
        args = _finish_args(sid, reward, rollout_id, metadata, wait_timeout)
        self._channel.call(
            lambda rid: protocol.RequestFinish(rid, *args),
            protocol.FinishAccepted,
            self.timeout,
            resend=True,
        )

    def episodes(
        self,
        timeout: float | None = None,
        max_pending: int = DEFAULT_MAX_PENDING,
        only_mine: bool = False,
        group: str | None = None,
        lease: float = DEFAULT_LEASE_S,
        auto_ack: bool = True,
    ) -> EpisodeStream:
        """Subscribe to finished episodes (`request_finish` and agent finishes): a blocking iterator.

        Several streams (threads, processes, hosts) share the broker's outbox; each episode goes to
        one of them and stays leased to it until acknowledged. See `EpisodeStream` for the arguments.
        """
        return EpisodeStream(
            self._channel,
            self.client_id,
            self.timeout,
            timeout=timeout,
            max_pending=max_pending,
            client_id=self.client_id if only_mine else None,
            group=group,
            lease=lease,
            auto_ack=auto_ack,
        )

    def drop_session(self, sid: str) -> bool:
        """Free a session without building rows; False if the broker had no such session.

        Resent through a broker restart (dropping twice frees it once): then False may also mean that the
        first attempt dropped it.
        """
        reply = self._channel.call(
            lambda rid: protocol.DropSession(rid, sid), protocol.SessionDropped, self.timeout, resend=True
        )
        return reply.existed

    def stats(self) -> dict[str, Any]:
        """The broker's counters and gauges (sessions, turns in flight, commits, refusals, ...); resent through a
        broker restart."""
        return self._channel.call(lambda rid: protocol.GetStats(rid), protocol.Stats, self.timeout, resend=True).stats

    def set_engines(self, urls: list[str]) -> list[str]:
        """Route sessions over these engine replicas from now on (base URLs), e.g. after a weight sync restarted
        them; returns the list as the broker keeps it. A new session goes to the least-loaded healthy replica and
        stays there until it ends; a replica no longer listed (or failing its /health check) gives its sessions
        to the others at their next turn. An empty list hands routing back to the workers' --engine-url lists.
        Not kept across a broker restart (it starts from its --engine-url list again). Resent through a restart."""
        if isinstance(urls, str) or not all(isinstance(u, str) for u in urls):
            raise ValueError("urls must be a list of base URLs")
        reply = self._channel.call(
            lambda rid: protocol.SetEngines(rid, list(urls)), protocol.EnginesSet, self.timeout, resend=True
        )
        return reply.urls

    def set_weight_version(self, version: int) -> int:
        """The policy version the engines serve from now on (an int >= 0, e.g. the training step whose weights
        they loaded); returns the previous one (-1: none). Every turn the broker opens after this call records
        `version`, and its sampled tokens carry it (`TraceRecord.weight_versions`); a turn already generating
        keeps the version it opened with. Durable with the broker's `--state-dir`; resent through a restart."""
        if type(version) is not int or not 0 <= version < 2**31:
            raise ValueError(f"version must be an int in [0, 2**31), got {version!r}")
        reply = self._channel.call(
            lambda rid: protocol.SetWeightVersion(rid, version), protocol.WeightVersionSet, self.timeout, resend=True
        )
        return reply.previous

    def pause_generation(self, mode: str, timeout: float = DEFAULT_PAUSE_TIMEOUT_S) -> PauseReport:
        """Stop generating, around a weight update; returns once every worker has stopped sending to the engines.

        From now on every agent request is accepted and held, its connection open and no engine call made,
        until `resume_generation` (or its hold bound, `--pause-hold-s`, when it gets a retryable 503). `mode`
        says what becomes of the generations in flight: "wait" lets them finish (and returns when none is left);
        "abort" stops them at the engines at once, keeps the tokens each sampled, and at the resume asks the same
        replica for the rest (the agent gets one reply; its tokens carry the old version, then the new one);
        "keep" uses the engines' own pause (vLLM `mode=keep`, SGLang `in_place`), which holds them inside the engine
        with their KV cache until the resume (returns once every replica's pause answered; which tokens carry which
        version: `TraceRecord.weight_versions`, -1 and the row flagged where the engine cannot tell).
        Every worker, and one that starts or reconnects meanwhile, applies the pause; a broker with
        `--state-dir` keeps it through a restart. Pausing while paused changes nothing and waits the same way
        (`PauseReport.already`). Raises `PauseTimeout` (the pause stays in force) when the workers are not idle
        within `timeout` seconds."""
        if mode not in protocol.PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(protocol.PAUSE_MODES)}, got {mode!r}")
        if type(timeout) not in (int, float) or not (math.isfinite(timeout) and timeout >= 0):
            raise ValueError(f"timeout must be finite seconds >= 0 (the broker's --max-wait-timeout at most), "
                             f"got {timeout!r}")  # fmt: skip
        reply = self._channel.call(lambda rid: protocol.PauseGeneration(rid, mode, float(timeout)),
                                   protocol.GenerationPaused, self.timeout + timeout, resend=True)  # fmt: skip
        report = PauseReport.from_wire(reply)
        if reply.resumed:
            raise PauseTimeout("a resume_generation ended the pause before every worker was idle", report)
        if not reply.idle:
            raise PauseTimeout(f"generation paused ({mode}), but {reply.engine_calls} engine call(s) were still "
                               f"running after {timeout:g}s", report)  # fmt: skip
        return report

    def resume_generation(self, weight_version: int | None = None) -> bool:
        """End the pause: set `weight_version` first, if given (as `set_weight_version`: the held turns sample
        under it), then release every held turn. Returns whether generation was paused (False: only the version
        was set)."""
        version = -1 if weight_version is None else weight_version
        if type(version) is not int or not -1 <= version < 2**31:
            raise ValueError(f"weight_version must be None or an int in [0, 2**31), got {weight_version!r}")
        reply = self._channel.call(lambda rid: protocol.ResumeGeneration(rid, version), protocol.GenerationResumed,
                                   self.timeout, resend=True)  # fmt: skip
        return reply.was_paused

    def generation_paused(self) -> str | None:
        """The pause in force: its mode ("wait", "abort", "keep"), or None while generating."""
        reply = self._channel.call(lambda rid: protocol.GetGeneration(rid), protocol.GenerationState, self.timeout,
                                   resend=True)  # fmt: skip
        return reply.mode or None

    def metrics(self) -> str:
        """The whole gateway's metrics in the Prometheus text format (what any worker's `/metrics` answers)."""
        metrics = self._channel.call(lambda rid: protocol.GetMetrics(rid), protocol.MetricsText, self.timeout,
                                     resend=True)
        return metrics.text

    def close(self) -> None:
        """Close every socket and the context. Call it once no other thread is inside a call."""
        self._channel.close()

    def __enter__(self) -> TrainerClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _finish_args(
    sid: str, reward: float | None, rollout_id: str | int | None, metadata: dict[str, Any] | None, wait_timeout: float
) -> tuple[str, float | None, str | None, dict[str, Any], float]:
    """The fields FinishSession and RequestFinish share, checked and normalized (rollout ids travel as text)."""
    if not (isinstance(wait_timeout, (int, float)) and wait_timeout >= 0 and math.isfinite(wait_timeout)):
        raise InvalidRequest(f"wait_timeout must be a finite number >= 0, got {wait_timeout!r}")
    rollout = None if rollout_id is None else str(rollout_id)
    return sid, None if reward is None else float(reward), rollout, dict(metadata or {}), float(wait_timeout)
