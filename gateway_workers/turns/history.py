"""Linear history on the worker: a request that extends a held turn is prompted with that turn's ids.

In a linear session (`TurnOpened.history_mode`) the broker names the session's heads: its newest committed
turns, each with its message count n and the echo fingerprint of its tools and its response, the message it
ends with (`broker.message_keys`), recorded by the worker that committed it. A request whose n-th message
has a head's fingerprint (with the same tools), and whose first n messages have the same keys as that head's
(compared once the held turn is at hand), extends that head: its prompt is the head's prompt ids + output
ids, the ids the engine saw, then the template's rendering of only the new messages
(`rendering.linear.linear_tail`). The trajectory builder then finds the turn on the head's row, so
an append-only episode is one row and every trained token follows exactly what the engine saw. The held
ids come from this worker's commit base when it committed the head, else from the broker
(`GetTurn.with_ids`), so no session is pinned to a worker.

A request that echoes a reply whose commit has not reached the broker yet (the agent got the reply a
moment before its COMMIT landed) would match only the turn before it: while the session has other turns
in flight and the new messages hold an assistant message, the OPEN is asked again (same turn, fresh
heads) for up to LINEAR_WAIT_S. A request that extends no head, or whose tail cannot be placed, follows
the session's fallback: fork or rerender (a full render; see `broker.sessions.history`) or reject (a 400
naming the first message that differs).
"""

from __future__ import annotations

import asyncio
from array import array
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import compress, count, repeat
from operator import is_not, itemgetter
from typing import Any

import orjson

from broker import protocol
from broker.message_keys import EchoDigest, canonical_json, first_format_digests, is_first_format, message_key
from gateway_workers.capture.backplane import Backplane, TurnRefused
from gateway_workers.capture.commit_bases import CommitBase
from gateway_workers.http.errors import ApiError
from gateway_workers.rendering.linear import HeadRenders, LinearTail, TailRefusal, linear_tail
from gateway_workers.rendering.messages import message_chars
from gateway_workers.rendering.renderer import RenderedPrompt, Renderer

# How long a request that echoes a reply not yet committed waits for that commit (it is usually
# milliseconds behind the reply), and the pauses between two asks.
LINEAR_WAIT_S = 10.0
LINEAR_ASK_FIRST_S = 0.005
LINEAR_ASK_MAX_S = 0.2
# The characters of distinct tool sets a worker keeps one copy of (the sessions of one run share theirs).
TOOL_SETS_CHARS = 8 * 1024 * 1024
_TEXT_TYPES = {str, type(None)}


def render_context(tools: Sequence[Mapping[str, Any]] | None) -> str:
    """What else must match for a request to extend a turn: the tools, whose block the tail does not re-render."""
    return canonical_json(tools or [])


def echo_flag(echo: EchoDigest, response: Mapping[str, Any]) -> list[Any]:
    """`CommitTurn.flags["echo"]` of a linear turn: `[message_count, fingerprint]` of its messages + its response;
    `echo` is the digest of its tools context, as many messages in as it was prompted with."""
    with_response = echo.copy().add([response])
    return [with_response.count, with_response.hexdigest()]


@dataclass(frozen=True, slots=True)
class HeldTurn:
    """A committed turn a request extends: its canonical messages and the ids the engine saw."""

    turn_id: str
    prompt_messages: Sequence[Any]
    response: Mapping[str, Any]
    context: array  # its prompt ids + output ids: a copy of this turn's own, which the next prompt extends
    prompt_tokens: int

    @property
    def output_ids(self) -> array:
        return self.context[self.prompt_tokens :]


@dataclass(frozen=True, slots=True)
class LinearPrompt:
    """How a linear session's turn is prompted: `rendered` (None: render the messages in full) and its
    `kind` for the commit's `history` flag: linear, first, fork or rerender. `opened` is the latest OPEN reply;
    `echo` the digest of the tools context, as many messages in as the request has, which the commit continues
    with the response (`echo_flag`)."""

    kind: str
    rendered: RenderedPrompt | None
    opened: protocol.TurnOpened
    echo: EchoDigest


