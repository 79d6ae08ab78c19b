"""vLLM backend: token-in/token-out over `POST /inference/v1/generate` (vLLM >= 0.11.2).

Matched against vllm-project/vllm `entrypoints/openai/serving_tokens.py` (v0.11.2), later
`entrypoints/serve/disagg/{protocol,serving,api_router}.py`, and the docs.vllm.ai API pages.
Request: {request_id, token_ids, sampling_params {max_tokens, temperature, top_p, top_k, seed,
frequency_penalty, presence_penalty, repetition_penalty, min_p, logit_bias (token id strings -> bias), stop,
logprobs: 0 (= the sampled token's own), detokenize}, stream: false, model?}. Response:
{choices: [{token_ids, finish_reason, logprobs: {content: [{token: "token_id:N", logprob}]}}]}.
Streaming (`serve_tokens_stream_generator`): `stream: true` + `stream_options.include_usage`
gives SSE `data: {choices: [{index, token_ids (new ids only), logprobs, finish_reason}]}` per
engine step (steps without new ids are skipped, so an abort may end the stream without a
finish reason), then `data: {choices: [], usage}`, `data: [DONE]`; errors arrive as
`data: {"error": {...}}`. The route runs under vLLM's `with_cancellation`: closing the
connection (a cancelled `generate`, a closed stream, a failed one) aborts the request. `X-Request-Id`
carries our id, which vLLM prefers. A generation vLLM aborted (finish reason `abort`, or a stream
without one) is an EngineError; every failed call is counted against its replica (`faults`). One we asked it
to stop (`abort`: `POST /abort_requests {"request_ids": ["generate-tokens-<our id>"]}`, a route of vLLM's RLHF
dev mode, `entrypoints/serve/dev/rlhf/api_router.py`) answers with what it sampled: `EngineAborted`. The same
routes pause and resume the engine (`POST /pause?mode=keep`: the scheduler stops, its requests frozen in place,
answered once it has; `POST /resume`); vLLM reports no weight version, so the tokens of a generation held across
such a pause cannot be told apart by version (`turns.gated_engine` flags them).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from gateway_workers.engines.base import (
    EngineAborted,
    EngineChunk,
    EngineError,
    EngineResult,
    FinishReason,
    SamplingParams,
    shared_sampling,
)
from gateway_workers.engines.http_engine import HttpEngineBase, all_ints, as_floats, bad_answer, incomplete

logger = logging.getLogger(__name__)

GENERATE_PATH = "/inference/v1/generate"
ABORT_PATH = "/abort_requests"  # vLLM's RLHF dev routes (VLLM_SERVER_DEV_MODE=1), as are these two
PAUSE_PATH = "/pause?mode=keep"
RESUME_PATH = "/resume"
REQUEST_ID_PREFIX = "generate-tokens-"
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length"}
_REASON_SNIPPET = 200  # characters of an engine's finish reason quoted in our error


class VllmEngine(HttpEngineBase):
    """A vLLM server (or a vllm-router in front of several) speaking the tokens-in/tokens-out API."""

    def _body(self, prompt_ids: Sequence[int], params: SamplingParams, session_id: str, request_id: str,
              stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "request_id": request_id,
            "token_ids": self.prompt_json(session_id, prompt_ids),
            "sampling_params": sampling_body(params),
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        if self._config.model:
            body["model"] = self._config.model
        return body

    def abort_request(self, base: str, request_id: str) -> tuple[str, dict[str, Any]]:
        # vLLM names a tokens request after our X-Request-Id (`serving_tokens`), and aborts external ids.
        return base + ABORT_PATH, {"request_ids": [f"{REQUEST_ID_PREFIX}{request_id}"]}

    def pause_requests(self, base: str) -> list[tuple[str, dict[str, Any]]]:
        return [(base + PAUSE_PATH, {})]

    def resume_requests(self, base: str, weight_version: int | None) -> list[tuple[str, dict[str, Any]]]:
        return [(base + RESUME_PATH, {})]

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, session_id: str, request_id: str, replica: str = ""
    ) -> EngineResult:
        base, headers = self.route(session_id, replica)
        url = base + GENERATE_PATH
        body = self._body(prompt_ids, params, session_id, request_id, stream=False)
        self.in_flight.add(request_id)
        try:
            answer = await self.post_json(url, body, {**headers, "X-Request-Id": request_id})
            return parse_answer(url, answer, stopping=request_id in self.stopping)
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
        finished = False
        total = 0
        opened = self.stream_json(url, body, {**headers, "X-Request-Id": request_id})
        self.in_flight.add(request_id)
        try:
            # Closed on any exit, so a failed stream's connection closes now, which aborts the request in vLLM.
            async with contextlib.aclosing(opened) as events:
                async for event in events:
                    if not isinstance(event, dict):
                        raise bad_answer(url, "a stream event is not an object")
                    if "error" in event:
                        message = f"engine {url} failed mid-stream: {str(event['error'])[:300]}"
                        raise EngineError(message, kind="error_event")
                    for choice in event.get("choices") or ():
                        if finished:
                            raise bad_answer(url, "tokens after the finish reason")
                        chunk = parse_stream_choice(url, choice, stopping=request_id in self.stopping)
                        total += len(chunk.output_ids)
                        finished = chunk.finish_reason is not None
                        yield chunk
                    usage = event.get("usage")
                    if isinstance(usage, dict) and usage.get("completion_tokens") not in (None, total):
                        count = usage.get("completion_tokens")
                        raise bad_answer(url, f"usage counts {count} tokens, the stream had {total}")
            if not finished:
                # vLLM skips steps without new ids, so a request it aborted ends without a finish reason.
                if request_id in self.stopping:
                    raise EngineAborted([], [])
                raise incomplete(url, "the stream ended without a finish reason")
        except EngineError as e:
            self.count_fault(base, e)
            raise
        finally:
            self.settled(request_id)


def sampling_body(params: SamplingParams) -> dict[str, Any]:
    """vLLM `SamplingParams` JSON: only what is set, so the server's defaults apply to the rest."""
    body: dict[str, Any] = {"max_tokens": params.max_tokens, "logprobs": 0}
    if params.temperature is not None:
        body["temperature"] = params.temperature
    if params.top_p is not None:
        body["top_p"] = params.top_p
    if params.top_k is not None:
        body["top_k"] = params.top_k
    if params.seed is not None:
        body["seed"] = params.seed
    body.update(shared_sampling(params))
    if params.stop:
        body["stop"] = list(params.stop)
    else:
        # Detokenizing is wasted work for a token-out caller, but vLLM needs it to match stop strings.
        body["detokenize"] = False
    return body


