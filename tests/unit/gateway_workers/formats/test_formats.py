"""Every family's response format against its real chat template (trl's copy, read as data) and a real BPE.

Per family: the registered sha256 is the real template's, detection picks the family's format,
an assistant message with reasoning, text and (where the template allows) two parallel tool calls
rendered by the real template and tokenized parses back to the same structure, the parsed echo
re-renders to exactly the sampled text (or the documented exception), and malformed output
degrades to raw text with `ill_formed`. Runs on whichever transformers engine is installed
(declarative >= 5.13, legacy response_schema 5.0-5.12); CI runs both.
"""

from __future__ import annotations

import copy
import json
import re
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
from fake_formats import FAMILIES, WRITERS, template_path, trl_templates_dir
from family_cases import ALL_TOOLS, QUESTION, encode, family_tokenizer, render, reply_for, sampled
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway_workers.formats import (
    FORMATS,
    PLAIN_TEXT,
    TEMPLATE_FORMATS,
    ParsedResponse,
    ParserUnavailable,
    PlainTextParser,
    detect_parser,
    known_templates,
    legacy,
    parsing_engine,
    resolve_format,
    template_from_dir,
    template_sha256,
)
from gateway_workers.rendering.messages import template_messages

# --- the registry -----------------------------------------------------------------------------------


def test_every_registered_hash_is_a_real_template_file():
    # Hashed as transformers reads a template file: text mode (glm4moe_training.jinja has CRLF line ends).
    on_disk = {template_sha256(p.read_text("utf-8")): p.name for p in trl_templates_dir().glob("*.jinja")}
    missing = {digest: fmt for digest, fmt in TEMPLATE_FORMATS.items() if digest not in on_disk}
    assert not missing, f"registered hashes with no template in the trl wheel: {missing}"
    assert set(TEMPLATE_FORMATS.values()) == set(FORMATS)  # every format is reachable by detection
    assert len(known_templates()) == len(TEMPLATE_FORMATS) + 1  # + the built-in template


def test_every_shipped_template_is_served_or_listed_in_the_docs_with_its_reason():
    readme = (Path(__file__).resolve().parents[4] / "docs" / "formats.md").read_text("utf-8")
    table = readme.split("that are not served, and why:", 1)[1].split("\n\n", 2)[1]
    # each row: the template names in backticks before the first cell ends, then a reason
    listed = {
        name
        for cells in re.findall(r"^\| ([^|]+) \| \w.+\|$", table, re.MULTILINE)
        for name in re.findall(r"`(\w+)`", cells)
    }
    for path in trl_templates_dir().glob("*.jinja"):
        if template_sha256(path.read_text("utf-8")) in TEMPLATE_FORMATS:
            continue
        stem = path.stem.removesuffix("_training")
        assert stem in listed, f"{path.name} is neither registered nor listed in docs/formats.md as not served"


@pytest.mark.parametrize("key", sorted(FAMILIES))
def test_family_template_is_detected(key):
    family = FAMILIES[key]
    text = template_path(family.template).read_text("utf-8")
    assert TEMPLATE_FORMATS[template_sha256(text)] == family.format_name
    training = template_path(family.template).with_name(f"{family.template}_training.jinja")
    if training.is_file():  # trl's training variants parse the same
        assert TEMPLATE_FORMATS[template_sha256(training.read_text("utf-8"))] == family.format_name
    assert detect_parser(family_tokenizer(key)).format_name == family.format_name


# --- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("key", sorted(FAMILIES))
def test_round_trip_reasoning_text_and_parallel_calls(key):
    tokenizer = family_tokenizer(key)
    parser = detect_parser(tokenizer)
    for typed in (False, True):
        reply = reply_for(key, typed)
        prefix, out = sampled(tokenizer, key, reply)
        ids = encode(tokenizer, out)
        parsed = parser.parse(ids, prefix, ALL_TOOLS)
        assert not parsed.ill_formed, (parsed.error, out)
        assert parsed.canonical_message() == reply, out
        # The prompt may be given as ids too (only its tail is decoded).
        assert parser.parse(ids, encode(tokenizer, prefix), ALL_TOOLS) == parsed


