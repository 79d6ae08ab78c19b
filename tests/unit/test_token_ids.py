"""`broker.token_ids`: the one bytes table both sides decode with, validated on both.

The table is built and validated once in `token_ids`; the workers' `TableDecoder` and the broker's
`RowBuilder` both take it from there, and both refuse a table that decodes differently from the
tokenizer (and then decode with the tokenizer).
"""

from __future__ import annotations

import os
from array import array
from types import SimpleNamespace

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from broker import token_ids
from broker.episodes.rows import RowBuilder
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
