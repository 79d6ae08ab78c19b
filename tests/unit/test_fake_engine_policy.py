"""The fake engine's Qwen3 policy (tests/fake_engine.py): schema-valid tool arguments and its test controls.

Coding-agent harnesses validate a call's arguments against the tool's JSON schema before they run it, so the
fake must send arguments valid for real tool schemas (enums, arrays, nested objects, $ref, anyOf, bounds).
Validated with the small validator below and, where it is installed, with `jsonschema` too.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import fake_engine as fake
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from processes import TestProcess
from tokenizers import Tokenizer

try:
    import jsonschema
except ImportError:  # a transitive test dependency only: the validator below is the one relied on
    jsonschema = None

DRAFT7 = "http://json-schema.org/draft-07/schema#"

# opencode (zod -> JSON schema): todowrite's todos and webfetch's format enum.
TODOWRITE = {
    "type": "object",
    "properties": {
        "todos": {
            "type": "array",
            "description": "The updated todo list",
            "items": {
                "type": "object",
                "properties": {
                    "content": {"type": "string", "description": "Brief description of the task"},
                    "status": {"type": "string", "enum": ["pending", "in_progress", "completed", "cancelled"]},
                    "priority": {"type": "string", "enum": ["high", "medium", "low"]},
                    "id": {"type": "string"},
                },
                "required": ["content", "status", "priority", "id"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["todos"],
    "additionalProperties": False,
    "$schema": DRAFT7,
}
WEBFETCH = {
    "type": "object",
    "properties": {
        "url": {"type": "string", "description": "The URL to fetch content from"},
        "format": {"type": "string", "enum": ["text", "markdown", "html"], "default": "markdown"},
        "timeout": {"type": "number", "description": "Optional timeout in seconds (max 120)"},
    },
    "required": ["url", "format"],
    "additionalProperties": False,
    "$schema": DRAFT7,
}
# Claude Code: Bash (timeout in milliseconds, optional), WebFetch (url with format uri), TodoWrite.
BASH = {
    "type": "object",
    "properties": {
        "command": {"type": "string", "description": "The command to execute"},
        "timeout": {"type": "number", "description": "Optional timeout in milliseconds (max 600000)"},
        "description": {"type": "string"},
        "run_in_background": {"type": "boolean"},
    },
    "required": ["command"],
    "additionalProperties": False,
    "$schema": DRAFT7,
}
CLAUDE_WEBFETCH = {
    "type": "object",
    "properties": {"url": {"type": "string", "format": "uri"}, "prompt": {"type": "string"}},
    "required": ["url", "prompt"],
    "additionalProperties": False,
    "$schema": DRAFT7,
}
CLAUDE_TODOWRITE = {
    "type": "object",
    "properties": {
        "todos": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "content": {"type": "string", "minLength": 1},
                    "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]},
                    "activeForm": {"type": "string", "minLength": 1},
                },
                "required": ["content", "status", "activeForm"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["todos"],
    "additionalProperties": False,
    "$schema": DRAFT7,
}
# Codex CLI's shell: the command is an argv array. Qwen Code's run_shell_command: a required boolean.
CODEX_SHELL = {
    "type": "object",
    "properties": {
        "command": {"type": "array", "items": {"type": "string"}},
        "workdir": {"type": "string"},
        "timeout_ms": {"type": "number"},
    },
    "required": ["command"],
    "additionalProperties": False,
}
QWEN_SHELL = {
    "type": "object",
    "properties": {
        "command": {"type": "string"},
        "is_background": {"type": "boolean"},
        "directory": {"type": "string"},
    },
    "required": ["command", "is_background"],
}
# pydantic (an MCP server): $defs, Optional[...] as anyOf with null, a bounded integer.
PYDANTIC = {
    "$defs": {
        "Point": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 3}, "y": {"type": "number"}},
            "required": ["x", "y"],
            "title": "Point",
        },
        "Mode": {"type": "string", "enum": ["fast", "exact"], "title": "Mode"},
    },
    "type": "object",
    "properties": {
        "where": {"$ref": "#/$defs/Point"},
        "mode": {"$ref": "#/$defs/Mode"},
        "label": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 4}]},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
    },
    "required": ["where", "mode", "label"],
}
# Nesting, oneOf, allOf, a type list, const, legacy definitions, bounds, tuples, nullable, untyped.
NESTED = {
    "type": "object",
    "definitions": {"Tag": {"type": "string", "const": "v1"}},
    "properties": {
        "outer": {
            "type": "object",
            "properties": {
                "inner": {
                    "type": "object",
                    "properties": {"depth": {"type": "integer", "exclusiveMinimum": 100}, "flag": {"type": "boolean"}},
                    "required": ["depth", "flag"],
                },
                "skip": {"type": "string"},
            },
            "required": ["inner"],
        },
        "choice": {"oneOf": [{"type": "integer", "maximum": 2}, {"type": "string", "minLength": 50}]},
        "both": {"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
                           {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
        "maybe": {"type": ["null", "integer"], "exclusiveMaximum": 3},
        "tag": {"$ref": "#/definitions/Tag"},
        "empty": {"type": "array", "items": {"type": "string"}, "maxItems": 0},
        "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "boolean"}], "items": False},
        "many": {"type": "array", "items": {"type": "number", "multipleOf": 0.5, "minimum": 7.2}, "minItems": 2},
        "nothing": {"type": "null"},
        "anything": {},
        "short": {"type": "string", "maxLength": 3},
        "when": {"type": "string", "format": "date-time"},
    },
    "required": ["outer", "choice", "both", "maybe", "tag", "empty", "pair", "many", "nothing", "anything", "short",
                 "when"],
    "additionalProperties": False,
}

def _nest(levels: int, leaf: dict[str, Any]) -> dict[str, Any]:
    for _ in range(levels):
        leaf = {"type": "object", "properties": {"in": leaf, "other": {"type": "string"}}, "required": ["in"]}
    return leaf


# Six objects deep, a $ref to a $ref to anyOf(null, $ref to an enum): resolving does not eat into the nesting bound.
DEEP = {
    "$defs": {
        "Mode": {"type": "string", "enum": ["fast", "exact"]},
        "Opt": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/Mode"}]},
        "Alias": {"$ref": "#/$defs/Opt", "description": "an alias"},
    },
    **_nest(6, {"$ref": "#/$defs/Alias"}),
}
SCHEMAS = {
    "deep": DEEP,
    "todowrite": TODOWRITE,
    "webfetch": WEBFETCH,
    "Bash": BASH,
    "WebFetch": CLAUDE_WEBFETCH,
    "TodoWrite": CLAUDE_TODOWRITE,
    "shell": CODEX_SHELL,
    "run_shell_command": QWEN_SHELL,
    "pydantic": PYDANTIC,
    "nested": NESTED,
}
QUERIES = ["List the files", "empty", "a much longer question about several things"]


# --- a small JSON schema validator (the keywords the schemas above use) ----------------------------------


def errors(value: Any, schema: Any, root: dict[str, Any] | None = None, at: str = "$") -> list[str]:
    """Why `value` is not valid for `schema` (draft 7 / 2020-12 keywords), [] when it is."""
    root = schema if root is None else root
    if schema is True or schema == {}:
        return []
    if schema is False:
        return [f"{at}: no value allowed"]
    out: list[str] = []
    if "$ref" in schema:
        node: Any = root
        for part in schema["$ref"].lstrip("#").split("/")[1:]:
            node = node[part]
        out += errors(value, node, root, at)
    if "const" in schema and value != schema["const"]:
        out.append(f"{at}: {value!r} is not the const {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{at}: {value!r} not in {schema['enum']}")
    kinds = schema.get("type")
    if kinds is not None:
        kinds = kinds if isinstance(kinds, list) else [kinds]
        if not any(_is(value, k) for k in kinds):
            return out + [f"{at}: {value!r} is not of type {kinds}"]
    for part in schema.get("allOf", []):
        out += errors(value, part, root, at)
    if "anyOf" in schema and not any(not errors(value, b, root, at) for b in schema["anyOf"]):
        out.append(f"{at}: {value!r} matches no anyOf branch")
    if "oneOf" in schema and sum(not errors(value, b, root, at) for b in schema["oneOf"]) != 1:
        out.append(f"{at}: {value!r} does not match exactly one oneOf branch")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", math.inf):
            out.append(f"{at}: {value!r} has the wrong length")
        if schema.get("format") in ("uri", "url") and not re.match(r"https?://[^ ]+$", value):
            out.append(f"{at}: {value!r} is not a uri")
        if schema.get("format") == "date-time" and not re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$", value):
            out.append(f"{at}: {value!r} is not a date-time")
    if _is(value, "number"):
        if (value < schema.get("minimum", -math.inf) or value > schema.get("maximum", math.inf)
                or value <= schema.get("exclusiveMinimum", -math.inf)
                or value >= schema.get("exclusiveMaximum", math.inf)):
            out.append(f"{at}: {value!r} is out of bounds")
        step = schema.get("multipleOf")
        if step is not None and abs(value / step - round(value / step)) > 1e-9:
            out.append(f"{at}: {value!r} is not a multiple of {step}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", math.inf):
            out.append(f"{at}: {len(value)} items")
        prefix = schema.get("prefixItems", [])
        for i, item in enumerate(value):
            sub = prefix[i] if i < len(prefix) else schema.get("items", {})
            out += errors(item, sub, root, f"{at}[{i}]")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        out += [f"{at}: {name!r} is required" for name in schema.get("required", []) if name not in value]
        for name, item in value.items():
            sub = props.get(name, schema.get("additionalProperties", True))
            out += errors(item, sub, root, f"{at}.{name}")
    return out


def _is(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    python = {"string": str, "boolean": bool, "array": list, "object": dict, "null": type(None)}[kind]
    return isinstance(value, python)


def assert_valid(value: Any, schema: dict[str, Any]) -> None:
    assert errors(value, schema) == [], (value, errors(value, schema))
    json.dumps(value, allow_nan=False)  # it goes into the reply as JSON
    if jsonschema is not None:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls(schema, format_checker=cls.FORMAT_CHECKER).validate(value)


def arguments(name: str, query: str = "List the files", n: int = 0) -> dict[str, Any]:
    return fake._arguments({"name": name, "parameters": SCHEMAS[name]}, query, n)


# --- the arguments ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("query", QUERIES)
@pytest.mark.parametrize("n", [0, 1])
def test_arguments_are_valid_for_real_tool_schemas(name: str, query: str, n: int) -> None:
    assert_valid(fake._arguments({"name": name, "parameters": SCHEMAS[name]}, query, n), SCHEMAS[name])


def test_required_properties_only_strings_keep_the_query_and_enums_take_their_first_value() -> None:
    assert arguments("Bash") == {"command": "List the files #0"}  # no timeout: 12 would be 12 ms
    assert arguments("Bash", n=1) == {"command": "List the files #1"}
    assert arguments("run_shell_command") == {"command": "List the files #0", "is_background": False}
    assert arguments("webfetch") == {"url": "List the files #0", "format": "text"}
    assert arguments("WebFetch") == {"url": "https://example.com/", "prompt": "List the files #0"}
    assert arguments("shell") == {"command": ["List the files #0"]}
    assert arguments("todowrite") == {
        "todos": [{"content": "List the files #0", "status": "pending", "priority": "high", "id": "List the files #0"}]
    }
    assert arguments("pydantic") == {"where": {"x": 3, "y": 14}, "mode": "fast", "label": "List"}


def test_nested_schema_values() -> None:
    got = arguments("nested", "ab", 0)
    assert got["outer"] == {"inner": {"depth": 101, "flag": False}}  # "skip" is optional
    assert got["choice"] == 2 and got["both"] == {"a": "ab #0", "b": 2} and got["maybe"] == 2
    assert got["tag"] == "v1" and got["empty"] == [] and got["pair"] == [2, False]
    assert got["many"] == [7.5, 7.5] and got["nothing"] is None and got["anything"] == "ab #0"
    assert got["short"] == "ab " and got["when"] == "2024-01-01T00:00:00Z"


def test_deep_refs_resolve() -> None:
    got = arguments("deep")
    for _ in range(6):
        got = got["in"]
    assert got == "fast"


def test_a_schema_without_properties_keeps_the_query_argument() -> None:
    for params in ({}, {"type": "object"}, {"type": "object", "properties": {}}):
        assert fake._arguments({"name": "t", "parameters": params}, "hi there", 1) == {"query": "hi there #1"}
    closed = {"type": "object", "properties": {}, "additionalProperties": False}
    assert fake._arguments({"name": "t", "parameters": closed}, "hi", 0) == {}
    optional_only = {"type": "object", "properties": {"days": {"type": "integer"}}}
    assert fake._arguments({"name": "t", "parameters": optional_only}, "hi", 0) == {}


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"me": {"$ref": "#"}}, "required": ["me"]},  # infinitely nested
        {"$ref": "#"},
        {"allOf": [{"$ref": "#"}] * 20, "properties": {"x": {"allOf": [{"$ref": "#"}] * 20}}, "required": ["x"]},
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "properties": {"x": {"$ref": "#/$defs/a"}},
         "required": ["x"]},
        {"properties": {"x": {"type": "array", "minItems": 10**9, "items": {"type": "array", "minItems": 10**9,
                                                                               "items": {"$ref": "#/properties/x"}}}},
         "required": ["x"]},
        {"properties": {"x": {"type": "string", "minLength": 10**9}, "y": {"$ref": "http://example.com/s.json"},
                        "z": {"anyOf": "junk", "type": 7}, "w": {"type": "integer", "minimum": 5, "maximum": 1}},
         "required": ["x", "y", "z", "w", 12]},
    ],
)
def test_hostile_schemas_end_quickly(schema: dict[str, Any]) -> None:
    start = time.monotonic()
    got = fake._arguments({"name": "t", "parameters": schema}, "q", 0)
    assert time.monotonic() - start < 2.0
    assert isinstance(got, dict) and len(json.dumps(got)) < 10**7


@given(
    kind=st.sampled_from(["integer", "number"]),
    low=st.none() | st.integers(-40, 40),
    high=st.none() | st.integers(-40, 40),
    exclusive=st.booleans(),
    step=st.none() | st.integers(1, 7),
    query=st.text(max_size=30),
    n=st.integers(0, 3),
)
def test_numbers_land_within_satisfiable_bounds(kind, low, high, exclusive, step, query, n) -> None:
    schema: dict[str, Any] = {"type": kind}
    if low is not None:
        schema["exclusiveMinimum" if exclusive else "minimum"] = low
    if high is not None:
        schema["exclusiveMaximum" if exclusive else "maximum"] = high
    if step is not None:
        schema["multipleOf"] = step
    span = range((low if low is not None else -100) - 1, (high if high is not None else 100) + 2)
    assume(any(not errors(v, schema) for v in span))  # some integer satisfies them all
    tool = {"name": "t", "parameters": {"type": "object", "properties": {"v": schema}, "required": ["v"]}}
    got = fake._arguments(tool, query, n)["v"]
    assert errors(got, schema) == []
    if not any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")):
        assert got == n + len(query)


def test_tools_keep_the_whole_parameters_schema(qwen3_tokenizer) -> None:
    tools = [{"type": "function", "function": {"name": name, "description": "d", "parameters": schema}}
             for name, schema in SCHEMAS.items()]
    text = qwen3_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools, tokenize=False,
                                               add_generation_prompt=True)
    assert fake._tools(text) == [{"name": name, "parameters": schema} for name, schema in SCHEMAS.items()]


# --- the policy end to end: reply() on prompts rendered by the real Qwen3 template ---------------------------

CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)
HARNESS_TOOLS = ["Task", "Bash", "WebFetch", "TodoWrite", "webfetch", "todowrite"]


@pytest.fixture(scope="module")
def state(qwen3_tokenizer_dir: str) -> fake.State:
    tok = Tokenizer.from_file(str(Path(qwen3_tokenizer_dir) / "tokenizer.json"))
    return fake.State(tokenizer=tok, eos_id=tok.token_to_id("<|im_end|>"), tool_rounds=2)


def _tool(name: str) -> dict[str, Any]:
    schema = SCHEMAS.get(name) or {"type": "object", "properties": {"prompt": {"type": "string"},
                                                                    "subagent_type": {"type": "string"}},
                                   "required": ["prompt", "subagent_type"]}
    return {"type": "function", "function": {"name": name, "description": f"The {name} tool.", "parameters": schema}}


def prompt(tokenizer: Any, query: str, tools: list[str] | None = None, results: int = 0) -> list[int]:
    """A rendered conversation: a user query, then `results` rounds of a Bash call and its result."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": query}]
    for i in range(results):
        call = {"type": "function", "function": {"name": "Bash", "arguments": {"command": f"echo {i}"}}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": str(i)}]
    tools = HARNESS_TOOLS if tools is None else tools
    ids = tokenizer.apply_chat_template(messages, tools=[_tool(t) for t in tools], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def text_of(state: fake.State, ids: list[int]) -> str:
    assert ids[-1] == state.eos_id
    return state.tokenizer.decode(ids[:-1], skip_special_tokens=False)


def calls_of(text: str) -> list[dict[str, Any]]:
    return [json.loads(c) for c in CALL.findall(text)]


QUESTIONS = ["List the files", "What is in README?", "Fix the failing test", "Count lines", "Run it", "Why?"]


@pytest.mark.parametrize("query", QUESTIONS)
def test_default_replies_call_tools_with_valid_arguments(state, qwen3_tokenizer, query: str) -> None:
    text = text_of(state, fake.reply(state, prompt(qwen3_tokenizer, query), 4096)[0])
    assert text.startswith("<think>\nStep 1: ")
    calls = calls_of(text)
    assert 1 <= len(calls) <= 2
    for call in calls:
        assert_valid(call["arguments"], _tool(call["name"])["function"]["parameters"])
    assert fake.reply(state, prompt(qwen3_tokenizer, query), 4096) == fake.reply(
        state, prompt(qwen3_tokenizer, query), 4096, fake.Policy())  # no controls: the same reply


@pytest.mark.parametrize("query", QUESTIONS)
def test_prefer_tools_calls_the_first_declared_preferred_tool_once(state, qwen3_tokenizer, query: str) -> None:
    policy = fake.Policy(prefer_tools=["Shell", "Bash", "Task"])  # Shell is not declared: Bash, before Task
    for results in (0, 1):
        calls = calls_of(text_of(state, fake.reply(state, prompt(qwen3_tokenizer, query, results=results), 4096,
                                                   policy)[0]))
        first_words = " ".join(query.split()[:3])
        assert calls == [{"name": "Bash", "arguments": {"command": f"{first_words} #0"}}]
    # Two results answered (tool_rounds=2): the final answer, whatever is preferred.
    final = text_of(state, fake.reply(state, prompt(qwen3_tokenizer, query, results=2), 4096, policy)[0])
    assert calls_of(final) == [] and "Final answer after 2 tool results" in final
    # None of the preferred tools declared: the digest picks, as without a policy.
    bare = prompt(qwen3_tokenizer, query, tools=["webfetch", "todowrite"])
    assert fake.reply(state, bare, 4096, policy) == fake.reply(state, bare, 4096)


def test_arguments_override_merges_over_the_generated_ones(state, qwen3_tokenizer) -> None:
    policy = fake.Policy(prefer_tools=["TodoWrite"], arguments={"TodoWrite": {"todos": []}, "Bash": {"x": 1}})
    calls = calls_of(text_of(state, fake.reply(state, prompt(qwen3_tokenizer, "Plan it"), 4096, policy)[0]))
    assert calls == [{"name": "TodoWrite", "arguments": {"todos": []}}]
    policy = fake.Policy(prefer_tools=["Bash"], arguments={"Bash": {"command": "echo alpha", "timeout": 5000}})
    calls = calls_of(text_of(state, fake.reply(state, prompt(qwen3_tokenizer, "List the files"), 4096, policy)[0]))
    assert calls == [{"name": "Bash", "arguments": {"command": "echo alpha", "timeout": 5000}}]
    # Without prefer_tools the override applies to whichever calls the digest makes.
    everywhere = fake.Policy(arguments={name: {"marker": name} for name in HARNESS_TOOLS})
    for query in QUESTIONS:
        for call in calls_of(text_of(state, fake.reply(state, prompt(qwen3_tokenizer, query), 4096, everywhere)[0])):
            assert call["arguments"]["marker"] == call["name"]


@pytest.mark.parametrize("results", [0, 2])  # a tool-call reply, then a final answer
def test_think_false_drops_the_think_block(state, qwen3_tokenizer, results: int) -> None:
    ids = prompt(qwen3_tokenizer, "List the files", results=results)
    thinking = text_of(state, fake.reply(state, ids, 4096)[0])
    plain = text_of(state, fake.reply(state, ids, 4096, fake.Policy(think=False))[0])
    assert thinking.startswith("<think>\n") and "<think>" not in plain and "</think>" not in plain
    assert thinking.split("</think>\n\n", 1)[1] == plain
    assert plain.startswith("<tool_call>\n" if results == 0 else "Final answer after 2 tool results: ")
    quiet = fake.State(tokenizer=state.tokenizer, eos_id=state.eos_id, tool_rounds=2, think=False)  # --no-think
    assert text_of(quiet, fake.reply(quiet, ids, 4096)[0]) == plain
    assert text_of(quiet, fake.reply(quiet, ids, 4096, fake.Policy(think=True))[0]) == thinking


def test_policies_are_scoped_and_counted_like_faults(state) -> None:
    scoped = fake.State(tokenizer=state.tokenizer, eos_id=state.eos_id, tool_rounds=2)
    everyone, mine = fake.Policy(think=False), fake.Policy(key="k", prefer_tools=["Bash"], times=2)
    scoped.policies += [everyone, mine]
    assert fake._policy_for(scoped, "other") is everyone and fake._policy_for(scoped, None) is everyone
    assert [fake._policy_for(scoped, "k") for _ in range(3)] == [mine, mine, fake.Policy()]
    assert fake._fault_for(scoped, "k") == fake.Fault()  # a separate list
    with pytest.raises(ValueError):
        fake.Policy(prefer_tools="Bash")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        fake.Policy(arguments={"Bash": "echo"})  # type: ignore[dict-item]


def test_config_route_sets_and_resets_policies(state, qwen3_tokenizer) -> None:
    from starlette.testclient import TestClient

    served = fake.State(tokenizer=state.tokenizer, eos_id=state.eos_id, tool_rounds=2)
    ids = prompt(qwen3_tokenizer, "List the files")
    body = {"token_ids": ids, "sampling_params": {"max_tokens": 4096}, "request_id": "r"}
    with TestClient(fake.build_app(served)) as client:
        policy = {"key": "k", "prefer_tools": ["Bash"], "arguments": {"Bash": {"command": "echo alpha"}},
                  "think": False, "times": 1}
        assert client.post("/_fake/config", json={"policy": policy}).status_code == 200
        assert served.policies == [fake.Policy(**policy)]

        def sample(key: str) -> str:
            answer = client.post("/inference/v1/generate", json=body, headers={"x-smg-routing-key": key}).json()
            return text_of(served, answer["choices"][0]["token_ids"])

        assert sample("k") == '<tool_call>\n{"name": "Bash", "arguments": {"command": "echo alpha"}}\n</tool_call>'
        assert sample("k") == sample("other") == text_of(served, fake.reply(served, ids, 4096)[0])  # times ran out
        client.post("/_fake/config", json={"policy": {"think": False}})
        assert "<think>" not in sample("any")
        client.post("/_fake/config", json={"reset": True})
        assert served.policies == [] and sample("any").startswith("<think>\n")


def test_no_think_flag(qwen3_tokenizer_dir: str, qwen3_tokenizer) -> None:
    script = Path(fake.__file__)
    args = [sys.executable, "-u", str(script), "--port", "0", "--tokenizer", qwen3_tokenizer_dir, "--no-think"]
    with TestProcess(args, name="fake_engine_no_think") as process:
        url = process.expect(r"FAKE ENGINE READY (\S+)", 30.0).group(1)
        ids = prompt(qwen3_tokenizer, "List the files", results=2)
        body = json.dumps({"token_ids": ids, "sampling_params": {"max_tokens": 4096}}).encode()
        req = urllib.request.Request(url + "/inference/v1/generate", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            out = json.loads(resp.read())["choices"][0]["token_ids"]
    tok = Tokenizer.from_file(str(Path(qwen3_tokenizer_dir) / "tokenizer.json"))
    assert tok.decode(out, skip_special_tokens=False).startswith("Final answer after 2 tool results: ")
