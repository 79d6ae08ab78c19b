"""Prompt text cut into pieces at added tokens, and the per-process cache of each piece's ids.

The `tokenizers` pipeline splits raw text on its added tokens before normalizing and BPE, so no
merge crosses them: the renderer cuts rendered text the same way (`special_splitter`, accepted
only for tokenizers whose cut pieces provably encode alike) and looks each piece up in a bounded,
thread-safe LRU (`SegmentCache`), encoding only the pieces it has not seen. `Pieces` is one
render's cut and lookup, which `renderer.Renderer` assembles into prompt ids.
Imports only the stdlib and `session_renders`; must not import the renderer, the app or the backplane.
"""

from __future__ import annotations

import re
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway_workers.rendering.session_renders import LastRender

# Per worker process. A 24k-token conversation holds ~200 KB (text + ids), so the default keeps
# ~1,000 such conversations; an agent whose pieces were evicted just pays a full encode once.
DEFAULT_CACHE_BYTES = 256 * 1024 * 1024
_ENTRY_OVERHEAD_BYTES = 100  # the OrderedDict slot and links, on top of the str and array objects
# Texts that exercise every boundary effect we know of (leading space markers, NFC across a cut,
# CRLF, digits, trailing whitespace): a tokenizer that encodes a piece differently alone fails this.
_PROBE_TEXTS = ("hello world", " x", "  two\n\n", "e\u0301t\u00e9 12345", "\r\n\tz ", "\u0301a", "", "b c\n")


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot of a `SegmentCache`: hits and misses count pieces, bytes is the current estimate, forgotten counts
    the pieces dropped with their sessions."""

    hits: int
    misses: int
    evictions: int
    entries: int
    bytes: int
    forgotten: int = 0


class SegmentCache:
    """A thread-safe LRU map from a text piece to its token ids, bounded by an estimate of its bytes.

    Most pieces are one session's own (its messages, tool results, replies): a piece put for a session is
    its session's until another (or no) session uses it, and `forget` drops the pieces a session that ended
    still owns, so the cache holds what recurs (system prompts, tool schemas) rather than the dead sessions'
    text until the LRU gets to it.
    """

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, array] = OrderedDict()
        self._owners: dict[str, str] = {}  # piece -> the session it was put for, while no other used it
        self._bytes = 0
        self._lock = threading.Lock()
        self._hits = self._misses = self._evictions = self._forgotten = 0

    @staticmethod
    def cost(piece: str, ids: array) -> int:
        # getsizeof is O(1) here and counts 1, 2 or 4 bytes per character, as CPython stores the text.
        return sys.getsizeof(piece) + sys.getsizeof(ids) + _ENTRY_OVERHEAD_BYTES

    def get_many(self, pieces: Sequence[str], session: str | None = None) -> list[array | None]:
        """The cached ids of each piece (None for a miss) for `session`, refreshing the hits' recency."""
        out: list[array | None] = []
        with self._lock:
            entries, owners = self._entries, self._owners
            for piece in pieces:
                ids = entries.get(piece)
                if ids is not None:
                    entries.move_to_end(piece)
                    if owners.get(piece, session) != session:
                        del owners[piece]  # shared now: it outlives its first session
                out.append(ids)
            hits = sum(ids is not None for ids in out)
            self._hits += hits
            self._misses += len(out) - hits
        return out

    def put_many(self, items: Sequence[tuple[str, array]], session: str | None = None) -> None:
        """Cache pieces encoded for `session` (None: for no session in particular)."""
        with self._lock:
            owners = self._owners
            for piece, ids in items:
                cost = self.cost(piece, ids)
                if cost > self.max_bytes:
                    continue  # larger than the whole cache: keeping it would evict everything else
                old = self._entries.pop(piece, None)
                if old is not None:
                    self._bytes -= self.cost(piece, old)
                self._entries[piece] = ids
                self._bytes += cost
                if old is None:
                    if session is not None:
                        owners[piece] = session
                elif owners.get(piece, session) != session:
                    del owners[piece]  # encoded for two sessions at once (a render on the loop and one on the thread)
            while self._bytes > self.max_bytes:
                piece, ids = self._entries.popitem(last=False)
                owners.pop(piece, None)
                self._bytes -= self.cost(piece, ids)
                self._evictions += 1

    def forget(self, session: str, pieces: Sequence[str]) -> None:
        """Drop those of `pieces` that `session` (which ended) still owns."""
        with self._lock:
            entries, owners = self._entries, self._owners
            for piece in pieces:
                if owners.get(piece) == session:
                    del owners[piece]
                    self._bytes -= self.cost(piece, entries.pop(piece))
                    self._forgotten += 1

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                self._hits, self._misses, self._evictions, len(self._entries), self._bytes, self._forgotten
            )


