"""A request parsed with the session's previous one (`Adapter.parse_request`'s `earlier`) is the request parsed
without it, and takes that one's canonical messages for the elements it shares with it.

The next bodies are built as `http.bodies` builds an extension's value: the earlier body's fields and
history elements, the same objects, with elements appended; and as an agent may send them instead: a
history element or the system prompt / instructions replaced by an equal copy or by something else.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from bad_requests import GOOD, LIMITS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_fuzz_adapters import ADAPTERS, JSON, mutated

from gateway_workers.http.errors import ApiError

FIELDS = {"chat": "messages", "messages": "messages", "responses": "input"}
PREAMBLE = {"chat": None, "messages": "system", "responses": "instructions"}  # what else makes the first messages
PROPERTY = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def _histories(dialect: str) -> list[dict[str, Any]]:
    """The dialect's valid bodies with a history list, and their longest history cut at every element."""
    field = FIELDS[dialect]
    bodies = [b for b in GOOD[dialect] if isinstance(b.get(field), list)]
    longest = max(bodies, key=lambda b: len(b[field]))
    return bodies + [{**longest, field: longest[field][:n]} for n in range(1, len(longest[field]))]


def _elements(dialect: str) -> list[Any]:
    return [e for b in GOOD[dialect] if isinstance(b.get(FIELDS[dialect]), list) for e in b[FIELDS[dialect]]]


def _outcome(dialect: str, body: Any, earlier: Any = None) -> tuple[Any, ...]:
    try:
        request = ADAPTERS[dialect].parse_request(body, LIMITS, earlier)
    except ApiError as e:
        return ("refused", e.status, e.kind, e.message, e.param, e.code)
    # `ignored` names what the request adds to its predecessor (what is counted), so it differs by design
    kept = {k: v for k, v in _fields(request).items() if k not in ("turn", "ignored")}
    return ("parsed", request.turn, kept)


def _fields(request: Any) -> dict[str, Any]:
    slots = type(request).__slots__
    return {name: getattr(request, name) for name in slots}


def _new_object(value: Any) -> Any:
    """An equal value that is another object (a string too: copy.deepcopy keeps strings)."""
    return (value + "x")[:-1] if isinstance(value, str) and value else copy.deepcopy(value)


