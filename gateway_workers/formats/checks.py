"""Structural checks shared by the tag-delimited formats: one reasoning block, balanced call blocks.

A check reads the whole reply body (the prompt's prefill, e.g. an opened `<think>`, included)
and returns either the reason the reply is malformed or how many tool calls it holds. The
transformers engines are lenient (an unterminated block is silently closed at the end), so
this is what makes truncated or interleaved output `ill_formed` instead of a partial parse.
Pure string code: imports nothing from the gateway.
"""

from __future__ import annotations

import re
from collections.abc import Callable

THINK = ("<think>", "</think>")
TOOL_CALL = ("<tool_call>", "</tool_call>")

BlockCheck = Callable[[str], "str | None"]
# The pattern of each (open, close) pair of call tags, built once (formats use one or two pairs).
_TAGS: dict[tuple[str, str], re.Pattern[str]] = {}


def check_tagged(
    body: str,
    *,
    think: tuple[str, str] | None = THINK,
    call: tuple[str, str] = TOOL_CALL,
    call_body: BlockCheck | None = None,
) -> str | int:
    """Reason the body is malformed, or its number of `call` blocks.

    `think`: the reasoning tags (None: the family has no reasoning, the tags are plain text). At
    most one block, at the very start, closed, with no call inside. `call_body` checks the text
    inside each call block.
    """
    after = body
    if think is not None:
        problem, after = _split_reasoning(body, think, call)
        if problem is not None:
            return problem
    call_open, call_close = call
    tags = _TAGS.get(call)
    if tags is None:
        tags = _TAGS[call] = re.compile(f"{re.escape(call_open)}|{re.escape(call_close)}")
    inside_from: int | None = None
    count = 0
    for tag in tags.finditer(after):
        opening = tag.group() == call_open
        if opening and inside_from is not None:
            return f"nested {call_open}"
        if not opening and inside_from is None:
            return f"{call_close} without {call_open}"
        if opening:
            inside_from = tag.end()
            continue
        if call_body is not None:
            problem = call_body(after[inside_from : tag.start()])
            if problem is not None:
                return problem
        inside_from = None
        count += 1
    if inside_from is not None:
        return f"unterminated {call_open} (reply truncated?)"
    return count


def _split_reasoning(body: str, think: tuple[str, str], call: tuple[str, str]) -> tuple[str | None, str]:
    """(problem, the body after the reasoning block)."""
    think_open, think_close = think
    opens, closes = body.count(think_open), body.count(think_close)
    if not opens and not closes:
        return None, body
    if opens != 1 or closes > 1:
        return f"malformed {think_open} block", body
    if body.lstrip().find(think_open) != 0:
        return f"{think_open} after the start of the reply", body
    if not closes:
        return f"unterminated {think_open} block (reply truncated?)", body
    reasoning, after = body.split(think_close, 1)
    if call[0] in reasoning or call[1] in reasoning:
        return f"tool call inside {think_open}", body
    return None, after


def fullmatch_check(pattern: re.Pattern[str], what: str) -> BlockCheck:
    """A `call_body` check: the block's inside must match `pattern` entirely."""

    def check(inside: str) -> str | None:
        return None if pattern.fullmatch(inside) else f"malformed {what} inside a tool call"

    return check
