"""ApiError: an HTTP error that the agent's own dialect renders (status, kind, message, code, param).

Raised anywhere on a turn's path (adapters, the turn pipeline, the app) and rendered once, at the edge,
by the adapter of the request's dialect (`Adapter.error_body`). Imports nothing of the gateway.
"""

from __future__ import annotations


class ApiError(Exception):
    """An HTTP error an adapter renders in its API's shape.

    `kind` is one of: invalid_request, authentication, permission, not_found,
    rate_limit, engine, timeout, unavailable, internal.
    """

    def __init__(self, status: int, kind: str, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message
        self.code = code
        self.param = param
