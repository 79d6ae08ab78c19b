"""Trajectory builder: a finished session's committed turns -> loss-masked training rows.

Pure computation: no sockets or clocks; imports only `broker.sessions.turn_record` (its input), which the
session registry materializes at finish, and `broker.message_keys` (the message tree's keys); `rows.py`
turns its rows into wire rows.
Fidelity rule (docs/design.md): every kept sampled token is trained once, with its float32 logprob, right after
exactly its turn's prompt_ids -- so a turn joins a row only when the row's ids are a prefix of its prompt.
Row.weight_versions: each response-region token's policy version (its turn's, or as a pause split it: the turn's
`weight_versions` runs; -1 for context and unversioned turns).
Row.metadata: truncated, use_tool, ill_formed (bools); turn_ids (trained here, in order); row_start ("first" |
"branch": its parent's row went on elsewhere | "realign": the prompt re-rendered its parent's reply | "rewrite":
the client replayed an earlier reply rewritten | "fork": anything else); parent_turn_id (the turn it continues
per the message tree, or None); decisions (session-wide: each turn counted once as clean, a row_start, empty or
dropped); weight_version_min / _max (over its turns); engine_weight_versions (per turn, when the engine reported it);
weight_versions_unknown (when an engine pause held a turn whose engine cannot say which tokens came after it).
"""

from __future__ import annotations

import logging
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from broker.message_keys import message_key
from broker.sessions.turn_record import TurnRecord

logger = logging.getLogger(__name__)

RowStart = Literal["first", "branch", "realign", "rewrite", "fork"]
DECISIONS: tuple[str, ...] = ("clean", "first", "branch", "realign", "rewrite", "fork", "empty", "dropped")

# Why rows look the way they do (the design notes behind the module docstring):
# - A row is a chain of turns t1..tm where each prompt_ids extends the previous turn's prompt_ids + output_ids.
#   Its token_ids are exactly the last turn's prompt + output, so a row never outgrows what the engine saw and
#   `max_context_tokens` can only bite on a turn that itself overshot it.
# - REALIGN and the short-rewrite merge never overwrite or demote a sampled span: the reference design lost most
#   tokens of thinking models that way. A turn whose prompt re-rendered (Qwen3 drops earlier <think> blocks) or
#   rewrote its parent's reply starts a new row instead; the old row keeps the reply trained where it was sampled.
# - Rows are a minimum chain cover: turns are placed in order of prompt length (a topological order of "extends"),
#   each onto the open row with the longest held ids that prefix its prompt (best fit leaves shorter tails for
#   later siblings). The message tree (canonical messages, normalised) only labels rows; tokens decide placement.


@dataclass(slots=True)
class Row:
    """One training row; `loss_mask`/`logprobs`/`weight_versions` cover the last `response_length` ids."""

    token_ids: array
    loss_mask: array  # typecode "B"
    logprobs: array  # typecode "f"
    response_length: int
    metadata: dict[str, Any]
    weight_versions: array = field(default_factory=lambda: array("i"))  # per token: its turn's version, -1: context


@dataclass(slots=True)
class _Turn:
    """A turn prepared for building: typed arrays, how much output fits, and the message tree's verdicts."""

    rec: TurnRecord
    prompt: array
    output: array
    logprobs: array
    keep: int  # output ids that fit max_context_tokens after the prompt
    parent: _Turn | None = None  # the turn whose reply is the deepest generated message this prompt echoes
    rewrites: _Turn | None = None  # the turn whose reply this prompt replaced by a different assistant message


@dataclass(slots=True)
class _Chain:
    """A row under construction: its turns in position order."""

    turns: list[_Turn]
    open: bool = True  # False once its last turn was cut by the budget: nothing can follow it

    @property
    def held(self) -> int:
        last = self.turns[-1]
        return len(last.prompt) + last.keep


@dataclass(slots=True)
class _Node:
    """A message-tree node: children by normalised message, and the turns that generated this message."""

    children: dict[tuple[Any, ...], _Node] = field(default_factory=dict)
    replies: list[_Turn] = field(default_factory=list)


