"""Families whose templates render no tools: the reply is text, ended by the family's stop token.

Their templates ignore a `tools` argument, so a request that declares tools is refused with a 400
(`supports_tools=False`) rather than answered by a model that never saw them. Each is a header the
generation prompt ends with, the tokens a reply may end on, and how the template trims the text it
writes back. DeepSeek-V3's template is DeepSeek-R1's (`deepseek.py`). Imports only
`formats.base`/`live_split`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from gateway_workers.formats.base import ResponseFormat
from gateway_workers.formats.live_split import TagGrammar, TagSplitter


def _no_calls(body: str) -> str | int:
    return 0  # text only: nothing in it can be a half-parsed call


def plain_format(name: str, anchor: str, end_markers: tuple[str, ...], trimmed: bool) -> ResponseFormat:
    """A text-only format; `trimmed`: the template writes the text back `| trim`med."""
    text = {"content": "text", "content_args": {"strip": False}}
    trim = None if trimmed else ""

    def finish(content: str, reasoning: str | None) -> tuple[str, str | None]:
        return (content.strip() if trimmed else content), None

    template: dict[str, Any] = {"version": 1, "start_anchor": anchor, "fields": {"content": text}}
    return ResponseFormat(
        name, anchor, end_markers, template, check=_no_calls, finish=finish, supports_tools=False, reasoning=False,
        parallel_calls=False,
        live=partial(TagSplitter, TagGrammar(end_markers, content_trim_start=trim, content_trim_end=trim)),
    )


GEMMA3 = plain_format("gemma3", "<start_of_turn>model\n", ("<end_of_turn>", "<eos>"), trimmed=True)
PHI3 = plain_format("phi3", "<|assistant|>\n", ("<|end|>", "<|endoftext|>"), trimmed=False)
COHERE = plain_format(
    "cohere", "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>", ("<|END_OF_TURN_TOKEN|>", "<EOS_TOKEN>"), trimmed=True
)
# The reply sits in <|START_RESPONSE|> ... <|END_RESPONSE|>, then the turn ends.
COHERE2 = plain_format(
    "cohere2", "<|START_RESPONSE|>", ("<|END_RESPONSE|>", "<|END_OF_TURN_TOKEN|>", "<EOS_TOKEN>"), trimmed=False
)
LLAMA3 = plain_format(
    "llama3", "<|start_header_id|>assistant<|end_header_id|>\n\n", ("<|eot_id|>", "<|end_of_text|>"), trimmed=True
)
CHATML = plain_format("chatml", "<|im_start|>assistant\n", ("<|im_end|>", "<|endoftext|>"), trimmed=False)
PLAIN_FORMATS = (GEMMA3, PHI3, COHERE, COHERE2, LLAMA3, CHATML)
