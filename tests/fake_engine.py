"""A stand-in inference engine process for tests: vLLM's and SGLang's exact token-in/token-out formats.

`python tests/fake_engine.py --port 0 --tokenizer DIR` prints `FAKE ENGINE READY http://HOST:PORT`.
Routes: vLLM `POST /inference/v1/generate` + `POST /abort_requests` (its dev mode's), SGLang `POST /generate` +
`POST /abort_request` (an aborted generation answers with what it had sampled, at `token_delay` per token), each
engine's own pause and resume (vLLM's dev-mode `POST /pause?mode=abort|wait|keep`, `POST /resume`, `GET /is_paused`;
SGLang's `POST /pause_generation {"mode": "abort"|"retract"|"in_place"}`, `POST /continue_generation`,
`POST /update_weight_version {"new_version", "abort_all_requests"}`, which aborts everything unless told not to): a
paused engine samples nothing, and every token's `resumes` (the resumes before it was sampled) is logged per request,
and test controls `POST /_fake/config` (delay, per-token delay and the faults of `Fault`: HTTP errors, hangs,
dropped connections, error events, answers of the wrong kind or shape, a fixed text; scoped to a routing key so
tests sharing the process do not collide, and to a number of requests) and `GET /_fake/log` (requests, each
with the fault that struck it or None, aborts, disconnects, finished streams). `stream: true` streams one token per
step as SSE: vLLM's new-ids chunks + usage + [DONE], SGLang's cumulative events + [DONE].
Policy: tools declared and fewer than `tool_rounds` tool responses since the last user turn ->
`<think>..</think>` + one or two Qwen3 `<tool_call>`s; else a final answer; always `<|im_end|>`.
A call's arguments are valid for its tool's JSON schema (`_arguments`): the `required` properties only,
strings "<first 3 words of the query> #n" (enum/const/format/length honoured), numbers n+len(query) within
their bounds, booleans false, arrays of one item, objects recursed into; $ref/anyOf/oneOf/allOf resolved.
`POST /_fake/config {"policy": {...}}` steers the Qwen3 policy (see `Policy`, scoped and counted like a
`Fault` but separately from it): `prefer_tools` (call the first of these the prompt declares, one call per
reply), `arguments` (tool name -> values merged over the generated ones), `think` (false: no `<think>` block;
`--no-think` makes that the process default). `--format NAME` swaps in another family's writer from
tests/fake_formats.py (GLM, harmony, Llama, Qwen3.5 XML, ...): same policy, that family's syntax
and stop token (it ignores `Policy` and `--no-think`, and fills every property as before).
Ids and logprobs (k/1024: exact in float32) depend only on the prompt (and the `Policy` in force).
Depends on starlette, uvicorn and `tokenizers` only, never on the code under test.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import random
import re
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import uvicorn
from fake_arguments import arguments as _arguments  # a sibling module: stdlib only
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tokenizers import Tokenizer

READY_LINE = "FAKE ENGINE READY"
ROUTING_HEADERS = ("x-smg-routing-key", "x-session-id")
HANG_S = 3600.0  # a "hang" lasts until the client goes away or the request is aborted
DISCONNECT_POLL_S = 0.02
_TOOLS_BLOCK = re.compile(r"<tools>\n(.*?)\n</tools>", re.DOTALL)
_USER_TURN = "<|im_start|>user\n"
_WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()


# What `Fault.answer` sends instead of a proper reply (streams: from token `answer_after` on).
ANSWERS = (
    "json",  # a whole non-stream JSON body, even to a streaming request
    "sse",  # a stream, even to a non-stream request
    "garbage",  # an HTML page with status 200 (streams: appended as raw bytes, then the body ends)
    "no_ids",  # vLLM: no token_ids; SGLang: no output_token_logprobs (as if return_logprob were ignored)
    "short_logprobs",  # one logprob fewer than ids (SGLang: output_ids one longer than its logprob entries)
    "no_finish",  # no finish reason: the stream ends after the last id (and the usage, and [DONE])
    "aborted",  # the engine aborts the generation by itself: finish reason "abort" after `answer_after` ids
)
GARBAGE = b"<html><body><h1>upstream error</h1></body></html>"


@dataclass
class Fault:
    """Injected behaviour; `key` None applies to every request, else only to that routing key.

    `times` counts down on every request the entry applies to; once it reaches 0 requests are served normally.
    """

    key: str | None = None
    delay: float = 0.0
    status: int | None = None  # answer this HTTP status instead of generating
    times: int | None = None  # how many requests get this entry (None: all)
    hang: bool = False
    token_delay: float = 0.0  # streaming: seconds before each token is sent
    error_after: int | None = None  # streaming: fail with an error event after this many tokens
    drop_after: int | None = None  # close the connection after this many tokens (non-stream: halfway through the body)
    hang_after: int | None = None  # streaming: send nothing more after this many tokens, until the client leaves
    answer: str | None = None  # one of ANSWERS
    answer_after: int = 0  # streaming: the token from which `answer` applies
    text: str | None = None  # answer these words (`text_reply`), whatever the prompt: a degenerate model's output

    def __post_init__(self) -> None:
        if self.answer is not None and self.answer not in ANSWERS:
            raise ValueError(f"answer must be one of {ANSWERS}, got {self.answer!r}")

    def name(self) -> str | None:
        """What struck a request (its log entry's `fault`), None when it was answered properly."""
        if self.status is not None:
            return f"status {self.status}"
        if self.hang:
            return "hang"
        for what in ("error_after", "drop_after", "hang_after", "text"):
            if getattr(self, what) is not None:
                return what
        return self.answer


@dataclass
class Policy:
    """Test controls of the Qwen3 policy (`reply`); `key` and `times` work as in `Fault`, in their own list.

    `times` counts down on every reply the policy generates for the key (not on requests a status, hang or
    `text` fault answers). `--format` writers ignore it.
    """

    key: str | None = None
    times: int | None = None
    # Tool-call replies call the first tool of this list that the prompt declares (one call per reply, not the
    # digest's one or two); when it declares none of them, the digest picks as usual.
    prefer_tools: list[str] | None = None
    # tool name -> argument values merged over the generated ones (top-level keys replace), e.g.
    # {"Bash": {"command": "echo alpha"}}: the harness runs a known command whose output a test can look for.
    arguments: dict[str, dict[str, Any]] = field(default_factory=dict)
    think: bool | None = None  # False: no `<think>..</think>` block (calls and answers); None: the process default

    def __post_init__(self) -> None:
        if self.prefer_tools is not None and not (
            isinstance(self.prefer_tools, list) and all(isinstance(t, str) for t in self.prefer_tools)
        ):
            raise ValueError(f"prefer_tools must be a list of tool names, got {self.prefer_tools!r}")
        if not isinstance(self.arguments, dict) or not all(isinstance(a, dict) for a in self.arguments.values()):
            raise ValueError(f"arguments must map tool names to objects, got {self.arguments!r}")
        if self.think is not None and not isinstance(self.think, bool):
            raise ValueError(f"think must be a boolean, got {self.think!r}")


class InjectedDrop(Exception):
    """Raised inside a response so uvicorn drops the connection (its log of it is filtered out)."""


class _QuietDrops(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], InjectedDrop))


