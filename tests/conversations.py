"""Hypothesis strategies for canonical conversations that stress rendering: the rendering tests share them.

Content mixes the Qwen special tokens, near-misses of them, whitespace runs and characters whose NFC
form or BPE merges change when cut apart; assistant turns carry reasoning and tool calls with object
or string arguments.
"""

from __future__ import annotations

from hypothesis import strategies as st

SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
            "<tool_response>", "</tool_response>", "<|endoftext|>", "<|fim_pad|>"]
# Near-misses and pieces of specials, whitespace runs and characters whose NFC form or BPE merges
# would change if a cut split them from their neighbours.
TRICKY = ["<|im_", "|>", "<think", "think>", "</", "<", ">", "\n", "\n\n", " ", "  ", "\t", "\r\n", "e\u0301",
          "\u0301", "é", "中文", "🙂", "12345", "'s", " x", "```", '{"a": 1}', "\u00a0", "\u200b"]
fragment = st.one_of(st.sampled_from(SPECIALS), st.sampled_from(TRICKY),
                     st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12))
content = st.lists(fragment, max_size=8).map("".join)
arguments = st.one_of(
    st.dictionaries(st.sampled_from(["query", "city", "q é", "n"]),
                    st.one_of(content, st.integers(-5, 10**12), st.floats(allow_nan=False), st.booleans(),
                              st.none(), st.lists(st.integers(0, 9), max_size=3)), max_size=3),
    content,  # a string passes through verbatim
)
call = st.fixed_dictionaries({"name": st.sampled_from(["search", "get_weather", "naïve_tool"]), "arguments": arguments})


@st.composite
def message(draw: st.DrawFn) -> dict:
    role = draw(st.sampled_from(["user", "assistant", "assistant", "tool", "tool", "system"]))
    out: dict = {"role": role, "content": draw(content)}
    if role == "assistant":
        if draw(st.booleans()):
            out["reasoning"] = draw(content)
        if draw(st.booleans()):
            out["tool_calls"] = draw(st.lists(call, min_size=1, max_size=3))
    return out


@st.composite
def conversation(draw: st.DrawFn) -> list[dict]:
    head = [{"role": "system", "content": draw(content)}] if draw(st.booleans()) else []
    return head + [{"role": "user", "content": draw(content)}] + draw(st.lists(message(), max_size=8))
