"""Named errors of the trainer client; each docstring says what the caller should do.

`TrainerClient` turns socket timeouts, undecodable replies and every `Refused` code
from the broker into one of these (`error_for_refusal`). Stdlib only: importing this
module loads neither zmq nor any asyncio-based code.
"""

from __future__ import annotations

from typing import Any


class GatewayError(Exception):
    """Base of every trainer-client error. `code` is the broker's refusal code, if there was one."""

    code: str | None = None

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class BrokerTimeout(GatewayError, TimeoutError):
    """No reply within the deadline: the broker is down, overloaded or unreachable.

    The client has already reset its socket. Retrying is safe for `stats` and
    `drop_session`; for `open_session` pass your own `session_id` so a retry can be
    recognised (`DuplicateSession` then means the first attempt did register it).
    """


class BrokerDisconnected(BrokerTimeout):
    """The connection to the broker ended while the call waited for its reply (the broker crashed or restarted,
    or the network dropped): the call may or may not have taken effect. Raised at once, not after the timeout.

    Retry it. The calls the broker recognises when repeated are resent by the client itself once it is
    connected again (`stats`, `drop_session`, `finish_session`, `request_finish`, `open_session` with your
    own `session_id`, the episode stream's steps); they raise this only when no broker answers again within
    their timeout. `open_session()` without `session_id` raises it at once: a session may have been opened
    that nobody will use (it holds nothing until dropped). Pass your own `session_id` to let the client
    resend the call itself.
    """


class UnknownSession(GatewayError, KeyError):
    """The broker has no such session (never opened, dropped, or lost in a broker restart).

    Do not retry with the same id; open a new session and rerun the episode.
    """

    code = "unknown_session"

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class SessionClosed(GatewayError):
    """The session was already finished (or a finish is in progress): its rows went to that finish.

    A session finishes exactly once, whichever way comes first: `finish_session`, `request_finish`
    or the agent's `POST /rollout/v1/sessions/finish`; the message says which one it was. Do not
    retry; with `request_finish` / agent finishes, the episode arrives on `episodes()`.
    """

    code = "session_closed"


class DuplicateSession(GatewayError):
    """`open_session` with a `session_id` that is already open. Pick another id, or reuse the open session."""

    code = "duplicate_session"


class InvalidRequest(GatewayError, ValueError):
    """The broker refused the arguments (e.g. a non-positive max_turns). Fix the call; retrying will not help."""

    code = "bad_request"


class BrokerBusy(GatewayError):
    """The broker is at a capacity limit: max_sessions, or a full episode outbox for `request_finish`.

    Finish or drop sessions, or consume (acknowledge) episodes, then retry: a refused request
    changed nothing (a session whose finish was refused is still open).
    """

    code = "busy"


class EpisodeTimeout(GatewayError, TimeoutError):
    """No episode arrived within the episode stream's `timeout` (the broker did answer).

    Nothing matching your filters finished in time. The stream is still usable: call `next()`
    again to keep waiting, or check that sessions are being finished (and with your group).
    """


class ProtocolMismatch(GatewayError):
    """Broker and client do not speak the same protocol (or something else answered on the endpoint).

    Run the same rollout-gateway release everywhere and check the endpoint.
    """


class AuthenticationFailed(GatewayError):
    """The broker refused this client's CURVE handshake (its key is not authorized there, or `broker.key` is not
    that broker's, or the broker runs without CURVE, or it requires CURVE and this client has no keys). The message
    says which.

    Fix the key directory (`curve_keys`) or the broker's `authorized_trainers/`; retrying as is will not help.
    """


class PauseTimeout(GatewayError, TimeoutError):
    """`pause_generation` ran out of time before every worker went idle; `report` says what was still running.
    The pause stays in force: call `pause_generation` again to wait longer, or `resume_generation`. (Also raised
    when another caller's `resume_generation` ended the pause first.)"""

    def __init__(self, message: str, report: Any) -> None:
        super().__init__(message, "pause_timeout")
        self.report = report


class BrokerError(GatewayError):
    """The broker failed on its own side (its log has the cause). Report it; the session may be lost."""

    code = "internal"


_BY_CODE: dict[str, type[GatewayError]] = {
    "unknown_session": UnknownSession,
    "session_closed": SessionClosed,
    "duplicate_session": DuplicateSession,
    "bad_request": InvalidRequest,
    "busy": BrokerBusy,
    "protocol": ProtocolMismatch,
    "version_mismatch": ProtocolMismatch,
    "internal": BrokerError,
}


def error_for_refusal(code: str, message: str) -> GatewayError:
    """The named error for a broker `Refused(code, message)`; unknown codes become `BrokerError`."""
    cls = _BY_CODE.get(code, BrokerError)
    return cls(f"broker refused ({code}): {message}", code)
