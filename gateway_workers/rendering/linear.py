"""Linear history: the prompt tail that extends a session's held ids with the rendering of only the new messages.

In `linear` history mode a turn whose messages extend the session's previous turn is prompted with the
ids the session holds (that turn's prompt ids + its sampled output ids) followed by `linear_tail`: the
chat template's own rendering of the new messages after the existing ones, including whatever closing
of the previous reply the output lacks and the generation prompt (the tools block is not re-rendered).
The tail is measured on a stand-in conversation, the few earlier messages the rendering of later ones
can depend on, then the previous reply and the new messages, and only its text is tokenized, so the
cost grows with the new messages, not with the history; the stand-in's head renders are kept per
session (`HeadRenders`), so a tool-calling turn renders the template once. Where the tail cannot be
placed safely the answer is a `TailRefusal` naming why, never a guess. Imports the renderer only; must
not import the app, adapters, engines, parsers or the backplane.
"""

from __future__ import annotations

import json
import threading
import weakref
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from gateway_workers.rendering.messages import RenderError
from gateway_workers.rendering.renderer import Renderer
from gateway_workers.rendering.twins.bpe import token_decoder

# A stop token the model samples where the template writes another token when it renders the reply back
# into history. Harmony (gpt-oss) ends a final answer with <|return|> when sampled and with <|end|> in
# history (the harmony format's rule; gptoss.jinja writes it so). The held ids keep the sampled token.
STOP_EQUIVALENTS: Mapping[str, str] = {"<|return|>": "<|end|>"}

# The stand-in heads a worker keeps renders of: sessions, and characters of renders.
HEAD_SESSIONS = 4096
HEAD_CHARS = 16 * 1024 * 1024

# How many trailing characters of the reply (whitespace aside) must read the same where the tail is
# anchored in the re-rendered reply: enough that an anchor on the wrong end marker (one inside the reply's
# text, or the end of a reasoning block the template kept) disagrees, few enough to tolerate what the
# templates rewrite at the end of a reply. Fewer when the output's last added token is closer to its end:
# what precedes that token may be rewritten (a dropped reasoning block, a re-spaced call).
_ANCHOR_CHECK_CHARS = 8

TailReason = Literal[
    "no_new_messages",
    "not_a_reply",
    "render_refused",
    "head_rerendered",
    "stop_mismatch",
    "end_not_found",
    "marker_in_reply",
    "boundary_in_text",
]


@dataclass(frozen=True, slots=True)
class LinearTail:
    """The ids to append to the held ids (prompt + output) for the next prompt, and the text they encode.

    `verbatim`: the template renders the previous reply exactly as it was sampled, from the generation
    prompt to the output's last token, so held + tail is the full render wherever the earlier history
    renders as it was prompted too. False: the template rewrites that reply (drops its reasoning, writes
    another end token, re-spaces its calls) and the tail was anchored at the reply's end marker instead;
    the prompt keeps the reply as sampled, where a full render would not.
    """

    ids: array  # array('i'), the packed form the protocol ships
    text: str
    verbatim: bool


@dataclass(frozen=True, slots=True)
class TailRefusal:
    """No tail can be placed safely; the caller falls back (fork, re-render or reject).

    Reasons:
        no_new_messages: nothing follows the previous reply.
        not_a_reply: the previous response is not an assistant message, or its output is empty.
        render_refused: the template or the message checks refused the stand-in conversation.
        head_rerendered: the new messages change what the template renders before the previous reply
            (e.g. a system message that DeepSeek's template moves to the top): no tail can express it.
        stop_mismatch: the output's stop token is not what the template writes where the reply ends here
            (a token it never writes, e.g. <|endoftext|> where ChatML writes <|im_end|>; or GLM's <|user|>
            when a tool result follows, which the template opens with <|observation|>).
        end_not_found: the reply was cut (no stop token), the template re-renders it differently, and no
            end marker (nor a token the template writes for one) follows it; or the template renders
            nothing after the reply.
        marker_in_reply: the reply's text holds the end marker the tail would be anchored at, or the
            anchored reply does not end as the output does (e.g. harmony writes a reply cut in its
            analysis as an empty final answer): the anchor cannot be trusted.
        boundary_in_text: neither the held ids end with an added token nor the tail starts with one, so
            tokenizing the tail alone could split text the whole prompt would merge.
    """

    reason: TailReason
    detail: str


