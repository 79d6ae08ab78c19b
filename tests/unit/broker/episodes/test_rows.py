"""A row's `response` text: the broker's byte-table decode equals the tokenizer's own decode.

Property-tested on the real Qwen BPE over any id sequence: sampled text, special tokens anywhere,
single ids that are partial UTF-8 (so the whole is invalid and the tokenizer's run-by-run lossy
decode must decide), and ids past the vocabulary. The table's one-gather join equals joining each id's
bytes, negative and out-of-range ids included (they index, or raise IndexError, as a list does).
"""

from __future__ import annotations

import os
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from broker import token_ids
from broker.episodes.rows import RowBuilder

SPECIAL_IDS = [151643, 151644, 151645, 151657, 151658, 151667, 151668]


@pytest.fixture(scope="module")
def rows(qwen3_tokenizer_dir: str) -> RowBuilder:
    builder = RowBuilder(qwen3_tokenizer_dir)
    builder.decode(array("i", [0]))
    assert builder._token_bytes is not None  # the Qwen BPE gets the fast table
    return builder


@pytest.fixture(scope="module")
def tokenizer(qwen3_tokenizer_dir: str) -> Tokenizer:
    return Tokenizer.from_file(os.path.join(qwen3_tokenizer_dir, "tokenizer.json"))


texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.one_of(texts, st.sampled_from(SPECIAL_IDS), st.integers(0, 151642)), max_size=12))
def test_byte_table_decode_equals_the_tokenizer(rows, tokenizer, parts):
    ids: list[int] = []
    for part in parts:
        ids += tokenizer.encode(part, add_special_tokens=False).ids if isinstance(part, str) else [part]
    assert rows.decode(array("i", ids)) == tokenizer.decode(ids, skip_special_tokens=False)


def test_partial_utf8_next_to_special_tokens_decodes_like_the_tokenizer(rows, tokenizer):
    # a character that takes several tokens: its first id alone is broken UTF-8
    emoji = next(ids for ch in "𠀋𝔘🜁🝳🫠" if len(ids := tokenizer.encode(ch, add_special_tokens=False).ids) > 1)
    assert "\ufffd" in tokenizer.decode(emoji[:1])
    for ids in ([emoji[0], 151645, emoji[1]], [151644, *emoji[:-1]], emoji[1:] + [151643]):
        assert rows.decode(array("i", ids)) == tokenizer.decode(ids, skip_special_tokens=False)


def test_without_a_tokenizer_the_text_is_empty():
    assert RowBuilder(None).decode(array("i", [1, 2, 3])) == ""


@pytest.fixture(scope="module")
def token_bytes(tokenizer: Tokenizer) -> list[bytes]:
    table, why = token_ids.byte_table(tokenizer, lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False))
    assert table is not None and len(table) > 151_000
    return table


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.one_of(st.integers(0, 151_668), st.integers(-151_669, -1), st.sampled_from(SPECIAL_IDS))))
def test_the_table_gather_joins_exactly_the_ids_bytes(rows, token_bytes, ids):
    table = rows._token_bytes
    assert len(table) == len(token_bytes) == 151_669
    expected = b"".join(token_bytes[i] for i in ids)
    assert table.raw(array("i", ids)) == expected
    assert table.raw(array("q", ids)) == expected  # any integer array
    try:
        text = expected.decode("utf-8")
    except UnicodeDecodeError:
        with pytest.raises(UnicodeDecodeError):
            table.decode(array("i", ids))
    else:
        assert table.decode(array("i", ids)) == text


@pytest.mark.parametrize("bad", [151_700_000, -151_700_000, len(SPECIAL_IDS) - 2**31])
def test_the_table_refuses_ids_a_list_refuses(rows, token_bytes, bad):
    with pytest.raises(IndexError):
        token_bytes[bad]
    with pytest.raises(IndexError):
        rows._token_bytes.raw(array("i", [5, bad]))
    if bad > 0:
        assert rows.decode(array("i", [bad])) == ""  # the tokenizer decides, as before


def test_empty_tokens_join_to_nothing(rows, token_bytes):
    holes = [i for i, b in enumerate(token_bytes) if not b]
    ids = [9707, *holes[:3], 1879]
    assert rows._token_bytes.raw(array("i", ids)) == b"".join(token_bytes[i] for i in ids)
