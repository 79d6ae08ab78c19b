"""`broker.token_ids`: the one bytes table both sides decode with, validated on both, and the prefix bisection.

The table is built and validated once in `token_ids`; the workers' `TableDecoder` and the broker's
`RowBuilder` both take it from there, and both refuse a table that decodes differently from the
tokenizer (and then decode with the tokenizer). `matching_prefix` is property-tested against a plain
scan, alone and through its three users (commit bases' ids and messages, the turn store's log ranges).
"""

from __future__ import annotations

import os
from array import array
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from broker import token_ids
from broker.episodes.rows import RowBuilder
from broker.sessions.logs.ranges import common_prefix
from gateway_workers.capture.commit_bases import shared_ids, shared_items
from gateway_workers.rendering.twins.bpe import TableDecoder, token_decoder


def exact_of(tokenizer: Tokenizer):
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False)


@pytest.fixture(scope="module")
def qwen(qwen3_tokenizer_dir: str) -> Tokenizer:
    return Tokenizer.from_file(os.path.join(qwen3_tokenizer_dir, "tokenizer.json"))


def test_the_byte_alphabet_maps_256_chars_onto_the_256_bytes():
    alphabet = token_ids.byte_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert {chr(c) for c in alphabet} == set(pre_tokenizers.ByteLevel.alphabet())
    assert alphabet[ord("A")] == ord("A") and alphabet[ord("Ġ")] == ord(" ") and alphabet[ord("Ċ")] == ord("\n")


def test_one_table_for_workers_and_broker(qwen, qwen3_tokenizer_dir):
    table, why = token_ids.byte_table(qwen, exact_of(qwen))
    assert table is not None, why
    decode = token_decoder(SimpleNamespace(backend_tokenizer=qwen))
    assert isinstance(decode, TableDecoder) and decode._table == table
    rows = RowBuilder(qwen3_tokenizer_dir)
    rows.decode(array("i", [0]))
    assert rows._token_bytes is not None
    assert rows._token_bytes.raw(array("i", range(len(table)))) == b"".join(table)


def test_decode_is_the_lossy_join_of_the_ids_bytes():
    table = [b"a", b"\xe4\xb8", b"\xad", b""]
    assert token_ids.decode(table, [0, 1, 2, 3, 0]) == "a中a"
    assert token_ids.decode(table, [1, 0]) == "\ufffda"
    assert token_ids.decode(table, []) == ""


def with_added(qwen: Tokenizer, tmp_path, *tokens: str) -> tuple[Tokenizer, str]:
    """A copy of the Qwen tokenizer with more added tokens, and its file (the broker loads by path)."""
    path = str(tmp_path / "tokenizer.json")
    qwen.save(path)
    tok = Tokenizer.from_file(path)
    tok.add_tokens([AddedToken(t, normalized=False) for t in tokens])
    tok.save(path)
    return tok, path


def test_added_tokens_spelled_in_the_alphabet_decode_to_their_bytes_on_both_sides(qwen, tmp_path):
    # "ĠxĠ" is " x " to the ByteLevel decoder; "日本" is no alphabet spelling, so its own UTF-8
    tok, path = with_added(qwen, tmp_path, "ĠxĠ", "日本")
    ids = [*tok.encode("say", add_special_tokens=False).ids, tok.token_to_id("ĠxĠ"), tok.token_to_id("日本")]
    assert tok.decode(ids, skip_special_tokens=False) == "say x 日本"
    table, why = token_ids.byte_table(tok, exact_of(tok))
    assert table is not None, why
    assert token_ids.decode(table, ids) == "say x 日本"
    assert token_decoder(SimpleNamespace(backend_tokenizer=tok))(ids) == "say x 日本"
    rows = RowBuilder(path)
    assert rows.decode(array("i", ids)) == "say x 日本" and rows._token_bytes is not None


