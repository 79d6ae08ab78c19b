"""The ASGI app of one gateway worker: routes, lifespan, and the reply-then-commit rule.

The lifespan builds this process's tokenizer, renderer, parser, engine client and
backplane socket (never at import, never in the uvicorn parent) and closes them with
bounded waits. Every dialect (Chat Completions, Anthropic Messages, Responses) goes
through one plain-ASGI handler, `serve_turn`, and one `send_reply`, which sends the reply
(one body, or SSE events while the engine generates) and only then commits the turn; a
reply that did not reach the agent aborts it, and a stream the agent left stops the engine.
The other routes are Starlette's. uvicorn starts workers through `create_app_from_env`
(factory=True), which reads the CLI's WorkerConfig.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypedDict, cast

import orjson
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from broker.protocol import session_tag
from gateway_workers.adapters import anthropic_messages, openai_chat, openai_responses
from gateway_workers.adapters.base import Adapter, ParsedRequest
from gateway_workers.capture.backplane import Backplane
from gateway_workers.capture.commit_bases import CommitBases
from gateway_workers.config import WorkerConfig
from gateway_workers.engines import create_engine
from gateway_workers.formats import PLAIN_TEXT, ResponseParser, detect_parser
from gateway_workers.http import access_log
from gateway_workers.http.bodies import BodyDecoder, DecodedBody, decode_whole
from gateway_workers.http.connection import AgentConnection, session_key
from gateway_workers.http.errors import ApiError
from gateway_workers.http.finish_route import FINISH_PATH, finish_session
from gateway_workers.http.info_routes import healthz, metrics, models, unknown_route, worker_metrics
from gateway_workers.http.limits import RequestLimits, check_headers, check_strings, read_body
from gateway_workers.lifetime import tie_to_parent
from gateway_workers.metrics import WorkerMetrics
from gateway_workers.rendering.renderer import Renderer
from gateway_workers.rendering.tokenizer import load_tokenizer
from gateway_workers.turns.captured import LiveReply, ReplySource
from gateway_workers.turns.gated_engine import GatedEngine
from gateway_workers.turns.pipeline import TurnPipeline
from gateway_workers.turns.replay import IDEMPOTENCY_HEADER, RETRY_COUNT_HEADER, retry_key
from gateway_workers.turns.start import start_turn

logger = logging.getLogger(__name__)

ENGINE_CLOSE_TIMEOUT_S = 5.0




class WorkerState(TypedDict):
    pipeline: TurnPipeline
    config: WorkerConfig
    metrics: WorkerMetrics
    bodies: BodyDecoder
    snapshot: Callable[[], dict[str, Any]]  # this worker's metrics, its parts' counts included


async def _once(body: bytes) -> AsyncIterator[bytes]:
    yield body


_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
_JSON_TYPE = (b"content-type", b"application/json")


class TurnLabels:
    """What a turn's metrics and log line are labelled with, and when its request arrived."""

    __slots__ = ("dialect", "stream", "t0", "path", "sid")

    def __init__(self, dialect: str, t0: float, path: str) -> None:
        self.dialect, self.stream, self.t0 = dialect, "unknown", t0  # the stream flag is known once parsed
        self.path = path
        self.sid: str | None = None  # known once the key is read


def _count_turn(metrics: WorkerMetrics, labels: TurnLabels, outcome: str) -> None:
    metrics.count("turns", (labels.dialect, labels.stream, outcome))


def _record(metrics: WorkerMetrics, source: ReplySource, labels: TurnLabels, outcome: str, t_reply: float) -> None:
    """A settled turn's outcome, its tokens and how long each stage took (a replay's: only the reply's)."""
    _count_turn(metrics, labels, outcome)
    now = time.perf_counter()
    metrics.observe("turn_duration_seconds", ("reply",), now - t_reply)
    metrics.observe("turn_duration_seconds", ("total",), now - labels.t0)
    turn = source.turn
    if outcome not in ("failed", "refused"):  # an error mid-stream was logged with the error
        access_log.served("POST", labels.path, 200, labels.t0, labels.sid, labels.stream, outcome)
    if turn is None or source.replayed:  # a replay's tokens and stages were counted with the attempt that sampled it
        return
    metrics.count("tokens", ("prompt",), len(turn.prompt_ids))
    metrics.count("tokens", ("output",), len(turn.result.output_ids))
    timings = turn.timings
    for stage in ("render", "engine", "parse"):
        metrics.observe("turn_duration_seconds", (stage,), timings[stage + "_s"])
    if outcome == "committed" and turn.parsed.ill_formed:
        metrics.count("ill_formed_turns", (labels.dialect,))


