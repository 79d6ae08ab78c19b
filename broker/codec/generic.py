"""The generic codec: walks a dataclass's field spec, one validating converter per field.

It is the reference `fast` is held to (and falls back to): any message class, any frame an older
peer sends (trailing defaulted fields missing), and the exact error text for a field of the wrong
type. A frame's fields are positional in declaration order, so the spec is built from
`dataclasses.fields` and never written by hand. Raises `TypeError`; `broker.protocol` turns it into
`ProtocolError`. Imports only the stdlib, `msgpack` (through `wire`) and `broker.codec`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, NamedTuple, Union

from broker.codec.wire import array_unpacker, pack, pack_array, pack_message

Converter = Callable[[object], object]


class FieldSpec(NamedTuple):
    """How one field travels: its name, the converter of its msgpack value, and whether it is a packed array."""

    name: str
    decoder: Converter
    packed: bool


def _check(kind: type | tuple[type, ...], name: str) -> Converter:
    def check(value: object) -> object:
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
            raise TypeError(f"expected {name}")
        return value

    return check


def _as_float(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError("expected float")
    return float(value)


def _optional(inner: Converter) -> Converter:
    return lambda value: None if value is None else inner(value)


def _list_of(inner: Converter) -> Converter:
    def decode_list(value: object) -> list[object]:
        if not isinstance(value, list):
            raise TypeError("expected list")
        return [inner(v) for v in value]

    return decode_list


def converter(hint: Any) -> Converter:
    """Turn a field's type hint into a validating decoder of its msgpack value."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) > 1 and all(a in (dict, bytes) or typing.get_origin(a) is dict for a in args):
            kinds = tuple(typing.get_origin(a) or a for a in args)
            return _check(kinds, " or ".join("map" if k is dict else k.__name__ for k in kinds))
        if len(args) != 1:
            raise TypeError(f"unsupported union {hint!r}")
        return _optional(converter(args[0]))
    if origin is list:
        (item,) = typing.get_args(hint)
        if isinstance(item, type) and dataclasses.is_dataclass(item):
            return _list_of(struct_decoder(item))
        if item in (int, str):  # e.g. delivery ids: each element is checked too
            return _list_of(converter(item))
        return _check(list, "list")
    if hint is float:
        return _as_float
    simple = {str: "str", int: "int", bool: "bool", bytes: "bytes"}
    if hint in simple:
        return _check(hint, simple[hint])
    if hint is dict or origin is dict:
        return _check(dict, "map")
    if hint is Any:
        return lambda value: value
    raise TypeError(f"unsupported field type {hint!r}")


_SPECS: dict[type, list[FieldSpec]] = {}
_MAP_FIELDS: dict[type, frozenset[str]] = {}


def field_spec(cls: type) -> list[FieldSpec]:
    """`cls`'s fields in declaration order (the wire order), each with its converter; built once per class."""
    spec = _SPECS.get(cls)
    if spec is None:
        hints = typing.get_type_hints(cls)
        spec = []
        for f in dataclasses.fields(cls):
            packed = f.metadata.get("packed")
            decoder = array_unpacker(packed) if packed else converter(hints[f.name])
            spec.append(FieldSpec(f.name, decoder, bool(packed)))
        _SPECS[cls] = spec
        _MAP_FIELDS[cls] = frozenset(f.name for f in dataclasses.fields(cls) if f.metadata.get("packed_maps"))
    return spec


def converters(cls: type) -> dict[str, Converter]:
    """Field name -> converter of `cls`: what `fast.build_decoder` calls where it checks nothing inline."""
    return {f.name: f.decoder for f in field_spec(cls)}


def fields_out(obj: object) -> list[object]:
    """A message's (or nested struct's) fields as the wire carries them, in declaration order."""
    out: list[object] = []
    spec = field_spec(type(obj))
    maps = _MAP_FIELDS[type(obj)]
    for name, _, packed in spec:
        value = getattr(obj, name)
        if packed:
            value = pack_array(value)
        elif name in maps:
            value = [pack_message(v) for v in value] if type(value) is list else pack_message(value)
        elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            value = [fields_out(v) for v in value]
        out.append(value)
    return out


def encode(msg: Any, version: int) -> bytes:
    """One frame `[version, TAG, *fields]`, walked field by field."""
    return pack([version, msg.TAG, *fields_out(msg)])


def build(cls: type, values: list[object]) -> Any:
    """A `cls` from its wire fields (an older peer's frame may lack trailing defaulted ones); TypeError if invalid."""
    spec = field_spec(cls)
    if len(values) > len(spec):
        raise TypeError(f"{len(values)} fields, {cls.__name__} has {len(spec)}")
    kwargs = {}
    for (name, decoder, _), value in zip(spec, values, strict=False):  # older peers send fewer
        try:
            kwargs[name] = decoder(value)
        except TypeError as e:
            raise TypeError(f"{cls.__name__}.{name}: {e}") from None
    try:
        return cls(**kwargs)  # fields missing from an older peer take their defaults
    except TypeError as e:
        raise TypeError(f"{cls.__name__}: {e}") from None


def struct_decoder(cls: type) -> Converter:
    """The converter of a nested struct (e.g. a TraceRow inside SessionFinished), sent as an array."""

    def decode_struct(value: object) -> object:
        if not isinstance(value, list):
            raise TypeError(f"expected {cls.__name__} as array")
        return build(cls, value)

    return decode_struct
