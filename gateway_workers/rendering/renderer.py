"""Rendering: canonical messages + tools -> prompt token ids, with the tokenizer's own chat template.

Sits on the seam between the wire adapters (which produce canonical messages, see
`broker.protocol.CommitTurn`) and the engines (which take token ids). The template is
rendered to text, then encoded with ids identical to `apply_chat_template(tokenize=True)`,
but at a cost proportional to what is new: the text is cut at added-token boundaries
(which the tokenizer splits on before normalizing and BPE, so no merge crosses them) and
each piece's ids come from a bounded per-process LRU cache (`SegmentCache`); new pieces are
encoded by a tiktoken twin of the tokenizer where one exists (`twins.bpe`). Known templates
render through their plain-Python twin (`twins.native_templates`). Both are `twins.checks.Twin`s,
checked against the original (Jinja, the `tokenizers` encode) on a sample of live renders.
`Renderer.render` is safe to call from any thread; the app runs long renders on the renderer's
own thread (`Renderer.thread`), which keeps a tiktoken encoding of its own.
Must not import the app, adapters, engines or the backplane.
"""

from __future__ import annotations

import functools
import logging
import re
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jinja2
from transformers import PreTrainedTokenizerBase

from gateway_workers.rendering.session_renders import LastRender, SessionRenders, shared_prefix
from gateway_workers.rendering.twins.bpe import BpeTwin
from gateway_workers.rendering.twins.bpe import bpe_twin as _bpe_twin
from gateway_workers.rendering.twins.checks import Twin
from gateway_workers.rendering.twins.native_templates import NativeTemplate, native_template

logger = logging.getLogger(__name__)

CANONICAL_ROLES = frozenset({"system", "user", "assistant", "tool"})
# Per worker process. A 24k-token conversation holds ~200 KB (text + ids), so the default keeps
# ~1,000 such conversations; an agent whose pieces were evicted just pays a full encode once.
DEFAULT_CACHE_BYTES = 256 * 1024 * 1024
_ENTRY_OVERHEAD_BYTES = 100  # the OrderedDict slot and links, on top of the str and array objects
# Texts that exercise every boundary effect we know of (leading space markers, NFC across a cut,
# CRLF, digits, trailing whitespace): a tokenizer that encodes a piece differently alone fails this.
_PROBE_TEXTS = ("hello world", " x", "  two\n\n", "e\u0301t\u00e9 12345", "\r\n\tz ", "\u0301a", "", "b c\n")
# New text a render may tokenize on the event loop's thread (~0.1 µs per char with the tiktoken twin here).
INLINE_NEW_CHARS = 8192


class RenderError(ValueError):
    """The conversation cannot be rendered with this chat template (bad shape or a template refusal): a 400."""


