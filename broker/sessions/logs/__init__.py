"""A session's append-only logs: raw tails, compressed heads, and ranges into them.

Pure data structures; imports only the stdlib and `broker.protocol`.
"""
