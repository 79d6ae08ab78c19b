"""Live replies: sampled ids -> text deltas -> reasoning / text / tool-call deltas, reconciled with the final parse.

Sits between the engine's token stream and the wire adapters. `IncrementalDecoder` turns
ids into text without splitting a UTF-8 character; a format's `LiveSplitter` turns text
into `LiveDelta`s while the engine generates, emitting only what the final parse of a
well-formed reply will agree with (it holds back partial tags, whitespace a tag would
swallow, a tool call until it is complete). The final parse stays the non-streaming
`ResponseParser.parse` of all ids; `StreamTracker.remainder` sends whatever it adds and says
whether what was streamed is a prefix of it. Formats without a live splitter stream at the
end. Must not import the app, adapters, engines or the backplane.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from gateway_workers.formats import ParsedResponse

logger = logging.getLogger(__name__)

DeltaKind = Literal["reasoning", "content", "tool_call"]
_REPLACEMENT = "\ufffd"  # what a decoder returns for an incomplete UTF-8 sequence


@dataclass(frozen=True, slots=True)
class LiveDelta:
    """A piece of the reply: reasoning or content text, or one complete canonical tool call."""

    kind: DeltaKind
    text: str = ""
    call: dict[str, Any] | None = None


def reply_deltas(parsed: ParsedResponse) -> list[LiveDelta]:
    """A whole reply as blocks in reply order: reasoning, text, then each tool call (empty fields left out)."""
    deltas = []
    if parsed.reasoning:
        deltas.append(LiveDelta("reasoning", parsed.reasoning))
    if parsed.content:
        deltas.append(LiveDelta("content", parsed.content))
    deltas.extend(LiveDelta("tool_call", call=call) for call in parsed.tool_calls)
    return deltas


class IncrementalDecoder:
    """Ids -> new text as they arrive; an id that ends mid-character waits for the next one.

    Decodes a short window (the ids of the previous step plus the new ones) and keeps what
    the new ids added, so cost stays linear and tokenizers that merge across ids decode right.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # ids before this are already returned as text

    def feed(self, ids: Sequence[int]) -> str:
        self._ids.extend(ids)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith(_REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def flush(self) -> str:
        """Whatever is held back (an incomplete character decodes to U+FFFD)."""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return after[len(before) :]


class LiveSplitter(Protocol):
    """Splits one reply's text as it arrives; `feed` returns the deltas that became certain."""

    def feed(self, text: str) -> list[LiveDelta]: ...


class BufferedSplitter:
    """For formats without a live splitter: nothing is certain before the final parse."""

    def feed(self, text: str) -> list[LiveDelta]:
        return []


@dataclass(frozen=True, slots=True)
class TagFormat:
    """A reply format of tagged regions: optional reasoning, text, then tool-call blocks, then an end marker."""

    think_open: str
    think_close: str
    call_open: str
    call_close: str
    end_markers: tuple[str, ...]
    anchor: str  # the assistant header the prompt ends with; the prompt after it may pre-open reasoning
    parse_call: Callable[[str], dict[str, Any] | None]


def _json_call(body: str) -> dict[str, Any] | None:
    """A Qwen3 `<tool_call>` body as a canonical call, or None when the final parse will call it ill-formed."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"name": call["name"], "arguments": arguments}


QWEN3_TAGS = TagFormat(
    think_open="<think>",
    think_close="</think>",
    call_open="<tool_call>",
    call_close="</tool_call>",
    end_markers=("<|im_end|>", "<|endoftext|>"),
    anchor="<|im_start|>assistant\n",
    parse_call=_json_call,
)

_State = Literal["start", "reasoning", "content", "call", "after_call", "done"]


class TagSplitter:
    """The live splitter of a `TagFormat`, trimming text the way the Qwen3 parser does.

    Reasoning is stripped of newlines at both ends and content of newlines at its start;
    whitespace before a tool-call tag belongs to no field. Anything unexpected (text after a
    tool call, a call whose body will not parse) stops the live split: the rest comes from
    the final parse.
    """

    def __init__(self, tags: TagFormat, prompt_text: str) -> None:
        self._tags = tags
        self._buffer = ""
        self._state: _State = "start"
        self._started = False  # the current text field has emitted a non-newline character
        self._newlines = ""  # reasoning: trailing newlines held until more reasoning follows
        at = prompt_text.rfind(tags.anchor)
        head = prompt_text[at + len(tags.anchor) :] if at >= 0 else ""
        if tags.think_open in head:
            self._state = "content" if tags.think_close in head.split(tags.think_open)[-1] else "reasoning"

    def feed(self, text: str) -> list[LiveDelta]:
        self._buffer += text
        out: list[LiveDelta] = []
        while self._step(out):
            pass
        return out

    def _step(self, out: list[LiveDelta]) -> bool:
        """Advance as far as the buffer allows; True when the state changed and another step may progress."""
        tags, buf = self._tags, self._buffer
        if self._state == "start":
            lead = buf.lstrip()
            if not lead or (len(lead) < len(tags.think_open) and tags.think_open.startswith(lead)):
                return False
            if lead.startswith(tags.think_open):
                self._enter("reasoning", lead[len(tags.think_open) :])
            else:
                self._enter("content", buf)
            return True
        if self._state == "reasoning":
            at = buf.find(tags.think_close)
            if at >= 0:
                self._reasoning(buf[:at], out, closing=True)
                self._enter("content", buf[at + len(tags.think_close) :])
                return True
            keep = _partial_suffix(buf, (tags.think_close,))
            self._reasoning(buf[: len(buf) - keep], out, closing=False)
            self._buffer = buf[len(buf) - keep :]
            return False
        if self._state == "content":
            call = buf.find(tags.call_open)
            end = min((i for i in (buf.find(m) for m in tags.end_markers) if i >= 0), default=-1)
            if call >= 0 and (end < 0 or call < end):
                self._content(buf[:call].rstrip(), out)
                self._enter("call", buf[call + len(tags.call_open) :])
                return True
            if end >= 0:
                self._content(buf[:end], out)
                self._enter("done", "")
                return False
            keep = _partial_suffix(buf, (tags.call_open, *tags.end_markers))
            keep = len(buf) - len(buf[: len(buf) - keep].rstrip())  # whitespace before a tag is swallowed
            self._content(buf[: len(buf) - keep], out)
            self._buffer = buf[len(buf) - keep :]
            return False
        if self._state == "call":
            at = buf.find(tags.call_close)
            if at < 0:
                return False
            parsed = tags.parse_call(buf[:at].strip())
            if parsed is None:
                self._enter("done", "")  # the final parse will call the reply ill-formed
                return False
            out.append(LiveDelta("tool_call", call=parsed))
            self._enter("after_call", buf[at + len(tags.call_close) :])
            return True
        if self._state == "after_call":
            lead = buf.lstrip()
            if lead.startswith(tags.call_open):
                self._enter("call", lead[len(tags.call_open) :])
                return True
            if not lead or any(m.startswith(lead) or lead.startswith(m) for m in (tags.call_open, *tags.end_markers)):
                return False
            self._enter("done", "")  # text after tool calls: joined by the final parse, sent at the end
        return False

    def _enter(self, state: _State, buffer: str) -> None:
        self._state, self._buffer = state, buffer
        self._started, self._newlines = False, ""

    def _reasoning(self, text: str, out: list[LiveDelta], closing: bool) -> None:
        if not self._started:
            text = text.lstrip("\n")
        if closing:
            text = text.rstrip("\n")
            held, self._newlines = self._newlines if text else "", ""
        else:
            body = text.rstrip("\n")
            held = self._newlines if body else ""
            self._newlines = (self._newlines if not body else "") + text[len(body) :]
            text = body
        if text:
            self._started = True
            out.append(LiveDelta("reasoning", held + text))

    def _content(self, text: str, out: list[LiveDelta]) -> None:
        if not self._started:
            text = text.lstrip("\n")
        if text:
            self._started = True
            out.append(LiveDelta("content", text))


def _partial_suffix(text: str, tags: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


# format name (`ResponseParser.format_name`) -> tags; formats not listed stream at the end.
LIVE_FORMATS: dict[str, TagFormat] = {"qwen3": QWEN3_TAGS}


def live_splitter(format_name: str, prompt_text: str) -> LiveSplitter:
    """The live splitter for a response format, given the rendered prompt's text (its tail matters)."""
    tags = LIVE_FORMATS.get(format_name)
    return TagSplitter(tags, prompt_text) if tags is not None else BufferedSplitter()


class StreamTracker:
    """What the agent was sent, per field, and what the final parse adds to it."""

    def __init__(self) -> None:
        self._text: dict[str, list[str]] = {"reasoning": [], "content": []}
        self.calls: list[dict[str, Any]] = []

    def record(self, delta: LiveDelta) -> None:
        if delta.kind == "tool_call":
            assert delta.call is not None
            self.calls.append(delta.call)
        else:
            self._text[delta.kind].append(delta.text)

    def remainder(self, final: ParsedResponse) -> tuple[list[LiveDelta], bool]:
        """(deltas that complete the stream to `final`, whether what was streamed is a prefix of `final`)."""
        tail: list[LiveDelta] = []
        consistent = True
        for kind, value in (("reasoning", final.reasoning or ""), ("content", final.content)):
            sent = "".join(self._text[kind])
            if value.startswith(sent):
                if len(value) > len(sent):
                    tail.append(LiveDelta(kind, value[len(sent) :]))  # type: ignore[arg-type]
            else:
                consistent = False
        if final.tool_calls[: len(self.calls)] == self.calls:
            tail.extend(LiveDelta("tool_call", call=dict(c)) for c in final.tool_calls[len(self.calls) :])
        else:
            consistent = False
        for delta in tail:
            self.record(delta)
        return tail, consistent
