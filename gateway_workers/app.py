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
import logging
import os
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any, Protocol, TypedDict

import orjson
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from broker.protocol import session_tag
from gateway_workers.adapters import anthropic_messages, openai_chat, openai_responses
from gateway_workers.adapters.base import Adapter
from gateway_workers.capture.backplane import Backplane
from gateway_workers.capture.commit_bases import CommitBases
from gateway_workers.config import WorkerConfig
from gateway_workers.engines import create_engine
from gateway_workers.formats import PLAIN_TEXT, ResponseParser, detect_parser
from gateway_workers.http.connection import AgentConnection, session_key
from gateway_workers.http.errors import ApiError
from gateway_workers.http.finish_route import FINISH_PATH, finish_session
from gateway_workers.http.limits import RequestLimits, check_headers, check_strings, read_body
from gateway_workers.lifetime import tie_to_parent
from gateway_workers.rendering.renderer import Renderer
from gateway_workers.rendering.tokenizer import load_tokenizer
from gateway_workers.rendering.twins.checks import twin_stats
from gateway_workers.turns.live import start_live_turn
from gateway_workers.turns.pipeline import CapturedTurn, TurnPipeline
from gateway_workers.turns.replay import IDEMPOTENCY_HEADER, RETRY_COUNT_HEADER, Replayed, ReplayedLive, retry_key

logger = logging.getLogger(__name__)

ENGINE_CLOSE_TIMEOUT_S = 5.0


class WorkerState(TypedDict):
    pipeline: TurnPipeline
    config: WorkerConfig
    counters: Counter[str]


class ReplySource(Protocol):
    """What a reply settles: a whole `CapturedTurn` or a `LiveTurn` still generating."""

    turn_id: str
    session_id: str

    def commit(self) -> None: ...

    def abort(self, reason: str) -> None: ...

    async def close(self) -> None: ...


async def _once(body: bytes) -> AsyncIterator[bytes]:
    yield body


_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
_JSON_TYPE = (b"content-type", b"application/json")


async def send_reply(source: ReplySource, body: AsyncIterator[bytes], headers: list[tuple[bytes, bytes]],
                     send: Send, connection: AgentConnection, counters: Counter[str]) -> None:
    """Send a turn's reply, one body or SSE events as they are produced, then commit the turn.

    uvicorn's `send` silently drops data once the client is gone, so a disconnect cancels the
    sending (and with it the engine stream) and the turn is aborted, never trained on. An
    `ApiError` from the body (the engine failed mid-stream, after the adapter sent its error
    event) ends the stream and aborts the turn.
    """
    sent = False
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
        counters[f"stream_{e.status}"] += 1
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
            counters["turns_committed"] += 1
        else:
            source.abort("client disconnected before the reply was sent")
            counters["turns_aborted"] += 1


def _error(adapter: Adapter[Any], error: ApiError, counters: Counter[str]) -> Response:
    # Not logged here: whoever raises a 5xx logs its cause once, with the turn and session tag it knows.
    counters[f"http_{error.status}"] += 1
    headers = dict(error.headers)
    # After a 413/431 the rest of the request is unread: closing the connection keeps uvicorn from buffering it.
    if error.status in (413, 431):
        headers["connection"] = "close"
    return Response(orjson.dumps(adapter.error_body(error)), status_code=error.status, media_type="application/json",
                    headers=headers)


def _json(raw: bytes, limits: RequestLimits) -> Any:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, "invalid_request", f"the body is not valid JSON: {e}") from None
    if len(raw) > limits.max_string_chars:  # only such a body can hold a string over the limit
        check_strings(body, limits)
    return body


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


