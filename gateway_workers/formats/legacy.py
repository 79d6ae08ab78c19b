"""The legacy parsing engine: transformers 5.0-5.12's `response_schema`s (regex + jmespath), one per format.

transformers >= 5.13 parses with the declarative `response_template` each format carries; before that, only
these schemas parse, each the same grammar as its format's template (the tests run every family on both
engines). All that belongs to the legacy engine is here, so dropping transformers 5.12 is deleting this file
and the one branch of `formats.transformers_parsing` that imports it. A format without a schema here is served only on
>= 5.13. Imports the family modules for their grammars' shared pieces; nothing imports this but `transformers_parsing`.
"""

from __future__ import annotations

import re
from typing import Any

from gateway_workers.formats.chatml import PARAMETER
from gateway_workers.formats.checks import THINK
from gateway_workers.formats.gemma import CALL as GEMMA_CALL
from gateway_workers.formats.gemma import THOUGHT
from gateway_workers.formats.glm import ARG
from gateway_workers.formats.harmony import CALL_NAME
from gateway_workers.formats.lfm import CALLS as LFM_CALLS
from gateway_workers.formats.muse import CALL_HEADER, INVOKE_CLOSE, INVOKE_OPEN
from gateway_workers.formats.muse import PARAMETER as MUSE_PARAMETER
from gateway_workers.formats.plain import PLAIN_FORMATS

# A pattern that opens with `\s*` may start only where a run of whitespace starts: `re` has no `\G`, and
# otherwise every character of a long run is retried (see `formats.base`).
AT_SPACE_RUN = r"(?<!\s)"


def _strings(iterator: str) -> dict[str, Any]:
    return {"type": "array", "x-regex-iterator": iterator, "items": {"type": "string"}}


def _removed(*patterns: str) -> dict[str, Any]:
    """The text outside the removed regions (the declarative engine's implicit `content` region)."""
    return {"type": "string", "x-regex-substitutions": [[pattern, ""] for pattern in patterns]}


def _named_calls(iterator: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """Calls read by an iterator with groups `name` and `arguments`."""
    item = {"type": "object", "properties": {"name": {"type": "string"}, "arguments": arguments}}
    return {"type": "array", "x-regex-iterator": iterator, "items": item}


def _key_values(pattern: str) -> dict[str, Any]:
    return {"type": "object", "x-regex-key-value": pattern}


def text_blocks(think: tuple[str, str], call: tuple[str, str]) -> dict[str, Any]:
    """`base.text_blocks_template`'s grammar: a reasoning block, text, and tool-call blocks cut out as text."""
    (think_open, think_close), (call_open, call_close) = (tuple(map(re.escape, pair)) for pair in (think, call))
    return _reply(
        reasoning={"type": "string", "x-regex": f"{think_open}(.*?){think_close}"},
        tool_calls=_strings(f"{call_open}(.*?){call_close}"),
        content=_removed(f"{think_open}.*?{think_close}", f"{call_open}.*?{call_close}"),
    )


def _reply(**properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties}


_THINK = {"type": "string", "x-regex": r"<think>(.*?)</think>"}
_NOT_THINK = r"<think>.*?</think>"
_NOT_TOOL_CALL = AT_SPACE_RUN + r"\s*<tool_call>.*?</tool_call>"
# untyped: a non-object is our verdict, not an engine error
_JSON_CALLS = {"type": "array", "x-regex-iterator": r"<tool_call>(.*?)</tool_call>", "items": {"x-parser": "json"}}
_XML_CALLS = _named_calls(
    r"<tool_call>\s*<function=(?P<name>[^>\n]+)>(?P<arguments>.*?)</function>\s*</tool_call>", _key_values(PARAMETER)
)
_XML = _reply(reasoning=_THINK, tool_calls=_XML_CALLS, content=_removed(_NOT_THINK, _NOT_TOOL_CALL))
_HARMONY_CALL_HEADER = (
    r"(?:(?<![^<])|(?=<\|start\|>assistant))" + CALL_NAME
    + r"[^<]*<\|channel\|>commentary[^<]*(?:<\|constrain\|>[^<]*)?<\|message\|>"
)  # fmt: skip

# format name -> its response_schema
SCHEMAS: dict[str, dict[str, Any]] = {
    "qwen3": _reply(reasoning=_THINK, tool_calls=_JSON_CALLS, content=_removed(_NOT_THINK, _NOT_TOOL_CALL)),
    "qwen2_5": _reply(tool_calls=_JSON_CALLS, content=_removed(_NOT_TOOL_CALL)),
    "qwen3_5": _XML,
    "nemotron3": _XML,
    "deepseek_r1": _reply(reasoning=_THINK, content=_removed(_NOT_THINK)),
    "glm4_moe": _reply(
        reasoning=_THINK,
        tool_calls=_named_calls(r"<tool_call>(?P<name>[^\n<]+)(?P<arguments>.*?)</tool_call>", _key_values(ARG)),
        content=_removed(_NOT_THINK, _NOT_TOOL_CALL),
    ),
    "gpt_oss": _reply(
        reasoning=_strings(r"<\|channel\|>analysis<\|message\|>(.*?)(?:<\|end\|>|\Z)"),
        content=_strings(r"<\|channel\|>(?:final|commentary)<\|message\|>(.*?)(?:<\|end\|>|<\|return\|>|\Z)"),
        tool_calls=_named_calls(_HARMONY_CALL_HEADER + r"(?P<arguments>.*?)(?:<\|call\|>|\Z)", {"x-parser": "json"}),
    ),
    "llama3_json": _reply(
        tool_calls={
            "type": "array",
            # A call ends where its trailing spaces start: `(?<!\s)` keeps `.*?` from retrying inside them.
            "x-regex-iterator": r'(?:\A\s*(?:<\|python_tag\|>\s*)?|;\s*)(\{\s*"name"\s*:.*?)'
            r'(?<!\s)\s*(?=;\s*\{\s*"name"\s*:|\Z)',
            "items": {"x-parser": "json"},
        },
        content={"type": "string", "x-regex": r'\A(?!\s*(?:<\|python_tag\|>\s*)?\{\s*"name"\s*:)(.*)\Z'},
    ),
    "muse_glimmer": _reply(
        reasoning=_strings(r" to=self<\|message\|>(.*?)<\|eom\|>"),
        content=_strings(r" to=user<\|message\|>(.*?)(?:<\|eot\|>|\Z)"),
        tool_calls=_named_calls(
            CALL_HEADER + INVOKE_OPEN + r"(?P<arguments>.*?)" + INVOKE_CLOSE, _key_values(MUSE_PARAMETER)
        ),
    ),
    "gemma4": text_blocks(THOUGHT, GEMMA_CALL),
    "lfm2": text_blocks(THINK, LFM_CALLS),
    **{fmt.name: _reply(content={"type": "string", "x-regex": r"(?s)\A(.*)\Z"}) for fmt in PLAIN_FORMATS},
}

