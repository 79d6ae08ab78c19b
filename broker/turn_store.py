"""TurnStore: one session's committed turns, stored deduplicated, materialized only at finish.

A turn's tokens (prompt + output) and messages (prompt + response) are kept as ranges
into append-only per-session logs (int32 ids; messages as their msgpack bytes, never decoded
on the commit path), sharing the longest common prefix with a neighbouring turn, so a session
costs about its unique tokens. A delta commit (one naming its base turn) is stored without any
comparison: the base's ranges cut to the shared length, plus the new tail appended. Older log
bytes can be compressed in the broker's idle time (`start_compaction`, see `cold_log`). Turns are plain
tuples of ints, strs and tuples, which the garbage collector stops tracking. Pure data structure:
no sockets, no clocks, no lifecycle rules (`sessions.py` owns those). Imports only the stdlib and
`broker.protocol` / `broker.trajectory` / `broker.cold_log`.
"""

from __future__ import annotations

import zlib
from array import array
from bisect import bisect_left, insort
from collections.abc import Callable
from functools import partial
from typing import Any, Final

from broker import protocol
from broker.cold_log import MIN_CHUNK, ColdLog, PendingChunk
from broker.trajectory import TurnRecord

_ID_BYTES = 4  # int32 token ids
_LP_BYTES = 4  # float32 logprobs
_TURN_OVERHEAD = 320  # a turn's tuple, range tuples, id and dict slots: for the bytes_held gauge
_MESSAGE_OVERHEAD = 8  # its list slot (hot) or end offset (cold)

# A stored turn is a tuple (built in one step, untracked by the collector once it has seen it):
# id, OPEN seq, token ranges (flat (start, stop, ...) in ids), prompt length, output logprobs (the
# commit's own float32 array: keeping it copies nothing), output length, finish reason, message
# ranges (flat, in messages), prompt message count, flags, context length (prompt + output ids).
# (Final literals: mypy types each field of the tuple by its index.)
_SEQ: Final = 1
_TOKS: Final = 2
_PLEN: Final = 3
_LPS: Final = 4
_NOUT: Final = 5
_FINISH: Final = 6
_MSGS: Final = 7
_NPM: Final = 8
_FLAGS: Final = 9
_NTOK: Final = 10
Ranges = tuple[int, ...]
_NO_RANGES: Ranges = ()
_NO_LIMIT = (1 << 62, 1 << 62)  # compaction limited only by the previous commit's mark
Turn = tuple[str, int, Ranges, int, array, int, str, Ranges, int, dict[str, Any], int]


