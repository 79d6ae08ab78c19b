"""The plumbing the HTTP engines (vLLM, SGLang) share behind `engines.base.Engine`.

Replica choice (the broker's, else this worker's rendezvous hash), one keep-alive `http.client.HttpPool` per
engine object, JSON POSTs with bounded timeouts, orjson bodies in which each session's prompt ids are written
once (`PromptJson`), an SSE reader for streamed generations, the stop of a generation in flight (`abort`, which
the backend answers with `EngineAborted`) and the engine's own pause and resume; each backend gives its URLs and
bodies. Also the checks their answers share (`bad_answer`, `incomplete`, `all_ints`, `as_floats`).
Must not import the app, adapters, backplane or transformers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from array import array
from collections import Counter, OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, Protocol

import numpy
import orjson

from gateway_workers.engines.base import EngineError, EngineTimeout, FaultKind
from gateway_workers.engines.config import EngineConfig
from gateway_workers.engines.http.client import HttpConnectionError, HttpPool, HttpTimeout, tls_context
from gateway_workers.engines.routing import choose_replica, routing_headers, routing_key

logger = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 2.0  # bound on the best-effort abort call sent when a generate is cancelled
CONTROL_TIMEOUT_S = 30.0  # bound on one call of an engine's own pause or resume
# A pause's abort of a generation is asked again this often, this many times, while the call runs.
ABORT_AGAIN_S = 0.1
ABORT_TRIES = 20

_BODY_SNIPPET = 300  # bytes of an engine's error body quoted in our error message
# One SSE event may carry a whole generation's logprobs (SGLang's cumulative streaming): bound, don't trust.
MAX_SSE_EVENT_BYTES = 64 * 1024 * 1024
# After an SSE stream's [DONE], how long its body's end may take to arrive before the connection is dropped.
SSE_TAIL_WAIT_S = 0.5


# Each worker keeps the JSON of recent sessions' last prompts (about 11 bytes per token with the raw ids).
PROMPT_JSON_SESSIONS = 4096
PROMPT_JSON_BYTES = 128 * 1024 * 1024


class PromptJson:
    """Prompt ids as the JSON text of an engine request, each id of a session's context written once.

    A conversation grows at its end, so a turn's prompt usually begins with the session's previous prompt
    (in linear history it is that prompt, the output and the new messages' ids). Each recent session's last
    prompt is kept with its text, and a prompt that begins with it is written as that text and its new ids;
    any other prompt is written whole. Without this each turn writes every id of its context again, the
    largest cost of a long-context turn after parsing the agent's body (docs/performance.md). Bounded by
    sessions and bytes, the least recently used dropped first; the event loop's thread only.
    """

    def __init__(self, max_sessions: int = PROMPT_JSON_SESSIONS, max_bytes: int = PROMPT_JSON_BYTES) -> None:
        self.max_sessions, self.max_bytes = max_sessions, max_bytes
        self._last: OrderedDict[str, tuple[bytes, bytes]] = OrderedDict()  # session -> (int32 ids, their JSON)
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._last)

    def __call__(self, session_id: str, ids: Sequence[int]) -> orjson.Fragment:
        """`ids` as a JSON array, pre-serialized for the request body; kept as the session's last prompt."""
        raw = ids.tobytes() if isinstance(ids, array) and ids.typecode == "i" and ids.itemsize == 4 else _int32(ids)
        last = self._drop(session_id)
        if last is not None and raw == last[0]:
            text = last[1]
        elif last is not None and last[0] and len(raw) > len(last[0]) and raw.startswith(last[0]):
            new = _json_ids(raw, len(last[0]))
            text = b"".join((memoryview(last[1])[:-1], b",", memoryview(new)[1:]))  # [a,b] + [c] -> [a,b,c]
        else:
            text = _json_ids(raw)
        self._last[session_id] = (raw, text)
        self._bytes += len(raw) + len(text)
        while self._last and (len(self._last) > self.max_sessions or self._bytes > self.max_bytes):
            self._drop(next(iter(self._last)))
        return orjson.Fragment(text)

    def forget(self, sessions: list[str]) -> None:
        for session in sessions:
            self._drop(session)

    def _drop(self, session_id: str) -> tuple[bytes, bytes] | None:
        last = self._last.pop(session_id, None)
        if last is not None:
            self._bytes -= len(last[0]) + len(last[1])
        return last


def _int32(ids: Sequence[int]) -> bytes:
    return array("i", ids).tobytes()


def _json_ids(raw: bytes, offset: int = 0) -> bytes:
    """The JSON array of the int32 ids in `raw` from byte `offset`: a numpy view, which orjson writes natively,
    several times faster than a Python list (docs/performance.md)."""
    return orjson.dumps(numpy.frombuffer(raw, dtype=numpy.int32, offset=offset), option=orjson.OPT_SERIALIZE_NUMPY)


class HttpEngineBase:
    """Plumbing shared by the HTTP engines: replica choice, one keep-alive pool, JSON POSTs with bounds.

    The pool is created lazily on first use and binds to the running loop then (an engine object
    may be built before the worker's loop starts); `aclose` closes every connection.
    """

    def __init__(self, config: EngineConfig) -> None:
        if not config.urls:
            raise ValueError(f"{config.kind} engine needs at least one URL")
        self._config = config
        self._urls = self.replicas = tuple(url.rstrip("/") for url in config.urls)
        # Built here, at worker startup, so an unusable CA file fails the start rather than each request; also
        # without an https:// URL given, since the broker may route sessions to one (`SetEngines`).
        self._tls = tls_context(config.ca_file)
        self._pool: HttpPool | None = None
        self.faults: Counter[tuple[str, FaultKind]] = Counter()
        self.prompt_json = PromptJson()
        # Generations in flight, and those of them `abort` asked the engine to stop: their abort answer is not a
        # failure but `EngineAborted`.
        self.in_flight: set[str] = set()
        self.stopping: set[str] = set()

    def forget_sessions(self, sessions: list[str]) -> None:
        self.prompt_json.forget(sessions)

    def route(self, session_id: str, replica: str = "") -> tuple[str, dict[str, str]]:
        """(replica base url, routing headers) for a session: the broker's choice (`replica`), else this worker's
        own, by rendezvous hashing over its --engine-url list."""
        key = routing_key(session_id)
        return replica or choose_replica(self._urls, key), routing_headers(key)

    async def abort(self, request_id: str, *, session_id: str, replica: str = "") -> None:
        if request_id not in self.in_flight:
            return  # ended meanwhile: nothing to stop
        self.stopping.add(request_id)
        base, headers = self.route(session_id, replica)
        url, body = self.abort_request(base, request_id)
        # Asked again while the call runs: the request may not have reached the engine when the first ask did.
        for _ in range(ABORT_TRIES):
            try:
                await self.post(url, body, headers, timeout=ABORT_TIMEOUT_S)
            except EngineError as e:
                logger.warning("the engine at %s did not stop request %s (it runs to its end): %s", base,
                               request_id, e)  # fmt: skip
                return
            await asyncio.sleep(ABORT_AGAIN_S)
            if request_id not in self.in_flight:
                return
        logger.warning("the engine at %s did not stop request %s within %.1fs: it runs to its end", base, request_id,
                       ABORT_TRIES * ABORT_AGAIN_S)  # fmt: skip

    def abort_request(self, base: str, request_id: str) -> tuple[str, dict[str, Any]]:
        """The URL and body that ask the engine to stop a generation (each backend's own)."""
        raise NotImplementedError

    def pause_requests(self, base: str) -> list[tuple[str, dict[str, Any]]]:
        """The URLs and bodies, in order, of the engine's own pause (each backend's own)."""
        raise NotImplementedError

    def resume_requests(self, base: str, weight_version: int | None) -> list[tuple[str, dict[str, Any]]]:
        """The URLs and bodies, in order, that end it (each backend's own)."""
        raise NotImplementedError

    async def pause_replica(self, replica: str) -> None:
        for url, body in self.pause_requests(replica):
            await self.post(url, body, {}, timeout=CONTROL_TIMEOUT_S)

    async def resume_replica(self, replica: str, weight_version: int | None) -> None:
        for url, body in self.resume_requests(replica, weight_version):
            await self.post(url, body, {}, timeout=CONTROL_TIMEOUT_S)

    def settled(self, request_id: str) -> None:
        """A call `abort` could stop (in `in_flight` from its start) is over."""
        self.in_flight.discard(request_id)
        self.stopping.discard(request_id)

    def pool(self) -> HttpPool:
        if self._pool is None:
            self._pool = HttpPool(self._config.connect_timeout_s, tls=self._tls)
        return self._pool

    def count_fault(self, replica: str, error: EngineError) -> None:
        """Count a failed call against its replica (once per call: the backends call this where it fails)."""
        self.faults[replica, error.kind] += 1

    async def post(
        self, url: str, body: dict[str, Any], headers: dict[str, str], timeout: float | None = None
    ) -> bytes:
        """POST `body` as JSON and return the 2xx answer's body; failures become EngineError/EngineTimeout.

        `timeout` (seconds, default the config's request_timeout_s) bounds the whole call, connecting included.
        """
        limit = timeout or self._config.request_timeout_s
        data = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
        try:
            status, raw = await self.pool().post(url, data, headers, limit)
        except HttpTimeout as e:
            raise EngineTimeout(f"engine {url} did not answer within {limit}s") from e
        except HttpConnectionError as e:
            raise EngineError(f"engine {url} request failed: {type(e).__name__}: {e}", kind="connection") from e
        if status >= 300:
            snippet = raw[:_BODY_SNIPPET].decode("utf-8", "replace")
            raise EngineError(f"engine {url} answered HTTP {status}: {snippet}", status=status, kind="status")
        return raw

    async def post_json(
        self, url: str, body: dict[str, Any], headers: dict[str, str], timeout: float | None = None
    ) -> Any:
        """`post`, and the answer decoded as JSON (an EngineError if it is not)."""
        raw = await self.post(url, body, headers, timeout)
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise bad_answer(url, f"not JSON: {raw[:_BODY_SNIPPET]!r}") from e

    async def stream_json(
        self, url: str, body: dict[str, Any], headers: dict[str, str]
    ) -> AsyncGenerator[Any, None]:
        """POST `body` and yield each SSE `data:` event decoded as JSON, until `[DONE]` or the end of the body.

        Closing the iterator closes the connection, which is how vLLM learns the client went away.
        The config's request_timeout_s bounds the whole stream. Failures become EngineError/EngineTimeout.
        """
        limit = self._config.request_timeout_s
        data = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
        resp = None
        try:
            resp = await self.pool().open_stream(url, data, headers, limit)
            if resp.status >= 300:
                snippet = (await resp.read())[:_BODY_SNIPPET].decode("utf-8", "replace")
                raise EngineError(f"engine {url} answered HTTP {resp.status}: {snippet}", status=resp.status,
                                  kind="status")
            if resp.content_type.startswith(b"application/json"):
                # An engine that ignores `stream` (a version or route without streaming) answers one JSON body,
                # which holds no events: it must not pass for an empty generation.
                raise bad_answer(url, f"a JSON body to a streaming request: {(await resp.read())[:_BODY_SNIPPET]!r}")
            async for event in _sse_events(resp, url):
                if event == b"[DONE]":
                    # The body's end follows at once: reading it lets the connection go back to the pool.
                    with contextlib.suppress(asyncio.TimeoutError, HttpConnectionError, HttpTimeout):
                        await asyncio.wait_for(resp.read(), SSE_TAIL_WAIT_S)
                    return
                try:
                    decoded = orjson.loads(event)
                except orjson.JSONDecodeError as e:
                    raise bad_answer(url, f"a streamed event that is not JSON: {event[:_BODY_SNIPPET]!r}") from e
                yield decoded
        except HttpTimeout as e:
            raise EngineTimeout(f"engine {url} did not finish within {limit}s") from e
        except HttpConnectionError as e:
            raise EngineError(f"engine {url} stream failed: {type(e).__name__}: {e}", kind="connection") from e
        finally:
            if resp is not None:
                resp.close()  # a body not read to its end closes the connection; a finished one is pooled already

    async def aclose(self) -> None:
        if self._pool is not None:
            await self._pool.aclose()
        self._pool = None


class _ChunkSource(Protocol):
    def iter_any(self) -> AsyncIterator[bytes]: ...


async def _sse_events(content: _ChunkSource, url: str) -> AsyncIterator[bytes]:
    """The `data` of each server-sent event (multi-line data joined with newlines); other fields are ignored.

    Reads raw chunks rather than lines: a cumulative SGLang event holds every logprob so far, so
    one line may be megabytes (bounded by MAX_SSE_EVENT_BYTES).
    """
    buffer = b""
    data: list[bytes] = []
    async for chunk in content.iter_any():
        buffer += chunk
        if len(buffer) > MAX_SSE_EVENT_BYTES:
            raise EngineError(f"engine {url} streamed an event over {MAX_SSE_EVENT_BYTES} bytes")
        *lines, buffer = buffer.split(b"\n")
        for raw in lines:
            line = raw[:-1] if raw.endswith(b"\r") else raw
            if not line:
                if data:
                    yield b"\n".join(data)
                    data = []
            elif line.startswith(b"data:"):
                value = line[5:]
                data.append(value[1:] if value.startswith(b" ") else value)
    if buffer.startswith(b"data:"):
        data.append(buffer[5:].lstrip(b" "))
    if data:
        yield b"\n".join(data)


def bad_answer(url: str, what: str) -> EngineError:
    """An engine answered 2xx with a body we cannot use."""
    return EngineError(f"engine {url} answered an unusable body: {what}", kind="bad_answer")


def incomplete(url: str, what: str) -> EngineError:
    """A generation that did not finish: what was sampled is not a reply, so none is sent or recorded."""
    return EngineError(f"engine {url} did not finish the generation: {what}", kind="incomplete")


# An answer's ids and logprobs are read on every turn, so whole lists are checked by the set of
# their items' types (C loops) rather than item by item; exact types also refuse bools.
_INT = frozenset([int])
_FLOAT = frozenset([float])
_NUMBER = frozenset([int, float])


def all_ints(values: list[Any]) -> bool:
    """Whether every item is an int (not a bool)."""
    return set(map(type, values)) <= _INT


def as_floats(values: list[Any]) -> list[float] | None:
    """The items as floats, or None when one is neither an int nor a float (bools included)."""
    kinds = set(map(type, values))
    if not kinds <= _NUMBER:
        return None
    return values if kinds <= _FLOAT else [float(v) for v in values]
