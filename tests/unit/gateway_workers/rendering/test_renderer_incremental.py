"""Incremental prompt encoding: ids identical to a full encode, on the real Qwen BPE and real templates.

Property tests (hypothesis) compare `Renderer.render` against `apply_chat_template(tokenize=True)`
for trl's qwen3.jinja and the built-in template, over conversations with unicode, whitespace at
piece edges and special-token-looking text inside content, and growing episodes rendered turn by
turn through one shared renderer (so later turns reuse cached pieces, and new pieces are encoded by
the tiktoken twin past its checked renders). Also: the cache's bound and
LRU order, and the tokenizers the splitter must refuse.
"""

from __future__ import annotations

import logging
from array import array
from concurrent.futures import ThreadPoolExecutor

import pytest
from assets import TOOLS
from conversations import content, conversation, fragment
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

from gateway_workers.rendering.budget import PromptOverBudget
from gateway_workers.rendering.messages import template_messages
from gateway_workers.rendering.pieces import SegmentCache, special_splitter
from gateway_workers.rendering.renderer import INLINE_NEW_CHARS, Renderer
from gateway_workers.rendering.session_renders import LastRender, shared_prefix
from gateway_workers.rendering.twins.checks import VERIFY_EVERY, VERIFY_FIRST


def expected_ids(tokenizer, messages, tools, **kwargs) -> list[int]:
    return list(tokenizer.apply_chat_template(template_messages(messages), tools=tools, add_generation_prompt=True,
                                              tokenize=True, return_dict=False, **kwargs))


@pytest.fixture(scope="module", params=["builtin", "qwen3"])
def tokenizer(request, builtin_tokenizer, qwen3_tokenizer):
    return builtin_tokenizer if request.param == "builtin" else qwen3_tokenizer


@pytest.fixture(scope="module")
def renderer(tokenizer):
    """One renderer per template for the whole module: later examples hit pieces cached by earlier ones."""
    r = Renderer(tokenizer)
    assert r.incremental and r.bpe_twin
    # Past the renders that double-check the tiktoken twin: what the properties below see is the twin's.
    r.encode_twin.uses = VERIFY_FIRST + 1
    return r


PROPERTY = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(messages=conversation(), with_tools=st.booleans(), thinking=st.sampled_from([None, True, False]))
def test_render_ids_equal_apply_chat_template(tokenizer, renderer, messages, with_tools, thinking):
    tools = TOOLS if with_tools else None
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    rendered = renderer.render(messages, tools, template_kwargs=kwargs)
    assert rendered.prompt_ids.typecode == "i"
    assert list(rendered.prompt_ids) == expected_ids(tokenizer, messages, tools, **kwargs)
    assert renderer.bpe_twin  # it never disagreed with the tokenizer on a checked render


@PROPERTY
@given(messages=conversation())
def test_a_growing_episode_equals_full_renders_at_every_turn(tokenizer, renderer, messages):
    for cut in range(1, len(messages) + 1):
        rendered = renderer.render(messages[:cut], TOOLS)
        assert list(rendered.prompt_ids) == expected_ids(tokenizer, messages[:cut], TOOLS), cut


def session_render(renderer, messages, tools, session):
    begun = renderer.begin_render(messages, tools, session)
    return begun() if callable(begun) else begun


@PROPERTY
@given(messages=conversation(), edits=st.lists(st.tuples(st.integers(0, 9), content), max_size=3),
       other=conversation())
def test_a_session_renders_every_turn_as_a_full_render(tokenizer, renderer, messages, edits, other):
    """Each render of a session starts from its previous one: as the episode grows, after an earlier
    message is rewritten (a template re-rendering history), and for another conversation under the key."""
    renderer.template_twin.uses = VERIFY_FIRST + 1  # past the renders that go wholly to Jinja
    session = f"s{id(messages)}-{len(messages)}"
    turns = [messages[:cut] for cut in range(1, len(messages) + 1)]
    for at, text in edits:
        rewritten = [dict(m) for m in messages]
        rewritten[at % len(rewritten)]["content"] = text
        turns.append(rewritten)
    turns += [other, [*other, *messages[1:]]]
    for k, turn in enumerate(turns):
        rendered = session_render(renderer, turn, TOOLS, session)
        assert list(rendered.prompt_ids) == expected_ids(tokenizer, turn, TOOLS), k
    assert renderer.bpe_twin


