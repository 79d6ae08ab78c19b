"""SGLang backend: token-in/token-out over `POST /generate`, with `POST /abort_request` on cancel.

Matched against sgl-project/sglang (v0.4-v0.5) `managers/io_struct.py` (GenerateReqInput,
AbortReq), `sampling/sampling_params.py`, `managers/tokenizer_manager.py` (meta_info) and
`entrypoints/http_server.py`, plus docs.sglang.io. Request: {input_ids, sampling_params
{max_new_tokens, temperature, top_p, top_k, stop, sampling_seed, frequency_penalty, presence_penalty,
repetition_penalty, min_p, logit_bias (token id strings -> bias)}, return_logprob: true,
logprob_start_len: -1, rid, stream: false}. Response: {output_ids (recent), meta_info
{finish_reason {type: stop|length|abort}, output_token_logprobs [[logprob, id, text]]}}.
Streaming (`stream: true`): SSE `data: {output_ids, meta_info}` per step, then `data: [DONE]`;
by default every event is cumulative (all ids and logprobs so far), with
`--incremental-streaming-output` each holds only the new ones: `meta_info.completion_tokens`
(the running total) tells which, and both are accepted. A cancelled or timed-out generate,
or a stream closed or failed before its finish, sends {"rid"} to /abort_request (answered with an
empty 200) with its own short bound, shielded so the cancellation cannot skip it; a failed abort is
logged. A generation SGLang aborted itself (finish reason `abort`, with its message) or one without a
finish reason is an EngineError; every failed call is counted against its replica (`faults`). One we asked it
to stop (`abort`, the same /abort_request) answers with what it sampled: `EngineAborted`. Its own pause
(`POST /pause_generation {"mode": "in_place"}`, io_struct `PauseGenerationReqInput`) holds the running requests
with their KV cache until `POST /continue_generation`; a resume that changed the weight version first sets it with
`POST /update_weight_version {"new_version", "abort_all_requests": false}` (left out, some versions abort every
request), so each output processed after it reports the new version in `meta_info.weight_version`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from operator import itemgetter
from typing import Any

from gateway_workers.engines.base import (
    EngineAborted,
    EngineChunk,
    EngineError,
    EngineResult,
    EngineTimeout,
    FinishReason,
    SamplingParams,
    shared_sampling,
)
from gateway_workers.engines.http_engine import (
    ABORT_TIMEOUT_S,
    HttpEngineBase,
    all_ints,
    as_floats,
    bad_answer,
    incomplete,
)

logger = logging.getLogger(__name__)

GENERATE_PATH = "/generate"
ABORT_PATH = "/abort_request"
PAUSE_PATH = "/pause_generation"
CONTINUE_PATH = "/continue_generation"
VERSION_PATH = "/update_weight_version"
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length"}
_ENTRY = frozenset([list, tuple])  # [logprob, token_id, text]
_REASON_SNIPPET = 200  # characters of an engine's finish reason quoted in our error
_LOGPROB, _ID = itemgetter(0), itemgetter(1)


class SglangEngine(HttpEngineBase):
    """An SGLang server (or SGLang Model Gateway) speaking the native /generate API."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._aborts: set[asyncio.Task[None]] = set()

    def _body(self, prompt_ids: Sequence[int], params: SamplingParams, session_id: str, request_id: str,
              stream: bool) -> dict[str, Any]:
        return {
            "input_ids": self.prompt_json(session_id, prompt_ids),
            "sampling_params": sampling_body(params),
            "return_logprob": True,
            "logprob_start_len": -1,  # output logprobs only; prompt logprobs cost a forward pass of work
            "rid": request_id,
            "stream": stream,
        }

    def abort_request(self, base: str, request_id: str) -> tuple[str, dict[str, Any]]:
        return base + ABORT_PATH, {"rid": request_id}

    def pause_requests(self, base: str) -> list[tuple[str, dict[str, Any]]]:
        return [(base + PAUSE_PATH, {"mode": "in_place"})]

    def resume_requests(self, base: str, weight_version: int | None) -> list[tuple[str, dict[str, Any]]]:
        told = [] if weight_version is None else [
            (base + VERSION_PATH, {"new_version": str(weight_version), "abort_all_requests": False})
        ]  # fmt: skip
        return [*told, (base + CONTINUE_PATH, {})]

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, session_id: str, request_id: str, replica: str = ""
    ) -> EngineResult:
        base, headers = self.route(session_id, replica)
        url = base + GENERATE_PATH
        body = self._body(prompt_ids, params, session_id, request_id, stream=False)
        self.in_flight.add(request_id)
        try:
            return parse_answer(url, await self.post_json(url, body, headers), request_id in self.stopping)
        except (asyncio.CancelledError, EngineTimeout) as e:
            # The engine keeps generating for a request nobody will read: tell it to stop.
            await self._abort(base, request_id, headers)
            if isinstance(e, EngineTimeout):
                self.count_fault(base, e)
            raise
        except EngineError as e:
            self.count_fault(base, e)
            raise
        finally:
            self.settled(request_id)

    async def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, session_id: str, request_id: str, replica: str = ""
    ) -> AsyncIterator[EngineChunk]:
        base, headers = self.route(session_id, replica)
        url = base + GENERATE_PATH
        body = self._body(prompt_ids, params, session_id, request_id, stream=True)
        have = 0
        finished = False
        self.in_flight.add(request_id)
        try:
            async with contextlib.aclosing(self.stream_json(url, body, headers)) as events:
                async for event in events:
                    if finished:
                        continue  # nothing follows a finish but [DONE]; read on so the connection is reusable
                    if isinstance(event, dict) and "error" in event:
                        message = f"engine {url} failed mid-stream: {str(event['error'])[:300]}"
                        raise EngineError(message, kind="error_event")
                    chunk = parse_stream_event(url, event, have, request_id in self.stopping)
                    have += len(chunk.output_ids)
                    finished = chunk.finish_reason is not None
                    yield chunk
            if not finished:
                raise incomplete(url, "the stream ended without a finish reason")
        except EngineAborted:
            finished = True  # stopped as we asked: nothing left to abort
            raise
        except EngineError as e:
            self.count_fault(base, e)
            raise
        finally:
            self.settled(request_id)
            if not finished:
                # Closed early (the agent left), failed or timed out: the engine would keep generating.
                await self._abort(base, request_id, headers)

    async def _abort(self, base: str, rid: str, headers: dict[str, str]) -> None:
        task = asyncio.get_running_loop().create_task(self._send_abort(base, rid, headers))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)
        # Shielded: a second cancel stops our wait, never the abort call itself.
        await asyncio.shield(task)

    async def _send_abort(self, base: str, rid: str, headers: dict[str, str]) -> None:
        try:
            await self.post(base + ABORT_PATH, {"rid": rid}, headers, timeout=ABORT_TIMEOUT_S)
        except EngineError as e:
            logger.warning("abort of SGLang request %s failed: %s", rid, e)

    async def aclose(self) -> None:
        if self._aborts:
            await asyncio.wait(set(self._aborts), timeout=ABORT_TIMEOUT_S)
        await super().aclose()