class LinearHistory:
    """Builds linear sessions' prompts for one worker's pipeline.

    A request usually extends the turn its session last committed through this worker (one connection per
    agent): that head is matched by comparing the request's messages with the commit base's (echoed
    unchanged, they compare equal at C speed) and the tools with those that turn was prompted with. Any other
    head is found by the fingerprints (`_extended_heads`): one message digested per head, whatever the history.
    A turn's own fingerprint digests only its response.
    """

    def __init__(self, backplane: Backplane, renderer: Renderer, end_markers: Sequence[str]) -> None:
        self.backplane = backplane
        self.renderer = renderer
        self.end_markers = tuple(end_markers)
        # Where held turns came from (this worker's commit base, or the broker), how many requests were
        # matched to the head committed here without fingerprints, and how often one waited for a commit
        # still on its way: /metrics.
        self.counters: Counter[str] = Counter()
        self.heads = HeadRenders()
        # Each linear session's last turn prompted here, with its tools context: (turn id, context). As many
        # sessions as have commit bases here: the match it serves needs the base too.
        self._prompted: OrderedDict[str, tuple[str, str]] = OrderedDict()
        # One copy of each tools context and its CRC (where every fingerprint starts), by the tools' orjson
        # text: the context's own JSON encoding is stdlib's (recorded digests depend on it), many times
        # orjson's time, and the tools rarely change.
        self._tool_sets: dict[bytes, tuple[str, int]] = {}
        self._tool_chars = 0

    def forget_sessions(self, sessions: list[str]) -> None:
        """Sessions that ended: drop their stand-in heads' renders and their last prompted turn."""
        self.heads.forget(sessions)
        for session in sessions:
            self._prompted.pop(session, None)

    async def prompt(
        self, session_id: str, turn_id: str, messages: list[dict[str, Any]], tools: Any, opened: protocol.TurnOpened
    ) -> LinearPrompt:
        """The prompt of turn `turn_id` (OPENed: `opened`); raises ApiError (reject) or the backplane's errors."""
        (context, start), last = self._note_prompted(session_id, turn_id, tools)
        echo = EchoDigest(crc=start, count=len(messages))
        loop = asyncio.get_running_loop()
        deadline, pause = loop.time() + LINEAR_WAIT_S, LINEAR_ASK_FIRST_S
        fetched: dict[str, HeldTurn | None] = {}  # the held turns asked for, kept while the OPEN is asked again
        while True:
            local = _local_head(self.backplane.bases.get(session_id), last, opened.heads, messages, context)
            candidates = [local] if local else _extended_heads(opened.heads, messages, context, start)
            # confirmed before the wait is judged: a head of another line may end with the same reply
            held = await self._extended(session_id, messages, candidates, bool(local), fetched)
            new = messages[len(held.prompt_messages) + 1 :] if held is not None else messages
            if not (opened.pending and any(m.get("role") == "assistant" for m in new)) or loop.time() > deadline:
                break
            self.counters["linear_waits"] += 1
            await asyncio.sleep(pause)
            pause = min(2 * pause, LINEAR_ASK_MAX_S)
            opened = await self.backplane.open_turn(session_id, turn_id)  # type: ignore[assignment]
        if held is None:  # no head; one gone since the OPEN (the session is finishing); chance fingerprints
            if not opened.heads:
                return LinearPrompt("first", None, opened, echo)
            return await self._fallback(session_id, messages, opened, echo, None)
        if local:
            self.counters["linear_matched_local"] += 1

        def place() -> LinearTail | TailRefusal:
            return linear_tail(self.renderer, held.prompt_messages, held.response, held.output_ids, new,
                               end_markers=self.end_markers, tools=tools, heads=(self.heads, session_id))  # fmt: skip

        # As the tree path's renders: on the event loop's thread when it is cheap (no hand-off, and the loop's
        # warm tokenizer caches), else on the render thread.
        inline = self.renderer.inline(message_chars(new), renders=3)  # a head not kept: three renders
        tail = place() if inline else await loop.run_in_executor(self.renderer.thread, place)
        if isinstance(tail, TailRefusal):
            return await self._fallback(session_id, messages, opened, echo, tail)
        return LinearPrompt("linear", _prompt(held, tail), opened, echo)

    def _note_prompted(
        self, session_id: str, turn_id: str, tools: Any
    ) -> tuple[tuple[str, int], tuple[str, str] | None]:
        """The request's tools context and its CRC, kept once per tool set; and the session's last turn prompted
        here before this one, with its context: `turn_id` takes its place."""
        context = self._tools_context(tools)
        prompted = self._prompted
        last = prompted.pop(session_id, None)
        prompted[session_id] = (turn_id, context[0])
        if len(prompted) > self.backplane.bases.max_sessions:
            prompted.popitem(last=False)
        return context, last

    def _tools_context(self, tools: Any) -> tuple[str, int]:
        """`render_context(tools)` and its CRC, kept once per tool set. orjson's text tells apart every two tool
        sets a body can hold (it writes NaN as null, but a body's JSON has no NaN); it refuses integers past 64
        bits, whose tools are rendered every time. Unsorted: a tool set sent with its keys in another order is
        kept twice, with the same context, and no request pays for sorting."""
        try:
            key = orjson.dumps(tools or [])
        except orjson.JSONEncodeError:
            text = render_context(tools)
            return text, EchoDigest(text).crc
        context = self._tool_sets.get(key)
        if context is None:
            text = render_context(tools)
            context = (text, EchoDigest(text).crc)
            if self._tool_chars + len(key) + len(text) > TOOL_SETS_CHARS:
                # Full: start over, and forget what referred to the old copies, so the bound holds
                self._tool_sets.clear()
                self._prompted.clear()
                self._tool_chars = 0
            self._tool_sets[key] = context
            self._tool_chars += len(key) + len(text)
        return context

    async def _extended(
        self,
        session_id: str,
        messages: list[dict[str, Any]],
        candidates: list[tuple[str, int]],
        compared: bool,
        fetched: dict[str, HeldTurn | None],
    ) -> HeldTurn | None:
        """The first of `candidates` still held whose messages `messages` begin with, key for key (what its
        fingerprint only suggested; `compared`: the one candidate was compared already), or None. `fetched`
        keeps the turns held by the broker once asked for."""
        for turn_id, _ in candidates:
            held = fetched[turn_id] if turn_id in fetched else await self._held(session_id, turn_id)
            fetched[turn_id] = held
            if held is not None and (compared or _same_messages(messages, [*held.prompt_messages, held.response])):
                return held
        return None

    async def _held(self, session_id: str, turn_id: str) -> HeldTurn | None:
        base = self.backplane.bases.get(session_id)
        if base is not None and base.turn_id == turn_id:
            context = array("i")
            context.frombytes(base.context)
            self.counters["linear_held_local"] += 1
            return HeldTurn(turn_id, base.messages[:-1], base.messages[-1], context, base.prompt_tokens)
        try:
            found = await self.backplane.get_turn(session_id, turn_id, with_ids=True)
        except TurnRefused as e:
            if e.code in ("unknown_turn", "session_closed"):
                return None
            raise
        self.counters["linear_held_fetched"] += 1
        context, n = found.prompt_ids, len(found.prompt_ids)  # decoded for this call: ours to extend
        context.extend(found.output_ids)
        return HeldTurn(turn_id, found.prompt_messages, found.response_message, context, n)

    async def _fallback(
        self,
        session_id: str,
        messages: list[dict[str, Any]],
        opened: protocol.TurnOpened,
        echo: EchoDigest,
        tail: TailRefusal | None,
    ) -> LinearPrompt:
        if opened.linear_fallback != "reject":
            return LinearPrompt(opened.linear_fallback or "fork", None, opened, echo)
        if tail is not None:
            raise ApiError(
                400, "invalid_request", "this session's history is linear and its new messages cannot follow the "
                f"ids its previous turn holds ({tail.reason}: {tail.detail})", code=protocol.NOT_LINEAR,
            )  # fmt: skip
        newest = await self._held(session_id, opened.heads[0][0])
        held = [*newest.prompt_messages, newest.response] if newest is not None else []
        at = next((i for i, (a, b) in enumerate(zip(messages, held, strict=False)) if message_key(a) != message_key(b)),
                  min(len(messages), len(held)))  # fmt: skip
        raise ApiError(
            400, "invalid_request", f"this session's history is linear: messages[{at}] differs from what its previous "
            "turn holds there (edited history, another system prompt, a compaction?); its requests must extend it",
            code=protocol.NOT_LINEAR, param=f"messages[{at}]",
        )  # fmt: skip


