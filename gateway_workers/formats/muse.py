"""Muse Glimmer (the ATEM protocol): a reply is a sequence of addressed messages after `<|start|>assistant`.

` to=self<|message|>` R `<|eom|>` is reasoning; ` to=NAME<|message|>` holding one
`<atem:function_calls>` block with one `<atem:invoke name="NAME">` is a tool call (several calls are
several such messages, joined by `<|eom|><|start|>assistant`); ` to=user<|message|>` T is the text,
and `<|eot|>` (the stop token) ends the turn. The template writes exactly that, in that order:
reasoning first, then the calls, or the text (a calling message renders no text). Parameter values
are text (strings verbatim, booleans `true`/`false`, `null`, lists and objects as JSON, numbers
printed): cast by the tool's JSON schema. Imports only `formats.base`/`live_split`.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from gateway_workers.formats.base import ResponseFormat
from gateway_workers.formats.live_split import Reader, SteppedSplitter, partial_suffix
from gateway_workers.formats.parsed import LiveDelta

ANCHOR = "<|start|>assistant"
END_OF_MESSAGE = "<|eom|>"
END_MARKERS = ("<|eot|>",)
NEXT_MESSAGE = END_OF_MESSAGE + ANCHOR  # what separates two messages of one reply
_TEXT = {"content": "text", "content_args": {"strip": False}}
_START = r"(?:<\|start\|>assistant)?"
CALL_HEADER = r" to=(?P<name>[^\s<]+)<\|message\|>"
INVOKE_OPEN = r'<atem:function_calls>\s*<atem:invoke name="[^"]*">'
INVOKE_CLOSE = r"</atem:invoke>\s*</atem:function_calls>"
PARAMETER = r'<atem:parameter name="(?P<key>[^"]*)">(?P<value>.*?)</atem:parameter>'

MUSE_TEMPLATE: dict[str, Any] = {
    "version": 1,
    "start_anchor": ANCHOR,
    "fields": {
        "reasoning": {"open_pattern": _START + r" to=self<\|message\|>", "close": END_OF_MESSAGE, **_TEXT},
        "content": {"open_pattern": _START + r" to=user<\|message\|>", "close": "<|eot|>", "repeats": True, **_TEXT},
        "tool_calls": {
            "open_pattern": _START + CALL_HEADER + INVOKE_OPEN,
            "close_pattern": INVOKE_CLOSE,
            "repeats": True,
            "content": "xml-inline",
            "content_args": {"tag_pattern": PARAMETER},
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
    },
}

_MESSAGE = re.compile(r" to=(?P<to>[^\s<]+)<\|message\|>(?P<body>(?:(?!<\|(?:start|message|eom|eot)\|>).)*)", re.DOTALL)
_CALL = re.compile(
    r'<atem:function_calls>\s*<atem:invoke name="(?P<name>[^"]*)">\s*'
    # a value never spans its close tag: one way to read each parameter, so a bad block fails in linear time
    r'(?P<parameters>(?:<atem:parameter name="[^"]*">(?:(?!</atem:parameter>).)*</atem:parameter>\s*)*)'
    r"</atem:invoke>\s*</atem:function_calls>",
    re.DOTALL,
)
_PARAMETER_NAME = re.compile(r'<atem:parameter name="([^"]*)">')


def _call_problem(to: str, body: str) -> str | None:
    call = _CALL.fullmatch(body)
    if call is None:
        return f"malformed <atem:function_calls> block in the message to {to!r} (reply truncated?)"
    if call.group("name") != to:
        return f"a message to {to!r} invokes {call.group('name')!r}"
    names = _PARAMETER_NAME.findall(call.group("parameters"))
    if len(set(names)) != len(names):
        return f"a parameter of {to!r} is given twice"
    return None


def _check(body: str) -> str | int:
    """Walk the messages: reasoning only first, each call one well-formed invoke of its recipient, text last."""
    at, calls, index = 0, 0, 0
    while True:
        message = _MESSAGE.match(body, at)
        if message is None:
            return "malformed ATEM message (no ' to=RECIPIENT<|message|>' header, or the reply was truncated)"
        to, at = message.group("to"), message.end()
        if to == "self":
            if index:
                return "reasoning (to=self) after the reply's first message"
        elif to != "user":
            problem = _call_problem(to, message.group("body"))
            if problem is not None:
                return problem
            calls += 1
        index += 1
        if at == len(body):
            if to == "self":
                return "the turn ended inside its reasoning (reply truncated?)"
            return calls
        if to == "user":
            return "the reply goes on after its text (to=user ends the turn)"
        if not body.startswith(NEXT_MESSAGE, at):
            return "an ATEM message not followed by <|eom|><|start|>assistant"
        at += len(NEXT_MESSAGE)


def _finish(content: str, reasoning: str | None) -> tuple[str, str | None]:
    return content, reasoning  # the template writes both verbatim


_BODY_ENDS = ("<|eom|>", "<|eot|>", "<|start|>", "<|message|>")
_CALL_END = "</atem:function_calls>"
_HEADER = re.compile(r" to=([^\s<]+)")
_State = Literal["header", "reasoning", "content", "call", "between", "done"]
_RECIPIENT_STATES: dict[str, _State] = {"self": "reasoning", "user": "content"}  # any other recipient: a call


class MuseSplitter(SteppedSplitter):
    """The live split: reasoning and text bodies as they are sampled, each tool call when its block closes.

    A completed call is read by the format's own parser (`read` of the reply up to the block's close),
    so a streamed call is the final parse's, typed arguments included. Anything unexpected stops the
    live split: the rest comes from the final parse.
    """

    def __init__(self, head: str, read: Reader) -> None:
        super().__init__(read)
        self._buffer = head  # what the prompt already wrote of the reply (normally nothing)
        self._state: _State = "header"

    def _step(self, out: list[LiveDelta]) -> bool:
        buf, state = self._buffer, self._state
        if state == "header":
            at = buf.find("<|message|>")
            if at < 0:
                return False
            header = _HEADER.fullmatch(buf[:at])
            to = header.group(1) if header else None
            kind: _State = _RECIPIENT_STATES.get(to, "call") if to is not None else "done"
            return self._enter(kind, buf[at + len("<|message|>") :])
        if state == "call":
            at = buf.find(_CALL_END)
            if at < 0:
                return False
            rest = buf[at + len(_CALL_END) :]
            if not self._send_closed_calls(rest, out):
                return self._enter("done", "")
            return self._enter("between", rest)
        if state == "between":  # after a message: the separator, then the next header
            if buf.startswith(NEXT_MESSAGE):
                return self._enter("header", buf[len(NEXT_MESSAGE) :])
            if NEXT_MESSAGE.startswith(buf):
                return False
            return self._enter("done", "")  # the end of the turn, or something for the final parse
        if state in ("reasoning", "content"):
            ends = [at for marker in _BODY_ENDS if (at := buf.find(marker)) >= 0]
            keep = len(buf) - min(ends) if ends else partial_suffix(buf, _BODY_ENDS)
            if len(buf) > keep:
                out.append(LiveDelta(state, buf[: len(buf) - keep]))
            if not ends:
                self._buffer = buf[len(buf) - keep :]
                return False
            # the text ends the turn; reasoning is followed by the next message
            return self._enter("between" if state == "reasoning" else "done", buf[len(buf) - keep :])
        return False

    def _enter(self, state: _State, buffer: str) -> bool:
        self._state, self._buffer = state, buffer
        return state != "done"


MUSE_GLIMMER = ResponseFormat(
    "muse_glimmer", ANCHOR, END_MARKERS, MUSE_TEMPLATE, check=_check, finish=_finish, string_arguments=True,
    live=MuseSplitter,
)
