"""The bad-request corpus (`tests/bad_requests.py`) through each adapter: every entry gets its status, code and field.

Each entry runs through its dialect's `parse_request` under the corpus' small `LIMITS` and must raise
the ApiError it names, rendered by the adapter's `error_body` in the dialect's own shape. The same
entries go to a real `serve` in `tests/process/test_bad_requests_served.py`. The last tests pin what
the real APIs accept and the gateway must accept too (the other side of strictness).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import orjson
import pytest
from bad_requests import ACCEPTED, CORPUS, GOOD, LIMITS, BadRequest, mismatch

from gateway_workers.adapters import anthropic_messages, openai_chat, openai_responses
from gateway_workers.http import limits
from gateway_workers.http.errors import ApiError
from gateway_workers.rendering.messages import template_messages

ADAPTERS: dict[str, Any] = {"chat": openai_chat, "messages": anthropic_messages, "responses": openai_responses}
# String lengths are checked on the whole decoded body by the HTTP edge (`limits.check_strings`): an `edge`
# entry is refused there when its adapter takes it.


def _refusal(entry: BadRequest) -> ApiError:
    """The ApiError the entry gets: from its adapter, or (an over-long string) from the edge's string check."""
    try:
        ADAPTERS[entry.dialect].parse_request(entry.body, LIMITS)
    except ApiError as e:
        return e
    if entry.edge is not None:
        try:
            limits.check_strings(entry.body, LIMITS)
        except ApiError as e:
            return e
    pytest.fail(f"{entry.name} was accepted")


def test_the_corpus_holds_at_least_200_named_entries_over_the_three_dialects():
    counts = Counter(entry.dialect for entry in CORPUS)
    assert len(CORPUS) >= 200 and set(counts) == set(ADAPTERS) and min(counts.values()) >= 60, counts
    assert len({entry.name for entry in CORPUS}) == len(CORPUS)


def test_every_entry_is_json_within_the_body_limit():
    """So a served entry is answered by its adapter, never by the body limit."""
    for entry in CORPUS:
        assert len(orjson.dumps(entry.body)) < LIMITS.max_body_bytes, entry.name


@pytest.mark.parametrize("dialect", list(GOOD))
def test_the_good_bodies_the_entries_start_from_are_accepted(dialect):
    for body in GOOD[dialect]:
        request = ADAPTERS[dialect].parse_request(body, LIMITS)
        assert request.turn.messages and template_messages(request.turn.messages)


@pytest.mark.parametrize("dialect", list(ACCEPTED))
def test_what_the_real_apis_accept_is_accepted(dialect):
    """Bodies this corpus once refused: parsed, rendered, and anything hosted noted rather than refused."""
    for body in ACCEPTED[dialect]:
        request = ADAPTERS[dialect].parse_request(body, LIMITS)
        assert request.turn.messages and template_messages(request.turn.messages)
        hosted = [tool for tool in body.get("tools", []) if tool.get("type", "custom") not in ("function", "custom",
                                                                                               "namespace")]
        assert len(request.hosted) == len(hosted) + ("web_search_options" in body), body


@pytest.mark.parametrize("entry", CORPUS, ids=lambda entry: entry.name)
def test_a_bad_request_gets_its_status_code_and_field(entry: BadRequest):
    error = _refusal(entry)
    problem = mismatch(entry, error.status, orjson.loads(orjson.dumps(ADAPTERS[entry.dialect].error_body(error))))
    assert problem is None, f"{entry.name}: {problem}"


def test_mismatch_tells_a_wrong_answer():
    entry = next(e for e in CORPUS if e.name == "chat-tool-call-id-missing")
    right = {"error": {"message": "m", "type": "invalid_request_error", "param": entry.field, "code": entry.code}}
    assert mismatch(entry, 400, right) is None
    assert "status" in mismatch(entry, 500, right)
    assert "param" in mismatch(entry, 400, {"error": {**right["error"], "param": "messages"}})
    assert "shape" in mismatch(entry, 400, {"type": "error", "message": "m"})
    anthropic = next(e for e in CORPUS if e.name == "messages-tool_use-id-missing")
    assert "name" in mismatch(anthropic, 400, {"type": "error", "error": {"type": anthropic.code, "message": "x"}})


# --- what the real APIs accept ------------------------------------------------------------------


def _chat_echo(arguments: str) -> dict[str, Any]:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return {"model": "m", "messages": [{"role": "user", "content": "hi"},
                                       {"role": "assistant", "content": None, "tool_calls": [call]},
                                       {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]}


@pytest.mark.parametrize("arguments", ["[1, 2]", "5", '"Oslo"', "null", "not json"])
def test_echoed_arguments_that_are_not_a_json_object_stay_text(arguments):
    """The APIs take any string as a call's arguments; only an object is parsed, so the template can render it."""
    chat = openai_chat.parse_request(_chat_echo(arguments), LIMITS).turn.messages[1]
    items = [{"type": "message", "role": "user", "content": "hi"},
             {"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": arguments},
             {"type": "function_call_output", "call_id": "c", "output": "ok"}]
    responses = openai_responses.parse_request({"input": items}, LIMITS).turn.messages[1]
    for message in (chat, responses):
        assert message["tool_calls"][0]["arguments"] == arguments
        assert template_messages([message])[0]["tool_calls"][0]["function"]["arguments"] == arguments


def test_object_arguments_are_still_parsed():
    message = openai_chat.parse_request(_chat_echo('{"city": "Oslo"}'), LIMITS).turn.messages[1]
    assert message["tool_calls"][0]["arguments"] == {"city": "Oslo"}


def test_null_stands_for_an_absent_parameter():
    nulls = {"model": None, "user": None, "stream_options": None, "parallel_tool_calls": None, "n": None,
             "metadata": None, "seed": None, "stop": None, "temperature": None}
    assert len(openai_chat.parse_request({**_chat_echo("{}"), **nulls}, LIMITS).turn.messages) == 3


@pytest.mark.parametrize("name", ["get_weather", "a", "A-b_9", "x" * 64])
def test_tool_names_the_apis_allow_are_accepted(name):
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}]}
    assert openai_chat.parse_request(chat, LIMITS).turn.tools[0]["function"]["name"] == name
    messages = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"name": name + "y" * 64, "input_schema": {"type": "object"}}]}
    assert anthropic_messages.parse_request(messages, LIMITS).turn.tools[0]["function"]["name"] == name + "y" * 64
