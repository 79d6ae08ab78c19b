"""The fidelity checker every test layer shares: asserts docs/design.md's fidelity rule on built rows.

Turns: `broker.episodes.trajectory.TurnRecord` or anything with turn_id/prompt_ids/output_ids/logprobs. Rows: the
builder's `Row`, a `TraceRow`/`TraceRecord`, or any object (or dict) with token_ids/loss_mask/logprobs/
response_length, as arrays or lists. Checks: every kept sampled token trained exactly once, contiguous, with its
exact float32 logprob, right after exactly its turn's prompt_ids; loss-0 positions carry logprob 0.0; lengths
agree; each row's response region starts with a trained turn. Imports only the stdlib.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_MAX_SPLITS = 32  # ways to cut one row into turns that are tried; real rows have one


@dataclass(frozen=True, slots=True)
class _RowView:
    index: int
    ids: array
    mask: bytes  # over the whole row: prompt region padded with 0
    logprobs: array  # over the whole row, float32
    start: int  # first position of the response region


@dataclass(frozen=True, slots=True)
class _Group:
    """Turns with identical prompt, kept output and logprobs: interchangeable, so counted together."""

    turn_ids: tuple[str, ...]
    prompt: array
    output: array
    logprobs: array


def _get(obj: Any, name: str) -> Any:
    return obj[name] if isinstance(obj, dict) else getattr(obj, name)


def _view(index: int, row: Any, budget: int | None) -> _RowView:
    ids = array("i", _get(row, "token_ids"))
    mask = bytes(_get(row, "loss_mask"))
    lps = array("f", _get(row, "logprobs"))
    n = _get(row, "response_length")
    where = f"row {index}"
    assert isinstance(n, int) and 0 <= n <= len(ids), f"{where}: response_length {n!r} for {len(ids)} token ids"
    assert len(mask) == n, f"{where}: loss_mask has {len(mask)} entries, response_length is {n}"
    assert len(lps) == n, f"{where}: logprobs has {len(lps)} entries, response_length is {n}"
    assert set(mask) <= {0, 1}, f"{where}: loss_mask holds values other than 0/1: {sorted(set(mask))}"
    assert budget is None or len(ids) <= budget, f"{where}: {len(ids)} ids exceed max_context_tokens={budget}"
    start = len(ids) - n
    for k in range(n):
        if not mask[k] and lps[k] != 0.0:
            raise AssertionError(f"{where}: position {start + k} has loss 0 but logprob {lps[k]!r}, expected 0.0")
    assert 1 in mask, f"{where}: trains no token"
    assert mask[0] == 1, f"{where}: the response region starts at {start} but its first trained id is later"
    return _RowView(index, ids, bytes(start) + mask, array("f", bytes(4 * start)) + lps, start)


def _groups(turns: Sequence[Any], budget: int | None) -> tuple[list[_Group], list[int]]:
    by_key: dict[tuple[bytes, bytes, bytes], list[str]] = {}
    parts: dict[tuple[bytes, bytes, bytes], tuple[array, array, array]] = {}
    for t in turns:
        prompt = array("i", t.prompt_ids)
        output = array("i", t.output_ids)
        lps = array("f", t.logprobs)
        assert len(lps) == len(output), f"turn {t.turn_id}: {len(lps)} logprobs for {len(output)} output ids"
        keep = len(output) if budget is None else max(0, min(len(output), budget - len(prompt)))
        if not keep:
            continue
        output, lps = output[:keep], lps[:keep]
        key = (prompt.tobytes(), output.tobytes(), lps.tobytes())
        by_key.setdefault(key, []).append(str(t.turn_id))
        parts[key] = (prompt, output, lps)
    groups = [_Group(tuple(ids), *parts[key]) for key, ids in by_key.items()]
    return groups, [len(g.turn_ids) for g in groups]


def _fits(g: _Group, row: _RowView, pos: int) -> bool:
    """Whether g's output is trained in `row` at `pos`, right after exactly its prompt, with its logprobs."""
    end = pos + len(g.output)
    return (
        len(g.prompt) == pos
        and end <= len(row.ids)
        and row.ids[:pos] == g.prompt
        and row.ids[pos:end] == g.output
        and row.mask[pos:end] == b"\x01" * len(g.output)
        and row.logprobs[pos:end] == g.logprobs
    )


