"""Benchmark harness: the three agent dialects the load generator speaks, as pluggable classes.

A dialect owns one agent's conversation in its own wire shape: the request body and headers,
reading a reply (JSON or SSE) into a `Reply`, and appending the echo of the reply plus the tool
results for the next turn. `chat` = OpenAI Chat Completions, `messages` = Anthropic Messages,
`responses` = OpenAI Responses. Stdlib + orjson + aiohttp only; used by scripts/loadgen.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

# What the official SDKs send on every first attempt: the gateway then names the request for its retries
# (a digest of its body), so agents are measured at what SDK agents cost.
SDK_FIRST_ATTEMPT = {"x-stainless-retry-count": "0"}
SEARCH = {
    "name": "search",
    "description": "Search the corpus.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
}


@dataclass
class Reply:
    """What an agent received for one turn."""

    text: str = ""
    reasoning: str = ""
    calls: list[tuple[str, str, str]] = field(default_factory=list)  # (call id, name, arguments json)
    completion_tokens: int = 0
    raw: Any = None  # the dialect's own reply object, echoed back verbatim where the dialect allows it


async def sse_events(reply: aiohttp.ClientResponse) -> AsyncIterator[Any]:
    """Decoded `data:` payloads of an SSE body (stops at [DONE])."""
    async for raw in reply.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield orjson.loads(data)


class Dialect:
    """One wire API; subclasses fill in the shapes."""

    name = ""
    path = ""

    def __init__(self, echo_reasoning: bool) -> None:
        self.echo_reasoning = echo_reasoning

    def start(self, system: str, user: str) -> dict[str, Any]:
        raise NotImplementedError

    def headers(self, sid: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {sid}", "Content-Type": "application/json", **SDK_FIRST_ATTEMPT}

    def body(self, state: dict[str, Any], max_tokens: int, stream: bool) -> dict[str, Any]:
        raise NotImplementedError

    async def read(self, reply: aiohttp.ClientResponse, stream: bool) -> Reply:
        raise NotImplementedError

    def advance(self, state: dict[str, Any], reply: Reply, tool_output: str, user_text: str) -> None:
        raise NotImplementedError


class Chat(Dialect):
    name, path = "chat", "/chat/completions"

    def start(self, system: str, user: str) -> dict[str, Any]:
        return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}

    def body(self, state: dict[str, Any], max_tokens: int, stream: bool) -> dict[str, Any]:
        body = {
            "model": "bench",
            "messages": state["messages"],
            "tools": [{"type": "function", "function": SEARCH}],
            "max_tokens": max_tokens,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def read(self, reply: aiohttp.ClientResponse, stream: bool) -> Reply:
        out = Reply()
        if not stream:
            data = orjson.loads(await reply.read())
            message = data["choices"][0]["message"]
            out.text = message.get("content") or ""
            out.reasoning = message.get("reasoning_content") or ""
            out.calls = [
                (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or ()
            ]
            out.completion_tokens = data["usage"]["completion_tokens"]
            return out
        calls: dict[int, list[str]] = {}
        async for chunk in sse_events(reply):
            if chunk.get("usage"):
                out.completion_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                out.text += delta.get("content") or ""
                out.reasoning += delta.get("reasoning_content") or ""
                for call in delta.get("tool_calls") or ():
                    entry = calls.setdefault(call["index"], ["", "", ""])
                    entry[0] = call.get("id") or entry[0]
                    fn = call.get("function") or {}
                    entry[1] += fn.get("name") or ""
                    entry[2] += fn.get("arguments") or ""
        out.calls = [tuple(calls[i]) for i in sorted(calls)]  # type: ignore[misc]
        return out

    def advance(self, state: dict[str, Any], reply: Reply, tool_output: str, user_text: str) -> None:
        echo: dict[str, Any] = {"role": "assistant", "content": reply.text}
        if self.echo_reasoning and reply.reasoning:
            echo["reasoning_content"] = reply.reasoning
        if reply.calls:
            echo["tool_calls"] = [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in reply.calls
            ]
        state["messages"].append(echo)
        for call_id, _, _ in reply.calls:
            state["messages"].append({"role": "tool", "tool_call_id": call_id, "content": tool_output})
        if not reply.calls:
            state["messages"].append({"role": "user", "content": user_text})


class Messages(Dialect):
    name, path = "messages", "/messages"

    def headers(self, sid: str) -> dict[str, str]:
        return {"x-api-key": sid, "anthropic-version": "2023-06-01", "Content-Type": "application/json",
                **SDK_FIRST_ATTEMPT}

    def start(self, system: str, user: str) -> dict[str, Any]:
        return {"system": system, "messages": [{"role": "user", "content": user}]}

    def body(self, state: dict[str, Any], max_tokens: int, stream: bool) -> dict[str, Any]:
        tool = {"name": SEARCH["name"], "description": SEARCH["description"], "input_schema": SEARCH["parameters"]}
        return {
            "model": "bench",
            "system": state["system"],
            "messages": state["messages"],
            "tools": [tool],
            "max_tokens": max_tokens,
            "stream": stream,
        }

    async def read(self, reply: aiohttp.ClientResponse, stream: bool) -> Reply:
        if not stream:
            data = orjson.loads(await reply.read())
            blocks = data["content"]
            tokens = data["usage"]["output_tokens"]
        else:
            blocks, tokens = [], 0
            partial: dict[int, str] = {}
            async for event in sse_events(reply):
                kind = event.get("type")
                if kind == "content_block_start":
                    blocks.append(dict(event["content_block"]))
                elif kind == "content_block_delta":
                    block, delta = blocks[event["index"]], event["delta"]
                    if delta["type"] == "text_delta":
                        block["text"] = block.get("text", "") + delta["text"]
                    elif delta["type"] == "thinking_delta":
                        block["thinking"] = block.get("thinking", "") + delta["thinking"]
                    elif delta["type"] == "signature_delta":
                        block["signature"] = delta["signature"]
                    elif delta["type"] == "input_json_delta":
                        partial[event["index"]] = partial.get(event["index"], "") + delta["partial_json"]
                elif kind == "message_delta":
                    tokens = event["usage"]["output_tokens"]
            for index, text in partial.items():
                blocks[index]["input"] = orjson.loads(text or "{}")
        out = Reply(completion_tokens=tokens, raw=blocks)
        for block in blocks:
            if block["type"] == "text":
                out.text += block["text"]
            elif block["type"] == "thinking":
                out.reasoning += block["thinking"]
            elif block["type"] == "tool_use":
                out.calls.append((block["id"], block["name"], orjson.dumps(block["input"]).decode()))
        return out

    def advance(self, state: dict[str, Any], reply: Reply, tool_output: str, user_text: str) -> None:
        blocks = [b for b in reply.raw if self.echo_reasoning or b["type"] != "thinking"]
        state["messages"].append({"role": "assistant", "content": blocks or [{"type": "text", "text": ""}]})
        if reply.calls:
            results = [{"type": "tool_result", "tool_use_id": i, "content": tool_output} for i, _, _ in reply.calls]
            state["messages"].append({"role": "user", "content": results})
        else:
            state["messages"].append({"role": "user", "content": user_text})


class Responses(Dialect):
    name, path = "responses", "/responses"

    def start(self, system: str, user: str) -> dict[str, Any]:
        return {"instructions": system, "input": [{"role": "user", "content": user}]}

    def body(self, state: dict[str, Any], max_tokens: int, stream: bool) -> dict[str, Any]:
        return {
            "model": "bench",
            "instructions": state["instructions"],
            "input": state["input"],
            "tools": [{"type": "function", **SEARCH}],
            "max_output_tokens": max_tokens,
            "stream": stream,
        }

    async def read(self, reply: aiohttp.ClientResponse, stream: bool) -> Reply:
        if not stream:
            data = orjson.loads(await reply.read())
        else:
            data = None
            async for event in sse_events(reply):
                if event.get("type") == "response.completed":
                    data = event["response"]
            if data is None:
                raise RuntimeError("the Responses stream ended without response.completed")
        out = Reply(completion_tokens=data["usage"]["output_tokens"], raw=data["output"])
        for item in data["output"]:
            if item["type"] == "message":
                out.text += "".join(p.get("text", "") for p in item["content"])
            elif item["type"] == "reasoning":
                out.reasoning += "".join(p.get("text", "") for p in item.get("content") or ())
            elif item["type"] == "function_call":
                out.calls.append((item["call_id"], item["name"], item["arguments"]))
        return out

    def advance(self, state: dict[str, Any], reply: Reply, tool_output: str, user_text: str) -> None:
        state["input"] += [i for i in reply.raw if self.echo_reasoning or i["type"] != "reasoning"]
        for call_id, _, _ in reply.calls:
            state["input"].append({"type": "function_call_output", "call_id": call_id, "output": tool_output})
        if not reply.calls:
            state["input"].append({"role": "user", "content": user_text})


DIALECTS: dict[str, type[Dialect]] = {d.name: d for d in (Chat, Messages, Responses)}
