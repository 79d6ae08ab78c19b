"""Token ids as plain data, shared by the workers and the broker: byte tables and matching prefixes.

A byte-level BPE's text is the UTF-8 decode of its tokens' bytes, so both sides decode ids by a
bytes table: workers every reply (`gateway_workers.rendering.twins.bpe.TableDecoder`), the broker
every row's response (`broker.episodes.rows`). This module owns the byte alphabet, building the
table from a `tokenizers.Tokenizer` (duck-typed, never imported), decoding ids through it and
validating it against the tokenizer's own decode; and `matching_prefix`, the bisection behind the
workers' commit bases and the broker's turn store. Workers may import it beside `broker.protocol`,
so it is stdlib only: no zmq, no numpy, nothing of `broker.sessions` or `broker.episodes`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

Decode = Callable[[Sequence[int]], str]


def byte_alphabet() -> dict[int, int]:
    """Byte-level alphabet char -> its byte (GPT-2's bytes_to_unicode, inverted) as a str.translate table.

    Printable bytes stand for themselves; the other bytes, in order, take code points from 256 up.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: b for b in printable}
    others = [b for b in range(256) if b not in table]
    table.update({256 + k: b for k, b in enumerate(others)})
    return table


def decode(table: Sequence[bytes], ids: Iterable[int]) -> str:
    """The ids' bytes joined and decoded as lossy UTF-8: what a ByteLevel decoder writes for them."""
    return b"".join([table[i] for i in ids]).decode("utf-8", "replace")


def build_byte_table(tokenizer: Any) -> tuple[list[bytes] | None, str]:
    """Each id's bytes as the tokenizer's ByteLevel decoder writes them, or (None, why not); not yet validated.

    Vocabulary tokens are spelled in the byte alphabet. An added token made only of alphabet
    chars stands for their bytes too, any other for its own UTF-8 (the decoder's rule). Ids the
    vocabulary skips decode to nothing.
    """
    decoder = tokenizer.decoder
    state = None if decoder is None else json.loads(decoder.__getstate__())
    if not isinstance(state, dict) or state.get("type") != "ByteLevel":
        return None, f"decoder {state and state.get('type')} is not ByteLevel"
    alphabet = byte_alphabet()
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    added = tokenizer.get_added_tokens_decoder()
    table = [b""] * size
    try:
        # one id_to_token call an id: less than half the time of building get_vocab()'s dict
        for token_id in range(size):
            token = tokenizer.id_to_token(token_id)
            if token is not None and token_id not in added:
                table[token_id] = token.translate(alphabet).encode("latin-1")
    except UnicodeEncodeError:
        return None, "the vocabulary is not byte-level"
    for token_id, added_token in added.items():
        if not 0 <= token_id < size:
            return None, f"added token id {token_id} is outside the vocabulary's {size}"
        text = added_token.content
        byte_level = all(ord(c) in alphabet for c in text)
        table[token_id] = text.translate(alphabet).encode("latin-1") if byte_level else text.encode("utf-8")
    return table, ""


def check_byte_table(table: Sequence[bytes], exact: Decode, probes: Iterable[Sequence[int]]) -> str:
    """"" if every probe decodes through the table to the exact decoder's text, else which one does not."""
    for probe in probes:
        if decode(table, probe) != exact(probe):
            shown = ", ".join(map(str, probe[:4])) + (", ..." if len(probe) > 4 else "")
            return f"{len(probe)} probe id(s) [{shown}] decode differently from the tokenizer"
    return ""


def byte_table(tokenizer: Any, exact: Decode) -> tuple[list[bytes] | None, str]:
    """A validated bytes table for this tokenizer, or (None, why not).

    `exact` is the tokenizer's own decode (special tokens kept). The probes are the whole
    vocabulary at once (every id's bytes, in one pass of each decoder) and each added token alone.
    """
    table, why = build_byte_table(tokenizer)
    if table is None:
        return None, why
    probes = [range(len(table)), *([token_id] for token_id in sorted(tokenizer.get_added_tokens_decoder()))]
    why = check_byte_table(table, exact, probes)
    return (None, why) if why else (table, "")


def matching_prefix(n: int, same: Callable[[int, int], bool]) -> int:
    """How many leading items of two n-item sequences match, given `same(lo, hi)`: whether items [lo, hi) do.

    For when the whole did not match: callers compare all n items at once first (one memcmp or
    list compare, the common case) and call this only when that failed, which it takes as given.
    It bisects the undecided range, so the compares cover about two passes over the prefix.
    """
    lo, hi = 0, n  # items [0, lo) match, [0, hi) do not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if same(lo, mid):
            lo = mid
        else:
            hi = mid
    return lo
