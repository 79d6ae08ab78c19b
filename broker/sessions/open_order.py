"""A session's stored turns in OPEN sequence order, and the turns a new commit most likely shares a prefix with.

Commits nearly always arrive in OPEN order, so a turn's row is appended; a late one is inserted by bisection.
`TurnStore` keeps one per session. Imports only the stdlib.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator


class OpenOrder:
    """Rows by OPEN seq: `seqs` sorted, `rows[i]` the store row of `seqs[i]` (lists: an array's item store parses
    its argument, several times the cost of a list append; and both are small ints, shared objects, in most
    sessions)."""

    __slots__ = ("seqs", "rows")

    def __init__(self, seqs: list[int] | None = None, rows: list[int] | None = None) -> None:
        self.seqs: list[int] = seqs if seqs is not None else []
        self.rows: list[int] = rows if rows is not None else []

    def __iter__(self) -> Iterator[tuple[int, int]]:
        """(seq, row) in OPEN order."""
        return zip(self.seqs, self.rows, strict=True)

    def add(self, seq: int, row: int) -> None:
        seqs = self.seqs
        if not seqs or seqs[-1] < seq:  # in-order arrival, the common case
            seqs.append(seq)
            self.rows.append(row)
        else:
            pos = bisect_left(seqs, seq)
            seqs.insert(pos, seq)
            self.rows.insert(pos, row)

    def likely_bases(self, seq: int, last: int) -> list[int]:
        """The rows a turn of OPEN `seq` most likely shares a prefix with: its neighbours by OPEN order (the usual
        case: the next prompt extends the previous turn) and the latest arrival, row `last` (-1: none)."""
        seqs, rows = self.seqs, self.rows
        if not seqs or seqs[-1] < seq:  # in-order arrival, the common case: no search
            return [] if last < 0 else [last] if rows[-1] == last else [rows[-1], last]
        pos = bisect_left(seqs, seq)
        candidates = [rows[i] for i in (pos - 1, pos) if 0 <= i < len(seqs)]
        if last not in candidates:
            candidates.append(last)
        return candidates

    def seq_of(self, row: int) -> int:
        return self.seqs[self.rows.index(row)]