@pytest.mark.parametrize("key", sorted(FAMILIES))
def test_echo_rerenders_the_sampled_text(key):
    """The parsed reply, echoed back as the next prompt's assistant message, renders to the sampled text.

    The exception (documented in the README): DeepSeek-R1's template drops earlier reasoning. The GPT-OSS and
    LFM2.5 templates read it as `thinking`, which the gateway writes on every transformers.
    """
    tokenizer = family_tokenizer(key)
    family = FAMILIES[key]
    reply = reply_for(key)
    prefix, out = sampled(tokenizer, key, reply)
    parsed = detect_parser(tokenizer).parse(encode(tokenizer, out), prefix, ALL_TOOLS)
    echo = parsed.canonical_message()
    follow = [{"role": "tool", "content": f"result {i}"} for i, _ in enumerate(echo.get("tool_calls", []))] or [
        {"role": "user", "content": "And tomorrow?"}
    ]
    chat = template_messages([*QUESTION, echo, *follow])
    tools = ALL_TOOLS if family.tools else None
    text = tokenizer.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True)
    if family.format_name == "deepseek_r1":
        assert f"<｜Assistant｜>{echo['content']}<｜end▁of▁sentence｜>" in text and reply["reasoning"] not in text
    else:
        assert text.startswith(prefix + out.rstrip("\n")), (text[len(prefix) : len(prefix) + len(out) + 40], out)


@pytest.mark.parametrize("key", ["qwen3_5_think", "nemotron_3_nano", "glm4moe", "deepseek_r1_distill"])
def test_generation_prompt_without_thinking(key):
    """enable_thinking=False makes the template write an empty think block: the reply is plain text."""
    tokenizer = family_tokenizer(key)
    prefix = render(tokenizer, key, QUESTION, add_generation_prompt=True, enable_thinking=False)
    parsed = detect_parser(tokenizer).parse(encode(tokenizer, "Hello there." + FAMILIES[key].stop), prefix)
    if key == "deepseek_r1_distill":  # its template has no such switch: the prompt still opens <think>
        assert parsed.ill_formed and "unterminated <think>" in parsed.error
    else:
        assert (parsed.content, parsed.reasoning, parsed.ill_formed) == ("Hello there.", "", False)


@pytest.mark.parametrize("key", ["qwen3_5_think", "nemotron_3_nano", "glm4moe", "muse_glimmer"])
def test_string_arguments_are_typed_by_the_tool_schema(key):
    """XML-style values are text: cast by the tool's JSON schema, kept as text without one."""
    tokenizer = family_tokenizer(key)
    parser = detect_parser(tokenizer)
    reply = reply_for(key, typed=True)
    prefix, out = sampled(tokenizer, key, reply)
    typed = parser.parse(encode(tokenizer, out), prefix, ALL_TOOLS).tool_calls[1]["arguments"]
    assert typed == reply["tool_calls"][1]["arguments"]  # every JSON type, as the agent's tool declared it
    untyped = parser.parse(encode(tokenizer, out), prefix, None).tool_calls[1]["arguments"]
    assert all(isinstance(v, str) for v in untyped.values()) and untyped["label"] == "7"


def test_json_arguments_keep_the_model_types():
    """JSON formats hand the model's own types through: a string where the schema wants an integer stays one."""
    tokenizer = family_tokenizer("qwen3")
    prefix = render(tokenizer, "qwen3", QUESTION, add_generation_prompt=True)
    out = '<tool_call>\n{"name": "configure", "arguments": {"count": "7"}}\n</tool_call><|im_end|>'
    parsed = detect_parser(tokenizer).parse(encode(tokenizer, out), prefix, ALL_TOOLS)
    assert parsed.tool_calls == [{"name": "configure", "arguments": {"count": "7"}}]


# --- degradation -------------------------------------------------------------------------------------