async def send_reply(source: ReplySource, body: AsyncIterator[bytes], headers: list[tuple[bytes, bytes]],
                     send: Send, connection: AgentConnection, metrics: WorkerMetrics, labels: TurnLabels) -> None:
    """Send a turn's reply, one body or SSE events as they are produced, then commit the turn.

    uvicorn's `send` silently drops data once the client is gone, so a disconnect cancels the
    sending (and with it the engine stream) and the turn is aborted, never trained on. An
    `ApiError` from the body (the engine failed mid-stream, after the adapter sent its error
    event) ends the stream and aborts the turn. A replayed reply (a retry's) commits nothing.
    """
    sent = False
    failed: ApiError | None = None
    t_reply = time.perf_counter()
    try:
        with connection.cancelled_on_disconnect():
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async for chunk in body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            sent = True
    except asyncio.CancelledError:
        if not connection.took_cancel():
            raise
    except ApiError as e:
        # The adapter already sent the error event; end the stream so the agent is not left waiting.
        failed = e
        metrics.count("http_errors", (labels.dialect, str(e.status), e.code or e.kind))
        error_type = TURN_ROUTES[labels.path][1].error_body(e)["error"]["type"]
        access_log.refused("POST", labels.path, e, error_type, labels.t0, labels.sid,
                           "an error event after the reply had begun with 200")
        with contextlib.suppress(Exception):
            await send({"type": "http.response.body", "body": b"", "more_body": False})
    except Exception:
        logger.exception("sending the reply of turn %s (session %s) failed", source.turn_id,
                         session_tag(source.session_id))
    finally:
        connection.stop()
        aclose = getattr(body, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
        await source.close()
        if sent:
            source.commit()
            outcome = "replayed" if source.replayed else "committed"
        else:
            source.abort("client disconnected before the reply was sent")
            outcome = "aborted" if failed is None else "failed" if failed.status >= 500 else "refused"
        _record(metrics, source, labels, outcome, t_reply)


def _error(adapter: Adapter[Any], error: ApiError, metrics: WorkerMetrics, labels: TurnLabels) -> Response:
    """The error in the dialect's shape, counted and logged (one line: whoever raised a 5xx logged its cause too)."""
    metrics.count("http_errors", (labels.dialect, str(error.status), error.code or error.kind))
    if labels.stream != "none":  # a turn route's (count_tokens is not a turn)
        _count_turn(metrics, labels, "failed" if error.status >= 500 else "refused")
    body = adapter.error_body(error)
    access_log.refused("POST", labels.path, error, body["error"]["type"], labels.t0, labels.sid)
    headers = dict(error.headers)
    # After a 413/431 the rest of the request is unread: closing the connection keeps uvicorn from buffering it.
    if error.status in (413, 431):
        headers["connection"] = "close"
    return Response(orjson.dumps(body), status_code=error.status, media_type="application/json", headers=headers)


def _note(request: ParsedRequest, labels: TurnLabels, config: WorkerConfig, metrics: WorkerMetrics) -> None:
    """Count the fields the request carried that are ignored, and leave out its hosted tools (or refuse them)."""
    hosted = request.hosted
    if hosted:
        if config.hosted_tools == "reject":
            where, kind = hosted[0]
            raise ApiError(400, "invalid_request", f"{where}: {kind!r} is a tool the provider runs, which the model "
                           "cannot call through this gateway (it runs with --hosted-tools reject)",
                           code="unsupported_value", param=where.partition("[")[0])
        metrics.count_each("hosted_tools_dropped", labels.dialect, [kind for _, kind in hosted])
    metrics.count_each("request_fields_ignored", labels.dialect, request.ignored)


def _json(decode: Callable[[bytes, Callable[[DecodedBody], None]], DecodedBody], raw: bytes,
          limits: RequestLimits) -> DecodedBody:
    def check(decoded: DecodedBody) -> None:
        if decoded.fresh_bytes > limits.max_string_chars:  # only so much text can hold a string over the limit
            for value, place in decoded.fresh:
                check_strings(value, limits, place)

    try:
        return decode(raw, check)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, "invalid_request", f"the body is not valid JSON: {e}") from None


def _key(headers: Headers) -> str:
    sid = session_key(headers)
    if sid is None:
        raise ApiError(401, "authentication", "missing API key (the session key)", code="invalid_api_key")
    return sid


