"""Qwen3 response parsing through transformers' parse_response, on real templates and real token ids."""

from __future__ import annotations

import copy
import importlib.metadata

import pytest
import transformers
from assets import TOOLS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from packaging.version import Version

from gateway_workers.formats import FormatParser, ParsedResponse, ParserUnavailable, detect_parser, parsing_engine
from gateway_workers.rendering.messages import template_messages
from gateway_workers.rendering.renderer import Renderer

QUESTION = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "Weather in Paris and Lyon, then a search?"},
]
REPLY = {
    "role": "assistant",
    "content": "I will check both cities.",
    "reasoning": "Two cities: call get_weather twice.\nThen summarise.",
    "tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
        {"name": "get_weather", "arguments": {"city": "Lyon", "units": {"temp": "C"}, "flags": [1, 2.5, None, True]}},
    ],
}


_RENDERERS: dict[int, Renderer] = {}


def renderer(tokenizer) -> Renderer:
    """One Renderer per tokenizer: building one probes the tokenizer, which costs seconds."""
    if id(tokenizer) not in _RENDERERS:
        _RENDERERS[id(tokenizer)] = Renderer(tokenizer)
    return _RENDERERS[id(tokenizer)]


@pytest.fixture(scope="module", params=["builtin", "qwen3"])
def tokenizer(request, builtin_tokenizer, qwen3_tokenizer):
    return builtin_tokenizer if request.param == "builtin" else qwen3_tokenizer


def sampled_ids(tokenizer, prompt: list[dict], reply: dict) -> tuple[str, list[int]]:
    """(prompt text, reply ids) as a model would have produced the reply: the template's own rendering."""
    prefix = renderer(tokenizer).render(prompt, TOOLS).text
    full = tokenizer.apply_chat_template(template_messages([*prompt, reply]), tools=TOOLS, tokenize=False)
    assert full.startswith(prefix)
    out = full[len(prefix) :]
    assert out.endswith("<|im_end|>\n")
    return prefix, tokenizer.encode(out[:-1], add_special_tokens=False)  # the model stops at <|im_end|>


def test_round_trip_reasoning_text_and_parallel_calls(tokenizer):
    parser = detect_parser(tokenizer)
    prefix, ids = sampled_ids(tokenizer, QUESTION, REPLY)
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    parsed = parser.parse(ids, prefix, TOOLS)
    assert not parsed.ill_formed and parsed.error is None
    assert parsed.canonical_message() == REPLY
    # The prompt may be given as ids too (only its last assistant header is decoded).
    prompt_ids = renderer(tokenizer).render(QUESTION, TOOLS).prompt_ids
    assert parser.parse(ids, prompt_ids, TOOLS) == parsed


@pytest.mark.parametrize(
    "reply",
    [
        {"role": "assistant", "content": "Just text, no thinking."},
        {"role": "assistant", "content": "Plain answer.", "reasoning": "short"},
        {"role": "assistant", "content": "", "reasoning": "", "tool_calls": [{"name": "search", "arguments": {}}]},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "search", "arguments": {"query": 'ü "q"'}}]},
    ],
)
def test_round_trip_other_shapes(tokenizer, reply):
    prefix, ids = sampled_ids(tokenizer, QUESTION, reply)
    expected = dict(reply)
    if tokenizer.convert_tokens_to_ids("<think>") in ids:
        # Qwen3's template writes an empty think block into the final turn even without reasoning.
        expected.setdefault("reasoning", "")
    assert detect_parser(tokenizer).parse(ids, prefix, TOOLS).canonical_message() == expected


def test_generation_prompt_that_prefills_think(qwen3_tokenizer):
    """Templates that write (part of) the think block into the prompt must still parse right."""
    parser = detect_parser(qwen3_tokenizer)
    encode = lambda text: qwen3_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    closed = Renderer(qwen3_tokenizer, template_kwargs={"enable_thinking": False}).render(QUESTION).text
    assert closed.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    parsed = parser.parse(encode("Hello there.<|im_end|>"), closed)
    assert (parsed.content, parsed.reasoning, parsed.ill_formed) == ("Hello there.", "", False)
    opened = closed[: -len("\n</think>\n\n")]  # a template that opens <think> and lets the model close it
    parsed = parser.parse(encode("I should greet.\n</think>\n\nHello.<|im_end|>"), opened)
    assert (parsed.content, parsed.reasoning, parsed.ill_formed) == ("Hello.", "I should greet.", False)
    # Without the prefix the same ids are a stray </think>: the prefix is what makes them valid.
    assert parser.parse(encode("I should greet.\n</think>\n\nHello.<|im_end|>"), "").ill_formed


