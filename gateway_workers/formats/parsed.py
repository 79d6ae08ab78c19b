"""What a reply is parsed into, and the protocol every format's parser offers.

`ParsedResponse` is one reply split into reasoning, text and canonical tool calls; `LiveDelta` a piece of it
sent while it streams. `ResponseParser` is the Format protocol: parse a reply's ids, and give the splitter
of a reply that streams (`LiveSplitter`). Also the canonical forms every format's parse ends in. Imports
only the stdlib.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

logger = logging.getLogger(__name__)


class ParserUnavailable(Exception):
    """No response parser fits this tokenizer/template or this transformers: the message says what to change."""


@dataclass(frozen=True, slots=True)
class ParsedResponse:
    """One assistant reply, split. `tool_calls` are canonical: [{"name": str, "arguments": dict}]."""

    content: str
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    ill_formed: bool = False
    error: str | None = None

    def canonical_message(self) -> dict[str, Any]:
        """The reply as a canonical assistant message (the shape `CommitTurn` stores)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            message["reasoning"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [dict(call) for call in self.tool_calls]
        return message


class ResponseParser(Protocol):
    """The Format protocol: splits one reply's output ids (`prefix`: the rendered prompt, text or ids, that the
    engine continued), and gives the splitter of a reply that streams.

    `supports_tools` False means tool calls cannot be parsed: the app refuses requests that declare tools.
    """

    format_name: str
    supports_tools: bool

    def parse(self, output_ids: Sequence[int], prefix: str | Sequence[int],
              tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedResponse: ...

    def live_splitter(self, prompt_text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> LiveSplitter:
        """The splitter of one reply while it streams, given the rendered prompt (its tail matters). A parser from
        outside may leave it out: its replies stream at the end (`live_split.live_splitter`)."""
        ...


class LiveSplitter(Protocol):
    """Splits one reply's text as it arrives; `feed` returns the deltas that became certain."""

    def feed(self, text: str) -> list[LiveDelta]: ...


# "keepalive": nothing new, while a stream waits (a pause holds it): the dialects send an SSE comment, so neither
# the agent's SDK nor a proxy takes the quiet for a dead connection.
DeltaKind = Literal["reasoning", "content", "tool_call", "keepalive"]


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


def joined_text(value: object) -> str | None:
    """A text field's value: repeated regions (a list) are concatenated, as the legacy schemas' substitutions do."""
    if value is None:
        return None
    if isinstance(value, list):
        parts = [str(v) for v in value if v is not None]
        return "".join(parts) if parts else None
    return str(value)


def strip_end(text: str, markers: Sequence[str]) -> str:
    """Drop the end-of-turn marker(s) the engine stopped on (Qwen3.5 emits '<|im_end|>\\n<|endoftext|>')."""
    while True:
        trimmed = text.rstrip()
        for marker in markers:
            if trimmed.endswith(marker):
                text = trimmed[: -len(marker)]
                break
        else:
            return text


def canonical_call(call: object, json_strings: bool = True) -> dict[str, Any] | str:
    """A parsed call as {"name", "arguments": dict}, or the reason it is not one.

    Accepts {"name", "arguments"|"parameters"} and the OpenAI-style {"type": "function", "function": {...}}.
    """
    if isinstance(call, dict) and isinstance(call.get("function"), dict):
        call = call["function"]
    if not isinstance(call, dict):
        return "tool call is not a JSON object"
    name = call.get("name")
    arguments = call["arguments"] if "arguments" in call else call.get("parameters", {})
    if not isinstance(name, str) or not name.strip():
        return "tool call without a function name"
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str) and json_strings:
        # Some models double-encode the arguments; accept it when the string is itself a JSON object.
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return f"tool call {name!r} has non-JSON arguments"
    if not isinstance(arguments, dict):
        return f"tool call {name!r} arguments are not a JSON object"
    return {"name": name.strip(), "arguments": arguments}


def ill_formed(text: str, reason: str) -> ParsedResponse:
    logger.debug("ill-formed reply (%s): %.200r", reason, text)
    return ParsedResponse(content=text, reasoning=None, tool_calls=[], ill_formed=True, error=reason)
