"""The wire forms both codecs share: field markers, packed arrays, packed maps and the process's one Packer.

`broker.messages` marks its dataclass fields with `IDS` / `LOGPROBS` / `MASK` / `PACKED_MAPS`;
`generic` and `fast` read those markers and use the pieces here, so the two codecs write the
same bytes by construction. Imports only the stdlib and `msgpack`; nothing of `broker`.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable
from typing import Any

import msgpack

LITTLE_ENDIAN = sys.byteorder == "little"

# `field(metadata=IDS)` marks a packed int32 field, `LOGPROBS` a float32 one, `MASK` a uint8 one.
IDS = {"packed": "i"}
LOGPROBS = {"packed": "f"}
MASK = {"packed": "B"}
# `PACKED_MAPS` marks a message field (a map, or a list of maps) that travels as msgpack bins, each the
# encoding of one map: the broker keeps them as bytes and decodes them only when it needs the dicts.
PACKED_MAPS = {"packed_maps": True}

# msgpack's extension type: what a durable broker's snapshots mark large buffers with (`broker.durability.records`).
ExtType = msgpack.ExtType

# One Packer for every frame this process writes (building one per frame would cost more than packing).
packer = msgpack.Packer(use_bin_type=True)
pack = packer.pack

# First byte of a msgpack map: fixmap (0x80-0x8f), map 16 (0xde), map 32 (0xdf).
_MAP_MARKERS = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])


def pack_array(a: array) -> bytes:
    """A packed array's wire bytes: little-endian whatever this machine's order."""
    if LITTLE_ENDIAN:
        return a.tobytes()
    swapped = array(a.typecode, a)
    swapped.byteswap()
    return swapped.tobytes()


def array_unpacker(typecode: str) -> Callable[[object], array]:
    """A validating decoder of packed `typecode` bytes into an array (TypeError for anything else)."""
    itemsize = array(typecode).itemsize

    def unpack(value: object) -> array:
        if not isinstance(value, (bytes, bytearray)) or len(value) % itemsize:
            raise TypeError(f"expected packed {typecode!r} bytes")
        a = array(typecode)
        a.frombytes(value)
        if not LITTLE_ENDIAN:
            a.byteswap()
        return a

    return unpack


def pack_message(message: dict[str, Any] | bytes) -> bytes:
    """A message's msgpack encoding, the form `CommitTurn` carries and the broker keeps (bytes pass through)."""
    if type(message) is bytes:
        return message
    if not isinstance(message, dict):
        raise TypeError(f"a message is a map, not {type(message).__name__}")
    return pack(message)


def is_packed_map(value: object) -> bool:
    """Whether `value` is bytes that start like a msgpack map (the cheap check a stored message gets on arrival)."""
    return type(value) is bytes and len(value) > 0 and value[0] in _MAP_MARKERS