def test_a_session_render_reuses_the_shared_prefix(builtin_tokenizer):
    renderer = Renderer(builtin_tokenizer)
    renderer.template_twin.uses = VERIFY_FIRST + 1
    episode = [{"role": "system", "content": "sys " * 500}, {"role": "user", "content": "question " * 800}]
    session_render(renderer, episode, TOOLS, "s1")
    episode += [{"role": "assistant", "content": "", "tool_calls": [{"name": "search", "arguments": {"q": 1}}]},
                {"role": "tool", "content": "result " * 300}]
    lookups = []
    get_many = renderer.cache.get_many
    renderer.cache.get_many = lambda pieces, session=None: lookups.append(list(pieces)) or get_many(pieces, session)
    rendered = session_render(renderer, episode, TOOLS, "s1")
    assert list(rendered.prompt_ids) == expected_ids(builtin_tokenizer, episode, TOOLS)
    looked_up = "".join(lookups[0])
    assert "result" in looked_up and "question" not in looked_up and "sys" not in looked_up


@settings(max_examples=300, deadline=None)
@given(a=st.text(st.sampled_from("ab<>|"), max_size=40), b=st.text(st.sampled_from("ab<>|"), max_size=40))
def test_shared_prefix_ends_after_the_last_shared_token(a, b):
    ends = [i + 2 for i in range(len(a) - 1) if a[i : i + 2] == "<>"]  # "<>" plays an added token here
    last = LastRender(a, array("i", range(len(ends))), ends, list(range(1, len(ends) + 1)))
    at, head = shared_prefix(b, last)
    common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    expected = [e for e in ends if e <= common]
    assert at == (expected[-1] if expected else 0)
    assert (head is None) == (not expected) and (head is None or len(head) == len(expected))


@settings(max_examples=400, deadline=None)
@given(text=st.lists(fragment, max_size=30).map("".join))
def test_encode_prompt_equals_full_encode_on_any_text(renderer, text):
    assert list(renderer.encode_prompt(text)) == renderer.encode(text)
    assert list(renderer.encode_prompt(text)) == renderer.encode(text)  # second time: all pieces cached


def test_later_turns_reuse_cached_pieces(builtin_tokenizer):
    renderer = Renderer(builtin_tokenizer)
    episode = [{"role": "system", "content": "sys " * 500}, {"role": "user", "content": "question " * 800}]
    renderer.render(episode, TOOLS)
    before = renderer.cache.stats()
    episode += [{"role": "assistant", "content": "", "tool_calls": [{"name": "search", "arguments": {"query": "x"}}]},
                {"role": "tool", "content": "result " * 300}]
    renderer.render(episode, TOOLS)
    after = renderer.cache.stats()
    # Only the new turn's pieces are tokenized: the system prompt, tools and question come from the cache.
    new_misses = after.misses - before.misses
    assert after.hits > before.hits and 0 < new_misses <= 4, (before, after)


def test_cache_is_bounded_and_evicts_least_recently_used():
    one = array("i", [1, 2, 3])
    cost = SegmentCache.cost("aaaa", one)
    cache = SegmentCache(max_bytes=3 * cost)
    cache.put_many([("aaaa", one), ("bbbb", one), ("cccc", one)])
    assert cache.get_many(["aaaa"]) == [one]  # refreshes "aaaa"
    cache.put_many([("dddd", one)])
    assert cache.get_many(["bbbb", "aaaa", "cccc", "dddd"]) == [None, one, one, one]
    stats = cache.stats()
    assert stats.entries == 3 and stats.bytes == 3 * cost and stats.evictions == 1
    assert stats.hits == 4 and stats.misses == 1
    cache.put_many([("x" * 10_000, one)])  # bigger than the whole cache: not kept, nothing evicted
    assert cache.stats().entries == 3
    with pytest.raises(ValueError):
        SegmentCache(-1)


