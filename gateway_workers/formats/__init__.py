"""Response formats: sampled token ids -> reasoning, text and tool calls, per model family.

`detect_parser(tokenizer, format_name=None, allow_plain_text=False)` is the entry point the app
uses; `resolve_format` is the same decision for the CLI (no tokenizer). One module per family
group (chatml, glm, harmony, llama, deepseek, gemma, lfm, muse, plain), shared machinery in `base`/`checks`, the hash
table in `registry`. Must not import the app, adapters, engines or the backplane.
"""

from __future__ import annotations

from gateway_workers.formats.base import FormatParser, ResponseFormat
from gateway_workers.formats.parsed import ParsedResponse, ParserUnavailable, ResponseParser
from gateway_workers.formats.registry import (
    FORMATS,
    PARSER_FACTORIES,
    PLAIN_TEXT,
    TEMPLATE_FORMATS,
    PlainTextParser,
    detect_parser,
    known_templates,
    resolve_format,
    template_from_dir,
    template_sha256,
)
from gateway_workers.formats.transformers_parsing import parsing_engine

__all__ = [
    "FORMATS",
    "PARSER_FACTORIES",
    "PLAIN_TEXT",
    "TEMPLATE_FORMATS",
    "FormatParser",
    "ParsedResponse",
    "ParserUnavailable",
    "PlainTextParser",
    "ResponseFormat",
    "ResponseParser",
    "detect_parser",
    "known_templates",
    "parsing_engine",
    "resolve_format",
    "template_from_dir",
    "template_sha256",
]
