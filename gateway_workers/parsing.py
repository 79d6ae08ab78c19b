"""Response parsing: sampled token ids -> reasoning, text and tool calls, per chat-template family.

Sits between the engine (token ids out) and the wire adapters (messages out). Parsing
uses transformers' declarative `response_template` (`tokenizer.parse_response`,
transformers >= 5.13) with a spec we write per format, fed the prompt's tail as prefix so
templates that pre-open `<think>` parse right. Malformed output never raises: it comes
back as raw text with `ill_formed=True`. Tool-call ids are the adapters' job, not ours.
`detect_parser` maps a chat template (by sha256) to a format name, and a format name to
a parser factory; both are plain dicts so new families register in one line.
Must not import the app, adapters, engines or the backplane.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import transformers
from packaging.version import Version
from transformers import PreTrainedTokenizerBase

from gateway_workers.tokenizer import builtin_template_text

logger = logging.getLogger(__name__)

MIN_TRANSFORMERS = Version("5.13")
# trl's qwen3.jinja (a copy of Qwen3's own template), as shipped in the trl wheel.
TRL_QWEN3_SHA256 = "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8"


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
    """Splits one reply's output ids; `prefix` is the rendered prompt (text or ids) the engine continued."""

    format_name: str

    def parse(
        self,
        output_ids: Sequence[int],
        prefix: str | Sequence[int],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> ParsedResponse: ...


# --- Qwen3 family ----------------------------------------------------------------------------

_IM_START = "<|im_start|>"
_ANCHOR = "<|im_start|>assistant\n"
_END_MARKERS = ("<|im_end|>", "<|endoftext|>")
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
_CALL_OPEN, _CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_TAG = re.compile(r"</?tool_call>")

# Qwen3 replies: optional <think>..</think>, text, then <tool_call>{json}</tool_call> blocks.
# Text is kept unstripped here and trimmed the way the template re-renders it (below); the
# leading \s* on the call opener swallows the newline between text and calls and between calls.
QWEN3_RESPONSE_TEMPLATE: dict[str, Any] = {
    "version": 1,
    "defaults": {"reasoning": None},
    "start_anchor": _ANCHOR,
    "fields": {
        "reasoning": {"open": _THINK_OPEN, "close": _THINK_CLOSE, "content": "text", "content_args": {"strip": False}},
        "tool_calls": {"open_pattern": r"\s*<tool_call>", "close": _CALL_CLOSE, "repeats": True, "content": "json"},
        # Text after a tool call (rare) is appended, not allowed to overwrite the text before it.
        "content": {"content": "text", "content_args": {"strip": False}, "repeats": True, "join": "\n"},
    },
}


class Qwen3Parser:
    """Qwen3-family replies: `<think>` reasoning and JSON `<tool_call>` blocks, ending in <|im_end|>."""

    format_name = "qwen3"

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        require_response_templates()
        self._tokenizer = tokenizer
        self._im_start_id = tokenizer.convert_tokens_to_ids(_IM_START)
        self._backend = getattr(tokenizer, "backend_tokenizer", None)

    def parse(
        self,
        output_ids: Sequence[int],
        prefix: str | Sequence[int],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> ParsedResponse:
        text = _strip_end(self._decode(output_ids))
        head = self._prefix_tail(prefix)
        problem = _qwen3_structure_problem(head + text)
        if problem is not None:
            return _ill_formed(text, problem)
        try:
            parsed = self._tokenizer.parse_response(
                text,
                schema=QWEN3_RESPONSE_TEMPLATE,
                prefix=head,
                tools=[dict(tool) for tool in tools] if tools else None,
            )
        except Exception as e:  # any parser failure is a verdict on the output, never a 500
            return _ill_formed(text, f"unparseable reply: {e}")
        calls = parsed.get("tool_calls") or []
        canonical = []
        for call in calls:
            checked = _canonical_call(call)
            if isinstance(checked, str):
                return _ill_formed(text, checked)
            canonical.append(checked)
        reasoning = parsed.get("reasoning")
        content = parsed.get("content") or ""
        return ParsedResponse(
            # Trim exactly what the Qwen3 templates trim on re-render, so the echo renders the same tokens.
            content=content.lstrip("\n"),
            reasoning=reasoning.strip("\n") if isinstance(reasoning, str) else None,
            tool_calls=canonical,
        )

    def _decode(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=False)
        text = self._tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return text if isinstance(text, str) else "".join(text)

    def _prefix_tail(self, prefix: str | Sequence[int]) -> str:
        """The prompt from its last assistant anchor on: all the parser needs, without decoding 24k tokens."""
        if isinstance(prefix, str):
            at = prefix.rfind(_ANCHOR)
            return prefix[at:] if at >= 0 else ""
        ids = list(prefix)
        for at in range(len(ids) - 1, -1, -1):
            if ids[at] == self._im_start_id:
                tail = self._decode(ids[at:])
                return tail if tail.startswith(_ANCHOR) else ""
        return ""


def _strip_end(text: str) -> str:
    """Drop the end-of-turn marker(s) the engine stopped on (Qwen3.5 emits '<|im_end|>\\n<|endoftext|>')."""
    while True:
        trimmed = text.rstrip()
        for marker in _END_MARKERS:
            if trimmed.endswith(marker):
                text = trimmed[: -len(marker)]
                break
        else:
            return text


def _qwen3_structure_problem(body: str) -> str | None:
    """Why this assistant message (anchor on) is not a well-formed Qwen3 reply, or None."""
    body = body[len(_ANCHOR) :] if body.startswith(_ANCHOR) else body
    opens, closes = body.count(_THINK_OPEN), body.count(_THINK_CLOSE)
    after = body
    if opens or closes:
        if opens != 1 or closes > 1:
            return "malformed <think> block"
        if body.lstrip().find(_THINK_OPEN) != 0:
            return "<think> after the start of the reply"
        if not closes:
            return "unterminated <think> block (reply truncated?)"
        reasoning, after = body.split(_THINK_CLOSE, 1)
        if _CALL_OPEN in reasoning or _CALL_CLOSE in reasoning:
            return "tool call inside <think>"
    inside = False
    for tag in _CALL_TAG.finditer(after):
        opening = tag.group() == _CALL_OPEN
        if opening == inside:
            return "nested <tool_call>" if opening else "</tool_call> without <tool_call>"
        inside = opening
    if inside:
        return "unterminated <tool_call> (reply truncated?)"
    return None


def _canonical_call(call: object) -> dict[str, Any] | str:
    """A parsed call as {"name", "arguments": dict}, or the reason it is not one."""
    if not isinstance(call, dict):
        return "tool call is not a JSON object"
    name, arguments = call.get("name"), call.get("arguments", {})
    if not isinstance(name, str) or not name:
        return "tool call without a function name"
    if isinstance(arguments, str):
        # Some models double-encode the arguments; accept it when the string is itself a JSON object.
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return f"tool call {name!r} has non-JSON arguments"
    if not isinstance(arguments, dict):
        return f"tool call {name!r} arguments are not a JSON object"
    return {"name": name, "arguments": arguments}


def _ill_formed(text: str, reason: str) -> ParsedResponse:
    logger.debug("ill-formed reply (%s): %.200r", reason, text)
    return ParsedResponse(content=text, reasoning=None, tool_calls=[], ill_formed=True, error=reason)


# --- registry ----------------------------------------------------------------------------------

ParserFactory = Callable[[PreTrainedTokenizerBase], ResponseParser]

PARSER_FACTORIES: dict[str, ParserFactory] = {"qwen3": Qwen3Parser}
# sha256 of a chat template's text -> response format name; the built-in one is added lazily.
TEMPLATE_FORMATS: dict[str, str] = {TRL_QWEN3_SHA256: "qwen3"}


def template_sha256(template: str) -> str:
    return hashlib.sha256(template.encode("utf-8")).hexdigest()


def require_response_templates() -> None:
    """Raise if this transformers lacks declarative response templates (5.13+)."""
    if Version(transformers.__version__) < MIN_TRANSFORMERS:
        raise ParserUnavailable(
            f"response parsing needs transformers >= {MIN_TRANSFORMERS} (declarative response_template); "
            f"found {transformers.__version__}: pip install -U 'transformers>={MIN_TRANSFORMERS},<6'"
        )


def detect_parser(tokenizer: PreTrainedTokenizerBase, format_name: str | None = None) -> ResponseParser:
    """The parser for this tokenizer's chat template (recognised by sha256), or for `format_name` if given."""
    if format_name is None:
        template = tokenizer.chat_template
        if not isinstance(template, str) or not template:
            raise ParserUnavailable("the tokenizer has no chat template, so its reply format is unknown")
        formats = {template_sha256(builtin_template_text()): "qwen3", **TEMPLATE_FORMATS}
        digest = template_sha256(template)
        format_name = formats.get(digest)
        if format_name is None:
            raise ParserUnavailable(
                f"unknown chat template (sha256 {digest}); no response parser is registered for it. "
                f"Known formats: {sorted(PARSER_FACTORIES)}; name one explicitly to parse with it."
            )
    factory = PARSER_FACTORIES.get(format_name)
    if factory is None:
        raise ParserUnavailable(f"unknown response format {format_name!r}; known: {sorted(PARSER_FACTORIES)}")
    return factory(tokenizer)
