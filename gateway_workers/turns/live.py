"""A turn streamed live: engine chunks -> `LiveDelta`s for the agent while the engine generates.

`start_live_turn` takes a turn OPENed and rendered (`TurnPipeline.prepare`), starts the engine
stream and waits for its first chunk, so an engine that fails at once still gets a proper
HTTP error. `LiveTurn.deltas()` then yields reasoning / text / tool-call deltas as they
become certain, runs the final (non-streaming) parse of all sampled ids when the engine
finishes, sends what that parse adds, and leaves the `CapturedTurn` to commit. Closing a
`LiveTurn` early closes the engine stream, which aborts the request on the engine.
Must not import the app or the adapters.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from broker.protocol import session_tag
from gateway_workers.engines.base import EngineChunk, EngineError, EngineResult, FinishReason
from gateway_workers.formats.live_split import IncrementalDecoder, StreamTracker, live_splitter
from gateway_workers.formats.parsed import LiveDelta
from gateway_workers.http.connection import AgentConnection
from gateway_workers.http.errors import ApiError
from gateway_workers.rendering.twins.bpe import token_decoder
from gateway_workers.turns.captured import CapturedTurn, PreparedTurn
from gateway_workers.turns.pipeline import TurnPipeline, engine_error

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0  # bound on closing an engine stream (an SGLang abort call included)
KEEPALIVE = LiveDelta("keepalive")


async def start_live_turn(pipeline: TurnPipeline, prepared: PreparedTurn, connection: AgentConnection) -> LiveTurn:
    """Start generating the prepared turn; raises ApiError (after aborting it). The caller must commit() or
    abort(), then close()."""
    try:
        live = LiveTurn(pipeline, prepared)  # builds the format's splitter: a parser from outside may raise
    except BaseException as e:
        pipeline.backplane.abort_in_background(prepared.session_id, prepared.turn_id, type(e).__name__)
        raise
    try:
        await live.start(connection)
    except BaseException as e:
        live.abort(type(e).__name__)
        await live.close()
        raise
    return live


class LiveTurn:
    """One turn whose reply is streamed while it is generated (a `captured.LiveReply`)."""

    replayed = False

    def __init__(self, pipeline: TurnPipeline, prepared: PreparedTurn) -> None:
        self.pipeline = pipeline
        self.prepared = prepared
        self.session_id = prepared.session_id
        self.turn_id = prepared.turn_id
        self.request = prepared.request
        self.prompt_ids = prepared.prompt_ids
        self.created = int(time.time())
        self.turn: CapturedTurn | None = None  # set once the engine finished and the final parse ran
        self._stream: AsyncIterator[EngineChunk] | None = None
        self._first: EngineChunk | None = None
        self._gen: Any = None
        self._settled = False
        self._decoder = IncrementalDecoder(token_decoder(pipeline.renderer.tokenizer))
        self._splitter = live_splitter(pipeline.parser, prepared.prompt_text, prepared.request.tools)
        self._tracker = StreamTracker()

    async def start(self, connection: AgentConnection) -> None:
        """Start the engine and wait for its first chunk (or the agent leaving)."""
        prepared = self.prepared
        if prepared.over_budget:
            # A prompt already over the context budget yields an empty `length` turn (`rendering.budget`).
            self._first = EngineChunk([], [], "length")
            return
        self._stream = self.pipeline.engine.stream(
            prepared.prompt_ids, prepared.params, session_id=self.session_id, request_id=self.turn_id,
            replica=prepared.replica,
        ).__aiter__()  # fmt: skip
        try:
            with connection.cancelled_on_disconnect():
                self._first = await self._next()
        except asyncio.CancelledError:  # the caller closes the engine stream, which aborts the request
            if connection.took_cancel():
                raise ApiError(499, "invalid_request", "client disconnected") from None
            raise

    async def _next(self) -> EngineChunk:
        assert self._stream is not None
        try:
            return await self._stream.__anext__()
        except StopAsyncIteration:  # a backend must raise instead; logged and answered as any engine failure
            error = EngineError("the engine stream ended without a finish", kind="incomplete")
            raise engine_error(error, self.session_id, self.turn_id) from None
        except EngineError as e:
            raise engine_error(e, self.session_id, self.turn_id) from None

    def deltas(self) -> AsyncIterator[LiveDelta]:
        """The reply as it is generated; raises ApiError if the engine fails mid-way. Iterate once."""
        if self._gen is None:
            self._gen = self._run()
        return self._gen  # type: ignore[no-any-return]

    async def _run(self) -> AsyncIterator[LiveDelta]:
        assert self._first is not None, "start() first"
        ids: list[int] = []
        logprobs: list[float] = []
        chunk = self._first
        finish: FinishReason | None = None
        version: str | None = None
        try:
            while True:
                ids += chunk.output_ids
                logprobs += chunk.logprobs
                version = chunk.weight_version or version
                versions = chunk.weight_versions
                for delta in self._split(self._decoder.feed(chunk.output_ids)):
                    yield delta
                if not chunk.output_ids and chunk.finish_reason is None:
                    yield KEEPALIVE  # the engine seam says it waits: the agent hears it is not dropped
                if chunk.finish_reason is not None:
                    finish = chunk.finish_reason
                    break
                chunk = await self._next()
            await self._drain()
        finally:
            if finish is None and self._stream is not None:
                await self._close_stream()
        for delta in self._split(self._decoder.flush()):
            yield delta
        t_engine = time.perf_counter()
        result = EngineResult(ids, logprobs, finish, weight_version=version, weight_versions=versions)
        parsed = self.pipeline.parser.parse(ids, self.prepared.prompt_text, self.request.tools)
        turn = self.pipeline.captured(self.prepared, result, parsed, t_engine)
        turn.created = self.created
        tail, consistent = self._tracker.remainder(parsed)
        if not consistent:
            # Only for replies the final parse finds ill-formed (or a format's splitter got wrong): the
            # agent saw text the stored message lacks; its tokens are still exactly what was sampled.
            logger.warning(
                "turn %s (session %s): the live stream diverged from the final parse",
                self.turn_id,
                session_tag(self.session_id),
            )
            turn.flags["stream_diverged"] = True
        self.turn = turn
        for delta in tail:
            yield delta

    async def _drain(self) -> None:
        """Read the engine's trailer (usage, [DONE]): it is checked, and the connection stays reusable."""
        if self._stream is None:
            return
        try:
            async for _ in self._stream:
                pass
        except EngineError as e:
            raise engine_error(e, self.session_id, self.turn_id) from None

    def _split(self, text: str) -> list[LiveDelta]:
        if not text:
            return []
        deltas = self._splitter.feed(text)
        for delta in deltas:
            self._tracker.record(delta)
        return deltas

    async def _close_stream(self) -> None:
        stream, self._stream = self._stream, None
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            try:
                await asyncio.wait_for(aclose(), CLOSE_TIMEOUT_S)
            except (asyncio.TimeoutError, EngineError, RuntimeError) as e:
                logger.warning("closing the engine stream of turn %s failed: %s", self.turn_id, e)

    @property
    def finish_reason(self) -> str:
        """stop | length | tool_calls (the OpenAI names), once the turn is complete."""
        assert self.turn is not None
        return self.turn.finish_reason

    def commit(self) -> None:
        if self._settled:
            return
        self._settled = True
        if self.turn is None:  # a caller bug: never commit a reply the engine did not finish
            logger.error("turn %s committed before its stream finished; aborting it", self.turn_id)
            self.pipeline.backplane.abort_in_background(self.session_id, self.turn_id, "incomplete stream")
            return
        self.turn.commit()

    def abort(self, reason: str) -> None:
        if self._settled:
            return
        self._settled = True
        if self.turn is not None:
            self.turn.abort(reason)
        else:
            self.pipeline.backplane.abort_in_background(self.session_id, self.turn_id, reason)

    async def close(self) -> None:
        """Stop generating if the stream was left early (the engine request is aborted); idempotent."""
        gen, self._gen = self._gen, None
        if gen is not None:
            try:
                await asyncio.wait_for(gen.aclose(), CLOSE_TIMEOUT_S)
            except (asyncio.TimeoutError, RuntimeError, ApiError) as e:
                logger.warning("closing the live stream of turn %s failed: %s", self.turn_id, e)
        if self._stream is not None and self.turn is None:
            await self._close_stream()