class TemplateConfigError(Exception):
    """The chat template itself is broken (syntax error): fix the template file, no request can succeed."""


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """A rendered prompt: the ids the engine sees and the text they encode (the parser's prefix)."""

    prompt_ids: array  # array('i'), the same packed form the protocol ships
    text: str


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot of a `SegmentCache`: hits and misses count pieces, bytes is the current estimate."""

    hits: int
    misses: int
    evictions: int
    entries: int
    bytes: int


class SegmentCache:
    """A thread-safe LRU map from a text piece to its token ids, bounded by an estimate of its bytes."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, array] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._hits = self._misses = self._evictions = 0

    @staticmethod
    def cost(piece: str, ids: array) -> int:
        # getsizeof is O(1) here and counts 1, 2 or 4 bytes per character, as CPython stores the text.
        return sys.getsizeof(piece) + sys.getsizeof(ids) + _ENTRY_OVERHEAD_BYTES

    def get_many(self, pieces: Sequence[str]) -> list[array | None]:
        """The cached ids of each piece (None for a miss), refreshing the hits' recency."""
        out: list[array | None] = []
        with self._lock:
            entries = self._entries
            for piece in pieces:
                ids = entries.get(piece)
                if ids is not None:
                    entries.move_to_end(piece)
                out.append(ids)
            hits = sum(ids is not None for ids in out)
            self._hits += hits
            self._misses += len(out) - hits
        return out

    def put_many(self, items: Sequence[tuple[str, array]]) -> None:
        with self._lock:
            for piece, ids in items:
                cost = self.cost(piece, ids)
                if cost > self.max_bytes:
                    continue  # larger than the whole cache: keeping it would evict everything else
                old = self._entries.pop(piece, None)
                if old is not None:
                    self._bytes -= self.cost(piece, old)
                self._entries[piece] = ids
                self._bytes += cost
            while self._bytes > self.max_bytes:
                piece, ids = self._entries.popitem(last=False)
                self._bytes -= self.cost(piece, ids)
                self._evictions += 1

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self._hits, self._misses, self._evictions, len(self._entries), self._bytes)


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
        self._splitter, why_not = _special_splitter(self._backend) if cache_bytes else (None, "cache_bytes=0")
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
        if self._splitter is not None and not _nested(self._splitter.ids):
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

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    @property
    def native_template(self) -> str | None:
        """The name of the template twin in use, if any."""
        twin = self.template_twin
        return twin.fast.name if twin is not None and twin.active else None

    def prepare_thread(self) -> None:
        """Give `thread` its twin encoding now, in the background (~0.3 s there), not on the first long render."""
        if self.encode_twin is not None:
            self.thread.submit(self.encode_twin.fast.own_encoding)

    @property
    def bpe_twin(self) -> bool:
        """Whether new pieces are encoded by the tiktoken twin (it passed its checks and has not diverged)."""
        twin = self.encode_twin
        return twin is not None and twin.active

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
    ) -> RenderedPrompt:
        """Render canonical messages (+ OpenAI function tools) into prompt ids, ending with the generation prompt."""
        text = self.render_text(messages, tools, template_kwargs=template_kwargs)
        return RenderedPrompt(prompt_ids=self.encode_prompt(text), text=text)

    def render_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The chat template's text for these messages, ending with the generation prompt."""
        chat = template_messages(messages)
        tool_list = _check_tools(tools)
        kwargs = {**self._template_kwargs, **(template_kwargs or {})}
        twin = self.template_twin
        if twin is not None and twin.active:
            native = twin.fast
            if native.variables.issuperset(kwargs):
                try:
                    text = native.render(chat, tool_list, True, **kwargs)
                except (TypeError, ValueError, KeyError):
                    pass  # something the twin does not cover (e.g. arguments json cannot encode): Jinja decides
                else:
                    if twin.use():
                        return twin.check(text, chat, tool_list, kwargs)
                    return text
        return self._jinja(chat, tool_list, kwargs)

    def _jinja(self, chat: list[dict[str, Any]], tools: Any, kwargs: dict[str, Any]) -> str:
        try:
            text = self._tokenizer.apply_chat_template(
                chat,
                tools=tools,
                add_generation_prompt=True,
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
    ) -> RenderedPrompt | Callable[[], RenderedPrompt]:
        """Do the cheap part of a render on the calling thread (the event loop's): the prompt if that was all,
        else a function that does the rest, to run on the render thread (`thread`).

        Cheap: the template renders through its plain-Python twin, no check against the originals is
        due, and the new text to tokenize (by the tiktoken twin) is at most INLINE_NEW_CHARS. That is
        most turns, and it saves the thread hand-off (two wake-ups) on the critical path. `session`
        names the conversation, whose previous render spares re-cutting their shared text.
        """
        template = self.template_twin
        if template is None or not template.active or self._splitter is None or template.next_checked():
            return functools.partial(self.render, messages, tools)
        text = self.render_text(messages, tools)
        pieces = self._lookup(text, session)
        encoder = self.encode_twin
        if pieces.missing and (
            encoder is None
            or not encoder.active
            or encoder.next_checked()
            or sum(len(pieces.texts[i]) for i in pieces.missing) > INLINE_NEW_CHARS
        ):
            return lambda: RenderedPrompt(prompt_ids=self._assemble(pieces, session), text=text)
        return RenderedPrompt(prompt_ids=self._assemble(pieces, session), text=text)

    def encode_prompt(self, text: str) -> array:
        """Ids of rendered template text, equal to a full encode; only pieces not seen before are tokenized."""
        if self._splitter is None:
            return array("i", self.encode(text))
        return self._assemble(self._lookup(text))

    def _lookup(self, text: str, session: str | None = None) -> _Pieces:
        """Cut the text at added tokens and look its pieces up. A session's last render lends the ids of the
        text the two share, up to an added token: only what follows is cut and looked up."""
        assert self._splitter is not None
        last = self._sessions.get(session) if session is not None and self._sessions is not None else None
        at, head = shared_prefix(text, last) if last is not None else (0, None)
        # [piece, added token, piece, ..., piece]; cutting from just after an added token cuts as the whole does
        parts = self._splitter.pattern.split(text[at:] if at else text)
        texts = parts[0::2]
        cached = self.cache.get_many(texts)
        missing = [i for i, ids in enumerate(cached) if ids is None]
        return _Pieces(text, at, head, last if head is not None else None, parts, texts, cached, missing)

    def _assemble(self, pieces: _Pieces, session: str | None = None) -> array:
        """Encode the missing pieces (caching them), then join every piece's ids with the added tokens' ids."""
        assert self._splitter is not None
        cached, missing, texts = pieces.cached, pieces.missing, pieces.texts
        if missing:
            fresh = self._encode_pieces([texts[i] for i in missing])
            for i, ids in zip(missing, fresh, strict=True):
                cached[i] = ids
            self.cache.put_many([(texts[i], ids) for i, ids in zip(missing, fresh, strict=True)])
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
            # a copy: what later renders of the session reuse must not change with the prompt handed out
            self._sessions.put(session, LastRender(pieces.text, out[:], token_ends, id_ends))
        return out

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


