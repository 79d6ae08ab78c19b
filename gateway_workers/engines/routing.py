"""Replica choice: a session sticks to one engine replica, and routers in front of engines learn its key.

Rendezvous (highest-random-weight) hashing on a routing key derived from the session id:
every worker process picks the same replica for a session with no shared state, and
adding or removing a replica moves only the sessions that hashed to it. The same key is
sent in the headers that engine routers use for session affinity:
`X-Session-ID` (vllm-router's consistent_hash policy, first key it reads) and
`X-SMG-Routing-Key` (SGLang Model Gateway's consistent_hashing and manual policies).
The key is the session's tag (`protocol.session_tag`), never the session id itself: the session id
is the agent's API key. The gateway's logs name sessions by the same tag, so an engine's request
log and ours can be matched. Imports only the stdlib and `broker.protocol`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from broker.protocol import session_tag

VLLM_ROUTER_HEADER = "X-Session-ID"
SGLANG_GATEWAY_HEADER = "X-SMG-Routing-Key"


def routing_key(session_id: str) -> str:
    """The key a session is routed by: its non-secret tag."""
    return session_tag(session_id)


def routing_headers(key: str) -> dict[str, str]:
    """The session-affinity headers engine routers read, all carrying `key`."""
    return {VLLM_ROUTER_HEADER: key, SGLANG_GATEWAY_HEADER: key}


def choose_replica(urls: Sequence[str], key: str) -> str:
    """The replica for `key`: the url with the highest hash of (url, key)."""
    if not urls:
        raise ValueError("no engine replicas configured")
    if len(urls) == 1:
        return urls[0]
    return max(urls, key=lambda url: hashlib.blake2b(f"{url}\0{key}".encode(), digest_size=8).digest())
