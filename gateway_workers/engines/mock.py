"""The built-in mock engine: a GPU-less `serve` and load tests, with real token ids of the worker's tokenizer.

Replies are Qwen3-format assistant messages (optional `<think>` block, text or JSON
`<tool_call>` blocks) encoded with the worker's tokenizer and ended with its eos id, so
they parse, render back and train like a real model's. Everything is a pure function of
(config seed, prompt ids, request seed): the same prompt always gets the same reply and
the same logprobs, which are multiples of 1/1024 and so exact in float32. Delays are a
fixed time plus a per-token time; `stream` yields one token per step after the same delays.
Stop strings are not simulated. Tools are read from the `<tools>` block of the rendered
prompt (our template and Qwen3's put one JSON per line).
Must not import the app, adapters or the backplane; the tokenizer is passed in.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import random
import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, Protocol

from gateway_workers.engines.base import (
    EngineAborted,
    EngineChunk,
    EngineResult,
    FaultKind,
    FinishReason,
    SamplingParams,
)
from gateway_workers.engines.config import EngineConfig

logger = logging.getLogger(__name__)

_WORDS = (
    "the agent checks each result before it answers and keeps the plan short so that every step "
    "is easy to verify with a tool or a quick look at the data while the task stays on track"
).split()
_TOOLS_OPEN, _TOOLS_CLOSE = "<tools>\n", "\n</tools>"
_TOOL_SCAN_TOKENS = 8192  # tools live in the system prompt, at the start
_TOOL_CACHE_SIZE = 256  # distinct system prompts remembered (one per agent type, typically)
_LOGPROB_STEPS = 8192  # logprobs are -k/1024 for k in [1, 8192): exact in float32


class MockTokenizer(Protocol):
    """What the mock needs from the worker's tokenizer."""

    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def convert_tokens_to_ids(self, token: str) -> int | None: ...


