"""One agent request as a turn: OPEN -> render -> engine -> parse, replied to whole or live, then COMMIT or ABORT.

Read `start` first: it is the path. Dialect-free: the adapters translate wire bodies to `captured.TurnRequest`
and turns back to replies.
"""
