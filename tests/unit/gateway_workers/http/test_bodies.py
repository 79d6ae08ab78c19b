"""Request bodies decoded in proportion to what they add (`gateway_workers.http.bodies`): every decode equals
orjson's of the whole body, and its CRC-32 zlib's, whatever the bodies; an append-only agent's bodies after
its second are decoded by extension."""

from __future__ import annotations

import itertools
import json
import zlib
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway_workers.http.bodies import BodyDecoder, _shared_prefix

CHAT = "/v1/chat/completions"


def _message(i: int, text: str = "") -> dict[str, Any]:
    return {"role": "user" if i % 2 else "assistant", "content": f"turn {i} {text}"}


def _body(messages: list[Any], **extra: Any) -> bytes:
    return json.dumps({"model": "m", "messages": messages, **extra}).encode()  # as the SDKs write it


def _exact(decoder: BodyDecoder, raw: bytes, field: str = "messages", session: str = "s", path: str = CHAT) -> Any:
    decoded = decoder.decode(session, path, field, raw)
    assert decoded.value == orjson.loads(raw)
    assert decoded.crc32 == zlib.crc32(raw)
    return decoded


REFUSED = object()


def _whole_or_refused(decoder: BodyDecoder, raw: bytes) -> Any:
    """orjson's decode of `raw`; REFUSED if orjson refuses it, as the decoder then must too."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        with pytest.raises(orjson.JSONDecodeError):
            decoder.decode("s", CHAT, "messages", raw)
        return REFUSED


def test_an_append_only_agent_is_decoded_by_extension_from_its_third_body() -> None:
    decoder, messages = BodyDecoder(), [{"role": "system", "content": "be brief"}]
    hows = []
    for i in range(6):
        messages = [*messages, _message(i, "x" * 50), _message(i + 1, "tool ] , [ output")]
        before = dict(decoder.counts)
        decoded = _exact(decoder, _body(messages, tools=[{"type": "function"}], stream=False))
        hows.append("extended" if decoder.counts["extended"] > before["extended"] else "whole")
        if hows[-1] == "extended":  # only what was added needs checking
            assert [place for _, place in decoded.fresh] == [f"messages.[{len(messages) - 2}]",
                                                             f"messages.[{len(messages) - 1}]"]
    assert hows == ["whole", "whole", "extended", "extended", "extended", "extended"]


def test_a_repeated_body_is_its_earlier_decode_and_the_session_goes_on_extending() -> None:
    decoder, bodies = BodyDecoder(), [_body([_message(i) for i in range(n)]) for n in (1, 2, 3, 3, 4)]
    values = [_exact(decoder, raw).value for raw in bodies]
    assert values[3] is values[2] and decoder.counts == {"extended": 2, "repeated": 1, "whole": 2}


def test_an_extension_shares_the_earlier_messages_and_copies_the_list() -> None:
    decoder = BodyDecoder()
    bodies = [_body([_message(0)]), _body([_message(0), _message(1)]), _body([_message(0), _message(1), _message(2)])]
    first, second, third = (decoder.decode("s", CHAT, "messages", raw).value for raw in bodies)
    assert third["messages"][0] is second["messages"][0]
    assert third["messages"] is not second["messages"] and len(second["messages"]) == 2


def test_what_is_attached_to_a_body_comes_back_with_the_next_that_shares_its_elements() -> None:
    """An extension or a repeat carries what the caller attached to the body before (the adapter's parse, which
    the next parse takes its messages from); a body decoded whole, and a body after one refused, carry nothing."""
    decoder = BodyDecoder()
    bodies = [_body([_message(i) for i in range(n)]) for n in (1, 2, 3, 3)]
    earlier = []
    for n, raw in enumerate(bodies):
        decoded = decoder.decode("s", CHAT, "messages", raw)
        earlier.append(decoded.earlier)
        decoder.attach("s", f"parse {n}")
    assert earlier == [None, None, "parse 1", "parse 2"]  # whole, whole (learns the bracket), extended, repeated
    assert decoder.decode("other", CHAT, "messages", bodies[2]).earlier is None
    assert decoder.decode("s", "/v1/messages", "messages", bodies[3]).earlier is None  # another route's body

    def refuse(decoded: Any) -> None:
        raise ValueError("refused")

    decoder = BodyDecoder()
    for raw in bodies[:3]:
        decoder.decode("s", CHAT, "messages", raw)
        decoder.attach("s", raw)
    with pytest.raises(ValueError):
        decoder.decode("s", CHAT, "messages", _body([_message(i) for i in range(4)]), refuse)
    decoder.attach("s", "never kept")  # the session has no body now: nothing to attach to
    assert decoder.decode("s", CHAT, "messages", _body([_message(i) for i in range(5)])).earlier is None


@pytest.mark.parametrize(
    "following",
    [
        _body([_message(0), _message(1)], stop=["a", "b"]),  # a later array grew, not the history
        _body([_message(0), _message(1)], stop=["a"], n=2),  # a later field changed
        _body([_message(0, "edited"), _message(1), _message(2)], stop=["a"]),  # history edited
        _body([_message(0), _message(1)]),  # the field after the history dropped
        _body([_message(1)], stop=["a"]),  # history cut
        _body([_message(0), _message(1), [_message(9)]], stop=["a"]),  # an element that is no message: still JSON
    ],
)
def test_bodies_that_do_not_extend_are_decoded_whole_and_exactly(following: bytes) -> None:
    decoder = BodyDecoder()
    for raw in (_body([_message(0)], stop=["a"]), _body([_message(0), _message(1)], stop=["a"])):
        _exact(decoder, raw)
    _exact(decoder, following)


@pytest.mark.parametrize(
    "inserted",
    [
        b'3],"messages":[{"role":"user","content":"evil"}',  # closes the history, opens a duplicate of it
        b'3],"max_tokens":500,"x":[4',  # closes it and sets other fields
        b'3]}, {"a":[4',  # closes the body itself
    ],
)
def test_inserted_text_that_closes_the_history_is_decoded_whole(inserted: bytes) -> None:
    decoder = BodyDecoder()
    for raw in (b'{"messages":[1],"max_tokens":5}', b'{"messages":[1,2],"max_tokens":5}'):
        _exact(decoder, raw)
    raw = b'{"messages":[1,2,' + inserted + b'],"max_tokens":5}'
    if _whole_or_refused(decoder, raw) is not REFUSED:
        _exact(decoder, raw)
    assert decoder.counts["extended"] == 0


def test_a_grown_array_inside_the_last_message_is_not_taken_for_the_history() -> None:
    decoder = BodyDecoder()
    last = {"role": "user", "content": [{"type": "text", "text": "a"}]}
    _exact(decoder, _body([_message(0), last]))
    grown = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    _exact(decoder, _body([_message(0), grown]))  # diverges at a `]` then `,`, but inside the message
    assert decoder.counts["extended"] == 0


def test_a_bracket_and_comma_inside_a_string_are_not_taken_for_the_history() -> None:
    decoder = BodyDecoder()
    _exact(decoder, b'{"messages": [{"role": "user", "content": "a]"}], "model": "m"}')
    _exact(decoder, b'{"messages": [{"role": "user", "content": "a,{\\"x\\": 1}]"}], "model": "m"}')
    _exact(decoder, b'{"messages": [{"role": "user", "content": "a,{\\"x\\": 1},{\\"y\\": 2}]"}], "model": "m"}')
    assert decoder.counts["extended"] == 0


def test_an_inserted_part_that_is_not_json_is_refused_by_the_whole_decode() -> None:
    decoder = BodyDecoder()
    for n in (1, 2, 3):
        _exact(decoder, _body([_message(i) for i in range(n)]))
    good = _body([_message(i) for i in range(3)])
    at = good.rindex(b"]")
    for bad in (good[:at] + b", ]" + good[at + 1 :], good[:at] + b", {]" + good[at + 1 :], good[:at] + b",]"):
        with pytest.raises(orjson.JSONDecodeError):
            decoder.decode("s", CHAT, "messages", bad)
    _exact(decoder, _body([_message(i) for i in range(4)]))  # and the session goes on


def test_a_body_its_check_refuses_is_not_kept_so_nothing_unchecked_is_shared_later() -> None:
    decoder, seen = BodyDecoder(), []

    def check(decoded: Any) -> None:
        seen.append([place for _, place in decoded.fresh])
        if "refuse me" in json.dumps(decoded.value):
            raise ValueError("refused")

    bodies = [_body([_message(i) for i in range(n)]) for n in (1, 2, 3)]
    for raw in bodies:
        decoder.decode("s", CHAT, "messages", raw, check)
    bad = [*[_message(i) for i in range(3)], _message(3, "refuse me")]
    with pytest.raises(ValueError):
        decoder.decode("s", CHAT, "messages", _body(bad), check)
    assert seen[-1] == ["messages.[3]"]  # an extension: only what it added was checked, and refused
    with pytest.raises(ValueError):  # the next body extends the refused one: decoded and checked whole
        decoder.decode("s", CHAT, "messages", _body([*bad, _message(4)]), check)
    assert seen[-1] == [""]


def test_elements_are_decoded_at_their_depth_in_the_body_and_deep_ones_compared_safely() -> None:
    """Around orjson's nesting limit (1024) an extension decodes, or refuses, as the whole body does; values
    nested deeper than the interpreter's recursion limit are compared without a RecursionError."""
    deep = {"role": "user", "content": "X"}
    learnt_from_deep = [[_message(0)], [_message(0), deep], [_message(0), deep, _message(2)]]
    deep_extension = [[_message(0)], [_message(0), _message(1)], [_message(0), _message(1), deep]]
    for depth, bodies in itertools.product((990, 1020, 1021, 1022, 1023), (learnt_from_deep, deep_extension)):
        decoder = BodyDecoder()
        for messages in bodies:
            raw = _body(messages).replace(b'"X"', b"[" * depth + b"]" * depth)
            expected = _whole_or_refused(decoder, raw)
            if expected is not REFUSED:
                assert _same(decoder.decode("s", CHAT, "messages", raw).value, expected)