@dataclass
class State:
    tokenizer: Tokenizer
    eos_id: int
    tool_rounds: int
    faults: list[Fault] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    aborts: list[dict[str, Any]] = field(default_factory=list)
    disconnects: list[dict[str, Any]] = field(default_factory=list)
    streamed: list[dict[str, Any]] = field(default_factory=list)  # streams sent to their end
    stopped: list[dict[str, Any]] = field(default_factory=list)  # whole generations aborted: what they had sampled
    running: dict[str, asyncio.Event] = field(default_factory=dict)  # rid -> set on abort
    paused: bool = False  # its own pause (keep, in_place, retract): nothing is sampled until the resume
    unpaused: asyncio.Event = field(default_factory=asyncio.Event)  # set while not paused
    resumes: int = 0  # resumes so far: a token sampled after the n-th one has `resumes` n in the log
    sampled_at: dict[str, dict[str, Any]] = field(default_factory=dict)  # rid -> {key, resumes: per token}
    controls: list[dict[str, Any]] = field(default_factory=list)  # pause, resume and version calls, in order
    format: str | None = None  # a tests/fake_formats.py writer; None: the Qwen3 policy below
    weight_version: str = "default"  # what SGLang reports in meta_info (its --weight-version; set by /_fake/config)
    healthy: bool = True  # GET /health answers 200, else 503 (set by /_fake/config)
    policies: list[Policy] = field(default_factory=list)
    think: bool = True  # the Qwen3 policy's replies open with a <think> block (`--no-think`: False)


