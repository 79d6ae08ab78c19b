"""Codecs behind `broker.protocol`: message <-> msgpack frame, for the message dataclasses it re-exports.

`wire` (field markers, packed arrays and maps, the Packer), `generic` (the field-spec walk, the
reference), `fast` (per-class generated encoders and decoders) and `frames` (a direction's decoder).
Only `broker.protocol` imports this package (and `broker.messages`, the field markers in `wire`, and
`broker.durability.records`, whose log records are tagged dataclasses framed the same way);
everyone else calls `protocol.encode` / `protocol.decode_*`.
Stdlib and `msgpack` only: no zmq, nothing else of `broker`.
"""
