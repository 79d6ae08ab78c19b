"""System messages after the first one, per family: rendered where they stand, or folded where the template can.

Every served family's real template (trl's copies) renders the conversations real agents send — Claude Code's
environment as a system message after the first user message, Codex's two developer messages in a row, a
system message after a tool loop — with every message's text present and in order. Which templates needed the
fold is pinned, so a template that changes its mind is noticed. `fold` itself keeps what was rendered before a
message unchanged when the conversation grows (rows stay append-only), and leaves native templates alone.
"""

from __future__ import annotations

from typing import Any

import pytest
from family_cases import FAMILIES, family_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway_workers.rendering.messages import RenderError
from gateway_workers.rendering.renderer import Renderer
from gateway_workers.rendering.system_messages import NATIVE, SystemPlacement, fold, probe

# Templates that cannot render a system message where it stands (raise, drop it or move it), and fold it.
FOLDED = {"qwen3_vl", "qwen3_5_think", "qwen3_6", "qwen3_8", "gptoss", "deepseek_r1_distill", "deepseekv3",
          "gemma3", "cohere", "cohere2"}
# Templates that need user and assistant turns to alternate: two user turns in a row stay refused, folded or not.
ALTERNATING = {"gemma3", "cohere", "cohere2"}


def m(role: str, text: str, **more: Any) -> dict[str, Any]:
    return {"role": role, "content": text, **more}


CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
CONVERSATIONS = {
    "claude code": [m("system", "SYS-A"), m("user", "USER-1"), m("system", "ENV-B"), m("user", "USER-2")],
    "codex": [m("system", "DEV-A"), m("system", "DEV-B"), m("user", "USER-1"), m("user", "USER-2")],
    "after a reply": [m("system", "SYS-A"), m("user", "USER-1"), m("assistant", "REPLY-1"), m("system", "ENV-B"),
                      m("user", "USER-2")],
    "after a tool loop": [m("system", "SYS-A"), m("user", "USER-1"), m("assistant", "", tool_calls=[CALL]),
                          m("tool", "TOOL-1", name="get_weather"), m("system", "ENV-B"), m("user", "USER-2")],
}


def _renderer(key: str) -> Renderer:
    # text only: no piece cache and no fast twins, which render and encode the same text as the template does
    return Renderer(family_tokenizer(key), cache_bytes=0, native_templates=False, bpe_twin=False)


@pytest.mark.parametrize("key", list(FAMILIES))
def test_every_family_renders_late_system_messages_in_order(key: str) -> None:
    renderer = _renderer(key)
    assert (renderer.system_placement is not NATIVE) == (key in FOLDED), renderer.system_placement
    for name, conversation in CONVERSATIONS.items():
        if name == "after a tool loop" and not FAMILIES[key].tools:
            continue
        consecutive_users = name in ("claude code", "codex")
        try:
            text = renderer.render_text(conversation, None)
        except RenderError:
            assert key in ALTERNATING and consecutive_users, (key, name)
            continue
        at = -1
        for message in conversation:
            if message["content"]:
                found = text.find(message["content"], at + 1)
                assert found > at, (key, name, message["content"], text)
                at = found


def test_the_probe_finds_each_kind_of_template() -> None:
    def template(drop_late: bool = False, raise_leading: bool = False):
        def render(chat: list[dict[str, Any]]) -> str:
            systems = [i for i, message in enumerate(chat) if message["role"] == "system"]
            if raise_leading and systems[:2] == [0, 1]:
                raise ValueError("one system message")
            return "|".join(message["content"] for i, message in enumerate(chat)
                            if not (drop_late and message["role"] == "system" and i > 0))
        return render

    assert probe(template()) is NATIVE
    assert probe(template(drop_late=True)) == SystemPlacement(leading_run=False, late=False)
    assert probe(template(raise_leading=True)) == SystemPlacement(leading_run=False, late=True)


def test_fold_merges_a_leading_run_and_carries_late_ones_into_the_next_user_message() -> None:
    chat = [m("system", "A"), m("system", "B"), m("user", "U1"), m("assistant", "R"), m("system", "C"),
            m("system", "D"), m("user", "U2"), m("system", "E"), m("assistant", "R2"), m("system", "F")]
    folded = fold(chat, SystemPlacement(leading_run=False, late=False))
    assert folded == [m("system", "A\n\nB"), m("user", "U1"), m("assistant", "R"), m("user", "C\n\nD\n\nU2"),
                      m("user", "E"), m("assistant", "R2"), m("user", "F")]
    assert fold(chat, NATIVE) is chat
    assert fold(chat, SystemPlacement(leading_run=True, late=False))[:2] == chat[:2]


ROLES = st.sampled_from(["system", "user", "assistant", "tool"])


@settings(max_examples=300, deadline=None)
@given(roles=st.lists(ROLES, min_size=1, max_size=12), leading_run=st.booleans(), late=st.booleans())
def test_fold_keeps_what_came_before_each_reply(roles: list[str], leading_run: bool, late: bool) -> None:
    """Append-only: the fold of a conversation cut after any assistant message is a prefix of the whole's fold."""
    chat = [m(role, f"{role}-{i}") for i, role in enumerate(roles)]
    placement = SystemPlacement(leading_run, late)
    whole = fold(chat, placement)
    texts = " ".join(message["content"] for message in whole)
    assert all(message["content"] in texts for message in chat)  # nothing lost
    if not late:
        first = next((i for i, message in enumerate(whole) if message["role"] != "system"), len(whole))
        assert all(message["role"] != "system" for message in whole[first:])
    for cut, message in enumerate(chat, 1):
        if message["role"] == "assistant":
            head = fold(chat[:cut], placement)
            assert whole[:len(head)] == head, (chat[:cut], head, whole)
