"""The engine as the turns see it: every call passes the worker's generation gate, and a pause may stop it.

While generation is paused (`capture.generation`), a turn's engine call waits here, its agent's connection
open and nothing sent to the engine, until the resume; then it samples under the version the resume set. A call
held past `hold_s` gets a retryable 503 with Retry-After (the turn is aborted by its caller: nothing is
recorded); an agent that leaves while held cancels the wait like any engine call.

A pause in mode abort stops the calls in flight at the engine (`Engine.abort`), which answers each with what it
had sampled (`EngineAborted`). The call keeps those tokens, waits at the gate like a new one, and at the resume
asks the same replica for the rest: prompt + the tokens kept as the new prompt, the remaining `max_tokens`. So a
turn stays one call to the turn path: a whole reply comes once, complete; a stream's chunks go on where they
stopped. Its result says which version sampled which tokens (`weight_versions`: the version in force when each
part's call began), since the rest was sampled after the update; it is left empty for a call that neither waited
nor was stopped, whose tokens carry the version its turn opened with. The rest is sampled after exactly prompt +
the tokens kept, so the fidelity rule holds as for any turn. (A stop string that would span the two parts is not
seen by the engine: each part's own stop strings apply.)

A pause in mode keep leaves the calls in flight to the engines' own pause (`capture.generation`): they stop
sampling where they are and go on at the resume, under the new weights. Which of their tokens are old is known
this way: nothing is sampled while the engines are paused, and no engine is resumed before every worker applied
the pause (the trainer's pause returns only then), so every token this worker received before it applied the
pause is old. Of those received after it, each SGLang stream output says the version it was sampled under (the
resume sets it: `engines.sglang`); vLLM's say nothing, nor does a whole generation's answer of its tokens but
the last, so those are flagged unknown (`UNKNOWN_VERSION`, unless the resume left the version as it was) rather
than guessed. A call that ends while the engines are still paused waits for the resume to know it.

A stream the agent has begun to receive is not cut by the hold bound: stopped by a pause, it waits for the
resume as long as the pause lasts (up to `MAX_STARTED_HOLD_S`), yielding an empty chunk every `keepalive_s`,
which the dialects send as an SSE comment, so the agent's SDK (its read timeout) and proxies keep it open.

A replica that dies during a pause (its connection fails) does not fail the calls the pause touched (held at
the gate, stopped, or held by the engine): each keeps what it received and asks another replica for the rest,
after the resume; with none left, the engine's error stands (a 502).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from array import array
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from gateway_workers.capture.generation import GenerationGate, HoldTimeout
from gateway_workers.engines.base import (
    UNKNOWN_VERSION,
    Engine,
    EngineAborted,
    EngineChunk,
    EngineError,
    EngineResult,
    FaultKind,
    SamplingParams,
)
from gateway_workers.engines.routing import choose_replica, routing_key
from gateway_workers.http.errors import ApiError

logger = logging.getLogger(__name__)

# A held turn's 503 asks the agent's SDK to come back this soon: the pause may end any moment.
PAUSE_RETRY_AFTER_S = 2
# A stream the agent has begun to receive, stopped by a pause, sends a keep-alive this often while it waits, for
# at most this long (then the hold bound applies again).
KEEPALIVE_S = 15.0
MAX_STARTED_HOLD_S = 3600.0


@dataclass(slots=True)
class _Kept:
    """What the parts of one call sampled so far, and under which versions (runs of (version, count))."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    runs: list[tuple[int, int]] = field(default_factory=list)

    def add(self, version: int, ids: list[int], logprobs: list[float]) -> None:
        self.ids += ids
        self.logprobs += logprobs
        self.counted(version, len(ids))

    def counted(self, version: int, n: int) -> None:
        if not n:
            return
        if self.runs and self.runs[-1][0] == version:
            self.runs[-1] = (version, self.runs[-1][1] + n)
        else:
            self.runs.append((version, n))

    def extend(self, ids: list[int], logprobs: list[float]) -> None:
        self.ids += ids
        self.logprobs += logprobs

    def prompt(self, prompt_ids: Sequence[int]) -> Sequence[int]:
        if not self.ids:
            return prompt_ids
        prompt = array("i", prompt_ids)
        prompt.extend(self.ids)
        return prompt