class TurnStore:
    """The committed turns of one session, keyed by turn id and ordered by OPEN sequence."""

    __slots__ = (
        "tokens", "_tok_cold", "msgs", "_msg_cold", "_cold_ends", "logprob_bytes", "_turns", "_crc",
        "_by_seq", "_seqs", "_last", "_mark", "_prev_mark", "msg_bytes",
    )  # fmt: skip

    def __init__(self) -> None:
        # The token log's hot (uncompressed) tail as native int32 bytes: a bytearray, because
        # `bytearray.startswith(buffer, offset)` compares against it in place. Ids before
        # `_tok_cold.size` bytes are compressed (`start_compaction`).
        self.tokens = bytearray()
        self._tok_cold = ColdLog(_ID_BYTES)  # byte-shuffled: ids' high bytes compress far better than their low ones
        # Every distinct message's msgpack bytes, once: the first `len(_cold_ends)` compressed back to
        # back in `_msg_cold` (each one's end offset in `_cold_ends`), the rest in `msgs` (a list:
        # appending never copies what is already held, as a growing bytearray's reallocations do).
        self.msgs: list[bytes] = []
        self._msg_cold = ColdLog()
        self._cold_ends = array("q")
        self.msg_bytes = 0  # raw (uncompressed) bytes of every distinct message held
        self.logprob_bytes = 0
        self._turns: dict[str, Turn] = {}
        # turn id -> (CRC-32, length) of a checked prefix of its context (a delta's prefix, or the whole
        # context once a delta used the turn as its base): the next delta reads only ids past it.
        self._crc: dict[str, tuple[int, int]] = {}
        self._by_seq: dict[int, Turn] = {}
        self._seqs: list[int] = []  # sorted
        self._last: Turn | None = None  # most recent by arrival
        # (token log byte, message index) positions where the last and the previous commit began appending:
        # the next delta reads what the last one added, so only bytes before `_prev_mark` are compressed.
        self._mark = self._prev_mark = (0, 0)

    def __contains__(self, turn_id: object) -> bool:
        return turn_id in self._turns

    def __len__(self) -> int:
        return len(self._turns)

    @property
    def tokens_held(self) -> int:
        return (self._tok_cold.size + len(self.tokens)) // _ID_BYTES

    @property
    def raw_bytes(self) -> int:
        """Token log and message bytes as if none were compressed (what compaction policy weighs)."""
        return self._tok_cold.size + len(self.tokens) + self.msg_bytes

    @property
    def messages_held(self) -> int:
        """Distinct messages stored (each once, however many turns share it)."""
        return len(self._cold_ends) + len(self.msgs)

    def bytes_held(self) -> int:
        """Approximate payload bytes: token log, logprobs and messages (compressed parts as compressed)."""
        return (
            len(self.tokens) + self._tok_cold.stored + self.logprob_bytes + sum(map(len, self.msgs))
            + self._msg_cold.stored + _MESSAGE_OVERHEAD * self.messages_held + _TURN_OVERHEAD * len(self._turns)
        )  # fmt: skip

    # --- commit path ---------------------------------------------------------------------

    def add_delta(self, msg: protocol.CommitTurn, seq: int, messages: list[bytes]) -> str | None:
        """Store a delta commit as the turn with OPEN sequence `seq`, or say why its base cannot be used.

        `messages`: its prompt messages then its response, packed (`packed_messages`). The caller
        checked the commit is new and its numbers add up (`sessions._check_delta_shape`). Returns
        None once stored; else the problem (base not held, shorter than claimed, another prefix) and
        nothing is stored. The shared prefix is checked by its CRC-32, not id by id, and the base's
        own checked prefix is not read again (a delta of a delta reads only its base's tail). The
        turn is its base's ranges cut to the shared length plus the tail appended: no comparison.
        """
        base_id = msg.base_turn_id
        base = self._turns.get(base_id)
        if base is None:
            return f"no committed turn {base_id!r} to extend"
        n, n_base = msg.base_tokens, base[_NTOK]
        if n > n_base:
            return f"base turn {base_id!r} has {n_base} tokens, not {n}"
        n_msgs, n_base_msgs = msg.base_messages, base[_NPM] + 1
        if n_msgs > n_base_msgs:
            return f"base turn {base_id!r} has {n_base_msgs} messages, not {n_msgs}"
        crc, crc_len = self._crc.get(base_id, (0, 0))
        if n != crc_len:
            crc = self._prefix_crc(base, n, crc, crc_len)
        if crc != msg.base_crc32:
            return f"the first {n} tokens of base turn {base_id!r} are not the ones claimed"

        log = self.tokens
        cold = self._tok_cold.size
        start = cold + len(log)
        hot = self.msgs
        first = len(self._cold_ends) + len(hot)
        self._prev_mark, self._mark = self._mark, (start, first)
        log += msg.prompt_ids  # native int32 bytes, appended straight from the array's buffer
        prompt_len = msg.prompt_len
        output = msg.output_ids
        if n <= prompt_len:
            log += output
        else:  # the shared prefix reaches into the output (a regenerated turn): skip that much of it
            with memoryview(output) as o, o.cast("B") as ob:
                log += ob[(n - prompt_len) * _ID_BYTES :]
        stop = cold + len(log)
        ranges = base[_TOKS] if n == n_base else _cut(base[_TOKS], n)
        if stop > start:
            start //= _ID_BYTES
            stop //= _ID_BYTES
            ranges = ranges[:-1] + (stop,) if ranges and ranges[-1] == start else ranges + (start, stop)

        hot += messages
        self.msg_bytes += sum(map(len, messages))
        last = first + len(messages)
        msg_ranges = base[_MSGS] if n_msgs == n_base_msgs else _cut(base[_MSGS], n_msgs)
        if msg_ranges and msg_ranges[-1] == first:  # the base's messages end where this turn's begin
            msg_ranges = msg_ranges[:-1] + (last,)
        else:
            msg_ranges += (first, last)

        n_out = len(output)
        self.logprob_bytes += n_out * _LP_BYTES
        self._crc[msg.turn_id] = (crc, n)  # the checked prefix: the next delta of this turn reads only what follows
        self._keep(
            (msg.turn_id, seq, ranges, prompt_len, msg.logprobs, n_out, msg.finish_reason, msg_ranges,
             n_msgs + len(messages) - 1, msg.flags, prompt_len + n_out)  # fmt: skip
        )
        return None

    def _prefix_crc(self, base: Turn, n: int, crc: int, crc_len: int) -> int:
        """CRC-32 of the first `n` ids of `base`'s context, resumed from its known prefix CRC where that helps."""
        if n < crc_len:
            crc, crc_len = 0, 0
        for start, stop in _span(base[_TOKS], crc_len, n):
            crc = zlib.crc32(self._read_ids(start, stop), crc)
        if n == base[_NTOK]:  # the usual base: the whole context, which later deltas of it extend too
            self._crc[base[0]] = (crc, n)
        return crc

    def add_full(self, msg: protocol.CommitTurn, seq: int, messages: list[bytes]) -> None:
        """Store a full commit (the caller checked it is new and well-formed) as the turn with OPEN sequence `seq`.

        It shares the longest prefix of ids and of messages with a likely base turn (found by comparing).
        """
        self._prev_mark, self._mark = self._mark, (
            self._tok_cold.size + len(self.tokens), self.messages_held
        )  # fmt: skip
        with memoryview(msg.prompt_ids) as p, memoryview(msg.output_ids) as o, p.cast("B") as pb, o.cast("B") as ob:
            tok_ranges, base = self._add_ids(pb, ob, seq)
        shared, msg_ranges = 0, _NO_RANGES
        if base is not None:

            def same_msgs(i: int, j: int, n: int) -> bool:
                return messages[i : i + n] == [self._message_bytes(k) for k in range(j, j + n)]

            shared, msg_ranges = _common_prefix(len(messages), same_msgs, base[_MSGS])
        first = self.messages_held
        self.msgs += messages[shared:]
        self.msg_bytes += sum(map(len, messages[shared:]))
        msg_ranges = _extend(msg_ranges, first, self.messages_held)
        prompt_len, n_out = len(msg.prompt_ids), len(msg.output_ids)
        self.logprob_bytes += n_out * _LP_BYTES
        self._keep(
            (msg.turn_id, seq, tok_ranges, prompt_len, msg.logprobs, n_out, msg.finish_reason, msg_ranges,
             len(messages) - 1, msg.flags, prompt_len + n_out)  # fmt: skip
        )

    def _keep(self, turn: Turn) -> None:
        self._turns[turn[0]] = turn
        seq = turn[_SEQ]
        self._by_seq[seq] = turn
        seqs = self._seqs
        if not seqs or seqs[-1] < seq:  # in-order arrival, the common case
            seqs.append(seq)
        else:
            insort(seqs, seq)
        self._last = turn

    def _add_ids(self, pb: memoryview, ob: memoryview, seq: int) -> tuple[tuple[int, ...], Turn | None]:
        """Store prompt + output ids (as byte views) sharing the longest prefix with a likely base turn."""
        n_prompt = len(pb) // _ID_BYTES
        n_ctx = n_prompt + len(ob) // _ID_BYTES
        startswith = self._startswith

        def same(i: int, j: int, n: int) -> bool:
            # ids [i, i+n) of prompt + output against log ids [j, j+n), without building prompt + output
            if i + n <= n_prompt:
                return startswith(pb[i * _ID_BYTES : (i + n) * _ID_BYTES], j)
            if i >= n_prompt:
                k = i - n_prompt
                return startswith(ob[k * _ID_BYTES : (k + n) * _ID_BYTES], j)
            head = n_prompt - i
            return startswith(pb[i * _ID_BYTES :], j) and startswith(ob[: (n - head) * _ID_BYTES], j + head)

        # Candidates that most likely share a prefix: the neighbours by OPEN order (the usual
        # case: the next prompt extends the previous turn) and the latest arrival.
        seqs, last = self._seqs, self._last
        if not seqs or seqs[-1] < seq:  # in-order arrival, the common case: no search
            candidates = [] if last is None else [last] if last[_SEQ] == seqs[-1] else [self._by_seq[seqs[-1]], last]
        else:
            pos = bisect_left(seqs, seq)
            candidates = [self._by_seq[seqs[i]] for i in (pos - 1, pos) if 0 <= i < len(seqs)]
            if last is not None and all(c is not last for c in candidates):
                candidates.append(last)
        best_len, best_ranges, base = 0, _NO_RANGES, None
        for cand in candidates:
            n, ranges = _common_prefix(n_ctx, same, cand[_TOKS])
            if n > best_len or base is None:
                best_len, best_ranges, base = n, ranges, cand
            if n == n_ctx:
                break
        log = self.tokens
        start = self.tokens_held
        if best_len < n_prompt:
            log += pb[best_len * _ID_BYTES :]
            log += ob
        else:
            log += ob[(best_len - n_prompt) * _ID_BYTES :]
        return _extend(best_ranges, start, self.tokens_held), base

    # --- reading -----------------------------------------------------------------------------

    def _startswith(self, buf: memoryview, j: int) -> bool:
        """Whether the token log holds the bytes `buf` from id `j` on."""
        pos = j * _ID_BYTES - self._tok_cold.size
        if pos >= 0:
            return self.tokens.startswith(buf, pos)
        return self._read_ids(j, j + len(buf) // _ID_BYTES) == buf

    def _read_ids(self, start: int, stop: int) -> bytes | bytearray:
        """Token log ids [start, stop) as int32 bytes (cold parts decompressed)."""
        cold = self._tok_cold
        lo, hi = start * _ID_BYTES - cold.size, stop * _ID_BYTES - cold.size
        if lo >= 0:
            return self.tokens[lo:hi]
        return cold.read(start * _ID_BYTES, min(stop * _ID_BYTES, cold.size)) + self.tokens[: max(hi, 0)]

    def _read_msgs(self, start: int, stop: int) -> bytes:
        """Messages [start, stop) packed back to back (cold ones decompressed)."""
        ends = self._cold_ends
        n_cold = len(ends)
        parts = []
        if start < n_cold:
            parts.append(self._msg_cold.read(ends[start - 1] if start else 0, ends[min(stop, n_cold) - 1]))
        if stop > n_cold:
            parts += self.msgs[max(start - n_cold, 0) : stop - n_cold]
        return b"".join(parts)

    def _message_bytes(self, k: int) -> bytes:
        return self._read_msgs(k, k + 1)

    def _messages(self, ranges: tuple[int, ...], decoded: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """The messages `ranges` spell, decoded (from `decoded`, the whole log decoded, when given)."""
        out: list[dict[str, Any]] = []
        for i in range(0, len(ranges), 2):
            start, stop = ranges[i], ranges[i + 1]
            if decoded is not None:
                out += decoded[start:stop]
            else:
                out += protocol.unpack_messages(self._read_msgs(start, stop))
        return out

    def turn_messages(self, turn_id: str) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        """A committed turn's prompt messages and response message; None if it is not stored."""
        turn = self._turns.get(turn_id)
        if turn is None:
            return None
        msgs = self._messages(turn[_MSGS])
        return msgs[: turn[_NPM]], msgs[turn[_NPM]]

    def records(self) -> list[TurnRecord]:
        """Every stored turn, materialized, in OPEN sequence order. Message dicts are shared: read-only."""
        tokens = self._tok_cold.read_all() + self.tokens
        messages = protocol.unpack_messages(self._msg_cold.read_all() + b"".join(self.msgs))
        out = []
        with memoryview(tokens) as log:
            for seq in self._seqs:
                turn = self._by_seq[seq]
                ctx = protocol.ids_array()
                ranges = turn[_TOKS]
                for i in range(0, len(ranges), 2):
                    ctx.frombytes(log[ranges[i] * _ID_BYTES : ranges[i + 1] * _ID_BYTES])
                plen, npm = turn[_PLEN], turn[_NPM]
                msgs = self._messages(turn[_MSGS], messages)
                out.append(
                    TurnRecord(
                        turn_id=turn[0],
                        seq=seq,
                        prompt_ids=ctx[:plen],
                        output_ids=ctx[plen:],
                        logprobs=turn[_LPS],
                        finish_reason=turn[_FINISH],
                        prompt_messages=msgs[:npm],
                        response_message=msgs[npm],
                        flags=turn[_FLAGS],
                    )
                )
        return out

    # --- idle time ---------------------------------------------------------------------------

    @property
    def log_ends(self) -> tuple[int, int]:
        """(token log bytes, messages) held: a position that `start_compaction`'s `limit` may name later."""
        return self._tok_cold.size + len(self.tokens), self.messages_held

    def _due(self, limit: tuple[int, int]) -> tuple[int, list[bytes]]:
        """Hot token log bytes and hot messages that may be compressed: before `limit` and before
        the previous commit's appends (a delta reads its base's newest ids for its prefix check;
        anything else read later, a full commit's comparison, GET or finish, decompresses what it needs)."""
        tok_mark, msg_mark = self._prev_mark
        return (
            min(tok_mark, limit[0]) - self._tok_cold.size,
            self.msgs[: max(min(msg_mark, limit[1]) - len(self._cold_ends), 0)],
        )

    def compactable(self, limit: tuple[int, int] = _NO_LIMIT) -> bool:
        """Whether a chunk's worth is due before `limit` (`log_ends` of an earlier time)."""
        due_tok, due_msgs = self._due(limit)
        return due_tok >= MIN_CHUNK or sum(map(len, due_msgs)) >= MIN_CHUNK

    def start_compaction(self, chunk_bytes: int, limit: tuple[int, int] = _NO_LIMIT) -> PendingChunk | None:
        """The next chunk (about `chunk_bytes` raw) of the oldest due hot bytes, to compress a slice per step.

        None when less than `MIN_CHUNK` is due. Until its last step the chunk's bytes stay hot, so
        reads and commits meanwhile see the store as it was; the caller runs one at a time per store.
        """
        due_tok, due_msgs = self._due(limit)
        if due_tok >= MIN_CHUNK:
            n = min(due_tok, max(chunk_bytes - chunk_bytes % _ID_BYTES, _ID_BYTES))  # whole ids: chunks are shuffled
            return PendingChunk(
                bytes(self.tokens[:n]), partial(self._add_cold, self._tok_cold.size, 0), self._tok_cold.width
            )
        if sum(map(len, due_msgs)) < MIN_CHUNK:
            return None
        k = n = 0  # the oldest due messages, until chunk_bytes
        for m in due_msgs:
            if k and n + len(m) > 2 * chunk_bytes:
                break  # a huge next message starts its own chunk: joining it would copy it here
            k += 1
            n += len(m)
            if n >= chunk_bytes:
                break
        raw = due_msgs[0] if k == 1 else b"".join(due_msgs[:k])
        return PendingChunk(raw, partial(self._add_cold, self._msg_cold.size, k))

    def _add_cold(self, cold_size: int, n_msgs: int, raw_len: int, chunk: bytes) -> None:
        """A chunk's end: it goes cold and its bytes (token ids, or `n_msgs` messages) leave the hot part."""
        cold = self._msg_cold if n_msgs else self._tok_cold
        if cold.size != cold_size:  # another compaction of this store ran meanwhile: these bytes moved
            raise RuntimeError("overlapping compactions of one TurnStore")
        cold.add_chunk(raw_len, chunk)
        if not n_msgs:
            # In place: bytearray moves its start, and copies what remains into an exact-size buffer only
            # once that is under half its allocation; a copy per chunk would cost O(hot bytes) a step.
            del self.tokens[:raw_len]
            return
        hot, ends = self.msgs, self._cold_ends
        end = cold_size
        for m in hot[:n_msgs]:
            end += len(m)
            ends.append(end)
        self.msgs = hot[n_msgs:]


def packed_messages(prompt: list[Any], response: Any) -> list[bytes]:
    """A commit's prompt messages then its response as msgpack bytes; ValueError if one is no map."""
    out = [*prompt, response]
    for i, m in enumerate(out):
        if type(m) is not bytes:
            if type(m) is not dict:
                raise ValueError(f"message {i} is a {type(m).__name__}, not a map")
            out[i] = protocol.pack_message(m)  # an in-process caller or an older worker: dicts
        elif not protocol.is_packed_map(m):
            raise ValueError(f"message {i} is not a packed map")
    return out


def _common_prefix(
    length: int, same: Callable[[int, int, int], bool], ranges: tuple[int, ...]
) -> tuple[int, tuple[int, ...]]:
    """Common prefix of a `length`-item sequence and the one `ranges` spell in a log, and those ranges cut to it.

    `same(i, j, n)` compares items [i, i+n) of the sequence with log items [j, j+n). Whole
    ranges compare at once; only a mismatching range is bisected, so the cost is about two
    passes over the prefix.
    """
    off = 0
    out: list[int] = []
    for k in range(0, len(ranges), 2):
        start, stop = ranges[k], ranges[k + 1]
        n = min(stop - start, length - off)
        if n <= 0:
            break
        if same(off, start, n):
            out += (start, start + n)
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
            out += (start, start + lo)
            off += lo
        break
    return off, tuple(out)


def _span(ranges: tuple[int, ...], lo: int, hi: int) -> list[tuple[int, int]]:
    """Items [lo, hi) of the sequence that `ranges` spell, as log ranges (`hi` <= their length)."""
    out: list[tuple[int, int]] = []
    for k in range(0, len(ranges), 2):
        if hi <= 0:
            break
        start, stop = ranges[k], ranges[k + 1]
        n = stop - start
        if lo < n:
            out.append((start + max(lo, 0), start + min(n, hi)))
        lo -= n
        hi -= n
    return out


def _cut(ranges: tuple[int, ...], n: int) -> tuple[int, ...]:
    """The first `n` items that `ranges` spell, as ranges (`n` <= their length)."""
    out: list[int] = []
    for k in range(0, len(ranges), 2):
        if n <= 0:
            break
        start, stop = ranges[k], ranges[k + 1]
        m = min(stop - start, n)
        out += (start, start + m)
        n -= m
    return tuple(out)


def _extend(ranges: tuple[int, ...], start: int, stop: int) -> tuple[int, ...]:
    """`ranges` plus the log items just appended at [start, stop), merged when contiguous."""
    if stop == start:
        return ranges
    if ranges and ranges[-1] == start:  # the base ended at the log's end: a plain extension
        return ranges[:-1] + (stop,)
    return ranges + (start, stop)
