"""Llama 3.1 / 3.2 JSON tool calls: the whole reply is `{"name": ..., "parameters": {...}}` (or plain text).

The reply follows `<|start_header_id|>assistant<|end_header_id|>\\n\\n` and ends on `<|eot_id|>`
(`<|eom_id|>` in ipython mode). A reply is a tool call when it starts with a JSON object whose
first key is "name" (optionally after `<|python_tag|>`); several calls separated by ';' are all
returned, but the Llama templates render one call per assistant message and refuse more, so
parallel calls cannot be echoed back. Imports only `formats.base`/`live_split`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from gateway_workers.formats.base import AT_SPACE_RUN, ResponseFormat
from gateway_workers.formats.live_split import Reader, TagGrammar, TagSplitter
from gateway_workers.formats.parsed import LiveDelta

ANCHOR = "<|start_header_id|>assistant<|end_header_id|>\n\n"
END_MARKERS = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")
_CALL_START = re.compile(r'\s*(?:<\|python_tag\|>\s*)?(?=\{\s*"name"\s*:)')
_DECODER = json.JSONDecoder()

LLAMA3_TEMPLATE: dict[str, Any] = {
    "version": 1,
    "start_anchor": ANCHOR,
    "fields": {
        "tool_calls": {
            "open_pattern": r'\A\s*(?:<\|python_tag\|>\s*)?(?=\{\s*"name"\s*:)|'
            + AT_SPACE_RUN
            + r'\s*;\s*(?=\{\s*"name"\s*:)',
            "close_pattern": AT_SPACE_RUN + r'(?=\s*;\s*\{\s*"name"\s*:)',
            "repeats": True,
            "content": "json",
        },
        "content": {"content": "text", "content_args": {"strip": False}},
    },
}


def _check(body: str) -> str | int:
    """A call reply must be nothing but ';'-separated JSON objects; plain text holds no call."""
    start = _CALL_START.match(body)
    if start is None:
        return 0
    at, count = start.end(), 0
    while True:
        try:
            _, at = _DECODER.raw_decode(body, at)
        except ValueError as e:
            return f"invalid JSON in a tool call (reply truncated?): {e}"
        count += 1
        rest = body[at:].lstrip()
        if not rest:
            return count
        if not rest.startswith(";"):
            return "text after a JSON tool call"
        at = len(body) - len(rest) + 1
        at += len(body[at:]) - len(body[at:].lstrip())


def _finish(content: str, reasoning: str | None) -> tuple[str, str | None]:
    return content.strip(), None  # the template writes `content | trim`


_PYTHON_TAG = "<|python_tag|>"
_TEXT_GRAMMAR = TagGrammar(END_MARKERS, content_trim_start=None, content_trim_end=None)


class LlamaSplitter:
    """Llama's live split: a reply is either tool calls, which come with the final parse (the whole reply is
    the call list), or text, streamed as soon as its first character shows it is not a call."""

    def __init__(self, head: str, read: Reader) -> None:
        self._text = TagSplitter(_TEXT_GRAMMAR, head, read)
        self._lead = ""
        self._is_text: bool | None = None

    def feed(self, text: str) -> list[LiveDelta]:
        if self._is_text is None:
            self._lead += text
            lead = self._lead.lstrip()
            if not lead or (len(lead) < len(_PYTHON_TAG) and _PYTHON_TAG.startswith(lead)):
                return []
            self._is_text = not (lead.startswith("{") or lead.startswith(_PYTHON_TAG))
            text, self._lead = self._lead, ""
        return self._text.feed(text) if self._is_text else []


LLAMA3_JSON = ResponseFormat(
    "llama3_json", ANCHOR, END_MARKERS, LLAMA3_TEMPLATE, check=_check, finish=_finish, reasoning=False,
    parallel_calls=False, live=LlamaSplitter,
)