def build_rows(
    turns: Sequence[TurnRecord],
    *,
    max_context_tokens: int | None = None,
) -> list[Row]:
    """Build the session's rows from its committed turns (any order; sorted by OPEN seq here).

    Raises ValueError for inconsistent input (logprobs not matching output ids, duplicate turn ids, a
    non-positive budget). Rows come ordered by the seq of their first trained turn.
    """
    if max_context_tokens is not None and max_context_tokens <= 0:
        raise ValueError(f"max_context_tokens must be positive, got {max_context_tokens}")
    ordered = sorted(turns, key=lambda t: t.seq)
    decisions = dict.fromkeys(DECISIONS, 0)
    prepared: list[_Turn] = []
    seen: set[str] = set()
    for rec in ordered:
        if rec.turn_id in seen:
            raise ValueError(f"turn {rec.turn_id!r} appears twice")
        seen.add(rec.turn_id)
        t = _prepare(rec, max_context_tokens)
        if not len(t.output):
            decisions["empty"] += 1
        elif not t.keep:
            decisions["dropped"] += 1
            logger.warning(
                "turn %s dropped: its %d-id prompt leaves no room under max_context_tokens=%d for its %d output ids",
                rec.turn_id,
                len(t.prompt),
                max_context_tokens,
                len(t.output),
            )
        prepared.append(t)
    _label_from_tree(prepared)
    trained = [t for t in prepared if t.keep]
    chains = _place(trained, decisions)
    chains.sort(key=lambda c: c.turns[0].rec.seq)
    first_seq = trained[0].rec.seq if trained else None
    starts = [_row_start(c.turns[0], first_seq) for c in chains]
    for start, _ in starts:
        decisions[start] += 1
    rows = [_materialize(c, start, parent, decisions) for c, (start, parent) in zip(chains, starts, strict=True)]
    logger.debug("built %d rows from %d turns: %s", len(rows), len(ordered), decisions)
    return rows


def _prepare(rec: TurnRecord, budget: int | None) -> _Turn:
    prompt = _ids(rec.prompt_ids)
    output = _ids(rec.output_ids)
    lps = rec.logprobs if isinstance(rec.logprobs, array) and rec.logprobs.typecode == "f" else array("f", rec.logprobs)
    if len(lps) != len(output):
        raise ValueError(f"turn {rec.turn_id!r}: {len(lps)} logprobs for {len(output)} output ids")
    keep = len(output) if budget is None else max(0, min(len(output), budget - len(prompt)))
    return _Turn(rec, prompt, output, lps, keep)


def _ids(values: Any) -> array:
    # Sessions hand us int32 arrays; anything else (lists from a test or an older caller) is converted once.
    return values if isinstance(values, array) and values.typecode == "i" else array("i", values)


# --- placement: tokens decide -----------------------------------------------------------------------------------


def _extends(prompt: array, t: _Turn) -> bool:
    """Whether `prompt` starts with exactly t's prompt + output (array slices compare at C speed)."""
    lp, lo = len(t.prompt), len(t.output)
    if len(prompt) < lp + lo:
        return False
    # The output is the short, likely-different part: compare it first so a miss costs little.
    return prompt[lp : lp + lo] == t.output and prompt[:lp] == t.prompt


def _place(trained: list[_Turn], decisions: dict[str, int]) -> list[_Chain]:
    """Greedy best-fit chain cover over "t's prompt extends u's prompt + output"."""
    chains: list[_Chain] = []
    open_chains: list[_Chain] = []
    for t in sorted(trained, key=lambda t: (len(t.prompt), t.rec.seq)):
        home = None
        # Longest held ids first: that is the most specific row; shorter ones stay free for siblings.
        open_chains.sort(key=lambda c: c.held, reverse=True)
        for c in open_chains:
            if c.held <= len(t.prompt) and _extends(t.prompt, c.turns[-1]):
                home = c
                break
        if home is None:
            home = _Chain([t])
            chains.append(home)
            open_chains.append(home)
        else:
            home.turns.append(t)
            decisions["clean"] += 1
        if t.keep < len(t.output):
            home.open = False
            open_chains.remove(home)
            logger.warning(
                "turn %s cut to %d of %d output ids by max_context_tokens",
                t.rec.turn_id,
                t.keep,
                len(t.output),
            )
    return chains


def _row_start(t: _Turn, first_seq: int | None) -> tuple[RowStart, _Turn | None]:
    """Why a row begins with turn t, and which earlier turn it continues."""
    p = t.parent
    if p is None and t.rewrites is None and t.rec.seq == first_seq:
        return "first", None
    if p is not None and _extends(t.prompt, p):
        return "branch", p
    if t.rewrites is not None:
        return "rewrite", t.rewrites
    if p is not None and len(t.prompt) >= len(p.prompt) and t.prompt[: len(p.prompt)] == p.prompt:
        return "realign", p
    return "fork", p


