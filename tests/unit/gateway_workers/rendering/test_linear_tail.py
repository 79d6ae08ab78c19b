"""Linear history tails (`rendering.linear`) on every registry family: real trl templates, real Qwen BPEs.

A linear episode is simulated turn by turn: the held ids are the first prompt, then each turn's
sampled output and its tail; the tree prompt is the full render of all messages. The output a
model samples is either the template's own rendering of the reply up to its end token, or the
family's fake-engine writer parsed back by the family's parser (as the gateway does). Checked
on random multi-turn tool conversations: wherever the template is prefix-preserving (each tree
prompt extends the previous one plus its output), held + tail == the full render, id for id;
everywhere, the full render ends with the tail, right after the reply's end token, and the tail
holds the new messages and no other text. Where the template is not prefix-preserving, the
difference is the documented one (`REWRITES`): the full render rewrites earlier replies (drops
their reasoning, writes <|end|> for harmony's <|return|>), the linear prompt keeps them as
sampled, and nothing else differs. Also: outputs cut by a length limit (closed by the tail on
every family; refused only where harmony cannot re-render the cut), each refusal, and a tail
whose cost does not grow with the history (characters rendered and tokenized, counted).
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from assets import TOOLS
from fake_formats import FAMILIES, WRITERS, Family
from family_cases import family_tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway_workers.formats.parsed import ResponseParser
from gateway_workers.formats.registry import detect_parser
from gateway_workers.rendering.linear import (
    STOP_EQUIVALENTS,
    HeadRenders,
    LinearTail,
    TailRefusal,
    head_texts,
    linear_tail,
    stand_in,
)
from gateway_workers.rendering.renderer import Renderer
from gateway_workers.rendering.tokenizer import load_tokenizer

# What each family's template does to an earlier reply when it renders the history again: the
# documented difference between the linear prompt (the reply as sampled) and the full render.
#   None: nothing; the template is prefix-preserving, linear == tree on every turn.
#   "reasoning": the reasoning of a reply before the last user query is dropped (Qwen3, Qwen3.5/3.6) or
#       emptied to <think></think> (Nemotron-3, GLM-4.5), harmony drops the analysis of a tool call once a
#       final answer follows and of every final answer, whose <|return|> it writes as <|end|>; Qwen3 also
#       drops an empty think block unless the reply is the last message, and with enable_thinking=False
#       the empty block its generation prompt opens with. Harmony writes a reply cut inside its analysis
#       as an empty final answer.
#   "always": the reasoning of every earlier reply is dropped (DeepSeek-R1 distills).
# Every family may also rewrite a reply cut by a length limit: the parser hands back the cut's trailing
# whitespace as content (which the templates trim, or write before the calls), and a reply it cannot parse
# (cut inside a reasoning block or a call) as raw content, which the template writes as text (after a
# header or an empty reasoning block of its own, without the <think> the generation prompt opened), or
# whose think tags it reads as a reasoning block, rewritten as above.
REWRITES: dict[str, str | None] = {
    "qwen3": "reasoning",
    "qwen2_5": None,
    "qwen3_instruct_2507": None,
    "qwen3_vl": None,
    "qwen3_5_think": "reasoning",
    "qwen3_6": "reasoning",
    # preserve_thinking defaults to true: every reply keeps its reasoning. As text only: after the generation
    # prompt's "<think>\n", an empty reasoning's "\n" is sampled apart and re-tokenized with it ("\n\n"), so
    # ids drift there (as in Qwen3.5/3.6); linear keeps the sampled ids.
    "qwen3_8": None,
    "nemotron_3_nano": "reasoning",
    "nemotron_3_super": "reasoning",
    "nemotron_3_ultra": "reasoning",
    "nemotron_3_5_lightning": "reasoning",
    "glm4moe": "reasoning",
    "gptoss": "reasoning",
    "llama3_1": None,
    "llama3_2": None,
    "deepseek_r1_distill": "always",
    # Reasoning is written back only for the calling turns since the last user message (and, from v5 on, the
    # final answer after them).
    "gemma4": "reasoning",
    "gemma4_v3": "reasoning",
    "gemma4_v4": "reasoning",
    "gemma4_v5": "reasoning",
    "gemma4_v2": "reasoning",  # never written back
    # LFM2.5 writes reasoning back only for the turns since the last user message; LFM2 never.
    "lfm2_v2": "reasoning",
    "lfm2_2_5": "reasoning",
    "lfm2_2_5_v2": "reasoning",
    "lfm2_2_5_vl": "reasoning",
    "muse_glimmer": None,  # every reply is written back as sampled, its reasoning included
    "deepseekv3": "always",
    "gemma3": None,
    "phi3": None,
    "phi3_5": None,
    "cohere": None,
    "cohere2": None,
    "llama3": None,
    "qwen2_5_vl": None,
}
FAMILY_KEYS = sorted(FAMILIES)
WORDS = ["alpha", "bravo", "café", "東京", "naïve", "x=1;", "{a}", "<b>", "delta", "42"]
PROPERTY = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Kit:
    """One family's renderer and parser, and what its template can express."""

    key: str
    family: Family
    renderer: Renderer
    parser: ResponseParser
    markers: tuple[str, ...]
    tools: list[dict[str, Any]] | None
    thinking_kwarg: bool  # the template reads enable_thinking
    reasoning: bool  # the format has a reasoning block

    def encode(self, text: str) -> list[int]:
        return list(self.renderer.encode(text))

    def render(self, messages: list[dict[str, Any]], kwargs: dict[str, Any], gen: bool = True) -> str:
        return self.renderer.render_text(messages, self.tools, template_kwargs=kwargs, add_generation_prompt=gen)