class MockEngine:
    """Deterministic fake generations with configurable delay, think blocks and tool calls."""

    def __init__(self, config: EngineConfig, tokenizer: MockTokenizer) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("the mock engine needs a tokenizer with an eos token")
        self._config = config
        self._tokenizer = tokenizer
        self._eos = int(tokenizer.eos_token_id)
        im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
        assistant = tokenizer.encode("assistant", add_special_tokens=False)
        # ChatML: a generation prompt is <|im_start|> followed by the single token "assistant".
        self._turn_marker = (im_start, assistant[0]) if isinstance(im_start, int) and len(assistant) == 1 else None
        self._tools_cache: OrderedDict[bytes, list[dict[str, Any]]] = OrderedDict()
        self.faults: Counter[tuple[str, FaultKind]] = Counter()  # the mock never fails: always empty
        self.replicas: tuple[str, ...] = ()
        self._stops: dict[str, asyncio.Event] = {}  # generations in flight, set when `abort` stops one
        self._running: asyncio.Event | None = None  # cleared while paused (`pause_replica`); made on first use
        self._paused_s = 0.0  # seconds its own pause lasted, those ended
        self._paused_at = 0.0

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, session_id: str, request_id: str, replica: str = ""
    ) -> EngineResult:
        ids = prompt_ids if isinstance(prompt_ids, array) and prompt_ids.typecode == "i" else array("i", prompt_ids)
        result = self.reply(ids, params)
        delay = self._config.mock_delay_s + self._config.mock_per_token_s * len(result.output_ids)
        if delay > 0:
            started, paused_before = time.monotonic(), self._paused_s
            with self._stoppable(request_id) as stop:
                stopped = await _stopped(stop, delay)
                # Its own pause samples nothing: the time a pause held it is added to its pace.
                owed = 0.0 if stopped else await self._held_since(paused_before)
                while owed > 0 and not stopped:
                    paused_before += owed
                    stopped = await _stopped(stop, owed)
                    owed = 0.0 if stopped else await self._held_since(paused_before)
            if stopped:
                # What it had sampled by now, at its per-token pace (after the first token's delay).
                per_token = self._config.mock_per_token_s
                sampling = time.monotonic() - started - (self._paused_s - paused_before) - self._config.mock_delay_s
                n = min(max(int(sampling / per_token if per_token else 0), 0), len(result.output_ids))
                raise EngineAborted(result.output_ids[:n], result.logprobs[:n])
        elif self._running is not None:  # its own pause holds a whole generation before its answer
            await self._running.wait()
        return result

    async def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, session_id: str, request_id: str, replica: str = ""
    ) -> AsyncIterator[EngineChunk]:
        ids = prompt_ids if isinstance(prompt_ids, array) and prompt_ids.typecode == "i" else array("i", prompt_ids)
        result = self.reply(ids, params)
        with self._stoppable(request_id) as stop:
            if self._config.mock_delay_s > 0 and await _stopped(stop, self._config.mock_delay_s):
                raise EngineAborted([], [])
            last = len(result.output_ids) - 1
            for i, (token, logprob) in enumerate(zip(result.output_ids, result.logprobs, strict=True)):
                if self._config.mock_per_token_s > 0 and await _stopped(stop, self._config.mock_per_token_s):
                    raise EngineAborted([], [])
                if self._running is not None:  # its own pause holds it at its next token
                    await self._running.wait()
                yield EngineChunk([token], [logprob], result.finish_reason if i == last else None)
            if last < 0:
                yield EngineChunk([], [], result.finish_reason)

    @contextlib.contextmanager
    def _stoppable(self, request_id: str) -> Iterator[asyncio.Event]:
        """The event `abort` sets to stop a generation in flight."""
        stop = self._stops[request_id] = asyncio.Event()
        try:
            yield stop
        finally:
            self._stops.pop(request_id, None)

    async def abort(self, request_id: str, *, session_id: str, replica: str = "") -> None:
        stop = self._stops.get(request_id)
        if stop is not None:
            stop.set()

    async def _held_since(self, paused_before: float) -> float:
        """Seconds its own pause held it since `paused_before` (the pauses ended; one in force is waited out)."""
        if self._running is not None:
            await self._running.wait()
        return self._paused_s - paused_before

    async def pause_replica(self, replica: str) -> None:
        if self._running is None:
            self._running = asyncio.Event()
        if self._running.is_set() or not self._paused_at:
            self._paused_at = time.monotonic()
        self._running.clear()

    async def resume_replica(self, replica: str, weight_version: int | None) -> None:
        if self._running is not None and not self._running.is_set():
            self._paused_s += time.monotonic() - self._paused_at
            self._running.set()

    def forget_sessions(self, sessions: list[str]) -> None:
        pass  # it keeps nothing per session

    async def aclose(self) -> None:
        return None

    def reply(self, prompt_ids: array, params: SamplingParams) -> EngineResult:
        """The deterministic reply to a prompt (no delay)."""
        digest = hashlib.blake2b(prompt_ids.tobytes(), digest_size=16)
        digest.update(f"{self._config.seed}/{params.seed}".encode())
        rng = random.Random(digest.digest())
        text = self._reply_text(prompt_ids, rng)
        ids = self._tokenizer.encode(text, add_special_tokens=False) + [self._eos]
        finish: FinishReason = "stop"
        if len(ids) > params.max_tokens:
            ids, finish = ids[: max(params.max_tokens, 0)], "length"
        logprobs = [-rng.randrange(1, _LOGPROB_STEPS) / 1024.0 for _ in ids]
        return EngineResult(output_ids=ids, logprobs=logprobs, finish_reason=finish)

    def _reply_text(self, prompt_ids: array, rng: random.Random) -> str:
        n = self._config.mock_output_tokens
        text = ""
        if self._config.mock_think:
            text = "<think>\n" + _sentence(rng, max(n // 2, 1)) + "\n</think>\n\n"
        tools = self._tools(prompt_ids) if self._config.mock_tool_call_every else []
        if tools and self._assistant_turns(prompt_ids) % self._config.mock_tool_call_every == 0:
            calls = [_call(rng.choice(tools), rng) for _ in range(rng.choice((1, 1, 2)))]
            return text + "\n".join(f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>" for c in calls)
        return text + _sentence(rng, n)

    def _assistant_turns(self, prompt_ids: array) -> int:
        """Assistant headers in the prompt, the generation prompt included (1 on a first turn)."""
        if self._turn_marker is None:
            return 1
        # A byte search over the packed ids: a Python loop over a 24k-token prompt would stall the loop.
        raw, pattern = prompt_ids.tobytes(), array("i", self._turn_marker).tobytes()
        count, at = 0, raw.find(pattern)
        while at >= 0:
            if at % prompt_ids.itemsize == 0:  # aligned on a token boundary
                count += 1
            at = raw.find(pattern, at + 1)
        return max(count, 1)

    def _tools(self, prompt_ids: array) -> list[dict[str, Any]]:
        head = prompt_ids[:_TOOL_SCAN_TOKENS]
        key = hashlib.blake2b(head.tobytes(), digest_size=16).digest()
        cached = self._tools_cache.get(key)
        if cached is not None:
            self._tools_cache.move_to_end(key)
            return cached
        tools = _parse_tools(self._tokenizer.decode(head.tolist(), skip_special_tokens=False))
        self._tools_cache[key] = tools
        if len(self._tools_cache) > _TOOL_CACHE_SIZE:
            self._tools_cache.popitem(last=False)
        return tools


def _sentence(rng: random.Random, words: int) -> str:
    out = " ".join(rng.choice(_WORDS) for _ in range(words))
    return out[:1].upper() + out[1:] + "."


def _parse_tools(text: str) -> list[dict[str, Any]]:
    """Function signatures from a rendered `<tools>` block: [{"name", "properties"}]."""
    # str.find, not a lazy regex: that would rescan the rest of the prompt from every unclosed `<tools>`.
    start = text.find(_TOOLS_OPEN)
    end = text.find(_TOOLS_CLOSE, start + len(_TOOLS_OPEN)) if start >= 0 else -1
    if end < 0:
        return []
    tools = []
    for line in text[start + len(_TOOLS_OPEN) : end].splitlines():
        try:
            spec = json.loads(line)
        except ValueError:
            continue
        fn = spec.get("function", spec) if isinstance(spec, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            props = props if isinstance(props, dict) else {}
            tools.append({"name": fn["name"], "properties": props})
    return tools


def _call(tool: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """A call of `tool` with arguments of the declared JSON types."""
    arguments: dict[str, Any] = {}
    for name, schema in tool["properties"].items():
        kind = schema.get("type") if isinstance(schema, dict) else None
        if kind == "integer":
            arguments[name] = rng.randrange(100)
        elif kind == "number":
            arguments[name] = rng.randrange(1000) / 8
        elif kind == "boolean":
            arguments[name] = rng.random() < 0.5
        else:
            arguments[name] = rng.choice(_WORDS)
    return {"name": tool["name"], "arguments": arguments}


async def _stopped(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds` (the mock's pace); whether `abort` stopped the generation first."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except asyncio.TimeoutError:
        return False
    return True