def _splits(row: _RowView, by_len: dict[int, list[int]], groups: list[_Group]) -> list[list[int]]:
    """Ways to cut the row's trained positions into whole turn outputs (lists of group indexes)."""
    found: list[list[int]] = []

    def walk(pos: int, taken: list[int]) -> None:
        nxt = row.mask.find(1, pos)
        if nxt < 0:
            found.append(list(taken))
            return
        for gi in sorted(by_len.get(nxt, ()), key=lambda gi: -len(groups[gi].output)):
            if len(found) >= _MAX_SPLITS:
                return
            if _fits(groups[gi], row, nxt):
                taken.append(gi)
                walk(nxt + len(groups[gi].output), taken)
                taken.pop()

    walk(0, [])
    return found


def _uncovered(row: _RowView, by_len: dict[int, list[int]], groups: list[_Group]) -> str:
    """Describe where the greedy cut of a row first fails, naming what was expected there."""
    pos = 0
    while (nxt := row.mask.find(1, pos)) >= 0:
        fit = [gi for gi in by_len.get(nxt, ()) if _fits(groups[gi], row, nxt)]
        if not fit:
            near = [g.turn_ids[0] for gi in by_len.get(nxt, ()) for g in [groups[gi]] if row.ids[:nxt] == g.prompt]
            why = (
                f"turn(s) {near} have this exact prompt but their output/mask/logprobs differ here"
                if near
                else "the ids before it are no turn's exact prompt_ids"
            )
            return f"row {row.index}: trained id at position {nxt} starts no turn's output: {why}"
        pos = nxt + max(len(groups[gi].output) for gi in fit)
    return f"row {row.index}: no consistent cut"


def assert_fidelity(turns: Sequence[Any], rows: Sequence[Any], *, max_context_tokens: int | None = None) -> None:
    """Assert the fidelity rule; `max_context_tokens` allows each output to be cut to what fits after its prompt."""
    views = [_view(i, r, max_context_tokens) for i, r in enumerate(rows)]
    groups, need = _groups(turns, max_context_tokens)
    sampled = sum(len(g.output) * n for g, n in zip(groups, need, strict=True))
    trained = sum(v.mask.count(1) for v in views)
    assert trained == sampled, f"{trained} ids trained, {sampled} sampled (kept) over {len(turns)} turns"
    by_len: dict[int, list[int]] = {}
    for gi, g in enumerate(groups):
        by_len.setdefault(len(g.prompt), []).append(gi)
    places = [0] * len(groups)
    splits = []
    for v in views:
        options = _splits(v, by_len, groups)
        assert options, _uncovered(v, by_len, groups)
        for gi in {gi for option in options for gi in option}:
            places[gi] += 1
        splits.append(options)
    for g, n, p in zip(groups, need, places, strict=True):
        assert p >= n, (
            f"turn(s) {list(g.turn_ids)}: {len(g.output)} output ids trained after their exact prompt in {p} "
            f"row(s), expected {n}"
        )
    left = list(need)

    def assign(ri: int) -> bool:
        if ri == len(splits):
            return not any(left)
        for option in splits[ri]:
            for gi in option:
                left[gi] -= 1
            if min(left, default=0) >= 0 and assign(ri + 1):
                return True
            for gi in option:
                left[gi] += 1
        return False

    assert assign(0), "no way to train every turn exactly once: " + "; ".join(
        f"{list(g.turn_ids)} needs {n}, fits {p} row(s)" for g, n, p in zip(groups, need, places, strict=True)
    )
