"""Fast twins of slow library paths (chat template, BPE encode, id decode), each checked against its original.

`checks.Twin` is the one seam every twin (the response reader of `formats` too) goes through: the
sampling rule, the comparison, the switch-off and the counters. Must not import the rest of the gateway.
"""
