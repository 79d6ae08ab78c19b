"""The engine as the turns see it: every call passes the worker's generation gate first.

While generation is paused (`capture.generation`), a turn's engine call waits here, its agent's connection
open and nothing sent to the engine, until the resume; then it samples under the version the resume set, which
its result says (`EngineResult.weight_versions`). A call held past `hold_s` gets a retryable 503 with
Retry-After (the turn is aborted by its caller: nothing is recorded); an agent that leaves while held cancels
the wait like any engine call. Calls past the gate are counted until they end, which is how the broker learns
that a worker is idle.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import AsyncIterator, Sequence

from gateway_workers.capture.generation import GenerationGate, HoldTimeout
from gateway_workers.engines.base import Engine, EngineChunk, EngineResult, FaultKind, SamplingParams
from gateway_workers.http.errors import ApiError

# A held turn's 503 asks the agent's SDK to come back this soon: the pause may end any moment.
PAUSE_RETRY_AFTER_S = 2


class GatedEngine:
    """`engine`, its calls gated by `gate` (an `engines.base.Engine` itself)."""

    def __init__(self, engine: Engine, gate: GenerationGate, hold_s: float) -> None:
        self.engine, self.gate, self.hold_s = engine, gate, hold_s
        self.faults: Counter[tuple[str, FaultKind]] = engine.faults  # the same objects: counted by the engine
        self.replicas: tuple[str, ...] = engine.replicas

    def forget_sessions(self, sessions: list[str]) -> None:
        self.engine.forget_sessions(sessions)

    async def aclose(self) -> None:
        await self.engine.aclose()

    async def _enter(self) -> int:
        """Pass the gate; the version a held call samples under (-1: it was not held, or no version is set)."""
        try:
            held = await self.gate.enter(self.hold_s)
        except HoldTimeout as e:
            raise ApiError(
                503, "unavailable", f"generation is paused for a weight update ({e}); retry later",
                code="generation_paused", headers={"retry-after": str(PAUSE_RETRY_AFTER_S)},
            ) from None  # fmt: skip
        return self.gate.weight_version if held else -1

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, session_id: str, request_id: str, replica: str = ""
    ) -> EngineResult:
        version = await self._enter()
        try:
            result = await self.engine.generate(
                prompt_ids, params, session_id=session_id, request_id=request_id, replica=replica
            )
        finally:
            self.gate.leave()
        if version < 0:
            return result
        return dataclasses.replace(result, weight_versions=((version, len(result.output_ids)),))

    async def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, session_id: str, request_id: str, replica: str = ""
    ) -> AsyncIterator[EngineChunk]:
        version = await self._enter()
        try:
            sampled = 0
            chunks = self.engine.stream(prompt_ids, params, session_id=session_id, request_id=request_id,
                                        replica=replica)  # fmt: skip
            async with contextlib.aclosing(chunks) as opened:  # type: ignore[type-var]
                async for chunk in opened:
                    sampled += len(chunk.output_ids)
                    if chunk.finish_reason is not None and version >= 0:
                        chunk = dataclasses.replace(chunk, weight_versions=((version, sampled),))
                    yield chunk
        finally:
            self.gate.leave()
