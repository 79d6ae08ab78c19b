"""TurnStore: one session's committed turns, stored deduplicated, materialized only at finish.

A turn's tokens (prompt + output) and messages (prompt + response) are kept as ranges
into two append-only per-session logs, sharing the longest common prefix with a
neighbouring turn (usually the previous one by OPEN sequence), so a session costs about
its unique tokens instead of turns x context. A delta commit (one naming its base turn)
is stored without any comparison: the base's ranges cut to the shared length, plus the
new tail appended. Pure data structure: no sockets, no clocks, no lifecycle rules
(`sessions.py` owns those). Imports only the stdlib and
`broker.protocol` / `broker.trajectory` (for `TurnRecord`).
"""

from __future__ import annotations

import zlib
from array import array
from bisect import bisect_left, insort
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from broker import protocol
from broker.trajectory import TurnRecord

Range = tuple[int, int]
_MESSAGE_OVERHEAD = 64  # dict + key slots, for the bytes_held gauge
_ID_BYTES = 4  # int32 token ids


@dataclass(slots=True, eq=False)
class StoredTurn:
    """A committed turn as held: ranges into its session's logs instead of copies."""

    turn_id: str
    seq: int
    tok_ranges: list[Range]  # prompt ids + output ids, in the token log
    prompt_len: int
    logprobs: array
    finish_reason: str
    msg_ranges: list[Range]  # prompt messages + the response message, in the message log
    n_prompt_messages: int
    flags: dict[str, Any]
    n_tokens: int  # prompt + output ids
    # CRC-32 of the first `crc_len` context ids (a delta's checked prefix, or the whole context once a
    # delta used the turn as its base): the next delta's prefix check only reads ids past it.
    crc: int = 0
    crc_len: int = 0


