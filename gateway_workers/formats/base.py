"""What every response format is: its grammar (`ResponseFormat`), and the parser that reads its replies.

A `ResponseFormat` describes one family's replies: the declarative `response_template` transformers parses
with, our own structural check (balanced tags, call count), how the template re-renders text, and its live
splitter. `FormatParser` (the `parsed.ResponseParser` of every registered format) checks a reply, has
transformers read it (`transformers_parsing`: the declarative engine, or on 5.0-5.12 `legacy`'s schemas) or
the format's own native reader while it agrees, and canonicalizes the result, so a reply is either parsed
completely or handed back raw with `ill_formed=True`: never a partial call list, never a raise. Must not
import the app, adapters, engines, render or the backplane.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway_workers.formats.arguments import cast_arguments
from gateway_workers.formats.live_split import BufferedSplitter, SplitterFactory
from gateway_workers.formats.parsed import (
    LiveSplitter,
    ParsedResponse,
    ParserUnavailable,
    canonical_call,
    ill_formed,
    joined_text,
    strip_end,
)
from gateway_workers.formats.transformers_parsing import Engine, TransformersParsing
from gateway_workers.rendering.twins.bpe import token_decoder
from gateway_workers.rendering.twins.checks import Twin

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Engine patterns must stay linear in a long run of text (a model can emit 100k spaces):
# - One that opens with `\s*` may start only where a run of whitespace starts (or where the search does):
#   the leftmost match starts there anyway, and otherwise every character of the run is retried (the
#   legacy engine's `re` has no `\G`: `legacy.AT_SPACE_RUN`).
# - The declarative engine searches with the `regex` module's partial matching, on every chunk. There a
#   literal that follows a repeat (`\s*<tool_call>`, `[^<]*<|message|>`) is looked for from each start
#   position to the end of the text; inside an alternation (`\s+X|X`, or `X|(?!)`, whose second branch
#   never matches) it is not. `test_formats` times every format on such runs.
AT_SPACE_RUN = r"(?:\G|(?<!\s))"
SPACES_THEN_TOOL_CALL = AT_SPACE_RUN + r"(?:\s+<tool_call>|<tool_call>)"  # `\s*<tool_call>`


_TOO_DEEP = "tool call arguments nested too deeply to read"


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
        template: the declarative response_template (transformers >= 5.13; `legacy` has the schema of 5.0-5.12).
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


def text_blocks_template(start: Mapping[str, str], think: tuple[str, str], call: tuple[str, str]) -> dict[str, Any]:
    """The response template of a reasoning block, text, and tool-call blocks cut out as text.

    For formats whose calls are in a syntax of their own: the engines only find the blocks, and the
    format's `calls_reader` reads each. `start`: the template's `start_anchor` or `start_anchor_pattern`.
    """
    text = {"content": "text", "content_args": {"strip": False}}
    return {
        "version": 1,
        "defaults": {"reasoning": None},  # an empty reasoning block is reasoning "", none is None
        **start,
        "fields": {
            "reasoning": {"open": think[0], "close": think[1], **text},
            "tool_calls": {"open": call[0], "close": call[1], "repeats": True, **text},
            "content": {**text, "repeats": True},
        },
    }


class FormatParser:
    """Parses replies of one `ResponseFormat` with this tokenizer, on whichever engine transformers offers."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, fmt: ResponseFormat, engine: Engine | None = None,
                 legacy_schema: Mapping[str, Any] | None = None) -> None:
        """`legacy_schema`: the format's response_schema (`legacy.SCHEMAS`), for transformers 5.0-5.12."""
        self.format = fmt
        self.format_name = fmt.name
        self.supports_tools = fmt.supports_tools
        self._transformers = TransformersParsing(tokenizer, fmt.name, fmt.anchor, fmt.template, engine, legacy_schema)
        self.engine: Engine = self._transformers.engine
        self._tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode_ids = token_decoder(tokenizer)
        self._starts: dict[int, str] = {}  # first id of the anchor and of each resume marker -> its text
        for marker in (fmt.anchor, *fmt.resume_markers):
            ids = self._encode(marker)
            if not ids:
                raise ParserUnavailable(f"format {fmt.name!r}: the tokenizer encodes {marker!r} to nothing")
            self._starts.setdefault(ids[0], marker)
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

    def parse(self, output_ids: Sequence[int], prefix: str | Sequence[int],
              tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedResponse:
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
            if self.format.string_arguments and not self._transformers.typed_tools:
                call["arguments"] = cast_arguments(call["name"], call["arguments"], tools)
            calls.append(call)
        content = joined_text(parsed.get("content")) or ""
        content, reasoning = self.format.finish(content, joined_text(parsed.get("reasoning")))
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
        return self._transformers.read(text, head, tools)

    def live_splitter(self, prompt_text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> LiveSplitter:
        """The format's live splitter for one reply (`ResponseFormat.live`); without one, the reply streams at the
        end."""
        if self.format.live is None:
            return BufferedSplitter()
        read_text = self.read_text
        return self.format.live(self.prefix_head(prompt_text), lambda text: read_text(text, prompt_text, tools))

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
    return repr((joined_text(parsed.get("content")) or "", joined_text(parsed.get("reasoning")), calls))