_KITS: dict[str, Kit] = {}


def make_kit(key: str) -> Kit:
    if key not in _KITS:
        family = FAMILIES[key]
        # families with the same vocabulary and added tokens share one backend, and so its built twins
        tokenizer = family_tokenizer(key)
        parser = detect_parser(tokenizer)
        fmt = parser.format  # type: ignore[attr-defined]
        _KITS[key] = Kit(
            key,
            family,
            Renderer(tokenizer),
            parser,
            fmt.end_markers,
            TOOLS if family.tools else None,
            "enable_thinking" in tokenizer.chat_template,
            fmt.reasoning,
        )
    return _KITS[key]


@pytest.fixture(scope="module", params=FAMILY_KEYS)
def kit(request: pytest.FixtureRequest) -> Kit:
    return make_kit(request.param)


# --- conversations ------------------------------------------------------------------------------


class Texts:
    """Message texts drawn from WORDS, each with a serial of its own, so the tests can find each in a render."""

    def __init__(self, data: st.DataObject) -> None:
        self.data = data
        self.serial = itertools.count()

    def __call__(self) -> str:
        words = self.data.draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=4))
        sep = self.data.draw(st.sampled_from([" ", "\n"]))
        return sep.join(words) + f" #{next(self.serial)}"


def draw_reply(
    kit: Kit, data: st.DataObject, text: Texts, calls_allowed: bool = True, thinking: bool = True
) -> dict[str, Any]:
    """A canonical reply the family can express: reasoning (maybe empty), text, calls (parallel where allowed)."""
    reply: dict[str, Any] = {"role": "assistant", "content": ""}
    if kit.reasoning and thinking:
        reasoning = data.draw(st.sampled_from(["", "text", "text", "text"]))
        reply["reasoning"] = text() if reasoning else ""
    ncalls = 0
    if kit.tools and calls_allowed:
        ncalls = data.draw(st.integers(0, 2 if kit.family.parallel else 1))
    if ncalls:
        reply["tool_calls"] = [
            {"name": "get_weather", "arguments": {"city": text(), "days": data.draw(st.integers(0, 9))}}
            if data.draw(st.booleans())
            else {"name": "search", "arguments": {"query": text()}}
            for _ in range(ncalls)
        ]
        # harmony refuses content next to reasoning in a call; Llama and Muse Glimmer write only the calls;
        # Gemma 4 writes text after the call's results, so its model does too
        if kit.family.format_name not in ("gpt_oss", "llama3_json", "gemma4", "muse_glimmer") and data.draw(
            st.booleans()
        ):
            reply["content"] = text()
    else:
        reply["content"] = text()
    return reply


def draw_new(kit: Kit, data: st.DataObject, text: Texts, reply: dict[str, Any]) -> list[dict[str, Any]]:
    """What an agent sends after a reply: one result per call (then maybe a user message), else a user message."""
    calls = reply.get("tool_calls") or []
    new: list[dict[str, Any]] = [{"role": "tool", "name": c["name"], "content": text()} for c in calls]
    if not calls or data.draw(st.integers(0, 3)) == 0:
        new.append({"role": "user", "content": text()})
    return new