@dataclass(frozen=True, slots=True)
class _Pieces:
    """Rendered text cut at added tokens, with each piece's cached ids (None where missing)."""

    text: str
    at: int  # parts cut text[at:]; what comes before, the session's last render lends
    head: array | None  # the ids of text[:at]
    lender: LastRender | None  # the session's last render, if it lent `head`
    parts: list[str]  # [piece, added token, piece, ..., piece]
    texts: list[str]  # the pieces: parts[0::2]
    cached: list[array | None]
    missing: list[int]  # indices into texts


@dataclass(frozen=True, slots=True)
class _Splitter:
    """Where the tokenizer itself cuts text before BPE: its added tokens (leftmost-longest), and their ids."""

    pattern: re.Pattern[str]  # one capturing group, so pattern.split keeps the tokens
    ids: dict[str, int]


def _nested(tokens: Mapping[str, int]) -> bool:
    """Whether some added token occurs inside another (then a cut cannot be resumed after a token)."""
    return any(a != b and a in b for a in tokens for b in tokens)


def _special_splitter(backend: Any) -> tuple[_Splitter | None, str]:
    """A splitter whose pieces encode independently to exactly the full encode's ids, or (None, why not).

    The `tokenizers` pipeline first splits raw text on its non-normalized added tokens (Aho-Corasick,
    leftmost-longest), then normalizes, pre-tokenizes and BPE-encodes each piece on its own. A regex
    alternation of the same tokens, longest first, finds the same cuts. Tokens that strip neighbouring
    whitespace or match only whole words move the cuts, and some pre-tokenizers look at a piece's
    offset in the whole text: those tokenizers are refused, and a probe encode checks the rest.
    """
    if backend is None or not hasattr(backend, "get_added_tokens_decoder"):
        return None, "no fast (Rust) tokenizer"
    if getattr(backend, "encode_special_tokens", False):
        return None, "the tokenizer encodes special tokens as text"
    if backend.padding is not None or backend.truncation is not None:
        return None, "the tokenizer pads or truncates"
    ids: dict[str, int] = {}
    for token_id, token in backend.get_added_tokens_decoder().items():
        if token.normalized:
            continue  # matched inside normalized pieces, which are encoded whole anyway
        if token.lstrip or token.rstrip or token.single_word:
            return None, f"added token {token.content!r} strips whitespace or matches whole words only"
        if not token.content:
            return None, "an added token is empty"
        ids[token.content] = token_id
    if not ids:
        return None, "the tokenizer has no added tokens to cut at"
    # Metaspace(prepend_scheme="first") marks only the piece at offset 0: cut pieces would all get it.
    # (__getstate__ is the component's own JSON; the whole tokenizer's to_str() takes seconds.)
    pre_tokenizer = backend.pre_tokenizer
    if pre_tokenizer is not None and b'"prepend_scheme":"first"' in pre_tokenizer.__getstate__():
        return None, "the pre-tokenizer treats the text's first piece specially"
    alternation = "|".join(re.escape(t) for t in sorted(ids, key=len, reverse=True))
    splitter = _Splitter(re.compile(f"({alternation})"), ids)
    for probe in _probes(list(ids)):
        whole = backend.encode(probe, add_special_tokens=False).ids
        parts = splitter.pattern.split(probe)
        pieces = backend.encode_batch_fast(parts[0::2], add_special_tokens=False)
        cut = list(pieces[0].ids)
        for k in range(1, len(parts), 2):
            cut += [ids[parts[k]], *pieces[(k + 1) // 2].ids]
        if cut != whole:
            return None, f"a probe encodes differently when cut at added tokens: {probe[:80]!r}"
    return splitter, ""


def _probes(tokens: list[str]) -> list[str]:
    """Probe texts: every added token between every pair of boundary-sensitive texts."""
    out = []
    for i, token in enumerate(tokens):
        left = _PROBE_TEXTS[i % len(_PROBE_TEXTS)]
        out.append("".join(f"{a}{token}{b}" for a in _PROBE_TEXTS for b in (left, "")))
    out.append("".join(tokens) + " " + "".join(reversed(tokens)))
    return out


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Canonical messages -> the dicts HF chat templates read (reasoning_content, function-wrapped calls)."""
    # `type(...) is` first: an isinstance check against an ABC is a Python-level call (~0.4 us a message).
    if not messages or (
        type(messages) is not list and (not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)))
    ):
        raise RenderError("messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if type(message) is not dict and not isinstance(message, Mapping):
            raise RenderError(f"messages[{i}] must be an object")
        role = message.get("role")
        if role not in CANONICAL_ROLES:
            raise RenderError(f"messages[{i}].role must be one of {sorted(CANONICAL_ROLES)}, got {role!r}")
        content = message.get("content", "")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise RenderError(f"messages[{i}].content must be a string")
        item: dict[str, Any] = {"role": role, "content": content}
        reasoning = message.get("reasoning")
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise RenderError(f"messages[{i}].reasoning must be a string")
            item["reasoning_content"] = reasoning
        calls = message.get("tool_calls")
        if calls:
            item["tool_calls"] = [_template_call(i, j, call) for j, call in enumerate(_as_list(i, calls))]
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise RenderError(f"messages[{i}].name must be a string")
            item["name"] = name
        out.append(item)
    return out


def _as_list(i: int, calls: object) -> list[Any]:
    if not isinstance(calls, list):
        raise RenderError(f"messages[{i}].tool_calls must be a list")
    return calls


def _template_call(i: int, j: int, call: object) -> dict[str, Any]:
    if not isinstance(call, Mapping):
        raise RenderError(f"messages[{i}].tool_calls[{j}] must be an object")
    name, arguments = call.get("name"), call.get("arguments", {})
    if not isinstance(name, str) or not name:
        raise RenderError(f"messages[{i}].tool_calls[{j}].name must be a non-empty string")
    # Arguments are an object canonically; a string is passed through verbatim (templates print it as is).
    if not isinstance(arguments, (Mapping, str)):
        raise RenderError(f"messages[{i}].tool_calls[{j}].arguments must be an object")
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _check_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise RenderError("tools must be a list")
    out = []
    for k, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise RenderError(f"tools[{k}] must be an object")
        fn = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(fn, Mapping):
            raise RenderError(f"tools[{k}] must be a function tool: {{'type': 'function', 'function': {{...}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RenderError(f"tools[{k}].function.name must be a non-empty string")
        out.append(dict(tool))
    return out
