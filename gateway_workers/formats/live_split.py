"""Live replies: sampled ids -> text deltas -> reasoning / text / tool-call deltas, reconciled with the final parse.

Sits between the engine's token stream and the wire adapters. `IncrementalDecoder` turns
ids into text without splitting a UTF-8 character; a format's `LiveSplitter` turns text
into `LiveDelta`s while the engine generates, emitting only what the final parse of a
well-formed reply will agree with (it holds back partial tags, whitespace a tag would
swallow, a tool call until it is complete, and then asks the format's parser what it says).
Each format names its splitter (`ResponseFormat.live`): the tagged families a `TagGrammar`,
harmony and Llama their own. The final parse stays the non-streaming `ResponseParser.parse` of
all ids; `StreamTracker.remainder` sends whatever it adds and says whether what was streamed is
a prefix of it. Parsers from outside the registry stream at the end. Must not import the app,
adapters, engines or the backplane.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gateway_workers.formats.parsed import LiveDelta, LiveSplitter, ParsedResponse, ResponseParser

logger = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"  # what a decoder returns for an incomplete UTF-8 sequence


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


# The format's own parse of the reply text so far (`FormatParser.read_text` with the turn's prompt and tools).
Reader = Callable[[str], ParsedResponse]
# What a `ResponseFormat.live` builds: a splitter for one reply, from what the prompt already wrote of the reply
# (`FormatParser.prefix_head`, e.g. an opened think block) and the reader.
SplitterFactory = Callable[[str, Reader], LiveSplitter]


class BufferedSplitter:
    """For formats without a live splitter: nothing is certain before the final parse."""

    def feed(self, text: str) -> list[LiveDelta]:
        return []


@dataclass(frozen=True, slots=True)
class TagGrammar:
    """A reply of tagged regions: an optional reasoning block, text, tool-call blocks, an end marker.

    The trims say what the format's final parse strips, as `str.strip(chars)` reads them (None: any
    whitespace, "": nothing), so the live text is a prefix of the parsed one.

    Args:
        think / call: (open, close) tags of the reasoning block and of a tool-call block (one call, or all of a
            turn's); None: the family has none.
        call_eats_space: the parse drops the whitespace before a call tag (the patterns' `\\s*`).
        reasoning_trim: stripped from both ends of the reasoning.
        content_trim_start / content_trim_end: stripped from the start / the end of the text.
    """

    end_markers: tuple[str, ...]
    think: tuple[str, str] | None = None
    call: tuple[str, str] | None = None
    call_eats_space: bool = True
    reasoning_trim: str | None = "\n"
    content_trim_start: str | None = "\n"
    content_trim_end: str | None = ""


class SteppedSplitter:
    """What the live splitters of tagged replies share: the reply so far, its unconsumed end (the buffer), the
    calls sent, and the loop that steps a subclass's state machine over the buffer as text arrives."""

    def __init__(self, read: Reader) -> None:
        self._read = read
        self._text = ""  # the whole reply so far; the buffer is its unconsumed end
        self._buffer = ""
        self._calls: list[dict[str, Any]] = []

    def feed(self, text: str) -> list[LiveDelta]:
        self._text += text
        self._buffer += text
        out: list[LiveDelta] = []
        while self._step(out):
            pass
        return out

    def _step(self, out: list[LiveDelta]) -> bool:
        """Advance as far as the buffer allows; True when the state changed and another step may progress."""
        raise NotImplementedError

    def _send_closed_calls(self, rest: str, out: list[LiveDelta]) -> bool:
        """A call block just closed, `rest` after it: the reply up to there is read by the format's parser and
        the calls it adds to those sent go out. False when that reading is not the sent calls and more (the
        final parse decides what the reply is)."""
        parsed = self._read(self._text[: len(self._text) - len(rest)])
        sent = len(self._calls)
        if parsed.ill_formed or len(parsed.tool_calls) <= sent or parsed.tool_calls[:sent] != self._calls:
            return False
        for call in parsed.tool_calls[sent:]:
            self._calls.append(call)
            out.append(LiveDelta("tool_call", call=dict(call)))
        return True


_State = Literal["start", "reasoning", "content", "call", "after_call", "done"]


class TagSplitter(SteppedSplitter):
    """The live splitter of a `TagGrammar`.

    Text is trimmed as the grammar says. A completed call block is read by the format's own parser
    (`read` of the text up to its close tag), so a streamed call is the final parse's, typed arguments
    included. Anything
    unexpected (text after a tool call, a call the parser refuses) stops the live split: the rest
    comes from the final parse.
    """

    def __init__(self, grammar: TagGrammar, head: str, read: Reader) -> None:
        super().__init__(read)
        self._grammar = grammar
        self._think_open, self._think_close = grammar.think or ("", "")
        self._call_open, self._call_close = grammar.call or ("", "")
        self._tags = (self._call_open, *grammar.end_markers) if grammar.call else grammar.end_markers
        self._state: _State = "start"
        self._started = False  # the current text field has emitted text
        self._held = ""  # reasoning: trailing trimmable characters held until more reasoning follows
        if grammar.think is not None and self._think_open in head:
            self._state = "content" if self._think_close in head.split(self._think_open)[-1] else "reasoning"

    def _step(self, out: list[LiveDelta]) -> bool:
        grammar, buf = self._grammar, self._buffer
        think_open, think_close, call_open = self._think_open, self._think_close, self._call_open
        if self._state == "start":
            lead = buf.lstrip()
            if grammar.think is None:
                self._enter("content", buf)
                return True
            if not lead or (len(lead) < len(think_open) and think_open.startswith(lead)):
                return False
            if lead.startswith(think_open):
                self._enter("reasoning", lead[len(think_open) :])
            else:
                self._enter("content", buf)
            return True
        if self._state == "reasoning":
            at = buf.find(think_close)
            if at >= 0:
                self._reasoning(buf[:at], out, closing=True)
                self._enter("content", buf[at + len(think_close) :])
                return True
            keep = partial_suffix(buf, (think_close,))
            self._reasoning(buf[: len(buf) - keep], out, closing=False)
            self._buffer = buf[len(buf) - keep :]
            return False
        if self._state == "content":
            call = buf.find(call_open) if call_open else -1
            end = min((i for i in (buf.find(m) for m in grammar.end_markers) if i >= 0), default=-1)
            if call >= 0 and (end < 0 or call < end):
                self._content(buf[:call].rstrip() if grammar.call_eats_space else buf[:call], out)
                self._enter("call", buf[call + len(call_open) :])
                return True
            if end >= 0:
                self._content(buf[:end].rstrip(grammar.content_trim_end), out)
                self._enter("done", "")
                return False
            keep = partial_suffix(buf, self._tags)
            keep = len(buf) - len(buf[: len(buf) - keep].rstrip())  # a tag may swallow or trim what precedes it
            self._content(buf[: len(buf) - keep], out)
            self._buffer = buf[len(buf) - keep :]
            return False
        if self._state == "call":
            at = buf.find(self._call_close)
            if at < 0:
                return False
            rest = buf[at + len(self._call_close) :]
            if not self._send_closed_calls(rest, out):
                self._enter("done", "")
                return False
            self._enter("after_call", rest)
            return True
        if self._state == "after_call":
            lead = buf.lstrip()
            if lead.startswith(call_open):
                self._enter("call", lead[len(call_open) :])
                return True
            if not lead or any(m.startswith(lead) or lead.startswith(m) for m in self._tags):
                return False
            self._enter("done", "")  # text after tool calls: joined by the final parse, sent at the end
        return False

    def _enter(self, state: _State, buffer: str) -> None:
        self._state, self._buffer = state, buffer
        self._started, self._held = False, ""

    def _reasoning(self, text: str, out: list[LiveDelta], closing: bool) -> None:
        trim = self._grammar.reasoning_trim
        if not self._started:
            text = text.lstrip(trim)
        if closing:
            text = text.rstrip(trim)
            held, self._held = self._held if text else "", ""
        else:
            body = text.rstrip(trim)
            held = self._held if body else ""
            self._held = (self._held if not body else "") + text[len(body) :]
            text = body
        if text:
            self._started = True
            out.append(LiveDelta("reasoning", held + text))

    def _content(self, text: str, out: list[LiveDelta]) -> None:
        if not self._started:
            text = text.lstrip(self._grammar.content_trim_start)
        if text:
            self._started = True
            out.append(LiveDelta("content", text))


def partial_suffix(text: str, tags: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


def live_splitter(
    parser: ResponseParser, prompt_text: str, tools: Sequence[Mapping[str, Any]] | None = None
) -> LiveSplitter:
    """The live splitter for one reply of this parser's format, given the rendered prompt's text (its tail matters).

    A parser from outside the registry that has no `live_splitter` streams at the end.
    """
    make = getattr(parser, "live_splitter", None)
    return BufferedSplitter() if make is None else make(prompt_text, tools)  # type: ignore[no-any-return]


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
