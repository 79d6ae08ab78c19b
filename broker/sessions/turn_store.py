"""TurnStore: one session's committed turns, stored deduplicated, materialized only at finish.

A turn's tokens (prompt + output) and messages (prompt + response) are kept as ranges
into append-only per-session logs (`session_logs`: int32 ids; messages as their msgpack bytes,
never decoded on the commit path), sharing the longest common prefix with a neighbouring turn, so
a session costs about its unique tokens. A delta commit (one naming its base turn) is stored
without any comparison: the base's ranges cut to the shared length, plus the new tail appended.
Output logprobs go to a third log. Older log bytes can be compressed in the broker's idle time
(`start_compaction`). A turn is a row of ints in one array per session, its ranges in another:
no Python object per turn but its id. Pure data structure: no sockets, no clocks, no lifecycle
rules (`registry.py` owns those). Imports only the stdlib and `broker`.
"""

from __future__ import annotations

import struct
import zlib
from array import array
from typing import Any, Final

from broker import protocol
from broker.sessions.logs.append_logs import ItemLog, MessageLog
from broker.sessions.logs.cold_log import MIN_CHUNK, PendingChunk
from broker.sessions.logs.ranges import common_prefix, cut, extend, span
from broker.sessions.open_order import OpenOrder
from broker.sessions.turn_record import TurnRecord

_ID_BYTES = 4  # int32 token ids
_LP_BYTES = 4  # float32 logprobs
# A turn's id, its dict slot and its share of the arrays' spare room: for the bytes_held gauge.
_TURN_OVERHEAD = 120
_MESSAGE_OVERHEAD = 8  # its list slot (hot) or end offset (cold)

# A stored turn is row i (its arrival index; `_index` maps turn id -> i) of `_rec`, _FIELDS ints:
# OPEN seq, prompt length, output length, prompt message count, where its ranges start in
# `_ranges` (token ranges, then message ranges: flat (start, stop, ...) in ids and in messages) and
# how many ints each takes, the (CRC-32, length) of a
# checked prefix of its context (a delta's prefix, or the whole context once a delta used the turn
# as its base: the next delta reads only ids past it), and its finish reason (index in `_reasons`).
# Packed, a turn costs ~120 bytes plus its ranges; as a tuple of objects it cost ~800.
_SEQ: Final = 0
_PLEN: Final = 1
_NOUT: Final = 2
_NPM: Final = 3
_RANGES: Final = 4
_NTOKS: Final = 5
_NMSGS: Final = 6
_CRC: Final = 7
_CRC_LEN: Final = 8
_FINISH: Final = 9
_FIELDS: Final = 10
# Rows are packed with struct (one C call a row) rather than stored item by item in an array('q'),
# whose every item store parses its argument (costly on the commit path: docs/performance.md).
_ROW = struct.Struct(f"={_FIELDS}q")
_CRC_FIELDS = struct.Struct("=2q")  # _CRC and _CRC_LEN, rewritten in place
_CRC_AT: Final = 8 * _CRC
Ranges = tuple[int, ...]
_NO_RANGES: Ranges = ()
# compaction limited only by the previous commit's mark
_NO_LIMIT: tuple[int, int, int] = (1 << 62, 1 << 62, 1 << 62)


