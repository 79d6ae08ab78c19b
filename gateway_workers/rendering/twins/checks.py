"""`Twin`: a fast path checked against the exact original it stands in for, the one seam all of them share.

The worker has plain-Python or native twins of slow library paths: the chat template
(`native_templates`), the BPE encode (`bpe.BpeTwin`), the ids -> text bytes table
(`bpe.TableDecoder`) and the response reader of the JSON-call formats (`formats.base`). Each is
a `Twin`, which owns the sampling rule (its first VERIFY_FIRST uses, then one in VERIFY_EVERY,
re-run through the original and compared), the counters, the switch-off for good on the first
difference (logged) and the stats snapshot; `twin_stats` lists every live twin for `/metrics`.
Imports only the stdlib: nothing from the gateway.
"""

from __future__ import annotations

import itertools
import logging
import operator
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

# A twin's result is compared with the original's on its first uses and then on one in this many.
VERIFY_FIRST = 16
VERIFY_EVERY = 1024

TwinKind = Literal["template", "bpe_encode", "token_decode", "response_reader"]
F = TypeVar("F")  # the fast path: what the owner's hot path calls in place of the original
R = TypeVar("R")  # what both paths produce

# Every twin still referenced by its owner, in creation order (serial -> twin): what `twin_stats` reports.
_LIVE: weakref.WeakValueDictionary[int, Twin[Any, Any]] = weakref.WeakValueDictionary()
_SERIALS = itertools.count()


def checked_use(count: int) -> bool:
    """Whether the count-th use (from 0) of a twin is also run through the original and compared."""
    return count < VERIFY_FIRST or count % VERIFY_EVERY == 0


@dataclass(frozen=True, slots=True)
class TwinStats:
    """A snapshot of one twin: uses of its fast path, how many were checked, differences seen, still on."""

    kind: TwinKind
    name: str
    uses: int
    checks: int
    mismatches: int
    active: bool


class Twin(Generic[F, R]):
    """A fast path and the exact original it stands in for, compared on a sample of uses.

    The owner's hot path reads `active`, calls `fast` itself (so a use costs what the inline code
    did) and then `use()`, one int increment and compare; only when that says so does it pay for
    `check`, which runs the original and returns its result. Counters are racy across threads on
    purpose: a skipped or doubled check is harmless.

    Args:
        kind: which of the worker's twins this is (the metric's label).
        name: which implementation (a template's name, a format's name, "tiktoken", ...).
        fast: the fast path: the callable, or the object whose methods, the hot path calls.
        exact: the original: `check(found, *args)` compares `found` with `exact(*args)`.
        describe: the error logged on the first difference: (twin, found, expected, args) -> message;
            `expected` is the original's exception when `refusal_differs` and it raised.
        log: the owner's logger, so the error names the module whose twin differed.
        same: whether a fast result equals the exact one (default ==).
        refusal_differs: the original raising on a checked use is a difference too (then re-raised).
    """

    __slots__ = (
        "kind", "name", "fast", "exact", "active", "uses", "checks", "mismatches",
        "_describe", "_log", "_same", "_refusal_differs", "__weakref__",
    )

    def __init__(
        self,
        kind: TwinKind,
        name: str,
        fast: F,
        exact: Callable[..., R],
        *,
        describe: Callable[[Twin[F, R], R, Any, tuple[Any, ...]], str],
        log: logging.Logger,
        same: Callable[[R, R], bool] = operator.eq,
        refusal_differs: bool = False,
    ) -> None:
        self.kind = kind
        self.name = name
        self.fast = fast
        self.exact = exact
        self.active = True
        self.uses = self.checks = self.mismatches = 0
        self._describe = describe
        self._log = log
        self._same = same
        self._refusal_differs = refusal_differs
        _LIVE[next(_SERIALS)] = self

    def use(self) -> bool:
        """Count one use of the fast path; True when this use must also go through `check`."""
        count = self.uses
        self.uses = count + 1
        # `checked_use`, inlined: a use costs one call, as the inline counters it replaced did
        return count < VERIFY_FIRST or count % VERIFY_EVERY == 0

    def next_checked(self) -> bool:
        """Whether the next `use` will be checked (for a caller that plans around the slower checked call)."""
        return checked_use(self.uses)

    def check(self, found: R, *args: Any) -> R:
        """`exact(*args)`, compared with the fast path's `found`: on a difference the twin is off for good."""
        self.checks += 1
        try:
            expected = self.exact(*args)
        except Exception as e:
            if self._refusal_differs:
                self.mismatches += 1
                self.disable(self._describe(self, found, e, args))
            raise
        if not self._same(found, expected):
            self.mismatches += 1
            self.disable(self._describe(self, found, expected, args))
        return expected

    def disable(self, why: str) -> None:
        """Switch the twin off for good (logged as an error): the owner takes the exact path from now on."""
        self.active = False
        self._log.error("%s", why)

    def stats(self) -> TwinStats:
        return TwinStats(self.kind, self.name, self.uses, self.checks, self.mismatches, self.active)


def twin_stats() -> list[TwinStats]:
    """A snapshot of every twin this process still holds, oldest first (for `/metrics`)."""
    return [twin.stats() for twin in list(_LIVE.values())]
