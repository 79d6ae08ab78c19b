"""Session images: one live session as plain msgpack-able values, and the session rebuilt from them.

A durable broker's snapshots (`broker.durability.snapshots`) write each live session as its image,
so a restart loads a session's turn store as it was (its logs' bytes, compressed parts included)
instead of replaying every commit. The image is the store's own layout (`TurnStore.image`), not its
turns: loading it copies none of the logs' bytes (`logs.append_logs`). A session closed by a
FinishSession is imaged as open: its trainer is still waiting for the rows, and after a restart its
retried finish closes it again. No sockets, no encoding; imports only the stdlib and `broker.sessions`.
"""

from __future__ import annotations

from typing import Any

from broker.sessions.registry import Session
from broker.sessions.turn_store import TurnStore

# The layout of an image (a list): bumped with any change to it, checked on load. Layout 1 (before
# in-flight turns named their workers and requests their digests) lacks the last three items and still loads;
# layouts 1 and 2 hold a store's hot messages one item each (`MessageLog.from_image` reads both ways);
# layouts before 4 lack the history settings and heads (tree sessions).
IMAGE_VERSION = 4
_OWNERLESS_VERSION = 1
_LOADS = (IMAGE_VERSION, 3, 2, _OWNERLESS_VERSION)


def session_image(session: Session, *, closing: bool) -> list[Any]:
    """`session` as of now; `closing`: keep it closing (a RequestFinish closed it), else imaged open.

    Shares the store's buffers (see `TurnStore.image`): pack it before the session changes.
    """
    return [
        IMAGE_VERSION,
        session.sid,
        session.sampling_defaults,
        session.max_context_tokens,
        session.max_turns,
        session.metadata,
        session.client_id,
        session.group,
        session.finished_by if closing else None,
        session.next_seq,
        session.in_flight,
        sorted(session.aborted),
        session.committed.image(),
        session.owners,
        session.abandoned,
        session.digests,
        session.history_mode,
        session.linear_fallback,
        [[seq, *head] for seq, head in zip(session.head_seqs, session.heads, strict=True)],
    ]


def restore_session(image: list[Any]) -> Session:
    """The session an image was taken of (its compaction state starts afresh); ValueError if it is none."""
    if not image or image[0] not in _LOADS:
        raise ValueError(f"a session image of layout {image[0] if image else None!r}, not {IMAGE_VERSION}")
    if image[0] == _OWNERLESS_VERSION:
        image = [*image, {}, {}, {}]
    if image[0] < IMAGE_VERSION:
        image = [*image, "tree", "fork", []]
    try:
        (
            _, sid, sampling_defaults, max_context_tokens, max_turns, metadata, client_id, group, finished_by,
            next_seq, in_flight, aborted, store, owners, abandoned, digests, history_mode, linear_fallback, heads,
        ) = image  # fmt: skip
        session = Session(
            sid, sampling_defaults, max_context_tokens, max_turns, metadata, client_id, group, history_mode,
            linear_fallback, [head[1:] for head in heads], [head[0] for head in heads],
        )  # fmt: skip
        if finished_by is not None:
            session.state = "closing"
            session.finished_by = finished_by
        session.next_seq = next_seq
        session.in_flight = dict(in_flight)
        session.aborted = set(aborted)
        session.owners = dict(owners)
        session.abandoned = dict(abandoned)
        session.digests = dict(digests)
        session.committed = TurnStore.from_image(store)
    except (TypeError, ValueError, IndexError) as e:
        raise ValueError(f"a malformed session image: {e}") from e
    return session
