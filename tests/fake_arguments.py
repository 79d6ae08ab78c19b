"""Tool-call arguments valid for a tool's JSON schema, for the fake engine's replies (tests/fake_engine.py).

The required properties only: strings "<query> #n" (enum, const, format and length honoured), numbers
n+len(query) within their bounds, booleans false, arrays of one item, objects recursed into; $ref, anyOf,
oneOf and allOf resolved. Bounded (depth, steps, sizes), so a hostile schema cannot hang the fake engine.
Stdlib only, like the fake engine's other sibling modules.
"""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import unquote

SCHEMA_DEPTH = 8  # how deep `arguments` follows a tool schema (nesting, $ref): a hostile schema cannot hang it


def arguments(tool: dict[str, Any], query: str, n: int) -> dict[str, Any]:
    """Arguments valid for the tool's parameters schema: its `required` properties, each a value of its schema.

    A schema that declares no properties (and allows others) gets {"query": "<query> #n"}, as a model would send.
    """
    maker = _Values(tool["parameters"], query)
    schema = maker.resolved(maker.root)
    out = maker.object(schema, n, 1)
    if not out and not schema.get("properties") and schema.get("additionalProperties", True) is True:
        return {"query": f"{query} #{n}"}
    return out


_STRING_FORMATS = {
    "uri": "https://example.com/",
    "url": "https://example.com/",
    "iri": "https://example.com/",
    "uri-reference": "https://example.com/",
    "iri-reference": "https://example.com/",
    "email": "user@example.com",
    "idn-email": "user@example.com",
    "hostname": "example.com",
    "idn-hostname": "example.com",
    "ipv4": "127.0.0.1",
    "ipv6": "::1",
    "date-time": "2024-01-01T00:00:00Z",
    "date": "2024-01-01",
    "time": "00:00:00Z",
    "uuid": "00000000-0000-4000-8000-000000000000",
}
_SCHEMA_STEPS = 4096  # subschemas visited per call at most; past it every value is the plain string
_MOST_ITEMS = 64  # and no array longer than this (nor a string padded past _MOST_CHARS), whatever minItems says
_MOST_CHARS = 4096
_COMBINERS = ("$ref", "allOf", "anyOf", "oneOf")


class _Values:
    """Values valid for the subschemas of one tool's parameters schema (`root`), made from the query."""

    def __init__(self, root: dict[str, Any], query: str) -> None:
        self.root, self.query, self.steps = root, query, 0

    def spent(self) -> bool:
        self.steps += 1
        return self.steps > _SCHEMA_STEPS

    def value(self, schema: Any, n: int, depth: int) -> Any:
        """A value of `schema`; past SCHEMA_DEPTH (or the step budget) the plain string."""
        if depth > SCHEMA_DEPTH or self.spent():
            return f"{self.query} #{n}"
        s = self.resolved(schema)
        if "const" in s:
            return s["const"]
        if isinstance(s.get("enum"), list) and s["enum"]:
            return s["enum"][0]
        kind = s.get("type")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), kind[0] if kind else None)
        if kind is None:
            kind = "object" if "properties" in s else "array" if "items" in s or "prefixItems" in s else None
        if kind in ("integer", "number"):
            return _number(s, kind, n + len(self.query))
        if kind == "boolean":
            return False
        if kind == "null":
            return None
        if kind == "array":
            return self.array(s, n, depth + 1)
        if kind == "object":
            return self.object(s, n, depth + 1)
        return _string(s, f"{self.query} #{n}")

    def resolved(self, schema: Any, nested: int = 0) -> dict[str, Any]:
        """`schema` with local $refs followed, allOf merged in, anyOf/oneOf cut to their first non-null branch."""
        s = schema if isinstance(schema, dict) else {}
        for _ in range(4 * SCHEMA_DEPTH):  # a $ref cycle ends here; `nested` bounds allOf within allOf
            if self.spent():
                break
            if "$ref" in s:
                s = _merged({k: v for k, v in s.items() if k != "$ref"}, _pointer(self.root, s["$ref"]))
            elif "allOf" in s:
                parts = s["allOf"] if isinstance(s["allOf"], list) else []
                s = {k: v for k, v in s.items() if k != "allOf"}
                for part in parts if nested < SCHEMA_DEPTH else []:
                    s = _merged(s, self.resolved(part, nested + 1))
            elif "anyOf" in s or "oneOf" in s:
                which = "anyOf" if "anyOf" in s else "oneOf"
                branches = [b for b in s[which] if isinstance(b, dict)] if isinstance(s[which], list) else []
                useful = [b for b in branches if b.get("type") != "null"]
                s = _merged({k: v for k, v in s.items() if k != which}, (useful or branches or [{}])[0])
            else:
                return s
        return {k: v for k, v in s.items() if k not in _COMBINERS}  # a $ref cycle, or a hostile schema

    def object(self, s: dict[str, Any], n: int, depth: int) -> dict[str, Any]:
        """The required properties (then optional ones up to minProperties), each a value of its subschema."""
        props: dict[str, Any] = s["properties"] if isinstance(s.get("properties"), dict) else {}
        required: list[Any] = s["required"] if isinstance(s.get("required"), list) else []
        names = list(dict.fromkeys(r for r in required if isinstance(r, str)))
        least: int = s["minProperties"] if isinstance(s.get("minProperties"), int) else 0
        names += [p for p in props if p not in names][: max(0, least - len(names))]
        out: dict[str, Any] = {}
        for name in names:  # a required name without a property: additionalProperties (patternProperties unread)
            out[name] = self.value(props[name] if name in props else s.get("additionalProperties"), n, depth)
        return out

    def array(self, s: dict[str, Any], n: int, depth: int) -> list[Any]:
        """One item (minItems..maxItems of them; a tuple's prefix in full); item i is made with n+i."""
        items = s.get("items")
        prefix = s.get("prefixItems") if isinstance(s.get("prefixItems"), list) else items
        prefix = prefix if isinstance(prefix, list) else []
        rest = items if isinstance(items, dict) else s.get("additionalItems")
        least: int = s["minItems"] if isinstance(s.get("minItems"), int) else 0
        most: int | None = s["maxItems"] if isinstance(s.get("maxItems"), int) else None
        if prefix and (rest is False or items is False):
            most = len(prefix) if most is None else min(most, len(prefix))
        count = max(least, len(prefix) or 1)
        count = min(_MOST_ITEMS, count if most is None else max(0, min(count, most)))
        return [self.value(prefix[i] if i < len(prefix) else rest, n + i, depth) for i in range(count)]


