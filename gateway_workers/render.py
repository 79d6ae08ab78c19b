"""Rendering: canonical messages + tools -> prompt token ids, with the tokenizer's own chat template.

Sits on the seam between the wire adapters (which produce canonical messages, see
`broker.protocol.CommitTurn`) and the engines (which take token ids). The template text
is rendered first and then encoded without added special tokens, which equals
`apply_chat_template(tokenize=True)` and keeps the text for the response parser's prefix.
`Renderer.render` is safe to call from worker threads (the app uses run_in_threadpool).
Must not import the app, adapters, engines or the backplane.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

CANONICAL_ROLES = frozenset({"system", "user", "assistant", "tool"})


class RenderError(ValueError):
    """The conversation cannot be rendered with this chat template (bad shape or a template refusal): a 400."""


class TemplateConfigError(Exception):
    """The chat template itself is broken (syntax error): fix the template file, no request can succeed."""


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """A rendered prompt: the ids the engine sees and the text they encode (the parser's prefix)."""

    prompt_ids: array  # array('i'), the same packed form the protocol ships
    text: str


class Renderer:
    """Renders canonical conversations with one tokenizer's chat template.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        template_kwargs: extra variables every render passes to the template (e.g. enable_thinking).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template_kwargs: Mapping[str, Any] | None = None) -> None:
        if not tokenizer.chat_template:
            raise TemplateConfigError("the tokenizer has no chat template")
        self._tokenizer = tokenizer
        self._template_kwargs = dict(template_kwargs or {})
        # The Rust tokenizer's encode borrows immutably, so worker threads can share it; the Python
        # wrapper may touch truncation/padding state, which is not thread-safe.
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        try:
            tokenizer.apply_chat_template(
                [{"role": "user", "content": "ping"}], tokenize=False, add_generation_prompt=True
            )
        except jinja2.TemplateSyntaxError as e:
            raise TemplateConfigError(f"chat template syntax error: {e}") from e

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> RenderedPrompt:
        """Render canonical messages (+ OpenAI function tools) into prompt ids, ending with the generation prompt."""
        chat = template_messages(messages)
        tool_list = _check_tools(tools)
        kwargs = {**self._template_kwargs, **(template_kwargs or {})}
        try:
            text = self._tokenizer.apply_chat_template(
                chat,
                tools=tool_list,  # type: ignore[arg-type]  # plain dicts; HF's hint is invariant
                add_generation_prompt=True,
                tokenize=False,
                **kwargs,
            )
        except jinja2.TemplateError as e:
            raise RenderError(f"the chat template refused this conversation: {e}") from e
        except (TypeError, ValueError, KeyError) as e:
            raise RenderError(f"cannot render this conversation: {e}") from e
        if not isinstance(text, str):
            raise RenderError(f"chat template rendered {type(text).__name__}, expected text")
        return RenderedPrompt(prompt_ids=array("i", self.encode(text)), text=text)

    def encode(self, text: str) -> list[int]:
        """Token ids of already-rendered template text (no special tokens added)."""
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return self._tokenizer.encode(text, add_special_tokens=False)


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Canonical messages -> the dicts HF chat templates read (reasoning_content, function-wrapped calls)."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise RenderError("messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise RenderError(f"messages[{i}] must be an object")
        role = message.get("role")
        if role not in CANONICAL_ROLES:
            raise RenderError(f"messages[{i}].role must be one of {sorted(CANONICAL_ROLES)}, got {role!r}")
        content = message.get("content", "")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise RenderError(f"messages[{i}].content must be a string")
        item: dict[str, Any] = {"role": role, "content": content}
        reasoning = message.get("reasoning")
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise RenderError(f"messages[{i}].reasoning must be a string")
            item["reasoning_content"] = reasoning
        calls = message.get("tool_calls")
        if calls:
            item["tool_calls"] = [_template_call(i, j, call) for j, call in enumerate(_as_list(i, calls))]
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise RenderError(f"messages[{i}].name must be a string")
            item["name"] = name
        out.append(item)
    return out


def _as_list(i: int, calls: object) -> list[Any]:
    if not isinstance(calls, list):
        raise RenderError(f"messages[{i}].tool_calls must be a list")
    return calls


def _template_call(i: int, j: int, call: object) -> dict[str, Any]:
    if not isinstance(call, Mapping):
        raise RenderError(f"messages[{i}].tool_calls[{j}] must be an object")
    name, arguments = call.get("name"), call.get("arguments", {})
    if not isinstance(name, str) or not name:
        raise RenderError(f"messages[{i}].tool_calls[{j}].name must be a non-empty string")
    # Arguments are an object canonically; a string is passed through verbatim (templates print it as is).
    if not isinstance(arguments, (Mapping, str)):
        raise RenderError(f"messages[{i}].tool_calls[{j}].arguments must be an object")
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _check_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise RenderError("tools must be a list")
    out = []
    for k, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise RenderError(f"tools[{k}] must be an object")
        fn = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(fn, Mapping):
            raise RenderError(f"tools[{k}] must be a function tool: {{'type': 'function', 'function': {{...}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RenderError(f"tools[{k}].function.name must be a non-empty string")
        out.append(dict(tool))
    return out
