"""The turn's steps against the broker, the renderer, the engine and the parser (one `TurnPipeline` per worker).

`prepare` OPENs a turn and renders its prompt (or returns the broker's `TurnReplayed` for a retry whose turn is
recorded); `run` samples a prepared turn whole and parses it; `captured` makes the `CapturedTurn` a reply is
sent from (the live path, `turns.live`, calls it at the end of its stream). The path that chooses among them is
`turns.start`. Every exit before a reply exists aborts the turn; `ApiError` carries the HTTP status an adapter
renders in its own error shape. Also what requests that record nothing ask of the broker (`get_turn`,
`check_session`, `count_tokens`), and the parts' counts for `/metrics`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from broker import protocol
from broker.protocol import session_tag
from gateway_workers.capture.backplane import Backplane, BrokerUnavailable, TurnRefused
from gateway_workers.engines.base import (
    SHARED_SAMPLING,
    UNKNOWN_VERSION,
    Engine,
    EngineError,
    EngineResult,
    EngineTimeout,
    SamplingParams,
)
from gateway_workers.formats import ParsedResponse, ResponseParser
from gateway_workers.http.connection import AgentConnection
from gateway_workers.http.errors import ApiError, broker_unavailable
from gateway_workers.rendering.budget import PromptOverBudget
from gateway_workers.rendering.messages import message_chars
from gateway_workers.rendering.renderer import RenderedPrompt, Renderer, RenderError
from gateway_workers.rendering.twins.checks import twin_stats
from gateway_workers.turns.captured import CapturedTurn, PreparedTurn, TurnRequest
from gateway_workers.turns.history import LinearHistory, LinearPrompt
from gateway_workers.turns.replay import RetryKey

logger = logging.getLogger(__name__)

# Linear sessions a worker remembers as such (ids only), to skip their speculative full render.
LINEAR_SESSIONS_KEPT = 65_536


# A refusal from the broker -> (status, kind). 401/403 are final for the official SDKs,
# which retry 408/409/429/5xx on their own and would hammer a finished session.
_REFUSALS = {
    "unknown_session": (401, "authentication"),
    "session_closed": (403, "permission"),
    "turn_cap": (403, "permission"),
    "busy": (503, "unavailable"),
    "unknown_turn": (400, "invalid_request"),
    "turn_pending": (400, "invalid_request"),
}


def refusal_error(e: TurnRefused) -> ApiError:
    status, kind = _REFUSALS.get(e.code, (400, "invalid_request"))
    return ApiError(status, kind, e.message, code=e.code)


def engine_error(e: EngineError, session_id: str, turn_id: str) -> ApiError:
    """The HTTP error for an engine failure (logged: it is ours, not the agent's)."""
    if isinstance(e, EngineTimeout):
        logger.error("engine timed out on turn %s (session %s): %s", turn_id, session_tag(session_id), e)
        return ApiError(504, "timeout", f"the inference engine timed out: {e}")
    logger.error("engine failed on turn %s (session %s, %s): %s", turn_id, session_tag(session_id), e.kind, e)
    return ApiError(502, "engine", f"the inference engine failed: {e}")


# Requests with more message text than this are rendered wholly on the render thread, once the OPEN has
# told their context budget: their template render and cut would hold the event loop for milliseconds
# per MB, and the budget may prove them over it by their size before the cut.
HUGE_REQUEST_CHARS = 1 << 22


@dataclass(frozen=True, slots=True)
class EarlyRender:
    """A render begun before the OPEN's answer: done, its rest waiting for the budget, failed, or none begun."""

    done: RenderedPrompt | None = None
    rest: Callable[[int | None], RenderedPrompt] | None = None
    error: RenderError | None = None


def _with_engine_version(flags: dict[str, Any], result: EngineResult) -> dict[str, Any]:
    """The prepared turn's verdicts, the engine's own weight version when it reported one, and the policy
    versions a pause decided (`EngineResult.weight_versions`), which replace the one the turn opened with."""
    flags = dict(flags)
    if result.weight_version is not None:
        flags["engine_weight_version"] = result.weight_version
    if result.weight_versions:
        known = [version for version, _ in result.weight_versions if version != UNKNOWN_VERSION]
        if known:
            flags["weight_version"] = known[-1]
        if len(known) < len(result.weight_versions):  # the engine could not say: -1, flagged, never guessed
            flags["weight_versions_unknown"] = True
        flags["weight_versions"] = [[max(version, -1), n] for version, n in result.weight_versions]
    return flags

class TurnPipeline:
    """Runs turns against one backplane, renderer, parser and engine (one per worker)."""

    def __init__(
        self,
        backplane: Backplane,
        renderer: Renderer,
        parser: ResponseParser,
        engine: Engine,
        default_max_tokens: int,
        max_context_tokens: int | None = None,
    ) -> None:
        self.backplane, self.renderer, self.parser, self.engine = backplane, renderer, parser, engine
        self.default_max_tokens = default_max_tokens
        self.max_context_tokens = max_context_tokens  # the model's context window, for sessions without less
        fmt = getattr(parser, "format", None)
        eos = renderer.tokenizer.eos_token
        self.history = LinearHistory(
            backplane, renderer, fmt.end_markers if fmt is not None else ((eos,) if isinstance(eos, str) else ())
        )
        # Sessions seen to be linear: their full render is not begun before the OPEN's answer (most of their
        # turns need only the new messages rendered). A session forgotten only renders speculatively again.
        self._linear_sessions: OrderedDict[str, None] = OrderedDict()

    async def prepare(
        self, session_id: str, request: TurnRequest, key: RetryKey | None = None
    ) -> PreparedTurn | protocol.TurnReplayed:
        """OPEN the turn and render its prompt; raises ApiError (after aborting the turn if it was opened). When
        `key` names a retry of a request whose turn is recorded, the broker's `TurnReplayed` instead."""
        turn_id = uuid.uuid4().hex
        t0 = time.perf_counter()
        # The OPEN is on its way before the render starts, and awaited after its cheap part; the broker's
        # verdict still comes first, so a refused session gets its refusal, not a template error. The rest of
        # a long render waits for the OPEN's context budget, which spares tokenizing a prompt proven over it;
        # a huge request waits for it before its render starts, all of it on the render thread.
        digest, retry = (key.digest, key.retry) if key is not None else ("", False)
        opening = self.backplane.open_turn(session_id, turn_id, digest, retry)
        try:
            early = self._begin_render(session_id, request)
            opened = await opening
        except BaseException as e:
            opening.close()
            if isinstance(e, TurnRefused):
                raise refusal_error(e) from None
            # Unanswered (the broker stayed away, or the agent left while its OPEN was held), the OPEN may still
            # reach the broker (it waits in the socket for the broker's return): the ABORT follows it there, so no
            # turn is left in flight for a finish to wait for.
            unavailable = isinstance(e, BrokerUnavailable)
            self.backplane.abort_in_background(session_id, turn_id, "open_timeout" if unavailable else type(e).__name__)
            if unavailable:
                logger.error("OPEN of a turn for session %s failed: %s", session_tag(session_id), e)
                raise broker_unavailable() from None
            raise
        if isinstance(opened, protocol.TurnReplayed):
            return opened
        self.backplane.generation.apply(opened.generation_epoch, opened.paused, opened.weight_version)
        try:
            return await self._rendered(session_id, turn_id, request, opened, early, t0)
        except BaseException as e:
            rejected = isinstance(e, ApiError) and e.code == protocol.NOT_LINEAR
            reason = protocol.NOT_LINEAR if rejected else type(e).__name__
            self.backplane.abort_in_background(session_id, turn_id, reason)
            raise

    def _begin_render(self, session_id: str, request: TurnRequest) -> EarlyRender:
        """The render begun before the OPEN's answer: not for a session known linear, nor a huge request."""
        if session_id in self._linear_sessions or message_chars(request.messages) > HUGE_REQUEST_CHARS:
            return EarlyRender()
        try:
            begun = self.renderer.begin_render(request.messages, request.tools, session_id)
        except RenderError as e:
            return EarlyRender(error=e)
        return EarlyRender(rest=begun) if callable(begun) else EarlyRender(done=begun)

    async def _rendered(
        self, session_id: str, turn_id: str, request: TurnRequest, opened: protocol.TurnOpened, early: EarlyRender,
        t0: float,
    ) -> PreparedTurn:
        """The opened turn's prompt, rendered within its context budget: a linear session's from its history."""
        flags: dict[str, Any] = {}
        echo = None
        try:
            rendered = None
            if opened.history_mode == "linear":
                self._note_linear(session_id)
                linear = await self._linear_prompt(session_id, turn_id, request, opened)
                opened, flags["history"], echo, rendered = linear.opened, linear.kind, linear.echo, linear.rendered
            if opened.weight_version >= 0:  # the policy version in force: its tokens carry it in the rows
                flags["weight_version"] = opened.weight_version
            if rendered is None:
                rendered = await self._render_rest(session_id, request, early, self._budget(opened))
        except RenderError as e:
            raise ApiError(400, "invalid_request", f"the chat template rejected the messages: {e}") from None
        except PromptOverBudget as e:
            # An empty `length` turn, as for any prompt over the budget, but with no ids to record.
            params, _ = self._sampling(request, opened, e.at_least)
            return PreparedTurn(session_id, turn_id, request, array("i"), "", params, True, t0, time.perf_counter(),
                                {**flags, "prompt_tokens_at_least": e.at_least}, echo)
        params, over_budget = self._sampling(request, opened, len(rendered.prompt_ids))
        return PreparedTurn(
            session_id, turn_id, request, rendered.prompt_ids, rendered.text, params, over_budget, t0,
            time.perf_counter(), flags, echo, opened.replica,
        )  # fmt: skip

    async def _linear_prompt(
        self, session_id: str, turn_id: str, request: TurnRequest, opened: protocol.TurnOpened
    ) -> LinearPrompt:
        try:
            return await self.history.prompt(session_id, turn_id, request.messages, request.tools, opened)
        except TurnRefused as e:
            raise refusal_error(e) from None
        except BrokerUnavailable as e:
            logger.error("the held turn of linear session %s: %s", session_tag(session_id), e)
            raise broker_unavailable() from None

    async def _render_rest(
        self, session_id: str, request: TurnRequest, early: EarlyRender, budget: int | None
    ) -> RenderedPrompt:
        """Finish the early render within `budget` (on the render thread), or render it all there."""
        if early.error is not None:
            raise early.error
        if early.done is not None:
            return early.done
        rest = early.rest or functools.partial(self.renderer.render_session, request.messages, request.tools,
                                               session_id)
        return await asyncio.get_running_loop().run_in_executor(self.renderer.thread, rest, budget)

    def _note_linear(self, session_id: str) -> None:
        sessions = self._linear_sessions
        sessions[session_id] = None
        sessions.move_to_end(session_id)
        if len(sessions) > LINEAR_SESSIONS_KEPT:
            sessions.popitem(last=False)

    async def run(self, prepared: PreparedTurn, connection: AgentConnection) -> CapturedTurn:
        """Generate the prepared turn whole; raises ApiError (after aborting it). The caller must commit() or abort()
        the result."""
        try:
            if prepared.over_budget:
                # A prompt already over the context budget yields an empty `length` turn (`rendering.budget`).
                result = EngineResult(output_ids=[], logprobs=[], finish_reason="length")
            else:
                result = await self._call_engine(prepared, connection)
            t_engine = time.perf_counter()
            parsed = self.parser.parse(result.output_ids, prepared.prompt_text, prepared.request.tools)
            return self.captured(prepared, result, parsed, t_engine)
        except BaseException as e:
            self.backplane.abort_in_background(prepared.session_id, prepared.turn_id, type(e).__name__)
            raise

    def captured(
        self, prepared: PreparedTurn, result: EngineResult, parsed: ParsedResponse, t_engine: float
    ) -> CapturedTurn:
        """The generated turn, waiting for its reply to be sent."""
        timings = {"open_s": 0.0, "render_s": prepared.t_render - prepared.t0, "engine_s": t_engine - prepared.t_render,
                   "parse_s": time.perf_counter() - t_engine}
        flags = _with_engine_version(prepared.flags, result)
        return CapturedTurn(prepared.session_id, prepared.turn_id, prepared.request, prepared.prompt_ids, result,
                            parsed, int(time.time()), timings, flags, prepared.echo, _backplane=self.backplane)

    def metric_rows(self) -> tuple[list[list[Any]], list[list[Any]]]:
        """What the worker's parts count themselves, as (counters, gauges) snapshot rows: commits by form, linear
        history, the render cache, the fast twins, engine failures, and what the worker holds per session."""
        cache = self.renderer.cache.stats()
        backplane, history = dict(self.backplane.counters), dict(self.history.counters)
        counters: list[list[Any]] = [
            ["commits_sent", ["full"], backplane.get("commits_full", 0)],
            ["commits_sent", ["delta"], backplane.get("commits_delta", 0)],
            ["commit_deltas_refused", [], backplane.get("delta_refused", 0)],
            ["sessions_ended_told", [], backplane.get("sessions_ended", 0)],
            *(["linear_history", [name.removeprefix("linear_")], value] for name, value in history.items()),
            ["render_cache", ["hit"], cache.hits],
            ["render_cache", ["miss"], cache.misses],
            ["render_cache", ["forgotten"], cache.forgotten],
            *([["engine_errors", [replica, kind], n] for (replica, kind), n in dict(self.engine.faults).items()]),
            ["pause_holds", ["held"], self.backplane.generation.counters["held"]],
            ["pause_holds", ["timed_out"], self.backplane.generation.counters["hold_timeouts"]],
            ["pause_stops", [], self.backplane.generation.counters["stopped"]],
            ["pause_tokens_kept", [], self.backplane.generation.counters["tokens_kept"]],
            ["pause_resubmits", [], self.backplane.generation.counters["resubmits"]],
            ["pause_failovers", [], self.backplane.generation.counters["failovers"]],
        ]
        gauges: list[list[Any]] = [
            ["worker_sessions_held", ["commit_bases"], len(self.backplane.bases)],
            ["worker_sessions_held", ["session_renders"], self.renderer.sessions_held],
            ["render_cache_pieces", [], cache.entries],
            ["render_cache_bytes", [], cache.bytes],
            ["render_bpe_twin", [], int(self.renderer.bpe_twin)],
            *(["engine_replica", [url], 1] for url in self.engine.replicas),
        ]
        for twin in twin_stats():
            labels = [twin.kind, twin.name]
            counters += [["twin_uses", labels, twin.uses], ["twin_checks", labels, twin.checks],
                         ["twin_mismatches", labels, twin.mismatches]]  # fmt: skip
            gauges.append(["twin_active", labels, int(twin.active)])
        return counters, gauges

    async def get_turn(self, session_id: str, turn_id: str) -> protocol.TurnFound:
        """A committed turn of this session (`previous_response_id`); raises ApiError."""
        try:
            return await self.backplane.get_turn(session_id, turn_id)
        except TurnRefused as e:
            raise refusal_error(e) from None
        except BrokerUnavailable as e:
            logger.error("GET of turn %s of session %s failed: %s", turn_id, session_tag(session_id), e)
            raise broker_unavailable() from None

    async def check_session(self, session_id: str) -> None:
        """Raise ApiError unless the session is open (for requests that record nothing)."""
        try:
            await self.get_turn(session_id, "")
        except ApiError as e:
            if e.code != "unknown_turn":
                raise

    async def count_tokens(self, request: TurnRequest) -> int:
        """Prompt length of a request, rendered exactly as a turn would be."""
        try:
            render = functools.partial(self.renderer.render, request.messages, request.tools)
            rendered = await asyncio.get_running_loop().run_in_executor(self.renderer.thread, render)
        except RenderError as e:
            raise ApiError(400, "invalid_request", f"the chat template rejected the messages: {e}") from None
        return len(rendered.prompt_ids)

    async def _call_engine(self, prepared: PreparedTurn, connection: AgentConnection) -> EngineResult:
        session_id, turn_id = prepared.session_id, prepared.turn_id
        try:
            # An agent that leaves cancels the call, which makes the engine backend abort the request.
            with connection.cancelled_on_disconnect():
                return await self.engine.generate(
                    prepared.prompt_ids, prepared.params, session_id=session_id, request_id=turn_id,
                    replica=prepared.replica,
                )  # fmt: skip
        except asyncio.CancelledError:
            if connection.took_cancel():
                raise ApiError(499, "invalid_request", "client disconnected") from None
            raise
        except EngineError as e:
            raise engine_error(e, session_id, turn_id) from None

    def _budget(self, opened: protocol.TurnOpened) -> int | None:
        """The turn's context budget: the session's, within the model's context window."""
        session, model = opened.max_context_tokens, self.max_context_tokens
        if session is None or model is None:
            return model if session is None else session
        return min(session, model)

    def _sampling(
        self, request: TurnRequest, opened: protocol.TurnOpened, prompt_len: int
    ) -> tuple[SamplingParams, bool]:
        """Request values win over the session's sampling defaults; the context budget caps max_tokens."""
        defaults = opened.sampling_defaults

        def pick(name: str, value: Any) -> Any:
            return value if value is not None else defaults.get(name)

        max_tokens = pick("max_tokens", request.max_tokens) or self.default_max_tokens
        over_budget = False
        budget = self._budget(opened)
        if budget is not None:
            room = budget - prompt_len
            over_budget = room <= 0
            max_tokens = min(max_tokens, max(room, 0))
        stop = request.stop or tuple(defaults.get("stop") or ())
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=pick("temperature", request.temperature),
            top_p=pick("top_p", request.top_p),
            top_k=pick("top_k", request.top_k),
            stop=tuple(stop),
            seed=pick("seed", request.seed),
            more=request.sampling,
        )
        if defaults and not SHARED_SAMPLING.isdisjoint(defaults):  # the session's own, under the request's
            more = {name: defaults[name] for name in SHARED_SAMPLING if name in defaults}
            params = dataclasses.replace(params, more={**more, **(request.sampling or {})})
        return params, over_budget
