"""LFM2 / LFM2.5 (Liquid): `<think>` reasoning, then text, then one block of Python-style calls.

ChatML turns (`<|im_start|>assistant\\n` ... `<|im_end|>`). The template writes an assistant message
as `<think>` + R + `</think>` (LFM2.5, for the turns since the last user message), the content
verbatim, then all its calls in one `<|tool_call_start|>[name(key=value, ...), ...]<|tool_call_end|>`
block. Values are Python-style literals (`read_calls`): strings in single quotes (double quotes read
too), numbers, `True`/`False`/`None`, and lists and dicts, which the templates write as JSON or as
Python reprs. Both parsing engines only cut the block out; `read_calls` reads it the same way for
both, typed as written (no schema cast needed). Imports only `formats.base`/`checks`/`live_split`.
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any

from gateway_workers.formats.arguments import read_scalar
from gateway_workers.formats.base import ResponseFormat, text_blocks_template
from gateway_workers.formats.checks import THINK, check_tagged
from gateway_workers.formats.live_split import TagGrammar, TagSplitter

ANCHOR = "<|im_start|>assistant\n"
END_MARKERS = ("<|im_end|>", "<|endoftext|>")
CALLS = ("<|tool_call_start|>", "<|tool_call_end|>")

LFM2_TEMPLATE = text_blocks_template({"start_anchor": ANCHOR}, THINK, CALLS)

# --- the call block ------------------------------------------------------------------------------

_NAME = re.compile(r"\s*([A-Za-z_][\w.\-]*)\s*")
_SCALAR = re.compile(r"[^,)\]}\s:]+")
_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_LITERALS: dict[str, Any] = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}
_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", "'": "'", '"': '"'}


def read_calls(block: str) -> list[dict[str, Any]]:
    """`[name(key=value, ...), ...]` as calls; ValueError when the block is not exactly such a list."""
    at = _skip(block, 0)
    if not block.startswith("[", at):
        raise ValueError("a tool call block must be a [...] list")
    calls: list[dict[str, Any]] = []
    at = _skip(block, at + 1)
    if block.startswith("]", at):
        raise ValueError("an empty tool call list")
    while True:
        name = _NAME.match(block, at)
        if name is None or not block.startswith("(", name.end()):
            raise ValueError(f"no name(...) call at {at}")
        arguments, at = _arguments(block, name.end() + 1)
        calls.append({"name": name.group(1), "arguments": arguments})
        at = _skip(block, at)
        if block.startswith("]", at):
            if _skip(block, at + 1) != len(block):
                raise ValueError("text after the tool call list")
            return calls
        if not block.startswith(",", at):
            raise ValueError(f"expected ',' or ']' at {at}")
        at = _skip(block, at + 1)


def _arguments(text: str, at: int) -> tuple[dict[str, Any], int]:
    out: dict[str, Any] = {}
    at = _skip(text, at)
    if text.startswith(")", at):
        return out, at + 1
    while True:
        key = _NAME.match(text, at)
        if key is None or not text.startswith("=", key.end()):
            raise ValueError(f"no key=value at {at}")
        if key.group(1) in out:
            raise ValueError(f"argument {key.group(1)!r} given twice")
        out[key.group(1)], at = _value(text, _skip(text, key.end() + 1))
        at = _skip(text, at)
        if text.startswith(")", at):
            return out, at + 1
        if not text.startswith(",", at):
            raise ValueError(f"expected ',' or ')' at {at}")
        at = _skip(text, at + 1)


def _value(text: str, at: int) -> tuple[Any, int]:
    quote = text[at : at + 1]
    if quote in ("'", '"'):
        return _string(text, at + 1, quote)
    if quote in ("[", "{"):
        close = "]" if quote == "[" else "}"
        items: Any = [] if quote == "[" else {}
        at = _skip(text, at + 1)
        if text.startswith(close, at):
            return items, at + 1
        while True:
            if quote == "[":
                value, at = _value(text, at)
                items.append(value)
            else:
                key, at = _value(text, at)
                at = _skip(text, at)
                if not isinstance(key, str) or not text.startswith(":", at):
                    raise ValueError(f"no 'key': value at {at}")
                items[key], at = _value(text, _skip(text, at + 1))
            at = _skip(text, at)
            if text.startswith(close, at):
                return items, at + 1
            if not text.startswith(",", at):
                raise ValueError(f"expected ',' or {close!r} at {at}")
            at = _skip(text, at + 1)
    return read_scalar(text, at, _SCALAR, _LITERALS, _NUMBER, "")


def _string(text: str, at: int, quote: str) -> tuple[str, int]:
    """A quoted string from just after its opening quote; backslash escapes as Python reads them."""
    out: list[str] = []
    while at < len(text):
        char = text[at]
        if char == quote:
            return "".join(out), at + 1
        if char == "\\" and at + 1 < len(text):
            nxt = text[at + 1]
            out.append(_ESCAPES.get(nxt, "\\" + nxt))
            at += 2
            continue
        out.append(char)
        at += 1
    raise ValueError("unterminated string")


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _check(body: str) -> str | int:
    """The structural verdict, counting the calls of each block (one block holds a turn's calls)."""
    calls = 0

    def block(inside: str) -> str | None:
        nonlocal calls
        try:
            calls += len(read_calls(inside))
        except ValueError as e:
            return f"malformed LFM2 tool call list: {e}"
        return None

    verdict = check_tagged(body, think=THINK, call=CALLS, call_body=block)
    return verdict if isinstance(verdict, str) else calls


def _finish(content: str, reasoning: str | None) -> tuple[str, str | None]:
    return content, reasoning  # the template writes both verbatim


LFM2 = ResponseFormat(
    "lfm2", ANCHOR, END_MARKERS, LFM2_TEMPLATE, check=_check, finish=_finish, calls_reader=read_calls,
    live=partial(TagSplitter, TagGrammar(END_MARKERS, think=THINK, call=CALLS, reasoning_trim="",
                                         content_trim_start="")),
)
