"""Episodes: finishing sessions, building training rows from their turns, and the outbox that delivers them.

No sockets; imports the stdlib, `broker.protocol` and `broker.sessions`.
"""
