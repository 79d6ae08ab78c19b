"""Fast twins of slow library paths (chat template, BPE encode, id decode), each checked against its original.

`checks` holds the one sampling rule every twin follows. Must not import the rest of the gateway.
"""