def _routing_key(request: Request) -> str | None:
    for name in ROUTING_HEADERS:
        if name in request.headers:
            return request.headers[name]
    return None


_Entry = TypeVar("_Entry", Fault, Policy)


def _entry_for(entries: list[_Entry], key: str | None) -> _Entry | None:
    """The entry scoped to `key` (else the unscoped one), counted down; None once its `times` ran out."""
    scoped = [e for e in entries if e.key is not None and e.key == key]
    for entry in scoped or [e for e in entries if e.key is None]:
        if entry.times is None:
            return entry
        if entry.times > 0:
            entry.times -= 1
            return entry
    return None


def _fault_for(state: State, key: str | None) -> Fault:
    """The entry for this request (counted down), or a plain Fault() once its `times` ran out."""
    return _entry_for(state.faults, key) or Fault()


def _policy_for(state: State, key: str | None) -> Policy:
    """The Policy for a reply to this routing key (counted down), or a plain Policy()."""
    return _entry_for(state.policies, key) or Policy()


# --- the policy -------------------------------------------------------------------------------


def _cut(ids: list[int], max_tokens: int) -> tuple[list[int], str]:
    """A generation's ids and finish reason under its max_tokens: cut there, it finished by "length"."""
    return (ids[:max_tokens], "length") if len(ids) > max_tokens else (ids, "stop")