def sampling_body(params: SamplingParams) -> dict[str, Any]:
    """SGLang `SamplingParams` JSON: only what is set, so the server's defaults apply to the rest."""
    body: dict[str, Any] = {"max_new_tokens": params.max_tokens, "skip_special_tokens": False}
    if params.temperature is not None:
        body["temperature"] = params.temperature
    if params.top_p is not None:
        body["top_p"] = params.top_p
    if params.top_k is not None:
        body["top_k"] = params.top_k
    if params.seed is not None:
        body["sampling_seed"] = params.seed
    body.update(shared_sampling(params))
    if params.stop:
        body["stop"] = list(params.stop)
    return body


def parse_answer(url: str, answer: Any, stopping: bool = False) -> EngineResult:
    """Ids, sampled logprobs and finish reason from a /generate body (`stopping`: we asked for its abort, which
    raises EngineAborted with them)."""
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    if not isinstance(meta, dict):
        raise bad_answer(url, "no meta_info")
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list):
        raise bad_answer(url, "no meta_info.output_token_logprobs (return_logprob ignored?)")
    ids, logprobs = _tokens(url, entries)
    output_ids = answer.get("output_ids")
    if output_ids is not None and output_ids != ids:
        raise bad_answer(url, "output_ids disagree with output_token_logprobs")
    if stopping and _aborted(meta.get("finish_reason")):
        raise EngineAborted(ids, logprobs)
    return EngineResult(output_ids=ids, logprobs=logprobs, finish_reason=_finish(url, meta.get("finish_reason")),
                        weight_version=_weight_version(meta))