# Per format: (output after the generation prompt, expected error fragment). The prompt's prefill
# counts: Qwen3.5, Nemotron and DeepSeek prompts already opened <think>.
_BAD: dict[str, list[tuple[str, str]]] = {
    "qwen3": [
        ('<tool_call>\n{"name": "search", "arguments": {"query": "x"}', "unterminated <tool_call>"),
        ('<tool_call>\n{"name": "search", "arguments": {"query": }}\n</tool_call>', "unparseable"),
        ('<think>\n<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>\n</think>\n\nok', "inside <think>"),
        ("<think>\nI was cut off", "unterminated <think>"),
    ],
    "qwen2_5": [
        ('<tool_call>\n{"name": "search", "arguments": {"query": "x"}', "unterminated <tool_call>"),
        ('<tool_call>\n{"name": "search", "arguments": "not json"}\n</tool_call>', "non-JSON arguments"),
        ("</tool_call>", "without <tool_call>"),
    ],
    "qwen3_5": [
        ("r\n</think>\n\n<tool_call>\n<function=search>\n<parameter=query>\nx\n", "unterminated <tool_call>"),
        (
            "r\n</think>\n\n<tool_call>\n<function=search>\n<parameter=query>\nx\n</function>\n</tool_call>",
            "malformed <function=...> block",
        ),
        ("<tool_call>\n<function=search>\n</function>\n</tool_call>\n</think>\n\nok", "inside <think>"),
        ("I was cut off while thinking", "unterminated <think>"),
    ],
    "nemotron3": [
        ("r\n</think>\n<tool_call>\n<function=search>\n", "unterminated <tool_call>"),
        ("r\n</think>\n<tool_call>\nsearch(query='x')\n</tool_call>\n", "malformed <function=...> block"),
        ("<tool_call>\n<function=search>\n</function>\n</tool_call>\n</think>\nok", "inside <think>"),
    ],
    "glm4_moe": [
        ("\n<think>r</think>\n<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>x", "unterminated <tool_call>"),
        ("\n<think>r</think>\n<tool_call>search\n<arg_key>query</arg_key>\n</tool_call>", "<arg_key>/<arg_value>"),
        ("\n<think><tool_call>search\n</tool_call></think>\nok", "inside <think>"),
    ],
    "gpt_oss": [
        (
            "<|channel|>analysis<|message|>r<|end|><|start|>assistant to=functions.search<|channel|>commentary json"
            '<|message|>{"query": "x',
            "unparseable",
        ),
        (
            "<|channel|>analysis<|message|>r<|end|><|start|>assistant to=browser.search<|channel|>commentary json"
            '<|message|>{"query": "x"}',
            "not a function call",
        ),
        ("Plain text without any channel.", "malformed harmony message"),
        ("<|channel|>analysis<|message|>r<|end|><|channel|>final<|message|>x", "without <|start|>assistant"),
    ],
    "llama3_json": [
        ('{"name": "search", "parameters": {"query": "x"', "invalid JSON"),
        ('{"name": "search", "parameters": {"query": "x"}} and some text', "text after a JSON tool call"),
        ('{"name": "search", "parameters": ["x"]}', "not a JSON object"),
    ],
    "gemma4": [
        ('<|tool_call>call:search{query:<|"|>x<|"|>}', "unterminated <|tool_call>"),
        ("<|tool_call>call:search{query:x}<tool_call|>", "malformed Gemma tool call"),
        ('<|tool_call>call:search{query:<|"|>x<|"|>} and more<tool_call|>', "malformed Gemma tool call"),
        ("<|channel>thought\nI was cut off", "unterminated <|channel>thought"),
    ],
    "lfm2": [
        ("<|tool_call_start|>[search(query='x')", "unterminated <|tool_call_start|>"),
        ("<|tool_call_start|>[search(query='x'), ]<|tool_call_end|>", "malformed LFM2 tool call list"),
        ("<|tool_call_start|>[search(query=x y)]<|tool_call_end|>", "malformed LFM2 tool call list"),
        ("<|tool_call_start|>[search(query='x', query='y')]<|tool_call_end|>", "given twice"),
        ("<think>I was cut off", "unterminated <think>"),
    ],
    "muse_glimmer": [
        (" to=self<|message|>I was cut off", "ended inside its reasoning"),
        (
            ' to=search<|message|><atem:function_calls>\n<atem:invoke name="search">\n'
            '<atem:parameter name="query">x</atem:parameter>\n',
            "malformed <atem:function_calls>",
        ),
        (
            ' to=search<|message|><atem:function_calls>\n<atem:invoke name="get_weather">\n'
            "</atem:invoke>\n</atem:function_calls>",
            "invokes 'get_weather'",
        ),
        (
            ' to=search<|message|><atem:function_calls>\n<atem:invoke name="search">\n<atem:parameter name="q">x'
            '</atem:parameter>\n<atem:parameter name="q">y</atem:parameter>\n</atem:invoke>\n</atem:function_calls>',
            "given twice",
        ),
        (" to=user<|message|>Done.<|eom|><|start|>assistant to=self<|message|>r", "goes on after its text"),
        (" to=user<|message|>ok<|eom|><|start|>assistant to=self<|message|>r<|eom|>", "goes on after its text"),
        ("<|message|>No recipient.", "malformed ATEM message"),
        (" to=user<|message|>a<|eom|>b", "goes on after its text"),
    ],
    "deepseek_r1": [
        ("I was cut off while thinking", "unterminated <think>"),
        ("r\n</think>\n\nok\n<think>\nagain\n</think>", "malformed <think>"),
    ],
}
_ONE_FAMILY_PER_FORMAT = {fmt: next(k for k, f in sorted(FAMILIES.items()) if f.format_name == fmt) for fmt in FORMATS}


