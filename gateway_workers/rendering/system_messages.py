"""System messages a chat template cannot render where they stand, and the fold that places them where it can.

Agents put system messages after the first one: Claude Code sends its environment as a system message after the
first user message, Codex CLI starts with two developer messages. Most templates render a system turn anywhere,
and then nothing is changed. Some cannot: Qwen3.5 raises unless the system message is first, GPT-OSS and
Qwen3-VL drop it silently, DeepSeek's move it to the top, Gemma's need user and assistant turns to alternate.
`probe` finds out once per template by rendering marked conversations; for a template that fails, `fold` runs
before every render:
- a run of system messages at the start becomes one, their texts joined by a blank line;
- a later system message goes into the next user message, before its text and a blank line (the templates' own
  way to put a system prompt into a user turn), or becomes a user message itself when an assistant or tool
  message comes first. Either way what was rendered before it stays as it was, so rows stay append-only.
Imports only the stdlib.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_SEP = "\n\n"
_S0, _S1, _U1, _A1, _SMID, _U2 = (f"PROBE{i}Z" for i in range(6))


@dataclass(frozen=True, slots=True)
class SystemPlacement:
    """What a template can do with system messages: a run of them at the start, and one after the start."""

    leading_run: bool = True
    late: bool = True

    @property
    def native(self) -> bool:
        return self.leading_run and self.late


NATIVE = SystemPlacement()


def _in_order(render: Callable[[list[dict[str, Any]]], str], chat: list[dict[str, Any]]) -> bool:
    """Whether the template renders `chat` with every message's text present, in the messages' order."""
    try:
        text = render(chat)
    except Exception:  # a template refusing the conversation is the answer we look for
        return False
    at = -1
    for message in chat:
        found = text.find(message["content"], at + 1)
        if found < 0:
            return False
        at = found
    return True


def probe(render: Callable[[list[dict[str, Any]]], str]) -> SystemPlacement:
    """Where the template behind `render` (chat -> text) puts system messages, found by rendering marked ones."""

    def m(role: str, text: str) -> dict[str, Any]:
        return {"role": role, "content": text}

    late = all(_in_order(render, chat) for chat in (
        [m("system", _S0), m("user", _U1), m("assistant", _A1), m("system", _SMID), m("user", _U2)],
        [m("user", _U1), m("assistant", _A1), m("system", _SMID), m("user", _U2)],
    ))
    leading_run = _in_order(render, [m("system", _S0), m("system", _S1), m("user", _U1)])
    return NATIVE if leading_run and late else SystemPlacement(leading_run, late)


def fold(chat: list[dict[str, Any]], placement: SystemPlacement) -> list[dict[str, Any]]:
    """`chat` (template messages) with its system messages where a template of `placement` can render them."""
    if placement.native:
        return chat
    first = 0
    while first < len(chat) and chat[first]["role"] == "system":
        first += 1
    if all(message["role"] != "system" for message in chat[first:]) and (first < 2 or placement.leading_run):
        return chat
    out: list[dict[str, Any]] = list(chat[:first])
    if first > 1 and not placement.leading_run:
        out = [{**chat[0], "content": _SEP.join(message["content"] for message in chat[:first])}]
    held: list[str] = []  # later system texts waiting for the next user message
    for message in chat[first:]:
        role = message["role"]
        if role == "system" and not placement.late:
            held.append(message["content"])
            continue
        if held:
            if role == "user":
                message = {**message, "content": _SEP.join([*held, message["content"]])}
            else:
                out.append({"role": "user", "content": _SEP.join(held)})
            held = []
        out.append(message)
    if held:
        out.append({"role": "user", "content": _SEP.join(held)})
    return out
