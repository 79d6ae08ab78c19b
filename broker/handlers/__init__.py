"""The broker's message handlers, one per message, by concern: turns (a worker's opens, commits, aborts,
lookups and heartbeats), sessions (a trainer's opens and drops), episodes (finishes, either side's, and the
episode stream), control (stats, metrics, engine replicas, weight versions) and generation (a trainer's
pause and resume).

Each concern is a class over the shared `BrokerState` (a `base.Concern`) whose `ROUTES` name its handlers;
`routes` here joins them for the server, which only polls, decodes, routes and sends. A handler takes the
message, the peer's envelope, the frame as received and the side it came from (`base.Handler`), and returns
its reply, or None when the reply waits (a parked finish or long poll); replies to parked requests go out
through `send_parked`. No sockets; imports `broker.*` only.
"""

from __future__ import annotations

from broker.handlers.base import Handler, SendParked
from broker.handlers.control import ControlHandlers
from broker.handlers.episodes import EpisodeHandlers
from broker.handlers.generation import GenerationHandlers
from broker.handlers.sessions import SessionHandlers
from broker.handlers.turns import TurnHandlers
from broker.state import BrokerState


def routes(state: BrokerState, send_parked: SendParked, turns: TurnHandlers | None = None) -> dict[type, Handler]:
    """Every message class a peer may send, with its handler (`turns`: the server's own, which it also asks to
    give up silent workers' turns)."""
    joined: dict[type, Handler] = {}
    concerns = (turns or TurnHandlers(state, send_parked), SessionHandlers(state, send_parked),
                EpisodeHandlers(state, send_parked), ControlHandlers(state, send_parked),
                GenerationHandlers(state, send_parked))
    for concern in concerns:
        for message_class, handler in concern.routes().items():
            assert message_class not in joined, f"two handlers for {message_class.__name__}"
            joined[message_class] = handler
    return joined