@pytest.mark.parametrize(("fmt", "output", "error"), [(f, o, e) for f, cases in _BAD.items() for o, e in cases])
def test_malformed_output_degrades_to_raw_text(fmt, output, error):
    key = _ONE_FAMILY_PER_FORMAT[fmt]
    tokenizer = family_tokenizer(key)
    prefix = render(tokenizer, key, QUESTION, add_generation_prompt=True)
    parsed = detect_parser(tokenizer).parse(encode(tokenizer, output + FAMILIES[key].stop), prefix, ALL_TOOLS)
    assert parsed == ParsedResponse(content=output, reasoning=None, tool_calls=[], ill_formed=True, error=parsed.error)
    assert error in parsed.error


@pytest.mark.parametrize("writer", sorted({f.writer for f in FAMILIES.values() if f.tools}))
def test_hallucinated_tool_names_pass_through(writer):
    """A call to a tool nobody declared is still a call: the agent framework rejects it, not us."""
    key = next(k for k, f in sorted(FAMILIES.items()) if f.writer == writer)
    tokenizer = family_tokenizer(key)
    prefix = render(tokenizer, key, QUESTION, add_generation_prompt=True)
    plan = {"reasoning": "r", "text": "", "calls": [{"name": "launch_rockets", "arguments": {"count": "3"}}]}
    out = WRITERS[writer].write(plan) + FAMILIES[key].stop
    parsed = detect_parser(tokenizer).parse(encode(tokenizer, out), prefix, ALL_TOOLS)
    assert not parsed.ill_formed, parsed.error
    assert parsed.tool_calls == [{"name": "launch_rockets", "arguments": {"count": "3"}}]


# A call block with many arguments whose end is garbled: (prompt-free output, the error). A lazy value pattern
# inside a repeated group backtracks exponentially in the arguments when the block fails to match.
_MANY = 40
_GARBLED_CALLS: dict[str, str] = {
    "qwen3_6": "r\n</think>\n\n<tool_call>\n<function=search>\n"
    + "".join(f"<parameter=k{i}>\nv\n</parameter>\n" for i in range(_MANY))
    + "</functio>\n</tool_call>",
    "nemotron_3_nano": "r\n</think>\n<tool_call>\n<function=search>\n"
    + "".join(f"<parameter=k{i}>\nv\n</parameter>\n" for i in range(_MANY))
    + "X\n</tool_call>\n",
    "glm4moe": "\n<think>r</think>\n<tool_call>search\n"
    + "".join(f"<arg_key>k{i}</arg_key>\n<arg_value>v</arg_value>\n" for i in range(_MANY))
    + "X</tool_call>",
    "muse_glimmer": ' to=search<|message|><atem:function_calls>\n<atem:invoke name="search">\n'
    + "".join(f'<atem:parameter name="k{i}">v</atem:parameter>\n' for i in range(_MANY))
    + "</atem:invoke>\n</atem:function_call>",
}


