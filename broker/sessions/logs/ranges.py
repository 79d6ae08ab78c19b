"""Log ranges: a sequence spelled as (start, stop) runs of an append-only log, flat ints.

`turn_store.TurnStore` keeps each turn's context (ids) and messages as such runs of its
session's logs, sharing them between turns; these helpers compare, cut and extend them.
Pure functions over sequences of ints (tuples or `array('q')` slices); imports only the stdlib and
`broker.token_ids` (its `matching_prefix` bisects a range that differs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from broker.token_ids import matching_prefix


def common_prefix(
    length: int, same: Callable[[int, int, int], bool], ranges: Sequence[int]
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
        lo = matching_prefix(n, lambda i, j: same(off + i, start + i, j - i))  # noqa: B023  (used before the loop moves on)
        if lo:
            out += (start, start + lo)
            off += lo
        break
    return off, tuple(out)


def span(ranges: Sequence[int], lo: int, hi: int) -> list[tuple[int, int]]:
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


def cut(ranges: Sequence[int], n: int) -> tuple[int, ...]:
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


def extend(ranges: tuple[int, ...], start: int, stop: int) -> tuple[int, ...]:
    """`ranges` plus the log items just appended at [start, stop), merged when contiguous."""
    if stop == start:
        return ranges
    if ranges and ranges[-1] == start:  # the base ended at the log's end: a plain extension
        return ranges[:-1] + (stop,)
    return ranges + (start, stop)
