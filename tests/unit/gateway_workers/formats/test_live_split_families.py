"""Every family streams live: its real template, its test tokenizer, the reply fed one token at a time.

Per family, the replies are the template's own rendering of the richest message it can hold
(reasoning, text, parallel calls) and what the fake engine's writer samples (calls, then an
answer). Streamed deltas plus the reconciled tail must equal the non-streamed parse of the same
ids, in any chunking; reasoning and (where a call does not end the generation) every tool call
must already be live, the tail holding at most whitespace a tag could have swallowed.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from fake_formats import FAMILIES, WRITERS, plan, read_prompt
from family_cases import ALL_TOOLS, QUESTION, encode, family_tokenizer, render, reply_for, sampled, stream_ids
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway_workers.formats import ParsedResponse, detect_parser
from gateway_workers.formats.live_split import BufferedSplitter, live_splitter
from gateway_workers.formats.parsed import LiveDelta

# A call ends the generation in these formats (harmony's <|call|>, Llama's whole-reply call): it comes with
# the final parse, after the engine stopped, exactly when the agent could act on it anyway.
CALLS_AT_THE_END = {"gpt_oss", "llama3_json"}


def _replies(key: str) -> dict[str, tuple[str, str]]:
    """name -> (prompt text, reply text) for this family."""
    tokenizer = family_tokenizer(key)
    family = FAMILIES[key]
    prompt = render(tokenizer, key, QUESTION, add_generation_prompt=True)
    out: dict[str, tuple[str, str]] = {"richest": sampled(tokenizer, key, reply_for(key))}
    text_only = {k: v for k, v in reply_for(key).items() if k != "tool_calls"}
    text_only["content"] = text_only["content"] or "A plain answer."
    out["text"] = sampled(tokenizer, key, text_only)
    writer = WRITERS[family.writer]
    asked = read_prompt(prompt, writer.layout, writer.tools)
    for name, rounds in (("writer_calls", 3), ("writer_answer", 0), ("writer_padded", 0)):
        written = plan(asked, random.Random(name), b"\x01\x02", rounds, writer.parallel)
        if name == "writer_padded":  # what the template would never write, but a model may sample: each
            # format's parse trims it its own way, and the live text must trim the same
            written["reasoning"] = f" \n {written['reasoning']} \n\n "
            written["text"] = f"\n \n{written['text']}\n\n  \n"
        stop = writer.stops[-1] if written["calls"] and len(writer.stops) > 1 else writer.stops[0]
        out[name] = (prompt, writer.write(written) + stop)
    return out


_CASES = [
    (key, name)
    for key in sorted(FAMILIES)
    for name in ("richest", "text", "writer_calls", "writer_answer", "writer_padded")
]


def _stream(key: str, prompt: str, reply: str, cuts: list[int] | None = None):
    tokenizer = family_tokenizer(key)
    return stream_ids(tokenizer, detect_parser(tokenizer), prompt, encode(tokenizer, reply), ALL_TOOLS, cuts)


def _assert_is(final: ParsedResponse, live: list[LiveDelta], tail: list[LiveDelta], consistent: bool) -> None:
    everything = live + tail
    assert consistent, (live, tail, final)
    assert "".join(d.text for d in everything if d.kind == "reasoning") == (final.reasoning or "")
    assert "".join(d.text for d in everything if d.kind == "content") == final.content
    assert [d.call for d in everything if d.kind == "tool_call"] == final.tool_calls


@pytest.mark.parametrize(("key", "name"), _CASES)
def test_token_by_token_stream_is_the_final_parse(key: str, name: str) -> None:
    prompt, reply = _replies(key)[name]
    live, tail, consistent, final = _stream(key, prompt, reply)
    assert not final.ill_formed, (final.error, reply)
    _assert_is(final, live, tail, consistent)
    assert not isinstance(live_splitter(detect_parser(family_tokenizer(key)), prompt), BufferedSplitter)
    assert not any(d.kind == "reasoning" for d in tail), tail  # reasoning is always live
    assert all(d.text.strip() == "" for d in tail if d.kind == "content"), tail
    if FAMILIES[key].format_name not in CALLS_AT_THE_END:
        assert not any(d.kind == "tool_call" for d in tail), tail
    if final.reasoning:
        assert live[0].kind == "reasoning", live[:2]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(_CASES), cuts=st.lists(st.integers(1, 120), max_size=12))
def test_any_chunking_gives_the_same_result(case: tuple[str, str], cuts: list[int]) -> None:
    key, name = case
    prompt, reply = _replies(key)[name]
    live, tail, consistent, final = _stream(key, prompt, reply, cuts)
    _assert_is(final, live, tail, consistent)


@pytest.mark.parametrize("key", sorted(k for k, f in FAMILIES.items() if f.tools))
def test_a_cut_reply_never_streams_a_call_the_parse_lacks_beyond_those_complete(key: str) -> None:
    """Cut anywhere: what was streamed is the start of the complete reply's parse, never something else."""
    prompt, reply = _replies(key)["writer_calls"]
    tokenizer = family_tokenizer(key)
    ids = encode(tokenizer, reply)
    complete = detect_parser(tokenizer).parse(ids, prompt, ALL_TOOLS)
    for cut in range(1, len(ids), 3):
        live, _, _, _ = _stream(key, prompt, tokenizer.decode(ids[:cut], skip_special_tokens=False))
        calls: list[dict[str, Any]] = [d.call for d in live if d.kind == "tool_call"]  # type: ignore[misc]
        assert calls == complete.tool_calls[: len(calls)], (cut, calls)
        for kind, value in (("reasoning", complete.reasoning or ""), ("content", complete.content)):
            assert value.startswith("".join(d.text for d in live if d.kind == kind)), (cut, kind, live)
