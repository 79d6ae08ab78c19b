"""Live splitting with the real Qwen BPE and Qwen3 parser: streamed deltas + the reconciled tail == the final parse.

Replies are tokenized with the real tokenizer and fed back in every chunking (one token at
a time, random chunks); for well-formed replies the live part must already carry the
reasoning and every tool call, and the tail only what cannot be known before the end.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from assets import TOOLS
from family_cases import stream_ids
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway_workers.adapters.common import block_events, from_list
from gateway_workers.formats import PlainTextParser, detect_parser
from gateway_workers.formats.live_split import BufferedSplitter, IncrementalDecoder, StreamTracker, live_splitter
from gateway_workers.formats.parsed import LiveDelta
from gateway_workers.rendering.renderer import Renderer

CONVERSATION = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"}]
CALL = {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}
CALL2 = {"name": "search", "arguments": {"query": "météo 巴黎 🌦"}}


def _call(c: dict) -> str:
    return f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>"


WELL_FORMED = {
    "think_text": "<think>\nI should answer.\n\nCarefully.\n</think>\n\nIt is sunny 🌞 in Paris.\n\nEnjoy!<|im_end|>",
    "think_call": f"<think>\nNeed the weather.\n</think>\n\n{_call(CALL)}<|im_end|>",
    "think_two_calls": f"<think>\nTwo lookups.\n</think>\n\nLet me check.\n{_call(CALL)}\n{_call(CALL2)}<|im_end|>",
    "text_only": "Plain answer with <b>tags</b> and a < sign.<|im_end|>",
    "trailing_space": "<think>\n\n</think>\n\nAnswer with trailing space \n<|im_end|>",
    "unicode": "<think>\n思考中…\n</think>\n\n答案是 42 ✓<|im_end|>",
    "truncated_text": "<think>\nok\n</think>\n\nThe answer is cut off mid",
}


@pytest.fixture(scope="module")
def setup(qwen3_tokenizer):
    rendered = Renderer(qwen3_tokenizer).render(CONVERSATION, TOOLS)
    return qwen3_tokenizer, detect_parser(qwen3_tokenizer), rendered


def _decode(tokenizer):
    backend = tokenizer.backend_tokenizer
    return lambda ids: backend.decode(ids, skip_special_tokens=False)


def _stream(setup, text: str, cuts: list[int] | None = None):
    """(live deltas, tail deltas, consistent, final parse) for `text` fed in chunks of ids."""
    tokenizer, parser, rendered = setup
    return stream_ids(tokenizer, parser, rendered.text, tokenizer.encode(text, add_special_tokens=False), TOOLS, cuts)


def _joined(deltas: list[LiveDelta], kind: str) -> str:
    return "".join(d.text for d in deltas if d.kind == kind)


def _assert_equals_final(live, tail, consistent, final):
    everything = live + tail
    assert consistent
    assert _joined(everything, "reasoning") == (final.reasoning or "")
    assert _joined(everything, "content") == final.content
    assert [d.call for d in everything if d.kind == "tool_call"] == final.tool_calls


@pytest.mark.parametrize("name", sorted(WELL_FORMED))
def test_token_by_token_stream_is_the_final_parse_and_mostly_live(setup, name):
    live, tail, consistent, final = _stream(setup, WELL_FORMED[name])
    assert not final.ill_formed, final.error
    _assert_equals_final(live, tail, consistent, final)
    # Reasoning and tool calls are fully streamed live; only whitespace a tag might have swallowed waits.
    assert all(d.kind == "content" and not d.text.strip() for d in tail), tail
    if final.reasoning:
        assert live[0].kind == "reasoning"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(WELL_FORMED)), cuts=st.lists(st.integers(1, 80), max_size=12))
def test_any_chunking_gives_the_same_result(setup, name, cuts):
    _assert_equals_final(*_stream(setup, WELL_FORMED[name], cuts))


def test_decoder_never_splits_a_character(qwen3_tokenizer):
    text = "naïve 😀 emoji, 中文字符, ∑ math 🇫🇷 flags"
    ids = qwen3_tokenizer.encode(text, add_special_tokens=False)
    decoder = IncrementalDecoder(_decode(qwen3_tokenizer))
    pieces = [decoder.feed([i]) for i in ids]
    assert "".join(pieces) + decoder.flush() == text
    assert not any("\ufffd" in p for p in pieces)


def test_ill_formed_replies_are_reported_as_diverged(setup):
    # An unterminated think block: streamed as reasoning, but the final parse keeps it all as raw text.
    live, tail, consistent, final = _stream(setup, "<think>\nstill thinking when the budget ran out")
    assert final.ill_formed and not consistent
    assert _joined(live, "reasoning") and _joined(tail, "content") == final.content
    # A tool call with broken JSON is never streamed as a call.
    live, _, _, final = _stream(setup, "<think>\nx\n</think>\n\n<tool_call>\n{not json}\n</tool_call><|im_end|>")
    assert final.ill_formed and not any(d.kind == "tool_call" for d in live)


def test_text_after_tool_calls_comes_from_the_final_parse(setup):
    reply = f"<think>\nx\n</think>\n\n{_call(CALL)}\nAnd one more thing.<|im_end|>"
    live, tail, consistent, final = _stream(setup, reply)
    _assert_equals_final(live, tail, consistent, final)
    assert [d.kind for d in live] == ["reasoning", "tool_call"]


def test_a_prompt_that_opens_the_think_block_starts_in_reasoning(setup):
    tokenizer, parser, rendered = setup
    splitter = live_splitter(parser, rendered.text + "<think>\n")
    assert splitter.feed("pondering\n</think>\n\nDone.") == [
        LiveDelta("reasoning", "pondering"),
        LiveDelta("content", "Done."),
    ]
    closed = live_splitter(parser, rendered.text + "<think>\n\n</think>\n\n")
    assert closed.feed("Straight to the answer") == [LiveDelta("content", "Straight to the answer")]


def test_parsers_from_outside_the_registry_stream_at_the_end(qwen3_tokenizer):
    assert isinstance(live_splitter(PlainTextParser(qwen3_tokenizer), ""), BufferedSplitter)
    tracker = StreamTracker()
    final = type("P", (), {"reasoning": "r", "content": "c", "tool_calls": [CALL]})()
    tail, consistent = tracker.remainder(final)  # type: ignore[arg-type]
    assert consistent and [d.kind for d in tail] == ["reasoning", "content", "tool_call"]


def test_block_events_group_text_and_isolate_calls():
    deltas = [
        LiveDelta("reasoning", "a"),
        LiveDelta("reasoning", "b"),
        LiveDelta("content", "c"),
        LiveDelta("tool_call", call=CALL),
        LiveDelta("tool_call", call=CALL2),
        LiveDelta("content", "d"),
    ]

    async def collect():
        return [(e.action, e.index, e.kind, e.text, e.call_index) async for e in block_events(from_list(deltas))]

    assert asyncio.run(collect()) == [
        ("open", 0, "reasoning", "", 0),
        ("delta", 0, "reasoning", "a", 0),
        ("delta", 0, "reasoning", "b", 0),
        ("close", 0, "reasoning", "", 0),
        ("open", 1, "content", "", 0),
        ("delta", 1, "content", "c", 0),
        ("close", 1, "content", "", 0),
        ("open", 2, "tool_call", "", 0),
        ("close", 2, "tool_call", "", 0),
        ("open", 3, "tool_call", "", 1),
        ("close", 3, "tool_call", "", 1),
        ("open", 4, "content", "", 0),
        ("delta", 4, "content", "d", 0),
        ("close", 4, "content", "", 0),
    ]
