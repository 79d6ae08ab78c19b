"""Frame -> message for one direction of a socket: unpack, check version and tag, hand the fields to a class decoder.

`broker.protocol` builds one decoder per direction here (`direction_decoder`), handing in its
version and its two error classes, so this module needs nothing of `protocol`. Each class's
`fast` decoder is generated on that class's first frame: generating all of them would add to
every process's import. Imports only the stdlib, `msgpack` and `broker.codec`.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

import msgpack

from broker.codec import fast

ClassDecoder = Callable[[list[object]], Any]


class ErrorTypes(typing.NamedTuple):
    """The errors a decoder raises: `error(message, request_id)` and `mismatch(peer_version, request_id)`."""

    error: Callable[[str, int | None], Exception]
    mismatch: Callable[[object, int | None], Exception]


def _lazy_decoder(cls: Any, table: dict[str, ClassDecoder]) -> ClassDecoder:
    """A stand-in that generates `cls`'s decoder on its first frame and puts it in `table` in its place."""

    def first(items: list[object]) -> Any:
        decode = table[cls.TAG] = fast.build_decoder(cls)
        return decode(items)

    return first


def _request_id(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def direction_decoder(direction: str, union: Any, version: int, errors: ErrorTypes) -> Callable[[bytes], Any]:
    """The decoder of frames carrying the messages of `union`: one of them, or `errors.error` (or `mismatch`)."""
    by_tag: dict[str, ClassDecoder] = {}
    by_tag.update((cls.TAG, _lazy_decoder(cls, by_tag)) for cls in typing.get_args(union))
    unpackb = msgpack.unpackb
    error, mismatch = errors

    def bad_frame(items: object) -> Exception:
        """Why a frame that decoded as msgpack is not a message of this direction."""
        if not isinstance(items, list) or len(items) < 3:
            return error("a frame must be an array [version, tag, request_id, ...]", None)
        peer_version, tag, rid = items[0], items[1], _request_id(items[2])
        if peer_version != version:
            return mismatch(peer_version, rid)
        return error(f"unknown message {tag!r} for {direction}", rid)

    def decode(frame: bytes) -> Any:
        try:
            items = unpackb(frame, raw=False, strict_map_key=False)
        except Exception as e:  # msgpack raises several unrelated types for garbage
            raise error(f"undecodable frame ({type(e).__name__}: {e})", None) from e
        # The usual frame passes these four checks; anything unusual is sorted out by `bad_frame`.
        if type(items) is list and len(items) > 2 and items[0] == version and type(items[1]) is str:
            build = by_tag.get(items[1])  # type: ignore[arg-type]
            if build is not None:
                try:
                    return build(items)
                except TypeError as e:
                    raise error(f"malformed {items[1]}: {e}", _request_id(items[2])) from e
        raise bad_frame(items)

    decode.__name__ = f"decode_{direction}"
    return decode