class GatedEngine:
    """`engine`, its calls gated by `gate` (an `engines.base.Engine` itself)."""

    def __init__(self, engine: Engine, gate: GenerationGate, hold_s: float, keepalive_s: float = KEEPALIVE_S) -> None:
        self.engine, self.gate, self.hold_s, self.keepalive_s = engine, gate, hold_s, keepalive_s
        self.faults: Counter[tuple[str, FaultKind]] = engine.faults  # the same objects: counted by the engine
        self.replicas: tuple[str, ...] = engine.replicas
        self._stopped: set[str] = set()  # parts a pause stopped, while they are in flight
        gate.stop = self._stop
        gate.replicas, gate.pause_engine, gate.resume_engine = engine.replicas, self.pause_replica, self.resume_replica

    def forget_sessions(self, sessions: list[str]) -> None:
        self.engine.forget_sessions(sessions)

    async def aclose(self) -> None:
        await self.engine.aclose()

    async def abort(self, request_id: str, *, session_id: str, replica: str = "") -> None:
        await self.engine.abort(request_id, session_id=session_id, replica=replica)

    async def pause_replica(self, replica: str) -> None:
        await self.engine.pause_replica(replica)

    async def resume_replica(self, replica: str, weight_version: int | None) -> None:
        await self.engine.resume_replica(replica, weight_version)

    async def _enter(self) -> tuple[int, bool]:
        """Pass the gate: (the version in force, whether the call waited for a resume)."""
        gate = self.gate
        if not gate.paused:  # generating: no wait (the hot path pays a count)
            gate.engine_calls += 1
            return gate.weight_version, False
        try:
            held = await gate.enter(self.hold_s)
        except HoldTimeout as e:
            raise ApiError(
                503, "unavailable", f"generation is paused for a weight update ({e}); retry later",
                code="generation_paused", headers={"retry-after": str(PAUSE_RETRY_AFTER_S)},
            ) from None  # fmt: skip
        return gate.weight_version, held

    async def _stop(self, part: str, session_id: str, replica: str) -> None:
        """The gate's way to stop a part in flight (a pause in mode abort)."""
        self._stopped.add(part)  # a stream stops at its next chunk even if the engine never heard of it yet
        await self.engine.abort(part, session_id=session_id, replica=replica)

    def _elsewhere(self, e: EngineError, session_id: str, replica: str, dead: set[str], touched: bool) -> str:
        """The replica a call the pause `touched` goes on at, now that its own failed with `e`; raises `e` when the
        call was not touched, the replica did not die (its connection failed), or none is left."""
        if not touched or e.kind != "connection" or not self.replicas:
            raise e
        key = routing_key(session_id)
        dead.add(replica or choose_replica(self.replicas, key))
        left = [r for r in self.replicas if r not in dead]
        if not left:
            raise e
        moved = choose_replica(left, key)
        self.gate.counters["failovers"] += 1
        logger.warning("a generation held by the pause lost its engine replica (%s); it goes on at %s", e, moved)
        return moved

    async def _kept_open(self) -> AsyncIterator[EngineChunk]:
        """Wait for the resume, an empty chunk every `keepalive_s` (counted as a held turn meanwhile)."""
        gate = self.gate
        loop = asyncio.get_running_loop()
        deadline = loop.time() + MAX_STARTED_HOLD_S
        gate.turns_held += 1
        try:
            while gate.paused and loop.time() < deadline:
                await gate.resumed(self.keepalive_s)
                if gate.paused:
                    yield EngineChunk([], [])
        finally:
            gate.turns_held -= 1

    def _left(self, part: str) -> None:
        self.gate.stoppers.pop(part, None)
        self._stopped.discard(part)
        self.gate.leave()

    async def _held_by_engine(
        self, kept: _Kept, version: int, before: int, after: list[tuple[str | None, int]], whole: bool = False
    ) -> None:
        """Count the versions of a part an engine pause held: `before` tokens received before this worker applied
        the pause (old), then `after`, as (the version the engine said, tokens) per output received since (a
        `whole` generation's says only its last token's)."""
        kept.counted(version, before)
        gate = self.gate
        if gate.paused == "keep":  # the resume's version is not known yet
            await gate.resumed(self.hold_s)
        end = gate.weight_version if gate.paused != "keep" else None
        for said, n in after:
            kept.counted(_sampled_under(said, version, end, whole), n)

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, session_id: str, request_id: str, replica: str = ""
    ) -> EngineResult:
        kept, held, gate, dead = _Kept(), False, self.gate, set[str]()
        for n in range(MAX_PARTS):
            version, waited = await self._enter()
            held = held or waited
            left = params.max_tokens - len(kept.ids)
            if left <= 0:  # stopped right at its last token: nothing left to sample
                gate.leave()
                return EngineResult(kept.ids, kept.logprobs, "length", weight_versions=tuple(kept.runs))
            part = request_id if n == 0 else f"{request_id}-{n}"
            gate.stoppers[part] = (session_id, replica)
            if n:
                gate.counters["resubmits"] += 1
            keeps = gate.keep_pauses
            try:
                result = await self.engine.generate(
                    kept.prompt(prompt_ids), dataclasses.replace(params, max_tokens=left) if kept.ids else params,
                    session_id=session_id, request_id=part, replica=replica,
                )  # fmt: skip
            except EngineAborted as e:
                kept.add(version, e.output_ids, e.logprobs)
                gate.kept(len(e.output_ids))
                continue
            except EngineError as e:  # nothing of a whole generation arrived: it is sampled again elsewhere
                replica = self._elsewhere(e, session_id, replica, dead, held or n > 0 or gate.keep_pauses != keeps)
                continue
            finally:
                self._left(part)
            if gate.keep_pauses != keeps:  # an engine pause held it: which tokens came before is not known
                said = [(result.weight_version, len(result.output_ids))]
                await self._held_by_engine(kept, version, 0, said, whole=True)
                kept.extend(result.output_ids, result.logprobs)
            elif not held and not kept.ids:
                return result  # neither waited nor stopped: untouched
            else:
                kept.add(version, result.output_ids, result.logprobs)
            return EngineResult(kept.ids, kept.logprobs, result.finish_reason, result.weight_version,
                                tuple(kept.runs))  # fmt: skip
        raise too_many_parts()

    async def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, session_id: str, request_id: str, replica: str = ""
    ) -> AsyncIterator[EngineChunk]:
        kept, held, gate, dead, started = _Kept(), False, self.gate, set[str](), False
        for n in range(MAX_PARTS):
            if started and gate.paused:  # the agent has part of the reply: no 503 now, keep-alives instead
                async for keepalive in self._kept_open():
                    yield keepalive
            version, waited = await self._enter()
            held = held or waited
            left = params.max_tokens - len(kept.ids)
            if left <= 0:
                gate.leave()
                yield EngineChunk([], [], "length", weight_versions=tuple(kept.runs))
                return
            part = request_id if n == 0 else f"{request_id}-{n}"
            gate.stoppers[part] = (session_id, replica)
            if n:
                gate.counters["resubmits"] += 1
            ids, logprobs, stopped_parts = kept.ids, kept.logprobs, self._stopped
            sampled, stopped, keeps = len(ids), None, gate.keep_pauses
            before, after = 0, None  # an engine pause: this part's tokens received before it, and the outputs since
            try:
                chunks = self.engine.stream(
                    kept.prompt(prompt_ids), dataclasses.replace(params, max_tokens=left) if ids else params,
                    session_id=session_id, request_id=part, replica=replica,
                )  # fmt: skip
                async with contextlib.aclosing(chunks) as opened:  # type: ignore[type-var]
                    # Read to the engine stream's own end, past the finish (its trailer: usage, [DONE]), so its
                    # connection goes back to the pool.
                    async for chunk in opened:
                        if gate.keep_pauses != keeps:
                            if after is None:
                                before, after = len(ids) - sampled, []
                            after.append((chunk.weight_version, len(chunk.output_ids)))
                        if chunk.finish_reason is not None:
                            if after is not None:
                                await self._held_by_engine(kept, version, before, after)
                                chunk = dataclasses.replace(chunk, weight_versions=tuple(kept.runs))
                            elif held or kept.runs:
                                kept.counted(version, len(ids) + len(chunk.output_ids) - sampled)
                                chunk = dataclasses.replace(chunk, weight_versions=tuple(kept.runs))
                            yield chunk
                            continue
                        ids += chunk.output_ids  # what a stop keeps: the next part's prompt
                        logprobs += chunk.logprobs
                        started = True
                        yield chunk
                        if part in stopped_parts:  # closed here: the engine stops (vLLM on the disconnect)
                            raise EngineAborted([], [])
                return  # finished: a backend raises for a stream that ends without a finish
            except (EngineAborted, EngineError) as e:
                if isinstance(e, EngineError):  # what it streamed is kept; the rest comes from another replica
                    touched = held or n > 0 or gate.keep_pauses != keeps
                    replica = self._elsewhere(e, session_id, replica, dead, touched)
                    e = EngineAborted([], [])
                if after is not None:  # held by an engine pause, then stopped by a pause in mode abort
                    await self._held_by_engine(kept, version, before, [*after, (None, len(e.output_ids))])
                else:
                    kept.counted(version, len(ids) - sampled + len(e.output_ids))
                kept.extend(e.output_ids, e.logprobs)
                gate.kept(len(ids) - sampled)
                stopped = EngineChunk(e.output_ids, e.logprobs) if e.output_ids else None
            finally:
                self._left(part)
            if stopped is not None:
                started = True
                yield stopped  # what the engine sampled and had not streamed: the agent sees it too
        raise too_many_parts()


def _sampled_under(said: str | None, version: int, end: int | None, whole: bool) -> int:
    """The policy version of tokens an engine pause held, sampled under `version` or after the resume to `end`
    (None: not known yet), from the version the engine said (SGLang: as the resume set it) of them all, or of the
    last of them (`whole`: a later version than `version` leaves the split unknown)."""
    if end == version:
        return version
    if said is None or end is None:
        return UNKNOWN_VERSION
    try:
        told = int(said)
    except ValueError:
        return version  # not one a resume set: from before it
    if not version < told <= end:
        return version
    return UNKNOWN_VERSION if whole else told


# A call stopped by this many pauses in a row gives up (a trainer pausing in a loop must not hold it forever).
MAX_PARTS = 64


def too_many_parts() -> ApiError:
    return ApiError(503, "unavailable", f"the generation was stopped by {MAX_PARTS} pauses; retry later",
                    code="generation_paused", headers={"retry-after": str(PAUSE_RETRY_AFTER_S)})  # fmt: skip