# --- what a model samples -----------------------------------------------------------------------


def template_sample(
    kit: Kit, messages: list[dict[str, Any]], reply: dict[str, Any], new: list[dict[str, Any]], kwargs: dict[str, Any]
) -> str | None:
    """The template's own rendering of the reply after the generation prompt, up to and including its end token.

    GLM writes no end token after a reply: its model stops on the token that opens what follows. None
    where the template's reply does not follow its own generation prompt (DeepSeek drops the reasoning
    its prompt opens).
    """
    prompt = kit.render(messages, kwargs)
    rendered = kit.render([*messages, reply], kwargs, gen=False)
    if not rendered.startswith(prompt):
        return None
    body = rendered[len(prompt) :]
    hits = [(i, m) for m in kit.markers if (i := body.find(m)) >= 0]
    if hits:
        at, marker = min(hits)
        return body[: at + len(marker)]
    # what follows, rendered after the reply without reasoning, so the reply renders the same either way
    plain = [messages[0], {**reply, "reasoning": None}]
    following = kit.render([*plain, *new], kwargs)[len(kit.render(plain, kwargs, gen=False)) :]
    opener = next((m for m in kit.markers if following.startswith(m)), None)
    assert opener is not None, f"{kit.key}: no end token after the reply: {following[:40]!r}"
    return body + opener


def writer_sample(kit: Kit, reply: dict[str, Any]) -> str:
    """The family's fake-engine writer for the reply's reasoning, calls and text, with its stop token."""
    writer = WRITERS[kit.family.writer]
    calls = reply.get("tool_calls") or []
    plan = {"reasoning": reply.get("reasoning") or "", "calls": calls, "text": reply["content"]}
    stop = writer.stops[-1] if calls and len(writer.stops) > 1 else writer.stops[0]
    return writer.write(plan) + stop


# --- the episode --------------------------------------------------------------------------------


@dataclass
class Turn:
    """One turn of a linear episode: what was sampled, its tail, and how the tree prompt moved."""

    output: str
    tail: LinearTail
    tree_extends: bool  # the next tree prompt extends this turn's tree prompt + output (ids)
    text_extends: bool  # ... as text (ids may still differ where BPE merges across the prompt's end)
    cut: bool  # the output was cut by a length limit


@dataclass
class Episode:
    """A linear episode as `run_episode` left it."""

    messages: list[dict[str, Any]]
    held: list[int]  # the linear prompt's ids
    turns: list[Turn]
    first_text: str  # the first prompt's text
    refusal: TailRefusal | None  # the last turn got no tail