def _merged(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Both schemas' keywords (`b` wins), their properties and required lists united."""
    out = {**a, **b}
    if isinstance(a.get("properties"), dict) and isinstance(b.get("properties"), dict):
        out["properties"] = {**a["properties"], **b["properties"]}
    if isinstance(a.get("required"), list) and isinstance(b.get("required"), list):
        out["required"] = a["required"] + [r for r in b["required"] if r not in a["required"]]
    return out


def _pointer(root: dict[str, Any], ref: Any) -> dict[str, Any]:
    """The subschema a local $ref ("#", "#/$defs/Name", "#/definitions/Name", any JSON pointer) names; else {}."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return {}
    node: Any = root
    for part in unquote(ref[1:]).split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return {}
    return node if isinstance(node, dict) else {}


def _string(s: dict[str, Any], value: str) -> str:
    """`value` (a known `format`'s example instead), padded or cut to minLength/maxLength; `pattern` is ignored."""
    if isinstance(s.get("format"), str):
        value = _STRING_FORMATS.get(s["format"], value)
    least, most = s.get("minLength"), s.get("maxLength")
    if isinstance(least, int) and len(value) < least:
        value += "x" * (min(least, _MOST_CHARS) - len(value))
    if isinstance(most, int) and len(value) > most:
        value = value[: max(0, most)]
    return value


def _number(s: dict[str, Any], kind: str, value: int) -> int | float:
    """`value` if the bounds (and multipleOf) allow it, else the nearest bound, or the middle, that they allow."""

    def bound(name: str) -> float | None:
        v = s.get(name)
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None

    low, high, above, below = bound("minimum"), bound("maximum"), bound("exclusiveMinimum"), bound("exclusiveMaximum")
    if s.get("exclusiveMinimum") is True:  # draft 4: a boolean that makes `minimum` exclusive
        low, above = None, low
    if s.get("exclusiveMaximum") is True:
        high, below = None, high
    step = bound("multipleOf")
    step = step if step is not None and step > 0 else None

    def fits(v: float) -> bool:
        return (
            (kind != "integer" or v == int(v))
            and (step is None or abs(v / step - round(v / step)) < 1e-9)
            and (low is None or v >= low) and (high is None or v <= high)
            and (above is None or v > above) and (below is None or v < below)
        )

    lo, hi = (low if low is not None else above), (high if high is not None else below)
    edges = (low, high, above + 1 if above is not None else None, below - 1 if below is not None else None)
    bases: list[float] = [value, *sorted((e for e in edges if e is not None), key=lambda e: abs(e - value))]
    if lo is not None and hi is not None:
        bases.append((lo + hi) / 2)
    for base in bases:
        tries = [base] + ([step * math.ceil(base / step), step * math.floor(base / step)] if step else [])
        tries += [math.ceil(base), math.floor(base)]
        for v in tries:
            if fits(v):
                return int(v) if v == int(v) else v
    return value