def _same(a: Any, b: Any) -> bool:
    """Equality of decoded JSON, types included, without recursion (the values above nest past its limit)."""
    stack = [(a, b)]
    while stack:
        x, y = stack.pop()
        if type(x) is not type(y):
            return False
        if type(x) is list:
            if len(x) != len(y):
                return False
            stack.extend(zip(x, y, strict=True))
        elif type(x) is dict:
            if list(x) != list(y):
                return False
            stack.extend((x[k], y[k]) for k in x)
        elif x != y:
            return False
    return True


def test_sessions_paths_and_fields_are_kept_apart_and_forgotten() -> None:
    decoder = BodyDecoder()
    for n in (1, 2):
        _exact(decoder, _body([_message(i) for i in range(n)]), session="a")
    _exact(decoder, _body([_message(i) for i in range(3)]), session="b")  # another session: nothing to extend
    _exact(decoder, _body([_message(i) for i in range(3)]), session="a", path="/v1/messages")  # another route
    assert decoder.counts["extended"] == 0
    responses = [json.dumps({"input": "just text", "model": "m"}).encode(), json.dumps({"input": "more"}).encode()]
    for raw in responses:
        _exact(decoder, raw, field="input", session="r", path="/v1/responses")
    decoder.forget(["a", "b", "r"])
    assert len(decoder) == 0