class TurnStore:
    """The committed turns of one session, keyed by turn id and ordered by OPEN sequence."""

    __slots__ = (
        "ids", "msgs", "lps", "_index", "_rec", "_ranges", "_open", "_reasons", "_flags", "_mark",
        "_prev_mark",
    )  # fmt: skip

    def __init__(self) -> None:
        self.ids = ItemLog(_ID_BYTES)  # the token log: native int32 ids
        self.msgs = MessageLog()  # every distinct message's msgpack bytes, once
        # Every turn's output logprobs (native float32), in arrival order; never read before finish.
        self.lps = ItemLog(_LP_BYTES)  # shuffled too: sign and exponent bytes repeat
        self._index: dict[str, int] = {}  # turn id -> row, in arrival order
        self._rec = bytearray()  # the rows (`_ROW`)
        self._ranges = array("q")
        self._open = OpenOrder()  # rows by OPEN seq
        self._reasons: list[str] = []  # distinct finish reasons
        self._flags: dict[int, dict[str, Any]] = {}  # row -> flags, when there are any
        # (token log byte, message index) positions where the last and the previous commit began appending:
        # the next delta reads what the last one added, so only bytes before `_prev_mark` are compressed.
        self._mark = self._prev_mark = (0, 0)

    def __contains__(self, turn_id: object) -> bool:
        return turn_id in self._index

    def __len__(self) -> int:
        return len(self._index)

    @property
    def tokens_held(self) -> int:
        return self.ids.size // _ID_BYTES

    @property
    def raw_bytes(self) -> int:
        """Token log and message bytes as if none were compressed (what compaction policy weighs)."""
        return self.ids.size + self.msgs.raw_bytes

    def bytes_held(self) -> int:
        """Approximate payload bytes: the logs (compressed parts as compressed) and the turns' rows and ranges."""
        return (
            self.ids.stored + self.lps.stored + self.msgs.stored + _MESSAGE_OVERHEAD * self.msgs.held
            + len(self._rec) + 8 * len(self._ranges) + _TURN_OVERHEAD * len(self._index)
        )  # fmt: skip

    def _row(self, row: int) -> tuple[int, ...]:
        return _ROW.unpack_from(self._rec, row * _ROW.size)

    def _tok_ranges(self, rec: tuple[int, ...]) -> array:
        """The token ranges of the turn whose row is `rec` (`_row`)."""
        start = rec[_RANGES]
        return self._ranges[start : start + rec[_NTOKS]]

    def _msg_ranges(self, rec: tuple[int, ...]) -> array:
        """The message ranges of the turn whose row is `rec` (`_row`)."""
        start = rec[_RANGES] + rec[_NTOKS]
        return self._ranges[start : start + rec[_NMSGS]]

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
        row = self._index.get(base_id)
        if row is None:
            return f"no committed turn {base_id!r} to extend"
        rec = _ROW.unpack_from(self._rec, row * _ROW.size)
        n, n_base = msg.base_tokens, rec[_PLEN] + rec[_NOUT]
        if n > n_base:
            return f"base turn {base_id!r} has {n_base} tokens, not {n}"
        n_msgs, n_base_msgs = msg.base_messages, rec[_NPM] + 1
        if n_msgs > n_base_msgs:
            return f"base turn {base_id!r} has {n_base_msgs} messages, not {n_msgs}"
        crc, crc_len = rec[_CRC], rec[_CRC_LEN]
        if n != crc_len:
            crc = self._prefix_crc(row, rec, n, crc, crc_len)
        if crc != msg.base_crc32:
            return f"the first {n} tokens of base turn {base_id!r} are not the ones claimed"

        ids, msgs = self.ids, self.msgs
        log = ids.tail()
        cold = ids.cold.size
        start = cold + len(log)
        first = msgs.held
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
        start //= _ID_BYTES
        stop //= _ID_BYTES
        msgs.add(messages)
        last = first + len(messages)

        flat = self._ranges
        ranges_at = len(flat)
        base_at, base_toks, base_msgs = rec[_RANGES], rec[_NTOKS], rec[_NMSGS]
        tok_end, msg_end = base_at + base_toks - 1, base_at + base_toks + base_msgs - 1
        if (
            n == n_base and n_msgs == n_base_msgs and base_toks and flat[tok_end] == start and base_msgs
            and flat[msg_end] == first
        ):  # fmt: skip
            # The usual delta: the base (the latest turn) ends where the logs end, and this turn extends it.
            flat += flat[base_at : msg_end + 1]
            flat[ranges_at + base_toks - 1] = stop
            flat[-1] = last
            n_toks = base_toks
        else:
            flat.extend(extend(cut(flat[base_at : base_at + base_toks], n), start, stop))
            n_toks = len(flat) - ranges_at
            flat.extend(extend(cut(flat[base_at + base_toks : msg_end + 1], n_msgs), first, last))

        # the checked prefix (crc, n): the next delta of this turn reads only what follows
        self._keep(msg, seq, prompt_len, n_msgs + len(messages) - 1, ranges_at, n_toks, crc, n)
        return None

    def _prefix_crc(self, row: int, rec: tuple[int, ...], n: int, crc: int, crc_len: int) -> int:
        """CRC-32 of the first `n` ids of turn `row`'s (fields `rec`) context, resumed from its known prefix CRC."""
        if n < crc_len:
            crc, crc_len = 0, 0
        ranges, first, end = self._ranges, rec[_RANGES], rec[_RANGES] + rec[_NTOKS]
        n_ctx = rec[_PLEN] + rec[_NOUT]
        if end > first and ranges[end - 1] - ranges[end - 2] >= n_ctx - crc_len:  # the usual case: in its last run
            last = ranges[end - 1]  # context item i is log id last - n_ctx + i
            crc = zlib.crc32(self._read_ids(last - n_ctx + crc_len, last - n_ctx + n), crc)
        else:
            for start, stop in span(ranges[first:end], crc_len, n):
                crc = zlib.crc32(self._read_ids(start, stop), crc)
        if n == n_ctx:  # the usual base: the whole context, which later deltas extend
            _CRC_FIELDS.pack_into(self._rec, row * _ROW.size + _CRC_AT, crc, n)
        return crc

    def add_full(self, msg: protocol.CommitTurn, seq: int, messages: list[bytes]) -> None:
        """Store a full commit (the caller checked it is new and well-formed) as the turn with OPEN sequence `seq`.

        It shares the longest prefix of ids and of messages with a likely base turn (found by comparing).
        """
        self._prev_mark, self._mark = self._mark, (self.ids.size, self.msgs.held)
        with memoryview(msg.prompt_ids) as p, memoryview(msg.output_ids) as o, p.cast("B") as pb, o.cast("B") as ob:
            tok_ranges, base = self._add_ids(pb, ob, seq)
        shared, msg_ranges = 0, _NO_RANGES
        if base is not None:

            def same_msgs(i: int, j: int, n: int) -> bool:
                return messages[i : i + n] == [self.msgs.read(k, k + 1) for k in range(j, j + n)]

            shared, msg_ranges = common_prefix(len(messages), same_msgs, self._msg_ranges(self._row(base)))
        first = self.msgs.held
        self.msgs.add(messages[shared:])
        msg_ranges = extend(msg_ranges, first, self.msgs.held)
        flat = self._ranges
        ranges_at = len(flat)
        flat.extend(tok_ranges)
        flat.extend(msg_ranges)
        self._keep(msg, seq, len(msg.prompt_ids), len(messages) - 1, ranges_at, len(tok_ranges), 0, 0)

    def _keep(
        self, msg: protocol.CommitTurn, seq: int, prompt_len: int, n_prompt_msgs: int, ranges_at: int, n_toks: int,
        crc: int, crc_len: int,
    ) -> None:  # fmt: skip
        """Add the turn's row; its ranges are `_ranges[ranges_at:]`, the first `n_toks` ints its tokens'."""
        index = self._index
        row = len(index)
        index[msg.turn_id] = row
        lps = self.lps.tail()
        lps += msg.logprobs  # native float32 bytes; a turn's place follows from the output lengths before it
        reason, reasons = msg.finish_reason, self._reasons
        try:
            code = reasons.index(reason)
        except ValueError:  # a session sees a few distinct reasons
            code = len(reasons)
            reasons.append(reason)
        if msg.flags:
            self._flags[row] = msg.flags
        n_out = len(msg.output_ids)
        n_msgs = len(self._ranges) - ranges_at - n_toks
        self._rec += _ROW.pack(seq, prompt_len, n_out, n_prompt_msgs, ranges_at, n_toks, n_msgs, crc, crc_len, code)
        self._open.add(seq, row)

    def _add_ids(self, pb: memoryview, ob: memoryview, seq: int) -> tuple[Ranges, int | None]:
        """Store prompt + output ids (as byte views) sharing the longest prefix with a likely base turn (its row)."""
        n_prompt = len(pb) // _ID_BYTES
        n_ctx = n_prompt + len(ob) // _ID_BYTES
        ids = self.ids

        def same(i: int, j: int, n: int) -> bool:
            # ids [i, i+n) of prompt + output against log ids [j, j+n), without building prompt + output
            at = j * _ID_BYTES
            if i + n <= n_prompt:
                return ids.startswith(pb[i * _ID_BYTES : (i + n) * _ID_BYTES], at)
            if i >= n_prompt:
                k = i - n_prompt
                return ids.startswith(ob[k * _ID_BYTES : (k + n) * _ID_BYTES], at)
            head = n_prompt - i
            return ids.startswith(pb[i * _ID_BYTES :], at) and ids.startswith(
                ob[: (n - head) * _ID_BYTES], at + head * _ID_BYTES
            )

        candidates = self._open.likely_bases(seq, len(self._index) - 1)
        best_len, best_ranges, base = 0, _NO_RANGES, None
        for cand in candidates:
            n, ranges = common_prefix(n_ctx, same, self._tok_ranges(self._row(cand)))
            if n > best_len or base is None:
                best_len, best_ranges, base = n, ranges, cand
            if n == n_ctx:
                break
        log = ids.tail()
        start = self.tokens_held
        if best_len < n_prompt:
            log += pb[best_len * _ID_BYTES :]
            log += ob
        else:
            log += ob[(best_len - n_prompt) * _ID_BYTES :]
        return extend(best_ranges, start, self.tokens_held), base

    # --- reading -----------------------------------------------------------------------------

    def _read_ids(self, start: int, stop: int) -> bytes | bytearray | memoryview:
        """Token log ids [start, stop) as int32 bytes."""
        return self.ids.read(start * _ID_BYTES, stop * _ID_BYTES)

    def _messages(self, ranges: array, decoded: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """The messages `ranges` spell, decoded (from `decoded`, the whole log decoded, when given)."""
        out: list[dict[str, Any]] = []
        for i in range(0, len(ranges), 2):
            start, stop = ranges[i], ranges[i + 1]
            if decoded is not None:
                out += decoded[start:stop]
            else:
                out += protocol.unpack_messages(self.msgs.read(start, stop))
        return out

    def turn_messages(self, turn_id: str) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        """A committed turn's prompt messages and response message; None if it is not stored."""
        row = self._index.get(turn_id)
        if row is None:
            return None
        rec = self._row(row)
        msgs = self._messages(self._msg_ranges(rec))
        npm = rec[_NPM]
        return msgs[:npm], msgs[npm]

    def record(self, turn_id: str) -> TurnRecord | None:
        """One stored turn, materialized (a retried request's reply); None if it is not stored."""
        row = self._index.get(turn_id)
        if row is None:
            return None
        rec = self._row(row)
        ctx = protocol.ids_array()
        ranges = self._tok_ranges(rec)
        for i in range(0, len(ranges), 2):
            ctx.frombytes(self._read_ids(ranges[i], ranges[i + 1]))
        lp_at = sum(self._row(r)[_NOUT] for r in range(row))  # logprobs are logged in row order
        lp = protocol.logprobs_array()
        lp.frombytes(self.lps.read(lp_at * _LP_BYTES, (lp_at + rec[_NOUT]) * _LP_BYTES))
        msgs = self._messages(self._msg_ranges(rec))
        plen, npm = rec[_PLEN], rec[_NPM]
        seq = self._open.seq_of(row)
        return TurnRecord(turn_id, seq, ctx[:plen], ctx[plen:], lp, self._reasons[rec[_FINISH]], msgs[:npm], msgs[npm],
                          self._flags.get(row, {}))

    def records(self) -> list[TurnRecord]:
        """Every stored turn, materialized, in OPEN sequence order. Message dicts are shared: read-only."""
        tokens = self.ids.read_all()
        logprobs = self.lps.read_all()
        messages = protocol.unpack_messages(self.msgs.read_all())
        ids = list(self._index)  # in row order
        rows = [_ROW.unpack_from(self._rec, at) for at in range(0, len(self._rec), _ROW.size)]
        lp_starts, lp_at = [], 0  # logprobs are logged in row order
        for rec in rows:
            lp_starts.append(lp_at)
            lp_at += rec[_NOUT]
        reasons, flags = self._reasons, self._flags
        out = []
        with memoryview(tokens) as log, memoryview(logprobs) as lp_log:
            for seq, row in self._open:
                rec = rows[row]
                ctx = protocol.ids_array()
                ranges = self._tok_ranges(rec)
                for i in range(0, len(ranges), 2):
                    ctx.frombytes(log[ranges[i] * _ID_BYTES : ranges[i + 1] * _ID_BYTES])
                plen, npm = rec[_PLEN], rec[_NPM]
                lp = protocol.logprobs_array()
                lp_at = lp_starts[row]
                lp.frombytes(lp_log[lp_at * _LP_BYTES : (lp_at + rec[_NOUT]) * _LP_BYTES])
                msgs = self._messages(self._msg_ranges(rec), messages)
                out.append(
                    TurnRecord(
                        turn_id=ids[row],
                        seq=seq,
                        prompt_ids=ctx[:plen],
                        output_ids=ctx[plen:],
                        logprobs=lp,
                        finish_reason=reasons[rec[_FINISH]],
                        prompt_messages=msgs[:npm],
                        response_message=msgs[npm],
                        flags=flags.get(row, {}),
                    )
                )
        return out

    # --- images (a durable broker's snapshots) ------------------------------------------------

    def image(self) -> list[Any]:
        """Everything `from_image` needs to rebuild this store exactly: logs, rows, ranges, order.

        Buffers are shared with the store, not copied, so the caller packs the image before the
        store changes again; arrays are native byte order (a snapshot names its machine's).
        """
        return [
            self.ids.image(), self.msgs.image(), self.lps.image(), list(self._index), self._rec,
            self._ranges.tobytes(), self._open.seqs, self._open.rows, self._reasons, self._flags,
            list(self._mark), list(self._prev_mark),
        ]  # fmt: skip

    @classmethod
    def from_image(cls, image: list[Any]) -> TurnStore:
        ids, msgs, lps, turn_ids, rec, ranges, seqs, order, reasons, flags, mark, prev_mark = image
        store = cls()
        store.ids = ItemLog.from_image(ids)
        store.msgs = MessageLog.from_image(msgs)
        store.lps = ItemLog.from_image(lps)
        store._index = {turn_id: row for row, turn_id in enumerate(turn_ids)}
        store._rec = bytearray(rec)
        store._ranges.frombytes(ranges)
        store._open, store._reasons = OpenOrder(list(seqs), list(order)), list(reasons)
        store._flags = dict(flags)
        store._mark, store._prev_mark = (mark[0], mark[1]), (prev_mark[0], prev_mark[1])
        if len(store._rec) != len(store._index) * _ROW.size or len(store._open.seqs) != len(store._index):
            raise ValueError(f"a turn store image of {len(store._index)} turns holds {len(store._rec)} row bytes")
        return store

    # --- idle time ---------------------------------------------------------------------------

    @property
    def log_ends(self) -> tuple[int, int, int]:
        """(token log bytes, messages, logprob log bytes) held: a later `start_compaction`'s `limit` may name it."""
        return self.ids.size, self.msgs.held, self.lps.size

    def _due(self, limit: tuple[int, int, int], idle: bool) -> tuple[int, list[bytes | memoryview], int]:
        """Hot token log bytes, hot messages and hot logprob bytes that may be compressed: those before `limit`.

        Unless the session is `idle`, ids and messages only before the previous commit's appends too: the
        next delta reads its base's newest ids for its prefix check (anything else read later, a full
        commit's comparison, GET or finish, decompresses what it needs; so does a delta after an idle
        spell). Logprobs are read only at finish.
        """
        tok_end, msg_end = limit[0], limit[1]
        if not idle:
            tok_end, msg_end = min(tok_end, self._prev_mark[0]), min(msg_end, self._prev_mark[1])
        lp_due = min(limit[2] - self.lps.cold.size, len(self.lps.hot))
        return tok_end - self.ids.cold.size, self.msgs.due(msg_end), lp_due

    def start_compaction(
        self, chunk_bytes: int, limit: tuple[int, int, int] = _NO_LIMIT, idle: bool = False
    ) -> PendingChunk | None:
        """The next chunk (about `chunk_bytes` raw) of the oldest due hot bytes, to compress a slice per step.

        None when less than `MIN_CHUNK` is due, or nothing at all when `idle` (the session has had no
        commit for a while: its tail goes too, in a smaller chunk). Until its last step the chunk's bytes
        stay hot, so reads and commits meanwhile see the store as it was; the caller runs one at a time
        per store.
        """
        due_tok, due_msgs, due_lps = self._due(limit, idle)
        least = 1 if idle else MIN_CHUNK
        for due, log in ((due_tok, self.ids), (due_lps, self.lps)):
            if due >= least:
                return log.chunk(due, chunk_bytes)
        if sum(map(len, due_msgs)) < least:
            return None
        return self.msgs.chunk(due_msgs, chunk_bytes)

