"""ChatML families (`<|im_start|>assistant\\n` ... `<|im_end|>`): Qwen2.5/Qwen3 JSON calls, Qwen3.5/Nemotron XML calls.

- `qwen3`: `<think>` reasoning + `<tool_call>{json}</tool_call>` (Qwen3, the built-in template).
- `qwen2_5`: the same JSON calls, no reasoning (Qwen2.5, Qwen3-Instruct-2507, Qwen3-VL).
- `qwen3_5` / `nemotron3`: `<think>` + `<tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>`
  with untyped text values (Qwen3.5/3.6/3.8, Nemotron-3); they differ only in how the template trims.
Each format is a response_template (its legacy response_schema is in `formats.legacy`).
Facts about the grammars only; no code is shared with the engines. Imports only `formats.base`/`checks`/`live_split`.
"""

from __future__ import annotations

import json
import re
from functools import partial
from typing import Any

from gateway_workers.formats.base import SPACES_THEN_TOOL_CALL, Finisher, NativeReader, ResponseFormat
from gateway_workers.formats.checks import THINK, TOOL_CALL, check_tagged, fullmatch_check
from gateway_workers.formats.live_split import TagGrammar, TagSplitter

ANCHOR = "<|im_start|>assistant\n"
END_MARKERS = ("<|im_end|>", "<|endoftext|>")
_TEXT = {"content": "text", "content_args": {"strip": False}}

# --- JSON calls -------------------------------------------------------------------------------

# The leading \s* on the call opener swallows the newline the templates put between text and calls.
_JSON_CALLS_TEMPLATE: dict[str, Any] = {
    "open_pattern": SPACES_THEN_TOOL_CALL,
    "close": "</tool_call>",
    "repeats": True,
    "content": "json",
}
_REASONING_TEMPLATE: dict[str, Any] = {"open": "<think>", "close": "</think>", **_TEXT}



def _think_then_calls(calls: dict[str, Any]) -> dict[str, Any]:
    """The response template of a `<think>` block, text, and `<tool_call>`s of one kind."""
    return {
        "version": 1,
        "defaults": {"reasoning": None},  # an empty think block is reasoning "", none is None
        "start_anchor": ANCHOR,
        "fields": {
            "reasoning": _REASONING_TEMPLATE,
            "tool_calls": calls,
            # Text after a tool call (rare) is appended, not allowed to overwrite the text before it.
            "content": {**_TEXT, "repeats": True},
        },
    }


QWEN3_TEMPLATE = _think_then_calls(_JSON_CALLS_TEMPLATE)
QWEN2_5_TEMPLATE: dict[str, Any] = {
    "version": 1,
    "start_anchor": ANCHOR,
    "fields": {"tool_calls": _JSON_CALLS_TEMPLATE, "content": {**_TEXT, "repeats": True}},
}


# What the engine's `\s` (the `regex` module's) leaves out of str.isspace(): the ASCII separators.
_NOT_REGEX_SPACE = frozenset("\x1c\x1d\x1e\x1f")


def _json_calls_reader(think: bool) -> NativeReader:
    r"""The declarative engine's reading of `_think_then_calls(_JSON_CALLS_TEMPLATE)` (think) or QWEN2_5_TEMPLATE.

    Only for bodies that passed `check_tagged`: at most one leading, closed reasoning block, balanced calls.
    Text outside the blocks is content, except the whitespace right before each `<tool_call>` (the open
    pattern's `\s*`). A call that is not JSON, or is OpenAI-shaped (`{"function": ...}`, which the engine
    casts by the tools' schemas), is left to the engine (None), so its verdict and its message stay its own.
    """
    (think_open, think_close), (call_open, call_close) = THINK, TOOL_CALL

    def read(body: str) -> dict[str, Any] | None:
        reasoning: str | None = None
        content: list[str] = []
        at = 0
        start = body.find(think_open) if think else -1
        if start >= 0:
            end = body.find(think_close, start)
            if end < 0:
                return None
            content.append(body[:start])
            reasoning = body[start + len(think_open) : end]
            at = end + len(think_close)
        calls = []
        while (opened := body.find(call_open, at)) >= 0:
            cut = opened
            while cut > at and body[cut - 1].isspace() and body[cut - 1] not in _NOT_REGEX_SPACE:
                cut -= 1
            content.append(body[at:cut])
            closed = body.find(call_close, opened)
            if closed < 0:
                return None
            try:
                call = json.loads(body[opened + len(call_open) : closed])
            except ValueError:
                return None
            if isinstance(call, dict) and "function" in call:
                return None
            calls.append(call)
            at = closed + len(call_close)
        content.append(body[at:])
        return {"reasoning": reasoning, "content": "".join(content), "tool_calls": calls}

    return read


