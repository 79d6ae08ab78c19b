"""Each dialect's tool declarations -> a `ToolSet` (`adapters.tools`): what is declared, mapped back, or hosted.

Chat Completions: `function` and `custom` tools, and `web_search_options` (hosted). Anthropic Messages: the
agent's own tools (no `type`, or `custom`); the typed tools Anthropic knows, and `mcp_servers`, are hosted.
Responses: `function`, `custom` and `namespace` tools; the other types OpenAI knows are hosted. A type no rule
of `request_fields` knows is a 400. Pure translation; errors are 400s naming `tools`.
"""

from __future__ import annotations

from typing import Any

from gateway_workers.adapters import request_fields
from gateway_workers.adapters.common import bad, invalid_type, missing, wrong_value
from gateway_workers.adapters.tools import NO_TOOLS, ToolCollector, ToolSet, tool_list

MAX_ANTHROPIC_NAME = 128  # the Messages API's own bound on a tool's name (OpenAI's is 64)
# Ignored fields of tool definitions, counted by their place's name.
_CHAT_FUNCTION_IGNORED = request_fields.ignored_fields("chat", "tools[function].function")
_MESSAGES_TOOL_IGNORED = request_fields.ignored_fields("messages", "tools[custom]")
_RESPONSES_TOOL_IGNORED = request_fields.ignored_fields("responses", "tools[function]")


def chat_tools(raw: Any, web_search: Any) -> ToolSet:
    """Chat Completions: function and custom tools; `web_search_options` asks for a hosted one."""
    if web_search is None and (raw is None or raw == []):
        return NO_TOOLS
    collector = ToolCollector()
    if web_search is not None:
        collector.hosted_tool("web_search_options", "web_search")
    for i, tool in enumerate(tool_list(raw)):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind is None and isinstance(tool, dict):
            raise missing(f"{where}.type", "tools")
        if kind == "function":
            fn = tool.get("function")
            if not isinstance(fn, dict):
                raise missing(f"{where}.function", "tools") if fn is None else invalid_type(
                    f"{where}.function", "an object", fn, "tools")
            collector.notice(fn, _CHAT_FUNCTION_IGNORED, "tools.function")
            collector.function(fn.get("name"), fn.get("description"), fn.get("parameters"), where)
        elif kind == "custom":
            custom = tool.get("custom")
            if not isinstance(custom, dict):
                raise missing(f"{where}.custom", "tools") if custom is None else invalid_type(
                    f"{where}.custom", "an object", custom, "tools")
            collector.custom_tool(custom.get("name"), custom.get("description"), custom.get("format"), where)
        elif not isinstance(tool, dict):
            raise invalid_type(where, "an object", tool, "tools")
        else:
            raise wrong_value(f"{where}.type", kind, ("function", "custom"), "tools")
    return collector.result()


def messages_tools(raw: Any, mcp_servers: Any) -> ToolSet:
    """Anthropic Messages: the agent's own tools (no `type`, or `custom`); every typed tool Anthropic knows is
    hosted, and so are `mcp_servers`."""
    if (raw is None or raw == []) and not mcp_servers:
        return NO_TOOLS
    collector = ToolCollector(max_name=MAX_ANTHROPIC_NAME)
    for i in range(len(mcp_servers) if isinstance(mcp_servers, list) else 0):
        collector.hosted_tool(f"mcp_servers[{i}]", "mcp")
    for i, tool in enumerate(tool_list(raw)):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid_type(where, "an object", tool, "tools")
        kind = tool.get("type", "custom")
        if kind not in ("custom", None):
            if not isinstance(kind, str):
                raise invalid_type(f"{where}.type", "a string", kind, "tools")
            if request_fields.verdict("messages", f"tools[{kind}]") != "hosted":
                raise bad(f"{where}.type: unknown tool type {kind!r} (a tool of the agent's own has no type, or "
                          "'custom')", "tools", "invalid_value")
            collector.hosted_tool(where, kind)
            continue
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise missing(f"{where}.input_schema", "tools") if schema is None else invalid_type(
                f"{where}.input_schema", "an object", schema, "tools")
        if schema.get("type") != "object":
            raise bad(f"tools: tool {tool.get('name')!r}: input_schema.type must be 'object'", "tools", "invalid_value")
        collector.notice(tool, _MESSAGES_TOOL_IGNORED)
        collector.function(tool.get("name"), tool.get("description"), schema, where)
    toolset = collector.result()
    names = [tool["function"]["name"] for tool in toolset.tools or ()]
    if len(set(names)) < len(names):
        raise bad("tools: tool names must be unique", "tools", "invalid_value")
    return toolset


def _responses_tool(collector: ToolCollector, tool: Any, where: str, namespace: str | None = None) -> None:
    if not isinstance(tool, dict):
        raise invalid_type(where, "an object", tool, "tools")
    kind = tool.get("type")
    if kind == "function":
        collector.notice(tool, _RESPONSES_TOOL_IGNORED)
        collector.function(tool.get("name"), tool.get("description"), tool.get("parameters"), where, namespace)
    elif kind == "custom":
        collector.notice(tool, _RESPONSES_TOOL_IGNORED)
        collector.custom_tool(tool.get("name"), tool.get("description"), tool.get("format"), where, namespace)
    elif kind == "namespace" and namespace is None:
        name, tools = tool.get("name"), tool.get("tools")
        if not isinstance(name, str) or not name:
            raise missing(f"{where}.name", "tools")
        if not isinstance(tools, list):
            raise missing(f"{where}.tools", "tools") if tools is None else invalid_type(
                f"{where}.tools", "an array", tools, "tools")
        for j, inner in enumerate(tools):
            _responses_tool(collector, inner, f"{where}.tools[{j}]", name)
    elif not isinstance(kind, str):
        raise missing(f"{where}.type", "tools") if kind is None else invalid_type(f"{where}.type", "a string", kind,
                                                                                 "tools")
    elif namespace is not None:
        raise wrong_value(f"{where}.type", kind, ("function", "custom"), "tools")
    elif request_fields.verdict("responses", f"tools[{kind}]") == "hosted":
        collector.hosted_tool(where, kind)
    else:
        raise bad(f"{where}.type: unknown tool type {kind!r}", "tools", "invalid_value")


def responses_tools(raw: Any) -> ToolSet:
    """OpenAI Responses: function, custom and namespace tools; every other type it knows is hosted."""
    if raw is None or raw == []:
        return NO_TOOLS
    collector = ToolCollector()
    for i, tool in enumerate(tool_list(raw)):
        _responses_tool(collector, tool, f"tools[{i}]")
    return collector.result()