def _extended_heads(
    heads: list[list[Any]], messages: list[dict[str, Any]], context: str, start: int
) -> list[tuple[str, int]]:
    """(turn id, message count n) of each head that `messages` may extend (by more), as the fingerprints tell:
    the tools context's (`context`, whose CRC is `start`) continued with the n-th message, the head's reply as
    echoed. Those with the most messages first, then the newest. A head recorded before the fingerprints'
    format changed (a broker's log or image) is compared in its own format, which digests every message."""
    found: list[tuple[str, int]] = []
    digests: dict[int, str] = {}
    first_format: dict[int, str] | None = None
    for turn_id, n, digest in heads:  # newest first
        if type(n) is not int or not 0 < n < len(messages):
            continue
        if is_first_format(digest):
            if first_format is None:
                first_format = first_format_digests(context, messages, [h[1] for h in heads])
            expected = first_format.get(n)
        else:
            expected = digests.get(n)
            if expected is None:
                expected = digests[n] = EchoDigest(crc=start).add(messages[n - 1 : n]).hexdigest()
        if expected == digest:
            found.append((turn_id, n))
    found.sort(key=itemgetter(1), reverse=True)  # stable: the newest first of those as long
    return found


def _local_head(
    base: CommitBase | None,
    last: tuple[str, str] | None,
    heads: list[list[Any]],
    messages: list[dict[str, Any]],
    context: str,
) -> tuple[str, int] | None:
    """(turn id, message count) of the head `messages` extends when that head is the session's commit base here
    (`base`), was prompted here with the same tools (`last`), and no other head with as many messages or more
    could be extended instead: found by comparing messages (confirmed, unlike a fingerprint); else None. An
    unchanged echo's messages are replaced in `messages` by the base's own (equal, the same JSON), in the list
    the request's parse holds: the session's next request takes them from there (`Adapter.parse_request`'s
    `earlier`), so its match finds them identical."""
    if base is None or last is None or last != (base.turn_id, context):
        return None
    n = len(base.messages)
    head = next((h for h in heads if h[0] == base.turn_id), None)
    if head is None or head[1] != n or n >= len(messages):
        return None
    # Another head as long or longer may be the one to extend (the fingerprints pick the newest of a tie)
    if any(h[0] != base.turn_id and type(h[1]) is int and n <= h[1] < len(messages) for h in heads):
        return None
    same = _identical(messages, base.messages)
    if _unchanged_echo(messages, base.messages, same):
        # The same JSON, message for message: the held objects take their place, so the commit's delta against
        # this base finds them shared by identity instead of comparing the history a second time.
        messages[:n] = base.messages
    elif not _same_keys(messages, base.messages, same):
        return None
    return base.turn_id, n