@pytest.mark.parametrize(
    ("output", "error"),
    [
        ('<tool_call>\n{"name": "search", "arguments": {"query": "x"}', "unterminated <tool_call>"),
        ('<tool_call>\n{"name": "search", "arguments": {"query": }}\n</tool_call>', "unparseable"),
        ('<tool_call>\n{"name": "search", "arguments": "not json"}\n</tool_call>', "non-JSON arguments"),
        ('<tool_call>\n{"name": "search", "arguments": [1]}\n</tool_call>', "not a JSON object"),
        ('<tool_call>\n{"arguments": {}}\n</tool_call>', "without a function name"),
        ('<tool_call>\n["search"]\n</tool_call>', "not a JSON object"),
        ('<think>\n<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>\n</think>\n\nok', "inside <think>"),
        ("<think>\nI was cut off while thinking", "unterminated <think>"),
        ("<think>\na\n</think>\n\n<think>\nb\n</think>\n\nc", "malformed <think>"),
        ("Sure.\n<think>\nlate\n</think>", "after the start"),
        ("text</tool_call>", "without <tool_call>"),
        ("<tool_call>\n<tool_call>\n{}\n</tool_call>\n</tool_call>", "nested"),
    ],
)
def test_malformed_output_degrades_to_raw_text(tokenizer, output, error):
    prefix = renderer(tokenizer).render(QUESTION, TOOLS).text
    ids = tokenizer.encode(output + "<|im_end|>", add_special_tokens=False)
    parsed = detect_parser(tokenizer).parse(ids, prefix, TOOLS)
    assert parsed == ParsedResponse(content=output, reasoning=None, tool_calls=[], ill_formed=True, error=parsed.error)
    assert error in parsed.error


def test_end_markers_are_stripped_and_truncation_is_not_ill_formed(builtin_tokenizer):
    parser = detect_parser(builtin_tokenizer)
    prefix = renderer(builtin_tokenizer).render(QUESTION).text
    encode = lambda text: builtin_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    for tail in ("<|im_end|>", "<|im_end|>\n<|endoftext|>", "<|endoftext|>", ""):
        parsed = parser.parse(encode("<think>\nr\n</think>\n\nAnswer." + tail), prefix)
        assert (parsed.content, parsed.reasoning, parsed.ill_formed) == ("Answer.", "r", False), tail
    # Cut by max_tokens in plain text: a partial answer, not a malformed one (finish_reason tells).
    cut = parser.parse(encode("<think>\nr\n</think>\n\nThe answer is"), prefix)
    assert (cut.content, cut.ill_formed) == ("The answer is", False)
    empty = parser.parse([], prefix)
    assert (empty.content, empty.reasoning, empty.tool_calls, empty.ill_formed) == ("", None, [], False)


def test_double_encoded_arguments_and_text_after_calls(builtin_tokenizer):
    parser = detect_parser(builtin_tokenizer)
    prefix = renderer(builtin_tokenizer).render(QUESTION, TOOLS).text
    output = (
        'Checking.\n<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"q\\"}"}\n</tool_call>\n'
        "Done calling.<|im_end|>"
    )
    parsed = parser.parse(builtin_tokenizer.encode(output, add_special_tokens=False), prefix, TOOLS)
    assert parsed.tool_calls == [{"name": "search", "arguments": {"query": "q"}}]
    # Text after the calls is appended as written (the newline before it stays; the template would move it).
    assert parsed.content == "Checking.\nDone calling." and not parsed.ill_formed


def test_detect_parser_by_template_hash(builtin_tokenizer, qwen3_tokenizer):
    assert detect_parser(builtin_tokenizer).format_name == "qwen3"
    parser = detect_parser(qwen3_tokenizer)
    assert isinstance(parser, FormatParser) and parser.format_name == "qwen3"
    unknown = copy.copy(builtin_tokenizer)
    unknown.chat_template = builtin_tokenizer.chat_template + "\n"
    with pytest.raises(ParserUnavailable, match="unknown chat template") as info:
        detect_parser(unknown)
    assert "sha256" in str(info.value)
    assert detect_parser(unknown, format_name="qwen3").format_name == "qwen3"
    with pytest.raises(ParserUnavailable, match="unknown response format"):
        detect_parser(unknown, format_name="llama-json")
    assert detect_parser(unknown, format_name="llama3_json").format_name == "llama3_json"


def test_parsing_engine_follows_the_transformers_version(builtin_tokenizer, monkeypatch):
    """5.13+: declarative response_template; 5.0-5.12: legacy response_schema; 4.x has neither: refused."""
    version = Version(transformers.__version__)
    assert parsing_engine() == ("template" if version >= Version("5.13") else "schema")
    assert detect_parser(builtin_tokenizer).engine == parsing_engine()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "4.57.1")  # what the gateway reads
    with pytest.raises(ParserUnavailable, match=r"transformers >= 5\.0"):
        detect_parser(builtin_tokenizer)


# Property: whatever the model emits, parsing returns a verdict and never raises; a well-formed
# verdict only holds canonical calls, and an ill-formed one hands back the raw text.
_PIECES = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "\n",
    " ",
    "{",
    "}",
    '"name"',
    '"arguments"',
    ":",
    ",",
    '"search"',
    "[1]",
    "hello",
    "<|im_end|>",
    '{"name": "search", "arguments": {}}',
]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(_PIECES), max_size=14))
def test_parser_never_raises(builtin_tokenizer, pieces):
    parser = detect_parser(builtin_tokenizer)
    text = "".join(pieces)
    parsed = parser.parse(builtin_tokenizer.encode(text, add_special_tokens=False), "<|im_start|>assistant\n", TOOLS)
    if parsed.ill_formed:
        assert parsed.tool_calls == [] and parsed.reasoning is None and parsed.error
    else:
        for call in parsed.tool_calls:
            assert isinstance(call["name"], str) and isinstance(call["arguments"], dict)
