"""Codecs behind `broker.protocol`: generated per-class encoders and decoders for the hot messages.

Only `broker.protocol` imports this package; everyone else calls `protocol.encode` / `protocol.decode_*`.
"""
