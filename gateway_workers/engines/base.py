"""The engine seam: token ids in, token ids + logprobs out, behind one small Protocol.

Owns the records every backend shares (`SamplingParams`, `EngineResult`, `EngineChunk`; the engine's
settings are `config.EngineConfig`), the two failures the app maps to HTTP (`EngineError` -> 502,
`EngineTimeout` -> 504), each with its `FaultKind`, and the per-replica fault counts (`Engine.faults`,
on the worker's /metrics); the plumbing the HTTP backends share is `http_engine`.
Backends (vllm, sglang, mock) implement `Engine`: `generate` returns a whole generation, `stream`
yields it as it is sampled. A generation that did not finish (no finish reason, or one the engine
aborted by itself) is a failure, never a reply.
Must not import the app, adapters, backplane or transformers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

FinishReason = Literal["stop", "length"]
# Why an engine call failed, as counted per replica: an HTTP error status; no answer in time; the connection
# failed or broke; the engine's own error event mid-stream; a 2xx body we cannot use (not JSON, not a stream,
# the wrong shape, ids without their logprobs); a generation that ended without finishing.
FaultKind = Literal["status", "timeout", "connection", "error_event", "bad_answer", "incomplete"]



class EngineError(Exception):
    """The engine failed or answered garbage: the agent gets a 502 and the turn is aborted."""

    def __init__(self, message: str, status: int | None = None, kind: FaultKind = "bad_answer") -> None:
        super().__init__(message)
        self.status = status
        self.kind: FaultKind = kind


class EngineAborted(Exception):
    """The engine stopped a generation because `Engine.abort` asked it to: what it had sampled, and had not yet
    streamed, comes with it (a pause in mode abort keeps those tokens and resubmits the rest). Not a failure."""

    def __init__(self, output_ids: list[int], logprobs: list[float]) -> None:
        super().__init__(f"stopped after {len(output_ids)} more tokens")
        self.output_ids, self.logprobs = output_ids, logprobs


class EngineTimeout(EngineError):
    """The engine did not answer within the configured bound: the agent gets a 504."""

    def __init__(self, message: str) -> None:
        super().__init__(message, kind="timeout")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What the engine samples with; None leaves the engine's own default."""

    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    more: Mapping[str, Any] | None = None  # of `SHARED_SAMPLING`, as the engines take them (`shared_sampling`)


# Sampling parameters vLLM's and SGLang's `SamplingParams` name and read alike (logit_bias: token ids as JSON
# strings -> bias): few requests set them, so they travel together, as `SamplingParams.more`.
SHARED_SAMPLING = frozenset({"frequency_penalty", "presence_penalty", "repetition_penalty", "min_p", "logit_bias"})


def shared_sampling(params: SamplingParams) -> Mapping[str, Any]:
    """What of `SHARED_SAMPLING` is set, for either engine's sampling body."""
    return params.more or {}


UNKNOWN_VERSION = -2


@dataclass(frozen=True, slots=True)
class EngineResult:
    """One generation: the sampled ids, one logprob per id, and why it ended; `weight_version`: the weights the
    engine says it sampled with (SGLang's `meta_info.weight_version`), None when it does not say."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: str | None = None
    # The policy version each sampled id was sampled under, as runs of (version, count), when a pause decided it
    # (the turn waited for a resume); empty: the version its turn opened with, throughout. UNKNOWN_VERSION: ids an
    # engine pause held whose version the engine does not say.
    weight_versions: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class EngineChunk:
    """Ids sampled since the previous chunk, one logprob each; `finish_reason` is set on the last chunk only
    (`weight_version` as `EngineResult`'s, on any chunk that carries it)."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason | None = None
    weight_version: str | None = None
    weight_versions: tuple[tuple[int, int], ...] = ()  # as `EngineResult`'s, on the last chunk only


class Engine(Protocol):
    """A token-in/token-out engine.

    Cancelling `generate`, or cancelling or closing a `stream` iterator before its last
    chunk, must stop the engine's work (best effort). A stream's chunks concatenate to
    exactly what `generate` would have returned; its last chunk carries the finish reason. `replica`, when
    given, is the base URL to call (the broker routes sessions); else the engine picks one of its own.
    `faults` counts the calls that failed with an EngineError, by (replica url, kind); `replicas` are the
    base URLs it sends to (none for the mock).
    """

    faults: Counter[tuple[str, FaultKind]]
    replicas: tuple[str, ...]

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, session_id: str, request_id: str, replica: str = ""
    ) -> EngineResult: ...

    def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, session_id: str, request_id: str, replica: str = ""
    ) -> AsyncIterator[EngineChunk]: ...

    async def abort(self, request_id: str, *, session_id: str, replica: str = "") -> None:
        """Stop the generation `request_id` (in flight on this engine object) at the engine: its pending call then
        raises `EngineAborted` with what it sampled. Best effort: a failed request is logged, and the call then
        ends as it would have."""
        ...

    async def pause_replica(self, replica: str) -> None:
        """The engine's own pause on `replica` (vLLM `/pause?mode=keep`, SGLang `in_place`): its generations stay
        where they are, KV cache and all, until `resume_replica`. Raises EngineError when it does not answer."""
        ...

    async def resume_replica(self, replica: str, weight_version: int | None) -> None:
        """End `pause_replica`; `weight_version`, when the pause changed it, is told first where the engine reports
        one per output (SGLang's, so each chunk after the resume names the new version)."""
        ...

    async def aclose(self) -> None: ...

    def forget_sessions(self, sessions: list[str]) -> None:
        """Sessions that ended: drop what the engine keeps for them (the HTTP engines: their last prompt's JSON)."""
        ...
