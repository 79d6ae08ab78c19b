"""What every response format shares: the parsed record, the parser seam, and the two parsing engines.

A `ResponseFormat` describes one family's reply grammar twice, once per transformers parsing
engine: a declarative `response_template` (transformers >= 5.13, parsed with `prefix=` and, on
>= 5.15, `tools=` to type string arguments) and a legacy `response_schema` (regex + jmespath,
transformers 5.0-5.14). `FormatParser` runs whichever engine this transformers has, after our own
structural check (balanced tags, call count) and before our canonicalization, so a reply is either
parsed completely or handed back raw with `ill_formed=True`: never a partial call list, never a raise.
Must not import the app, adapters, engines, render or the backplane.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from packaging.version import Version

from gateway_workers.formats.arguments import cast_arguments
from gateway_workers.rendering.twins.bpe import token_decoder
from gateway_workers.rendering.twins.checks import Twin

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gateway_workers.formats.live_split import SplitterFactory

logger = logging.getLogger(__name__)

Engine = Literal["template", "schema"]
DECLARATIVE_SINCE = Version("5.13")  # response_template + parse_response(prefix=)
TYPED_TOOLS_SINCE = Version("5.15")  # parse_response(tools=) casts string arguments by the tool schema
LEGACY_UNTIL = Version("5.15")  # response_schema (recursive_parse) was removed here


# Engine patterns must stay linear in a long run of text (a model can emit 100k spaces):
# - One that opens with `\s*` may start only where a run of whitespace starts (or where the search does):
#   the leftmost match starts there anyway, and otherwise every character of the run is retried. The
#   legacy engine's `re` has no `\G`.
# - The declarative engine searches with the `regex` module's partial matching, on every chunk. There a
#   literal that follows a repeat (`\s*<tool_call>`, `[^<]*<|message|>`) is looked for from each start
#   position to the end of the text; inside an alternation (`\s+X|X`, or `X|(?!)`, whose second branch
#   never matches) it is not. `test_formats` times every format on such runs.
AT_SPACE_RUN = r"(?:\G|(?<!\s))"
AT_SPACE_RUN_LEGACY = r"(?<!\s)"
SPACES_THEN_TOOL_CALL = AT_SPACE_RUN + r"(?:\s+<tool_call>|<tool_call>)"  # `\s*<tool_call>`


_TOO_DEEP = "tool call arguments nested too deeply to read"


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
    """Splits one reply's output ids; `prefix` is the rendered prompt (text or ids) the engine continued.

    `supports_tools` False means tool calls cannot be parsed: the app refuses requests that declare tools.
    """

    format_name: str
    supports_tools: bool

    def parse(
        self,
        output_ids: Sequence[int],
        prefix: str | Sequence[int],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> ParsedResponse: ...


# A structural verdict on a reply body: the reason it is malformed, or the number of tool calls it holds.
StructureCheck = Callable[[str], "str | int"]
# Turns the engine's content/reasoning into what the template re-renders: (content, reasoning).
Finisher = Callable[[str, "str | None"], "tuple[str, str | None]"]
# A plain-Python reading of a reply body that passed the check, in the template engine's output shape
# ({"content", "reasoning", "tool_calls"}), or None to leave the reply to the engine.
NativeReader = Callable[[str], "dict[str, Any] | None"]


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """One family's reply grammar.

    Args:
        name: the registry name (`--response-format NAME`).
        anchor: the assistant header the generation prompt ends with; the reply (and any prefill) follows it.
        resume_markers: the reply also starts right after the last of these when it comes after the anchor
            (Gemma 4 continues its model turn after the tool results the template writes into it).
        end_markers: stop tokens the engine may include at the end of the output; stripped before parsing.
        template: the declarative response_template (transformers >= 5.13).
        schema: the legacy response_schema (transformers 5.0-5.14).
        check: our own structural check of the reply body (prefill included).
        finish: trims content/reasoning the way the family's template re-renders them.
        string_arguments: argument values are untyped text (XML formats): cast by the tool's JSON schema.
        calls_reader: for calls in the family's own syntax (not JSON): the engines cut each tool-call block out
            as text, and this reads the calls it holds ({"name", "arguments"}), or raises ValueError.
        supports_tools / reasoning / parallel_calls: what the family can express (README coverage table).
        native_reader: reads a checked body exactly as the declarative engine does, in a fraction of its
            time; used in place of that engine while sampled comparisons with it agree (`twins.checks.Twin`).
        live: builds the reply's live splitter (`formats.live_split`); None: the reply streams at the end.
    """

    name: str
    anchor: str
    end_markers: tuple[str, ...]
    template: Mapping[str, Any]
    schema: Mapping[str, Any]
    check: StructureCheck
    finish: Finisher
    string_arguments: bool = False
    calls_reader: Callable[[str], list[dict[str, Any]]] | None = None
    resume_markers: tuple[str, ...] = ()
    supports_tools: bool = True
    reasoning: bool = True
    parallel_calls: bool = True
    native_reader: NativeReader | None = None
    live: SplitterFactory | None = None


def text_blocks_grammar(
    start: Mapping[str, str], think: tuple[str, str], call: tuple[str, str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(declarative template, legacy schema) of a reasoning block, text, and tool-call blocks cut out as text.

    For formats whose calls are in a syntax of their own: the engines only find the blocks, and the
    format's `calls_reader` reads each. `start`: the template's `start_anchor` or `start_anchor_pattern`.
    """
    text = {"content": "text", "content_args": {"strip": False}}
    (think_open, think_close), (call_open, call_close) = (tuple(map(re.escape, pair)) for pair in (think, call))
    template = {
        "version": 1,
        "defaults": {"reasoning": None},  # an empty reasoning block is reasoning "", none is None
        **start,
        "fields": {
            "reasoning": {"open": think[0], "close": think[1], **text},
            "tool_calls": {"open": call[0], "close": call[1], "repeats": True, **text},
            "content": {**text, "repeats": True},
        },
    }
    schema = {
        "type": "object",
        "properties": {
            "reasoning": {"type": "string", "x-regex": f"{think_open}(.*?){think_close}"},
            "tool_calls": {
                "type": "array",
                "x-regex-iterator": f"{call_open}(.*?){call_close}",
                "items": {"type": "string"},
            },
            "content": {
                "type": "string",
                "x-regex-substitutions": [[f"{think_open}.*?{think_close}", ""], [f"{call_open}.*?{call_close}", ""]],
            },
        },
    }
    return template, schema


