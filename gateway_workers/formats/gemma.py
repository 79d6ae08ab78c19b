"""Gemma 4: `<|channel>thought` reasoning and `<|tool_call>call:NAME{key:value,...}<tool_call|>` calls.

The reply follows `<|turn>model\\n`. After tool calls the model stops on `<|tool_response>`, and the
template writes the results into the same model turn, so the next reply continues right after the
last `<tool_response|>` (a resume marker, not a new header). A text reply ends on `<turn|>`. The
template writes reasoning as `<|channel>thought\\n` + R + `\\n<channel|>` (only for turns that call
tools in the current exchange; the final answer's from revision 5 on) and content trimmed, after the
calls and their results. Argument values are Gemma's own literal syntax (`read_arguments`): strings
between `<|"|>` delimiters, unquoted keys, numbers, `true`/`false`, `null` (`None` in the first
revisions); both parsing engines only cut each call block out, and `read_call` reads it the same way
for both. Imports only `formats.base`/`checks`/`live_split`.
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any

from gateway_workers.formats.arguments import read_scalar
from gateway_workers.formats.base import ResponseFormat, text_blocks_template
from gateway_workers.formats.checks import check_tagged
from gateway_workers.formats.live_split import TagGrammar, TagSplitter

ANCHOR = "<|turn>model\n"
RESUME = "<tool_response|>"
END_MARKERS = ("<turn|>", "<|tool_response>", "<eos>")
THOUGHT = ("<|channel>thought\n", "<channel|>")
CALL = ("<|tool_call>", "<tool_call|>")
STRING = '<|"|>'
_NAME = r"[^{<\s]+"

GEMMA4_TEMPLATE = text_blocks_template(
    {"start_anchor_pattern": r"<\|turn>model\n|<tool_response\|>"}, THOUGHT, CALL
)

# --- argument values ------------------------------------------------------------------------------

_KEY = re.compile(r"[^\s:{}\[\],<>]+")
_SCALAR = re.compile(r"[^,}\]\s<]+")
_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?|-?inf|nan")
_LITERALS: dict[str, Any] = {"true": True, "false": False, "null": None, "None": None}


_CALL_BODY = re.compile(rf"call:({_NAME})(\{{.*\}})", re.DOTALL)


def read_call(block: str) -> list[dict[str, Any]]:
    """A `call:NAME{key:value,...}` block as its one call; ValueError when it is not exactly that."""
    found = _CALL_BODY.fullmatch(block)
    if found is None:
        raise ValueError(f"not a call:NAME{{...}} block: {block[:80]!r}")
    arguments, at = _value(found.group(2), 0)
    if at != len(found.group(2)):
        raise ValueError(f"text after the arguments of {found.group(1)!r}")
    return [{"name": found.group(1), "arguments": arguments}]


def _value(text: str, at: int) -> tuple[Any, int]:
    if text.startswith(STRING, at):
        end = text.find(STRING, at + len(STRING))
        if end < 0:
            raise ValueError('unterminated <|"|> string')
        return text[at + len(STRING) : end], end + len(STRING)
    if text.startswith("{", at):
        return _items(text, at + 1, "}", keyed=True)
    if text.startswith("[", at):
        return _items(text, at + 1, "]", keyed=False)
    return read_scalar(text, at, _SCALAR, _LITERALS, _NUMBER, "Gemma ")


def _items(text: str, at: int, close: str, keyed: bool) -> tuple[Any, int]:
    out: Any = {} if keyed else []
    if text.startswith(close, at):
        return out, at + 1
    while True:
        if keyed:
            key = _KEY.match(text, at)
            if key is None or not text.startswith(":", key.end()):
                raise ValueError(f"no key at {at}")
            value, at = _value(text, key.end() + 1)
            out[key.group()] = value
        else:
            value, at = _value(text, at)
            out.append(value)
        if text.startswith(close, at):
            return out, at + 1
        if not text.startswith(",", at):
            raise ValueError(f"expected ',' or {close!r} at {at}")
        at += 1


def _call_body(inside: str) -> str | None:
    try:
        read_call(inside)
    except ValueError as e:
        return f"malformed Gemma tool call: {e}"
    return None


def _finish(content: str, reasoning: str | None) -> tuple[str, str | None]:
    # The template writes '<|channel>thought\n' + R + '\n<channel|>' and the content trimmed.
    return content.strip(), reasoning.strip("\n") if reasoning is not None else None


GEMMA4 = ResponseFormat(
    "gemma4", ANCHOR, END_MARKERS, GEMMA4_TEMPLATE, resume_markers=(RESUME,),
    check=lambda body: check_tagged(body, think=THOUGHT, call=CALL, call_body=_call_body), finish=_finish,
    calls_reader=read_call,
    live=partial(TagSplitter, TagGrammar(END_MARKERS, think=THOUGHT, call=CALL, content_trim_start=None,
                                         content_trim_end=None)),
)
