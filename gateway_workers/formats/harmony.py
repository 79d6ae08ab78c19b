"""GPT-OSS (harmony): a reply is a sequence of channel messages after `<|start|>assistant`.

`<|channel|>analysis<|message|>...<|end|>` is reasoning, `<|channel|>final<|message|>...` the answer
(`commentary` without a recipient: a preamble, also content), and a message addressed
`to=functions.NAME` on the commentary channel is a tool call with JSON arguments, ended by
`<|call|>` (a stop token: one call per generation, so no parallel calls). The recipient may sit
before or after `<|channel|>` in the header; both are accepted. Imports only `formats.base`/`live_split`.
"""

from __future__ import annotations

import re
from typing import Any

from gateway_workers.formats.base import ResponseFormat
from gateway_workers.formats.live_split import Reader, partial_suffix
from gateway_workers.formats.parsed import DeltaKind, LiveDelta

ANCHOR = "<|start|>assistant"
END_MARKERS = ("<|return|>", "<|call|>", "<|endoftext|>")
_TEXT = {"content": "text", "content_args": {"strip": False}}
# A tool-call header: `[<|start|>assistant] to=functions.X<|channel|>commentary json<|message|>` or
# `<|channel|>commentary to=functions.X <|constrain|>json<|message|>`; the lookahead finds the name in either.
CALL_NAME = r"(?:<\|start\|>assistant)?(?=[^<]*(?:<\|channel\|>[^<]*)?to=functions\.(?P<name>[^\s<]+))"
# It starts at the search start, at the start of a run without '<', or at `<|start|>assistant`: the leftmost
# match always does, and trying only those keeps the lookahead from rescanning a long run of reasoning
# from each of its characters. The template's literals sit in alternations (see `formats.base`).
_TEMPLATE_CALL_HEADER = (
    r"(?:\G|(?<![^<])|(?=<\|start\|>assistant))"
    + CALL_NAME
    + r"[^<]*(?:<\|channel\|>commentary|(?!))[^<]*(?:<\|constrain\|>[^<]*)?(?:<\|message\|>|(?!))"
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
            "open_pattern": _TEMPLATE_CALL_HEADER,
            "close_pattern": r"<\|call\|>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
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


_LIVE_HEADERS: dict[str, DeltaKind] = {
    "<|channel|>analysis": "reasoning",
    "<|channel|>final": "content",
    "<|channel|>commentary": "content",  # without a recipient: a preamble
}
_BODY_ENDS = ("<|end|>", "<|return|>", "<|call|>", "<|start|>", "<|channel|>", "<|message|>")


class HarmonySplitter:
    """Harmony's live split: each channel message's body as it is sampled (analysis: reasoning; final, and
    commentary without a recipient: text), verbatim as the parse keeps it.

    A tool call is the generation's last message (`<|call|>` stops it), so it comes with the final
    parse; so does everything after a header this does not know (a recipient, a constraint).
    """

    def __init__(self, head: str, read: Reader) -> None:
        self._buffer = ""
        self._kind: DeltaKind | None = None  # None: reading a message header
        self._first = True
        self._done = False

    def feed(self, text: str) -> list[LiveDelta]:
        self._buffer += text
        out: list[LiveDelta] = []
        while not self._done and self._step(out):
            pass
        return out

    def _step(self, out: list[LiveDelta]) -> bool:
        buf = self._buffer
        if self._kind is None:
            at = buf.find("<|message|>")
            if at < 0:
                return False
            header = buf[:at]
            if header.startswith(ANCHOR):
                header = header[len(ANCHOR) :]
            elif not self._first:  # the check refuses a later message without its start
                header = ""
            kind = _LIVE_HEADERS.get(header)
            if kind is None:
                self._done = True
                return False
            self._kind, self._first, self._buffer = kind, False, buf[at + len("<|message|>") :]
            return True
        ends = [(at, marker) for marker in _BODY_ENDS if (at := buf.find(marker)) >= 0]
        if not ends:
            keep = partial_suffix(buf, _BODY_ENDS)
            if len(buf) > keep:
                out.append(LiveDelta(self._kind, buf[: len(buf) - keep]))
            self._buffer = buf[len(buf) - keep :]
            return False
        at, marker = min(ends)
        if at:
            out.append(LiveDelta(self._kind, buf[:at]))
        if marker != "<|end|>":  # <|return|> ends the reply; anything else is the final parse's to read
            self._done = True
            return False
        self._kind, self._buffer = None, buf[at + len(marker) :]
        return True


GPT_OSS = ResponseFormat(
    "gpt_oss", ANCHOR, END_MARKERS, GPT_OSS_TEMPLATE, check=_check, finish=_finish, parallel_calls=False,
    live=HarmonySplitter,
)
