"""DeepSeek-R1 distills: reasoning only. The prompt pre-opens `<think>\\n`; the model closes it and answers.

Its template renders no tools and re-renders earlier replies without their reasoning (it keeps
what follows `</think>`), so the builder REALIGNs or FORKs those turns. Tool calls cannot be
parsed (`supports_tools=False`): requests that declare tools are refused with a 400.
Imports only `formats.base`/`checks`/`live_split`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from gateway_workers.formats.base import ResponseFormat
from gateway_workers.formats.checks import THINK, check_tagged
from gateway_workers.formats.live_split import TagGrammar, TagSplitter

ANCHOR = "<｜Assistant｜>"
END_MARKERS = ("<｜end▁of▁sentence｜>",)
_TEXT = {"content": "text", "content_args": {"strip": False}}

DEEPSEEK_R1_TEMPLATE: dict[str, Any] = {
    "version": 1,
    "defaults": {"reasoning": None},  # an empty think block is reasoning "", none is None
    "start_anchor": ANCHOR,
    "fields": {"reasoning": {"open": "<think>", "close": "</think>", **_TEXT}, "content": {**_TEXT, "repeats": True}},
}


def _finish(content: str, reasoning: str | None) -> tuple[str, str | None]:
    return content.lstrip("\n"), reasoning.strip("\n") if reasoning is not None else None


def _check(body: str) -> str | int:
    # No call tags exist in this family: a reserved pair that never occurs keeps the count at 0.
    return check_tagged(body, think=THINK, call=("\x00call\x00", "\x00/call\x00"))


DEEPSEEK_R1 = ResponseFormat(
    "deepseek_r1", ANCHOR, END_MARKERS, DEEPSEEK_R1_TEMPLATE, check=_check, finish=_finish, supports_tools=False,
    parallel_calls=False, live=partial(TagSplitter, TagGrammar(END_MARKERS, think=THINK)),
)