async def serve_turn(scope: Scope, receive: Receive, send: Send, adapter: Adapter[Any]) -> None:
    """One turn in any dialect: validate, run (live when streaming), reply, commit.

    A plain ASGI handler: turns are nearly all of a worker's requests, and Starlette's
    middleware and routing cost more per request than the rest of this function.
    """
    state: WorkerState = scope["state"]
    counters = state["counters"]
    pipeline = state["pipeline"]
    counters["requests"] += 1
    limits = state["config"].limits
    try:
        check_headers(scope["headers"], limits)
        request_headers = Headers(scope=scope)
        sid = _key(request_headers)
        body = await read_body(request_headers.get("content-length"), receive, limits)
        parsed = adapter.parse_request(_json(body, limits), limits)
        parsed = await adapter.load_history(parsed, sid, pipeline)
        _check_tools_parseable(pipeline.parser, parsed.turn.tools)
    except ApiError as e:
        return await _error(adapter, e, counters)(scope, receive, send)
    key = retry_key(scope["path"], request_headers.get(IDEMPOTENCY_HEADER), request_headers.get(RETRY_COUNT_HEADER),
                    body)
    connection = AgentConnection(receive)
    model = state["config"].model_name
    turn: CapturedTurn | None = None
    try:
        try:
            if parsed.stream:
                live = await start_live_turn(pipeline, sid, parsed.turn, connection, key)
                events = adapter.stream_events(live, parsed, model)
                return await send_reply(live, events, _SSE_HEADERS, send, connection, counters)
            turn = await pipeline.run(sid, parsed.turn, connection, key)
        except Replayed as r:
            counters["turns_replayed"] += 1
            turn = pipeline.replayed_turn(sid, parsed.turn, r.recorded)
            if parsed.stream:
                replay = ReplayedLive(turn)
                # ReplayedLive has what the adapters read of a LiveTurn (ids, created, prompt_ids, deltas, turn)
                events = adapter.stream_events(replay, parsed, model)  # type: ignore[arg-type]
                return await send_reply(replay, events, _SSE_HEADERS, send, connection, counters)
        body = adapter.response_body(turn, parsed, model)
    except ApiError as e:
        connection.stop()
        return await _error(adapter, e, counters)(scope, receive, send)
    except Exception:
        connection.stop()
        if turn is not None:
            turn.abort("the reply could not be built")
        logger.exception("turn of session %s failed", session_tag(sid))
        error = ApiError(500, "internal", "internal error in the gateway worker")
        return await _error(adapter, error, counters)(scope, receive, send)
    headers = [_JSON_TYPE, (b"content-length", str(len(body)).encode())]
    await send_reply(turn, _once(body), headers, send, connection, counters)


TURN_ROUTES: dict[str, Adapter[Any]] = {
    "/v1/chat/completions": openai_chat,
    "/v1/messages": anthropic_messages,
    "/v1/responses": openai_responses,
}


class TurnEndpoint:
    """A turn route as Starlette sees it (for what the fast path does not take: 405s, redirects)."""

    def __init__(self, adapter: Adapter[Any]) -> None:
        self.adapter = adapter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await serve_turn(scope, receive, send, self.adapter)


class GatewayApp:
    """A worker's ASGI app: POSTs to the turn routes go straight to `serve_turn`, the rest to Starlette."""

    def __init__(self, routes: Starlette) -> None:
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            adapter = TURN_ROUTES.get(scope["path"])
            if adapter is not None:
                return await serve_turn(scope, receive, send, adapter)
        await self.routes(scope, receive, send)


async def count_tokens(request: Request) -> Response:
    """Anthropic's token counting: the prompt rendered exactly as a turn would be; records nothing."""
    state = request.state
    limits = state.config.limits
    try:
        check_headers(request.scope["headers"], limits)
        sid = _key(request.headers)
        body = await read_body(request.headers.get("content-length"), request.receive, limits)
        parsed = anthropic_messages.parse_request(_json(body, limits), limits, counting=True)
        await state.pipeline.check_session(sid)
        count = await state.pipeline.count_tokens(parsed.turn)
    except ApiError as e:
        return _error(anthropic_messages, e, state.counters)
    return JSONResponse({"input_tokens": count})


async def models(request: Request) -> Response:
    name = request.state.config.model_name
    return JSONResponse({"object": "list",
                         "data": [{"id": name, "object": "model", "created": 0, "owned_by": "rollout-gateway"}]})


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok", "pid": os.getpid()})


