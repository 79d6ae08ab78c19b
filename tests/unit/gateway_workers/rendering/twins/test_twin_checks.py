"""`Twin`: the sampling rule, the switch-off for good on the first difference, the counters and the stats.

The four real twins (template, BPE encode, bytes-table decode, response reader) are tested against
their originals in their own modules; here a toy twin pins down what they all share.
"""

from __future__ import annotations

import gc
import logging

import pytest

from gateway_workers.rendering.twins import checks
from gateway_workers.rendering.twins.checks import VERIFY_EVERY, VERIFY_FIRST, Twin, checked_use, twin_stats

log = logging.getLogger(__name__)


def describe(twin, found, expected, args) -> str:
    return f"toy {twin.name} gave {found!r} for {args!r}, the original {expected!r}"


def toy(fast=str.upper, exact=str.upper, **kwargs) -> Twin:
    return Twin("template", "toy", fast, exact, describe=describe, log=log, **kwargs)


def run(twin: Twin, arg: str) -> str:
    """An owner's hot path, as the renderer and parser write it."""
    if not twin.active:
        return twin.exact(arg)
    found = twin.fast(arg)
    if twin.use():
        return twin.check(found, arg)
    return found


def test_the_first_uses_and_then_one_in_verify_every_are_checked():
    twin = toy()
    checked = []
    for k in range(VERIFY_FIRST + 2 * VERIFY_EVERY + 1):
        due = twin.next_checked()
        assert twin.use() == due
        if due:
            checked.append(k)
    assert checked == [*range(VERIFY_FIRST), VERIFY_EVERY, 2 * VERIFY_EVERY]
    assert checked == [k for k in range(VERIFY_FIRST + 2 * VERIFY_EVERY + 1) if checked_use(k)]
    assert twin.uses == VERIFY_FIRST + 2 * VERIFY_EVERY + 1 and twin.checks == 0  # `check` counts checks


def test_use_counts_every_use_and_next_checked_only_peeks():
    twin = toy()
    for _ in range(VERIFY_FIRST):
        assert twin.next_checked() and twin.next_checked()
        assert twin.use()
    assert twin.uses == VERIFY_FIRST
    assert not twin.next_checked() and not twin.use()
    assert twin.uses == VERIFY_FIRST + 1


def test_the_rule_follows_the_module_constants(monkeypatch):
    monkeypatch.setattr(checks, "VERIFY_FIRST", 2)
    monkeypatch.setattr(checks, "VERIFY_EVERY", 3)
    twin = toy()
    assert [twin.use() for _ in range(8)] == [True, True, False, True, False, False, True, False]


def test_agreeing_checks_keep_the_twin_and_count():
    calls = []
    twin = toy(exact=lambda s: calls.append(s) or s.upper())
    assert [run(twin, f"x{k}") for k in range(VERIFY_FIRST + 5)] == [f"X{k}" for k in range(VERIFY_FIRST + 5)]
    assert len(calls) == VERIFY_FIRST
    assert twin.stats() == checks.TwinStats("template", "toy", VERIFY_FIRST + 5, VERIFY_FIRST, 0, True)


def test_a_difference_switches_the_twin_off_for_good(caplog):
    exact_calls = []
    twin = toy(fast=lambda s: "wrong", exact=lambda s: exact_calls.append(s) or s.upper())
    with caplog.at_level(logging.ERROR, logger=__name__):
        assert run(twin, "a") == "A"  # a checked use answers with the original's result
    assert not twin.active
    assert caplog.records[-1].name == __name__ and caplog.records[-1].levelno == logging.ERROR
    assert "toy toy gave 'wrong' for ('a',), the original 'A'" in caplog.text
    caplog.clear()
    twin.uses = VERIFY_FIRST + 1  # even where no check is due
    assert [run(twin, s) for s in "bcd"] == ["B", "C", "D"]
    assert exact_calls == ["a", "b", "c", "d"] and caplog.text == ""  # logged once
    assert twin.stats() == checks.TwinStats("template", "toy", VERIFY_FIRST + 1, 1, 1, False)


def test_a_custom_comparison_decides_what_differs():
    twin = toy(fast=lambda s: s.upper() + " ", same=lambda a, b: a.strip() == b.strip())
    assert run(twin, "a") == "A" and twin.active
    strict = toy(fast=lambda s: s.upper() + " ")
    assert run(strict, "a") == "A" and not strict.active


class Refused(Exception):
    pass


def refuse(s: str) -> str:
    raise Refused(s)


def test_the_original_refusing_propagates_and_only_counts_when_asked(caplog):
    lenient = toy(exact=refuse)
    with pytest.raises(Refused):
        run(lenient, "a")
    assert lenient.active and lenient.stats().checks == 1 and lenient.stats().mismatches == 0
    strict = toy(exact=refuse, refusal_differs=True)
    with caplog.at_level(logging.ERROR, logger=__name__), pytest.raises(Refused):
        run(strict, "a")
    assert not strict.active and strict.mismatches == 1
    assert "the original Refused('a')" in caplog.text  # describe sees the exception as `expected`


def test_twin_stats_lists_the_live_twins_in_creation_order():
    first = Twin("template", "first-of-two", str.upper, str.upper, describe=describe, log=log)
    second = Twin("bpe_encode", "second-of-two", len, len, describe=describe, log=log)
    second.use()
    mine = [s for s in twin_stats() if s.name.endswith("-of-two")]
    assert mine == [first.stats(), second.stats()]
    assert mine[1].kind == "bpe_encode" and mine[1].uses == 1 and mine[1].active
    del first, second
    gc.collect()
    assert not [s for s in twin_stats() if s.name.endswith("-of-two")]  # a twin whose owner is gone is not reported


def test_the_real_twins_report_their_stats(builtin_tokenizer):
    from gateway_workers.formats.base import FormatParser
    from gateway_workers.formats.chatml import QWEN3
    from gateway_workers.rendering.renderer import Renderer

    renderer = Renderer(builtin_tokenizer)
    parser = FormatParser(builtin_tokenizer, QWEN3, engine="template")
    renderer.render([{"role": "user", "content": "a question for the twins"}])
    parser.parse(builtin_tokenizer.encode("Hello."), "<|im_start|>assistant\n")
    twins = [renderer.template_twin, renderer.encode_twin, parser.reader_twin]
    assert [twin and twin.kind for twin in twins] == ["template", "bpe_encode", "response_reader"]
    live = twin_stats()
    for twin in twins:
        assert twin.active and twin.uses >= 1 and twin.stats() in live
    assert any(s.kind == "token_decode" and s.name == "bytes-table" and s.uses >= 1 for s in live)
