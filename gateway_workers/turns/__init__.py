"""One agent request as a turn: OPEN -> render -> engine -> parse, replied to whole or live, then COMMIT or ABORT.

Dialect-free: the adapters translate wire bodies to `pipeline.TurnRequest` and turns back to replies.
"""
