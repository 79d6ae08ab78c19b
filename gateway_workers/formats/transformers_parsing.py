"""transformers' `parse_response`, behind one adapter: a format's reply text in, the engine's reading out.

transformers >= 5.13 parses with the format's declarative `response_template` (with `prefix=`, and on >= 5.15
`tools=` to type string arguments); 5.0-5.12 only with a legacy `response_schema` (regex + jmespath), the
format's in `formats.legacy`, which the registry hands its parsers. `FormatParser` checks a reply before and
canonicalizes after. Imports transformers only when a parser is built (`serve` checks a template without it).
"""

from __future__ import annotations

import importlib.metadata
import inspect
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from packaging.version import Version

from gateway_workers.formats.parsed import ParserUnavailable

Engine = Literal["template", "schema"]
DECLARATIVE_SINCE = Version("5.13")  # response_template + parse_response(prefix=)
TYPED_TOOLS_SINCE = Version("5.15")  # parse_response(tools=) casts string arguments by the tool schema


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


class TransformersParsing:
    """Reads one format's replies with this tokenizer, on whichever engine transformers offers (or `engine`).

    `typed_tools`: transformers types string arguments itself by the tools' schemas.
    """

    def __init__(self, tokenizer: Any, name: str, anchor: str, template: Mapping[str, Any],
                 engine: Engine | None = None, legacy_schema: Mapping[str, Any] | None = None) -> None:
        self.engine: Engine = engine or parsing_engine()
        self.typed_tools = self.engine == "template" and _typed_tools_supported()
        self._tokenizer, self._anchor = tokenizer, anchor
        self._template: Any = None
        self._schema: dict[str, Any] = {}
        if self.engine == "template":
            self._template = self._compiled(template)
        elif legacy_schema is None:
            raise ParserUnavailable(f"format {name!r} has no legacy response schema: it needs transformers "
                                    f">= {DECLARATIVE_SINCE} (found {transformers_version()})")
        else:
            self._schema = dict(legacy_schema)

    def read(self, text: str, head: str, tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
        """The engine's reading of reply `text`, after `head`: what the prompt already wrote of the reply."""
        if self.engine == "template":
            kwargs: dict[str, Any] = {"prefix": self._anchor + head}
            if self.typed_tools and tools:
                kwargs["tools"] = [dict(tool) for tool in tools]
            parsed = self._tokenizer.parse_response(text, schema=self._template, **kwargs)
        else:
            # The legacy engine sees no prompt: hand it the prefill (e.g. an opened <think>) inline.
            parsed = self._tokenizer.parse_response(head + text, schema=dict(self._schema))
        if not isinstance(parsed, dict):
            raise ValueError(f"the parser returned {type(parsed).__name__}, not a message")
        return parsed

    def _compiled(self, template: Mapping[str, Any]) -> Any:
        """The response template compiled once: given a dict, transformers rebuilds its regexes on every parse.

        A transformers whose parse_response does not take the compiled form gets the dict.
        """
        as_dict = dict(template)
        try:
            from transformers.utils.chat_parsing.response_templates import load_response_template

            compiled: Any = load_response_template(as_dict)
            self._tokenizer.parse_response("", schema=compiled, prefix=self._anchor)
        except Exception:  # any other layout or signature: the public dict form always works
            return as_dict
        return compiled
