"""Response parsing, the seam the turn pipeline and adapters import: re-exports `gateway_workers.formats`.

The formats package holds one module per model family group and the template-hash registry;
this module keeps the stable import path (`from gateway_workers.parsing import ParsedResponse,
ResponseParser, detect_parser`) for the rest of the worker. Malformed output never raises: it
comes back as raw text with `ill_formed=True`. Tool-call ids are the adapters' job, not ours.
Must not import the app, adapters, engines or the backplane.
"""

from __future__ import annotations

from gateway_workers.formats import (
    FORMATS,
    PARSER_FACTORIES,
    PLAIN_TEXT,
    TEMPLATE_FORMATS,
    FormatParser,
    ParsedResponse,
    ParserUnavailable,
    PlainTextParser,
    ResponseFormat,
    ResponseParser,
    detect_parser,
    known_templates,
    parsing_engine,
    resolve_format,
    template_from_dir,
    template_sha256,
)

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
