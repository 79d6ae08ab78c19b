"""Every field and block type a request may carry, per dialect, with one verdict: honoured, ignored, refused or hosted.

The official SDKs' request types (`openai.types.chat.CompletionCreateParams`,
`openai.types.responses.ResponseCreateParams`, `anthropic.types.beta.MessageCreateParams`) are the source of
truth for what a client may send; a test walks them by introspection and checks that every field, and every
member of every union (message roles, content blocks, tools, input items), has a rule here, so a new SDK
version's new fields fail it until they get a verdict. `docs/request-fields.md` is generated from these rules.

A rule's pattern names a place as the walk does: field names joined by dots, a union member by its tag in
brackets (`messages[user].content[text].cache_control`), `[*]` for any member. The first rule that matches
decides. The walk goes into honoured places only: what is ignored, refused or hosted is so with all it holds.
- honoured: it changes what is rendered, sampled or answered, as the real API would;
- ignored: accepted, and without effect on what the engine samples; counted by name in `/metrics`
  (`request_fields_ignored`);
- refused: the real API's own 400, where honouring it is impossible here and ignoring it would silently
  change what the agent asked for;
- hosted: a tool the provider runs (web search, code execution, ...) or whose schema only the provider knows:
  the model cannot call it through this gateway. Left out of the prompt and counted (`hosted_tools_dropped`),
  or refused with `--hosted-tools reject`.
The rules themselves, a table per dialect, are in `request_field_rules`; here are the lookups and the
reference. Imports nothing of the gateway but its rules.
"""

from __future__ import annotations

import re
from functools import cache, lru_cache

from gateway_workers.adapters.request_field_rules import CHAT, MESSAGES, RESPONSES, Dialect, Rule, Verdict

RULES: dict[Dialect, tuple[Rule, ...]] = {"chat": CHAT, "messages": MESSAGES, "responses": RESPONSES}


@cache
def _compiled(dialect: Dialect) -> tuple[tuple[re.Pattern[str], Rule], ...]:
    def regex(pattern: str) -> re.Pattern[str]:
        # `*` stands for any tag or name, never crossing a dot or a bracket
        return re.compile("".join("[^.\\[\\]]*" if part == "*" else re.escape(part)
                                  for part in re.split(r"(\*)", pattern)))

    return tuple((regex(rule.pattern), rule) for rule in RULES[dialect])


@lru_cache(maxsize=4096)  # adapters look up the tool and item types requests name
def rule_for(dialect: Dialect, place: str) -> Rule | None:
    """The rule that decides `place` (the first that matches), None when no rule does."""
    for regex, rule in _compiled(dialect):
        if regex.fullmatch(place):
            return rule
    return None


def verdict(dialect: Dialect, place: str) -> Verdict | None:
    rule = rule_for(dialect, place)
    return None if rule is None else rule.verdict


def known_fields(dialect: Dialect, where: str = "") -> dict[str, Verdict]:
    """The fields the rules name directly under the place `where` ("" for the body), each with its verdict there:
    what an adapter checks a body or an object against (computed once, at import)."""
    names = {rule.pattern.rpartition(".")[2] for rule in RULES[dialect]}
    prefix = f"{where}." if where else ""
    found = {}
    for name in names:
        if re.fullmatch(r"\w+", name) and (found_verdict := verdict(dialect, prefix + name)) is not None:
            found[name] = found_verdict
    return found


def ignored_fields(dialect: Dialect, where: str) -> frozenset[str]:
    """The fields directly under the place `where` that are ignored there (an adapter counts them when seen)."""
    return frozenset(name for name, found in known_fields(dialect, where).items() if found == "ignored")


def reference_markdown() -> str:
    """docs/request-fields.md: every rule, per dialect, in the order it is applied."""
    titles = {"chat": "OpenAI Chat Completions (`POST /v1/chat/completions`)",
              "messages": "Anthropic Messages (`POST /v1/messages`, `/v1/messages/count_tokens`)",
              "responses": "OpenAI Responses (`POST /v1/responses`)"}
    lines = [
        "# Request fields: what the gateway does with each",
        "",
        "Generated from `gateway_workers/adapters/request_fields.py` (`python -m gateway_workers.adapters."
        "request_fields`); a test checks this file against it, and checks that every field and union member of "
        "the official SDKs' request types (`openai`, `anthropic`, read by introspection) matches a row.",
        "",
        "- **honoured**: it changes what is rendered, sampled or answered, as the real API would.",
        "- **ignored**: accepted, without effect on what the engine samples; each request carrying one (at the "
        "top level, or in what it adds to the session's previous request) is counted by name in "
        "`rollout_gateway_request_fields_ignored_total`.",
        "- **refused**: a 400 in the API's own shape, where honouring is impossible here and ignoring would "
        "silently change what the agent asked for.",
        "- **hosted**: a tool the provider runs or whose schema only the provider knows; left out of the prompt "
        "and counted (`rollout_gateway_hosted_tools_dropped_total`), or a 400 with `--hosted-tools reject`.",
        "",
        "A place is a path of field names; `[tag]` is a member of a union (a message role, a block, tool or "
        "item type), `*` any name or tag. The first row that matches a place decides; what is not honoured is "
        "so with everything it holds. *Extension*: a field the SDK types lack that is accepted all the same.",
    ]
    for dialect, rules in RULES.items():
        lines += ["", f"## {titles[dialect]}", "", "| place | verdict | what happens |", "|---|---|---|"]
        for rule in rules:
            extra = " *(extension)*" if rule.extension else ""
            note = rule.note.replace("|", "\\|")
            lines.append(f"| `{rule.pattern}`{extra} | {rule.verdict} | {note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(reference_markdown(), end="")
