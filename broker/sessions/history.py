"""History modes: how a session's prompts are built, and the heads a linear session's next request may extend.

A "tree" session's prompt is the chat template's rendering of the request's messages. A "linear" session's
prompt extends a committed turn's ids (prompt + output) with the rendering of only the new messages
(`gateway_workers.turns.history`), so an append-only episode is one row. The broker keeps, per linear
session, its newest committed turns with their echo fingerprints (`CommitTurn` flags): a worker matches the
request against them, whichever worker committed them. Under `fork` a request may extend any of the last
`FORK_HEADS` (a sub-agent's line and the main agent's both go on); under `rerender` and `reject` only the
newest. Pure data: imports only the stdlib.
"""

from __future__ import annotations

from typing import Any

# Lines a forking linear session keeps going at once: a main agent and a few sub-agents or retries.
FORK_HEADS = 8
# Counted at commit by `flags["history"]`, and at abort for the requests `reject` refused.
HISTORY_COUNTERS = ("linear_turns", "linear_first", "linear_forks", "linear_rerenders", "linear_rejects")
_COUNTER_OF = {
    "linear": "linear_turns",
    "first": "linear_first",
    "fork": "linear_forks",
    "rerender": "linear_rerenders",
}


def note_head(
    heads: list[list[Any]], seqs: list[int], seq: int, turn_id: str, flags: dict[str, Any], keep: int
) -> str | None:
    """Add a committed linear turn to `heads` (`TurnOpened.heads`: `[turn_id, message_count, digest]`, newest
    seq first, at most `keep`; the OPEN reply sends them as they are) and its seq to `seqs` (theirs, in the same
    order); returns the counter its `history` flag names (None: not a linear turn)."""
    echo = flags.get("echo")
    if type(echo) is list and len(echo) == 2 and type(echo[0]) is int and type(echo[1]) is str:
        # newest first; a commit is usually the newest (a retried one may come in late)
        at = 0 if not seqs or seqs[0] < seq else next((i for i, s in enumerate(seqs) if s < seq), len(seqs))
        if at < keep:
            heads.insert(at, [turn_id, echo[0], echo[1]])
            seqs.insert(at, seq)
            if len(seqs) > keep:
                heads.pop()
                seqs.pop()
    return _COUNTER_OF.get(flags.get("history"))
