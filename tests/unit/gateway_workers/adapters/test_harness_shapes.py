"""What real harnesses send, through each adapter: custom and namespaced tools there and back, hosted tools left out,
ignored fields named, and system messages inside an Anthropic conversation.

The shapes are Codex CLI's (a `namespace` tool, `client_metadata`, developer messages, reasoning items with
`encrypted_content`, a `web_search` tool), Claude Code's (a system message after the first user message, a
`clear_at` one, `cache_control`, `defer_loading`, server tools) and the OpenAI SDKs' custom (freeform) tools.
A call the model writes comes back in the shape the agent declared its tool in, and the agent's echo of it
converts to the same canonical call, so the next prompt renders what was sampled.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from gateway_workers.adapters import anthropic_messages, openai_chat, openai_responses
from gateway_workers.adapters.common import from_list
from gateway_workers.engines.base import EngineResult
from gateway_workers.formats import ParsedResponse
from gateway_workers.formats.parsed import LiveDelta
from gateway_workers.http.errors import ApiError
from gateway_workers.turns.captured import CapturedTurn, TurnRequest, tool_call_id

SCHEMA = {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}
GRAMMAR = {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}
NAMESPACE = {"type": "namespace", "name": "multi_agent", "description": "Sub-agents.",
             "tools": [{"type": "function", "name": "spawn", "description": "Spawn one.", "parameters": SCHEMA}]}
CUSTOM = {"type": "custom", "name": "apply_patch", "description": "Patch files.", "format": GRAMMAR}
PATCH = "*** Begin Patch\n*** End Patch"


def _captured(calls: list[dict[str, Any]]) -> CapturedTurn:
    result = EngineResult(output_ids=[1, 2], logprobs=[-0.5] * 2, finish_reason="stop")
    return CapturedTurn("sid", "f" * 32, TurnRequest(messages=[]), [7] * 4, result,
                        ParsedResponse(content="", tool_calls=calls), created=1)


def _events(stream: Any) -> list[dict[str, Any]]:
    async def collect() -> list[bytes]:
        return [chunk async for chunk in stream]

    out = []
    for chunk in asyncio.run(collect()):
        out += [json.loads(line[6:]) for line in chunk.decode().splitlines()
                if line.startswith("data: ") and line != "data: [DONE]"]
    return out


def _live(turn: CapturedTurn) -> Any:
    deltas = [LiveDelta("tool_call", call=call) for call in turn.parsed.tool_calls]
    return SimpleNamespace(turn_id=turn.turn_id, created=1, prompt_ids=turn.prompt_ids, turn=turn,
                           deltas=lambda: from_list(deltas))


def test_responses_namespace_and_custom_tools_are_declared_flat_and_answered_in_their_own_shape():
    request = openai_responses.parse_request({"input": "hi", "tools": [NAMESPACE, CUSTOM, {"type": "web_search"}],
                                              "client_metadata": {"turn_id": "t"}})
    names = [tool["function"]["name"] for tool in request.turn.tools]
    assert names == ["multi_agent__spawn", "apply_patch"]
    patch_schema = request.turn.tools[1]["function"]["parameters"]
    assert patch_schema["required"] == ["input"] and "start: /.+/" in patch_schema["properties"]["input"]["description"]
    assert request.hosted == (("tools[2]", "web_search"),)
    assert request.ignored == ("client_metadata",)
    turn = _captured([{"name": "multi_agent__spawn", "arguments": {"cmd": "ls"}},
                      {"name": "apply_patch", "arguments": {"input": PATCH}}])
    output = json.loads(openai_responses.response_body(turn, request, "m"))["output"]
    assert output[0]["type"] == "function_call" and (output[0]["namespace"], output[0]["name"]) == ("multi_agent",
                                                                                                  "spawn")
    assert output[1] == {"id": output[1]["id"], "type": "custom_tool_call", "name": "apply_patch", "input": PATCH,
                         "call_id": tool_call_id("call_", turn.turn_id, 1)}
    events = _events(openai_responses.stream_events(_live(turn), request, "m"))
    kinds = [e["type"] for e in events]
    assert "response.custom_tool_call_input.done" in kinds
    assert next(e for e in events if e["type"] == "response.function_call_arguments.done")["name"] == "spawn"
    assert events[-1]["response"]["output"] == output
    # the agent echoes both calls and answers them: the same canonical calls as the reply's
    echo = [{"type": "message", "role": "user", "content": "hi"}, *output,
            {"type": "function_call_output", "call_id": output[0]["call_id"], "output": "spawned"},
            {"type": "custom_tool_call_output", "call_id": output[1]["call_id"], "output": "patched"}]
    again = openai_responses.parse_request({"input": echo, "tools": [NAMESPACE, CUSTOM]})
    assert again.turn.messages[1]["tool_calls"] == turn.parsed.tool_calls
    assert [m.get("name") for m in again.turn.messages[2:]] == ["multi_agent__spawn", "apply_patch"]


def test_an_output_that_answers_no_call_is_its_named_tools_result():
    """Codex puts its goal in the conversation as an output of a namespaced tool, without a call id."""
    goal = {"type": "function_call_output", "name": "goal_objective", "namespace": "agent", "output": "Ship it."}
    request = openai_responses.parse_request({"input": [{"role": "user", "content": "hi"}, goal]})
    assert request.turn.messages[1] == {"role": "tool", "content": "Ship it.", "name": "agent__goal_objective"}


def test_a_custom_call_the_model_wrote_without_its_input_comes_back_as_its_arguments_text():
    request = openai_responses.parse_request({"input": "hi", "tools": [CUSTOM]})
    turn = _captured([{"name": "apply_patch", "arguments": {"patch": PATCH}}])
    [item] = json.loads(openai_responses.response_body(turn, request, "m"))["output"]
    assert json.loads(item["input"]) == {"patch": PATCH}


def test_chat_custom_tools_there_and_back():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "custom", "custom": {"name": "apply_patch", "format": {"type": "text"}}},
                      {"type": "function", "function": {"name": "run", "parameters": SCHEMA, "strict": True}}],
            "web_search_options": {}}
    request = openai_chat.parse_request(body)
    assert [t["function"]["name"] for t in request.turn.tools] == ["apply_patch", "run"]
    assert request.hosted == (("web_search_options", "web_search"),)
    assert request.ignored == ("model", "tools.function.strict")
    turn = _captured([{"name": "apply_patch", "arguments": {"input": PATCH}},
                      {"name": "run", "arguments": {"cmd": "ls"}}])
    calls = json.loads(openai_chat.response_body(turn, request, "m"))["choices"][0]["message"]["tool_calls"]
    assert calls[0]["type"] == "custom" and calls[0]["custom"] == {"name": "apply_patch", "input": PATCH}
    assert calls[1]["type"] == "function"
    streamed = [c for e in _events(openai_chat.stream_events(_live(turn), request, "m"))
                for choice in e.get("choices", []) for c in choice["delta"].get("tool_calls", [])]
    assert [c["type"] for c in streamed] == ["custom", "function"]
    echo = {**body, "messages": [*body["messages"], {"role": "assistant", "content": None, "tool_calls": calls},
                                 {"role": "tool", "tool_call_id": calls[0]["id"], "content": "ok"},
                                 {"role": "tool", "tool_call_id": calls[1]["id"], "content": "ok"}]}
    assert openai_chat.parse_request(echo).turn.messages[1]["tool_calls"] == turn.parsed.tool_calls


def test_chat_sampling_extensions_are_honoured_and_template_variables_ignored():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "frequency_penalty": 0.5,
            "presence_penalty": -1, "repetition_penalty": 1.05, "min_p": 0.1, "logit_bias": {"42": -100},
            "chat_template_kwargs": {"enable_thinking": False}}
    request = openai_chat.parse_request(body)
    assert request.turn.sampling == {"frequency_penalty": 0.5, "presence_penalty": -1.0, "repetition_penalty": 1.05,
                                     "min_p": 0.1, "logit_bias": {"42": -100.0}}
    assert openai_chat.parse_request({"model": "m", "messages": body["messages"]}).turn.sampling is None
    assert set(request.ignored) == {"model", "chat_template_kwargs"}


def test_anthropic_typed_tools_are_hosted_and_the_agents_own_tools_kept():
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "Bash", "input_schema": SCHEMA, "defer_loading": True, "cache_control": {}},
                      {"type": "bash_20250124", "name": "bash"}, {"type": "web_fetch_20250910", "name": "fetch"},
                      {"type": "custom", "name": "Read", "input_schema": SCHEMA}],
            "mcp_servers": [{"type": "url", "url": "https://mcp", "name": "m"}]}
    request = anthropic_messages.parse_request(body)
    assert [t["function"]["name"] for t in request.turn.tools] == ["Bash", "Read"]
    assert request.hosted == (("mcp_servers[0]", "mcp"), ("tools[1]", "bash_20250124"),
                              ("tools[2]", "web_fetch_20250910"))
    assert set(request.ignored) == {"model", "tools.defer_loading", "tools.cache_control"}


def test_a_tool_search_result_names_the_tools_it_found():
    """Claude Code's ToolSearch answers with `tool_reference` blocks; every tool is declared up front here, so
    each stands for its tool's name (refusing them made Claude Code retry, then rewrite its history)."""
    use = {"type": "tool_use", "id": "toolu_1", "name": "ToolSearch", "input": {"query": "web"}}
    found = {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "tool_reference", "tool_name": "WebSearch"},
                         {"type": "tool_reference", "tool_name": "WebFetch", "cache_control": {"type": "ephemeral"}}]}
    body = {"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "find a tool"}, {"role": "assistant", "content": [use]},
        {"role": "user", "content": [found, {"type": "text", "text": "Tool loaded."}]}]}
    messages = anthropic_messages.parse_request(body).turn.messages
    assert messages[2] == {"role": "tool", "content": "WebSearch\nWebFetch", "name": "ToolSearch"}
    # only in a tool result: a user turn of its own cannot hold one
    body["messages"][2]["content"] = [{"type": "tool_reference", "tool_name": "WebSearch"}]
    with pytest.raises(ApiError):
        anthropic_messages.parse_request(body)


