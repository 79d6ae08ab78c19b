"""The Starlette app of one gateway worker: routes, lifespan, and the reply-then-commit rule.

The lifespan builds this process's tokenizer, renderer, parser, engine client and
backplane socket (never at import, never in the uvicorn parent) and closes them with
bounded waits. Every dialect (Chat Completions, Anthropic Messages, Responses) goes
through one handler and one `CapturedReply`, which sends the reply (one body, or SSE
events while the engine generates) and only then commits the turn; a reply that did not
reach the agent aborts it, and a stream the agent left stops the engine. uvicorn starts
workers through `create_app_from_env` (factory=True), which reads the CLI's WorkerConfig.
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
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway_workers.adapters import anthropic_messages, openai_chat, openai_responses
from gateway_workers.backplane import Backplane
from gateway_workers.config import WorkerConfig
from gateway_workers.engines import create_engine
from gateway_workers.finish_route import FINISH_PATH, finish_session
from gateway_workers.formats import PLAIN_TEXT, detect_parser
from gateway_workers.live import start_live_turn
from gateway_workers.render import Renderer
from gateway_workers.tokenizer import load_tokenizer
from gateway_workers.turns import ApiError, TurnPipeline

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


def session_key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return request.headers.get("x-api-key") or None


class DisconnectWatcher:
    """Sets `gone` when the agent's connection drops; runs until the reply is sent."""

    def __init__(self, request: Request) -> None:
        self.gone = asyncio.Event()
        self._task = asyncio.ensure_future(self._watch(request))

    async def _watch(self, request: Request) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                self.gone.set()
                return

    def stop(self) -> None:
        self._task.cancel()


async def _once(body: bytes) -> AsyncIterator[bytes]:
    yield body