def _same_messages(messages: Sequence[Any], held: Sequence[Any]) -> bool:
    """Whether `messages` begin with `held`, key for key (what the fingerprint only suggested), and add more."""
    same = _identical(messages, held)
    return _unchanged_echo(messages, held, same) or _same_keys(messages, held, same)


def _unchanged_echo(messages: Sequence[Any], held: Sequence[Any], same: int) -> bool:
    """Whether `messages` begin with `held` written as the same JSON, and add more: the usual case, settled in C.
    Past the `same` messages that are the held objects themselves (`_identical`), the lists compare equal, every
    content is text, and the tool calls, the one place equal dicts can hold other JSON (see `_same_message`),
    write the same JSON, all of them in one orjson call per side (no Python step per message). Roles are
    text: the adapters admit no other."""
    n = len(held)
    if len(messages) <= n:
        return False
    echoed, held = messages[same:n], held[same:]
    if echoed != held:
        return False
    try:
        texts = set(map(type, map(dict.get, echoed, repeat("content")))) <= _TEXT_TYPES
        return texts and orjson.dumps(list(map(dict.get, echoed, repeat("tool_calls")))) == orjson.dumps(
            list(map(dict.get, held, repeat("tool_calls")))
        )
    except (TypeError, orjson.JSONEncodeError):  # not dicts; keys that are not strings, integers past 64 bits
        return False


def _same_keys(messages: Sequence[Any], held: Sequence[Any], same: int) -> bool:
    """Whether `messages` begin with `held` key for key, compared message by message past the `same` ones that
    are the held objects (`_identical`), and add more."""
    n = len(held)
    return len(messages) > n and all(map(_same_message, messages[same:n], held[same:]))


def _identical(messages: Sequence[Any], held: Sequence[Any]) -> int:
    """How many leading `messages` are `held`'s own objects: a request parsed from the body that extends the
    one before takes that one's messages (`Adapter.parse_request`'s `earlier`), which were the held turn's
    when it was matched to it, so only the messages since need comparing. One pass in C."""
    return next(compress(count(), map(is_not, messages, held)), min(len(messages), len(held)))


def _same_message(a: Any, b: Any) -> bool:
    """A key is made of a message's role, content and tool calls, whatever else it holds (the reasoning a client
    drops on echo, a name it adds), so messages whose three compare equal at C speed have the same key, but for
    values of other types that compare equal (1 == 1.0 == True in tool-call arguments, which the keys write as
    JSON): where there are tool calls or content that is not text, the three must also write the same JSON,
    which tells those types apart, in orjson's time rather than the keys' (the one value orjson writes as
    another, NaN as null, never compares equal to it). Anything else is keyed."""
    if type(a) is dict and type(b) is dict:
        keyed = (a.get("role"), a.get("content"), a.get("tool_calls"))
        if type(keyed[0]) is str and keyed == (b.get("role"), b.get("content"), b.get("tool_calls")):
            if not keyed[2] and type(keyed[1]) in _TEXT_TYPES:
                return True
            try:
                if orjson.dumps(keyed, option=orjson.OPT_SORT_KEYS) == orjson.dumps(
                    (keyed[0], b.get("content"), b.get("tool_calls")), option=orjson.OPT_SORT_KEYS
                ):
                    return True
            except orjson.JSONEncodeError:  # keys that are not strings, integers past 64 bits: keyed
                pass
    return message_key(a) == message_key(b)


def _prompt(held: HeldTurn, tail: LinearTail) -> RenderedPrompt:
    """The held ids, then the tail (extending the held turn's own copy); the text is the tail's (what the parser
    reads of the prompt: its end)."""
    ids = held.context
    ids.extend(tail.ids)
    return RenderedPrompt(prompt_ids=ids, text=tail.text)
