"""The adapter seam: what every wire dialect provides to the one turn handler (`app.serve_turn`).

An adapter is a module (`openai_chat`, `anthropic_messages`, `openai_responses`) that satisfies `Adapter`:
it parses its dialect's body into a request carrying a canonical `TurnRequest`, completes it with any
earlier turns it names (only Responses' `previous_response_id` does), and renders a finished turn, a live
stream or an `ApiError` in its own wire shape. Pure translation: no I/O but the pipeline call in
`load_history`; must not import the app.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, TypeVar

from gateway_workers.http.errors import ApiError
from gateway_workers.http.limits import RequestLimits
from gateway_workers.turns.captured import CapturedTurn, LiveReply, TurnRequest
from gateway_workers.turns.pipeline import TurnPipeline


class ParsedRequest(Protocol):
    """A dialect's validated request: the canonical turn and whether the agent asked for a stream."""

    @property
    def turn(self) -> TurnRequest: ...

    @property
    def stream(self) -> bool: ...

    @property
    def ignored(self) -> tuple[str, ...]:
        """The ignored fields it carried (at the top level, or in what it adds to the session's previous request),
        by their place's name (`request_fields`)."""
        ...

    @property
    def hosted(self) -> tuple[tuple[str, str], ...]:
        """(param, type) of each hosted tool it declared, left out of the prompt."""
        ...


RequestT = TypeVar("RequestT", bound=ParsedRequest)


class Adapter(Protocol[RequestT]):
    """One wire dialect, as `app.serve_turn` drives it."""

    # The body's field that holds the conversation: an array an agent's next request extends at its end
    # (`http.bodies` decodes only what it adds).
    HISTORY_FIELD: str

    def parse_request(self, body: Any, limits: RequestLimits = ..., earlier: RequestT | None = None, /) -> RequestT:
        """The validated request within `limits`, or an ApiError (400) naming the field. `earlier`: the session's
        previous request parsed here, whose canonical messages this one takes for the elements of its
        conversation that are that request's own objects (`http.bodies`), converting only what follows; the
        same request as a parse without it."""
        ...

    async def load_history(self, request: RequestT, session_id: str, pipeline: TurnPipeline, /) -> RequestT:
        """The request with the earlier turns it names prepended (the broker holds them), else as it is."""
        ...

    def response_body(self, turn: CapturedTurn, request: RequestT, model: str, /) -> bytes:
        """The whole reply's JSON body."""
        ...

    def stream_events(self, live: LiveReply, request: RequestT, model: str, /) -> AsyncIterator[bytes]:
        """The reply's SSE events while the engine generates (an error event, then ApiError, if it fails)."""
        ...

    def error_body(self, error: ApiError, /) -> dict[str, Any]:
        """The dialect's error JSON for an ApiError."""
        ...


async def no_history(request: RequestT, session_id: str, pipeline: TurnPipeline) -> RequestT:
    """`Adapter.load_history` for dialects whose requests carry their whole conversation."""
    return request
