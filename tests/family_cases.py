"""What the per-family format tests share: a question, typed tools, each family's test tokenizer and replies.

`sampled` renders a reply with the family's real template (trl's copy), the way the model would
have produced it; `reply_for` is the richest message a family's template can render.
"""

from __future__ import annotations

import copy
from typing import Any

from assets import TOOLS
from fake_formats import FAMILIES, family_tokenizer_dir, template_path

from gateway_workers.formats import FORMATS
from gateway_workers.rendering.messages import template_messages

QUESTION = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "Weather in Paris and Lyon?"},
]
CONFIGURE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "configure",
        "description": "Typed parameters.",
        "parameters": {
            "type": "object",
            "properties": {
                "units": {"type": "object"},
                "flags": {"type": "array"},
                "dry_run": {"type": "boolean"},
                "ratio": {"type": "number"},
                "count": {"type": "integer"},
                "label": {"type": "string"},
            },
        },
    },
}
ALL_TOOLS = [*TOOLS, CONFIGURE_TOOL]
_BASES: dict[tuple[str, tuple[str, ...], str | None, str], Any] = {}


def family_tokenizer(key: str) -> Any:
    """The family's test tokenizer; families sharing a vocabulary share one loaded backend."""
    from transformers import AutoTokenizer

    family = FAMILIES[key]
    base_key = (family.vocab, family.added, family.bos, family.stop)
    if base_key not in _BASES:
        _BASES[base_key] = AutoTokenizer.from_pretrained(family_tokenizer_dir(key))
    tokenizer = copy.copy(_BASES[base_key])
    tokenizer.chat_template = template_path(family.template).read_text("utf-8")
    return tokenizer


def reply_for(key: str, typed: bool = False) -> dict[str, Any]:
    """The richest assistant message this family's template can render."""
    family, fmt = FAMILIES[key], FORMATS[FAMILIES[key].format_name]
    reply: dict[str, Any] = {
        "role": "assistant",
        "content": "I will check both cities.",
        "reasoning": "Two cities: call get_weather twice.\nThen summarise.",
    }
    calls = [
        {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
        {"name": "get_weather", "arguments": {"city": 'Lyon ü "q"', "days": 3}},
    ]
    if typed:
        calls[1] = {
            "name": "configure",
            "arguments": {
                "units": {"temp": "C"},
                "flags": [1, 2.5, None],
                "dry_run": False,
                "ratio": 0.5,
                "count": 7,
                "label": "7",
            },
        }
    if family.tools:
        reply["tool_calls"] = calls if family.parallel else calls[:1]
    if not fmt.reasoning or not family.renders_reasoning:
        del reply["reasoning"]
    if fmt.name in ("llama3_json", "gpt_oss", "gemma4", "muse_glimmer") and family.tools:
        # A call message carries no text in these templates (Gemma 4 writes it after the tool results).
        reply["content"] = ""
    return reply


def render(tokenizer: Any, key: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    chat = template_messages(messages)
    tools = ALL_TOOLS if FAMILIES[key].tools else None
    return tokenizer.apply_chat_template(chat, tools=tools, tokenize=False, **kwargs)


def sampled(tokenizer: Any, key: str, reply: dict[str, Any]) -> tuple[str, str]:
    """(prompt text, reply text) as the model would have produced the reply: the template's own rendering."""
    prefix = render(tokenizer, key, QUESTION, add_generation_prompt=True)
    if FAMILIES[key].format_name == "deepseek_r1":
        # Its template never renders an assistant's reasoning: the model writes it after the prefilled <think>.
        return prefix, f"{reply['reasoning']}\n</think>\n\n{reply['content']}{FAMILIES[key].stop}"
    full = render(tokenizer, key, [*QUESTION, reply])
    assert full.startswith(prefix), (full[len(prefix) - 60 : len(prefix) + 60], prefix[-60:])
    if FAMILIES[key].format_name == "phi3":  # without a generation prompt it appends eos after the last message
        full = full.removesuffix(tokenizer.eos_token)
    return prefix, full[len(prefix) :]


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream_ids(
    tokenizer: Any, parser: Any, prompt_text: str, ids: list[int], tools: Any, cuts: list[int] | None = None
):
    """(live deltas, tail deltas, consistent, final parse) for a reply's `ids` fed in chunks (`cuts`; default one id
    at a time), as `turns.live.LiveTurn` feeds them."""
    from gateway_workers.formats.live_split import IncrementalDecoder, StreamTracker, live_splitter

    backend = tokenizer.backend_tokenizer
    decoder = IncrementalDecoder(lambda chunk: backend.decode(chunk, skip_special_tokens=False))
    splitter = live_splitter(parser, prompt_text, tools)
    tracker = StreamTracker()
    bounds = sorted({0, len(ids), *(c for c in (cuts or range(len(ids))) if 0 < c < len(ids))})
    texts = [decoder.feed(ids[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    live = []
    for text in [*texts, decoder.flush()]:
        for delta in splitter.feed(text):
            tracker.record(delta)
            live.append(delta)
    final = parser.parse(ids, prompt_text, tools)
    tail, consistent = tracker.remainder(final)
    return live, tail, consistent, final
