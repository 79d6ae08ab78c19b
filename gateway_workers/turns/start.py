"""A turn's one path, from an accepted request to the source its reply is sent from.

1. `TurnPipeline.prepare`: OPEN the turn at the broker and render its prompt (a linear session's from its
   history, `turns.history`), within the context budget the OPEN tells. Refusals, a template's rejection, a
   broker out of reach and an agent that left meanwhile are ApiErrors here, the turn aborted.
2. A retry of a request whose turn is recorded comes back from the OPEN as the broker's `TurnReplayed`: the
   reply is that turn again (`turns.replay`), whole or streamed, and nothing new is recorded.
3. Otherwise the engine samples it: whole (`TurnPipeline.run`: engine, then the parse into reasoning, text
   and tool calls), or live (`turns.live`: deltas while the engine generates, the same parse at its end).

The app then sends the reply from what this returns and settles it: commit once the reply reached the agent,
abort otherwise (`captured.ReplySource`).
"""

from __future__ import annotations

import asyncio

from broker import protocol
from gateway_workers.http.connection import AgentConnection
from gateway_workers.http.errors import ApiError
from gateway_workers.turns.captured import ReplySource, TurnRequest
from gateway_workers.turns.live import start_live_turn
from gateway_workers.turns.pipeline import TurnPipeline
from gateway_workers.turns.replay import ReplayedLive, RetryKey, replayed_turn


async def start_turn(
    pipeline: TurnPipeline, session_id: str, request: TurnRequest, connection: AgentConnection,
    key: RetryKey | None, live: bool,
) -> ReplySource:
    """The reply source of one turn: a `LiveReply` when `live`, else a whole `CapturedTurn`; raises ApiError."""
    try:
        # An OPEN is held while the broker is away (up to --pause-hold-s): an agent that leaves meanwhile ends it.
        with connection.cancelled_on_disconnect():
            prepared = await pipeline.prepare(session_id, request, key)
    except asyncio.CancelledError:
        if connection.took_cancel():
            raise ApiError(499, "invalid_request", "client disconnected") from None
        raise
    if isinstance(prepared, protocol.TurnReplayed):
        turn = replayed_turn(session_id, request, prepared)
        return ReplayedLive(turn) if live else turn
    if live:
        return await start_live_turn(pipeline, prepared, connection)
    return await pipeline.run(prepared, connection)
