"""The tiktoken twin of a byte-level BPE tokenizer: equal ids on any text, refusals, and the renderer's fallback.

Equality is property-tested against the `tokenizers` encode on both real Qwen vocabularies (151k and
the 248k Qwen3.5/3.6 one), over unicode text with every whitespace and combining-mark shape, and on
adversarial words built from the vocabulary's own self-overlapping tokens (where two merge orders could
disagree). Tokenizers the twin cannot copy are refused with a reason; a twin that diverges live is
dropped by the renderer, which keeps answering with the exact ids.
"""

from __future__ import annotations

import itertools
import logging
import random

import orjson
import pytest
from fake_formats import family_tokenizer_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from gateway_workers.rendering.renderer import Renderer
from gateway_workers.rendering.twins import checks as twin_checks
from gateway_workers.rendering.twins.bpe import BpeTwin, _lookahead_cuts, bpe_twin

ADDED = ("<|", "|>", "<think", "</think", "<tool_", "</tool_")  # text that could form an added token is cut out


@pytest.fixture(scope="module", params=["qwen", "qwen3_5"])
def backend(request, builtin_tokenizer):
    if request.param == "qwen":
        return builtin_tokenizer.backend_tokenizer
    return Tokenizer.from_file(f"{family_tokenizer_dir('qwen3_6')}/tokenizer.json")


@pytest.fixture(scope="module")
def twin(backend) -> BpeTwin:
    twin, why = bpe_twin(backend)
    assert twin is not None, why
    return twin


def exact(backend, text: str) -> list[int]:
    return backend.encode(text, add_special_tokens=False).ids


shapes = st.sampled_from([" ", "  ", "\n", "\n\n", "\t", "\r\n", " \n ", "\u00a0", "\u200b", "\u0301", "'s", "'LL",
                          "123", "1 2", "中文", "日本語", "🙂", "👍🏽", "é", "e\u0301", "ß", "Ω", "```", "{\"a\": 1}"])
text = st.lists(st.one_of(shapes, st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=16)),
                max_size=24).map("".join).filter(lambda t: not any(a in t for a in ADDED))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=text)
def test_twin_encodes_any_text_like_the_tokenizer(backend, twin, text):
    assert twin.encode(text).tolist() == exact(backend, text)


# Runs of every kind of space (the engine's \\s, Python's extra \\x1c-\\x1f, newlines) between words,
# punctuation and digits: where the split pattern's lookahead ends pieces, which the twin restores by cuts.
SPACES = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2005\u200a\u2028\u2029\u202f\u205f\u3000\x1c\x1f"
runs = st.text(st.sampled_from(SPACES), min_size=1, max_size=5)
words = st.sampled_from(["a", "Word", "中", "1", "42", '"key"', "{", "}", "(", ":", "½", "²", "e\u0301", "🙂", "'s"])
spaced = st.lists(st.one_of(runs, words), max_size=40).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=spaced, repeat=st.sampled_from([1, 1, 60]))
def test_twin_restores_the_pieces_the_lookahead_ends(backend, twin, text, repeat):
    """Short pieces find the cuts by `re`, long ones (x60) by numpy; ½ and ² in the text are cut markers too."""
    text = text * repeat
    assert twin.encode(text).tolist() == exact(backend, text)


# ASCII text takes numpy's byte path (and its early exit when no two spaces are adjacent); \x00 and \x1c-\x1f
# are <= 32 like the spaces but are none.
ascii_spaced = st.lists(
    st.one_of(st.text(st.sampled_from("\t\n\x0b\x0c\r \x1c\x1f\x00"), min_size=1, max_size=4),
              st.sampled_from(["a", "Word", "1", '"key"', "{", ":", "\x7f", " x"])),
    max_size=40,
).map("".join)


@settings(max_examples=500, deadline=None)
@given(text=st.one_of(spaced, ascii_spaced))
def test_numpy_and_re_find_the_same_cuts(text):
    by_re = _lookahead_cuts(text, numpy_from=len(text) + 1)
    assert _lookahead_cuts(text, numpy_from=0) == by_re


def test_indented_code_and_text_holding_every_cut_marker(backend, twin):
    code = "def f(x):\n    if x:\n\t\treturn {\n        'a':  [1,  2],\n    }\n  \n" * 40
    assert twin._cuts is not None  # the Qwen patterns split without their lookahead
    ends = "a  \rb \t\rc x\r\n  \ry\n\n  \u2028\u2028z"
    for text in (code, code + "".join(twin._cuts), "".join(twin._cuts) + "  x  \u3000y", ends, ends * 50):
        assert twin.encode(text).tolist() == exact(backend, text)


