"""When a fast twin is checked against the original it stands in for.

The worker has plain-Python or native twins of slow library paths: the chat template
(`native_templates`), the BPE encode (`bpe_twin`) and the response reader of the JSON-call
formats (`formats.chatml`). Each is used only while it agrees with its original; this is the
one sampling rule for all of them. Imports nothing from the gateway.
"""

from __future__ import annotations

# A twin's result is compared with the original's on its first uses and then on one in this many.
VERIFY_FIRST = 16
VERIFY_EVERY = 1024


def checked_use(count: int) -> bool:
    """Whether the count-th use (from 0) of a twin is also run through the original and compared."""
    return count < VERIFY_FIRST or count % VERIFY_EVERY == 0