def test_a_tiny_cache_still_renders_exact_ids(builtin_tokenizer):
    renderer = Renderer(builtin_tokenizer, cache_bytes=2_000)
    messages = [{"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "more " * 400}]
    for _ in range(2):
        assert list(renderer.render(messages, TOOLS).prompt_ids) == expected_ids(builtin_tokenizer, messages, TOOLS)
    assert renderer.cache.stats().bytes <= 2_000 and renderer.cache.stats().evictions > 0


def test_cache_bytes_zero_turns_incremental_off(builtin_tokenizer):
    renderer = Renderer(builtin_tokenizer, cache_bytes=0)
    assert not renderer.incremental
    messages = [{"role": "user", "content": "hi <think> there"}]
    assert list(renderer.render(messages).prompt_ids) == expected_ids(builtin_tokenizer, messages, None)


def test_concurrent_renders_of_overlapping_episodes_are_exact(qwen3_tokenizer):
    renderer = Renderer(qwen3_tokenizer)
    base = [{"role": "system", "content": "shared system prompt " * 50}]
    episodes = [base + [{"role": "user", "content": f"agent {i}: " + "text é " * (20 * i)}] for i in range(24)]
    expected = [expected_ids(qwen3_tokenizer, e, TOOLS) for e in episodes]
    with ThreadPoolExecutor(max_workers=8) as pool:
        got = list(pool.map(lambda e: list(renderer.render(e, TOOLS).prompt_ids), episodes * 3))
    assert got == expected * 3


# --- tokenizers the splitter must refuse --------------------------------------------------------------


def _word_level(pre_tokenizer=None, normalizer=None) -> Tokenizer:
    vocab = {"[UNK]": 0, "a": 1, "b": 2, "▁a": 3, "▁b": 4, "▁": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizer or pre_tokenizers.Whitespace()
    if normalizer is not None:
        tok.normalizer = normalizer
    return tok


def test_splitter_accepts_a_plain_tokenizer_with_added_tokens():
    tok = _word_level()
    tok.add_special_tokens([AddedToken("<s>", normalized=False)])
    splitter, why = special_splitter(tok)
    assert splitter is not None and why == "" and splitter.ids == {"<s>": 6}


@pytest.mark.parametrize("flag", ["lstrip", "rstrip", "single_word"])
def test_splitter_refuses_tokens_that_move_the_cut(flag):
    tok = _word_level()
    tok.add_special_tokens([AddedToken("<s>", normalized=False, **{flag: True})])
    splitter, why = special_splitter(tok)
    assert splitter is None and "strips whitespace" in why


def test_splitter_refuses_position_dependent_pre_tokenizers():
    tok = _word_level(pre_tokenizers.Metaspace(prepend_scheme="first"))
    tok.add_special_tokens([AddedToken("<s>", normalized=False)])
    assert tok.encode("a<s>a").ids != tok.encode("a").ids + [6] + tok.encode("a").ids  # the hazard is real
    splitter, why = special_splitter(tok)
    assert splitter is None and "first piece" in why


def test_splitter_refuses_tokenizers_with_nothing_to_cut_at_or_special_tokens_as_text():
    assert special_splitter(_word_level())[0] is None
    tok = _word_level(normalizer=normalizers.NFC())
    tok.add_special_tokens([AddedToken("<s>", normalized=False)])
    tok.encode_special_tokens = True
    assert "as text" in special_splitter(tok)[1]
    assert special_splitter(None)[0] is None


def test_incremental_off_is_logged(builtin_tokenizer, caplog):
    with caplog.at_level(logging.INFO, logger="gateway_workers.rendering.renderer"):
        Renderer(builtin_tokenizer, cache_bytes=0)
    assert "incremental prompt encoding is off" in caplog.text


def test_begin_render_does_cheap_renders_on_the_calling_thread_and_hands_off_the_rest(builtin_tokenizer):
    renderer = Renderer(builtin_tokenizer)
    episode = [{"role": "user", "content": "a short question"}]
    first = renderer.begin_render(episode)
    assert callable(first)  # the first renders are checked against the originals: on a worker thread
    assert list(first().prompt_ids) == list(Renderer(builtin_tokenizer, cache_bytes=0).render(episode).prompt_ids)
    renderer.template_twin.uses = renderer.encode_twin.uses = VERIFY_FIRST + 1
    episode += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    on_loop = renderer.begin_render(episode)
    assert not callable(on_loop)
    full = Renderer(builtin_tokenizer, cache_bytes=0).render(episode)
    assert list(on_loop.prompt_ids) == list(full.prompt_ids) and on_loop.text == full.text
    long_turn = episode + [{"role": "user", "content": "word " * (INLINE_NEW_CHARS // 4)}]
    rest = renderer.begin_render(long_turn)
    assert callable(rest)  # too much new text for the loop's thread: the encode is left to a worker thread
    exact = Renderer(builtin_tokenizer, cache_bytes=0).render(long_turn)
    assert list(rest().prompt_ids) == list(exact.prompt_ids)


def test_inline_follows_begin_renders_rule(builtin_tokenizer):
    renderer = Renderer(builtin_tokenizer)
    assert not renderer.inline(10)  # the first uses of both twins are checked against the originals
    renderer.template_twin.uses = VERIFY_FIRST + 1
    assert not renderer.inline(10)
    renderer.encode_twin.uses = VERIFY_FIRST + 1
    assert renderer.inline(10) and renderer.inline(INLINE_NEW_CHARS) and not renderer.inline(INLINE_NEW_CHARS + 1)
    renderer.template_twin.uses = 2 * VERIFY_EVERY - 2  # the third use from here is a checked one
    assert renderer.inline(10, renders=2) and not renderer.inline(10, renders=3)
    assert not Renderer(builtin_tokenizer, native_templates=False).inline(10)


def test_begin_render_hands_templates_without_a_twin_to_a_thread(builtin_tokenizer):
    renderer = Renderer(builtin_tokenizer, native_templates=False)
    assert renderer.template_twin is None
    renderer.encode_twin.uses = VERIFY_FIRST + 1
    assert callable(renderer.begin_render([{"role": "user", "content": "hi"}]))


# --- context budgets ---------------------------------------------------------------------------------------


@PROPERTY
@given(messages=conversation(), budget=st.integers(1, 400), padding=st.sampled_from(["", "word ", "  ", "é\u0301"]),
       repeat=st.integers(0, 3000))
def test_a_budgeted_render_is_the_full_render_or_a_proven_overrun(tokenizer, renderer, messages, budget, padding,
                                                                  repeat):
    """Under any budget: the exact ids when the prompt fits, else `PromptOverBudget` with a true lower bound."""
    messages = [*messages, {"role": "user", "content": padding * repeat}]
    expected = expected_ids(tokenizer, messages, TOOLS)
    try:
        rendered = renderer.render(messages, TOOLS, budget=budget)
    except PromptOverBudget as e:
        assert budget < len(expected) and budget < e.at_least <= len(expected), (e.at_least, len(expected))
    else:
        assert len(expected) <= budget and list(rendered.prompt_ids) == expected


def test_a_prompt_proven_over_budget_by_size_is_not_tokenized(builtin_tokenizer):
    renderer = Renderer(builtin_tokenizer)
    renderer.template_twin.uses = renderer.encode_twin.uses = VERIFY_FIRST + 1
    huge = [{"role": "user", "content": "many words in a row " * 200_000}]  # 4 MB: at least 31k tokens by size
    encoded: list[int] = []
    renderer._encode_pieces = lambda pieces: encoded.append(len(pieces)) or []  # type: ignore[method-assign]
    with pytest.raises(PromptOverBudget) as raised:
        renderer.render(huge, budget=4096)
    assert encoded == [] and raised.value.at_least >= len("".join(m["content"] for m in huge)) // 128


def test_a_long_prompt_of_many_pieces_stops_being_tokenized_past_the_budget(builtin_tokenizer):
    renderer = Renderer(builtin_tokenizer)
    renderer.template_twin.uses = renderer.encode_twin.uses = VERIFY_FIRST + 1
    # 40 messages of ~64k chars: each fits the size bound, so only counting finds the overrun
    episode = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"step {i} " + "lorem ipsum " * 5_000}
               for i in range(40)]
    encode = renderer._encode_pieces
    encoded: list[int] = []

    def counting(pieces):
        encoded.append(sum(map(len, pieces)))
        return encode(pieces)

    renderer._encode_pieces = counting  # type: ignore[method-assign]
    with pytest.raises(PromptOverBudget) as raised:
        renderer.render(episode, budget=40_000)
    total = sum(len(m["content"]) for m in episode)
    assert raised.value.at_least > 40_000 and sum(encoded) < total / 2, (sum(encoded), total)


def test_begin_render_hands_the_budget_to_the_deferred_part(builtin_tokenizer):
    renderer = Renderer(builtin_tokenizer)
    renderer.template_twin.uses = renderer.encode_twin.uses = VERIFY_FIRST + 1
    long_turn = [{"role": "user", "content": "word " * INLINE_NEW_CHARS}]
    rest = renderer.begin_render(long_turn)
    assert callable(rest)
    with pytest.raises(PromptOverBudget):
        rest(100)
    assert len(rest(None).prompt_ids) > 100


def test_token_bound_by_size():
    from gateway_workers.rendering.budget import TokenBound

    bound = TokenBound(4, nfc=True)
    assert bound.at_least("abcd" * 10, 10) == 0  # 40 bytes prove 10 tokens, not more than 10
    assert bound.at_least("abcd" * 10 + "e", 10) == 11
    # NFC composes e + combining acute (3 bytes) into é (2 bytes): only the composed size proves anything
    assert bound.at_least("e\u0301" * 20, 10) == 0 and bound.at_least("e\u0301" * 21, 10) == 11
    assert TokenBound(0).at_least("x" * 1000, 1) == 0


def test_token_bound_of_the_builtin_tokenizer(builtin_tokenizer):
    from gateway_workers.rendering.budget import token_bound

    renderer = Renderer(builtin_tokenizer)
    assert renderer.token_bound.nfc  # Qwen normalizes to NFC
    vocab = builtin_tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True)
    longest = max(vocab, key=lambda t: len(builtin_tokenizer.convert_tokens_to_string([t]).encode()))
    assert renderer.token_bound.max_token_bytes == len(builtin_tokenizer.convert_tokens_to_string([longest]).encode())
    # without the byte table, token spellings bound it from above (the byte alphabet spells a byte in 1-2 chars)
    spelled = token_bound(builtin_tokenizer.backend_tokenizer, None).max_token_bytes
    assert renderer.token_bound.max_token_bytes <= spelled <= 2 * renderer.token_bound.max_token_bytes
    lowercasing = _word_level(normalizer=normalizers.Lowercase())
    assert token_bound(lowercasing, None).max_token_bytes == 0  # a normalizer it does not model: no bound


def test_a_known_budget_spares_cutting_a_prompt_its_size_proves_over(builtin_tokenizer):
    renderer = Renderer(builtin_tokenizer)
    renderer.template_twin.uses = renderer.encode_twin.uses = VERIFY_FIRST + 1
    cut: list[str] = []
    lookup = renderer._lookup
    renderer._lookup = lambda text, session=None: cut.append(text) or lookup(text, session)  # type: ignore[method-assign]
    huge = [{"role": "user", "content": "word " * 300_000}]
    with pytest.raises(PromptOverBudget):
        renderer.render_session(huge, None, "s1", 1024)
    assert cut == []
    small = [{"role": "user", "content": "word " * 100}]
    assert list(renderer.render_session(small, None, "s1", 1024).prompt_ids) == expected_ids(builtin_tokenizer, small,
                                                                                            None)


def test_a_piece_is_its_sessions_until_another_uses_it_and_goes_with_it():
    one, two = array("i", [1]), array("i", [2, 3])
    cache = SegmentCache()
    cache.put_many([("mine", one), ("shared", two), ("anon", one)], "a")
    cache.put_many([("free", one)])  # encoded for no session: nobody's
    assert cache.get_many(["shared"], "b") == [two]  # used by another session: no longer a's alone
    assert cache.get_many(["mine", "anon"], "a") == [one, one]  # a's own use keeps them a's
    cache.put_many([("anon", one)], "c")  # encoded for two sessions at once: both lose it
    cache.forget("a", ["mine", "shared", "anon", "free", "absent"])
    assert cache.get_many(["mine", "shared", "anon", "free"]) == [None, two, one, one]
    stats = cache.stats()
    assert stats.forgotten == 1 and stats.entries == 3
    assert stats.bytes == sum(SegmentCache.cost(p, ids) for p, ids in [("shared", two), ("anon", one), ("free", one)])


def test_an_evicted_piece_is_no_longer_owned():
    one = array("i", [1])
    cache = SegmentCache(max_bytes=2 * SegmentCache.cost("aaaa", one))
    cache.put_many([("aaaa", one), ("bbbb", one)], "a")
    cache.put_many([("cccc", one)], "b")  # evicts "aaaa"
    cache.put_many([("aaaa", one)], "b")  # back, now b's (evicts "bbbb")
    cache.forget("a", ["aaaa", "bbbb"])
    assert cache.get_many(["aaaa", "cccc"]) == [one, one] and cache.stats().forgotten == 0


def test_a_finished_session_leaves_only_what_it_shared(builtin_tokenizer):
    renderer = Renderer(builtin_tokenizer)
    renderer.template_twin.uses = VERIFY_FIRST + 1
    system = {"role": "system", "content": "sys " * 500}

    def episode(name: str) -> list[dict]:
        return [system, {"role": "user", "content": f"{name} question " * 400}]

    texts = {}
    for session in ("s1", "s2"):
        turns = episode(session)
        session_render(renderer, turns, TOOLS, session)
        turns += [{"role": "assistant", "content": f"{session} answer"}, {"role": "user", "content": "more"}]
        rendered = session_render(renderer, turns, TOOLS, session)
        texts[session] = set(renderer._splitter.pattern.split(rendered.text)[0::2])  # its pieces, not added tokens
    held = renderer.cache.stats()
    renderer.forget_sessions(["s1", "unknown"])
    assert renderer.sessions_held == 1  # s2's last render stays
    after = renderer.cache.stats()
    assert after.forgotten > 0 and after.entries == held.entries - after.forgotten
    # s1's own pieces are gone; the system prompt, tools and "more" (s2 used them too) stay, as do s2's own
    own, common = sorted(texts["s1"] - texts["s2"]), sorted(texts["s2"])
    assert any("s1 question" in p for p in own) and any("sys sys" in p for p in common)
    cached = renderer.cache.get_many(own + common)
    assert cached[: len(own)] == [None] * len(own) and None not in cached[len(own) :]
    again = session_render(renderer, episode("s1"), TOOLS, "s1")  # a reused key renders from scratch, exactly
    assert list(again.prompt_ids) == expected_ids(builtin_tokenizer, episode("s1"), TOOLS)


def test_pieces_a_re_rendered_history_left_behind_go_with_their_session(builtin_tokenizer):
    renderer = Renderer(builtin_tokenizer)
    first = [{"role": "system", "content": "sys " * 200}, {"role": "user", "content": "draft question " * 100}]
    session_render(renderer, first, TOOLS, "s1")
    rewritten = [first[0], {"role": "user", "content": "final question " * 100}]  # as a template dropping old text
    session_render(renderer, rewritten, TOOLS, "s1")
    session_render(renderer, [first[0], {"role": "user", "content": "other"}], TOOLS, "s2")  # shares the system
    held = renderer.cache.stats().entries
    renderer.forget_sessions(["s1"])
    left = renderer._splitter.pattern.split(renderer.render_text(first, TOOLS))[0::2]
    draft = [p for p in left if "draft question" in p]
    assert draft and renderer.cache.get_many(draft) == [None]  # not in s1's last render, gone all the same
    assert renderer.cache.stats().entries == held - 2  # the draft and the final question; the system stays


def test_a_render_handed_to_the_thread_is_still_its_sessions(builtin_tokenizer):
    renderer = Renderer(builtin_tokenizer)  # its first renders go wholly to Jinja (the twin is being checked)
    episode = [{"role": "system", "content": "sys " * 200}, {"role": "user", "content": "question " * 100}]
    begun = renderer.begin_render(episode, TOOLS, "s1")
    assert callable(begun)
    begun()
    assert renderer.sessions_held == 1  # its next render starts from this one, and its pieces are the session's
    renderer.forget_sessions(["s1"])
    assert renderer.sessions_held == 0 and renderer.cache.stats().forgotten > 0
