"""Sessions: the registry and its lifecycle rules, each session's turn store and logs, idle-time compaction.

Pure bookkeeping, no sockets; imports the stdlib and `broker.protocol`, never `broker.episodes`.
"""