def reply(
    state: State, prompt_ids: list[int], max_tokens: int, policy: Policy | None = None
) -> tuple[list[int], list[float], str]:
    """(output ids, logprobs, finish 'stop'|'length') for a prompt (under `policy`'s controls); deterministic."""
    policy = policy or Policy()
    digest = hashlib.sha256(json.dumps(prompt_ids).encode()).digest()
    rng = random.Random(digest)
    text = state.tokenizer.decode(prompt_ids, skip_special_tokens=False)
    if state.format is not None:
        return _format_reply(state, text, rng, digest, max_tokens)
    tools = _tools(text)
    last_user = _last_user_turn(text)
    tail = text[last_user:] if last_user >= 0 else text
    answered = tail.count("<tool_response>")
    thought = f"<think>\nStep {answered + 1}: I look at the {rng.choice(_WORDS)} case.\n</think>\n\n"
    if not (state.think if policy.think is None else policy.think):
        thought = ""  # after the rng draw above, so the rest of the reply stays the same
    if tools and answered < state.tool_rounds:
        query = _first_words(tail)
        calls = []
        picked = [tools[(digest[1] + n) % len(tools)] for n in range(1 + digest[0] % 2)]  # one or two in parallel
        preferred = _preferred(tools, policy.prefer_tools or [])
        if preferred is not None:
            picked = [preferred]
        for n, tool in enumerate(picked):
            arguments = {**_arguments(tool, query, n), **policy.arguments.get(tool["name"], {})}
            calls.append({"name": tool["name"], "arguments": arguments})
        body = "\n".join(f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>" for c in calls)
        out = thought + body
    else:
        out = thought + f"Final answer after {answered} tool results: {rng.choice(_WORDS)}."
    ids = state.tokenizer.encode(out, add_special_tokens=False).ids + [state.eos_id]
    ids, finish = _cut(ids, max_tokens)
    logprobs = [-rng.randrange(1, 8192) / 1024.0 for _ in ids]
    return ids, logprobs, finish


def text_reply(state: State, text: str, max_tokens: int) -> tuple[list[int], list[float], str]:
    """A fixed answer: `text`'s ids and the stop token (cut at `max_tokens`), with logprobs derived from them."""
    ids = state.tokenizer.encode(text, add_special_tokens=False).ids + [state.eos_id]
    ids, finish = _cut(ids, max_tokens)
    return ids, [-1.0 - (token % 64) / 64 for token in ids], finish


def _sampled(
    state: State, prompt: list[int], max_tokens: int, fault: Fault, key: str | None
) -> tuple[list[int], list[float], str]:
    if fault.text is not None:
        return text_reply(state, fault.text, max_tokens)
    return reply(state, prompt, max_tokens, None if state.format is not None else _policy_for(state, key))


def _format_reply(state: State, text: str, rng: random.Random, digest: bytes,
                  max_tokens: int) -> tuple[list[int], list[float], str]:
    import fake_formats  # a sibling module: stdlib only

    assert state.format is not None
    out, stop = fake_formats.reply_text(state.format, text, rng, digest, state.tool_rounds)
    stop_id = state.tokenizer.token_to_id(stop)
    if stop_id is None:
        raise RuntimeError(f"fake engine: the tokenizer has no {stop} token (format {state.format})")
    ids = state.tokenizer.encode(out, add_special_tokens=False).ids + [stop_id]
    ids, finish = _cut(ids, max_tokens)
    return ids, [-rng.randrange(1, 8192) / 1024.0 for _ in ids], finish


def _tools(text: str) -> list[dict[str, Any]]:
    """The declared tools, in order: {"name", "parameters": its whole JSON schema ({} if it has none)}."""
    match = _TOOLS_BLOCK.search(text)
    if match is None:
        return []
    tools = []
    for line in match.group(1).splitlines():
        try:
            spec = json.loads(line)
        except ValueError:
            continue
        fn = spec.get("function", spec)
        params = fn.get("parameters")
        tools.append({"name": fn["name"], "parameters": params if isinstance(params, dict) else {}})
    return tools


def _preferred(tools: list[dict[str, Any]], names: list[str]) -> dict[str, Any] | None:
    """The declared tool named first in `names`, if the prompt declares any of them."""
    declared = {tool["name"]: tool for tool in reversed(tools)}  # a name declared twice: its first declaration
    return next((declared[name] for name in names if name in declared), None)


def _last_user_turn(text: str) -> int:
    """Start of the last user turn that is not just tool responses."""
    at = len(text)
    while True:
        at = text.rfind(_USER_TURN, 0, at)
        if at < 0 or not text.startswith("<tool_response>", at + len(_USER_TURN)):
            return at


def _first_words(tail: str) -> str:
    body = tail[len(_USER_TURN) :].split("<|im_end|>", 1)[0]
    return " ".join(body.split()[:3]) or "empty"


# --- HTTP ----------------------------------------------------------------------------------------


async def _wait_out(state: State, request: Request, rid: str, seconds: float) -> str | None:
    """Sleep `seconds`, or less if the client disconnects ('disconnect') or the rid is aborted ('abort')."""
    aborted = state.running[rid]
    deadline = time.monotonic() + seconds
    while True:
        if aborted.is_set():
            return "abort"
        if await request.is_disconnected():
            return "disconnect"
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            await asyncio.wait_for(aborted.wait(), timeout=min(left, DISCONNECT_POLL_S))
        except asyncio.TimeoutError:
            pass


async def _generate(state: State, request: Request, api: str) -> Response:
    try:
        body = await request.json()
    except ValueError:
        return JSONResponse({"error": "body is not JSON"}, status_code=400)
    if api == "vllm":
        prompt, params = body.get("token_ids"), body.get("sampling_params")
        rid = str(body.get("request_id") or request.headers.get("x-request-id") or id(body))
        max_key = "max_tokens"
    else:
        prompt, params = body.get("input_ids"), body.get("sampling_params")
        rid, max_key = str(body.get("rid") or id(body)), "max_new_tokens"
    if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt) or not isinstance(params, dict):
        return JSONResponse({"error": "token ids and sampling_params are required"}, status_code=400)
    key = _routing_key(request)
    fault = _fault_for(state, key)
    state.requests.append(
        {"api": api, "rid": rid, "key": key, "headers": dict(request.headers), "body": body, "at": time.time(),
         "fault": fault.name(), "weight_version": state.weight_version}
    )
    if fault.status is not None:
        return JSONResponse({"error": "injected fault"}, status_code=fault.status)
    if fault.answer == "garbage" and (not body.get("stream") or fault.answer_after == 0):
        return Response(GARBAGE, media_type="text/html")
    if (body.get("stream") or fault.answer == "sse") and fault.answer != "json":
        ids, logprobs, finish = _sampled(state, prompt, int(params.get(max_key, 16)), fault, key)
        return SseReply(state, api, rid, key, body, prompt, (ids, logprobs, finish), fault)
    ids, logprobs, finish = _sampled(state, prompt, int(params.get(max_key, 16)), fault, key)
    state.running[rid] = asyncio.Event()
    sampled = 0  # at `token_delay` per token after the first delay, as a stream would send them
    log = _sampling_log(state, rid, key)
    try:
        outcome = await _wait_out(state, request, rid, HANG_S if fault.hang else fault.delay)
        while outcome is None and fault.token_delay > 0 and sampled < len(ids):
            outcome = await _wait_out(state, request, rid, fault.token_delay)
            if outcome is None:
                outcome = await _unpaused(state, state.running[rid], None)
            if outcome is None:
                sampled += 1
                log.append(state.resumes)
        if outcome is None and sampled < len(ids):  # sampled at once, after the delay
            outcome = await _unpaused(state, state.running[rid], None)
            log += [state.resumes] * (len(ids) - sampled)
    finally:
        del state.running[rid]
    if outcome == "disconnect":
        state.disconnects.append({"api": api, "rid": rid, "key": key})
        return Response(status_code=499)
    if outcome == "abort":  # what it had sampled when the abort came: the real engines answer it so
        ids, logprobs, finish = ids[:sampled], logprobs[:sampled], "abort"
        state.stopped.append({"api": api, "rid": rid, "key": key, "sampled": sampled})
    elif fault.answer == "aborted":
        half = len(ids) // 2
        ids, logprobs, finish = ids[:half], logprobs[:half], "abort"
    answer = (
        _vllm_body(rid, ids, logprobs, finish, params)
        if api == "vllm"
        else _sglang_body(state, rid, prompt, ids, logprobs, finish, body)
    )
    _misshape(api, answer, fault.answer)
    if fault.drop_after is not None:
        return DroppedReply(json.dumps(answer).encode())
    return JSONResponse(answer)