def parse_stream_event(url: str, event: Any, have: int, stopping: bool = False) -> EngineChunk:
    """The new ids of one streamed event, given that `have` ids came before; cumulative or incremental events."""
    meta = event.get("meta_info") if isinstance(event, dict) else None
    if not isinstance(meta, dict):
        raise bad_answer(url, "a stream event has no meta_info")
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list):
        raise bad_answer(url, "a stream event has no meta_info.output_token_logprobs (return_logprob ignored?)")
    total = meta.get("completion_tokens")
    if total is None or len(entries) == total:
        if len(entries) < have:
            raise bad_answer(url, f"a cumulative stream event holds {len(entries)} ids after {have}")
        entries = entries[have:]  # cumulative (SGLang's default): all ids so far
    elif not isinstance(total, int) or len(entries) != total - have:
        raise bad_answer(url, f"a stream event holds {len(entries)} ids; {have} came before, total {total!r}")
    ids, logprobs = _tokens(url, entries)
    raw = meta.get("finish_reason")
    if stopping and _aborted(raw):
        raise EngineAborted(ids, logprobs)
    return EngineChunk(output_ids=ids, logprobs=logprobs, finish_reason=None if raw is None else _finish(url, raw),
                       weight_version=_weight_version(meta))


def _aborted(finish: Any) -> bool:
    return (finish.get("type") if isinstance(finish, dict) else finish) == "abort"


def _weight_version(meta: dict[str, Any]) -> str | None:
    """The engine's own weight version (`--weight-version`, updated with its weights), if it reports one."""
    version = meta.get("weight_version")
    return str(version)[:_REASON_SNIPPET] if version is not None else None


def _finish(url: str, finish: Any) -> FinishReason:
    """A finished generation's reason; one SGLang aborted, or none at all, is no reply (an EngineError)."""
    kind = finish.get("type") if isinstance(finish, dict) else finish
    reason = _FINISH.get(kind) if isinstance(kind, str) else None
    if reason is not None:
        return reason
    if kind == "abort":
        # SGLang says why: an over-long prompt, a bad parameter, its own shutdown or a /abort_request.
        why = finish.get("message") if isinstance(finish, dict) else None
        raise incomplete(url, f"SGLang aborted it: {str(why)[:_REASON_SNIPPET]}")
    if finish is None:
        raise incomplete(url, "no finish reason")
    raise bad_answer(url, f"the finish reason {str(finish)[:_REASON_SNIPPET]!r}")


def _tokens(url: str, entries: list[Any]) -> tuple[list[int], list[float]]:
    if not entries:
        return [], []
    if not set(map(type, entries)) <= _ENTRY or min(map(len, entries)) < 2:
        raise bad_answer(url, "an output_token_logprobs entry is not [logprob, token_id, text]")
    ids = list(map(_ID, entries))
    logprobs = as_floats(list(map(_LOGPROB, entries)))
    if logprobs is None or not all_ints(ids):
        raise bad_answer(url, "an output_token_logprobs entry has a non-numeric logprob or id")
    return ids, logprobs