async def metrics(request: Request) -> Response:
    pipeline: TurnPipeline = request.state.pipeline
    cache = pipeline.renderer.cache.stats()
    counters: Counter[str] = Counter(request.state.counters)
    counters.update(pipeline.backplane.counters)  # commits sent full / as deltas, deltas refused
    counters.update(pipeline.history.counters)  # linear sessions' held turns: local or fetched; waits
    counters.update({"render_cache_hits": cache.hits, "render_cache_misses": cache.misses,
                     "render_cache_forgotten": cache.forgotten})
    pid = os.getpid()
    lines = [f'rollout_gateway_{name}_total{{pid="{pid}"}} {value}' for name, value in sorted(counters.items())]
    # What this worker holds per session (dropped when the broker says a session ended), and its piece cache
    held = {"commit_bases": len(pipeline.backplane.bases), "session_renders": pipeline.renderer.sessions_held,
            "render_cache_pieces": cache.entries, "render_cache_bytes": cache.bytes}
    lines += [f'rollout_gateway_{name}{{pid="{pid}"}} {value}' for name, value in held.items()]
    # 1 while new prompt text is encoded by the tiktoken twin (0: never had one, or it diverged and was dropped)
    lines.append(f'rollout_gateway_render_bpe_twin{{pid="{pid}"}} {int(pipeline.renderer.bpe_twin)}')
    for twin in twin_stats():  # every fast twin: how often it ran, was checked, differed, and whether it is on
        labels = f'pid="{pid}",twin="{twin.kind}",name="{twin.name}"'
        lines += [f"rollout_gateway_twin_uses_total{{{labels}}} {twin.uses}",
                  f"rollout_gateway_twin_checks_total{{{labels}}} {twin.checks}",
                  f"rollout_gateway_twin_mismatches_total{{{labels}}} {twin.mismatches}",
                  f"rollout_gateway_twin_active{{{labels}}} {int(twin.active)}"]
    for (replica, kind), count in sorted(pipeline.engine.faults.items()):  # failed engine calls, per replica
        lines.append(f'rollout_gateway_engine_faults_total{{pid="{pid}",replica="{_label(replica)}",kind="{kind}"}} '
                     f"{count}")
    return PlainTextResponse("\n".join(lines) + "\n")


def _label(value: str) -> str:
    """A Prometheus label value: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def create_app(config: WorkerConfig) -> GatewayApp:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[WorkerState]:
        tokenizer = load_tokenizer(config.tokenizer, chat_template_path=config.chat_template)
        engine = create_engine(config.engine, tokenizer)
        bases = CommitBases(config.commit_base_sessions, config.commit_base_mib << 20)
        backplane = Backplane(config.broker_endpoint, bases, curve_keys=config.curve_keys)
        backplane.start()
        # The CLI ran the same decision before spawning us; an unknown template fails here only if it did not.
        parser = detect_parser(tokenizer, config.response_format, config.allow_plain_text)
        renderer = Renderer(tokenizer)
        renderer.prepare_thread()
        backplane.ended_listeners.append(renderer.forget_sessions)
        pipeline = TurnPipeline(backplane, renderer, parser, engine, config.default_max_tokens,
                                config.max_context_tokens)
        backplane.ended_listeners += [pipeline.history.forget_sessions, engine.forget_sessions]
        logger.info("worker %d ready: broker %s, engine %s", os.getpid(), config.broker_endpoint, config.engine.kind)
        try:
            yield {"pipeline": pipeline, "config": config, "counters": Counter()}
        finally:
            renderer.thread.shutdown(wait=False, cancel_futures=True)
            await backplane.drain(config.commit_drain_s)
            await backplane.close()
            await asyncio.wait_for(engine.aclose(), ENGINE_CLOSE_TIMEOUT_S)

    turn_routes = [Route(path, TurnEndpoint(adapter), methods=["POST"]) for path, adapter in TURN_ROUTES.items()]
    return GatewayApp(Starlette(
        routes=[
            *turn_routes,
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route(FINISH_PATH, finish_session, methods=["POST"]),  # 404 unless --allow-agent-finish
        ],
        lifespan=lifespan,
    ))


def create_app_from_env() -> GatewayApp:
    """uvicorn factory: the CLI put the WorkerConfig in the environment."""
    config = WorkerConfig.from_env()
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(process)d %(name)s %(message)s")
    tie_to_parent()  # a worker never outlives the process that started it
    return create_app(config)