def _misshape(api: str, answer: dict[str, Any], how: str | None) -> None:
    """Make one generated body (a whole answer or a stream event) wrong in the way `how` names."""
    if api == "vllm":
        choices = answer["choices"]
        if how == "no_ids":
            del choices[0]["token_ids"]
        elif how == "short_logprobs" and choices[0]["logprobs"]:
            choices[0]["logprobs"]["content"].pop()
        elif how == "no_finish":
            choices[0]["finish_reason"] = None
        return
    meta = answer["meta_info"]
    if how == "no_ids":
        meta.pop("output_token_logprobs", None)
        answer.pop("output_ids", None)
    elif how == "short_logprobs" and meta.get("output_token_logprobs"):
        meta["output_token_logprobs"].pop()
    elif how == "no_finish":
        meta["finish_reason"] = None


class DroppedReply(Response):
    """A whole answer whose connection is dropped halfway through the body (its Content-Length promised more)."""

    def __init__(self, content: bytes) -> None:
        self.content = content
        self.status_code = 200
        self.background = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(self.content)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": self.content[: len(self.content) // 2], "more_body": True})
        raise InjectedDrop("injected connection drop")


def _vllm_body(rid: str, ids: list[int], lps: list[float], finish: str, params: dict[str, Any]) -> dict[str, Any]:
    logprobs = None
    if params.get("logprobs") is not None:  # vLLM returns logprobs only when asked
        content = []
        for t, lp in zip(ids, lps, strict=True):
            top = [{"token": f"token_id:{t}", "logprob": lp, "bytes": None}]
            content.append({"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": top})
        logprobs = {"content": content}
    choice = {"index": 0, "logprobs": logprobs, "finish_reason": finish, "token_ids": ids}
    return {
        "request_id": f"generate-tokens-{rid}",
        "choices": [choice],
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }


