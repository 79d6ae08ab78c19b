"""Rendering: canonical messages + tools -> prompt token ids, with the tokenizer's own chat template.

Sits on the seam between the wire adapters (which produce canonical messages, see
`broker.protocol.CommitTurn`) and the engines (which take token ids). The template is
rendered to text, then encoded with ids identical to `apply_chat_template(tokenize=True)`,
but at a cost proportional to what is new: the text is cut at added-token boundaries
(which the tokenizer splits on before normalizing and BPE, so no merge crosses them) and
each piece's ids come from a bounded per-process LRU cache (`pieces`); new pieces are encoded
by a tiktoken twin of the tokenizer where one exists (`twins.bpe`). Known templates render
through their plain-Python twin (`twins.native_templates`). Both are `twins.checks.Twin`s,
checked against the original (Jinja, the `tokenizers` encode) on a sample of live renders.
Messages are checked and shaped for the template by `messages`; system messages it cannot render where they
stand are folded (`system_messages`). `Renderer.render` is safe to
call from any thread; the app runs long renders on the renderer's own thread (`Renderer.thread`),
which keeps a tiktoken encoding of its own. Under a context budget, a prompt proven longer stops being
tokenized at the proof (`budget`). Must not import the app, adapters, engines or the backplane.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jinja2
from transformers import PreTrainedTokenizerBase

from gateway_workers.rendering.budget import PromptOverBudget, token_bound
from gateway_workers.rendering.messages import RenderError, check_tools, template_messages
from gateway_workers.rendering.pieces import DEFAULT_CACHE_BYTES, Pieces, SegmentCache, nested, special_splitter
from gateway_workers.rendering.session_renders import LastRender, SessionRenders, shared_prefix
from gateway_workers.rendering.system_messages import NATIVE, SystemPlacement, fold, probe
from gateway_workers.rendering.twins.bpe import BpeTwin, TableDecoder, token_decoder
from gateway_workers.rendering.twins.bpe import bpe_twin as _bpe_twin
from gateway_workers.rendering.twins.checks import Twin, checked_use
from gateway_workers.rendering.twins.native_templates import NativeTemplate, native_template

logger = logging.getLogger(__name__)

# New text a render may tokenize on the event loop's thread: small enough that tokenizing it inline costs
# less than the hand-off to the render thread (figures: docs/performance.md, "Where it runs").
INLINE_NEW_CHARS = 8192
# Under a context budget, new pieces are encoded in batches of about this many characters, so a prompt found
# over the budget stops being tokenized within a batch of the point that proves it.
BUDGET_BATCH_CHARS = 256 * 1024


class TemplateConfigError(Exception):
    """The chat template itself is broken (syntax error): fix the template file, no request can succeed."""


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """A rendered prompt: the ids the engine sees and the text they encode (the parser's prefix)."""

    prompt_ids: array  # array('i'), the same packed form the protocol ships
    text: str


class Renderer:
    """Renders canonical conversations with one tokenizer's chat template.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        template_kwargs: extra variables every render passes to the template (e.g. enable_thinking).
        cache_bytes: bound of the piece cache; 0 turns incremental encoding off (every render encodes all).
        native_templates: render known templates with their plain-Python twin (`native_templates.py`).
        bpe_twin: encode new pieces with a tiktoken twin of the tokenizer when it has one (`twins/bpe.py`).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        template_kwargs: Mapping[str, Any] | None = None,
        *,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        native_templates: bool = True,
        bpe_twin: bool = True,
    ) -> None:
        if not tokenizer.chat_template:
            raise TemplateConfigError("the tokenizer has no chat template")
        self._tokenizer = tokenizer
        self._template_kwargs = dict(template_kwargs or {})
        # The Rust tokenizer's encode borrows immutably, so worker threads can share it; the Python
        # wrapper may touch truncation/padding state, which is not thread-safe.
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self.cache = SegmentCache(cache_bytes)
        decoder = token_decoder(tokenizer)
        self.token_bound = token_bound(self._backend, decoder.table if isinstance(decoder, TableDecoder) else None)
        self._splitter, why_not = special_splitter(self._backend) if cache_bytes else (None, "cache_bytes=0")
        if self._splitter is None:
            logger.info("incremental prompt encoding is off (%s); every render encodes the whole prompt", why_not)
        # The twin encodes pieces without added tokens in them, so it needs the splitter. It is checked
        # per batch of new pieces, not per piece: its fast path is `BpeTwin.encode_many`.
        self.encode_twin: Twin[BpeTwin, list[array]] | None = None
        if self._splitter is not None and bpe_twin:
            encoder, why_not = _bpe_twin(self._backend)
            if encoder is None:
                logger.info("new prompt text is encoded by `tokenizers` (no tiktoken twin: %s)", why_not)
            else:
                self.encode_twin = Twin(
                    "bpe_encode", "tiktoken", encoder, self._encode_pieces_exactly, describe=_encode_difference,
                    log=logger,
                )
        # One thread for renders too long for the event loop: the same thread each time keeps the twin's
        # regex caches its own (`BpeTwin.own_encoding`), and one core's worth of work needs no more.
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="render")
        # A session's next render re-cuts only what follows its last render's last shared added token;
        # that is the same cut only if no added token occurs inside another.
        self._sessions: SessionRenders | None = None
        if self._splitter is not None and not nested(self._splitter.ids):
            self._sessions = SessionRenders()
        native = native_template(tokenizer.chat_template) if native_templates else None
        self.template_twin: Twin[NativeTemplate, str] | None = None
        if native is not None:
            self.template_twin = Twin(
                "template", native.name, native, self._jinja, describe=_template_difference, log=logger
            )
        try:
            tokenizer.apply_chat_template(
                [{"role": "user", "content": "ping"}], tokenize=False, add_generation_prompt=True
            )
        except jinja2.TemplateSyntaxError as e:
            raise TemplateConfigError(f"chat template syntax error: {e}") from e
        def render_chat(chat: list[dict[str, Any]]) -> str:
            text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True,
                                                 **self._template_kwargs)
            return text if isinstance(text, str) else ""

        self.system_placement: SystemPlacement = probe(render_chat)
        if self.system_placement != NATIVE:
            logger.info("the chat template cannot render every system message where it stands (%s): such "
                        "messages are folded (`rendering.system_messages`)", self.system_placement)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    @property
    def native_template(self) -> str | None:
        """The name of the template twin in use, if any."""
        twin = self.template_twin
        return twin.fast.name if twin is not None and twin.active else None

    def prepare_thread(self) -> None:
        """Give `thread` its twin encoding now, in the background (it takes a while: docs/performance.md), not on
        the first long render."""
        if self.encode_twin is not None:
            self.thread.submit(self.encode_twin.fast.own_encoding)

    @property
    def bpe_twin(self) -> bool:
        """Whether new pieces are encoded by the tiktoken twin (it passed its checks and has not diverged)."""
        twin = self.encode_twin
        return twin is not None and twin.active

    def inline(self, new_chars: int, renders: int = 1) -> bool:
        """Whether up to `renders` template renders that tokenize about `new_chars` of new text are cheap enough
        for the event loop's thread: both twins active, no check of either due within them, and at most
        INLINE_NEW_CHARS (`begin_render`'s rule, for a caller that knows the size of what is new before
        rendering it)."""
        template, encoder = self.template_twin, self.encode_twin
        return (
            new_chars <= INLINE_NEW_CHARS
            and self._splitter is not None
            and template is not None
            and template.active
            and not any(checked_use(template.uses + i) for i in range(renders))
            and encoder is not None
            and encoder.active
            and not encoder.next_checked()
        )

    def forget_sessions(self, sessions: list[str]) -> None:
        """Sessions that ended: drop their last renders, and the cached pieces of those renders only they used."""
        if self._sessions is None:
            return
        for session in sessions:
            last = self._sessions.pop(session)
            if last is not None:
                self.cache.forget(session, last.owned)

    @property
    def sessions_held(self) -> int:
        """How many sessions' last renders are kept."""
        return len(self._sessions) if self._sessions is not None else 0

    @property
    def incremental(self) -> bool:
        """Whether renders reuse cached piece ids (the tokenizer passed the boundary checks)."""
        return self._splitter is not None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
        budget: int | None = None,
    ) -> RenderedPrompt:
        """Render canonical messages (+ OpenAI function tools) into prompt ids, ending with the generation prompt.

        With a `budget` (the session's context budget), a prompt of more tokens raises `PromptOverBudget`, as
        soon as that is proven: often before it is tokenized in full.
        """
        text = self.render_text(messages, tools, template_kwargs=template_kwargs)
        return RenderedPrompt(prompt_ids=self.encode_prompt(text, budget), text=text)

    def render_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The chat template's text for these messages, ending with the generation prompt.

        `add_generation_prompt=False` ends it at the last message instead: linear history (`linear.py`)
        measures where a message's rendering ends.
        """
        chat = template_messages(messages)
        if self.system_placement is not NATIVE:
            chat = fold(chat, self.system_placement)
        tool_list = check_tools(tools)
        kwargs = {**self._template_kwargs, **(template_kwargs or {})}
        twin = self.template_twin
        if twin is not None and twin.active:
            native = twin.fast
            if native.variables.issuperset(kwargs):
                try:
                    text = native.render(chat, tool_list, add_generation_prompt, **kwargs)
                except (TypeError, ValueError, KeyError):
                    pass  # something the twin does not cover (e.g. arguments json cannot encode): Jinja decides
                else:
                    if twin.use():
                        return twin.check(text, chat, tool_list, kwargs, add_generation_prompt)
                    return text
        return self._jinja(chat, tool_list, kwargs, add_generation_prompt)

    def _jinja(
        self, chat: list[dict[str, Any]], tools: Any, kwargs: dict[str, Any], add_generation_prompt: bool = True
    ) -> str:
        try:
            text = self._tokenizer.apply_chat_template(
                chat,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **kwargs,
            )
        except jinja2.TemplateError as e:
            raise RenderError(f"the chat template refused this conversation: {e}") from e
        except (TypeError, ValueError, KeyError) as e:
            raise RenderError(f"cannot render this conversation: {e}") from e
        if not isinstance(text, str):
            raise RenderError(f"chat template rendered {type(text).__name__}, expected text")
        return text

    def begin_render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        session: str | None = None,
        budget: int | None = None,
    ) -> RenderedPrompt | Callable[[int | None], RenderedPrompt]:
        """Do the cheap part of a render on the calling thread (the event loop's): the prompt if that was all,
        else a function of the context budget that does the rest (`render`'s `budget`), to run on the render
        thread (`thread`).

        Cheap: the template renders through its plain-Python twin, no check against the originals is
        due, and the new text to tokenize (by the tiktoken twin) is at most INLINE_NEW_CHARS. That is
        most turns, and it saves the thread hand-off (two wake-ups) on the critical path. `session`
        names the conversation, whose previous render spares re-cutting their shared text. A `budget` known
        already spares cutting a text whose size proves it over (`PromptOverBudget`).
        """
        template = self.template_twin
        if template is None or not template.active or self._splitter is None or template.next_checked():

            def render(budget: int | None = None) -> RenderedPrompt:
                text = self.render_text(messages, tools)
                return RenderedPrompt(prompt_ids=self.encode_prompt(text, budget, session), text=text)

            return render
        text = self.render_text(messages, tools)
        if budget is not None and (at_least := self.token_bound.at_least(text, budget)):
            raise PromptOverBudget(at_least, budget)
        pieces = self._lookup(text, session)
        encoder = self.encode_twin
        if pieces.missing and (
            encoder is None
            or not encoder.active
            or encoder.next_checked()
            or sum(len(pieces.texts[i]) for i in pieces.missing) > INLINE_NEW_CHARS
        ):

            def encode(budget: int | None = None) -> RenderedPrompt:
                return RenderedPrompt(prompt_ids=self._assemble(pieces, session, budget), text=text)

            return encode
        return RenderedPrompt(prompt_ids=self._assemble(pieces, session), text=text)

    def render_session(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        session: str | None,
        budget: int | None,
    ) -> RenderedPrompt:
        """`begin_render` and the rest of it in one call, under `budget`: a whole render for the render thread."""
        begun = self.begin_render(messages, tools, session, budget)
        return begun(budget) if callable(begun) else begun

    def encode_prompt(self, text: str, budget: int | None = None, session: str | None = None) -> array:
        """Ids of rendered template text, equal to a full encode; only pieces not seen before are tokenized
        (`session`: the conversation it renders, whose previous render lends what they share).

        Raises `PromptOverBudget` when the text is proven to take more than `budget` tokens.
        """
        if self._splitter is None:
            if budget is not None and (at_least := self.token_bound.at_least(text, budget)):
                raise PromptOverBudget(at_least, budget)
            return array("i", self.encode(text))
        return self._assemble(self._lookup(text, session), session, budget)

    def _lookup(self, text: str, session: str | None = None) -> Pieces:
        """Cut the text at added tokens and look its pieces up. A session's last render lends the ids of the
        text the two share, up to an added token: only what follows is cut and looked up."""
        assert self._splitter is not None
        last = self._sessions.get(session) if session is not None and self._sessions is not None else None
        at, head = shared_prefix(text, last) if last is not None else (0, None)
        # [piece, added token, piece, ..., piece]; cutting from just after an added token cuts as the whole does
        parts = self._splitter.pattern.split(text[at:] if at else text)
        texts = parts[0::2]
        cached = self.cache.get_many(texts, session)
        missing = [i for i, ids in enumerate(cached) if ids is None]
        return Pieces(text, at, head, last if head is not None else None, parts, texts, cached, missing)

    def _assemble(self, pieces: Pieces, session: str | None = None, budget: int | None = None) -> array:
        """Encode the missing pieces (caching them), then join every piece's ids with the added tokens' ids.

        Under a `budget`, raises `PromptOverBudget` once the prompt is proven longer (`budget` module).
        """
        assert self._splitter is not None
        cached, missing, texts = pieces.cached, pieces.missing, pieces.texts
        if budget is not None:
            self._encode_within(pieces, budget, session)
        elif missing:
            fresh = self._encode_pieces([texts[i] for i in missing])
            for i, ids in zip(missing, fresh, strict=True):
                cached[i] = ids
            self.cache.put_many([(texts[i], ids) for i, ids in zip(missing, fresh, strict=True)], session)
        special, parts = self._splitter.ids, pieces.parts
        out = array("i", pieces.head) if pieces.head is not None else array("i")
        out.extend(cached[0])  # type: ignore[arg-type]  # every miss was filled above
        token_ends, id_ends = pieces.lender.ends_before(pieces.at) if pieces.lender is not None else ([], [])
        at = pieces.at + len(parts[0])
        for k in range(1, len(parts), 2):
            token = parts[k]
            out.append(special[token])
            at += len(token)
            token_ends.append(at)
            id_ends.append(len(out))
            out.extend(cached[(k + 1) // 2])  # type: ignore[arg-type]
            at += len(parts[k + 1])
        if session is not None and self._sessions is not None:
            # The pieces encoded for the session go with it when it ends (`forget_sessions`), those of earlier
            # renders too: a template that re-renders history (e.g. dropping old reasoning) leaves them behind.
            previous = self._sessions.get(session)
            owned = [texts[i] for i in missing]
            if previous is not None:
                owned = previous.owned + owned
            # a copy: what later renders of the session reuse must not change with the prompt handed out
            self._sessions.put(session, LastRender(pieces.text, out[:], token_ends, id_ends, owned))
        return out

    def _encode_within(self, pieces: Pieces, budget: int, session: str | None) -> None:
        """Fill the missing pieces' ids batch by batch, raising `PromptOverBudget` as soon as what is known proves
        the prompt longer than `budget`: the ids so far, one per added token and the size bound of the rest."""
        cached, missing, texts = pieces.cached, pieces.missing, pieces.texts
        known = len(pieces.head or ()) + len(pieces.parts) // 2 + sum(len(ids) for ids in cached if ids is not None)
        if known > budget:
            raise PromptOverBudget(known, budget)
        rest = "".join(texts[i] for i in missing)  # pieces are cut at added tokens: a bound of the join is theirs
        at_least = self.token_bound.at_least(rest, budget - known)
        if at_least:
            raise PromptOverBudget(known + at_least, budget)
        batch: list[int] = []
        chars = 0
        for n, i in enumerate(missing):
            batch.append(i)
            chars += len(texts[i])
            if chars < BUDGET_BATCH_CHARS and n + 1 < len(missing):
                continue
            fresh = self._encode_pieces([texts[j] for j in batch])
            for j, ids in zip(batch, fresh, strict=True):
                cached[j] = ids
                known += len(ids)
            self.cache.put_many([(texts[j], ids) for j, ids in zip(batch, fresh, strict=True)], session)
            if known > budget:
                raise PromptOverBudget(known, budget)
            batch, chars = [], 0

    def encode(self, text: str) -> list[int]:
        """Token ids of already-rendered template text (no special tokens added), encoded in full."""
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return self._tokenizer.encode(text, add_special_tokens=False)

    def _encode_pieces(self, pieces: list[str]) -> list[array]:
        twin = self.encode_twin
        if twin is None or not twin.active:
            return self._encode_pieces_exactly(pieces)
        ids = twin.fast.encode_many(pieces)
        if twin.use():
            return twin.check(ids, pieces)
        return ids

    def _encode_pieces_exactly(self, pieces: list[str]) -> list[array]:
        # The batch call releases the GIL (a single encode holds it, stalling the worker's event loop
        # for the whole encode) and skips offset tracking, which we never read.
        encodings = self._backend.encode_batch_fast(pieces, add_special_tokens=False)  # type: ignore[union-attr]
        return [array("i", e.ids) for e in encodings]


def _template_difference(twin: Twin[NativeTemplate, str], text: str, expected: str, args: tuple[Any, ...]) -> str:
    at = next(
        (i for i, (a, b) in enumerate(zip(text, expected, strict=False)) if a != b), min(len(text), len(expected))
    )
    return (
        f"the {twin.fast.name} template twin rendered differently from Jinja at char {at} "
        f"({text[max(0, at - 40) : at + 40]!r} vs {expected[max(0, at - 40) : at + 40]!r}); using Jinja from now on"
    )


def _encode_difference(twin: Twin[BpeTwin, list[array]], ids: list[array], expected: Any, args: tuple[Any, ...]) -> str:
    at = next(i for i, (a, b) in enumerate(zip(ids, expected, strict=True)) if a != b)
    return (
        f"the tiktoken twin encoded {args[0][at][:200]!r} differently from the tokenizer; "
        "using the tokenizer from now on"
    )