def _check_tools_parseable(parser: ResponseParser, tools: list[dict[str, Any]] | None) -> None:
    """A request that declares tools needs a parser that can find tool calls: else a 400, never a silent guess."""
    if not tools or parser.supports_tools:
        return
    name = parser.format_name
    if name == PLAIN_TEXT:
        reason = ("this gateway serves plain text only: the model's chat template is not recognized "
                  "(--allow-plain-text), so tool calls in its replies could not be parsed; restart it with "
                  "--response-format NAME to use tools")
    else:
        reason = f"the model's response format {name!r} has no tool calls; send the request without tools"
    raise ApiError(400, "invalid_request", reason, code="tools_unsupported", param="tools")


async def serve_turn(scope: Scope, receive: Receive, send: Send, dialect: str, adapter: Adapter[Any]) -> None:
    """One turn in any dialect: validate, run (live when streaming), reply, commit.

    A plain ASGI handler: turns are nearly all of a worker's requests, and Starlette's
    middleware and routing cost more per request than the rest of this function.
    """
    labels = TurnLabels(dialect, time.perf_counter(), scope["path"])
    state: WorkerState = scope["state"]
    metrics = state["metrics"]
    pipeline = state["pipeline"]
    limits = state["config"].limits
    try:
        check_headers(scope["headers"], limits)
        request_headers = Headers(scope=scope)
        sid = labels.sid = _key(request_headers)
        body = await read_body(request_headers.get("content-length"), receive, limits)
        bodies = state["bodies"]
        decoded = _json(functools.partial(bodies.decode, sid, scope["path"], adapter.HISTORY_FIELD), body, limits)
        parsed = adapter.parse_request(decoded.value, limits, decoded.earlier)
        bodies.attach(sid, parsed)
        labels.stream = "true" if parsed.stream else "false"
        _note(parsed, labels, state["config"], metrics)
        parsed = await adapter.load_history(parsed, sid, pipeline)
        _check_tools_parseable(pipeline.parser, parsed.turn.tools)
    except ApiError as e:
        return await _error(adapter, e, metrics, labels)(scope, receive, send)
    key = retry_key(scope["path"], request_headers.get(IDEMPOTENCY_HEADER), request_headers.get(RETRY_COUNT_HEADER),
                    len(body), decoded.crc32)
    connection = AgentConnection(receive)
    model = state["config"].model_name
    source: ReplySource | None = None
    try:
        source = await start_turn(pipeline, sid, parsed.turn, connection, key, live=parsed.stream)
        if parsed.stream:
            reply, headers = adapter.stream_events(cast(LiveReply, source), parsed, model), _SSE_HEADERS
        else:
            assert source.turn is not None
            whole = adapter.response_body(source.turn, parsed, model)
            reply, headers = _once(whole), [_JSON_TYPE, (b"content-length", str(len(whole)).encode())]
    except ApiError as e:
        connection.stop()
        return await _error(adapter, e, metrics, labels)(scope, receive, send)
    except Exception:
        connection.stop()
        if source is not None:
            source.abort("the reply could not be built")
            await source.close()
        logger.exception("turn of session %s failed", session_tag(sid))
        error = ApiError(500, "internal", "internal error in the gateway worker")
        return await _error(adapter, error, metrics, labels)(scope, receive, send)
    await send_reply(source, reply, headers, send, connection, metrics, labels)


# Starlette routes that log their answers themselves (with the session and the error's code), not by status.
_SELF_LOGGING = frozenset({"/v1/messages/count_tokens", FINISH_PATH})

# path -> (the dialect's name in metrics, its adapter)
TURN_ROUTES: dict[str, tuple[str, Adapter[Any]]] = {
    "/v1/chat/completions": ("chat", openai_chat),
    "/v1/messages": ("messages", anthropic_messages),
    "/v1/responses": ("responses", openai_responses),
}


class TurnEndpoint:
    """A turn route as Starlette sees it (for what the fast path does not take: 405s, redirects)."""

    def __init__(self, dialect: str, adapter: Adapter[Any]) -> None:
        self.dialect, self.adapter = dialect, adapter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await serve_turn(scope, receive, send, self.dialect, self.adapter)


