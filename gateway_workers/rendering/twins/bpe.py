"""A tiktoken twin of a byte-level BPE tokenizer: the same ids for text pieces, several times faster.

The renderer cuts prompts at added tokens and encodes only the new pieces (`renderer.py`);
that encode is most of a long turn's CPU, and tiktoken runs it several times faster than HF `tokenizers`
(docs/performance.md, "New tokens"). Both run the same algorithm on the same data when the tokenizer is
byte-level BPE whose merge order follows token ids (as for every vocabulary converted from
tiktoken ranks: Qwen, Llama 3, GPT-4 style): split with one regex, map bytes, merge the
lowest-ranked pair first, take whole pieces that are in the vocabulary. `bpe_twin` accepts a
tokenizer only when its structure says so and probe texts agree; the renderer's `Twin` also
re-checks live encodes against the original on a sample and drops it on any difference.
Where the split pattern ends in GPT-4's lookahead for runs of spaces (`_LOOKAHEAD_TAIL`), the twin splits
without it (faster, most on indented text) and restores its pieces by marking where it would have cut.
`token_decoder` is the reverse twin: ids to text by a bytes table (the parser and the live
stream decode every reply), a `Twin` checked the same way.
The byte alphabet and the table come from `broker.token_ids`, shared with the broker's row decoder.
Imports only tiktoken, numpy, orjson, `twins.checks`, `broker.token_ids` and the stdlib: not the app or renderer.
"""

from __future__ import annotations

import logging
import re
import struct
import threading
import unicodedata
from array import array
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import orjson

from broker import token_ids
from gateway_workers.rendering.twins.checks import Twin

logger = logging.getLogger(__name__)

# Text that exercises the split regex and the merges: cases, contractions, digits, CJK, emoji with
# modifiers, combining marks, every whitespace run shape, code.
PROBE_TEXTS = (
    "Hello world! It's 2026; we'll see. I'M HERE, they'D gone.",
    "  leading and trailing spaces   \n\n\ttabs\r\nCRLF \n  \n",
    "数字 12345 和 中文，日本語のテキスト、한국어 텍스트.",
    "emoji 🙂👍🏽 e\u0301t\u00e9 na\u00efve caf\u00e9 \u200bzero-width",
    "def f(x):\n    return {\"a\": [1, 2.5e-3, None], 'b': x ** 2}  # ok\n",
    "aaaaaaaaaaaaaaaa ababababab ,,,,,,;;;;;; ...... ---- ____ 0000000",
)
# GPT-4-style split patterns end in these alternatives. The lookahead keeps the last space of a run for the
# next word; it alone puts tiktoken's regex on its backtracking engine (slower, most on indented JSON:
# docs/performance.md).
_LOOKAHEAD_TAIL = r"|\s+(?!\S)|\s+"
# What `\s` means to that engine: Unicode White_Space (Python's str.isspace also takes \x1c-\x1f).
_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000"
_SPACE_CLASS = re.escape(_SPACE)
_SPACE_NOT_NEWLINE_CLASS = re.escape(_SPACE.replace("\n", "").replace("\r", ""))
# Where the lookahead ends a piece: before the last character of a run of 2+ spaces, that character not a
# newline and followed by a non-space (the group's start).
_LOOKAHEAD_CUT = re.compile(f"[{_SPACE_CLASS}]([{_SPACE_NOT_NEWLINE_CLASS}])(?=[^{_SPACE_CLASS}])")
_SPACE_TABLE = np.zeros(ord("\u3000") + 2, dtype=bool)  # indexed by code point, clipped to its last (False) slot
_SPACE_TABLE[[ord(c) for c in _SPACE]] = True
_NUMPY_CUTS_FROM = 1024  # chars: below, `re` finds the cuts faster than numpy's fixed costs
# Cut markers: number characters (`\p{N}` pieces of their own between spaces), each one token.
_SENTINELS = ("½", "¼", "¾", "²", "³", "¹")
_BUILT_MAX = 8  # tokenizer objects whose twins are kept (per kind), oldest dropped first
_TWINS: dict[int, tuple[Any, tuple[BpeTwin | None, str]]] = {}
_DECODERS: dict[int, tuple[Any, Decode]] = {}