def run_episode(
    kit: Kit, data: st.DataObject, source: str, kwargs: dict[str, Any], turns: int, cut: bool = False
) -> Episode:
    """Linear and tree prompts side by side, up to the last turn or the first refusal."""
    text = Texts(data)
    messages: list[dict[str, Any]] = []
    if data.draw(st.booleans()):
        messages.append({"role": "system", "content": text()})
    messages.append({"role": "user", "content": text()})
    first = kit.renderer.render(messages, kit.tools, template_kwargs=kwargs)
    held, tree, tree_text = list(first.prompt_ids), list(first.prompt_ids), first.text
    done: list[Turn] = []
    heads = HeadRenders()  # kept across the episode's turns, as a worker keeps them per session
    for n in range(turns):
        last_cut = cut and n + 1 == turns
        thinking = kwargs.get("enable_thinking") is not False  # a model told not to think writes no reasoning
        planned = draw_reply(
            kit, data, text, calls_allowed=n + 1 < turns or data.draw(st.booleans()), thinking=thinking
        )
        new = draw_new(kit, data, text, planned)
        sample = template_sample(kit, messages, planned, new, kwargs) if source == "template" else None
        assert sample is not None or thinking, f"{kit.key}: no sample of its own with {kwargs}"
        if sample is None:
            sample = writer_sample(kit, planned)
            output_ids = kit.encode(sample)
            if last_cut:
                # anywhere before its stop token, but not just after an end marker the reply writes before it
                # (Command R7B's <|END_RESPONSE|>): that reply is complete
                markers = set(kit.renderer.tokenizer.convert_tokens_to_ids(list(kit.markers)))
                cuts = [k for k in range(1, len(output_ids)) if output_ids[k - 1] not in markers]
                output_ids = output_ids[: data.draw(st.sampled_from(cuts))]
            reply = kit.parser.parse(output_ids, held, kit.tools).canonical_message()
            if last_cut:
                # what follows a cut reply: a user message (its calls, if any, were never made)
                new = [{"role": "user", "content": text()}]
        else:
            reply, output_ids = planned, kit.encode(sample)
        output = kit.renderer.tokenizer.decode(
            output_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        found = linear_tail(
            kit.renderer,
            messages,
            reply,
            output_ids,
            new,
            end_markers=kit.markers,
            tools=kit.tools,
            template_kwargs=kwargs,
            heads=(heads, "episode"),
        )
        messages = [*messages, reply, *new]
        if isinstance(found, TailRefusal):
            return Episode(messages, held, done, first.text, found)
        full = kit.renderer.render(messages, kit.tools, template_kwargs=kwargs)
        extends = list(full.prompt_ids[: len(tree) + len(output_ids)]) == tree + output_ids
        held = held + output_ids + list(found.ids)
        done.append(Turn(output, found, extends, full.text.startswith(tree_text + output), last_cut))
        tree, tree_text = list(full.prompt_ids), full.text
        check_tail(kit, found, output, new, full.text, full.prompt_ids)
        if all(t.tree_extends for t in done):
            # prefix-preserving so far: the linear prompt is the tree prompt, id for id
            assert held == tree, f"{kit.key}: linear != tree on a prefix-preserving episode"
            assert found.verbatim
    return Episode(messages, held, done, first.text, None)


def check_tail(
    kit: Kit, found: LinearTail, output: str, new: list[dict[str, Any]], full_text: str, full_ids: Any
) -> None:
    """The stand-in's tail is the full render's: its suffix, right after the reply's end token, holding `new`."""
    assert list(full_ids[len(full_ids) - len(found.ids) :]) == list(found.ids), f"{kit.key}: not the full render's"
    assert full_text.endswith(found.text)
    before = full_text[: len(full_text) - len(found.text)]
    stop = next((m for m in kit.markers if output.endswith(m)), None)
    if stop is not None:
        assert before.endswith(STOP_EQUIVALENTS.get(stop, stop)), f"{kit.key}: tail not right after the reply"
    elif not found.verbatim:
        # a cut reply the template rewrites: the tail closes it, from the end token the output lacks or the
        # one the template writes for it (a cut the template renders as sampled is continued by whatever it
        # renders next, its closing included)
        closings = (*kit.markers, *(STOP_EQUIVALENTS[m] for m in kit.markers if m in STOP_EQUIVALENTS))
        assert any(found.text.startswith(m) for m in closings), f"{kit.key}: cut tail {found.text[:30]!r}"
    at = 0
    for message in new:
        # as written, or as a JSON string (harmony and Llama write tool results with tojson)
        written = [
            found.text.find(form, at)
            for form in (message["content"], json.dumps(message["content"], ensure_ascii=False)[1:-1])
        ]
        at = max(written)
        assert at >= 0, f"{kit.key}: the tail lacks {message['content']!r}"
    # and no text of the reply or of earlier messages (each text ends with a serial of its own)
    serials = {serial for message in new for serial in re.findall(r"#(\d+)", message["content"])}
    assert set(re.findall(r"#(\d+)", found.text)) == serials, f"{kit.key}: the tail holds other texts: {found.text!r}"


def reasoning_free(text: str) -> str:
    """A reply's text without its reasoning, as the templates that drop it write it (whitespace aside)."""
    text = re.sub(r"<think>.*?</think>|<\|channel>thought\n.*?<channel\|>", "", text, flags=re.S)
    text = re.sub(r"<\|channel\|>analysis<\|message\|>.*?<\|end\|><\|start\|>assistant", "", text, flags=re.S)
    # an analysis cut short, which harmony writes as an empty final answer
    text = re.sub(
        r"<\|channel\|>analysis<\|message\|>(?:(?!<\|end\|>).)*$", "<|channel|>final<|message|>", text, flags=re.S
    )
    # Gemma 4 drops any thought channel from the content it writes back, one cut short included
    text = re.sub(r"<\|channel>(?:(?!<channel\|>).)*$", "", text, flags=re.S)
    return re.sub(r"\s+", "", text.replace("<|return|>", "<|end|>"))


def check_difference(kit: Kit, episode: Episode, full_text: str, kwargs: dict[str, Any]) -> None:
    """The full render is the linear prompt with each earlier reply rewritten as REWRITES documents."""
    probe = [{"role": "user", "content": "x"}]
    head, prompted = head_texts(kit.renderer, probe, kit.tools, kwargs)
    gen = prompted[len(head) :]
    resumes = tuple(kit.parser.format.resume_markers)  # type: ignore[attr-defined]
    first_text, turns = episode.first_text, episode.turns
    assert first_text.endswith(gen) and all(t.tail.text.endswith((gen, *resumes)) for t in turns)
    # every tail but the last ends with the generation prompt, which the full render replaces by its own
    # rendering of the reply's header, or with a resume marker (the model turn goes on after tool results):
    # the reply regions are what lies between the tails
    at = len(first_text) - len(gen)
    header = gen
    assert full_text.startswith(first_text[:at])
    for i, turn in enumerate(turns):
        last = i + 1 == len(turns)
        opens = "" if turn.tail.text.endswith(resumes or ("\x00",)) else gen  # the next reply's header
        piece = turn.tail.text if last else turn.tail.text[: len(turn.tail.text) - len(opens)]
        end = len(full_text) - len(piece) if last else full_text.find(piece, at)
        assert end >= at and full_text[end : end + len(piece)] == piece, f"{kit.key}: tail {i} not in the full render"
        rerendered, sampled = full_text[at:end], header + turn.output
        header = opens
        if rerendered != sampled:
            documented = REWRITES[kit.key] is not None or turn.cut
            assert documented, f"{kit.key}: reply {i} rewritten: {rerendered!r} vs {sampled!r}"
            rewritten = reasoning_free(rerendered) == reasoning_free(sampled)
            raw = turn.cut and "".join(turn.output.split()) in "".join(rerendered.split())
            assert rewritten or raw, f"{kit.key}: reply {i}: {rerendered!r} vs {sampled!r}"
        at = end + len(piece)
    assert at == len(full_text)


# --- properties ---------------------------------------------------------------------------------


@PROPERTY
@given(data=st.data())
def test_linear_prompt_is_the_full_render_where_the_template_is_prefix_preserving(kit, data):
    source = data.draw(st.sampled_from(["template", "writer"]))
    kwargs: dict[str, Any] = {}
    if source == "template" and kit.thinking_kwarg and data.draw(st.booleans()):
        kwargs = {"enable_thinking": False}
    episode = run_episode(kit, data, source, kwargs, turns=data.draw(st.integers(1, 4)))
    assert episode.refusal is None, episode.refusal
    full = kit.renderer.render(episode.messages, kit.tools, template_kwargs=kwargs)
    if REWRITES[kit.key] is None:
        assert all(t.text_extends for t in episode.turns), f"{kit.key} is documented as prefix-preserving"
        if all(t.tree_extends for t in episode.turns):
            assert episode.held == list(full.prompt_ids)
    check_difference(kit, episode, full.text, kwargs)


@PROPERTY
@given(data=st.data())
def test_tool_loops_are_prefix_preserving_until_a_user_follow_up(kit, data):
    """Without a user message after the first and with reasoning in every reply, only DeepSeek rewrites."""
    text = Texts(data)
    messages: list[dict[str, Any]] = [{"role": "user", "content": text()}]
    first = kit.renderer.render(messages, kit.tools)
    held = list(first.prompt_ids)
    for _ in range(data.draw(st.integers(1, 3))):
        reply = draw_reply(kit, data, text)
        if kit.reasoning:
            reply["reasoning"] = text()
        if not reply.get("tool_calls"):
            break
        new = [{"role": "tool", "name": c["name"], "content": text()} for c in reply["tool_calls"]]
        sample = template_sample(kit, messages, reply, new, {}) or writer_sample(kit, reply)
        output_ids = kit.encode(sample)
        found = linear_tail(kit.renderer, messages, reply, output_ids, new, end_markers=kit.markers, tools=kit.tools)
        assert isinstance(found, LinearTail), found
        messages = [*messages, reply, *new]
        held = held + output_ids + list(found.ids)
        full = list(kit.renderer.render(messages, kit.tools).prompt_ids)
        if REWRITES[kit.key] != "always":
            assert held == full, f"{kit.key}: a tool loop drifted"


@PROPERTY
@given(data=st.data())
def test_length_cut_outputs_get_their_closing_in_the_tail(kit, data):
    """The last reply is cut by a length limit: its tail adds the end token it lacks, or the tail is refused."""
    turns = data.draw(st.integers(1, 3))
    episode = run_episode(kit, data, "writer", {}, turns=turns, cut=True)
    if episode.refusal is not None:
        assert len(episode.turns) == turns - 1, episode.refusal
        if kit.key == "muse_glimmer":
            # a reply cut inside its first header (" to"): handed back raw, it is written as a text message
            # whose own header starts the same way, so the tail would start inside text
            assert episode.refusal.reason == "boundary_in_text", episode.refusal
            return
        # only on the cut turn, and otherwise only harmony's: the template refuses a reply the parser handed back raw
        # (channel tags in content), or writes a reply cut in its analysis as an empty final answer, which
        # leaves nothing of the output to check the anchor against
        assert kit.key == "gptoss", episode.refusal
        assert episode.refusal.reason in ("render_refused", "marker_in_reply"), episode.refusal
        return
    full = kit.renderer.render(episode.messages, kit.tools)
    assert not any(episode.turns[-1].output.endswith(m) for m in kit.markers)  # cut before its stop token
    if all(t.tree_extends for t in episode.turns):
        assert episode.held == list(full.prompt_ids)
    check_difference(kit, episode, full.text, {})


# --- examples -----------------------------------------------------------------------------------

HI = [{"role": "user", "content": "Hi"}]


def tail(
    kit: Kit, reply: dict[str, Any], output: str, new: list[dict[str, Any]], messages: Any = HI, with_tools: bool = True
) -> Any:
    """linear_tail of one example: `output` is the sampled text, encoded by the family's tokenizer."""
    tools = kit.tools if with_tools else None
    return linear_tail(kit.renderer, messages, reply, kit.encode(output), new, end_markers=kit.markers, tools=tools)


def test_qwen3_closing_newline_and_cut_closing():
    kit = make_kit("qwen3")
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    reply = {
        "role": "assistant",
        "content": "",
        "reasoning": "One call.",
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}],
    }
    new = [{"role": "tool", "name": "get_weather", "content": "sunny"}]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    sample = "<think>\nOne call.\n</think>\n\n" + call
    stopped = tail(kit, reply, sample + "<|im_end|>", new, messages)
    assert isinstance(stopped, LinearTail) and stopped.verbatim
    assert (
        stopped.text
        == "\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    go_on = [{"role": "user", "content": "go on"}]
    cut = tail(kit, {"role": "assistant", "content": "The weath"}, "<think>\nOne call.\n</think>\n\nThe weath", go_on,
               messages)  # fmt: skip
    assert isinstance(cut, LinearTail) and not cut.verbatim  # the template drops the reasoning: anchored
    assert cut.text == "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"
    # a reply of reasoning alone, which the template drops whole: it writes only the header, then <|im_end|>
    thought = {"role": "assistant", "content": "", "reasoning": "Hmm."}
    alone = tail(kit, thought, "<think>\nHmm.\n</think>\n\n<|im_end|>", go_on, messages)
    assert isinstance(alone, LinearTail) and not alone.verbatim
    assert alone.text == "\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"


def test_harmony_final_answers_stopped_and_cut():
    kit = make_kit("gptoss")
    reply = {"role": "assistant", "content": "Hello!", "reasoning": "Greet."}
    output = "<|channel|>analysis<|message|>Greet.<|end|><|start|>assistant<|channel|>final<|message|>Hello!<|return|>"
    bye = [{"role": "user", "content": "Bye"}]
    found = tail(kit, reply, output, bye, with_tools=False)
    assert isinstance(found, LinearTail) and not found.verbatim
    assert found.text == "<|start|>user<|message|>Bye<|end|><|start|>assistant"
    # cut in the final answer: closed with the <|end|> the template writes for a final answer in history
    cut = tail(kit, {**reply, "content": "Hel"}, output[: output.index("lo!")], bye, with_tools=False)
    assert isinstance(cut, LinearTail) and cut.text == "<|end|><|start|>user<|message|>Bye<|end|><|start|>assistant"
    # cut in the analysis: the template writes an empty final answer instead, so the anchor cannot be checked
    analysis = "<|channel|>analysis<|message|>Gre"
    cut = tail(kit, {"role": "assistant", "content": "", "reasoning": "Gre"}, analysis, bye, with_tools=False)
    assert isinstance(cut, TailRefusal) and cut.reason == "marker_in_reply"


def test_refusals():
    qwen3, glm, muse = make_kit("qwen3"), make_kit("glm4moe"), make_kit("muse_glimmer")
    user = HI
    reply = {"role": "assistant", "content": "Hello."}
    assert tail(qwen3, reply, "Hello.<|im_end|>", []).reason == "no_new_messages"
    assert tail(qwen3, {"role": "user", "content": "x"}, "x", user).reason == "not_a_reply"
    assert tail(qwen3, reply, "Hello.<|im_end|>", [{"role": "robot", "content": "x"}]).reason == "render_refused"
    # Muse Glimmer's template writes a default system header only while no system message exists: a new one
    # rewrites the head, so it cannot be a tail
    got = tail(muse, reply, " to=user<|message|>Hello.<|eot|>", [{"role": "system", "content": "New."}],
               with_tools=False)
    assert got.reason == "head_rerendered"
    # a stop token the template never writes after a reply
    got = tail(qwen3, {**reply, "reasoning": "r"}, "<think>\nr\n</think>\n\nHello.<|endoftext|>", user)
    assert got.reason == "stop_mismatch"
    # GLM's model said the user speaks next, but a tool result follows (the template opens it with <|observation|>)
    call = {
        "role": "assistant",
        "content": "",
        "reasoning": "r",
        "tool_calls": [{"name": "search", "arguments": {"query": "q"}}],
    }
    glm_out = "\n<think>r</think>\n<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>q</arg_value>\n</tool_call>"
    got = tail(glm, call, glm_out + "<|user|>", [{"role": "tool", "name": "search", "content": "r"}])
    assert got.reason == "stop_mismatch"
    ok = tail(glm, call, glm_out + "<|observation|>", [{"role": "tool", "name": "search", "content": "r"}])
    assert isinstance(ok, LinearTail) and ok.text.startswith("\n<tool_response>")
    # the anchor would be an end marker written inside the reply's own text
    tricky = {"role": "assistant", "content": "say <|im_end|> twice", "reasoning": "r"}
    got = tail(qwen3, tricky, "<think>\nr\n</think>\n\nsay <|im_end|> twice<|im_end|>", user)
    assert got.reason == "marker_in_reply"


def test_a_tail_inside_text_is_refused(tmp_path: Path):
    """A template that closes a reply with plain text: a cut output leaves the tail starting mid-text."""
    template = tmp_path / "plain.jinja"
    template.write_text(
        "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '\\n###\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    renderer = Renderer(load_tokenizer(None, chat_template_path=str(template)))
    cut = renderer.encode("Hello the")
    got = linear_tail(
        renderer,
        [{"role": "user", "content": "Hi"}],
        {"role": "assistant", "content": "Hello the"},
        cut,
        [{"role": "user", "content": "and?"}],
        end_markers=("<|im_end|>",),
    )
    assert isinstance(got, TailRefusal) and got.reason == "boundary_in_text"


# --- cost ---------------------------------------------------------------------------------------


class Counting(Renderer):
    """A renderer that counts the characters it renders and tokenizes."""

    rendered = tokenized = messages = 0

    def render_text(self, messages: Any, tools: Any = None, **kwargs: Any) -> str:
        text = super().render_text(messages, tools, **kwargs)
        self.rendered += len(text)
        self.messages += len(messages)
        return text

    def encode_prompt(self, text: str, budget: int | None = None, session: str | None = None) -> Any:
        self.tokenized += len(text)
        return super().encode_prompt(text, budget, session)


@pytest.mark.parametrize("key", ["qwen3", "gptoss", "llama3_1", "glm4moe"])
def test_cost_does_not_grow_with_the_history(key):
    kit = make_kit(key)
    renderer = Counting(kit.renderer.tokenizer)
    reply = {
        "role": "assistant",
        "content": "",
        "reasoning": "Look it up.",
        "tool_calls": [{"name": "search", "arguments": {"query": "news"}}],
    }
    new = [{"role": "tool", "name": "search", "content": "Nothing new."}, {"role": "user", "content": "Thanks."}]
    sample = template_sample(kit, [{"role": "user", "content": "Go."}], reply, new, {})
    assert sample is not None
    counts = []
    for turns in (2, 100):
        history: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Go."}]
        for n in range(turns - 1):
            history += [
                {**reply, "tool_calls": [{"name": "search", "arguments": {"query": f"q{n}" * 50}}]},
                {"role": "tool", "name": "search", "content": f"result {n} " * 100},
            ]
        renderer.rendered = renderer.tokenized = renderer.messages = 0
        found = linear_tail(renderer, history, reply, kit.encode(sample), new, end_markers=kit.markers, tools=kit.tools)
        assert isinstance(found, LinearTail), found
        counts.append((renderer.rendered, renderer.tokenized, renderer.messages))
    assert counts[0] == counts[1], counts


def test_the_head_renders_are_reused_while_the_head_and_tools_are_the_same():
    kit = make_kit("qwen3")
    renderer = Counting(kit.renderer.tokenizer)
    heads = HeadRenders(max_sessions=1)
    history: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Go."}]
    reply = {"role": "assistant", "content": "", "tool_calls": [{"name": "search", "arguments": {"query": "news"}}]}
    sample = '<tool_call>\n{"name": "search", "arguments": {"query": "news"}}\n</tool_call><|im_end|>'

    def place(session: str, tools: Any = kit.tools) -> list[int]:
        """The tail of the next tool turn, and how many messages the template rendered for it."""
        new = [{"role": "tool", "name": "search", "content": f"result {len(history)}"}]
        renderer.messages = 0
        found = linear_tail(renderer, history, reply, kit.encode(sample), new, end_markers=kit.markers, tools=tools,
                            heads=(heads, session))  # fmt: skip
        assert isinstance(found, LinearTail), found
        uncached = linear_tail(kit.renderer, history, reply, kit.encode(sample), new, end_markers=kit.markers,
                               tools=tools)  # fmt: skip
        assert uncached == found
        history.extend([reply, *new])
        return renderer.messages

    stand_in_size = len(stand_in(history))  # system + task: the same for every later tool turn
    whole = stand_in_size + 2  # the one render of the stand-in with the reply and the tool result
    assert place("a") == 2 * stand_in_size + whole  # first time: the head twice, then the whole
    assert place("a") == whole
    renamed = {**kit.tools[0], "function": {**kit.tools[0]["function"], "name": "x"}}
    assert place("a", tools=[*kit.tools, renamed]) > whole
    assert place("a") > whole  # the tools changed back: rendered again
    assert place("b") > whole and len(heads) == 1  # one session kept: "a" made room
    assert place("b") == whole
    heads.forget(["b"])
    assert len(heads) == 0 and place("b") > whole
    # the same tools with their keys in another order compare equal but render otherwise: rendered again,
    # not refused
    reordered = [{"function": dict(reversed(list(t["function"].items()))), "type": t["type"]} for t in kit.tools]
    assert reordered == kit.tools
    assert place("b", tools=reordered) > whole


def test_the_stand_in_keeps_the_last_user_query():
    """Qwen3.5 refuses a conversation without a user query: one that opens with an assistant greeting still has a
    tail, because the stand-in keeps the last user message (and only it, after the system message: templates
    that enforce alternation refuse two user messages in a row)."""
    history = [{"role": "system", "content": "s"}, *[{"role": "user", "content": str(i)} for i in range(9)]]
    assert stand_in(history) == [history[0], history[-1]]
    tool_loop = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "x"},
        {"role": "tool", "content": "r"},
    ]
    assert stand_in(tool_loop) == [tool_loop[0]]
    assert stand_in([{"role": "assistant", "content": "Hi."}]) == [{"role": "assistant", "content": "Hi."}]
    kit = make_kit("qwen3_5_think")
    greeted = [
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": "Ask away."},
        {"role": "user", "content": "Weather?"},
    ]
    reply = {"role": "assistant", "content": "Sunny.", "reasoning": "Easy."}
    new = [{"role": "user", "content": "Thanks."}]
    sample = template_sample(kit, greeted, reply, new, {})
    assert sample is not None
    found = linear_tail(kit.renderer, greeted, reply, kit.encode(sample), new, end_markers=kit.markers, tools=kit.tools)
    assert isinstance(found, LinearTail), found
    assert kit.renderer.render([*greeted, reply, *new], kit.tools).text.endswith(found.text)