class GatewayApp:
    """A worker's ASGI app: POSTs to the turn routes go straight to `serve_turn`, the rest to Starlette (each
    logged by `access_log`: an error always, anything else with --access-log)."""

    def __init__(self, routes: Starlette) -> None:
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.routes(scope, receive, send)
        if scope["method"] == "POST":
            route = TURN_ROUTES.get(scope["path"])
            if route is not None:
                return await serve_turn(scope, receive, send, *route)
        if scope["path"] in _SELF_LOGGING:  # they say more of their answers than a status
            return await self.routes(scope, receive, send)
        started, status = time.perf_counter(), 0

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.routes(scope, receive, sending)
        finally:
            access_log.answered(scope["method"], scope["path"], status or 500, started)


async def count_tokens(request: Request) -> Response:
    """Anthropic's token counting: the prompt rendered exactly as a turn would be; records nothing."""
    state = request.state
    limits = state.config.limits
    labels = TurnLabels("count_tokens", time.perf_counter(), request.url.path)
    labels.stream = "none"  # not a turn: counted among the HTTP errors only
    try:
        check_headers(request.scope["headers"], limits)
        sid = labels.sid = _key(request.headers)
        body = await read_body(request.headers.get("content-length"), request.receive, limits)
        parsed = anthropic_messages.parse_request(_json(decode_whole, body, limits).value, limits, counting=True)
        _note(parsed, labels, state.config, state.metrics)
        await state.pipeline.check_session(sid)
        count = await state.pipeline.count_tokens(parsed.turn)
    except ApiError as e:
        return _error(anthropic_messages, e, state.metrics, labels)
    access_log.served("POST", labels.path, 200, labels.t0, sid)
    return JSONResponse({"input_tokens": count})


def create_app(config: WorkerConfig) -> GatewayApp:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[WorkerState]:
        access_log.enable(config.access_log, config.log_level)
        tokenizer = load_tokenizer(config.tokenizer, chat_template_path=config.chat_template)
        engine = create_engine(config.engine, tokenizer)
        bases = CommitBases(config.commit_base_sessions, config.commit_base_mib << 20)
        metrics = WorkerMetrics()
        backplane = Backplane(
            config.broker_endpoint, bases, curve_keys=config.curve_keys, metrics=metrics, hold_s=config.pause_hold_s
        )
        # The CLI ran the same decision before spawning us; an unknown template fails here only if it did not.
        parser = detect_parser(tokenizer, config.response_format, config.allow_plain_text)
        renderer = Renderer(tokenizer)
        renderer.prepare_thread()
        backplane.ended_listeners.append(renderer.forget_sessions)
        gated = GatedEngine(engine, backplane.generation, config.pause_hold_s)
        pipeline = TurnPipeline(backplane, renderer, parser, gated, config.default_max_tokens,
                                config.max_context_tokens)
        bodies = BodyDecoder()
        backplane.ended_listeners += [pipeline.history.forget_sessions, engine.forget_sessions, bodies.forget]

        def parts() -> tuple[list[list[Any]], list[list[Any]]]:
            counters, gauges = pipeline.metric_rows()
            counters += [["request_bodies", [how], n] for how, n in bodies.counts.items()]
            return counters, [*gauges, ["worker_sessions_held", ["request_bodies"], len(bodies)]]

        def snapshot() -> dict[str, Any]:
            return metrics.snapshot(parts)

        backplane.start(snapshot)
        logger.info("worker %d ready: broker %s, engine %s", os.getpid(), config.broker_endpoint, config.engine.kind)
        try:
            yield {"pipeline": pipeline, "config": config, "metrics": metrics, "bodies": bodies,
                   "snapshot": snapshot}
        finally:
            renderer.thread.shutdown(wait=False, cancel_futures=True)
            await backplane.drain(config.commit_drain_s)
            await backplane.close()
            await asyncio.wait_for(engine.aclose(), ENGINE_CLOSE_TIMEOUT_S)

    turn_routes = [Route(path, TurnEndpoint(*route), methods=["POST"]) for path, route in TURN_ROUTES.items()]
    return GatewayApp(Starlette(
        routes=[
            *turn_routes,
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/metrics/worker", worker_metrics, methods=["GET"]),
            Route(FINISH_PATH, finish_session, methods=["POST"]),  # 404 unless --allow-agent-finish
        ],
        exception_handlers={404: unknown_route, 405: unknown_route},
        lifespan=lifespan,
    ))


def create_app_from_env() -> GatewayApp:
    """uvicorn factory: the CLI put the WorkerConfig in the environment."""
    config = WorkerConfig.from_env()
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(process)d %(name)s %(message)s")
    tie_to_parent()  # a worker never outlives the process that started it
    return create_app(config)