Decode = Callable[[Sequence[int]], str]
_Built = TypeVar("_Built")


def _per_backend(cache: dict[int, tuple[Any, _Built]], backend: Any, build: Callable[[Any], _Built]) -> _Built:
    """`build(backend)`, once per tokenizer object: kept with the object, so its id is not reused meanwhile."""
    key = id(backend)
    if key not in cache:
        if len(cache) >= _BUILT_MAX:
            cache.pop(next(iter(cache)))
        cache[key] = (backend, build(backend))
    return cache[key][1]


class BpeTwin:
    """Encodes text pieces (no added tokens inside) to the ids the original tokenizer would give.

    tiktoken's regex keeps its match caches in a pool that serves the first thread to use it
    without locking; every other thread takes a locked slow path on each match (a measurable share of
    an encode: docs/performance.md). So a thread that encodes much can take its own encoding
    (`own_encoding`, tens of MB); the others share the first.
    """

    def __init__(self, make_encoding: Callable[[], Any], nfc: bool, cuts: dict[str, int] | None = None) -> None:
        """`cuts`: sentinel char -> its id, when the encodings split without the lookahead (`_plain_split`)."""
        self._make_encoding = make_encoding
        self._shared = make_encoding()
        self._own = threading.local()
        self._nfc = nfc
        self._cuts = cuts

    def own_encoding(self) -> None:
        """Give the calling thread an encoding of its own (see the class docstring); idempotent."""
        if not hasattr(self._own, "encoding"):
            self._own.encoding = self._make_encoding()

    def encode_many(self, pieces: list[str]) -> list[array]:
        """Each piece's ids: the renderer's twin checks a batch of new pieces at once, not each piece."""
        encode = self.encode
        return [encode(piece) for piece in pieces]

    def encode(self, piece: str) -> array:
        if self._nfc and not unicodedata.is_normalized("NFC", piece):
            piece = unicodedata.normalize("NFC", piece)
        encoding = getattr(self._own, "encoding", self._shared)
        # encode_ordinary releases the GIL: a long piece does not stall the event loop's thread.
        if self._cuts is None:
            return _packed(encoding.encode_ordinary(piece))
        cuts = _lookahead_cuts(piece)
        if not cuts:
            return _packed(encoding.encode_ordinary(piece))
        parts = [piece[start:stop] for start, stop in zip([0, *cuts], [*cuts, len(piece)], strict=True)]
        sentinel = next((c for c in self._cuts if c not in piece), None)
        if sentinel is not None:
            ids = np.frombuffer(_packed(encoding.encode_ordinary(sentinel.join(parts))), dtype=np.int32)
            kept = ids[ids != self._cuts[sentinel]]
            if len(kept) == len(ids) - len(cuts):
                out = array("i")
                out.frombytes(kept.tobytes())
                return out
        # the piece holds every sentinel (or one merged): encode its parts one by one, the same ids, slower
        out = array("i")
        for part in parts:
            out += _packed(encoding.encode_ordinary(part))
        return out


def _packed(ids: list[int]) -> array:
    # struct packs a list of ints faster than array("i", list), which parses each item as an argument
    # (docs/performance.md).
    out = array("i")
    out.frombytes(struct.pack(f"{len(ids)}i", *ids))
    return out


def _lookahead_cuts(text: str, numpy_from: int = _NUMPY_CUTS_FROM) -> list[int]:
    """Indices where the split pattern's `\\s+(?!\\S)` ends a piece inside a run of spaces (see _LOOKAHEAD_CUT)."""
    if len(text) < numpy_from:
        return [m.start(1) for m in _LOOKAHEAD_CUT.finditer(text)]
    cp: np.ndarray
    if text.isascii():
        cp = np.frombuffer(text.encode("ascii"), dtype=np.uint8)
        low = cp <= 32  # every ASCII space is
        if not (low[1:] & low[:-1]).any():
            return []  # no two spaces in a row, as in most prose: far cheaper than the search below
    else:
        cp = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    space = _SPACE_TABLE.take(cp, mode="clip")  # past the table's end: its last slot, False
    mid = cp[1:-1]
    cut = space[:-2] & space[1:-1] & ~space[2:] & (mid != 10) & (mid != 13)
    return (np.flatnonzero(cut) + 1).tolist()  # type: ignore[no-any-return]


