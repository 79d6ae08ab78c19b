"""One log line per answered request: always (at warning) for a 4xx or 5xx, and for every request with --access-log.

A refused or failed request's line says why, in the API's own terms: route, status, the session's tag (never its
key), the error's type, code and param, the latency and the message, so an operator sees why an agent stopped.
A failure of ours was also logged with its cause where it happened; this line is its summary. The lines go to
the `rollout_gateway.access` logger, at info for the others, which `enable` turns on. Imports nothing of the
gateway but `broker.protocol`'s session tag.
"""

from __future__ import annotations

import logging
import time

from broker.protocol import session_tag
from gateway_workers.http.errors import ApiError

logger = logging.getLogger("rollout_gateway.access")
_MESSAGE_CHARS = 500  # an error message may quote what the agent sent: a line stays a line


def enable(on: bool, log_level: str = "info") -> None:
    """--access-log: a line for every request (at info), not only for errors (at warning, or above as the
    process's --log-level says)."""
    level = logging.getLevelName(log_level.upper())
    logger.setLevel(logging.INFO if on else max(logging.WARNING, level if isinstance(level, int) else 0))


def _tag(sid: str | None) -> str:
    return session_tag(sid) if sid else "-"


def served(method: str, path: str, status: int, started: float, sid: str | None = None, stream: str = "",
           outcome: str = "") -> None:
    """A request answered without an error (logged with --access-log only); a turn's says whether it streamed
    and what became of it (committed, replayed, aborted)."""
    if logger.isEnabledFor(logging.INFO):
        detail = f" stream={stream} {outcome}" if outcome else ""
        logger.info("%s %s %d session=%s %.1f ms%s", method, path, status, _tag(sid),
                    (time.perf_counter() - started) * 1000, detail)


def refused(method: str, path: str, error: ApiError, error_type: str, started: float, sid: str | None = None,
            detail: str = "") -> None:
    """A request answered with a 4xx or 5xx (`detail`: e.g. that the stream had begun)."""
    message = error.message if len(error.message) <= _MESSAGE_CHARS else error.message[:_MESSAGE_CHARS] + "..."
    logger.warning("%s %s %d session=%s type=%s code=%s param=%s %.1f ms%s: %s", method, path, error.status,
                   _tag(sid), error_type, error.code, error.param, (time.perf_counter() - started) * 1000,
                   f" ({detail})" if detail else "", message)


def answered(method: str, path: str, status: int, started: float) -> None:
    """A request answered by a route that says nothing more (an unknown path, a health check)."""
    if status >= 400:
        logger.warning("%s %s %d session=- %.1f ms", method, path, status, (time.perf_counter() - started) * 1000)
    else:
        served(method, path, status, started)