@st.composite
def next_body(draw: st.DrawFn, dialect: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(an earlier body, the next body): the earlier one's value with elements appended, and now and then a
    shared element or the preamble replaced."""
    field, preamble = FIELDS[dialect], PREAMBLE[dialect]
    earlier = draw(st.sampled_from(_histories(dialect)))
    element = st.one_of(
        st.sampled_from(_elements(dialect)).map(copy.deepcopy),
        mutated(dialect).map(lambda b: b.get(FIELDS[dialect]) if isinstance(b, dict) else b).flatmap(
            lambda h: st.sampled_from(h) if isinstance(h, list) and h else st.just(h)),
        JSON,
    )
    history = [*earlier[field], *draw(st.lists(element, max_size=4))]
    if draw(st.integers(0, 4)) == 0:  # a shared element replaced: equal, or another one
        at = draw(st.integers(0, len(earlier[field]) - 1))
        history[at] = draw(st.sampled_from([_new_object(history[at]), draw(element)]))
    body = {**earlier, field: history}
    if preamble is not None and draw(st.integers(0, 3)) == 0:
        body[preamble] = draw(st.sampled_from([_new_object(earlier.get(preamble)), "Be long.", None]))
    return earlier, body


@pytest.mark.parametrize("dialect", list(ADAPTERS))
@PROPERTY
@given(data=st.data())
def test_a_request_parsed_with_its_predecessor_is_the_request_parsed_alone(dialect: str, data: st.DataObject) -> None:
    earlier_body, body = data.draw(next_body(dialect))
    try:
        earlier = ADAPTERS[dialect].parse_request(earlier_body, LIMITS)
    except ApiError:
        return  # only a request that was served is kept for its successor
    assert _outcome(dialect, body, earlier) == _outcome(dialect, body)


# Each dialect's next request in an agent's loop: the reply echoed and answered, then a question.
_NEXT = {
    "chat": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Bergen"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}, {"role": "user", "content": "And now?"}],
    "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_9", "name": "get_weather",
                                                   "input": {"city": "Bergen"}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "sunny"}]}],
    "responses": [{"type": "function_call", "call_id": "call_9", "name": "get_weather",
                   "arguments": '{"city": "Bergen"}'},
                  {"type": "function_call_output", "call_id": "call_9", "output": "sunny"},
                  {"type": "message", "role": "user", "content": "And now?"}],
}


def _agent_bodies(dialect: str) -> tuple[dict[str, Any], dict[str, Any]]:
    field = FIELDS[dialect]
    first = copy.deepcopy(next(b for b in GOOD[dialect] if isinstance(b.get(field), list) and len(b[field]) > 1))
    if dialect == "responses":  # ends with the reply's message: the agent's answer closes that model turn
        first[field].append({"type": "message", "role": "user", "content": "Thanks."})
    return first, {**first, field: [*first[field], *copy.deepcopy(_NEXT[dialect])]}


@pytest.mark.parametrize("dialect", list(ADAPTERS))
def test_the_shared_elements_messages_are_the_earlier_requests_own(dialect: str) -> None:
    adapter = ADAPTERS[dialect]
    first, second = _agent_bodies(dialect)
    earlier = adapter.parse_request(first, LIMITS)
    held = earlier.turn.messages
    request = adapter.parse_request(second, LIMITS, earlier)
    assert len(request.turn.messages) > len(held)
    assert all(a is b for a, b in zip(request.turn.messages, held, strict=False))
    assert request.turn.messages is not held  # its own list: the earlier request's is left as it was
    assert request.turn == adapter.parse_request(second, LIMITS).turn
    repeated = adapter.parse_request(second, LIMITS, request)  # a retry of the same body
    assert repeated.turn == request.turn
    assert all(a is b for a, b in zip(repeated.turn.messages, request.turn.messages, strict=True))


@pytest.mark.parametrize("dialect", list(ADAPTERS))
def test_nothing_is_taken_when_an_element_or_the_preamble_is_another_object(dialect: str) -> None:
    adapter = ADAPTERS[dialect]
    field, preamble = FIELDS[dialect], PREAMBLE[dialect]
    first, second = _agent_bodies(dialect)
    earlier = adapter.parse_request(first, LIMITS)
    copied = {**second, field: [copy.deepcopy(second[field][0]), *second[field][1:]]}
    variants = [copied]
    if preamble is not None:
        variants.append({**second, preamble: "Be long."})
    for body in variants:
        request = adapter.parse_request(body, LIMITS, earlier)
        assert not any(a is b for a, b in zip(request.turn.messages, earlier.turn.messages, strict=False))
        assert request.turn == adapter.parse_request(body, LIMITS).turn


def test_a_responses_model_turn_left_open_is_folded_again_with_what_follows() -> None:
    """An input that ends with the assistant's message, extended by that turn's function call: the call joins
    the message's turn (one assistant message), which a parse of the new items alone would not do."""
    adapter = ADAPTERS["responses"]
    first = {"input": [{"type": "message", "role": "user", "content": "hi"},
                       {"type": "message", "role": "assistant", "content": "Let me look."}]}
    second = {**first, "input": [*first["input"], *copy.deepcopy(_NEXT["responses"])]}
    request = adapter.parse_request(second, LIMITS, adapter.parse_request(first, LIMITS))
    assert [m["role"] for m in request.turn.messages] == ["user", "assistant", "tool", "user"]
    assert request.turn.messages[1]["content"] == "Let me look." and request.turn.messages[1]["tool_calls"]
    assert request.turn == adapter.parse_request(second, LIMITS).turn


def test_a_responses_request_that_names_a_previous_response_takes_nothing() -> None:
    adapter = ADAPTERS["responses"]
    first, second = _agent_bodies("responses")
    earlier = adapter.parse_request(first, LIMITS)
    chained = {**second, "previous_response_id": "resp_" + "0" * 32}
    request = adapter.parse_request(chained, LIMITS, earlier)
    assert not any(a is b for a, b in zip(request.turn.messages, earlier.turn.messages, strict=False))
    assert request.turn == adapter.parse_request(chained, LIMITS).turn


def test_a_responses_request_after_one_that_named_a_previous_response_takes_nothing() -> None:
    """That request's messages left its call outputs unchecked (the response they answer was not loaded yet): a
    successor standing alone must answer its calls itself, and is refused when it does not."""
    adapter = ADAPTERS["responses"]
    output = {"type": "function_call_output", "call_id": "call_earlier", "output": "sunny"}
    first = {"previous_response_id": "resp_" + "0" * 32, "input": [output, {"role": "user", "content": "And now?"}]}
    earlier = adapter.parse_request(first, LIMITS)
    alone = {"input": [*first["input"], {"role": "user", "content": "Well?"}]}
    assert _outcome("responses", alone, earlier) == _outcome("responses", alone)
    assert _outcome("responses", alone)[0] == "refused"