@pytest.mark.parametrize("key", sorted(_GARBLED_CALLS))
def test_a_garbled_call_with_many_arguments_is_refused_in_linear_time(key):
    tokenizer = family_tokenizer(key)
    parser = detect_parser(tokenizer)
    prefix = render(tokenizer, key, QUESTION, add_generation_prompt=True)
    ids = encode(tokenizer, _GARBLED_CALLS[key] + FAMILIES[key].stop)
    started = time.perf_counter()
    parsed = parser.parse(ids, prefix, ALL_TOOLS)
    assert time.perf_counter() - started < 2.0  # exponential backtracking would take longer than the suite
    assert parsed.ill_formed and parsed.tool_calls == [], parsed


# Long runs a degenerate model emits (prompt-free output, whether the reply is ill-formed). Each took the old
# patterns seconds to minutes: a pattern retried from every character of the run, or rescanned the rest.
_LONG = 40_000
_LONG_RUNS: dict[str, tuple[str, str, bool]] = {
    "reasoning text": (
        "gptoss",
        "<|channel|>analysis<|message|>" + "word " * (_LONG // 10) + "<|end|><|start|>assistant<|channel|>final"
        "<|message|>ok",
        False,
    ),
    "spaces in text, JSON calls": ("qwen3", "<think>\nr\n</think>\n\nx" + " " * _LONG + "y", False),
    "spaces in text, XML calls": ("qwen3_6", "r\n</think>\n\nx" + " " * _LONG + "y", False),
    "spaces in text, GLM calls": ("glm4moe", "\n<think>r</think>\nx" + " " * _LONG + "y", False),
    "spaces in text, Llama calls": ("llama3_1", "x" + " " * _LONG + "y", False),
    "leading spaces, Llama calls": ("llama3_1", " " * _LONG + "x", False),
    "spaces after a GLM call name": (
        "glm4moe",
        "\n<think>r</think>\n<tool_call>search" + " " * _LONG + "<x</tool_call>",
        True,
    ),
    "digits, Gemma value": ("gemma4_v5", "<|tool_call>call:search{n:" + "1" * (_LONG // 4) + "x}<tool_call|>", True),
    "digits, LFM2 value": (
        "lfm2_2_5",
        "<|tool_call_start|>[search(n=" + "1" * (_LONG // 4) + "x)]<|tool_call_end|>",
        True,
    ),
    "nesting, Gemma value": (
        "gemma4_v5",
        "<|tool_call>call:search{a:" + "{a:" * 5000 + "1" + "}" * 5001 + "<tool_call|>",
        True,
    ),
    "nesting, LFM2 value": (
        "lfm2_2_5",
        "<|tool_call_start|>[search(a=" + "[" * 5000 + "1" + "]" * 5000 + ")]<|tool_call_end|>",
        True,
    ),
    "nesting, JSON value": (
        "qwen3",
        '<think>\nr\n</think>\n\n<tool_call>\n{"name": "search", "arguments": {"a": '
        + "[" * 100_000
        + "]" * 100_000
        + "}}\n</tool_call>",
        True,
    ),
}


@pytest.mark.parametrize("case", sorted(_LONG_RUNS))
def test_a_long_run_in_a_reply_is_read_in_linear_time(case):
    """The worker must not stall (nor fail) on what a degenerate model emits: a verdict, fast."""
    key, output, broken = _LONG_RUNS[case]
    tokenizer = family_tokenizer(key)
    parser = detect_parser(tokenizer)
    prefix = render(tokenizer, key, QUESTION, add_generation_prompt=True)
    started = time.perf_counter()
    parsed = parser.read_text(output + FAMILIES[key].stop, prefix, ALL_TOOLS)  # a 40k-space word is slow to encode
    assert time.perf_counter() - started < 2.0
    assert parsed.ill_formed == broken, parsed.error
    assert parsed.tool_calls == []


def _engine_patterns(fmt) -> list[tuple[str, Any, bool]]:
    """(where, compiled pattern, searched partially) for each pattern the parsing engine runs on a reply."""
    found: list[tuple[str, Any, bool]] = []
    if parsing_engine() == "template":
        from transformers.utils.chat_parsing.response_templates import load_response_template

        spec = load_response_template(dict(fmt.template))
        for field in spec.fields.values():
            for kind in ("open_re", "close_re"):
                if getattr(field, kind) is not None:
                    found += [(f"{field.name}.{kind}", getattr(field, kind), partial) for partial in (True, False)]
        return found

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            for name, value in node.items():
                if name in ("x-regex", "x-regex-iterator", "x-regex-key-value"):
                    found.append((f"{where}.{name}", re.compile(value, re.DOTALL), False))
                elif name == "x-regex-substitutions":
                    found.extend((f"{where}.{name}", re.compile(p, re.DOTALL), False) for p, _ in value)
                else:
                    walk(value, f"{where}.{name}")

    walk(dict(legacy.SCHEMAS[fmt.name]), "schema")
    return found


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_engine_pattern_is_linear_in_a_long_run(name):
    """Every pattern the engine runs, on runs of the characters replies are made of: a pattern that is
    quadratic in one (as `\\s*<tool_call>` was under partial matching) takes seconds here."""
    slow = []
    for where, pattern, partial in _engine_patterns(FORMATS[name]):
        for char in (" ", "\n", "a", "1", "<", "{", ";", ","):
            text = "x" + char * 50_000 + "y"
            started = time.perf_counter()
            if partial:
                pattern.search(text, 0, partial=True)
            else:
                list(pattern.finditer(text))
            if time.perf_counter() - started > 0.25:
                slow.append((where, char, partial))
    assert not slow, slow


@pytest.mark.parametrize(
    "key", ["qwen3_6", "glm4moe", "gptoss", "llama3_1", "nemotron_3_ultra", "gemma4_v5", "lfm2_2_5", "muse_glimmer"]
)
def test_cut_by_max_tokens_mid_call_is_ill_formed_never_a_partial_list(key):
    """Two calls, the second cut anywhere: never one call out of two."""
    tokenizer = family_tokenizer(key)
    parser = detect_parser(tokenizer)
    family = FAMILIES[key]
    prefix = render(tokenizer, key, QUESTION, add_generation_prompt=True)
    calls = [{"name": "search", "arguments": {"query": "first"}}, {"name": "search", "arguments": {"query": "second"}}]
    out = WRITERS[family.writer].write({"reasoning": "r", "text": "", "calls": calls})
    if not family.parallel:  # one call per reply: cut that one
        calls = calls[:1]
    ids = encode(tokenizer, out)
    full = parser.parse(ids, prefix, ALL_TOOLS)
    assert full.tool_calls == calls and not full.ill_formed
    cut_at = out.rfind("second") if family.parallel else out.rfind("first")
    for cut in range(len(encode(tokenizer, out[:cut_at])), len(ids) - 1):
        parsed = parser.parse(ids[:cut], prefix, ALL_TOOLS)
        assert parsed.ill_formed and parsed.tool_calls == [], (cut, parsed)


# Property: whatever the model emits, every format returns a verdict and never raises; a well-formed
# verdict holds only canonical calls, an ill-formed one hands back the raw text.
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
    "hello",
    "<function=search>",
    "</function>",
    "<parameter=query>",
    "</parameter>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<|channel|>",
    "analysis",
    "final",
    "<|message|>",
    "<|end|>",
    "<|start|>assistant",
    " to=functions.search",
    "commentary",
    '"parameters"',
    ";",
    "<|channel>thought\n",
    "<channel|>",
    "<|tool_call>",
    "<tool_call|>",
    "call:search",
    '<|"|>',
    "<|tool_call_start|>",
    "<|tool_call_end|>",
    "[",
    "]",
    "search(",
    ")",
    "query=",
    "'x'",
    " to=self",
    " to=user",
    " to=search",
    "<|eom|>",
    "<atem:function_calls>",
    '<atem:invoke name="search">',
    '<atem:parameter name="query">',
    "</atem:parameter>",
    "</atem:invoke>",
    "</atem:function_calls>",
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(sorted(_ONE_FAMILY_PER_FORMAT.values())), st.lists(st.sampled_from(_PIECES), max_size=16))
def test_no_output_makes_any_parser_raise(key, pieces):
    tokenizer = family_tokenizer(key)
    text = "".join(pieces)
    parsed = detect_parser(tokenizer).parse(
        encode(tokenizer, text), render(tokenizer, key, QUESTION, add_generation_prompt=True), ALL_TOOLS
    )
    if parsed.ill_formed:
        assert parsed.tool_calls == [] and parsed.reasoning is None and parsed.error
    else:
        for call in parsed.tool_calls:
            assert isinstance(call["name"], str) and call["name"] and isinstance(call["arguments"], dict)


# --- operator control ---------------------------------------------------------------------------------


def test_resolve_format_never_guesses(tmp_path):
    known = template_path("glm4moe").read_text("utf-8")
    assert resolve_format(known) == "glm4_moe"
    assert resolve_format(known + "\n", "qwen3") == "qwen3"  # the operator's word wins over detection
    with pytest.raises(ParserUnavailable, match=r"unknown chat template \(sha256 [0-9a-f]{64}\)") as info:
        resolve_format(known + "\n")
    assert "--response-format" in str(info.value) and "--allow-plain-text" in str(info.value)
    assert resolve_format(known + "\n", allow_plain_text=True) == PLAIN_TEXT
    with pytest.raises(ParserUnavailable, match="no chat template"):
        resolve_format(None)
    with pytest.raises(ParserUnavailable, match="unknown response format 'no_such_format'"):
        resolve_format(known, "no_such_format")
    with pytest.raises(ParserUnavailable, match="cannot import"):
        resolve_format(known, "no_such_package.parsers:make")
    with pytest.raises(ParserUnavailable, match="no callable 'nothing'"):
        resolve_format(known, "gateway_workers.formats.registry:nothing")


def test_custom_parser_by_import_path():
    """`package.module:factory` names any callable that takes the tokenizer and returns a parser."""
    tokenizer = family_tokenizer("qwen3")
    parser = detect_parser(tokenizer, "gateway_workers.formats.registry:PlainTextParser")
    assert isinstance(parser, PlainTextParser) and parser.supports_tools is False


def test_custom_parser_must_declare_its_capabilities(monkeypatch):
    """The app reads `format_name` and `supports_tools` as plain attributes, so a factory's parser must have them."""

    class ParseOnly:
        def parse(self, output_ids, prefix, tools=None):
            return ParsedResponse(content="")

    class NoToolsFlag(ParseOnly):
        format_name = "house"

    module = types.ModuleType("house_parsers")
    module.parse_only = lambda tokenizer: ParseOnly()
    module.no_tools_flag = lambda tokenizer: NoToolsFlag()
    monkeypatch.setitem(sys.modules, "house_parsers", module)
    tokenizer = family_tokenizer("qwen3")
    with pytest.raises(ParserUnavailable, match="no format_name"):
        detect_parser(tokenizer, "house_parsers:parse_only")
    with pytest.raises(ParserUnavailable, match="no supports_tools"):
        detect_parser(tokenizer, "house_parsers:no_tools_flag")


def test_plain_text_parser_keeps_text_and_drops_the_stop_token():
    tokenizer = family_tokenizer("qwen3")
    unknown = copy.copy(tokenizer)
    unknown.chat_template = tokenizer.chat_template + "{# house edit #}"
    with pytest.raises(ParserUnavailable):
        detect_parser(unknown)
    parser = detect_parser(unknown, allow_plain_text=True)
    parsed = parser.parse(encode(tokenizer, "<think>\nr\n</think>\n\nHi <tool_call>{}</tool_call><|im_end|>"), "")
    assert parsed == ParsedResponse(content="<think>\nr\n</think>\n\nHi <tool_call>{}</tool_call>")


def test_template_from_dir_reads_what_transformers_loads(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "A"}))
    assert template_from_dir(str(tmp_path)) == "A"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]})
    )
    assert template_from_dir(str(tmp_path)) == "D"
    (tmp_path / "chat_template.jinja").write_text("J\r\nK")
    assert template_from_dir(str(tmp_path)) == "J\nK"  # text mode, as transformers reads it
    override = tmp_path / "other.jinja"
    override.write_text("O")
    assert template_from_dir(str(tmp_path), str(override)) == "O"
    assert template_from_dir(str(tmp_path / "missing")) is None
