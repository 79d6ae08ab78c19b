"""Session images: one live session as plain msgpack-able values, and the session rebuilt from them.

A durable broker's snapshots (`broker.durability.snapshots`) write each live session as its image,
so a restart loads a session's turn store as it was (its logs' bytes, compressed parts included)
instead of replaying every commit. The image is the store's own layout (`TurnStore.image`), not its
turns: loading it copies none of the logs' bytes (`logs.append_logs`). A session closed by a
FinishSession is imaged as open: its trainer is still waiting for the rows, and after a restart its
retried finish closes it again. A session's settings are the log's open record's
(`records.SESSION_SETTINGS`), in its order. No sockets, no encoding; imports the stdlib,
`broker.sessions` and `records`.
"""

from __future__ import annotations

from typing import Any

from broker.durability.records import SESSION_SETTINGS, session_settings
from broker.sessions.session import Session
from broker.sessions.turn_store import TurnStore

# The layout of an image (a list): bumped with any change to it, checked on load, and older layouts are
# brought up to this one (`_current`). Layout 1 (before in-flight turns named their workers and requests their
# digests) lacks the owners, abandoned turns and digests; layouts 1 and 2 hold a store's hot messages one item
# each (`MessageLog.from_image` reads both ways); layouts before 4 lack the history settings and heads (tree
# sessions); layout 4 kept the history settings after the digests, where layout 5 has every setting together.
IMAGE_VERSION = 5
_SETTINGS_END = 2 + len(SESSION_SETTINGS)
_LOADS = (IMAGE_VERSION, 4, 3, 2, 1)


def session_image(session: Session, *, closing: bool) -> list[Any]:
    """`session` as of now; `closing`: keep it closing (a RequestFinish closed it), else imaged open.

    Shares the store's buffers (see `TurnStore.image`): pack it before the session changes.
    """
    return [
        IMAGE_VERSION,
        session.sid,
        *session_settings(session).values(),
        session.finished_by if closing else None,
        session.next_seq,
        session.in_flight,
        sorted(session.aborted),
        session.committed.image(),
        session.owners,
        session.abandoned,
        session.digests,
        [[seq, *head] for seq, head in zip(session.head_seqs, session.heads, strict=True)],
    ]


def restore_session(image: list[Any]) -> Session:
    """The session an image was taken of (its compaction state starts afresh); ValueError if it is none."""
    if not image or image[0] not in _LOADS:
        raise ValueError(f"a session image of layout {image[0] if image else None!r}, not {IMAGE_VERSION}")
    try:
        image = _current(image)
        sid, settings = image[1], dict(zip(SESSION_SETTINGS, image[2:_SETTINGS_END], strict=True))
        finished_by, next_seq, in_flight, aborted, store, owners, abandoned, digests, heads = image[_SETTINGS_END:]
        session = Session(sid, **settings, heads=[head[1:] for head in heads], head_seqs=[head[0] for head in heads])
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


def _current(image: list[Any]) -> list[Any]:
    """An image of an older layout in this one's."""
    if image[0] == 1:
        image = [*image, {}, {}, {}]
    if image[0] < 4:
        image = [*image, "tree", "fork", []]
    if image[0] < 5:  # the history settings moved from after the digests to after the other settings
        *before, history_mode, linear_fallback, heads = image
        image = [IMAGE_VERSION, *before[1:8], history_mode, linear_fallback, *before[8:], heads]
    return image