def test_the_cache_is_bounded_by_sessions_and_bytes() -> None:
    decoder = BodyDecoder(max_sessions=3, max_bytes=10_000)
    for s in range(5):
        _exact(decoder, _body([_message(0)]), session=str(s))
    assert len(decoder) == 3
    _exact(decoder, _body([_message(0, "x" * 6000)]), session="big")  # counted at least twice its size: over
    assert len(decoder) == 0
    assert decoder._bytes == 0


def test_what_is_kept_is_counted_with_its_decode_and_uncounted_when_dropped() -> None:
    decoder = BodyDecoder()
    short = [_message(i) for i in range(200)]  # short messages: a decode several times their text
    for n in (100, 150, 200):
        raw = _body(short[:n])
        _exact(decoder, raw)
        assert decoder._bytes >= 4 * len(raw)
    decoder.forget(["s"])
    assert decoder._bytes == 0 and len(decoder) == 0


def test_shared_prefix_is_the_longest_common_prefix() -> None:
    a = bytes(range(256)) * 1000
    for at in (0, 1, 255, 65535, 65536, 65537, 200_000, len(a) - 1):
        b = a[:at] + b"\xff\xfe" + a[at + 2 :] if a[at] != 0xFF else a[:at] + b"\x00" + a[at + 1 :]
        assert _shared_prefix(a, b) == at
    assert _shared_prefix(a, a) == len(a) and _shared_prefix(a, a[:10]) == 10 and _shared_prefix(b"", a) == 0


_text = st.text(alphabet=st.sampled_from('ab ],[{}":\\\n\u00e9\U0001f600'), max_size=12)
_leaf = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), _text)
_value = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
                      max_leaves=6)
_edit = st.sampled_from(["append"] * 6 + ["edit", "cut", "tail", "same", "raw"])


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(_edit, st.lists(_value, min_size=1, max_size=3)), min_size=1, max_size=12),
    st.sampled_from([{}, {"separators": (",", ":")}, {"indent": 1}, {"ensure_ascii": False}]),
    st.booleans(),
    st.lists(_value, max_size=2),
)
def test_every_decode_is_the_whole_decode_whatever_the_bodies(steps: list[tuple[str, list[Any]]],
                                                              style: dict[str, Any], history_last: bool,
                                                              history: list[Any]) -> None:
    decoder, extra = BodyDecoder(), {"model": "m", "tools": [[1, 2]]}
    for edit, values in steps:
        if edit == "append":
            history = [*history, *values]
        elif edit == "edit" and history:
            history = [values[0], *history[1:]]
        elif edit == "cut":
            history = history[: len(history) // 2]
        elif edit == "tail":
            extra = {**extra, "stop": values}
        if edit == "raw":  # arbitrary bytes inserted before the last `]`
            previous = _dump(history, extra, style, history_last)
            at = previous.rindex(b"]")
            raw = previous[:at] + b"," + json.dumps(values).encode()[1:-1] + previous[at:]
        else:
            raw = _dump(history, extra, style, history_last)
        expected = _whole_or_refused(decoder, raw)
        if expected is REFUSED:
            continue
        _exact(decoder, raw)
        if isinstance(expected, dict) and isinstance(expected.get("messages"), list):
            history = expected["messages"]


def _dump(history: list[Any], extra: dict[str, Any], style: dict[str, Any], history_last: bool) -> bytes:
    body = {**extra, "messages": history} if history_last else {"messages": history, **extra}
    return json.dumps(body, **style).encode()