def _qwen3_finish(content: str, reasoning: str | None) -> tuple[str, str | None]:
    # Exactly what the Qwen3 templates trim on re-render, so the echo renders the same tokens.
    return content.lstrip("\n"), reasoning.strip("\n") if reasoning is not None else None


def _verbatim(content: str, reasoning: str | None) -> tuple[str, str | None]:
    return content, reasoning


QWEN3 = ResponseFormat(
    "qwen3", ANCHOR, END_MARKERS, QWEN3_TEMPLATE, check=lambda body: check_tagged(body, think=THINK),
    finish=_qwen3_finish, native_reader=_json_calls_reader(think=True),
    live=partial(TagSplitter, TagGrammar(END_MARKERS, think=THINK, call=TOOL_CALL)),
)
QWEN2_5 = ResponseFormat(
    "qwen2_5", ANCHOR, END_MARKERS, QWEN2_5_TEMPLATE, check=lambda body: check_tagged(body, think=None),
    finish=_verbatim, reasoning=False, native_reader=_json_calls_reader(think=False),
    live=partial(TagSplitter, TagGrammar(END_MARKERS, call=TOOL_CALL, content_trim_start="")),
)

# --- XML calls (Qwen3.5 / Nemotron-3) ---------------------------------------------------------------

PARAMETER = r"<parameter=(?P<key>[^>\n]+)>\n?(?P<value>.*?)\n?</parameter>"
# A value never spans its close tag (as the engines read it): one way to read each parameter, so a block
# that fails to match fails in linear time (a lazy `.*?` there backtracks exponentially in the parameters).
_XML_CALL = re.compile(
    r"\s*<function=[^>\n]+>\s*(?:<parameter=[^>\n]+>(?:(?!</parameter>).)*</parameter>\s*)*</function>\s*", re.DOTALL
)
_XML_CALLS_TEMPLATE: dict[str, Any] = {
    "open_pattern": SPACES_THEN_TOOL_CALL + r"(?:\s+<function=|<function=)(?P<name>[^>\n]+)(?:>|(?!))",
    "close_pattern": r"</function>\s*</tool_call>",
    "repeats": True,
    "content": "xml-inline",
    "content_args": {"tag_pattern": PARAMETER},
    # The OpenAI-style shape is what transformers >= 5.15 casts by the tool schema.
    "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
}
XML_TEMPLATE = _think_then_calls(_XML_CALLS_TEMPLATE)


def _xml_check(body: str) -> str | int:
    return check_tagged(body, think=THINK, call_body=fullmatch_check(_XML_CALL, "<function=...> block"))


def _qwen3_5_finish(content: str, reasoning: str | None) -> tuple[str, str | None]:
    # Qwen3.5/3.6/3.8 re-render `reasoning_content|trim` and `content|trim`.
    return content.strip(), reasoning.strip() if reasoning is not None else None


def _nemotron_finish(content: str, reasoning: str | None) -> tuple[str, str | None]:
    # Nemotron-3 writes "<think>\n" + reasoning + ("\n" on Nano/Super) + "</think>" and trims the rest.
    return content.strip(), reasoning.strip("\n") if reasoning is not None else None


def _xml_format(name: str, finish: Finisher, reasoning_trim: str | None = "\n") -> ResponseFormat:
    """Qwen3.5 and Nemotron-3: the same grammar; they differ in how their templates trim text."""
    grammar = TagGrammar(END_MARKERS, think=THINK, call=TOOL_CALL, reasoning_trim=reasoning_trim,
                         content_trim_start=None, content_trim_end=None)
    return ResponseFormat(name, ANCHOR, END_MARKERS, XML_TEMPLATE, check=_xml_check, finish=finish,
                          string_arguments=True, live=partial(TagSplitter, grammar))


QWEN3_5 = _xml_format("qwen3_5", _qwen3_5_finish, reasoning_trim=None)
NEMOTRON3 = _xml_format("nemotron3", _nemotron_finish)
