"""A worker's routes that are not turns: the model list, health, metrics, and unknown routes in the API's shape.

Starlette routes reading the worker's lifespan state (`request.state`: config, metrics, snapshot, pipeline).
`GET /metrics` asks the broker, which sums every worker's counts; `GET /metrics/worker` is this one's own.
A 404 or 405 answers in OpenAI's error shape (Anthropic's under `/v1/messages`), so an agent's SDK reads it.
Imports the adapters' error shapes and the backplane's error only.
"""

from __future__ import annotations

import os

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from gateway_workers.adapters import anthropic_messages, openai_chat
from gateway_workers.capture.backplane import BrokerUnavailable
from gateway_workers.http.errors import ApiError

METRICS_TIMEOUT_S = 2.0  # a scrape waits this long for the broker, which aggregates every worker's metrics
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


async def models(request: Request) -> Response:
    name = request.state.config.model_name
    return JSONResponse({"object": "list",
                         "data": [{"id": name, "object": "model", "created": 0, "owned_by": "rollout-gateway"}]})


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok", "pid": os.getpid()})


async def metrics(request: Request) -> Response:
    """The whole gateway's metrics (Prometheus text), from the broker, which sums every worker's; this
    worker's counts are sent along, so they are current, the others' are as of their last heartbeat."""
    pipeline = request.state.pipeline
    snapshot = request.state.snapshot()
    try:
        text = await pipeline.backplane.metrics_text(snapshot, METRICS_TIMEOUT_S)
    except BrokerUnavailable:
        return PlainTextResponse("the broker, which aggregates the gateway's metrics, did not answer; this "
                                 "worker's own counts: GET /metrics/worker\n", status_code=503)
    return Response(text, media_type=PROMETHEUS_TEXT)


async def worker_metrics(request: Request) -> Response:
    """This worker's own snapshot (what its heartbeats carry), as JSON: for looking at one process."""
    return JSONResponse(request.state.snapshot())


async def unknown_route(request: Request, exc: Exception) -> Response:
    """404 and 405 in the API's own shape (Anthropic's under /v1/messages, OpenAI's elsewhere): an agent's SDK
    reads it, and the log line says which route it asked for."""
    status = getattr(exc, "status_code", 404)
    what = "Unknown request URL" if status == 404 else "Method not allowed for"
    error = ApiError(status, "not_found" if status == 404 else "invalid_request",
                     f"{what}: {request.method} {request.url.path}.", code="unknown_url" if status == 404 else None)
    adapter = anthropic_messages if request.url.path.startswith("/v1/messages") else openai_chat
    request.state.metrics.count("http_errors", ("other", str(status), error.code or error.kind))
    return JSONResponse(adapter.error_body(error), status_code=status, headers=getattr(exc, "headers", None))