def _sglang_body(
    state: State, rid: str, prompt: list[int], ids: list[int], lps: list[float], finish: str, body: dict[str, Any]
) -> dict[str, Any]:
    if finish == "stop":
        reason: dict[str, Any] = {"type": "stop", "matched": state.eos_id}
    elif finish == "length":
        reason = {"type": "length", "length": len(ids)}
    else:
        reason = {"type": "abort", "message": "Abort before prefill", "status_code": None, "err_type": None}
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": reason,
        "prompt_tokens": len(prompt),
        "completion_tokens": len(ids),
        "cached_tokens": 0,
        "e2e_latency": 0.0,
        "weight_version": state.weight_version,
    }
    if body.get("return_logprob"):
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(ids, lps, strict=True)]
    text = state.tokenizer.decode(ids, skip_special_tokens=False)
    return {"text": text, "output_ids": ids, "meta_info": meta}


class SseReply(Response):
    """A streamed generation: the initial delay, then one token per step, watching for disconnects and aborts."""

    def __init__(self, state: State, api: str, rid: str, key: str | None, body: dict[str, Any], prompt: list[int],
                 result: tuple[list[int], list[float], str], fault: Fault) -> None:
        self.state, self.api, self.rid, self.key, self.body, self.prompt = state, api, rid, key, body, prompt
        self.result, self.fault = result, fault
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8")]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.ensure_future(watch())
        aborted = self.state.running[self.rid] = asyncio.Event()
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            outcome = await _pause(aborted, gone, HANG_S if self.fault.hang else self.fault.delay)
            ids, lps, reason = self.result
            fault = self.fault
            finish = None if fault.answer == "no_finish" else reason
            sent, log = 0, _sampling_log(self.state, self.rid, self.key)
            while outcome is None and sent < len(ids):
                if sent == fault.error_after:
                    error = {"error": {"message": "injected mid-stream failure", "type": "InternalServerError",
                                       "code": 500}}
                    data = b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n"
                    await send({"type": "http.response.body", "body": data, "more_body": False})
                    return
                if sent == fault.drop_after:
                    raise InjectedDrop("injected connection drop")
                if sent == fault.hang_after:
                    outcome = await _pause(aborted, gone, HANG_S)
                    break
                if sent == fault.answer_after and fault.answer == "garbage":
                    await send({"type": "http.response.body", "body": GARBAGE, "more_body": False})
                    return
                if sent == fault.answer_after and fault.answer == "aborted":
                    sent += 1
                    await self._send_chunk(send, sent - 1, sent, "abort")
                    break
                outcome = await _pause(aborted, gone, fault.token_delay)
                if outcome is None:
                    outcome = await _unpaused(self.state, aborted, gone)
                if outcome is None:
                    sent += 1
                    log.append(self.state.resumes)
                    await self._send_chunk(send, sent - 1, sent, finish if sent == len(ids) else None)
            if outcome == "disconnect":
                self.state.disconnects.append({"api": self.api, "rid": self.rid, "key": self.key, "sent": sent})
                return
            if outcome == "abort":
                await self._send_chunk(send, sent, sent, "abort")
            await send({"type": "http.response.body", "body": self._tail(sent), "more_body": False})
            self.state.streamed.append({"api": self.api, "rid": self.rid, "key": self.key, "sent": sent})
        finally:
            watcher.cancel()
            del self.state.running[self.rid]

    async def _send_chunk(self, send: Any, start: int, stop: int, finish: str | None) -> None:
        """One step: vLLM sends the new ids only (and skips steps without any), SGLang everything so far."""
        ids, lps, _ = self.result
        if self.api == "vllm":
            if start == stop:
                return
            body = _vllm_body(self.rid, ids[start:stop], lps[start:stop], "", self.body["sampling_params"])
            body["choices"][0]["finish_reason"] = finish
            body = {"request_id": body["request_id"], "choices": body["choices"], "usage": None}
        else:
            body = _sglang_body(self.state, self.rid, self.prompt, ids[:stop], lps[:stop], finish or "", self.body)
            if finish is None:
                body["meta_info"]["finish_reason"] = None
        if stop > self.fault.answer_after and self.fault.answer in ("no_ids", "short_logprobs"):
            _misshape(self.api, body, self.fault.answer)
        data = b"data: " + json.dumps(body).encode() + b"\n\n"
        await send({"type": "http.response.body", "body": data, "more_body": True})

    def _tail(self, sent: int) -> bytes:
        tail = b""
        if self.api == "vllm" and (self.body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": len(self.prompt), "total_tokens": len(self.prompt) + sent,
                     "completion_tokens": sent}
            final = {"request_id": f"generate-tokens-{self.rid}", "choices": [], "usage": usage}
            tail = b"data: " + json.dumps(final).encode() + b"\n\n"
        return tail + b"data: [DONE]\n\n"


