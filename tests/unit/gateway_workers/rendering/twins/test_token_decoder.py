"""`token_decoder`: replies are decoded by a bytes table exactly as the tokenizer decodes them.

On both Qwen vocabularies (151k and the 248k Qwen3.5/3.6 one), over any ids: byte tokens that split
a character (lossy UTF-8), added tokens, ids past the vocabulary. A table that ever differs is dropped.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from fake_formats import family_tokenizer_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers

from gateway_workers.rendering.twins.bpe import TableDecoder, token_decoder


@pytest.fixture(scope="module", params=["qwen", "qwen3_5"])
def tokenizer(request, builtin_tokenizer):
    if request.param == "qwen":
        return builtin_tokenizer
    return SimpleNamespace(backend_tokenizer=Tokenizer.from_file(f"{family_tokenizer_dir('qwen3_6')}/tokenizer.json"))


def exact(tokenizer, ids: list[int]) -> str:
    return tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=False)


@st.composite
def ids(draw: st.DrawFn, size: int, added: list[int]) -> list[int]:
    byte_tokens = st.integers(0, 255)  # single bytes: most split a multi-byte character
    anything = st.integers(0, size + 8)  # past the end: the tokenizer's to drop
    return draw(st.lists(st.one_of(byte_tokens, anything, st.sampled_from(added)), max_size=40))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_ids_decode_as_the_tokenizer_decodes_them(tokenizer, data):
    backend = tokenizer.backend_tokenizer
    decode = token_decoder(tokenizer)
    assert isinstance(decode, TableDecoder)
    added = sorted(backend.get_added_tokens_decoder())
    sample = data.draw(ids(backend.get_vocab_size(), added))
    assert decode(sample) == exact(tokenizer, sample)
    assert decode.twin.active  # else every decode would be the tokenizer's and the test vacuous


def test_replies_decode_exactly(tokenizer):
    text = "<think>\nplan: été 中文 🙂\n</think>\n\nOk.\n<tool_call>\n{\"name\": \"f\"}\n</tool_call><|im_end|>"
    reply = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
    assert token_decoder(tokenizer)(reply) == text == exact(tokenizer, reply)


def test_a_table_that_differs_is_dropped_for_the_tokenizer(builtin_tokenizer, caplog):
    shared = token_decoder(builtin_tokenizer)
    assert isinstance(shared, TableDecoder)
    wrong = list(shared._table)
    hello = builtin_tokenizer.encode("hello")
    wrong[hello[0]] = b"HELLO"
    decode = TableDecoder(wrong, lambda ids: exact(builtin_tokenizer, list(ids)))
    with caplog.at_level(logging.ERROR):
        assert decode(hello) == "hello"
    assert not decode.twin.active and "bytes-table decoder" in caplog.text
    assert decode(hello) == "hello"


def test_a_tokenizer_without_a_byte_level_decoder_decodes_itself():
    backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    decode = token_decoder(SimpleNamespace(backend_tokenizer=backend))
    assert not isinstance(decode, TableDecoder)
    assert decode([0, 1]) == backend.decode([0, 1], skip_special_tokens=False)
