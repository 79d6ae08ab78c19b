"""Template twins (`gateway_workers.rendering.twins.native_templates`) render exactly what their Jinja template renders.

Property tests over conversations with every role order, reasoning given or embedded as
`<think>` in content, tool calls with object or string arguments, unicode and special-token text,
tools present or not and enable_thinking unset/True/False, against HF's `apply_chat_template`
on trl's qwen3.jinja and the built-in template. Also: the registry matches the template files
byte for byte, and a twin that disagrees with Jinja on a verified render is switched off.
"""

from __future__ import annotations

import logging

import pytest
from assets import TOOLS, TRL_QWEN3_SHA256
from conversations import content, conversation
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway_workers.rendering.messages import template_messages
from gateway_workers.rendering.renderer import Renderer
from gateway_workers.rendering.tokenizer import builtin_template_text
from gateway_workers.rendering.twins import native_templates as nt
from gateway_workers.rendering.twins.checks import VERIFY_FIRST

TWINS = {"builtin": nt.render_builtin, "qwen3": nt.render_qwen3}
UNICODE_TOOL = {
    "type": "function",
    "function": {"name": "naïve", "description": "Größe — 中文 🙂", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture(scope="module", params=["builtin", "qwen3"])
def case(request, builtin_tokenizer, qwen3_tokenizer):
    tokenizer = builtin_tokenizer if request.param == "builtin" else qwen3_tokenizer
    return tokenizer, TWINS[request.param]


def jinja_text(tokenizer, chat, tools, **kwargs) -> str:
    return tokenizer.apply_chat_template(chat, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs)


# Assistant content that embeds its reasoning, the way some clients echo it back.
embedded = st.tuples(content, content, st.sampled_from(["", "\n", "\n\n"])).map(
    lambda t: f"<think>{t[2]}{t[0]}{t[2]}</think>{t[2]}{t[1]}"
)


@st.composite
def chats(draw: st.DrawFn) -> list[dict]:
    messages = draw(conversation())
    for m in messages:
        if m["role"] == "assistant" and "reasoning" not in m and draw(st.booleans()):
            m["content"] = draw(embedded)
        if m["role"] == "user" and draw(st.integers(0, 4)) == 0:
            m["content"] = "<tool_response>" + m["content"] + "</tool_response>"  # not a real query for qwen3
    return template_messages(messages)


@settings(max_examples=400, deadline=None)
@given(
    chat=chats(),
    tools=st.sampled_from([None, TOOLS, [UNICODE_TOOL], TOOLS + [UNICODE_TOOL]]),
    thinking=st.sampled_from([None, True, False, 0]),
)
def test_twin_renders_the_templates_text(case, chat, tools, thinking):
    tokenizer, twin = case
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    assert twin(chat, tools, True, **kwargs) == jinja_text(tokenizer, chat, tools, **kwargs)


def test_registry_matches_the_template_files(qwen3_template_path, builtin_tokenizer, qwen3_tokenizer):
    assert nt.QWEN3_TRL_SHA256 == TRL_QWEN3_SHA256 == nt.template_sha256(qwen3_template_path.read_text("utf-8"))
    # Editing the built-in template changes its sha256 and silently drops its twin: this test says so.
    assert nt.template_sha256(builtin_template_text()) == nt.BUILTIN_SHA256
    assert Renderer(builtin_tokenizer).native_template == "builtin-qwen3-chatml"
    assert Renderer(qwen3_tokenizer).native_template == "qwen3"
    assert Renderer(qwen3_tokenizer, native_templates=False).native_template is None
    assert nt.native_template(qwen3_template_path.read_text("utf-8") + " ") is None


def test_unknown_template_variables_and_unencodable_arguments_go_to_jinja(qwen3_tokenizer):
    renderer = Renderer(qwen3_tokenizer)
    calls = []
    twin = renderer.template_twin
    real = twin.fast
    twin.fast = nt.NativeTemplate("spy", lambda *a, **k: calls.append(k) or real.render(*a, **k), real.variables)
    messages = [{"role": "user", "content": "hi"}]
    assert renderer.render_text(messages, template_kwargs={"custom_flag": 1}).endswith("<|im_start|>assistant\n")
    assert calls == []  # a variable the twin does not know: Jinja renders
    odd = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "search", "arguments": {"q": {1, 2}}}]},
    ]
    assert "<set>" in renderer.render_text(odd)  # json cannot encode a set: HF's placeholder, from Jinja
    assert renderer.native_template == "spy"  # falling back is not a mismatch


def test_a_twin_that_disagrees_is_switched_off(builtin_tokenizer, caplog):
    renderer = Renderer(builtin_tokenizer)
    broken = nt.NativeTemplate("broken", lambda *a, **k: "not the template", frozenset({"enable_thinking"}))
    renderer.template_twin.fast = broken
    messages = [{"role": "user", "content": "hi"}]
    with caplog.at_level(logging.ERROR, logger="gateway_workers.rendering.renderer"):
        text = renderer.render_text(messages)
    assert text == jinja_text(builtin_tokenizer, template_messages(messages), None)
    assert renderer.native_template is None and "rendered differently from Jinja" in caplog.text


def test_twin_is_verified_on_early_renders_then_trusted(builtin_tokenizer):
    renderer = Renderer(builtin_tokenizer)
    real = renderer.template_twin.fast
    jinja_calls = []
    original = renderer.template_twin.exact
    renderer.template_twin.exact = lambda *a: jinja_calls.append(1) or original(*a)
    for _ in range(VERIFY_FIRST + 10):
        renderer.render_text([{"role": "user", "content": "hi"}])
    assert len(jinja_calls) == VERIFY_FIRST and renderer.template_twin.fast is real
