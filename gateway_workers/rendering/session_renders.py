"""Each recent session's last render, so the next render of its conversation cuts only what is new.

The renderer cuts rendered text at the tokenizer's added tokens and looks each piece up by its
text (`renderer.py`): both cost time in proportion to the whole conversation. A conversation grows
at its end, so the text up to the last added token it shares with the session's previous render
cuts the same way again (given no added token occurs inside another, which the renderer checks),
and its ids are a prefix of the previous prompt's: only the rest is cut, looked up and joined.
Thread-safe (long renders finish on the renderer's own thread). Imports only the stdlib.
"""

from __future__ import annotations

import bisect
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

# Sessions kept, and the characters of their texts (their prompt ids take about as many bytes again).
MAX_SESSIONS = 4096
MAX_CHARS = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class LastRender:
    """A render's text and prompt ids, and for each added token in it: where it ends in the text, and how
    many prompt ids come up to and including it."""

    text: str
    prompt_ids: array
    token_ends: list[int]
    id_ends: list[int]
    owned: list[str] = field(default_factory=list)  # the pieces cached for its session, this render and earlier

    def ends_before(self, at: int) -> tuple[list[int], list[int]]:
        """The token and id ends up to character `at` (where a render that reused them starts cutting)."""
        count = bisect.bisect_right(self.token_ends, at)
        return self.token_ends[:count], self.id_ends[:count]


def shared_prefix(text: str, last: LastRender) -> tuple[int, array | None]:
    """(characters, their ids) of `last` that `text` starts with, ending just after an added token;
    (0, None) when none is shared."""
    if text.startswith(last.text):
        shared = len(last.text)
    else:  # the template re-rendered something before the end (rare): the longest common prefix
        lo, hi = 0, min(len(text), len(last.text))
        while lo < hi:  # each step copies only the span it tests: O(len) in all
            mid = (lo + hi + 1) // 2
            if last.text.startswith(text[lo:mid], lo):
                lo = mid
            else:
                hi = mid - 1
        shared = lo
    tokens = bisect.bisect_right(last.token_ends, shared)
    if not tokens:
        return 0, None
    return last.token_ends[tokens - 1], last.prompt_ids[: last.id_ends[tokens - 1]]


class SessionRenders:
    """An LRU of sessions' last renders, bounded by sessions and characters."""

    def __init__(self, max_sessions: int = MAX_SESSIONS, max_chars: int = MAX_CHARS) -> None:
        self._renders: OrderedDict[str, LastRender] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self.max_sessions = max_sessions
        self.max_chars = max_chars

    def get(self, session: str) -> LastRender | None:
        with self._lock:
            return self._renders.get(session)

    def put(self, session: str, render: LastRender) -> None:
        with self._lock:
            old = self._renders.pop(session, None)
            if old is not None:
                self._chars -= len(old.text)
            if len(render.text) > self.max_chars:
                return
            self._renders[session] = render
            self._chars += len(render.text)
            while len(self._renders) > self.max_sessions or self._chars > self.max_chars:
                _, evicted = self._renders.popitem(last=False)
                self._chars -= len(evicted.text)

    def pop(self, session: str) -> LastRender | None:
        """Drop a session's last render (the session ended); the render, if there was one."""
        with self._lock:
            old = self._renders.pop(session, None)
            if old is not None:
                self._chars -= len(old.text)
            return old

    def __len__(self) -> int:
        return len(self._renders)