@dataclass(frozen=True, slots=True)
class _Head:
    """A session's stand-in head, what it was rendered with, and its two renders."""

    messages: list[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None
    template_kwargs: Mapping[str, Any] | None
    text: str  # rendered without the generation prompt
    prompted: str  # and with it


class HeadRenders:
    """Each recent session's stand-in head (`stand_in`), rendered without and with the generation prompt.

    In a tool-calling episode the head (the system message, the task, the last user message) is the same
    turn after turn: its two renders are reused while the head, the tools and the template arguments
    compare equal (equal dicts compare at C speed; nothing is hashed), which leaves one render per turn, of
    the stand-in with the reply and the new messages. Equal is not identical (1 == True, and key order is
    ignored, where the template writes both): a kept head that the new render does not begin with is
    rendered again before the tail is refused (`linear_tail`). Thread-safe (tails are placed on the event loop's
    thread or the render thread); at most `max_sessions` sessions and `max_chars` characters of renders,
    the least recently used dropped first.
    """

    def __init__(self, max_sessions: int = HEAD_SESSIONS, max_chars: int = HEAD_CHARS) -> None:
        self.max_sessions, self.max_chars = max_sessions, max_chars
        self._lock = threading.Lock()
        self._heads: OrderedDict[str, _Head] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._heads)

    def renders(
        self,
        renderer: Renderer,
        session: str,
        head: list[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None,
        fresh: bool = False,
    ) -> tuple[str, str]:
        """The head's text without and with the generation prompt (`fresh`: rendered anew); raises RenderError."""
        with self._lock:
            kept = self._heads.get(session)
            if kept is not None:
                self._heads.move_to_end(session)
        asked = (head, tools, template_kwargs)
        if not fresh and kept is not None and (kept.messages, kept.tools, kept.template_kwargs) == asked:
            return kept.text, kept.prompted
        text, prompted = head_texts(renderer, head, tools, template_kwargs)
        with self._lock:
            self._drop(session)
            self._heads[session] = _Head(head, tools, template_kwargs, text, prompted)
            self._chars += len(text) + len(prompted)
            while self._heads and (len(self._heads) > self.max_sessions or self._chars > self.max_chars):
                self._drop(next(iter(self._heads)))
        return text, prompted

    def forget(self, sessions: Iterable[str]) -> None:
        with self._lock:
            for session in sessions:
                self._drop(session)

    def _drop(self, session: str) -> None:
        kept = self._heads.pop(session, None)
        if kept is not None:
            self._chars -= len(kept.text) + len(kept.prompted)


def linear_tail(
    renderer: Renderer,
    previous_messages: Sequence[Mapping[str, Any]],
    response: Mapping[str, Any],
    output_ids: Sequence[int],
    new_messages: Sequence[Mapping[str, Any]],
    *,
    end_markers: Sequence[str],
    tools: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    heads: tuple[HeadRenders, str] | None = None,
) -> LinearTail | TailRefusal:
    """The tail that follows the held ids (previous prompt ids + `output_ids`) when `new_messages` follow.

    Args:
        renderer: the session's renderer (its tokenizer and template).
        previous_messages: the canonical messages of the previous turn's prompt.
        response: the canonical assistant message parsed from that turn's output.
        output_ids: the sampled output ids; they may end with a stop token or be cut by a length limit.
        new_messages: what the next request adds after the response (tool results, a user message, ...).
        end_markers: the format's stop tokens (`ResponseFormat.end_markers`): where a reply can end.
        tools, template_kwargs: as the renderer takes them; the same as the previous turn's, whose prompt
            must end with this generation prompt.
        heads: where the stand-in head's renders are kept, and the session's key there.
    """
    if not new_messages:
        return TailRefusal("no_new_messages", "nothing follows the previous reply")
    if response.get("role") != "assistant" or not output_ids:
        return TailRefusal("not_a_reply", "the previous response is not an assistant message with output ids")
    head = stand_in(previous_messages)
    try:
        if heads is not None:
            head_text, prompted = heads[0].renders(renderer, heads[1], head, tools, template_kwargs)
        else:
            head_text, prompted = head_texts(renderer, head, tools, template_kwargs)
        text = renderer.render_text([*head, response, *new_messages], tools, template_kwargs=template_kwargs)
        if heads is not None and not (prompted.startswith(head_text) and text.startswith(head_text)):
            head_text, prompted = heads[0].renders(renderer, heads[1], head, tools, template_kwargs, fresh=True)
    except RenderError as e:
        return TailRefusal("render_refused", str(e))
    if not prompted.startswith(head_text) or not text.startswith(head_text):
        return TailRefusal("head_rerendered", "the new messages change what the template renders before the reply")
    start = len(head_text)  # where the previous reply's rendering starts
    generation_prompt = prompted[start:]
    tokenizer = renderer.tokenizer
    decode = token_decoder(tokenizer)
    output = decode(output_ids)
    markers = tuple(end_markers)
    last = tokenizer.convert_ids_to_tokens(int(output_ids[-1]))
    stop = last if isinstance(last, str) and last in markers and output.endswith(last) else None

    added = _added_ids(tokenizer)
    verbatim = text.startswith(generation_prompt + output, start)
    if verbatim:
        # The reply renders as sampled: the tail is what follows it, closing included (e.g. the "\n" after
        # <|im_end|>, or all of <|im_end|>\n after a cut).
        at = start + len(generation_prompt) + len(output)
    else:
        found = _anchor(
            text, start, generation_prompt, response, _ending(decode, output_ids, stop, added), stop, markers
        )
        if isinstance(found, TailRefusal):
            return found
        at = found
    tail_text = text[at:]
    if not tail_text:
        return TailRefusal("end_not_found", "the template renders nothing after the previous reply")
    ids = renderer.encode_prompt(tail_text)
    if int(output_ids[-1]) not in added and not (ids and ids[0] in added):
        return TailRefusal("boundary_in_text", f"the tail starts inside text: {tail_text[:40]!r}")
    return LinearTail(ids=ids, text=tail_text, verbatim=verbatim)


def stand_in(previous_messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The earlier messages the rendering of later ones can depend on, verbatim and in order.

    A leading system message (the tools block, and templates that treat a first system message apart),
    then the last user message (templates keep or drop an assistant's reasoning by whether a user query
    follows it; Qwen3.5 refuses a conversation without one), or the first message when none follows the
    system one (Llama 3.1 moves the tools into the first message after it, whatever its role). One message,
    so that the stand-in, the reply and the new messages alternate as templates that enforce
    user/assistant alternation require (Gemma, Command). The messages between are left out: the bulk of a
    long history, whose rendering nothing after the previous reply reads. Other assistant messages are left
    out too, so no earlier reasoning is re-rendered (or dropped) in the stand-in.
    """
    first = 1 if previous_messages and previous_messages[0].get("role") == "system" else 0
    keep = list(range(first))
    last_user = next(
        (i for i in range(len(previous_messages) - 1, first - 1, -1) if previous_messages[i].get("role") == "user"),
        None,
    )
    if last_user is not None:
        keep.append(last_user)
    elif first < len(previous_messages):
        keep.append(first)
    return [previous_messages[i] for i in keep]


def head_texts(
    renderer: Renderer,
    head: list[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    template_kwargs: Mapping[str, Any] | None,
) -> tuple[str, str]:
    """The head's text without and with the generation prompt."""
    text = renderer.render_text(head, tools, template_kwargs=template_kwargs, add_generation_prompt=False)
    prompted = renderer.render_text(head, tools, template_kwargs=template_kwargs)
    eos = renderer.tokenizer.eos_token
    if isinstance(eos, str) and eos and text.endswith(eos) and not prompted.startswith(text):
        # Phi-3 closes a conversation that ends without a generation prompt with its eos token: not a part
        # of the head that anything later follows
        text = text[: -len(eos)]
    return text, prompted


def _anchor(
    text: str,
    start: int,
    header: str,
    response: Mapping[str, Any],
    ending: str,
    stop: str | None,
    markers: tuple[str, ...],
) -> int | TailRefusal:
    """Where the tail starts in `text` when the template re-renders the reply differently from its output.

    After a stop token: just after the token the template writes where the reply ends (the stop itself,
    or its `STOP_EQUIVALENTS` entry), which must be the first end marker after the reply's start. After a
    cut: at the first end marker, the closing the output lacks; failing any, at the first token the template
    writes in place of one (harmony closes a cut final answer with <|end|>, as it does a finished one).
    The re-rendered reply must end as the output does (`ending`: its text from its last added token on, the
    stop left out), unless the template writes only its header (`header`, the generation prompt), as for a
    reply of reasoning alone that it drops; and the reply's own text must not hold the marker.
    """
    if stop is not None:
        target = STOP_EQUIVALENTS.get(stop, stop)
        hit = _first(text, start, {*markers, target})
        if hit is None:
            return TailRefusal(
                "stop_mismatch", f"the template writes no {target!r} after the reply that stopped on {stop!r}"
            )
        if hit[1] != target:
            return TailRefusal(
                "stop_mismatch", f"the reply stopped on {stop!r}, but the template ends it here with {hit[1]!r}"
            )
    else:
        equivalents = {STOP_EQUIVALENTS[m] for m in markers if m in STOP_EQUIVALENTS}
        hit = _first(text, start, markers) or _first(text, start, equivalents)
        if hit is None:
            return TailRefusal("end_not_found", "no end marker follows the cut reply")
    at, marker = hit
    if any(marker in value for value in _reply_texts(response)):
        return TailRefusal("marker_in_reply", f"the reply's text holds {marker!r}")
    reply = _squeezed(text[start:at])
    want = _squeezed(ending)[-_ANCHOR_CHECK_CHARS:]
    if not (reply and _squeezed(header).startswith(reply)) and not reply.endswith(want):
        return TailRefusal(
            "marker_in_reply", f"the reply re-rendered up to {marker!r} ends {reply[-len(want) :]!r}, not {want!r}"
        )
    return at + len(marker) if stop is not None else at


def _first(text: str, start: int, markers: Iterable[str]) -> tuple[int, str] | None:
    """The first of `markers` in `text` after `start`, and where it is."""
    return min(((i, m) for m in markers if (i := text.find(m, start)) >= 0), default=None)


def _squeezed(text: str) -> str:
    return "".join(text.split())


def _ending(
    decode: Callable[[Sequence[int]], str], output_ids: Sequence[int], stop: str | None, added: frozenset[int]
) -> str:
    """The output's text after its last added token (the stop left out), or from that token if nothing follows."""
    body = output_ids[:-1] if stop is not None else output_ids
    last = next((i for i in range(len(body) - 1, -1, -1) if int(body[i]) in added), -1)
    after = decode(body[last + 1 :])
    if after.strip() or last < 0:
        return after
    return decode(body[last:])


def _reply_texts(response: Mapping[str, Any]) -> list[str]:
    """The reply's text fields as the template may print them: content, reasoning, each call's arguments."""
    texts = [value for key in ("content", "reasoning") if isinstance(value := response.get(key), str)]
    for call in response.get("tool_calls") or ():
        if isinstance(call, Mapping):
            arguments = call.get("arguments")
            texts.append(arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))
    return texts


# Built once per tokenizer: transformers rebuilds `added_tokens_decoder` on every access.
_ADDED: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, frozenset[int]] = weakref.WeakKeyDictionary()


def _added_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The ids of the tokenizer's added tokens, which the encoder splits on before anything else."""
    ids = _ADDED.get(tokenizer)
    if ids is None:
        ids = _ADDED[tokenizer] = frozenset(tokenizer.added_tokens_decoder)
    return ids