def _sampling_log(state: State, rid: str, key: str | None) -> list[int]:
    """The list a generation logs each token's `resumes` in, as it samples it."""
    entry = state.sampled_at[rid] = {"rid": rid, "key": key, "resumes": []}
    return entry["resumes"]


async def _unpaused(state: State, aborted: asyncio.Event, gone: asyncio.Event | None) -> str | None:
    """Wait while the engine is paused; 'abort' or 'disconnect' if either happens first."""
    while state.paused:
        waits = {asyncio.ensure_future(state.unpaused.wait()), asyncio.ensure_future(aborted.wait())}
        if gone is not None:
            waits.add(asyncio.ensure_future(gone.wait()))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if aborted.is_set():
            return "abort"
        if gone is not None and gone.is_set():
            return "disconnect"
    return None


async def _pause(aborted: asyncio.Event, gone: asyncio.Event, seconds: float) -> str | None:
    """Wait `seconds`; 'abort' or 'disconnect' if either happens first (checked even when seconds is 0)."""
    if aborted.is_set():
        return "abort"
    if gone.is_set():
        return "disconnect"
    if seconds > 0:
        waits = {asyncio.ensure_future(aborted.wait()), asyncio.ensure_future(gone.wait())}
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
    else:
        await asyncio.sleep(0)
    return "abort" if aborted.is_set() else "disconnect" if gone.is_set() else None


