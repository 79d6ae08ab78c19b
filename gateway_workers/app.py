"""The Starlette app of one gateway worker: routes, lifespan, and the reply-then-commit rule.

The lifespan builds this process's tokenizer, renderer, parser, engine client and
backplane socket (never at import, never in the uvicorn parent) and closes them with
bounded waits. `CapturedReply` sends a turn's reply and only then commits it; a reply
that did not reach the agent aborts the turn. uvicorn starts workers through
`create_app_from_env` (factory=True), which reads the CLI's WorkerConfig.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any, TypedDict

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway_workers.adapters import openai_chat
from gateway_workers.backplane import Backplane
from gateway_workers.config import WorkerConfig
from gateway_workers.engines import create_engine
from gateway_workers.parsing import detect_parser
from gateway_workers.render import Renderer
from gateway_workers.tokenizer import load_tokenizer
from gateway_workers.turns import ApiError, CapturedTurn, TurnPipeline

logger = logging.getLogger(__name__)

ENGINE_CLOSE_TIMEOUT_S = 5.0


class WorkerState(TypedDict):
    pipeline: TurnPipeline
    config: WorkerConfig
    counters: Counter[str]


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


class CapturedReply(Response):
    """Sends a turn's reply as one body or as SSE events, then commits the turn.

    uvicorn's `send` silently drops data once the client is gone, so the last check of
    the watcher happens right before the final chunk: a turn whose reply the agent did
    not get is aborted, never trained on.
    """

    def __init__(self, turn: CapturedTurn, chunks: list[bytes], media_type: str, watcher: DisconnectWatcher,
                 counters: Counter[str]) -> None:
        self.status_code = 200
        self.background = None
        self.turn = turn
        self.chunks = chunks
        self.watcher = watcher
        self.counters = counters
        if media_type == "text/event-stream":
            self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        else:
            length = str(sum(len(c) for c in chunks)).encode()
            self.raw_headers = [(b"content-type", media_type.encode()), (b"content-length", length)]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sent = False
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            last = len(self.chunks) - 1
            for i, chunk in enumerate(self.chunks):
                if self.watcher.gone.is_set():
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": i < last})
            else:
                sent = True
        finally:
            self.watcher.stop()
            if sent:
                self.turn.commit()
                self.counters["turns_committed"] += 1
            else:
                self.turn.abort("client disconnected before the reply was sent")
                self.counters["turns_aborted"] += 1


def _error(adapter: Any, error: ApiError, counters: Counter[str]) -> Response:
    counters[f"http_{error.status}"] += 1
    if error.status >= 500:
        logger.error("turn failed with %d: %s", error.status, error.message)
    return Response(orjson.dumps(adapter.error_body(error)), status_code=error.status, media_type="application/json")


async def chat_completions(request: Request) -> Response:
    state = request.state
    counters: Counter[str] = state.counters
    counters["requests"] += 1
    sid = session_key(request)
    if sid is None:
        return _error(openai_chat, ApiError(401, "authentication", "missing API key (the session key)",
                                            code="invalid_api_key"), counters)
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as e:
        return _error(openai_chat, ApiError(400, "invalid_request", f"the body is not valid JSON: {e}"), counters)
    watcher = DisconnectWatcher(request)
    try:
        chat = openai_chat.parse_request(body)
        turn = await state.pipeline.run(sid, chat.turn, watcher.gone)
    except ApiError as e:
        watcher.stop()
        return _error(openai_chat, e, counters)
    except Exception:
        watcher.stop()
        logger.exception("turn of session %s failed", sid)
        return _error(openai_chat, ApiError(500, "internal", "internal error in the gateway worker"), counters)
    model = state.config.model_name
    if chat.stream:
        return CapturedReply(turn, openai_chat.stream_events(turn, model, chat.include_usage), "text/event-stream",
                             watcher, counters)
    return CapturedReply(turn, [openai_chat.response_body(turn, model)], "application/json", watcher, counters)


async def models(request: Request) -> Response:
    name = request.state.config.model_name
    return JSONResponse({"object": "list",
                         "data": [{"id": name, "object": "model", "created": 0, "owned_by": "rollout-gateway"}]})


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok", "pid": os.getpid()})


async def metrics(request: Request) -> Response:
    counters: Counter[str] = request.state.counters
    lines = [f'rollout_gateway_{name}_total{{pid="{os.getpid()}"}} {value}' for name, value in sorted(counters.items())]
    return PlainTextResponse("\n".join(lines) + "\n")


def create_app(config: WorkerConfig) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[WorkerState]:
        tokenizer = load_tokenizer(config.tokenizer, chat_template_path=config.chat_template)
        engine = create_engine(config.engine, tokenizer)
        backplane = Backplane(config.broker_endpoint)
        backplane.start()
        pipeline = TurnPipeline(backplane, Renderer(tokenizer), detect_parser(tokenizer), engine,
                                config.default_max_tokens)
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
            Route("/v1/models", models, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        lifespan=lifespan,
    )


def create_app_from_env() -> Starlette:
    """uvicorn factory: the CLI put the WorkerConfig in the environment."""
    config = WorkerConfig.from_env()
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(process)d %(name)s %(message)s")
    return create_app(config)