def parse_answer(url: str, answer: Any, stopping: bool = False) -> EngineResult:
    """Ids, sampled logprobs and finish reason from a `GenerateResponse` body (`stopping`: we asked for its abort,
    which raises EngineAborted with them)."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise bad_answer(url, "no choices")
    ids, logprobs = _tokens(url, choices[0])
    raw = choices[0].get("finish_reason")
    if stopping and raw == "abort":
        raise EngineAborted(ids, logprobs)
    return EngineResult(output_ids=ids, logprobs=logprobs, finish_reason=_finish(url, raw))


def parse_stream_choice(url: str, choice: Any, stopping: bool = False) -> EngineChunk:
    """New ids, their logprobs and the finish reason (None until the last) from a `GenerateStreamResponse` choice."""
    if not isinstance(choice, dict) or choice.get("index", 0) != 0:
        raise bad_answer(url, "a stream choice other than index 0")
    ids, logprobs = _tokens(url, choice)
    raw = choice.get("finish_reason")
    if stopping and raw == "abort":
        raise EngineAborted(ids, logprobs)
    return EngineChunk(output_ids=ids, logprobs=logprobs, finish_reason=None if raw is None else _finish(url, raw))


def _finish(url: str, raw: Any) -> FinishReason:
    """A finished generation's reason; one vLLM aborted, or none at all, is no reply (an EngineError)."""
    reason = _FINISH.get(raw) if isinstance(raw, str) else None
    if reason is not None:
        return reason
    if raw == "abort" or raw is None:
        raise incomplete(url, "vLLM aborted it" if raw else "no finish reason")
    raise bad_answer(url, f"the finish reason {str(raw)[:_REASON_SNIPPET]!r}")


def _tokens(url: str, choice: dict[str, Any]) -> tuple[list[int], list[float]]:
    ids = choice.get("token_ids")
    if not isinstance(ids, list) or not all_ints(ids):
        raise bad_answer(url, "choices[0].token_ids is not a list of ints")
    if not ids:
        return [], []
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list) or len(content) != len(ids):
        raise bad_answer(url, f"expected {len(ids)} logprobs in choices[0].logprobs.content")
    try:
        values = [entry["logprob"] for entry in content]
    except (TypeError, KeyError):
        values = []
    floats = as_floats(values)
    if len(values) != len(ids) or floats is None:
        raise bad_answer(url, "a logprobs.content entry has no numeric logprob")
    return ids, floats