def build_app(state: State) -> Starlette:
    async def vllm_generate(request: Request) -> Response:
        return await _generate(state, request, "vllm")

    async def sglang_generate(request: Request) -> Response:
        return await _generate(state, request, "sglang")

    async def abort_request(request: Request) -> Response:
        body = await request.json()
        rid = str(body.get("rid", ""))
        state.aborts.append({"rid": rid, "key": _routing_key(request), "headers": dict(request.headers)})
        if rid in state.running:
            state.running[rid].set()
        return Response(status_code=200)

    async def abort_requests(request: Request) -> Response:
        """vLLM's dev-mode /abort_requests: external request ids (ours under `generate-tokens-`)."""
        body = await request.json()
        ids = [str(i).removeprefix("generate-tokens-") for i in body.get("request_ids") or []]
        for rid in ids:
            state.aborts.append({"rid": rid, "key": _routing_key(request), "headers": dict(request.headers)})
            if rid in state.running:
                state.running[rid].set()
        return JSONResponse({"status": "aborted", "aborted": len(ids)})

    def control(request: Request, call: str, **what: Any) -> None:
        state.controls.append({"call": call, "key": _routing_key(request), "at": time.time(), **what})

    def abort_all() -> int:
        for event in state.running.values():
            event.set()
        return len(state.running)

    async def pause(mode: str) -> None:
        if mode == "abort":
            abort_all()
        elif mode == "wait":
            while state.running:
                await asyncio.sleep(DISCONNECT_POLL_S)
        state.paused = True
        state.unpaused.clear()

    def resume() -> None:
        if state.paused:
            state.resumes += 1
        state.paused = False
        state.unpaused.set()

    async def vllm_pause(request: Request) -> Response:
        mode = request.query_params.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            return JSONResponse({"error": f"bad mode {mode!r}"}, status_code=400)
        control(request, "pause", api="vllm", mode=mode)
        await pause(mode)
        return JSONResponse({"status": "paused"})

    async def vllm_resume(request: Request) -> Response:
        control(request, "resume", api="vllm")
        resume()
        return JSONResponse({"status": "resumed"})

    async def vllm_is_paused(request: Request) -> Response:
        return JSONResponse({"is_paused": state.paused})

    async def sglang_pause(request: Request) -> Response:
        mode = (await request.json()).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return JSONResponse({"error": f"Invalid mode: {mode!r}"}, status_code=400)
        control(request, "pause", api="sglang", mode=mode)
        await pause("abort" if mode == "abort" else "keep")
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def sglang_continue(request: Request) -> Response:
        control(request, "resume", api="sglang")
        resume()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    async def sglang_version(request: Request) -> Response:
        body = await request.json()
        aborting = body.get("abort_all_requests", True)
        control(request, "version", api="sglang", version=str(body.get("new_version")), aborted=aborting)
        if aborting:
            abort_all()
        state.weight_version = str(body.get("new_version"))
        return JSONResponse({"success": True, "message": f"Weight version updated to {state.weight_version}",
                             "new_version": state.weight_version})

    async def configure(request: Request) -> Response:
        body = await request.json()
        if body.get("reset"):
            state.faults.clear()
            state.requests.clear()
            state.aborts.clear()
            state.disconnects.clear()
            state.streamed.clear()
            state.stopped.clear()
            state.policies.clear()
            state.sampled_at.clear()
            state.controls.clear()
        if "tool_rounds" in body:
            state.tool_rounds = int(body["tool_rounds"])
        if "weight_version" in body:
            state.weight_version = str(body["weight_version"])
        if "healthy" in body:
            state.healthy = bool(body["healthy"])
        if "fault" in body:
            fault = Fault(**body["fault"])
            state.faults[:] = [f for f in state.faults if f.key != fault.key] + [fault]
        if "policy" in body:
            policy = Policy(**body["policy"])
            state.policies[:] = [p for p in state.policies if p.key != policy.key] + [policy]
        return JSONResponse({"ok": True})

    async def log(request: Request) -> Response:
        key = request.query_params.get("key")

        def pick(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [i for i in items if key is None or i["key"] == key]

        return JSONResponse(
            {"requests": pick(state.requests), "aborts": pick(state.aborts), "disconnects": pick(state.disconnects),
             "streamed": pick(state.streamed), "stopped": pick(state.stopped),
             "sampled": pick(list(state.sampled_at.values())), "controls": state.controls, "paused": state.paused}
        )

    async def health(request: Request) -> Response:
        return Response(status_code=200 if state.healthy else 503)

    return Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/inference/v1/generate", vllm_generate, methods=["POST"]),
            Route("/generate", sglang_generate, methods=["POST"]),
            Route("/abort_request", abort_request, methods=["POST"]),
            Route("/abort_requests", abort_requests, methods=["POST"]),
            Route("/pause", vllm_pause, methods=["POST"]),
            Route("/resume", vllm_resume, methods=["POST"]),
            Route("/is_paused", vllm_is_paused, methods=["GET"]),
            Route("/pause_generation", sglang_pause, methods=["POST"]),
            Route("/continue_generation", sglang_continue, methods=["POST"]),
            Route("/update_weight_version", sglang_version, methods=["POST"]),
            Route("/_fake/config", configure, methods=["POST"]),
            Route("/_fake/log", log, methods=["GET"]),
        ]
    )


async def _serve(args: argparse.Namespace) -> None:
    tokenizer = Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json"))
    eos = "<|im_end|>"
    if args.format is not None:
        import fake_formats

        eos = fake_formats.WRITERS[args.format].stops[0]
    eos_id = tokenizer.token_to_id(eos)
    if eos_id is None:
        sys.exit(f"fake engine: the tokenizer has no {eos} token")
    state = State(
        tokenizer=tokenizer, eos_id=eos_id, tool_rounds=args.tool_rounds, format=args.format, think=not args.no_think
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    config = uvicorn.Config(build_app(state), log_level="warning", access_log=False, lifespan="off")
    server = uvicorn.Server(config)  # configures uvicorn's loggers: the filter goes on after
    logging.getLogger("uvicorn.error").addFilter(_QuietDrops())
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        if serving.done():
            serving.result()
            sys.exit("fake engine: server stopped before it started")
        await asyncio.sleep(0.01)
    host, port = sock.getsockname()[:2]
    print(f"{READY_LINE} http://{host}:{port}", flush=True)
    await serving


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--tokenizer", required=True, help="directory holding tokenizer.json")
    parser.add_argument("--tool-rounds", type=int, default=2, help="tool-call replies before a final answer")
    parser.add_argument("--format", default=None, help="reply in this tests/fake_formats.py writer's family syntax")
    parser.add_argument("--no-think", action="store_true", help="Qwen3 policy: no <think> block unless a Policy asks")
    asyncio.run(_serve(parser.parse_args()))


if __name__ == "__main__":
    main()
