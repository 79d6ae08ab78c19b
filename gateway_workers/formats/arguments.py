"""Typing a tool call's string arguments by the tool's JSON schema, as transformers >= 5.15 does with `tools=`.

The XML-call formats (Qwen3.5, Nemotron-3, GLM) write every argument value as text; older
transformers return them as strings. `cast_arguments` casts each value to the type its tool's
schema declares (integer, number, boolean, null, object, array), leaving strings, unknown tools
and parameters, and values that do not cast as written. `read_scalar` reads a bare value of the formats that
write arguments in a syntax of their own (Gemma 4, LFM2). Pure functions; imports only the stdlib.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any


def cast_arguments(name: str, arguments: dict[str, Any], tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    """Cast the string values of one call's arguments to the types its tool's JSON schema declares.

    Unknown tools and parameters, `string` parameters and values that do not cast stay as written.
    """
    properties = _tool_properties(name, tools)
    if not properties:
        return arguments
    out = {}
    for key, value in arguments.items():
        types = _schema_types(properties.get(key))
        out[key] = _cast(value, types) if isinstance(value, str) and types else value
    return out


def _tool_properties(name: str, tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if isinstance(fn, Mapping) and fn.get("name") == name:
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, Mapping) else None
            return dict(props) if isinstance(props, Mapping) else {}
    return {}


def _schema_types(schema: object) -> list[str]:
    if not isinstance(schema, Mapping):
        return []
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else [t for t in declared or () if isinstance(t, str)]
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or ():
            types.extend(_schema_types(option))
    if schema.get("nullable"):
        types.append("null")
    return types


def _cast(raw: str, types: list[str]) -> Any:
    text = raw.strip()
    for kind in types:
        if kind == "string":
            return raw  # a string parameter is never reinterpreted, even if it looks like a number
        try:
            if kind == "integer":
                number = float(text)
                if number.is_integer() and math.isfinite(number):
                    return int(text) if text.lstrip("-").isdigit() else int(number)
            elif kind == "number":
                number = float(text)
                if math.isfinite(number):
                    return int(text) if text.lstrip("-").isdigit() else number
            elif kind == "boolean" and text.lower() in ("true", "false", "1", "0"):
                return text.lower() in ("true", "1")
            elif kind == "null" and text in ("null", "None"):
                return None
            elif kind in ("object", "array"):
                decoded = json.loads(text)
                if isinstance(decoded, dict if kind == "object" else list):
                    return decoded
        except ValueError:
            continue
    return raw


_INTEGER = re.compile(r"-?\d+")


def read_scalar(text: str, at: int, scalar: re.Pattern[str], literals: Mapping[str, Any], number: re.Pattern[str],
                family: str) -> tuple[Any, int]:
    """The bare value at `at` (a literal, an integer or a number, as `scalar` delimits it) and where it ends."""
    found = scalar.match(text, at)
    if found is None:
        raise ValueError(f"no value at {at}")
    token = found.group()
    if token in literals:
        return literals[token], found.end()
    if _INTEGER.fullmatch(token):
        return int(token), found.end()
    if number.fullmatch(token):
        return float(token), found.end()
    raise ValueError(f"not a {family}value: {token[:40]!r}")
