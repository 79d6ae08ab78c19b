"""GPT-OSS (harmony): a reply is a sequence of channel messages after `<|start|>assistant`.

`<|channel|>analysis<|message|>...<|end|>` is reasoning, `<|channel|>final<|message|>...` the answer
(`commentary` without a recipient: a preamble, also content), and a message addressed
`to=functions.NAME` on the commentary channel is a tool call with JSON arguments, ended by
`<|call|>` (a stop token: one call per generation, so no parallel calls). The recipient may sit
before or after `<|channel|>` in the header; both are accepted. Imports only `formats.base`.
"""

from __future__ import annotations

import re
from typing import Any

from gateway_workers.formats.base import ResponseFormat

ANCHOR = "<|start|>assistant"
END_MARKERS = ("<|return|>", "<|call|>", "<|endoftext|>")
_TEXT = {"content": "text", "content_args": {"strip": False}}
# A tool-call header: `[<|start|>assistant] to=functions.X<|channel|>commentary json<|message|>` or
# `<|channel|>commentary to=functions.X <|constrain|>json<|message|>`; the lookahead finds the name in either.
_CALL_HEADER = (
    r"(?:<\|start\|>assistant)?(?=[^<]*(?:<\|channel\|>[^<]*)?to=functions\.(?P<name>[^\s<]+))"
    r"[^<]*<\|channel\|>commentary[^<]*(?:<\|constrain\|>[^<]*)?<\|message\|>"
)

GPT_OSS_TEMPLATE: dict[str, Any] = {
    "version": 1,
    "start_anchor": ANCHOR,
    "fields": {
        "reasoning": {
            "open_pattern": r"<\|channel\|>analysis<\|message\|>",
            "close_pattern": r"<\|end\|>",
            "repeats": True,
            **_TEXT,
        },
        "content": {
            "open_pattern": r"<\|channel\|>(?:final|commentary)<\|message\|>",
            "close_pattern": r"<\|end\|>|<\|return\|>",
            "repeats": True,
            **_TEXT,
        },
        "tool_calls": {
            "open_pattern": _CALL_HEADER,
            "close_pattern": r"<\|call\|>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
    },
}
GPT_OSS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "reasoning": {
            "type": "array",
            "x-regex-iterator": r"<\|channel\|>analysis<\|message\|>(.*?)(?:<\|end\|>|\Z)",
            "items": {"type": "string"},
        },
        "content": {
            "type": "array",
            "x-regex-iterator": r"<\|channel\|>(?:final|commentary)<\|message\|>(.*?)(?:<\|end\|>|<\|return\|>|\Z)",
            "items": {"type": "string"},
        },
        "tool_calls": {
            "type": "array",
            "x-regex-iterator": _CALL_HEADER + r"(?P<arguments>.*?)(?:<\|call\|>|\Z)",
            "items": {"type": "object", "properties": {"name": {"type": "string"}, "arguments": {"x-parser": "json"}}},
        },
    },
}

_STOPS = r"<\|start\|>|<\|end\|>|<\|call\|>|<\|return\|>|<\|message\|>|<\|channel\|>"
_MESSAGE = re.compile(
    rf"(?P<header>(?:(?!{_STOPS}).)*(?:<\|channel\|>(?:(?!{_STOPS}).)*)?)<\|message\|>"
    rf"(?P<body>(?:(?!{_STOPS}).)*)(?P<end><\|end\|>|<\|call\|>|<\|return\|>|\Z)",
    re.DOTALL,
)
_CHANNEL = re.compile(r"<\|channel\|>(\w+)")
_RECIPIENT = re.compile(r"to=(\S+?)(?=\s|<|$)")


def _check(body: str) -> str | int:
    """Walk the channel messages: each well formed, on a known channel, calls only to `functions.*`."""
    at, calls, first = 0, 0, True
    while at < len(body):
        if body.startswith(ANCHOR, at):
            at += len(ANCHOR)
        elif not first:
            return "harmony message without <|start|>assistant"
        message = _MESSAGE.match(body, at)
        if message is None:
            return "malformed harmony message (reply truncated?)"
        header = message.group("header").replace("<|constrain|>", " ")
        channel = _CHANNEL.search(message.group("header"))
        recipient = _RECIPIENT.search(header)
        if channel is None or channel.group(1) not in ("analysis", "commentary", "final"):
            return "harmony message without a known channel"
        if recipient is not None:
            if not recipient.group(1).startswith("functions.") or channel.group(1) != "commentary":
                return f"harmony message to {recipient.group(1)!r} on {channel.group(1)} is not a function call"
            calls += 1
        at, first = message.end(), False
    return calls


def _finish(content: str, reasoning: str | None) -> tuple[str, str | None]:
    return content, reasoning


GPT_OSS = ResponseFormat(
    name="gpt_oss",
    anchor=ANCHOR,
    end_markers=END_MARKERS,
    template=GPT_OSS_TEMPLATE,
    schema=GPT_OSS_SCHEMA,
    check=_check,
    finish=_finish,
    parallel_calls=False,
)
