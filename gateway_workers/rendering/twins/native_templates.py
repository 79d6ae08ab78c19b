"""Plain-Python twins of known chat templates, so a render costs microseconds instead of a Jinja pass.

Rendering a conversation through HF's sandboxed Jinja costs more CPU than encoding what a turn adds
(docs/performance.md, "The template"); these functions produce the same text for the templates they are
registered for, matched by the sha256 of the exact template text (any other template, or any
extra template variable, falls back to Jinja). Each function is a line-by-line transcription of
its template and is property-tested against it (`test_native_templates.py` under
`tests/unit/gateway_workers/rendering/twins/`); `Renderer` also re-renders a sample of live
requests with Jinja and switches the twin off on a mismatch.
Inputs are `messages.template_messages` output and checked tools. Imports only the stdlib and
`json_texts` (the `tojson` texts of values a conversation prints on every turn).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway_workers.rendering.twins.json_texts import tojson

Messages = Sequence[Mapping[str, Any]]
Tools = Sequence[Mapping[str, Any]] | None


@dataclass(frozen=True, slots=True)
class NativeTemplate:
    """A twin of one template text: `render(messages, tools, add_generation_prompt, **variables)`."""

    name: str
    render: Callable[..., str]
    variables: frozenset[str]  # the template variables it understands besides messages/tools


def template_sha256(template: str) -> str:
    return hashlib.sha256(template.encode("utf-8")).hexdigest()


def _tojson(value: Any) -> str:
    # HF's `tojson` filter: json.dumps with ensure_ascii=False and default separators (cached: the same
    # tools and arguments are printed on every turn). A value json cannot encode raises TypeError, and
    # the caller falls back to Jinja (HF renders a placeholder).
    return tojson(value)


def _call_function(call: Mapping[str, Any], defined_only: bool) -> Mapping[str, Any]:
    fn: Mapping[str, Any] = call.get("function")  # type: ignore[assignment]  # checked just below
    if defined_only:
        return fn if "function" in call else call  # `call.function is defined`
    return fn if fn else call  # `{% if tool_call.function %}`


def _arguments(fn: Mapping[str, Any]) -> str:
    args = fn["arguments"]
    return args if isinstance(args, str) else _tojson(args)


# --- trl 1.16.0 chat_templates/qwen3.jinja (Qwen3's own template) -----------------------------------

_QWEN3_TOOLS_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_QWEN3_TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n"
)


def render_qwen3(messages: Messages, tools: Tools, add_generation_prompt: bool, enable_thinking: Any = None) -> str:
    out: list[str] = []
    n = len(messages)
    first_is_system = messages[0]["role"] == "system"
    if tools:
        out.append("<|im_start|>system\n")
        if first_is_system:
            out.append(messages[0]["content"] + "\n\n")
        out.append(_QWEN3_TOOLS_HEAD)
        for tool in tools:
            out.append("\n" + _tojson(tool))
        out.append(_QWEN3_TOOLS_TAIL)
    elif first_is_system:
        out.append("<|im_start|>system\n" + messages[0]["content"] + "<|im_end|>\n")
    last_query = n - 1  # the last user message that is not only tool responses
    for index in range(n - 1, -1, -1):
        message = messages[index]
        content = message["content"]
        if message["role"] == "user" and not (
            content.startswith("<tool_response>") and content.endswith("</tool_response>")
        ):
            last_query = index
            break
    for i, message in enumerate(messages):
        role, content = message["role"], message["content"]
        if role == "user" or (role == "system" and i > 0):
            out.append("<|im_start|>" + role + "\n" + content + "<|im_end|>\n")
        elif role == "assistant":
            reasoning = message.get("reasoning_content")
            if not isinstance(reasoning, str):
                reasoning = ""
                if "</think>" in content:
                    reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                    content = content.split("</think>")[-1].lstrip("\n")
            if i > last_query and (i == n - 1 or reasoning):
                out.append(
                    "<|im_start|>assistant\n<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
                )
            else:
                out.append("<|im_start|>assistant\n" + content)
            for j, call in enumerate(message.get("tool_calls") or ()):
                if j > 0 or content:
                    out.append("\n")
                fn = _call_function(call, defined_only=False)
                out.append(
                    '<tool_call>\n{"name": "' + fn["name"] + '", "arguments": ' + _arguments(fn) + "}\n</tool_call>"
                )
            out.append("<|im_end|>\n")
        elif role == "tool":
            if i == 0 or messages[i - 1]["role"] != "tool":
                out.append("<|im_start|>user")
            out.append("\n<tool_response>\n" + content + "\n</tool_response>")
            if i == n - 1 or messages[i + 1]["role"] != "tool":
                out.append("<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
        if enable_thinking is False:
            out.append("<think>\n\n</think>\n\n")
    return "".join(out)


# --- gateway_workers/rendering/templates/qwen3_chatml_tools.jinja (the built-in template) -----------

_BUILTIN_TOOLS_HEAD = (
    "# Tools\n\nYou can call the functions whose JSON signatures are listed inside <tools></tools>:\n<tools>"
)
_BUILTIN_TOOLS_TAIL = (
    "\n</tools>\n\nTo call functions, reply with one JSON object per call, each inside <tool_call></tool_call> "
    'tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def render_builtin(messages: Messages, tools: Tools, add_generation_prompt: bool, enable_thinking: Any = None) -> str:
    out: list[str] = []
    first_system: str | None = None
    rest = messages
    if messages and messages[0]["role"] == "system":
        first_system, rest = messages[0]["content"], messages[1:]
    if tools:
        catalog = "".join("\n" + _tojson(tool) for tool in tools)
        preamble = first_system + "\n\n" if first_system else ""
        out.append("<|im_start|>system\n" + preamble + _BUILTIN_TOOLS_HEAD + catalog + _BUILTIN_TOOLS_TAIL)
        out.append("<|im_end|>\n")
    elif first_system is not None:
        out.append("<|im_start|>system\n" + first_system + "<|im_end|>\n")
    n = len(rest)
    for k, message in enumerate(rest):
        role, text = message["role"], message["content"]
        if role in ("user", "system"):
            out.append("<|im_start|>" + role + "\n" + text + "<|im_end|>\n")
        elif role == "assistant":
            out.append("<|im_start|>assistant\n")
            reasoning = message.get("reasoning_content")
            if isinstance(reasoning, str):
                out.append("<think>\n" + reasoning.strip("\n") + "\n</think>\n\n")
            text = text.lstrip("\n")
            out.append(text)
            for j, call in enumerate(message.get("tool_calls") or ()):
                fn = _call_function(call, defined_only=True)
                if text or j > 0:
                    out.append("\n")
                out.append(
                    '<tool_call>\n{"name": "' + fn["name"] + '", "arguments": ' + _arguments(fn) + "}\n</tool_call>"
                )
            out.append("<|im_end|>\n")
        elif role == "tool":
            if k == 0 or rest[k - 1]["role"] != "tool":
                out.append("<|im_start|>user")
            out.append("\n<tool_response>\n" + text + "\n</tool_response>")
            if k == n - 1 or rest[k + 1]["role"] != "tool":
                out.append("<|im_end|>\n")
        else:
            raise ValueError(f"unsupported message role {role!r}")  # the template raises too: let Jinja say it
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
        if enable_thinking is False:
            out.append("<think>\n\n</think>\n\n")
    return "".join(out)


QWEN3_TRL_SHA256 = "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8"
BUILTIN_SHA256 = "9198f41c7002e01aa77a8436ebb38083788ab65a192f778d4e90a8fbbade85a0"
NATIVE_TEMPLATES: dict[str, NativeTemplate] = {
    QWEN3_TRL_SHA256: NativeTemplate("qwen3", render_qwen3, frozenset({"enable_thinking"})),
    BUILTIN_SHA256: NativeTemplate("builtin-qwen3-chatml", render_builtin, frozenset({"enable_thinking"})),
}


def native_template(template: str) -> NativeTemplate | None:
    """The twin registered for exactly this template text, if any."""
    return NATIVE_TEMPLATES.get(template_sha256(template))