@dataclass(frozen=True, slots=True)
class Pieces:
    """Rendered text cut at added tokens, with each piece's cached ids (None where missing)."""

    text: str
    at: int  # parts cut text[at:]; what comes before, the session's last render lends
    head: array | None  # the ids of text[:at]
    lender: LastRender | None  # the session's last render, if it lent `head`
    parts: list[str]  # [piece, added token, piece, ..., piece]
    texts: list[str]  # the pieces: parts[0::2]
    cached: list[array | None]
    missing: list[int]  # indices into texts


@dataclass(frozen=True, slots=True)
class Splitter:
    """Where the tokenizer itself cuts text before BPE: its added tokens (leftmost-longest), and their ids."""

    pattern: re.Pattern[str]  # one capturing group, so pattern.split keeps the tokens
    ids: dict[str, int]


def nested(tokens: Mapping[str, int]) -> bool:
    """Whether some added token occurs inside another (then a cut cannot be resumed after a token)."""
    return any(a != b and a in b for a in tokens for b in tokens)


def special_splitter(backend: Any) -> tuple[Splitter | None, str]:
    """A splitter whose pieces encode independently to exactly the full encode's ids, or (None, why not).

    The `tokenizers` pipeline first splits raw text on its non-normalized added tokens (Aho-Corasick,
    leftmost-longest), then normalizes, pre-tokenizes and BPE-encodes each piece on its own. A regex
    alternation of the same tokens, longest first, finds the same cuts. Tokens that strip neighbouring
    whitespace or match only whole words move the cuts, and some pre-tokenizers look at a piece's
    offset in the whole text: those tokenizers are refused, and a probe encode checks the rest.
    """
    if backend is None or not hasattr(backend, "get_added_tokens_decoder"):
        return None, "no fast (Rust) tokenizer"
    if getattr(backend, "encode_special_tokens", False):
        return None, "the tokenizer encodes special tokens as text"
    if backend.padding is not None or backend.truncation is not None:
        return None, "the tokenizer pads or truncates"
    ids: dict[str, int] = {}
    for token_id, token in backend.get_added_tokens_decoder().items():
        if token.normalized:
            continue  # matched inside normalized pieces, which are encoded whole anyway
        if token.lstrip or token.rstrip or token.single_word:
            return None, f"added token {token.content!r} strips whitespace or matches whole words only"
        if not token.content:
            return None, "an added token is empty"
        ids[token.content] = token_id
    if not ids:
        return None, "the tokenizer has no added tokens to cut at"
    # Metaspace(prepend_scheme="first") marks only the piece at offset 0: cut pieces would all get it.
    # (__getstate__ is the component's own JSON; the whole tokenizer's to_str() takes seconds.)
    pre_tokenizer = backend.pre_tokenizer
    if pre_tokenizer is not None and b'"prepend_scheme":"first"' in pre_tokenizer.__getstate__():
        return None, "the pre-tokenizer treats the text's first piece specially"
    alternation = "|".join(re.escape(t) for t in sorted(ids, key=len, reverse=True))
    splitter = Splitter(re.compile(f"({alternation})"), ids)
    for probe in _probes(list(ids)):
        whole = backend.encode(probe, add_special_tokens=False).ids
        parts = splitter.pattern.split(probe)
        pieces = backend.encode_batch_fast(parts[0::2], add_special_tokens=False)
        cut = list(pieces[0].ids)
        for k in range(1, len(parts), 2):
            cut += [ids[parts[k]], *pieces[(k + 1) // 2].ids]
        if cut != whole:
            return None, f"a probe encodes differently when cut at added tokens: {probe[:80]!r}"
    return splitter, ""


def _probes(tokens: list[str]) -> list[str]:
    """Probe texts: every added token between every pair of boundary-sensitive texts."""
    out = []
    for i, token in enumerate(tokens):
        left = _PROBE_TEXTS[i % len(_PROBE_TEXTS)]
        out.append("".join(f"{a}{token}{b}" for a in _PROBE_TEXTS for b in (left, "")))
    out.append("".join(tokens) + " " + "".join(reversed(tokens)))
    return out
