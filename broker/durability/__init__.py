"""Durability: a broker's state directory (`--state-dir`): the write-ahead log, snapshots, and recovery on start.

`wal` (segment files of checksummed records, fsync policies), `records` (what they hold),
`journal` (the broker's changes as records), `snapshots` (the live state, object by object),
`recovery` (snapshot + log -> registry and outbox) and `store` (the directory as the server uses
it). Only `broker.server` and `broker.__main__` wire it in; `broker.sessions` and
`broker.episodes` never import it (they log through the `episodes.journal` seam). No zmq, no asyncio.
"""
