"""Per-class decoders and encoders for `broker.protocol`, generated from the dataclass fields.

The generic codec (`generic`) walks a field spec and calls a checker per field; this module writes
one straight-line function per message class instead: exact-type checks (`type(v) is str`) inlined,
packed arrays unpacked in place, the slots filled by plain attribute stores (see `_fill_class`). A fast
decoder only *accepts* what the generic one accepts; anything it does not accept at once (a wrong type,
an older peer's shorter frame, an int where a float is due) goes to `generic.build`, which gives the
same answer and the same error message. Field order always comes from `dataclasses.fields`, never
from a caller, so the generated code cannot mis-order the wire. Imports only the stdlib, `msgpack`
(through `wire`) and `broker.codec`; no sockets.
"""

from __future__ import annotations

import dataclasses
import keyword
import types
import typing
from array import array
from collections.abc import Callable
from typing import Any

from broker.codec import generic
from broker.codec.wire import LITTLE_ENDIAN, pack, pack_array, pack_message

# Hints checked inline by exact type; every other hint goes through the generic converter.
_EXACT: dict[Any, str] = {str: "str", int: "int", bool: "bool", bytes: "bytes", dict: "dict"}


def _exact_type(hint: Any) -> str | None:
    """The exact builtin type name a value of `hint` must have (msgpack builds exact types), if one does."""
    if hint in _EXACT:
        return _EXACT[hint]
    origin = typing.get_origin(hint)
    if origin is dict:
        return "dict"
    if origin is list:
        (item,) = typing.get_args(hint)
        # list[int] / list[str] / list[Struct] check their elements: left to the generic converter
        if item in (int, str) or (isinstance(item, type) and dataclasses.is_dataclass(item)):
            return None
        return "list"
    return None


