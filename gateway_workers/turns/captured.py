"""What a turn carries along its path, and what a reply is sent from.

`TurnRequest` is what an agent asked for, in canonical form (the adapters make it of their wire body);
`PreparedTurn` is an OPENed, rendered turn about to go to the engine; `CapturedTurn` is a generated
turn waiting for its reply to be sent, then committed or aborted. A reply is sent from a `ReplySource`:
a whole `CapturedTurn`, or a `LiveReply` (`turns.live.LiveTurn` while the engine generates, or
`turns.replay.ReplayedLive`), and a retry's recorded turn is one too, replayed (it commits nothing).
Of the other turn modules it imports only `history` (the echo a linear turn commits with).
"""

from __future__ import annotations

from array import array
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from broker import protocol
from broker.message_keys import EchoDigest
from gateway_workers.capture.backplane import Backplane
from gateway_workers.engines.base import EngineResult, SamplingParams
from gateway_workers.formats import ParsedResponse
from gateway_workers.formats.parsed import LiveDelta
from gateway_workers.turns.history import echo_flag


def tool_call_id(prefix: str, turn_id: str, index: int) -> str:
    """The wire id of a reply's index-th tool call: derived from the turn, so a later request can name it."""
    return f"{prefix}{turn_id[:24]}_{index}"


@dataclass(frozen=True, slots=True)
class TurnRequest:
    """What an agent asked for, in canonical form (see `protocol.CommitTurn`)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    sampling: dict[str, Any] | None = None  # more of it (`engines.base.SHARED_SAMPLING`), as the engines take them


@dataclass(slots=True)
class CapturedTurn:
    """A generated turn waiting for its reply to be sent, then committed or aborted."""

    session_id: str
    turn_id: str
    request: TurnRequest
    prompt_ids: array  # int32, as rendered: no per-turn list copies on the hot path
    result: EngineResult
    parsed: ParsedResponse
    created: int
    timings: dict[str, float] = field(default_factory=dict)
    flags: dict[str, Any] = field(default_factory=dict)  # extra verdicts for the commit (e.g. stream_diverged)
    echo: EchoDigest | None = None  # a linear session's: its tools' digest, its messages counted (`turns.history`)
    replayed: bool = False  # a retry's reply, recorded before: it commits nothing (`turns.replay`)
    _backplane: Backplane | None = None
    _settled: bool = False

    @property
    def turn(self) -> CapturedTurn:
        """Itself: a whole reply's turn exists before it is sent (`ReplySource.turn`)."""
        return self

    @property
    def finish_reason(self) -> str:
        """stop | length | tool_calls, as the OpenAI dialect names it."""
        if self.result.finish_reason == "length":
            return "length"
        return "tool_calls" if self.parsed.tool_calls else "stop"

    def commit(self) -> None:
        if self._settled or self._backplane is None:
            return
        self._settled = True
        flags: dict[str, Any] = {"ill_formed": self.parsed.ill_formed, **self.flags}
        if self.parsed.error:
            flags["parse_error"] = self.parsed.error
        response = self.parsed.canonical_message()
        if self.echo is not None:  # a linear session's turn: the next request is matched against it
            flags["echo"] = echo_flag(self.echo, response)
        backplane = self._backplane
        backplane.commit_in_background(
            protocol.CommitTurn(
                request_id=backplane.request_id(),
                session_id=self.session_id,
                turn_id=self.turn_id,
                prompt_ids=self.prompt_ids,
                output_ids=array("i", self.result.output_ids),
                logprobs=array("f", self.result.logprobs),
                finish_reason=self.result.finish_reason,
                prompt_messages=[*self.request.messages],  # the wire type also admits packed bytes
                response_message=response,
                flags=flags,
                timings=self.timings,
            )
        )

    def abort(self, reason: str) -> None:
        if self._settled or self._backplane is None:
            return
        self._settled = True
        self._backplane.abort_in_background(self.session_id, self.turn_id, reason)

    async def close(self) -> None:
        """Nothing is left running once a whole reply exists (the live path holds an engine stream)."""


@dataclass(slots=True)
class PreparedTurn:
    """An OPENed, rendered turn about to go to the engine."""

    session_id: str
    turn_id: str
    request: TurnRequest
    prompt_ids: array
    prompt_text: str
    params: SamplingParams
    over_budget: bool
    t0: float
    t_render: float
    flags: dict[str, Any] = field(default_factory=dict)  # verdicts of the prompt, committed with the turn
    echo: EchoDigest | None = None  # a linear session's: its tools' digest, its messages counted
    replica: str = ""  # the engine replica the broker routes the session to ("": the engine's own choice)


class ReplySource(Protocol):
    """What a reply is sent from, and settled by once it was sent (commit) or not (abort)."""

    session_id: str
    turn_id: str
    replayed: bool  # recorded before: commit and abort do nothing

    @property
    def turn(self) -> CapturedTurn | None:
        """The whole turn, once it exists (a live one's when the engine finished)."""

    def commit(self) -> None: ...

    def abort(self, reason: str) -> None: ...

    async def close(self) -> None: ...


class LiveReply(ReplySource, Protocol):
    """A reply streamed as deltas: what the adapters read to write their events."""

    prompt_ids: array
    created: int

    def deltas(self) -> AsyncIterator[LiveDelta]: ...
