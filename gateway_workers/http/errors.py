"""ApiError: an HTTP error that the agent's own dialect renders (status, kind, message, code, param, headers).

Raised anywhere on a turn's path (adapters, the turn pipeline, the app) and rendered once, at the edge,
by the adapter of the request's dialect (`Adapter.error_body`), with its headers (e.g. `Retry-After`).
Imports nothing of the gateway.
"""

from __future__ import annotations

from collections.abc import Mapping

# The official SDKs sleep exactly a 503's Retry-After before their next attempt (openai's
# `_calculate_retry_timeout` honours 0 < value <= 120 s, anthropic's any positive value) and retry twice
# by default. A turn's 503 comes only after its worker held the request for the broker (resending its OPEN)
# through --pause-hold-s, so a supervised broker's restart never reaches the agent; a GET or FINISH's after
# the backplane's CALL_TIMEOUT_S. Either way a short wait gets the agent's retry to the broker soon once it is back.
BROKER_RETRY_AFTER_S = 1


class ApiError(Exception):
    """An HTTP error an adapter renders in its API's shape; `headers` go with the response.

    `kind` is one of: invalid_request, authentication, permission, not_found,
    rate_limit, engine, timeout, unavailable, internal.
    """

    def __init__(
        self,
        status: int,
        kind: str,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message
        self.code = code
        self.param = param
        self.headers: dict[str, str] = dict(headers or {})


def broker_unavailable() -> ApiError:
    """The 503 for a broker that did not answer in time: retryable, with Retry-After."""
    return ApiError(503, "unavailable", "the capture broker is unavailable; retry later",
                    headers={"retry-after": str(BROKER_RETRY_AFTER_S)})
