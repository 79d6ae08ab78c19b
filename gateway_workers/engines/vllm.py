"""vLLM backend: token-in/token-out over `POST /inference/v1/generate` (vLLM >= 0.11.2).

Matched against vllm-project/vllm `entrypoints/openai/serving_tokens.py` (v0.11.2), later
`entrypoints/serve/disagg/{protocol,serving,api_router}.py`, and the docs.vllm.ai API pages.
Request: {request_id, token_ids, sampling_params {max_tokens, temperature, top_p, top_k, seed,
stop, logprobs: 0 (= the sampled token's own), detokenize}, stream: false, model?}. Response:
{choices: [{token_ids, finish_reason, logprobs: {content: [{token: "token_id:N", logprob}]}}]}.
The route runs under vLLM's `with_cancellation`: closing the connection (a cancelled
`generate`) aborts the request. `X-Request-Id` carries our id, which vLLM prefers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from gateway_workers.engines.base import (
    EngineError,
    EngineResult,
    FinishReason,
    HttpEngineBase,
    SamplingParams,
    bad_answer,
    ids_list,
)

logger = logging.getLogger(__name__)

GENERATE_PATH = "/inference/v1/generate"
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


class VllmEngine(HttpEngineBase):
    """A vLLM server (or a vllm-router in front of several) speaking the tokens-in/tokens-out API."""

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, session_id: str, request_id: str
    ) -> EngineResult:
        base, headers = self.route(session_id)
        url = base + GENERATE_PATH
        body: dict[str, Any] = {
            "request_id": request_id,
            "token_ids": ids_list(prompt_ids),
            "sampling_params": sampling_body(params),
            "stream": False,
        }
        if self._config.model:
            body["model"] = self._config.model
        answer = await self.post_json(url, body, {**headers, "X-Request-Id": request_id})
        return parse_answer(url, answer)


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
    if params.stop:
        body["stop"] = list(params.stop)
    else:
        # Detokenizing is wasted work for a token-out caller, but vLLM needs it to match stop strings.
        body["detokenize"] = False
    return body


def parse_answer(url: str, answer: Any) -> EngineResult:
    """Ids, sampled logprobs and finish reason from a `GenerateResponse` body."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise bad_answer(url, "no choices")
    choice = choices[0]
    ids = choice.get("token_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise bad_answer(url, "choices[0].token_ids is not a list of ints")
    content = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
    if not isinstance(content, list) or len(content) != len(ids):
        raise bad_answer(url, f"expected {len(ids)} logprobs in choices[0].logprobs.content")
    logprobs = []
    for entry in content:
        value = entry.get("logprob") if isinstance(entry, dict) else None
        if not isinstance(value, (int, float)):
            raise bad_answer(url, "a logprobs.content entry has no numeric logprob")
        logprobs.append(float(value))
    reason = _FINISH.get(choice.get("finish_reason") or "stop")
    if reason is None:
        raise EngineError(f"engine {url} finished with {choice.get('finish_reason')!r}")
    return EngineResult(output_ids=ids, logprobs=logprobs, finish_reason=reason)
