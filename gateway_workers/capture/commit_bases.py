"""Commit bases: per session, the last turn this worker committed, so the next COMMIT can be a delta.

A turn's prompt almost always extends the previous turn of its session, which the broker
already holds; a delta COMMIT names that turn and sends only what follows the shared prefix
(see `protocol.CommitTurn`). This module keeps the bases (a bounded LRU: nothing depends on
an entry being there) and turns a full commit into a delta. Only ACKed turns become bases.
The prefix is found with memcmp over the int32 bytes (bisected on a mismatch), never a
Python loop over ids, and its CRC-32 continues the base's prompt CRC (each turn's prompt CRC
continues the one its delta sent), so only new ids are checksummed. Imports only the stdlib,
`broker.protocol` and `broker.token_ids`; no sockets, no asyncio.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from broker import protocol
from broker.token_ids import matching_prefix

MAX_SESSIONS = 4096
# Bound on the held context bytes (4 per token): 128 MiB is ~1300 sessions at 24k tokens.
# The messages held alongside are references to the request's own dicts, about as large again.
MAX_CONTEXT_BYTES = 128 * 2**20
_ID_BYTES = 4


@dataclass(frozen=True, slots=True)
class CommitBase:
    """A committed turn as a base: its id, context (prompt + output ids, native int32 bytes) and messages,
    and the CRC-32 of its prompt's ids (the context's first `prompt_tokens` ids)."""

    turn_id: str
    context: bytes
    messages: list[Any]  # prompt messages + the response message, as the worker built them (read-only)
    prompt_tokens: int = 0
    prompt_crc32: int = 0

    def crc32(self, tokens: int) -> int:
        """zlib.crc32 of the context's first `tokens` ids: past the prompt, only the rest is read."""
        view = memoryview(self.context)
        if tokens >= self.prompt_tokens:
            return zlib.crc32(view[self.prompt_tokens * _ID_BYTES : tokens * _ID_BYTES], self.prompt_crc32)
        return zlib.crc32(view[: tokens * _ID_BYTES])


class CommitBases:
    """The last ACKed turn of each recently active session, bounded by session count and context bytes."""

    def __init__(self, max_sessions: int = MAX_SESSIONS, max_bytes: int = MAX_CONTEXT_BYTES) -> None:
        self._bases: OrderedDict[str, CommitBase] = OrderedDict()
        self._bytes = 0
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes

    def __len__(self) -> int:
        return len(self._bases)

    @property
    def bytes_held(self) -> int:
        return self._bytes

    def get(self, session_id: str) -> CommitBase | None:
        return self._bases.get(session_id)

    def remember(self, commit: protocol.CommitTurn, prompt_crc32: int | None = None) -> None:
        """Make an ACKed full commit its session's base (the broker holds it now).

        `prompt_crc32`: zlib.crc32 of its prompt ids, if known (`delta_and_crc`); else computed here.
        """
        with memoryview(commit.prompt_ids) as p, memoryview(commit.output_ids) as o:
            context = b"".join((p.cast("B"), o.cast("B")))  # one copy: the commit's arrays may be reused
        n_prompt = len(commit.prompt_ids)
        if prompt_crc32 is None:
            prompt_crc32 = zlib.crc32(memoryview(context)[: n_prompt * _ID_BYTES])
        self.forget(commit.session_id)
        self._bases[commit.session_id] = CommitBase(
            commit.turn_id, context, [*commit.prompt_messages, commit.response_message], n_prompt, prompt_crc32
        )
        self._bytes += len(context)
        while self._bases and (len(self._bases) > self.max_sessions or self._bytes > self.max_bytes):
            _, evicted = self._bases.popitem(last=False)
            self._bytes -= len(evicted.context)

    def forget(self, session_id: str, turn_id: str | None = None) -> None:
        """Drop a session's base (only if it is `turn_id`, when given): refused, or its session is gone."""
        base = self._bases.get(session_id)
        if base is not None and (turn_id is None or base.turn_id == turn_id):
            del self._bases[session_id]
            self._bytes -= len(base.context)

    def delta(self, commit: protocol.CommitTurn, request_id: int = 0) -> protocol.CommitTurn | None:
        """`commit` (a full one) as a delta against its session's base; None when there is none or nothing is shared."""
        return self.delta_and_crc(commit, request_id)[0]

    def delta_and_crc(
        self, commit: protocol.CommitTurn, request_id: int = 0
    ) -> tuple[protocol.CommitTurn | None, int | None]:
        """(`delta(commit)` with `request_id`, zlib.crc32 of the commit's prompt ids if it came for free, else None).

        The CRC is for `remember` once the turn is ACKed: the delta's prefix CRC continued over the new ids.
        """
        base = self._bases.get(commit.session_id)
        if base is None or base.turn_id == commit.turn_id:
            return None, None
        prompt, output = commit.prompt_ids, commit.output_ids
        n_prompt = len(prompt)
        with memoryview(prompt) as p, memoryview(output) as o, p.cast("B") as pb, o.cast("B") as ob:
            shared = shared_ids(base.context, 0, pb)
            if shared == n_prompt:  # the whole prompt is shared: the output may continue the base too
                shared += shared_ids(base.context, n_prompt * _ID_BYTES, ob)
            # The response message always travels (the broker counts prompt messages from the delta).
            n_messages = shared_items(base.messages, commit.prompt_messages)
            if not shared and not n_messages:
                return None, None
            crc = base.crc32(shared)
            prompt_crc = zlib.crc32(pb[shared * _ID_BYTES :], crc) if shared <= n_prompt else None
        # Built in one go (a dataclasses.replace of the full commit's 17 fields cost more: docs/performance.md).
        delta = protocol.CommitTurn(
            request_id=request_id,
            session_id=commit.session_id,
            turn_id=commit.turn_id,
            prompt_ids=prompt[shared:] if shared < n_prompt else protocol.ids_array(),
            output_ids=output,
            logprobs=commit.logprobs,
            finish_reason=commit.finish_reason,
            prompt_messages=commit.prompt_messages[n_messages:],
            response_message=commit.response_message,
            flags=commit.flags,
            timings=commit.timings,
            base_turn_id=base.turn_id,
            base_tokens=shared,
            base_messages=n_messages,
            prompt_len=n_prompt,
            base_crc32=crc,
        )
        return delta, prompt_crc


def shared_ids(base: bytes, offset: int, new: memoryview) -> int:
    """How many leading int32 ids of `new` (bytes) equal those of `base` from byte `offset` on.

    One memcmp when all match; otherwise a bisection of memcmps over the remaining range
    (`token_ids.matching_prefix`: about two passes over the prefix in all).
    """
    n = min((len(base) - offset) // _ID_BYTES, len(new) // _ID_BYTES)
    if n <= 0:
        return 0
    if base.startswith(new[: n * _ID_BYTES], offset):
        return n
    return matching_prefix(
        n, lambda lo, hi: base.startswith(new[lo * _ID_BYTES : hi * _ID_BYTES], offset + lo * _ID_BYTES)
    )


def shared_items(base: list[Any], new: list[Any]) -> int:
    """How many leading items of `new` equal those of `base` (list equality in C, bisected on a mismatch)."""
    n = min(len(base), len(new))
    if base[:n] == new[:n]:
        return n
    return matching_prefix(n, lambda lo, hi: base[lo:hi] == new[lo:hi])
