"""`json.dumps(value, ensure_ascii=False)` of values seen before: what chat templates print again every turn.

A template twin (`native_templates`) prints each tool's schema and each earlier tool call's
arguments with HF's `tojson` on every render of a conversation, and through `json.dumps` that was
most of a twin render's CPU (docs/performance.md). `tojson` keeps the texts in
a small bounded per-process map. A value is looked up by its orjson encoding (one C call) and the
entry serves it only if the value equals (`==`) the plain JSON value decoded back from that key;
see `tojson` for why that pins the text exactly. Thread-safe. Imports only the stdlib and orjson.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import orjson

# Bounds of the map: entries, and characters of their texts (each entry also holds its key bytes and
# a decoded copy of the value, roughly 3x the text in all: ~3 MB at the character bound).
MAX_ENTRIES = 4096
MAX_CHARS = 1 << 20
MAX_ENTRY_CHARS = 1 << 14  # a larger value is encoded each time: it would push out too many others
# orjson refuses what it would otherwise encode like a plain JSON value: subclasses of str/int/float/
# dict/list, dataclasses and datetimes (all of them raise TypeError instead).
_KEY_OPTIONS = orjson.OPT_PASSTHROUGH_SUBCLASS | orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME

_entries: dict[bytes, tuple[Any, str]] = {}
_chars = 0
_lock = threading.Lock()


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def tojson(value: Any) -> str:
    """Exactly `json.dumps(value, ensure_ascii=False)` (same text, same TypeError/ValueError), cached.

    Why a hit is exact: the key is orjson's encoding of `value`, and the entry keeps `plain`, the
    value decoded back from it (only str, int, float, bool, None, list and dict). `value == plain`
    with equal encodings means equal JSON values: encodings fix every dict's key order, every
    number's type and digits (orjson writes each float's shortest round-trip form) and every
    string; `==` rules out what orjson writes like a plain value but `json.dumps` does not (NaN and
    infinities, written as null; tuples; UUIDs and enums, written as their values; fragments).
    Anything orjson refuses (other objects, subclasses, ints past 64 bits, lone surrogates) is
    encoded by `json.dumps` each time.
    """
    try:
        key = orjson.dumps(value, option=_KEY_OPTIONS)
    except TypeError:  # orjson.JSONEncodeError included
        return _dumps(value)
    entry = _entries.get(key)
    if entry is not None and value == entry[0]:
        return entry[1]
    text = _dumps(value)
    if len(text) <= MAX_ENTRY_CHARS:
        plain = orjson.loads(key)
        if value == plain:
            _remember(key, plain, text)
    return text


def _remember(key: bytes, plain: Any, text: str) -> None:
    global _chars
    with _lock:
        old = _entries.pop(key, None)
        if old is not None:
            _chars -= len(old[1])
        _entries[key] = (plain, text)
        _chars += len(text)
        while len(_entries) > MAX_ENTRIES or _chars > MAX_CHARS:
            oldest = next(iter(_entries))  # insertion order: the oldest entry goes first
            _chars -= len(_entries.pop(oldest)[1])


def cached() -> tuple[int, int]:
    """(entries, characters of their texts) now held."""
    with _lock:
        return len(_entries), _chars


def clear() -> None:
    """Forget every text (for tests)."""
    global _chars
    with _lock:
        _entries.clear()
        _chars = 0