def transformers_version() -> Version:
    # the installed distribution's version: transformers itself (seconds to import) is imported only by what
    # parses or loads a tokenizer, not by `serve`'s check of the template before it spawns anything
    return Version(importlib.metadata.version("transformers"))


def parsing_engine() -> Engine:
    """The engine this transformers offers: declarative templates when present, else legacy schemas."""
    version = transformers_version()
    if version >= DECLARATIVE_SINCE:
        return "template"
    if version >= Version("5.0"):
        return "schema"
    raise ParserUnavailable(
        f"response parsing needs transformers >= 5.0; found {version}: pip install -U 'transformers>=5.0,<6'"
    )


def _typed_tools_supported() -> bool:
    if transformers_version() < TYPED_TOOLS_SINCE:
        return False
    from transformers import PreTrainedTokenizerBase

    return "tools" in inspect.signature(PreTrainedTokenizerBase.parse_response).parameters


class FormatParser:
    """Parses replies of one `ResponseFormat` with this tokenizer, on whichever engine transformers offers."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, fmt: ResponseFormat, engine: Engine | None = None) -> None:
        self.format = fmt
        self.format_name = fmt.name
        self.supports_tools = fmt.supports_tools
        self.engine: Engine = engine or parsing_engine()
        self._typed_by_transformers = self.engine == "template" and _typed_tools_supported()
        self._tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode_ids = token_decoder(tokenizer)
        self._starts: dict[int, str] = {}  # first id of the anchor and of each resume marker -> its text
        for marker in (fmt.anchor, *fmt.resume_markers):
            ids = self._encode(marker)
            if not ids:
                raise ParserUnavailable(f"format {fmt.name!r}: the tokenizer encodes {marker!r} to nothing")
            self._starts.setdefault(ids[0], marker)
        self._template: Any = self._compiled_template() if self.engine == "template" else None
        # Only the declarative engine has a twin: the legacy one reads some edges (e.g. \x1c-\x1f as
        # whitespace) its own way. The engine refusing a reply the reader took is a difference too.
        self.reader_twin: Twin[NativeReader, dict[str, Any]] | None = None
        if self.engine == "template" and fmt.native_reader is not None:
            self.reader_twin = Twin(
                "response_reader",
                fmt.name,
                fmt.native_reader,
                self._run_engine,
                describe=_reader_difference,
                log=logger,
                same=_same_reading,
                refusal_differs=True,
            )

    def parse(
        self,
        output_ids: Sequence[int],
        prefix: str | Sequence[int],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> ParsedResponse:
        return self.read_text(self._decode_ids(output_ids), prefix, tools)

    def read_text(
        self, text: str, prefix: str | Sequence[int], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> ParsedResponse:
        """`parse` of a reply's decoded text (the live splitter reads the reply so far with it)."""
        text = strip_end(text, self.format.end_markers)
        head = self.prefix_head(prefix)
        body = head + text
        try:
            verdict = self.format.check(body)
        except RecursionError:  # the readers recurse into nested values: nesting this deep is no real call
            return ill_formed(text, _TOO_DEEP)
        if isinstance(verdict, str):
            return ill_formed(text, verdict)
        try:
            parsed = self._read(body, text, head, tools)
        except RecursionError:
            return ill_formed(text, _TOO_DEEP)
        except (ValueError, TypeError, KeyError, IndexError) as e:  # the engines' verdicts on malformed output
            return ill_formed(text, f"unparseable reply: {type(e).__name__}: {str(e)[:300]}")
        except Exception as e:  # not a verdict but a failure: still never a 500 for the agent, but logged
            logger.exception("format %s: the %s parsing engine failed on a reply", self.format_name, self.engine)
            return ill_formed(text, f"parser failure: {type(e).__name__}")
        raw_calls = parsed.get("tool_calls") or []
        if not isinstance(raw_calls, list):
            raw_calls = [raw_calls]
        if self.format.calls_reader is not None:
            try:
                raw_calls = [call for block in raw_calls for call in self.format.calls_reader(str(block))]
            except ValueError as e:
                return ill_formed(text, f"unreadable tool call: {str(e)[:300]}")
        if len(raw_calls) != verdict:
            return ill_formed(text, f"{verdict} tool call(s) in the reply but {len(raw_calls)} parsed")
        calls = []
        for raw in raw_calls:
            call = canonical_call(raw, json_strings=not self.format.string_arguments)
            if isinstance(call, str):
                return ill_formed(text, call)
            if self.format.string_arguments and not self._typed_by_transformers:
                call["arguments"] = cast_arguments(call["name"], call["arguments"], tools)
            calls.append(call)
        content, reasoning = self.format.finish(_joined(parsed.get("content")) or "", _joined(parsed.get("reasoning")))
        return ParsedResponse(content=content, reasoning=reasoning, tool_calls=calls)

    def _read(self, body: str, text: str, head: str, tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
        """The reply read by the format's native reader when it takes it (checked on a sample), else the engine."""
        twin = self.reader_twin
        if twin is not None and twin.active:
            found = twin.fast(body)
            if found is not None:
                if twin.use():
                    return twin.check(found, text, head, tools)
                return found
        return self._run_engine(text, head, tools)

    def _run_engine(self, text: str, head: str, tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
        if self.engine == "template":
            kwargs: dict[str, Any] = {"prefix": self.format.anchor + head}
            if self._typed_by_transformers and tools:
                kwargs["tools"] = [dict(tool) for tool in tools]
            parsed = self._tokenizer.parse_response(text, schema=self._template, **kwargs)
        else:
            # The legacy engine sees no prompt: hand it the prefill (e.g. an opened <think>) inline.
            parsed = self._tokenizer.parse_response(head + text, schema=dict(self.format.schema))
        if not isinstance(parsed, dict):
            raise ValueError(f"the parser returned {type(parsed).__name__}, not a message")
        return parsed

    def _compiled_template(self) -> Any:
        """The response template compiled once: given a dict, transformers rebuilds its regexes on every parse.

        A transformers whose parse_response does not take the compiled form gets the dict.
        """
        template = dict(self.format.template)
        try:
            from transformers.utils.chat_parsing.response_templates import load_response_template

            compiled: Any = load_response_template(template)
            self._tokenizer.parse_response("", schema=compiled, prefix=self.format.anchor)
        except Exception:  # any other layout or signature: the public dict form always works
            return template
        return compiled

    def _encode(self, text: str) -> list[int]:
        if self._backend is not None:
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def prefix_head(self, prefix: str | Sequence[int]) -> str:
        """What the prompt already wrote of the reply after its last assistant anchor (e.g. '<think>\\n').

        Only the prompt's tail is decoded, not 24k tokens. A prompt that does not end inside an
        assistant header (its last anchor belongs to an earlier, finished message) prefills nothing.
        """
        markers = (self.format.anchor, *self.format.resume_markers)
        if isinstance(prefix, str):
            at = max(prefix.rfind(marker) for marker in markers)
            tail = prefix[at:] if at >= 0 else ""
        else:
            ids = list(prefix)
            tail = ""
            for at in range(len(ids) - 1, -1, -1):
                if ids[at] in self._starts:
                    tail = self._decode_ids(ids[at:])
                    break
        start = next((marker for marker in markers if tail.startswith(marker)), None)
        if start is None:
            return ""
        head = tail[len(start) :]
        if any(marker in head for marker in self.format.end_markers):
            return ""
        return head


def _reader_difference(
    twin: Twin[NativeReader, dict[str, Any]], found: dict[str, Any], expected: Any, args: tuple[Any, ...]
) -> str:
    text, head, _ = args
    if isinstance(expected, BaseException):
        why = f"the engine refused it ({type(expected).__name__})"
    else:
        why = f"the engine read {_reading(expected)[:200]}, the twin {_reading(found)[:200]}"
    # only the declarative engine has a reader twin
    return (
        f"format {twin.name}: the native reader differs from the template engine on {head + text!r:.200}: "
        f"{why}; using the engine from now on"
    )


def _same_reading(found: dict[str, Any], expected: dict[str, Any]) -> bool:
    return _reading(found) == _reading(expected)


def _reading(parsed: dict[str, Any]) -> str:
    """What `parse` takes from an engine's output, as comparable text (repr: NaN equals NaN)."""
    calls = parsed.get("tool_calls") or []
    return repr((_joined(parsed.get("content")) or "", _joined(parsed.get("reasoning")), calls))


def _joined(value: object) -> str | None:
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