def bpe_twin(backend: Any) -> tuple[BpeTwin | None, str]:
    """A twin of this `tokenizers.Tokenizer`'s normalizer + pre-tokenizer + model, or (None, why not).

    Building one reads the whole vocabulary and merges (slow: docs/performance.md): the result is kept per
    tokenizer object.
    """
    return _per_backend(_TWINS, backend, _build)


def _build(backend: Any) -> tuple[BpeTwin | None, str]:
    try:
        import tiktoken
    except ImportError:
        return None, "tiktoken is not installed"
    normalizer = _state(backend.normalizer)
    if normalizer not in (None, {"type": "NFC"}):
        return None, f"normalizer {normalizer.get('type')} has no twin"
    pattern, why = _split_pattern(_state(backend.pre_tokenizer))
    if pattern is None:
        return None, why
    model = orjson.loads(backend.model.__getstate__())
    why = _model_refusal(model)
    if why:
        return None, why
    ranks, why = _ranks(model)
    if ranks is None:
        return None, why
    nfc = normalizer is not None

    def built(split: str, cuts: dict[str, int] | None) -> tuple[BpeTwin | None, str]:
        def make_encoding() -> Any:
            return tiktoken.Encoding("bpe-twin", pat_str=split, mergeable_ranks=ranks, special_tokens={})

        try:
            twin = BpeTwin(make_encoding, nfc, cuts)
        except Exception as e:  # e.g. a regex construct tiktoken's engine does not take
            return None, f"tiktoken refused the tokenizer: {type(e).__name__}: {e}"
        for probe in PROBE_TEXTS:
            if twin.encode(probe).tolist() != backend.encode(probe, add_special_tokens=False).ids:
                return None, f"a probe encodes differently: {probe[:60]!r}"
        return twin, ""

    plain = _plain_split(pattern)
    if plain is not None:
        twin, why = built(plain, _sentinels(ranks))
        if twin is not None:
            return twin, ""
        logger.info("the split pattern without its lookahead does not work here (%s); keeping it", why)
    return built(pattern, None)


def _plain_split(pattern: str) -> str | None:
    """The pattern without `\\s+(?!\\S)`, if that is its only lookaround (then cuts restore its pieces)."""
    if not pattern.endswith(_LOOKAHEAD_TAIL):
        return None
    head = pattern[: -len(_LOOKAHEAD_TAIL)]
    if any(construct in head for construct in ("(?=", "(?!", "(?<")):
        return None
    return head + r"|\s+"


def _sentinels(ranks: dict[bytes, int]) -> dict[str, int]:
    """The cut markers that are one token each (that each is a piece of its own, the probes check)."""
    return {c: ranks[c.encode()] for c in _SENTINELS if c.encode() in ranks}


def _state(component: Any) -> Any:
    return None if component is None else orjson.loads(component.__getstate__())


def _split_pattern(pre: Any) -> tuple[str | None, str]:
    """The regex of a Split(isolated) + ByteLevel(no prefix space, no own regex) pre-tokenizer."""
    if not isinstance(pre, dict) or pre.get("type") != "Sequence" or len(pre.get("pretokenizers", ())) != 2:
        return None, "the pre-tokenizer is not a regex split followed by byte-level mapping"
    split, byte_level = pre["pretokenizers"]
    pattern = split.get("pattern", {}).get("Regex") if split.get("type") == "Split" else None
    if pattern is None or split.get("behavior") != "Isolated" or split.get("invert"):
        return None, "the pre-tokenizer's split is not an isolating regex"
    if byte_level.get("type") != "ByteLevel" or byte_level.get("add_prefix_space") or byte_level.get("use_regex"):
        return None, "the pre-tokenizer's second step is not a plain byte-level mapping"
    return pattern, ""


