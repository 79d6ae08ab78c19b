"""ApiError: an HTTP error that the agent's own dialect renders (status, kind, message, code, param, headers).

Raised anywhere on a turn's path (adapters, the turn pipeline, the app) and rendered once, at the edge,
by the adapter of the request's dialect (`Adapter.error_body`), with its headers (e.g. `Retry-After`).
Imports nothing of the gateway.
"""

from __future__ import annotations

from collections.abc import Mapping

# The official SDKs sleep exactly a 503's Retry-After before their next attempt (openai's
# `_calculate_retry_timeout` honours 0 < value <= 120 s, anthropic's any positive value) and retry twice
# by default. The 503 comes only after the worker waited OPEN_TIMEOUT_S for the broker, by when a
# supervised broker (back after one restart backoff and its start-up) is usually up again: a short wait
# gets the agent's retry to it soon, and each retry's OPEN waits OPEN_TIMEOUT_S for the broker again, so
# a default SDK rides out an outage of about 2 * (BROKER_RETRY_AFTER_S + OPEN_TIMEOUT_S) + OPEN_TIMEOUT_S.
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
