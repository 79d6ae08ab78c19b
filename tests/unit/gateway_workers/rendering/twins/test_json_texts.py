"""`json_texts.tojson` is `json.dumps(value, ensure_ascii=False)`, cached without ever serving another value's text.

Property tests over nested JSON-like values (unicode, lone surrogates, NaN and infinities,
-0.0, ints past 64 bits, tuples), each encoded cold and then from the cache, and over pairs
that orjson encodes alike but `json.dumps` does not (NaN vs null, a UUID or an enum vs its
value, a tuple vs a list, a str subclass). Also: the same errors as `json.dumps`, and the bounds.
"""

from __future__ import annotations

import enum
import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway_workers.rendering.twins import json_texts


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


@pytest.fixture(autouse=True)
def empty_cache():
    json_texts.clear()
    yield
    json_texts.clear()


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),  # NaN, infinities and -0.0 included
    st.text(max_size=8),  # lone surrogates included
    st.sampled_from(["", "é", "中文", "🙂", "\u2028", '"', "\\", "\x00", "null"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=6), inner, max_size=4),
    ),
    max_leaves=12,
)


@settings(max_examples=500, deadline=None)
@given(first=values, second=values)
def test_the_text_is_always_json_dumps(first, second):
    for value in (first, second, first, second):  # cold, cold, then from the cache
        assert json_texts.tojson(value) == dumps(value)


class Color(enum.Enum):
    RED = "red"


class Text(str):
    pass


@pytest.mark.parametrize(
    ("plain", "lookalike"),
    [
        ({"a": None}, {"a": float("nan")}),
        ({"a": None}, {"a": float("inf")}),
        ([1, 2], (1, 2)),
        ({"x": "red"}, {"x": Color.RED}),
        ({"id": "12345678-1234-5678-1234-567812345678"}, {"id": uuid.UUID("12345678-1234-5678-1234-567812345678")}),
        ({"s": "a"}, {"s": Text("a")}),
        ({"n": 1}, {"n": True}),
        ({"n": 0.0}, {"n": -0.0}),
        ({"raw": [1]}, {"raw": orjson.Fragment(b"[1]")}),
    ],
)
def test_a_value_orjson_writes_alike_never_gets_the_cached_text(plain, lookalike):
    assert json_texts.tojson(plain) == dumps(plain)
    assert json_texts.tojson(plain) == dumps(plain)  # cached now
    try:
        expected: Any = dumps(lookalike)
    except TypeError as e:
        expected = e
    if isinstance(expected, TypeError):
        with pytest.raises(TypeError):
            json_texts.tojson(lookalike)
    else:
        assert json_texts.tojson(lookalike) == expected


def test_the_same_errors_as_json_dumps():
    with pytest.raises(TypeError):
        json_texts.tojson({"q": {1, 2}})
    circular: list[Any] = []
    circular.append(circular)
    with pytest.raises(ValueError):
        json_texts.tojson(circular)
    assert json_texts.cached() == (0, 0)


def test_hits_are_served_from_the_cache(monkeypatch):
    tool = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
    text = json_texts.tojson(tool)
    calls = []
    monkeypatch.setattr(json_texts, "_dumps", lambda v: calls.append(v) or dumps(v))
    assert json_texts.tojson(dict(tool)) == text  # an equal value, another object
    assert calls == []
    assert json_texts.tojson({**tool, "type": "other"}) != text
    assert len(calls) == 1


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(json_texts, "MAX_ENTRIES", 50)
    monkeypatch.setattr(json_texts, "MAX_CHARS", 2_000)
    for i in range(200):
        assert json_texts.tojson({"i": i}) == dumps({"i": i})
    entries, chars = json_texts.cached()
    assert entries == 50 and chars <= 2_000
    big = {"text": "x" * 1_500}
    json_texts.tojson(big)
    entries, chars = json_texts.cached()
    assert chars <= 2_000 and entries < 50  # older entries made room, oldest first
    assert json_texts.tojson({"i": 199}) == dumps({"i": 199})
    huge = {"text": "y" * (json_texts.MAX_ENTRY_CHARS + 1)}
    assert json_texts.tojson(huge) == dumps(huge)
    assert json_texts.cached()[1] <= 2_000


def test_threads_share_the_cache_safely(monkeypatch):
    monkeypatch.setattr(json_texts, "MAX_ENTRIES", 64)
    values = [{"k": i % 97, "v": [i % 7] * (i % 5)} for i in range(4_000)]
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(json_texts.tojson, values))
    assert texts == [dumps(v) for v in values]
    assert json_texts.cached()[0] <= 64