def test_twin_agrees_on_self_overlapping_tokens(backend, twin):
    """Words made of p + q + s where q is both a prefix and a suffix of the token p + q (= q + s)."""
    vocab = orjson.loads(backend.model.__getstate__())["vocab"]
    tokens = [t for t in vocab if 3 <= len(t) <= 12]
    words = []
    for token in random.Random(0).sample(tokens, 20_000):
        for k in range(1, len(token) // 2 + 1):
            q = token[:k]
            if token.endswith(q) and token[:-k] in vocab and token[k:] in vocab:
                words.append(token[:-k] + token + token[k:])
    decoder = decoders.ByteLevel()
    texts = [decoder.decode([w]) for w in words]
    texts = [t for t in texts if "\ufffd" not in t]
    assert len(texts) > 50
    for t in texts:
        assert twin.encode(t).tolist() == exact(backend, t), t


def byte_level_bpe(merges_in_id_order: bool = True, ignore_merges: bool = True, nfkc: bool = False) -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    merges = [("a", "b"), ("ab", "c")]
    if merges_in_id_order:
        vocab["ab"], vocab["abc"] = 256, 257
    else:
        vocab["ab"], vocab["abc"] = 257, 256
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\s+|\S+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    if nfkc:
        tok.normalizer = normalizers.NFKC()
    return tok


def test_a_small_byte_level_bpe_gets_a_twin():
    tok = byte_level_bpe()
    twin, why = bpe_twin(tok)
    assert twin is not None, why
    vocab = tok.get_vocab()
    assert twin.encode("abc").tolist() == exact(tok, "abc") == [vocab["abc"]]
    for text in ("abcab abc", "ab\nabcc", "cba"):
        assert twin.encode(text).tolist() == exact(tok, text)


@pytest.mark.parametrize(
    ("tokenizer", "reason"),
    [
        (byte_level_bpe(merges_in_id_order=False), "merge order"),
        (byte_level_bpe(ignore_merges=False), "ignore_merges"),
        (byte_level_bpe(nfkc=True), "NFKC"),
    ],
)
def test_tokenizers_without_an_exact_twin_are_refused(tokenizer, reason):
    twin, why = bpe_twin(tokenizer)
    assert twin is None
    assert reason in why


def test_a_non_byte_level_tokenizer_is_refused():
    tok = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    twin, why = bpe_twin(tok)
    assert twin is None and "pre-tokenizer" in why


def test_renderer_drops_a_diverging_twin_and_keeps_exact_ids(builtin_tokenizer, caplog, monkeypatch):
    renderer = Renderer(builtin_tokenizer)
    assert renderer.bpe_twin

    class Wrong(BpeTwin):
        def encode(self, piece):
            ids = super().encode(piece)
            return ids[::-1]

    good, _ = bpe_twin(builtin_tokenizer.backend_tokenizer)
    renderer.encode_twin.fast = Wrong(lambda: good._shared, nfc=True)
    messages = [{"role": "user", "content": "several words that are surely more than one token"}]
    with caplog.at_level(logging.ERROR, logger="gateway_workers.rendering.renderer"):
        ids = renderer.render(messages).prompt_ids
    assert list(ids) == list(builtin_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                    tokenize=True, return_dict=False))
    assert not renderer.bpe_twin
    assert "tiktoken twin" in caplog.text


def test_live_encodes_are_checked_on_a_sample(builtin_tokenizer, monkeypatch):
    """Past the first checked renders, one in VERIFY_EVERY is still compared with the tokenizer."""
    calls = itertools.count()
    renderer = Renderer(builtin_tokenizer)
    exact_encode = renderer.encode_twin.exact

    def counting(pieces):
        next(calls)
        return exact_encode(pieces)

    monkeypatch.setattr(renderer.encode_twin, "exact", counting)
    monkeypatch.setattr(twin_checks, "VERIFY_EVERY", 4)
    for k in range(twin_checks.VERIFY_FIRST + 8):
        renderer.render([{"role": "user", "content": f"question number {k} " * 3}])
    assert next(calls) == twin_checks.VERIFY_FIRST + 2  # the first ones, then 2 of the next 8 (every 4th)
    assert renderer.bpe_twin


def test_the_render_thread_encodes_with_its_own_encoding_and_the_same_ids(builtin_tokenizer):
    """tiktoken serves only the first thread to use an encoding lock-free: the render thread gets its own."""
    renderer = Renderer(builtin_tokenizer)
    assert renderer.encode_twin is not None
    twin = renderer.encode_twin.fast
    texts = ["plain words here", "  indented\n    code()\n", "数字 12345 🙂", "\t\ttabs  and  runs  \n"]
    try:
        renderer.prepare_thread()

        def on_thread() -> tuple[object, list[list[int]]]:
            return twin._own.encoding, [twin.encode(t).tolist() for t in texts]

        own, ids = renderer.thread.submit(on_thread).result(timeout=30)
    finally:
        renderer.thread.shutdown(wait=True)
    assert own is not twin._shared and not hasattr(twin._own, "encoding")  # this thread still shares the first
    assert ids == [twin.encode(t).tolist() for t in texts]
    assert ids == [builtin_tokenizer.backend_tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