def test_anthropic_system_messages_stay_where_they_stand_until_cleared():
    def body(*messages: dict[str, Any]) -> dict[str, Any]:
        return {"model": "m", "max_tokens": 8, "system": "Top.", "messages": list(messages)}

    user = {"role": "user", "content": "first"}
    env = {"role": "system", "content": [{"type": "text", "text": "env", "cache_control": {"type": "ephemeral"}}]}
    hint = {"role": "system", "content": "hint", "clear_at": "next_user_message"}
    reply = {"role": "assistant", "content": "ok"}
    parsed = anthropic_messages.parse_request(body(user, env, hint))
    assert [(m["role"], m["content"]) for m in parsed.turn.messages] == [
        ("system", "Top."), ("user", "first"), ("system", "env"), ("system", "hint")]
    assert "messages.content.cache_control" in parsed.ignored
    # once a later user message exists the hint is no longer shown, with or without the previous parse
    later = body(user, env, hint, reply, {"role": "user", "content": "next"})
    alone = anthropic_messages.parse_request(later)
    assert [m["content"] for m in alone.turn.messages] == ["Top.", "first", "env", "ok", "next"]
    later["messages"][:3] = parsed.raw_messages  # the session's previous body's own objects, as http.bodies shares
    later["system"] = parsed.raw_system
    assert anthropic_messages.parse_request(later, earlier=parsed).turn.messages == alone.turn.messages