class TurnStore:
    """The committed turns of one session, keyed by turn id and ordered by OPEN sequence."""

    __slots__ = (
        "tokens", "messages", "_text_bytes", "_sized", "logprob_bytes", "_turns", "_by_seq", "_seqs", "_last"
    )  # fmt: skip

    def __init__(self) -> None:
        # Every distinct token run, once, as native int32 bytes: a bytearray, because
        # `bytearray.startswith(buffer, offset)` compares against it in place (one memcmp,
        # no slice copies), which is most of the commit hot path.
        self.tokens = bytearray()
        self.messages: list[dict[str, Any]] = []  # every distinct message, once (read-only dicts)
        # Message text is sized for the gauge when it is read, not on the commit path: `_sized`
        # messages are counted in `_text_bytes`.
        self._text_bytes = 0
        self._sized = 0
        self.logprob_bytes = 0
        self._turns: dict[str, StoredTurn] = {}
        self._by_seq: dict[int, StoredTurn] = {}
        self._seqs: list[int] = []  # sorted
        self._last: StoredTurn | None = None  # most recent by arrival

    def __contains__(self, turn_id: object) -> bool:
        return turn_id in self._turns

    def __len__(self) -> int:
        return len(self._turns)

    @property
    def tokens_held(self) -> int:
        return len(self.tokens) // _ID_BYTES

    @property
    def message_bytes(self) -> int:
        """Approximate bytes of the held messages' text (see `_message_bytes`)."""
        messages = self.messages
        if self._sized < len(messages):
            self._text_bytes += sum(map(_message_bytes, messages[self._sized :]))
            self._sized = len(messages)
        return self._text_bytes

    def bytes_held(self) -> int:
        """Approximate payload bytes: token log, logprobs and message text."""
        return len(self.tokens) + self.logprob_bytes + self.message_bytes

    def add_delta(self, msg: protocol.CommitTurn, seq: int) -> str | None:
        """Store a delta commit as the turn with OPEN sequence `seq`, or say why its base cannot be used.

        The caller checked the commit is new and its numbers add up (`sessions._check_delta_shape`).
        Returns None once stored; else the problem (base not held, shorter than claimed, another
        prefix) and nothing is stored. The shared prefix is checked by its CRC-32, not id by id,
        and the base's own checked prefix is not read again (a delta of a delta reads only its
        base's tail: ~1 µs per 4k-token turn instead of ~7 µs for the whole context). The turn is
        its base's ranges cut to the shared length plus the tail appended: no comparison.
        """
        base = self._turns.get(msg.base_turn_id)
        if base is None:
            return f"no committed turn {msg.base_turn_id!r} to extend"
        n, n_base = msg.base_tokens, base.n_tokens
        if n > n_base:
            return f"base turn {msg.base_turn_id!r} has {n_base} tokens, not {n}"
        n_msgs, n_base_msgs = msg.base_messages, base.n_prompt_messages + 1
        if n_msgs > n_base_msgs:
            return f"base turn {msg.base_turn_id!r} has {n_base_msgs} messages, not {n_msgs}"
        crc = base.crc if n == base.crc_len else self._prefix_crc(base, n)
        if crc != msg.base_crc32:
            return f"the first {n} tokens of base turn {msg.base_turn_id!r} are not the ones claimed"

        log = self.tokens
        start = len(log) // _ID_BYTES
        log += msg.prompt_ids  # native int32 bytes, appended straight from the array's buffer
        prompt_len = msg.prompt_len
        if n <= prompt_len:
            log += msg.output_ids
        else:  # the shared prefix reaches into the output (a regenerated turn): skip that much of it
            with memoryview(msg.output_ids) as o, o.cast("B") as ob:
                log += ob[(n - prompt_len) * _ID_BYTES :]
        tok_ranges = base.tok_ranges[:] if n == n_base else _cut(base.tok_ranges, n)
        _extend(tok_ranges, start, len(log) // _ID_BYTES)

        messages = self.messages
        start = len(messages)
        prompt_messages = msg.prompt_messages
        messages += prompt_messages
        messages.append(msg.response_message)
        msg_ranges = base.msg_ranges[:] if n_msgs == n_base_msgs else _cut(base.msg_ranges, n_msgs)
        _extend(msg_ranges, start, len(messages))

        logprobs = msg.logprobs
        self._keep(
            StoredTurn(
                msg.turn_id,
                seq,
                tok_ranges,
                prompt_len,
                logprobs,
                msg.finish_reason,
                msg_ranges,
                n_msgs + len(prompt_messages),
                msg.flags,
                prompt_len + len(logprobs),  # len(logprobs) = len(output_ids), checked by the registry
                crc,  # the checked prefix: the next delta of this turn reads only what follows it
                n,
            )
        )
        return None

    def _prefix_crc(self, base: StoredTurn, n: int) -> int:
        """CRC-32 of the first `n` ids of `base`'s context, resumed from its known prefix CRC where that helps."""
        seed, lo = (base.crc, base.crc_len) if n > base.crc_len else (0, 0)
        crc = seed
        with memoryview(self.tokens) as log:
            for start, stop in _span(base.tok_ranges, lo, n):
                crc = zlib.crc32(log[start * _ID_BYTES : stop * _ID_BYTES], crc)
        if n == base.n_tokens:  # the usual base: the whole context, which later deltas of it extend too
            base.crc, base.crc_len = crc, n
        return crc

    def add_full(self, msg: protocol.CommitTurn, seq: int) -> None:
        """Store a full commit (the caller checked it is new and well-formed) as the turn with OPEN sequence `seq`.

        It shares the longest prefix of ids and of messages with a likely base turn (found by comparing).
        """
        msgs = msg.prompt_messages + [msg.response_message]
        with memoryview(msg.prompt_ids) as p, memoryview(msg.output_ids) as o, p.cast("B") as pb, o.cast("B") as ob:
            tok_ranges, base = self._add_ids(pb, ob, seq)
        shared, msg_ranges = 0, list[Range]()
        if base is not None:
            log_msgs = self.messages

            def same_msgs(i: int, j: int, n: int) -> bool:
                return bool(msgs[i : i + n] == log_msgs[j : j + n])  # dict equality, in C

            shared, msg_ranges = _common_prefix(len(msgs), same_msgs, base.msg_ranges)
        messages = self.messages
        start = len(messages)
        messages += msgs[shared:]
        _extend(msg_ranges, start, len(messages))
        prompt_len = len(msg.prompt_ids)
        self._keep(
            StoredTurn(
                msg.turn_id,
                seq,
                tok_ranges,
                prompt_len,
                msg.logprobs,
                msg.finish_reason,
                msg_ranges,
                len(msg.prompt_messages),
                msg.flags,
                prompt_len + len(msg.logprobs),
            )
        )

    def _keep(self, turn: StoredTurn) -> None:
        self.logprob_bytes += len(turn.logprobs) * turn.logprobs.itemsize
        self._turns[turn.turn_id] = turn
        seq = turn.seq
        self._by_seq[seq] = turn
        seqs = self._seqs
        if not seqs or seqs[-1] < seq:  # in-order arrival, the common case
            seqs.append(seq)
        else:
            insort(seqs, seq)
        self._last = turn

    def _add_ids(self, pb: memoryview, ob: memoryview, seq: int) -> tuple[list[Range], StoredTurn | None]:
        """Store prompt + output ids (as byte views) sharing the longest prefix with a likely base turn."""
        log = self.tokens
        n_prompt = len(pb) // _ID_BYTES
        n_ctx = n_prompt + len(ob) // _ID_BYTES

        def same(i: int, j: int, n: int) -> bool:
            # ids [i, i+n) of prompt + output against log ids [j, j+n), without building prompt + output
            if i + n <= n_prompt:
                return log.startswith(pb[i * _ID_BYTES : (i + n) * _ID_BYTES], j * _ID_BYTES)
            if i >= n_prompt:
                k = i - n_prompt
                return log.startswith(ob[k * _ID_BYTES : (k + n) * _ID_BYTES], j * _ID_BYTES)
            head = n_prompt - i
            return log.startswith(pb[i * _ID_BYTES :], j * _ID_BYTES) and log.startswith(
                ob[: (n - head) * _ID_BYTES], (j + head) * _ID_BYTES
            )

        # Candidates that most likely share a prefix: the neighbours by OPEN order (the usual
        # case: the next prompt extends the previous turn) and the latest arrival.
        seqs, last = self._seqs, self._last
        if not seqs or seqs[-1] < seq:  # in-order arrival, the common case: no search
            candidates = [] if last is None else [last] if last.seq == seqs[-1] else [self._by_seq[seqs[-1]], last]
        else:
            pos = bisect_left(seqs, seq)
            candidates = [self._by_seq[seqs[i]] for i in (pos - 1, pos) if 0 <= i < len(seqs)]
            if last is not None and all(c is not last for c in candidates):
                candidates.append(last)
        best_len, best_ranges, base = 0, [], None
        for cand in candidates:
            n, ranges = _common_prefix(n_ctx, same, cand.tok_ranges)
            if n > best_len or base is None:
                best_len, best_ranges, base = n, ranges, cand
            if n == n_ctx:
                break
        start = len(log) // _ID_BYTES
        if best_len < n_prompt:
            log += pb[best_len * _ID_BYTES :]
            log += ob
        else:
            log += ob[(best_len - n_prompt) * _ID_BYTES :]
        return _extend(best_ranges, start, len(log) // _ID_BYTES), base

    def turn_messages(self, turn_id: str) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        """A committed turn's prompt messages and response message; None if it is not stored."""
        turn = self._turns.get(turn_id)
        if turn is None:
            return None
        msgs = self._messages_of(turn)
        return msgs[: turn.n_prompt_messages], msgs[turn.n_prompt_messages]

    def records(self) -> list[TurnRecord]:
        """Every stored turn, materialized, in OPEN sequence order. Message dicts are shared: read-only."""
        return [self._materialize(self._by_seq[seq]) for seq in self._seqs]

    def _messages_of(self, turn: StoredTurn) -> list[dict[str, Any]]:
        msgs: list[dict[str, Any]] = []
        for start, stop in turn.msg_ranges:
            msgs.extend(self.messages[start:stop])
        return msgs

    def _materialize(self, turn: StoredTurn) -> TurnRecord:
        ctx = protocol.ids_array()
        for start, stop in turn.tok_ranges:
            ctx.frombytes(self.tokens[start * _ID_BYTES : stop * _ID_BYTES])
        msgs = self._messages_of(turn)
        return TurnRecord(
            turn_id=turn.turn_id,
            seq=turn.seq,
            prompt_ids=ctx[: turn.prompt_len],
            output_ids=ctx[turn.prompt_len :],
            logprobs=turn.logprobs,
            finish_reason=turn.finish_reason,
            prompt_messages=msgs[: turn.n_prompt_messages],
            response_message=msgs[turn.n_prompt_messages],
            flags=turn.flags,
        )


def _common_prefix(length: int, same: Callable[[int, int, int], bool], ranges: list[Range]) -> tuple[int, list[Range]]:
    """Common prefix of a `length`-item sequence and the one `ranges` spell in a log, and those ranges cut to it.

    `same(i, j, n)` compares items [i, i+n) of the sequence with log items [j, j+n). Whole
    ranges compare at once; only a mismatching range is bisected, so the cost is about two
    passes over the prefix.
    """
    off = 0
    out: list[Range] = []
    for start, stop in ranges:
        n = min(stop - start, length - off)
        if n <= 0:
            break
        if same(off, start, n):
            out.append((start, start + n))
            off += n
            if n < stop - start:
                break
            continue
        lo, hi = 0, n  # items [off, off+lo) match, [off, off+hi) do not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if same(off + lo, start + lo, mid - lo):
                lo = mid
            else:
                hi = mid
        if lo:
            out.append((start, start + lo))
            off += lo
        break
    return off, out


def _span(ranges: list[Range], lo: int, hi: int) -> list[Range]:
    """Items [lo, hi) of the sequence that `ranges` spell, as log ranges (`hi` <= their length)."""
    out: list[Range] = []
    for start, stop in ranges:
        if hi <= 0:
            break
        n = stop - start
        if lo < n:
            out.append((start + max(lo, 0), start + min(n, hi)))
        lo -= n
        hi -= n
    return out


def _cut(ranges: list[Range], n: int) -> list[Range]:
    """The first `n` items that `ranges` spell, as a new list of ranges (`n` <= their length)."""
    out: list[Range] = []
    for start, stop in ranges:
        if n <= 0:
            break
        k = min(stop - start, n)
        out.append((start, start + k))
        n -= k
    return out


def _extend(ranges: list[Range], start: int, stop: int) -> list[Range]:
    """`ranges` plus the log items just appended at [start, stop), merged when contiguous."""
    if stop == start:
        return ranges
    if ranges and ranges[-1][1] == start:  # the base turn ended at the log's end: a plain extension
        ranges[-1] = (ranges[-1][0], stop)
    else:
        ranges.append((start, stop))
    return ranges


def _message_bytes(message: dict[str, Any]) -> int:
    """Rough size of a message for the bytes_held gauge: its text plus a fixed overhead (cheap on the hot path)."""
    size = _MESSAGE_OVERHEAD
    for key in ("content", "reasoning"):
        text = message.get(key)
        if type(text) is str:
            size += len(text)
    calls = message.get("tool_calls")
    if type(calls) is list:
        size += _MESSAGE_OVERHEAD * len(calls)
    return size
