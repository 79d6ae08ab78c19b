"""The engine request's prompt JSON (`engines.http_engine.PromptJson`): each session's context written once, the text
always what a whole write gives."""

from __future__ import annotations

import json
from array import array

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

import gateway_workers.engines.http_engine as engines_base
from gateway_workers.engines.http_engine import PromptJson

IDS = st.lists(st.integers(0, 2**31 - 1), max_size=40)


def _text(fragment: orjson.Fragment) -> list[int]:
    return json.loads(orjson.dumps({"ids": fragment}))["ids"]


@settings(max_examples=300, deadline=None)
@given(first=IDS, steps=st.lists(st.tuples(st.sampled_from(["extend", "same", "cut", "other"]), IDS), max_size=6))
def test_every_prompt_is_written_as_its_ids_whatever_came_before(first, steps):
    cache = PromptJson()
    prompt = first
    assert _text(cache("s", array("i", prompt))) == prompt
    for kind, ids in steps:
        if kind == "extend":
            prompt = prompt + ids
        elif kind == "cut":
            prompt = prompt[: len(ids)]
        elif kind == "other":
            prompt = ids
        assert _text(cache("s", array("i", prompt))) == prompt
        assert _text(cache("other session", prompt)) == prompt  # a list too, and the sessions apart


def test_an_extended_prompt_writes_only_its_new_ids(monkeypatch):
    written: list[int] = []
    original = engines_base._json_ids

    def counting(raw: bytes, offset: int = 0) -> bytes:
        written.append((len(raw) - offset) // 4)
        return original(raw, offset)

    monkeypatch.setattr(engines_base, "_json_ids", counting)
    cache = PromptJson()
    context = array("i", range(1000))
    cache("s", context)
    context.extend(range(1000, 1010))
    assert _text(cache("s", context)) == list(range(1010))
    assert written == [1000, 10]


def test_sessions_are_kept_within_their_bounds_and_forgotten():
    cache = PromptJson(max_sessions=2)
    for session in ("a", "b", "c"):
        cache(session, [1, 2, 3])
    assert len(cache) == 2  # "a" made room
    cache.forget(["b", "c"])
    assert len(cache) == 0 and cache._bytes == 0
    small = PromptJson(max_bytes=50)  # one prompt of 5 ids: 20 bytes of ids + 11 of JSON
    small("a", list(range(5)))
    small("b", list(range(5)))
    assert len(small) == 1
    assert _text(small("big", list(range(100)))) == list(range(100))  # larger than the bound: written, not kept
    assert len(small) == 0 and small._bytes == 0
