"""The JSON-call formats' native reader against transformers' declarative engine, which it stands in for.

Property: on every body that passes the format's check and that the reader takes, it reads exactly what
the engine reads (content, reasoning, calls). Bodies are built from the tags, the whitespace the engine's
`\\s` does and does not cover, and JSON that is a call, OpenAI-shaped, not an object, or not JSON.
"""

from __future__ import annotations

import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway_workers.formats import FormatParser
from gateway_workers.formats.base import _reading
from gateway_workers.formats.chatml import QWEN2_5, QWEN3
from gateway_workers.formats.legacy import SCHEMAS
from gateway_workers.rendering.twins.checks import VERIFY_FIRST

SPACES = ["\n", " ", "\t", "\r\n", "\u00a0", "\u3000", "\x1c", "\x1f", "\x85", "\u200b"]
TEXT = ["", "Hi", "é 12", "{", "}", "<", "<tool", "think>", '"q"', "\\n", "<|im_start|>"]
CALLS = [
    '{"name": "search", "arguments": {"query": "q1"}}',
    '{"name": "f", "arguments": {"n": 1, "x": [1.5, null, true], "s": "</think>"}}',
    '{"name":"g","arguments":"{\\"a\\": 2}"}',
    '{"type": "function", "function": {"name": "f", "arguments": {"n": "3"}}}',
    '{"name": "f", "parameters": {"k": NaN}}',
    "[1, 2]",
    '"just text"',
    "{not json",
    "",
]


@st.composite
def bodies(draw: st.DrawFn) -> str:
    """Mostly well-formed replies (so the property is not vacuous), sometimes any tag soup."""
    if draw(st.integers(0, 5)) == 0:
        atoms = [*SPACES, *TEXT, "<think>", "</think>", "<tool_call>", "</tool_call>", *CALLS]
        return "".join(draw(st.lists(st.sampled_from(atoms), max_size=12)))
    ws = st.lists(st.sampled_from(SPACES), max_size=3).map("".join)
    text = st.lists(st.sampled_from([*TEXT, *SPACES]), max_size=4).map("".join)
    out = draw(ws)
    if draw(st.booleans()):
        out += "<think>" + draw(text) + "</think>"
    out += draw(text)
    for _ in range(draw(st.integers(0, 3))):
        out += draw(ws) + "<tool_call>" + draw(ws) + draw(st.sampled_from(CALLS)) + draw(ws) + "</tool_call>"
        out += draw(text)
    return out


@pytest.fixture(scope="module", params=[QWEN3, QWEN2_5], ids=lambda f: f.name)
def parser(request, builtin_tokenizer) -> FormatParser:
    return FormatParser(builtin_tokenizer, request.param)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies(), head=st.sampled_from(["", "<think>\n", "<think>\nplan "]))
def test_the_reader_reads_every_checked_body_as_the_engine_does(parser: FormatParser, body: str, head: str) -> None:
    full = head + body
    if not isinstance(parser.format.check(full), int):
        return  # ill-formed: neither reads it
    assert parser.format.native_reader is not None
    found = parser.format.native_reader(full)
    try:
        expected = parser._run_engine(body, head, None)
    except ValueError:
        assert found is None  # the engine's verdict (not JSON) is left to the engine
        return
    if found is not None:
        assert _reading(found) == _reading(expected)


def test_the_reader_takes_ordinary_replies(parser: FormatParser) -> None:
    """Not vacuous: plain replies with reasoning, text and parallel calls are read natively."""
    body = '<think>\nTwo calls.\n</think>\n\nChecking.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>'
    body += '\n<tool_call>\n{"name": "b", "arguments": {"k": [1]}}\n</tool_call>'
    found = parser.format.native_reader(body)
    assert found is not None and len(found["tool_calls"]) == 2
    assert _reading(found) == _reading(parser._run_engine(body, "", None))


def test_parse_uses_the_reader_and_checks_a_sample(parser: FormatParser, builtin_tokenizer, monkeypatch) -> None:
    engine_calls = []
    run_engine = parser._run_engine

    def counting(*args):
        engine_calls.append(args)
        return run_engine(*args)

    monkeypatch.setattr(parser.reader_twin, "exact", counting)
    monkeypatch.setattr(parser.reader_twin, "uses", 0)
    ids = builtin_tokenizer.encode('Done.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>')
    results = {repr(parser.parse(ids, "<|im_start|>assistant\n")) for _ in range(VERIFY_FIRST + 20)}
    assert len(engine_calls) == VERIFY_FIRST  # then one in VERIFY_EVERY
    assert len(results) == 1 and "'x': 1" in results.pop()


def test_a_reader_that_differs_is_dropped_for_the_engine(parser: FormatParser, builtin_tokenizer, monkeypatch,
                                                        caplog) -> None:
    wrong = {"content": "wrong", "reasoning": None, "tool_calls": []}
    monkeypatch.setattr(parser.reader_twin, "fast", lambda body: wrong)
    monkeypatch.setattr(parser.reader_twin, "uses", 0)
    monkeypatch.setattr(parser.reader_twin, "active", True)  # switched back on for the module's later tests
    ids = builtin_tokenizer.encode("The answer is 4.")
    with caplog.at_level(logging.ERROR):
        parsed = parser.parse(ids, "<|im_start|>assistant\n")
    assert parsed.content == "The answer is 4." and not parsed.ill_formed
    assert not parser.reader_twin.active and "native reader differs" in caplog.text
    assert parser.parse(ids, "<|im_start|>assistant\n").content == "The answer is 4."


def test_the_legacy_engine_has_no_twin(builtin_tokenizer) -> None:
    """The legacy schemas read some edges their own way (their regexes' whitespace): no reader there."""
    assert FormatParser(builtin_tokenizer, QWEN3, engine="schema", legacy_schema=SCHEMAS["qwen3"]).reader_twin is None