def _model_refusal(model: dict[str, Any]) -> str:
    if model.get("type") != "BPE":
        return f"model {model.get('type')} is not BPE"
    for key in ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            return f"BPE {key} has no twin"
    if model.get("byte_fallback"):
        return "BPE byte_fallback has no twin"
    if not model.get("ignore_merges"):
        # tiktoken always takes a piece that is a whole vocabulary entry; so does BPE with ignore_merges.
        return "BPE without ignore_merges may split whole-word entries"
    return ""


def _ranks(model: dict[str, Any]) -> tuple[dict[bytes, int] | None, str]:
    """Token bytes -> id, if ids order the merges as tiktoken's ranks do (each merge's result outranks the last)."""
    table = token_ids.byte_alphabet()
    vocab: dict[str, int] = model["vocab"]
    try:
        # translate maps each alphabet char to the char of its byte value, which latin-1 encodes as that byte
        ranks = {token.translate(table).encode("latin-1"): token_id for token, token_id in vocab.items()}
    except UnicodeEncodeError:
        return None, "the vocabulary is not byte-level"
    if len(ranks) != len(vocab) or any(bytes([b]) not in ranks for b in range(256)):
        return None, "the vocabulary does not hold every byte exactly once"
    merges = model["merges"]
    if merges and isinstance(merges[0], str):
        merges = [merge.split(" ", 1) for merge in merges]
    merged = [vocab.get(left + right, -1) for left, right in merges]
    if -1 in merged or any(a > b for a, b in zip(merged, merged[1:], strict=False)):
        return None, "the merge order does not follow the token ids"
    return ranks, ""


class TableDecoder:
    """ids -> text as a ByteLevel decoder does it: each token's bytes, joined, decoded as lossy UTF-8.

    A `Twin` of the tokenizer's decode (`twin`): checked on a sample of decodes, and any difference
    hands every later decode to the tokenizer. Ids outside the vocabulary (a model's padded
    embedding rows) are the tokenizer's to decode (it drops them).
    """

    def __init__(self, table: list[bytes], exact: Decode) -> None:
        self._table = table
        self.twin: Twin[list[bytes], str] = Twin(
            "token_decode", "bytes-table", table, exact, describe=_decode_difference, log=logger
        )

    def __call__(self, ids: Sequence[int]) -> str:
        table = self._table
        twin = self.twin
        if not twin.active or (ids and (min(ids) < 0 or max(ids) >= len(table))):
            return twin.exact(ids)
        # `token_ids.decode`, inlined: the live stream decodes twice per chunk
        text = b"".join([table[i] for i in ids]).decode("utf-8", "replace")
        if twin.use():
            return twin.check(text, ids)
        return text

    @property
    def table(self) -> list[bytes]:
        """Each id's bytes."""
        return self._table


def _decode_difference(twin: Twin[list[bytes], str], text: str, expected: Any, args: tuple[Any, ...]) -> str:
    return (
        f"the bytes-table decoder decoded {list(args[0])[:50]!r} as {text[:200]!r}, the tokenizer as "
        f"{expected[:200]!r}; using the tokenizer from now on"
    )


def token_decoder(tokenizer: Any) -> Decode:
    """The fastest exact ids -> text (special tokens kept) for this tokenizer: a `TableDecoder` for
    byte-level BPE whose whole vocabulary decodes alike both ways, else the Rust decoder, else the wrapper.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return lambda ids: _joined(tokenizer.decode(list(ids), skip_special_tokens=False,
                                                    clean_up_tokenization_spaces=False))
    return _per_backend(_DECODERS, backend, _build_decoder)


def _build_decoder(backend: Any) -> Decode:
    def exact(ids: Sequence[int]) -> str:
        return str(backend.decode(list(ids), skip_special_tokens=False))

    table, why = token_ids.byte_table(backend, exact)
    if table is None:
        logger.info("ids are decoded by the tokenizer: %s", why)
        return exact
    return TableDecoder(table, exact)


def _joined(text: str | list[str]) -> str:
    return text if isinstance(text, str) else "".join(text)