def _optional_inner(hint: Any) -> Any:
    """X for `X | None`, else None."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(hint)) == 2:
            return args[0]
    return None


def _check_expr(var: str, hint: Any) -> str | None:
    """A boolean expression that is True when `var` is certainly NOT acceptable inline, or None (no inline check)."""
    if hint is Any:
        return "False"
    exact = _exact_type(hint)
    if exact is not None:
        return f"type({var}) is not {exact}"
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        names = [_exact_type(a) for a in typing.get_args(hint)]
        if None not in names and "list" not in names:  # e.g. dict | bytes: one exact type of several
            return " and ".join(f"type({var}) is not {n}" for n in names)
    inner = _optional_inner(hint)
    if inner is not None:
        exact = _exact_type(inner)
        if exact is not None:
            return f"({var} is not None and type({var}) is not {exact})"
    return None


def build_decoder(
    cls: type,
    converters: dict[str, Callable[[object], object]] | None = None,
    fallback: Callable[[type, list[object]], Any] = generic.build,
    little_endian: bool = LITTLE_ENDIAN,
) -> Callable[[list[object]], Any]:
    """A decoder of a whole frame's items `[version, tag, *fields]` (version and tag already checked) into `cls`.

    `converters` are the generic per-field decoders (used where no inline check applies; default
    `generic.converters(cls)`) and `fallback(cls, items[2:])` is the generic build, called whenever
    the fast path declines (a test hands in a spy there).
    """
    if converters is None:
        converters = generic.converters(cls)
    fields = dataclasses.fields(cls)
    if hasattr(cls, "__post_init__") or not hasattr(cls, "__slots__"):
        # the generated code fills slots directly, which would skip a __post_init__
        return lambda items: fallback(cls, items[2:])
    hints = typing.get_type_hints(cls)
    names = [f"f_{f.name}" for f in fields]
    assert not any(keyword.iskeyword(n) for n in names)
    ns: dict[str, Any] = {
        "_fallback": fallback,
        "_cls": cls,
        "_fill": _fill_class(cls),
        "_new": object.__new__,
        "_array": array,
    }
    lines = [f"def decode_{cls.__name__}(items):", "    try:"]
    lines.append(f"        if len(items) != {len(fields) + 2}:")
    lines.append("            raise TypeError")  # an older (shorter) or a longer frame: the generic path decides
    lines.append(f"        _v, _t, {', '.join(names)}, = items")
    checks: list[str] = []
    body: list[str] = []
    for f, var in zip(fields, names, strict=True):
        packed = f.metadata.get("packed")
        if packed:
            size = array(packed).itemsize
            checks.append(f"type({var}) is not bytes" + (f" or len({var}) % {size}" if size > 1 else ""))
            if little_endian:
                body.append(f"        _a = _array({packed!r}); _a.frombytes({var}); {var} = _a")
            else:
                ns[f"c_{f.name}"] = converters[f.name]
                body.append(f"        {var} = c_{f.name}({var})")
            continue
        check = _check_expr(var, hints[f.name])
        if check is None:  # float, list[int], list[Struct], ...: the generic converter raises TypeError
            ns[f"c_{f.name}"] = converters[f.name]
            body.append(f"        {var} = c_{f.name}({var})")
        elif check != "False":
            checks.append(check)
    if checks:
        lines.append("        if (" + "\n                or ".join(checks) + "):")
        lines.append("            raise TypeError")
    lines += body
    lines.append("    except TypeError:")
    lines.append("        return _fallback(_cls, items[2:])")
    # Filled as a `_fill` (plain attribute stores, which the interpreter specializes to a slot write, far
    # cheaper than a slot descriptor's __set__ call: docs/performance.md), then made a `cls`.
    lines.append("    o = _new(_fill)")
    lines += [f"    o.{f.name} = {var}" for f, var in zip(fields, names, strict=True)]
    lines.append("    o.__class__ = _cls")
    lines.append("    return o")
    exec("\n".join(lines), ns)  # noqa: S102 - source built above from the dataclass's own field names
    decode: Callable[[list[object]], Any] = ns[f"decode_{cls.__name__}"]
    return decode


def _fill_class(cls: type) -> type:
    """A subclass of the slotted `cls` that adds no slot and lets its fields be set (a frozen class forbids it).

    Its instances have `cls`'s exact layout, so a filled one becomes a `cls` by `__class__` assignment
    (what `compatible_for_assignment` checks), equal to one its `__init__` would have built. Both
    `__setattr__` and `__delattr__` must be object's own: the interpreter then sees plain slot
    storage and specializes each store, while either one inherited from the frozen class would
    route every store through a Python-level hook.
    """
    namespace = {"__slots__": (), "__setattr__": object.__setattr__, "__delattr__": object.__delattr__}
    return type(f"_{cls.__name__}Fill", (cls,), namespace)


def build_encoder(cls: type, version: int) -> Callable[[Any], bytes]:
    """An encoder of a `cls` message into one frame `[version, TAG, *fields]`, fields in declaration order."""
    ns: dict[str, Any] = {}
    body = ", ".join(_field_exprs(cls, ns, "m.{}"))
    src = f"def encode_{cls.__name__}(m):\n    return _pack([{version!r}, {cls.TAG!r}, {body}])"  # type: ignore[attr-defined]
    exec(src, ns)  # noqa: S102 - source built from the dataclass's own field names
    encode: Callable[[Any], bytes] = ns[f"encode_{cls.__name__}"]
    return encode


def build_frame_encoder(cls: type, version: int) -> Callable[..., bytes]:
    """A function of `cls`'s fields, keyword-only, that returns the frame of `cls(**fields)` without building it.

    Its parameters are the dataclass's fields, so a caller names every field and the frame takes them
    in declaration order: reordering the dataclass moves both together, and a missing, extra or
    misspelled field is a TypeError at the call. Every field is required (no defaults filled in).
    """
    names = [f.name for f in dataclasses.fields(cls)]
    assert not any(keyword.iskeyword(n) or n.startswith("_") for n in names), names
    ns: dict[str, Any] = {}
    body = ", ".join(_field_exprs(cls, ns, "{}"))
    src = (
        f"def frame_{cls.__name__}(*, {', '.join(names)}):\n"
        f"    return _pack([{version!r}, {cls.TAG!r}, {body}])"  # type: ignore[attr-defined]
    )
    exec(src, ns)  # noqa: S102 - source built from the dataclass's own field names
    frame: Callable[..., bytes] = ns[f"frame_{cls.__name__}"]
    return frame


_STRUCT_FIELDS: dict[type, Callable[[Any], list[object]]] = {}


def struct_fields(cls: type) -> Callable[[Any], list[object]]:
    """The field list of a nested struct (e.g. TraceRow inside SessionFinished), as the wire carries it."""
    fields = _STRUCT_FIELDS.get(cls)
    if fields is None:
        ns: dict[str, Any] = {}
        body = ", ".join(_field_exprs(cls, ns, "m.{}"))
        exec(f"def fields_{cls.__name__}(m):\n    return [{body}]", ns)  # noqa: S102
        fields = _STRUCT_FIELDS[cls] = ns[f"fields_{cls.__name__}"]
    return fields


def _field_exprs(cls: type, ns: dict[str, Any], ref: str) -> list[str]:
    """One expression per field, in declaration order; `ref` formats a field name into how the code reads it."""
    ns.update(_pack=pack, _pack_array=pack_array, _pack_message=pack_message)
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        hint, value = hints[f.name], ref.format(f.name)
        if f.metadata.get("packed"):
            out.append(f"_pack_array({value})")
            continue
        if f.metadata.get("packed_maps"):
            if typing.get_origin(hint) is list:
                out.append(f"[_pack_message(v) for v in {value}]")
            else:
                out.append(f"_pack_message({value})")
            continue
        if typing.get_origin(hint) is list:
            (item,) = typing.get_args(hint)
            if isinstance(item, type) and dataclasses.is_dataclass(item):
                ns[f"_f_{f.name}"] = struct_fields(item)
                out.append(f"[_f_{f.name}(v) for v in {value}]")
                continue
        out.append(value)
    return out
