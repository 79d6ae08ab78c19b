"""Property-based fuzzing of the three request translators: any JSON body -> a request or a 4xx ApiError.

Bodies are mutations of each dialect's valid bodies (`bad_requests.GOOD`): keys dropped or renamed,
values replaced by random JSON, retyped, nested, duplicated or moved, strings swapped for the
dialect's own words or for unicode with NULs; and random objects over the dialect's own keys.
`parse_request` must either raise an ApiError with a 4xx whose error JSON encodes, or return a
request whose canonical turn is within the limits, renders (`template_messages`, `check_tools`)
and packs for the commit. Values are what a JSON body can carry (64-bit integers, no lone surrogates).
"""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest
from bad_requests import GOOD, LIMITS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.codec.wire import pack_message
from broker.protocol import unpack_messages
from gateway_workers.adapters import anthropic_messages, openai_chat, openai_responses
from gateway_workers.http.errors import ApiError
from gateway_workers.rendering.messages import check_tools, template_messages

ADAPTERS: dict[str, Any] = {"chat": openai_chat, "messages": anthropic_messages, "responses": openai_responses}
KEYS = {
    "chat": ["model", "messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens", "temperature",
             "top_p", "top_k", "stop", "seed", "n", "stream", "stream_options", "parallel_tool_calls", "user"],
    "messages": ["model", "messages", "system", "tools", "tool_choice", "max_tokens", "stop_sequences",
                 "temperature", "top_p", "top_k", "stream", "thinking", "metadata"],
    "responses": ["model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature",
                  "top_p", "stream", "previous_response_id", "text", "background", "reasoning", "store"],
}
# the words the dialects branch on: a mutation that lands on one reaches deeper code than random text
WORDS = ["user", "assistant", "system", "developer", "tool", "function", "custom", "text", "input_text",
         "output_text", "image_url", "tool_use", "tool_result", "thinking", "redacted_thinking", "message",
         "reasoning", "function_call", "function_call_output", "summary_text", "call_1", "call_2", "toolu_1",
         "get_weather", "auto", "enabled", "disabled", "object", "string", "role", "content", "type", "id",
         "tool_call_id", "tool_use_id", "call_id", "arguments", "input", "name", "", " ", "resp_" + "0" * 32]
ODD = ["\x00", "a\x00b", "\u202e", "\U0001f600", "\u00e9\u0301", "\n\t", "\ufeff", "\uffff", "<|im_end|>",
       "<tool_call>", '{"a": 1}', "[1, 2]", "null"]

STRINGS = st.one_of(st.sampled_from(WORDS), st.sampled_from(ODD), st.text(max_size=16))
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), STRINGS)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(STRINGS, inner, max_size=4),
                    max_leaves=12)
FUZZ = settings(max_examples=250, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def _slots(value: Any, out: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """Every (container, key or index) in a JSON value, outermost first."""
    if isinstance(value, dict):
        for key in list(value):
            out.append((value, key))
            _slots(value[key], out)
    elif isinstance(value, list):
        for index in range(len(value)):
            out.append((value, index))
            _slots(value[index], out)
    return out


def _retyped(value: Any) -> list[Any]:
    """The same value as other JSON types."""
    return [str(value), [value], {"value": value}, None, True, 0, -1, 1.5, len(str(value)), ""]


@st.composite
def mutated(draw: st.DrawFn, dialect: str) -> Any:
    body = copy.deepcopy(draw(st.sampled_from(GOOD[dialect])))
    for _ in range(draw(st.integers(1, 4))):
        slots = _slots(body, [])
        if not slots:
            break
        container, key = slots[draw(st.integers(0, len(slots) - 1))]
        op = draw(st.sampled_from(["drop", "replace", "retype", "nest", "duplicate", "word", "rename", "move"]))
        if op == "drop":
            del container[key]
        elif op == "replace":
            container[key] = draw(JSON)
        elif op == "retype":
            container[key] = draw(st.sampled_from(_retyped(container[key])))
        elif op == "nest":
            value = container[key]
            for _ in range(draw(st.integers(1, 12))):
                value = draw(st.sampled_from([[value], {"x": value}]))
            container[key] = value
        elif op == "duplicate":
            if isinstance(container, list):
                container.insert(key, copy.deepcopy(container[key]))
            else:
                container[draw(STRINGS)] = copy.deepcopy(container[key])
        elif op == "word":
            container[key] = draw(STRINGS)
        elif op == "rename" and isinstance(container, dict):
            container[draw(st.sampled_from(WORDS + KEYS[dialect]))] = container.pop(key)
        elif op == "move":  # another part of the body in this place (a tool_use block in a user message, ...)
            other, other_key = slots[draw(st.integers(0, len(slots) - 1))]
            container[key] = copy.deepcopy(other[other_key])
    return body


def shaped(dialect: str) -> st.SearchStrategy[Any]:
    """Random objects over the dialect's own keys (and now and then a body that is no object at all)."""
    keys = KEYS[dialect]
    return st.one_of(st.fixed_dictionaries({}, optional={key: JSON for key in keys}), JSON)


def check_translation(dialect: str, body: Any) -> None:
    adapter = ADAPTERS[dialect]
    try:
        request = adapter.parse_request(body, LIMITS)
    except ApiError as e:
        assert 400 <= e.status < 500, f"{e.status}: {e.message}"
        assert e.message and orjson.loads(orjson.dumps(adapter.error_body(e)))
        return
    turn = request.turn
    assert isinstance(request.stream, bool)
    assert 0 < len(turn.messages) <= LIMITS.max_messages and len(turn.tools or ()) <= LIMITS.max_tools
    template_messages(turn.messages)  # canonical: the renderer's own shape check passes
    check_tools(turn.tools)
    assert len(unpack_messages(b"".join(pack_message(m) for m in turn.messages))) == len(turn.messages)
    for name in ("max_tokens", "top_k", "seed"):
        value = getattr(turn, name)
        assert value is None or (type(value) is int and value >= -1), (name, value)
    for name in ("temperature", "top_p"):
        value = getattr(turn, name)
        assert value is None or (type(value) is float and 0.0 <= value <= 2.0), (name, value)
    assert all(type(s) is str and s for s in turn.stop)


@pytest.mark.parametrize("dialect", list(ADAPTERS))
@FUZZ
@given(data=st.data())
def test_mutated_bodies_get_a_request_or_a_4xx(dialect, data):
    check_translation(dialect, data.draw(mutated(dialect)))


@pytest.mark.parametrize("dialect", list(ADAPTERS))
@settings(FUZZ, max_examples=120)
@given(data=st.data())
def test_random_bodies_shaped_like_the_dialect_get_a_request_or_a_4xx(dialect, data):
    check_translation(dialect, data.draw(shaped(dialect)))


def test_the_mutator_reaches_both_outcomes():
    """A fuzzer whose bodies were all refused (or all accepted) would test little."""
    outcomes = set()

    @settings(max_examples=150, deadline=None, database=None, derandomize=True)
    @given(data=st.data())
    def run(data):
        body = data.draw(mutated("chat"))
        try:
            openai_chat.parse_request(body, LIMITS)
            outcomes.add("accepted")
        except ApiError:
            outcomes.add("refused")

    run()
    assert outcomes == {"accepted", "refused"}
