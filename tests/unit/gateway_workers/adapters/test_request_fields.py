"""Every field of the official SDKs' request types has a verdict, and the reference in docs is generated from them.

The SDKs' TypedDicts are walked by introspection, as a client's request may be built from them: every field and
every union member (by its `type` or `role` tag) of every honoured place must match a rule of
`gateway_workers.adapters.request_fields`, so a new SDK version's new fields fail here until they get one. A
rule that matches nothing the SDKs have must say it is an extension (a field another server or a harness sends).
"""

from __future__ import annotations

import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest
from typing_extensions import is_typeddict

from gateway_workers.adapters import request_fields
from gateway_workers.adapters.request_fields import Dialect

DOC = Path(__file__).resolve().parents[4] / "docs" / "request-fields.md"
MAX_DEPTH = 10


def _roots(dialect: Dialect) -> list[Any]:
    if dialect == "chat":
        from openai.types.chat import completion_create_params as chat

        return [chat.CompletionCreateParamsStreaming, chat.CompletionCreateParamsNonStreaming]
    if dialect == "responses":
        from openai.types.responses import response_create_params as responses

        return [responses.ResponseCreateParamsStreaming, responses.ResponseCreateParamsNonStreaming]
    from anthropic.types import message_create_params as messages
    from anthropic.types.beta import message_create_params as beta

    return [messages.MessageCreateParamsStreaming, messages.MessageCreateParamsNonStreaming,
            beta.MessageCreateParamsStreaming, beta.MessageCreateParamsNonStreaming]


def _typed_dicts(annotation: Any) -> Iterator[Any]:
    """The TypedDicts an annotation may hold, through Optional, unions, lists, iterables and Required."""
    if is_typeddict(annotation):
        yield annotation
        return
    if get_origin(annotation) is Literal:
        return
    for arg in get_args(annotation):
        yield from _typed_dicts(arg)


def _literals(annotation: Any) -> list[str]:
    """The string literals an annotation allows, through Optional, unions and Required."""
    if get_origin(annotation) is Literal:
        return [v for v in get_args(annotation) if isinstance(v, str)]
    return [value for arg in get_args(annotation) for value in _literals(arg)]


def _tags(member: Any) -> list[str]:
    """A union member's tag values: the literals of its `type` field, else of its `role` field."""
    hints = typing.get_type_hints(member)
    for field in ("type", "role"):
        if field in hints:
            return _literals(hints[field])
    return []


def sdk_places(dialect: Dialect) -> dict[str, request_fields.Rule | None]:
    """Every place of the SDK types that a request may hold, inside honoured places, with its rule."""
    found: dict[str, request_fields.Rule | None] = {}

    def walk(typed_dict: Any, path: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            return
        for name, annotation in typing.get_type_hints(typed_dict).items():
            place = f"{path}.{name}" if path else name
            rule = found[place] = request_fields.rule_for(dialect, place)
            if rule is None or rule.verdict != "honoured":
                continue
            for member in _typed_dicts(annotation):
                tags = _tags(member)
                if not tags:
                    walk(member, place, depth + 1)
                for tag in tags:
                    tagged = f"{place}[{tag}]"
                    rule = found[tagged] = request_fields.rule_for(dialect, tagged)
                    if rule is not None and rule.verdict == "honoured":
                        walk(member, tagged, depth + 1)

    for root in _roots(dialect):
        walk(root, "", 0)
    return found


@pytest.mark.parametrize("dialect", list(request_fields.RULES))
def test_every_sdk_field_has_a_verdict(dialect: Dialect) -> None:
    missing = sorted(place for place, rule in sdk_places(dialect).items() if rule is None)
    assert not missing, f"{dialect}: SDK fields without a verdict in request_fields.py: {missing}"


@pytest.mark.parametrize("dialect", list(request_fields.RULES))
def test_every_rule_matches_an_sdk_field_or_says_it_is_an_extension(dialect: Dialect) -> None:
    used = {id(rule) for rule in sdk_places(dialect).values() if rule is not None}
    dead = [rule.pattern for rule in request_fields.RULES[dialect] if id(rule) not in used and not rule.extension]
    assert not dead, f"{dialect}: rules that match no SDK field (misspelt, or say extension=True): {dead}"


def test_the_reference_in_docs_is_generated_from_the_rules() -> None:
    assert DOC.read_text() == request_fields.reference_markdown(), (
        "regenerate it: python -m gateway_workers.adapters.request_fields > docs/request-fields.md")


def test_the_first_matching_rule_decides() -> None:
    assert request_fields.verdict("messages", "messages[user].content[image]") == "refused"
    assert request_fields.verdict("messages", "tools[web_search_20250305]") == "hosted"
    assert request_fields.verdict("messages", "tools[custom].defer_loading") == "ignored"
    assert request_fields.verdict("responses", "tools[namespace].tools[function].name") == "honoured"
    assert request_fields.verdict("chat", "no_such_field") is None
    # `*` stands for one name or tag, never for a path
    assert request_fields.verdict("chat", "messages[user].content[text].text.deeper") is None