def _materialize(c: _Chain, start: str, parent: _Turn | None, decisions: dict[str, int]) -> Row:
    last = c.turns[-1]
    token_ids = last.prompt + last.output[: last.keep]
    first = len(c.turns[0].prompt)
    mask = array("B")
    lps = array("f")
    versions = array("i")
    turn_versions = [_weight_version(t.rec.flags) for t in c.turns]
    pos = first
    for t, version in zip(c.turns, turn_versions, strict=True):
        gap = len(t.prompt) - pos  # prompt tail between the previous output and this one: context, loss 0
        mask.frombytes(bytes(gap))
        lps.frombytes(bytes(gap * lps.itemsize))
        # From repeated bytes, which copy in doubling blocks (an array repeats, or extends from a tuple, an item at
        # a time); -1 is all ones.
        versions.frombytes(b"\xff" * (gap * versions.itemsize))
        mask.frombytes(b"\x01" * t.keep)
        lps.extend(t.logprobs[: t.keep])
        left = t.keep
        for run_version, count in _version_runs(t.rec.flags, version):
            n = min(count, left)
            versions.frombytes(run_version.to_bytes(versions.itemsize, sys.byteorder, signed=True) * n)
            left -= n
        versions.frombytes(version.to_bytes(versions.itemsize, sys.byteorder, signed=True) * left)
        pos = len(t.prompt) + t.keep
    all_versions = [*turn_versions, *(v for t in c.turns for v, _ in _version_runs(t.rec.flags))]
    metadata = {
        "truncated": not c.open,
        "use_tool": any(_has_tool_calls(t.rec.response_message) for t in c.turns),
        "ill_formed": any(bool((t.rec.flags or {}).get("ill_formed")) for t in c.turns),
        "turn_ids": [t.rec.turn_id for t in c.turns],
        "row_start": start,
        "parent_turn_id": parent.rec.turn_id if parent is not None else None,
        "decisions": dict(decisions),
        "weight_version_min": min(all_versions),
        "weight_version_max": max(all_versions),
    }
    if any((t.rec.flags or {}).get("weight_versions_unknown") for t in c.turns):
        metadata["weight_versions_unknown"] = True  # some tokens' version no one could tell: -1 in weight_versions
    engine_versions = [(t.rec.flags or {}).get("engine_weight_version") for t in c.turns]
    if any(v is not None for v in engine_versions):  # what the engine said it served, per turn (SGLang reports it)
        metadata["engine_weight_versions"] = engine_versions
    return Row(token_ids, mask, lps, len(token_ids) - first, metadata, versions)


def _weight_version(flags: dict[str, Any] | None) -> int:
    """The policy version a turn's commit recorded (`protocol.TurnOpened.weight_version`); -1 if none."""
    version = (flags or {}).get("weight_version", -1)
    return version if type(version) is int and -1 <= version < 2**31 else -1


def _version_runs(flags: dict[str, Any] | None, default: int = -1) -> list[tuple[int, int]]:
    """A turn's per-token policy versions as a pause decided them (`weight_versions`: [[version, count], ...] over
    its output), or none: its one `weight_version` throughout. Runs that do not read as such are ignored."""
    runs = (flags or {}).get("weight_versions")
    if not isinstance(runs, list):
        return []
    out = []
    for run in runs:
        if not (isinstance(run, list) and len(run) == 2 and all(type(v) is int for v in run)):
            return []
        version, count = run
        out.append((version if -1 <= version < 2**31 else default, max(count, 0)))
    return out


def _has_tool_calls(message: Any) -> bool:
    return isinstance(message, dict) and bool(message.get("tool_calls"))


# --- the message tree: labels only ------------------------------------------------------------------------------


def _label_from_tree(turns: list[_Turn]) -> None:
    """Walk each prompt (seq order) down the tree of earlier turns' messages; set `parent` and `rewrites`."""
    root = _Node()
    # Message id -> key. The turn store hands every turn the same dict for a message its prompts share,
    # and a reply's dict is its echo in the next prompt: each distinct message is normalised once. The
    # messages outlive this call (the records hold them), so an id is never reused meanwhile.
    keys_by_id: dict[int, tuple[Any, ...]] = {}

    def key_of(m: Any) -> tuple[Any, ...]:
        key = keys_by_id.get(id(m))
        if key is None:
            key = keys_by_id[id(m)] = message_key(m)
        return key

    for t in turns:
        msgs = t.rec.prompt_messages if isinstance(t.rec.prompt_messages, list) else []
        keys = list(map(key_of, msgs))
        node = root
        depth = 0
        for key in keys:
            child = node.children.get(key)
            if child is None:
                break
            node = child
            depth += 1
            if child.replies:
                t.parent = child.replies[-1]
        if depth < len(keys) and keys[depth][0] == "assistant":
            # An assistant message where an earlier turn's reply hangs, but not equal to it: a rewritten replay.
            replaced = [r for child in node.children.values() for r in child.replies]
            if replaced:
                t.rewrites = max(replaced, key=lambda r: r.rec.seq)
        for key in keys[depth:]:
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node()
            node = child
        if t.keep:
            key = key_of(t.rec.response_message)
            reply = node.children.get(key)
            if reply is None:
                reply = node.children[key] = _Node()
            reply.replies.append(t)
