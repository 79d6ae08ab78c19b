"""GLM-4-MoE (GLM-4.5/4.6): `<think>` reasoning, `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...`.

The reply follows `<|assistant|>` and ends where the model starts the next role: it stops on
`<|observation|>` (tool results follow) or `<|user|>`, and that stop token is also the first
token the template writes for the next message, so the sampled ids extend cleanly. Values are
text: strings verbatim, everything else JSON (the template's `tojson`); both are cast by the
tool's JSON schema. Imports only `formats.base`/`checks`/`live_split`.
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any

from gateway_workers.formats.base import SPACES_THEN_TOOL_CALL, ResponseFormat
from gateway_workers.formats.checks import THINK, TOOL_CALL, check_tagged, fullmatch_check
from gateway_workers.formats.live_split import TagGrammar, TagSplitter

ANCHOR = "<|assistant|>"
END_MARKERS = ("<|observation|>", "<|user|>", "<|endoftext|>")
_TEXT = {"content": "text", "content_args": {"strip": False}}
ARG = r"<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)</arg_value>"
# Neither a key nor a value spans its close tag, so a block that fails to match fails in linear time.
_CALL_BODY = re.compile(
    r"[^\n<]+(?:\n\s*)?(?:<arg_key>(?:(?!</arg_key>).)*</arg_key>\s*<arg_value>(?:(?!</arg_value>).)*</arg_value>\s*)*",
    re.DOTALL,
)

GLM4_MOE_TEMPLATE: dict[str, Any] = {
    "version": 1,
    "defaults": {"reasoning": None},  # an empty think block is reasoning "", none is None
    "start_anchor": ANCHOR,
    "fields": {
        "reasoning": {"open": "<think>", "close": "</think>", **_TEXT},
        "tool_calls": {
            "open_pattern": SPACES_THEN_TOOL_CALL + r"(?P<name>[^\n<]+)",
            "close": "</tool_call>",
            "repeats": True,
            "content": "xml-inline",
            "content_args": {"tag_pattern": ARG},
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {**_TEXT, "repeats": True},
    },
}


def _finish(content: str, reasoning: str | None) -> tuple[str, str | None]:
    # The template writes '\n<think>' + reasoning.strip() + '</think>' and '\n' + content.strip().
    return content.strip(), reasoning.strip() if reasoning is not None else None


GLM4_MOE = ResponseFormat(
    "glm4_moe", ANCHOR, END_MARKERS, GLM4_MOE_TEMPLATE,
    check=lambda body: check_tagged(body, think=THINK, call_body=fullmatch_check(_CALL_BODY, "<arg_key>/<arg_value>")),
    finish=_finish, string_arguments=True,
    live=partial(TagSplitter, TagGrammar(END_MARKERS, think=THINK, call=TOOL_CALL, reasoning_trim=None,
                                         content_trim_start=None, content_trim_end=None)),
)