class CapturedReply(Response):
    """Sends a turn's reply, one body or SSE events as they are produced, then commits the turn.

    uvicorn's `send` silently drops data once the client is gone, so the watcher is checked
    before every chunk, and a disconnect cancels the sending (and with it the engine stream).
    A turn whose reply the agent did not get entirely is aborted, never trained on. An
    `ApiError` from the body (the engine failed mid-stream, after the adapter sent its error
    event) ends the stream and aborts the turn.
    """

    def __init__(self, source: ReplySource, body: AsyncIterator[bytes], media_type: str, watcher: DisconnectWatcher,
                 counters: Counter[str], length: int | None = None) -> None:
        self.status_code = 200
        self.background = None
        self.source = source
        self.body_iterator = body
        self.watcher = watcher
        self.counters = counters
        if media_type == "text/event-stream":
            self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        else:
            self.raw_headers = [(b"content-type", media_type.encode())]
            if length is not None:
                self.raw_headers.append((b"content-length", str(length).encode()))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sender = asyncio.ensure_future(self._send_all(send))
        gone = asyncio.ensure_future(self.watcher.gone.wait())
        sent = False
        try:
            await asyncio.wait({sender, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            self.watcher.stop()
            if not sender.done():
                sender.cancel()  # the agent left mid-reply: stop generating and sending
            try:
                sent = await sender
            except asyncio.CancelledError:
                pass
            except ApiError as e:
                self.counters[f"stream_{e.status}"] += 1
            except Exception:
                logger.exception("sending the reply of turn %s (session %s) failed", self.source.turn_id,
                                 self.source.session_id)
            await self._settle(sent)

    async def _send_all(self, send: Send) -> bool:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for chunk in self.body_iterator:
                if self.watcher.gone.is_set():
                    return False
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except ApiError:
            # The adapter already sent the error event; end the stream so the agent is not left waiting.
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            raise
        if self.watcher.gone.is_set():
            return False
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True

    async def _settle(self, sent: bool) -> None:
        aclose = getattr(self.body_iterator, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
        await self.source.close()
        if sent:
            self.source.commit()
            self.counters["turns_committed"] += 1
        else:
            self.source.abort("client disconnected before the reply was sent")
            self.counters["turns_aborted"] += 1


def _error(adapter: Any, error: ApiError, counters: Counter[str]) -> Response:
    counters[f"http_{error.status}"] += 1
    if error.status >= 500:
        logger.error("turn failed with %d: %s", error.status, error.message)
    return Response(orjson.dumps(adapter.error_body(error)), status_code=error.status, media_type="application/json")


async def _body(request: Request) -> Any:
    try:
        return orjson.loads(await request.body())
    except orjson.JSONDecodeError as e:
        raise ApiError(400, "invalid_request", f"the body is not valid JSON: {e}") from None


def _key(request: Request) -> str:
    sid = session_key(request)
    if sid is None:
        raise ApiError(401, "authentication", "missing API key (the session key)", code="invalid_api_key")
    return sid


async def _with_history(pipeline: TurnPipeline, sid: str, parsed: Any) -> Any:
    """A Responses request naming `previous_response_id`: prepend that turn's messages (from the broker)."""
    if getattr(parsed, "previous_turn_id", None) is None:
        return parsed
    try:
        found = await pipeline.get_turn(sid, parsed.previous_turn_id)
    except ApiError as e:
        if e.code in ("unknown_turn", "turn_pending"):
            raise ApiError(400, "invalid_request", f"previous_response_id {parsed.previous_response_id!r} is not a "
                           "committed response of this session", code=e.code, param="previous_response_id") from None
        raise
    return openai_responses.with_history(parsed, found)


def _check_tools_parseable(parser: Any, tools: Any) -> None:
    """A request that declares tools needs a parser that can find tool calls: else a 400, never a silent guess."""
    if not tools or getattr(parser, "supports_tools", True):
        return
    name = getattr(parser, "format_name", "?")
    if name == PLAIN_TEXT:
        reason = ("this gateway serves plain text only: the model's chat template is not recognized "
                  "(--allow-plain-text), so tool calls in its replies could not be parsed; restart it with "
                  "--response-format NAME to use tools")
    else:
        reason = f"the model's response format {name!r} has no tool calls; send the request without tools"
    raise ApiError(400, "invalid_request", reason, code="tools_unsupported", param="tools")


async def serve_turn(request: Request, adapter: Any) -> Response:
    """One turn in any dialect: validate, run (live when streaming), reply, commit."""
    state = request.state
    counters: Counter[str] = state.counters
    counters["requests"] += 1
    try:
        sid = _key(request)
        parsed = adapter.parse_request(await _body(request))
        parsed = await _with_history(state.pipeline, sid, parsed)
        _check_tools_parseable(state.pipeline.parser, parsed.turn.tools)
    except ApiError as e:
        return _error(adapter, e, counters)
    watcher = DisconnectWatcher(request)
    model = state.config.model_name
    try:
        if parsed.stream:
            live = await start_live_turn(state.pipeline, sid, parsed.turn, watcher.gone)
            return CapturedReply(live, adapter.stream_events(live, parsed, model), "text/event-stream", watcher,
                                 counters)
        turn = await state.pipeline.run(sid, parsed.turn, watcher.gone)
    except ApiError as e:
        watcher.stop()
        return _error(adapter, e, counters)
    except Exception:
        watcher.stop()
        logger.exception("turn of session %s failed", sid)
        return _error(adapter, ApiError(500, "internal", "internal error in the gateway worker"), counters)
    body = adapter.response_body(turn, parsed, model)
    return CapturedReply(turn, _once(body), "application/json", watcher, counters, length=len(body))


async def chat_completions(request: Request) -> Response:
    return await serve_turn(request, openai_chat)


async def messages(request: Request) -> Response:
    return await serve_turn(request, anthropic_messages)


async def responses(request: Request) -> Response:
    return await serve_turn(request, openai_responses)


async def count_tokens(request: Request) -> Response:
    """Anthropic's token counting: the prompt rendered exactly as a turn would be; records nothing."""
    state = request.state
    try:
        sid = _key(request)
        parsed = anthropic_messages.parse_request(await _body(request), counting=True)
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
    counters.update({"render_cache_hits": cache.hits, "render_cache_misses": cache.misses})
    pid = os.getpid()
    lines = [f'rollout_gateway_{name}_total{{pid="{pid}"}} {value}' for name, value in sorted(counters.items())]
    # 1 while new prompt text is encoded by the tiktoken twin (0: never had one, or it diverged and was dropped)
    lines.append(f'rollout_gateway_render_bpe_twin{{pid="{pid}"}} {int(pipeline.renderer.bpe_twin)}')
    return PlainTextResponse("\n".join(lines) + "\n")


def create_app(config: WorkerConfig) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[WorkerState]:
        tokenizer = load_tokenizer(config.tokenizer, chat_template_path=config.chat_template)
        engine = create_engine(config.engine, tokenizer)
        backplane = Backplane(config.broker_endpoint)
        backplane.start()
        # The CLI ran the same decision before spawning us; an unknown template fails here only if it did not.
        parser = detect_parser(tokenizer, config.response_format, config.allow_plain_text)
        pipeline = TurnPipeline(backplane, Renderer(tokenizer), parser, engine, config.default_max_tokens)
        logger.info("worker %d ready: broker %s, engine %s", os.getpid(), config.broker_endpoint, config.engine.kind)
        try:
            yield {"pipeline": pipeline, "config": config, "counters": Counter()}
        finally:
            await backplane.drain(config.commit_drain_s)
            await backplane.close()
            await asyncio.wait_for(engine.aclose(), ENGINE_CLOSE_TIMEOUT_S)

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
            Route("/v1/responses", responses, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route(FINISH_PATH, finish_session, methods=["POST"]),  # 404 unless --allow-agent-finish
        ],
        lifespan=lifespan,
    )


def create_app_from_env() -> Starlette:
    """uvicorn factory: the CLI put the WorkerConfig in the environment."""
    config = WorkerConfig.from_env()
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(process)d %(name)s %(message)s")
    return create_app(config)
