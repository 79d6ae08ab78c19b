"""Agent-side finish: `POST /rollout/v1/sessions/finish`, for harnesses that score their own episodes.

Authenticated by the session key like every turn (`Authorization: Bearer <key>` or
`x-api-key`); the JSON body carries `reward` (number or null), `metadata` (object) and an
optional `rollout_id`. The worker forwards it to the broker as a `RequestFinish` (through
backplane.py) and answers as soon as the broker accepted it; the episode then reaches the
trainer's `episodes()` stream. Off unless the gateway runs with `--allow-agent-finish` (then
404). Errors use the OpenAI error shape. Imports starlette, orjson and `gateway_workers` only.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from broker.protocol import session_tag
from gateway_workers.adapters import openai_chat
from gateway_workers.capture.backplane import BrokerUnavailable, TurnRefused
from gateway_workers.http import access_log
from gateway_workers.http.connection import session_key
from gateway_workers.http.errors import ApiError, broker_unavailable
from gateway_workers.http.limits import read_body
from gateway_workers.metrics import WorkerMetrics

logger = logging.getLogger(__name__)

FINISH_PATH = "/rollout/v1/sessions/finish"
# In-flight turns of the session (e.g. a sub-agent still generating) get this long to land.
AGENT_FINISH_WAIT_S = 10.0
# A busy broker (full episode outbox) is worth retrying after about this long.
BUSY_RETRY_AFTER_S = 1
_FIELDS = {"reward", "metadata", "rollout_id"}
_MAX_ROLLOUT_ID_LEN = 256

# Broker refusal -> (status, kind, code). A session that already finished is 410 Gone: final,
# and not retried by the official SDKs (they retry 408, 409, 429 and 5xx by themselves).
_REFUSALS = {
    "session_closed": (410, "invalid_request", "session_finished"),
    "unknown_session": (401, "authentication", "invalid_api_key"),
    "busy": (503, "unavailable", "outbox_full"),
    "bad_request": (400, "invalid_request", None),
}


def _error(error: ApiError, metrics: WorkerMetrics, started: float, sid: str | None = None) -> Response:
    metrics.count("http_errors", ("finish", str(error.status), error.code or error.kind))
    if error.status >= 500:
        logger.error("agent finish failed with %d: %s", error.status, error.message)
    body = openai_chat.error_body(error)
    access_log.refused("POST", FINISH_PATH, error, body["error"]["type"], started, sid)
    return Response(orjson.dumps(body), status_code=error.status, media_type="application/json", headers=error.headers)


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, "invalid_request", message, param=param)


def parse_finish_body(raw: bytes) -> tuple[float | None, str | None, dict[str, Any]]:
    """(reward, rollout_id, metadata) from the request body; ApiError 400 on anything else."""
    try:
        body = orjson.loads(raw) if raw.strip() else {}
    except orjson.JSONDecodeError as e:
        raise _bad(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise _bad(f"unknown field(s) {unknown}; expected some of {sorted(_FIELDS)}", unknown[0])
    reward = body.get("reward")
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise _bad("reward must be a finite number or null", "reward")
        reward = float(reward)
    rollout_id = body.get("rollout_id")
    if isinstance(rollout_id, int) and not isinstance(rollout_id, bool):
        rollout_id = str(rollout_id)
    if rollout_id is not None and not (isinstance(rollout_id, str) and len(rollout_id) <= _MAX_ROLLOUT_ID_LEN):
        raise _bad(f"rollout_id must be a string of at most {_MAX_ROLLOUT_ID_LEN} characters", "rollout_id")
    metadata = body.get("metadata", {})
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise _bad("metadata must be a JSON object", "metadata")
    return reward, rollout_id, metadata


async def finish_session(request: Request) -> Response:
    """Finish the caller's session with its reward; the episode goes to the trainer's episode stream."""
    state = request.state
    metrics: WorkerMetrics = state.metrics
    started = time.perf_counter()
    if not state.config.allow_agent_finish:
        return _error(
            ApiError(
                404,
                "not_found",
                "agent-side finish is disabled on this gateway (the trainer finishes sessions); "
                "start it with --allow-agent-finish to enable it",
            ),
            metrics,
            started,
        )
    sid = session_key(request.headers)
    if sid is None:
        return _error(ApiError(401, "authentication", "missing API key (the session key)", "invalid_api_key"), metrics,
                      started)
    try:
        body = await read_body(request.headers.get("content-length"), request.receive, state.config.limits)
        reward, rollout_id, metadata = parse_finish_body(body)
    except ApiError as e:
        return _error(e, metrics, started, sid)
    try:
        await state.pipeline.backplane.request_finish(sid, reward, rollout_id, metadata, AGENT_FINISH_WAIT_S)
    except TurnRefused as e:
        status, kind, code = _REFUSALS.get(e.code, (400, "invalid_request", e.code))
        message = e.message
        if status == 410:
            message = f"{e.message}; a session finishes once, and its episode went to that finish"
        headers = {"retry-after": str(BUSY_RETRY_AFTER_S)} if status == 503 else None
        return _error(ApiError(status, kind, message, code, headers=headers), metrics, started, sid)
    except BrokerUnavailable as e:
        logger.error("agent finish of session %s: %s", session_tag(sid), e)
        return _error(broker_unavailable(), metrics, started, sid)
    metrics.count("agent_finishes")
    access_log.served("POST", FINISH_PATH, 200, started, sid)
    return JSONResponse({"object": "rollout.session.finish", "status": "accepted"})