def test_a_table_that_decodes_differently_is_refused_on_both_sides(qwen, tmp_path, monkeypatch):
    # one wrong entry, forced: the builder gets every tokenizer at hand right
    tok, path = with_added(qwen, tmp_path, "marker")
    marker = tok.token_to_id("marker")
    build = token_ids.build_byte_table

    def wrong(tokenizer):
        table, why = build(tokenizer)
        table[marker] = b"MARKER"
        return table, why

    monkeypatch.setattr(token_ids, "build_byte_table", wrong)
    table, why = token_ids.byte_table(tok, exact_of(tok))
    assert table is None and "decode differently" in why
    decode = token_decoder(SimpleNamespace(backend_tokenizer=tok))
    assert not isinstance(decode, TableDecoder) and decode([marker]) == "marker"
    rows = RowBuilder(path)
    assert rows.decode(array("i", [marker])) == "marker" and rows._token_bytes is None


def test_check_byte_table_names_the_probe_that_differs():
    table = [b"a", b"b", b"c"]
    assert token_ids.check_byte_table(table, lambda ids: "".join("abc"[i] for i in ids), [range(3), [1]]) == ""
    why = token_ids.check_byte_table(table, lambda ids: "x", [[0], range(3)])
    assert why == "1 probe id(s) [0] decode differently from the tokenizer"
    why = token_ids.check_byte_table(table, lambda ids: "abc" if len(ids) == 1 else "", [[2], range(3)])
    assert why == "1 probe id(s) [2] decode differently from the tokenizer"


def test_tokenizers_that_are_not_byte_level_get_no_table():
    word_level = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    assert token_ids.build_byte_table(word_level) == (None, "decoder None is not ByteLevel")
    word_level.decoder = decoders.WordPiece()
    assert token_ids.build_byte_table(word_level) == (None, "decoder WordPiece is not ByteLevel")
    odd = Tokenizer(models.WordLevel({"a": 0, "\u4e00": 1, "[UNK]": 2}, unk_token="[UNK]"))
    odd.decoder = decoders.ByteLevel()
    assert token_ids.build_byte_table(odd) == (None, "the vocabulary is not byte-level")


def naive_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# few distinct values, so prefixes of every length (and mismatches anywhere) are common
items = st.lists(st.integers(0, 2), max_size=80)


@given(a=items, b=items)
def test_matching_prefix_equals_a_plain_scan(a, b):
    n = min(len(a), len(b))
    calls = []

    def same(lo: int, hi: int) -> bool:
        calls.append((lo, hi))
        return a[lo:hi] == b[lo:hi]

    expected = naive_prefix(a, b)
    if expected == n:
        return  # the whole matches: callers answer that with their own first compare
    assert token_ids.matching_prefix(n, same) == expected
    assert len(calls) <= max(n - 1, 0).bit_length()  # a bisection: one compare per halving
    assert all(0 <= lo < hi <= n for lo, hi in calls)


@given(a=items, b=items, offset=st.integers(0, 3))
def test_the_three_users_equal_a_plain_scan(a, b, offset):
    base = array("i", [7] * offset + a)
    with memoryview(array("i", b)) as new, new.cast("B") as new_bytes:
        assert shared_ids(base.tobytes(), offset * 4, new_bytes) == naive_prefix(a, b)
    assert shared_items([{"v": x} for x in a], [{"v": x} for x in b]) == naive_prefix(a, b)


def spell(log: list[int], ranges) -> list[int]:
    """The items the (start, stop) ranges spell in the log, read back to back."""
    return [log[i] for lo, hi in zip(ranges[0::2], ranges[1::2], strict=True) for i in range(lo, hi)]


@given(log=st.lists(st.integers(0, 2), min_size=1, max_size=60), cuts=st.lists(st.integers(0, 60), max_size=6),
       seq=items)
def test_common_prefix_over_log_ranges_equals_a_plain_scan(log, cuts, seq):
    # ranges: consecutive slices of the log between sorted cut points
    points = sorted({0, len(log), *(c % (len(log) + 1) for c in cuts)})
    ranges = [x for lo, hi in zip(points, points[1:], strict=False) for x in (lo, hi)]

    def same(i: int, j: int, n: int) -> bool:
        return seq[i : i + n] == log[j : j + n]

    n, cut = common_prefix(len(seq), same, ranges)
    assert n == naive_prefix(seq, spell(log, ranges))
    assert spell(log, cut) == seq[:n]
