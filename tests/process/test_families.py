"""One multi-turn tool episode per model family through `rollout-gateway serve`, and the operator's format controls.

Per family: the family's test tokenizer carrying its real template (trl's copy), the fake engine
writing that family's reply syntax (`--format`), one gateway with two workers, the official openai
SDK as agent (one plain and one streaming session). Checked: every call the engine emitted reached
the agent with its arguments typed, the echoes extend the row (one row where the template
re-renders replies exactly), and every sampled token is trained once (`assert_fidelity`). Then the
same agent in a linear session, stripping its replies' reasoning and a connection per request (its
turns spread over both workers), in the chat, messages and responses dialects (the anthropic SDK for
messages): one row each, each prompt the ids the engine saw + a tail. Then:
an unknown template refuses to start, `--response-format` overrides detection, and
`--allow-plain-text` serves text but answers requests with tools with a 400.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import random
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from assets import FAKE_ENGINE_START_TIMEOUT_S, TOOLS, FakeEngine
from dialects import ANTHROPIC_TOOLS, RESPONSES_TOOLS, SYSTEM, tool_output
from fake_formats import FAMILIES, WRITERS, family_tokenizer_dir, plan, read_prompt, template_path
from fidelity import assert_fidelity
from processes import TestProcess, launch_gateway
from scrapes import worker_snapshots

from broker.protocol import ids_array, logprobs_array
from broker.sessions.turn_record import TurnRecord
from gateway_workers.engines.routing import routing_key
from gateway_workers.formats import FORMATS

FAKE_ENGINE = Path(__file__).resolve().parents[1] / "fake_engine.py"
MAX_TURNS = 5
TOOL_ROUNDS = 3  # results before the answer: 2 parallel calls, then 1 or 2
REFUSAL_TIMEOUT_S = 60.0
# One template per response format (qwen3 runs in test_serve_openai.py): the cheapest set that covers all.
E2E_FAMILIES = [
    "qwen3_instruct_2507",
    "qwen3_6",
    "nemotron_3_nano",
    "glm4moe",
    "gptoss",
    "llama3_2",
    "deepseek_r1_distill",
    "gemma4_v5",
    "lfm2_2_5_v2",
    "muse_glimmer",
    # templates without tools: a two-question chat each
    "gemma3",
    "phi3_5",
    "cohere",
    "cohere2",
    "llama3",
    "qwen2_5_vl",
]


class FamilyEngine(FakeEngine):
    """The fake engine process writing one family's syntax (`tests/fake_engine.py --format`)."""

    def __init__(self, tokenizer_dir: str, writer: str) -> None:  # the same controls as FakeEngine
        self.process = TestProcess(
            [
                sys.executable,
                "-u",
                str(FAKE_ENGINE),
                "--port",
                "0",
                "--tokenizer",
                tokenizer_dir,
                "--tool-rounds",
                str(TOOL_ROUNDS),
                "--format",
                writer,
            ],
            name=f"fake_engine[{writer}]",
        ).start()
        try:
            self.url = self.process.expect(r"FAKE ENGINE READY (\S+)", FAKE_ENGINE_START_TIMEOUT_S).group(1)
        except BaseException:
            self.process.stop()
            raise


def _policy(tokenizer_dir: str, writer: str) -> Any:
    """The fake engine's own reply function for this family, to recompute what it sampled."""
    from tokenizers import Tokenizer

    spec = importlib.util.spec_from_file_location("fake_engine_families", FAKE_ENGINE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    state = module.State(
        tokenizer=tok, eos_id=tok.token_to_id(WRITERS[writer].stops[0]), tool_rounds=TOOL_ROUNDS, format=writer
    )
    return tok, lambda prompt, max_tokens: module.reply(state, prompt, max_tokens)


def _engine_turns(engine: FakeEngine, sid: str, policy: Any) -> tuple[list[TurnRecord], list[list[int]]]:
    """What the engine sampled for one session, in request order, and the prompts it saw."""
    turns, prompts = [], []
    for i, req in enumerate(engine.log(routing_key(sid))["requests"]):
        body = req["body"]
        prompt = body.get("token_ids") or body.get("input_ids")
        params = body["sampling_params"]
        ids, lps, finish = policy(prompt, int(params.get("max_tokens", params.get("max_new_tokens", 16))))
        prompts.append(prompt)
        turns.append(
            TurnRecord(
                turn_id=f"t{i}",
                seq=i,
                prompt_ids=ids_array(prompt),
                output_ids=ids_array(ids),
                logprobs=logprobs_array(lps),
                finish_reason=finish,
                prompt_messages=[],
                response_message={},
            )
        )
    return turns, prompts


def _expected_calls(tok: Any, writer: str, prompt: list[int]) -> list[dict[str, Any]]:
    """The calls the fake model wrote for this prompt (its plan draws no random numbers for calls)."""
    text = tok.decode(prompt, skip_special_tokens=False)
    digest = hashlib.sha256(json.dumps(prompt).encode()).digest()
    w = WRITERS[writer]
    return plan(read_prompt(text, w.layout, w.tools), random.Random(digest), digest, TOOL_ROUNDS, w.parallel)["calls"]


def _run_agent(
    client: openai.OpenAI,
    tools: list[dict[str, Any]] | None,
    stream: bool,
    *,
    echo_reasoning: bool = True,
    system: str = "You are a careful weather agent.",
    question: str = "What is the weather in Paris?",
    between: Callable[[], None] | None = None,
) -> list[Any]:
    """A tool loop as agents write it: echo the reply (with its reasoning, unless not `echo_reasoning`), answer
    every call in order; `between` runs after the first reply."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    received = []
    for turn in range(MAX_TURNS):
        extra: dict[str, Any] = {"tools": tools} if tools else {}
        if stream:
            with client.chat.completions.stream(model="m", messages=messages, **extra) as s:
                message = s.get_final_completion().choices[0].message
        else:
            message = client.chat.completions.create(model="m", messages=messages, **extra).choices[0].message
        received.append(message)
        if between is not None and turn == 0:
            between()
        echo: dict[str, Any] = {"role": "assistant", "content": message.content or ""}
        if echo_reasoning and getattr(message, "reasoning_content", None):
            echo["reasoning_content"] = message.reasoning_content
        if message.tool_calls:
            echo["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in message.tool_calls
            ]
        messages.append(echo)
        for call in message.tool_calls or []:
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call.id,
                    "content": json.dumps({"ok": True, **json.loads(call.function.arguments)}),
                }
            )
        if not message.tool_calls:
            if tools or turn:  # a tool episode ends on the answer; a chat runs two user turns
                break
            messages.append({"role": "user", "content": "And tomorrow?"})
    return received


@contextlib.contextmanager
def serve_family(
    key: str, engine_kind: str, workers: int = 1, extra: Sequence[str] = ()
) -> Iterator[tuple[Any, FakeEngine, str]]:
    """`serve` with the family's tokenizer in front of the fake engine writing its syntax: (gateway, engine, dir)."""
    tokenizer_dir = family_tokenizer_dir(key)
    with FamilyEngine(tokenizer_dir, FAMILIES[key].writer) as engine:
        with launch_gateway(
            workers=workers,
            engine_kind=engine_kind,
            engine_urls=[engine.url],
            tokenizer=tokenizer_dir,
            extra_args=["--log-level", "warning", "--engine-timeout", "20", *extra],
        ) as gw:
            yield gw, engine, tokenizer_dir


@pytest.fixture(params=E2E_FAMILIES)
def family_gateway(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any, FakeEngine, str]]:
    key = request.param
    engine_kind = "sglang" if E2E_FAMILIES.index(key) % 2 else "vllm"  # both wire formats
    with serve_family(key, engine_kind, workers=2) as (gw, engine, tokenizer_dir):
        yield key, gw, engine, tokenizer_dir


def test_tool_episode_per_family(family_gateway: tuple[str, Any, FakeEngine, str]) -> None:
    key, gw, engine, tokenizer_dir = family_gateway
    family = FAMILIES[key]
    tok, policy = _policy(tokenizer_dir, family.writer)
    tools = TOOLS if family.tools else None
    for stream in (False, True):
        sid = gw.client.open_session(sampling_defaults={"temperature": 1.0})
        agent = openai.OpenAI(base_url=gw.base_url, api_key=sid, max_retries=2, timeout=60)
        received = _run_agent(agent, tools, stream)
        records = gw.client.finish_session(sid, reward=1.0, wait_timeout=10.0)
        turns, prompts = _engine_turns(engine, sid, policy)
        assert len(turns) == len(received)
        assert_fidelity(turns, records)
        for message, prompt in zip(received, prompts, strict=True):
            expected = _expected_calls(tok, family.writer, prompt)
            got = [
                {"name": c.function.name, "arguments": json.loads(c.function.arguments)}
                for c in message.tool_calls or []
            ]
            assert got == expected, (key, stream, message)  # every call, in order, arguments typed
            assert len({c.id for c in message.tool_calls or []}) == len(got)
            if FORMATS[family.format_name].reasoning:
                assert message.reasoning_content, (key, message)
        if tools:
            assert received[-1].content.startswith("Final answer after") and len(received) >= 3
            assert len(received[0].tool_calls) == (2 if family.parallel else 1)
        assert not any(r.metadata["ill_formed"] for r in records)
        if family.format_name == "deepseek_r1":
            # The template re-renders earlier replies without their reasoning: the builder starts new rows.
            assert len(records) == len(turns) and records[1].metadata["row_start"] in ("realign", "fork")
        else:
            assert len(records) == 1, [r.metadata for r in records]  # every echo extended the row exactly
    _linear_episode_is_one_row(gw, key, engine, policy, tools, ("chat", "messages", "responses"))
    fmt = FORMATS[family.format_name]
    if not fmt.supports_tools:
        _tools_are_refused(gw, family.format_name)
    if fmt.supports_tools or fmt.reasoning:  # a text-only reply cut short is just shorter text
        _cut_reply_is_raw_and_flagged(gw, tok, policy, prompts[0], family)


def connection_per_request(gw: Any, sid: str) -> openai.OpenAI:
    """An agent that opens a connection per request, so consecutive turns land on either worker (the SDK's own
    HTTP client, which it closes with itself)."""
    return openai.OpenAI(base_url=gw.base_url, api_key=sid, max_retries=2, timeout=60,
                         default_headers={"Connection": "close"})


def held_counts(gw: Any) -> dict[int, dict[str, float]]:
    """Each worker's linear_held_local / linear_held_fetched / linear_waits counters (its own snapshot)."""
    root = gw.base_url.removesuffix("/v1")
    events = ("held_local", "held_fetched", "waits")
    return {pid: {f"linear_{event}": values.get(f"linear_history:{event}", 0) for event in events}
            for pid, values in worker_snapshots(root, 2).items()}  # fmt: skip


def held_since(before: dict[int, dict[str, float]], after: dict[int, dict[str, float]]) -> dict[str, float]:
    """`held_counts` summed over the workers, `after` less `before`."""
    names = ("linear_held_local", "linear_held_fetched", "linear_waits")
    return {name: sum(w.get(name, 0) for w in after.values()) - sum(w.get(name, 0) for w in before.values())
            for name in names}  # fmt: skip


def assert_held(held: dict[str, float], expected: int) -> None:
    """Every turn after a line's first held its head's ids once (`expected` of them); a request whose head's
    commit was still on its way waited, and may have held an older head first: one more per wait at most."""
    count = held["linear_held_local"] + held["linear_held_fetched"]
    assert expected <= count <= expected + held["linear_waits"], held


def _linear_episode_is_one_row(
    gw: Any, key: str, engine: FakeEngine, policy: Any, tools: Any, dialects: Sequence[str] = ("chat",)
) -> list[Any]:
    """An agent that strips its replies' reasoning (a row per turn in tree mode on thinking templates), in a
    linear session, in each of `dialects` (chat, messages, responses): one row, every sampled token trained
    once right after the ids the engine saw, and each turn's prompt the previous prompt + output + a tail.
    Returns the last session's records."""
    for dialect in dialects:
        before, held_before = gw.client.stats(), held_counts(gw)
        sid = gw.client.open_session(sampling_defaults={"temperature": 1.0}, history_mode="linear")
        if dialect == "chat":
            received = len(_run_agent(connection_per_request(gw, sid), tools, False, echo_reasoning=False))
        else:
            received = dialect_episode(gw, sid, dialect, tools)
        records = gw.client.finish_session(sid, reward=1.0, wait_timeout=10.0)
        turns, prompts = _engine_turns(engine, sid, policy)
        assert len(turns) == received >= 2, (key, dialect)
        assert_fidelity(turns, records)
        assert len(records) == 1, (key, dialect, [r.metadata for r in records])
        assert len(records[0].metadata["turn_ids"]) == len(turns)
        for turn, nxt in zip(turns, prompts[1:], strict=False):  # each prompt extends what the engine saw
            held = list(turn.prompt_ids) + list(turn.output_ids)
            assert nxt[: len(held)] == held, (key, dialect)
        stats = gw.client.stats()
        assert stats["linear_first"] - before["linear_first"] == 1
        assert stats["linear_turns"] - before["linear_turns"] == len(turns) - 1, (key, dialect)
        assert stats["linear_forks"] == before["linear_forks"]
        assert stats["linear_rerenders"] == before["linear_rerenders"]
        assert_held(held_since(held_before, held_counts(gw)), len(turns) - 1)
    return records


def dialect_episode(gw: Any, sid: str, dialect: str, tools: Any, question: str = "What is the weather in Oslo?") -> int:
    """A tool loop (without tools: a two-question chat) in the messages or responses dialect, through the
    official SDK, echoing each reply without its reasoning, a connection per request; returns the replies."""
    received = 0
    if dialect == "messages":
        claude = anthropic.Anthropic(base_url=gw.base_url.removesuffix("/v1"), api_key=sid, max_retries=2,
                                     timeout=60, default_headers={"Connection": "close"})  # fmt: skip
        extra: dict[str, Any] = {"tools": ANTHROPIC_TOOLS} if tools else {}
        messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
        for _ in range(MAX_TURNS):
            message = claude.messages.create(model="m", max_tokens=512, system=SYSTEM, messages=messages, **extra)
            received += 1
            blocks = [b.model_dump(exclude_none=True) for b in message.content if b.type != "thinking"]
            messages.append({"role": "assistant", "content": blocks})
            uses = [b for b in message.content if b.type == "tool_use"]
            if uses:
                messages.append({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": u.id, "content": tool_output(u.name, u.input)} for u in uses
                ]})  # fmt: skip
            elif tools or received > 1:  # a tool episode ends on the answer; a chat runs two user turns
                break
            else:
                messages.append({"role": "user", "content": "And tomorrow?"})
        return received
    client = connection_per_request(gw, sid)
    extra = {"tools": RESPONSES_TOOLS} if tools else {}
    items: list[Any] = [{"role": "user", "content": question}]
    for _ in range(MAX_TURNS):
        response = client.responses.create(model="m", instructions=SYSTEM, input=items, **extra)
        received += 1
        calls = [item for item in response.output if item.type == "function_call"]
        items += [item.model_dump(exclude_none=True) for item in response.output if item.type != "reasoning"]
        if calls:
            items += [{"type": "function_call_output", "call_id": c.call_id,
                       "output": tool_output(c.name, json.loads(c.arguments))} for c in calls]  # fmt: skip
        elif tools or received > 1:
            break
        else:
            items.append({"role": "user", "content": "And tomorrow?"})
    return received


def _tools_are_refused(gw: Any, format_name: str) -> None:
    """A format without tool calls answers a request that declares tools with a 400 naming it; nothing recorded."""
    sid = gw.client.open_session()
    client = openai.OpenAI(base_url=gw.base_url, api_key=sid, max_retries=2, timeout=60)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", tools=TOOLS, messages=[{"role": "user", "content": "Weather?"}])
    assert info.value.body["code"] == "tools_unsupported" and repr(format_name) in info.value.body["message"]
    assert gw.client.finish_session(sid) == []


_CALL_STARTS = {
    "qwen2_5": "<tool_call>",
    "qwen3_5": "<tool_call>",
    "nemotron3": "<tool_call>",
    "glm4_moe": "<tool_call>",
    "gpt_oss": "to=functions",
    "llama3_json": '{"name"',
    "gemma4": "<|tool_call>",
    "lfm2": "<|tool_call_start|>",
}


def _cut_reply_is_raw_and_flagged(gw: Any, tok: Any, policy: Any, prompt: list[int], family: Any) -> None:
    """The first turn again, cut by max_tokens inside its last tool call (or its reasoning, for DeepSeek)."""
    ids, _, _ = policy(prompt, 10_000)
    marker = _CALL_STARTS.get(family.format_name)
    cut = 3
    if marker is not None:
        text = tok.decode(ids, skip_special_tokens=False)
        at = text.rfind(marker)
        cut = next(n for n in range(len(ids)) if len(tok.decode(ids[:n], skip_special_tokens=False)) > at) + 3
    sid = gw.client.open_session()
    client = openai.OpenAI(base_url=gw.base_url, api_key=sid, max_retries=2, timeout=60)
    extra: dict[str, Any] = {"tools": TOOLS} if family.tools else {}
    reply = client.chat.completions.create(
        model="m",
        max_tokens=cut,
        **extra,
        messages=[
            {"role": "system", "content": "You are a careful weather agent."},
            {"role": "user", "content": "What is the weather in Paris?"},
        ],
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls, choice
    assert reply.usage.completion_tokens == cut and choice.message.content  # the raw text, no partial call list
    records = gw.client.finish_session(sid)
    assert len(records) == 1 and records[0].metadata["ill_formed"], records[0].metadata


def _serve_cmd(*extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gateway_workers.cli",
        "serve",
        "--port",
        "0",
        "--control",
        "tcp://127.0.0.1:0",
        "--workers",
        "1",
        "--log-level",
        "warning",
        *extra,
    ]


@pytest.fixture(scope="module")
def unknown_template(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen3's real template plus one comment: renders the same, but no registry entry has its hash."""
    path = tmp_path_factory.mktemp("tpl") / "custom.jinja"
    path.write_text(template_path("qwen3").read_text("utf-8") + "{#- fine-tuned with a house template -#}\n")
    return str(path)


def test_unknown_template_refuses_to_start_before_spawning(unknown_template: str) -> None:
    done = subprocess.run(
        _serve_cmd("--chat-template", unknown_template),
        capture_output=True,
        text=True,
        timeout=REFUSAL_TIMEOUT_S,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode != 0
    assert "unknown chat template (sha256" in done.stderr and "--response-format" in done.stderr, done.stderr
    assert "GATEWAY READY" not in done.stdout and "BROKER READY" not in done.stdout


def test_response_format_overrides_detection(
    unknown_template: str, fake_engine: FakeEngine, qwen3_tokenizer_dir: str
) -> None:
    with launch_gateway(
        workers=1,
        engine_kind="vllm",
        engine_urls=[fake_engine.url],
        tokenizer=qwen3_tokenizer_dir,
        extra_args=["--chat-template", unknown_template, "--response-format", "qwen3", "--log-level", "warning"],
    ) as gw:
        sid = gw.client.open_session()
        client = openai.OpenAI(base_url=gw.base_url, api_key=sid, max_retries=2, timeout=30)
        reply = client.chat.completions.create(
            model="m", tools=TOOLS, messages=[{"role": "user", "content": "Weather in Paris?"}]
        )
        assert reply.choices[0].message.tool_calls, reply  # the fake engine calls a tool; qwen3 parses it
        records = gw.client.finish_session(sid)
        assert len(records) == 1 and not records[0].metadata["ill_formed"]


def test_plain_text_serving_refuses_tools_with_a_400(unknown_template: str) -> None:
    with launch_gateway(
        workers=1, extra_args=["--chat-template", unknown_template, "--allow-plain-text", "--log-level", "warning"]
    ) as gw:
        sid = gw.client.open_session()
        client = openai.OpenAI(base_url=gw.base_url, api_key=sid, max_retries=2, timeout=30)
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="m", tools=TOOLS, messages=[{"role": "user", "content": "hi"}])
        assert info.value.body["code"] == "tools_unsupported" and info.value.body["param"] == "tools"
        assert "--response-format" in info.value.body["message"]
        reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls
        root = gw.base_url.removesuffix("/v1")
        assert httpx.get(f"{root}/healthz").json()["status"] == "ok"
        assert len(gw.client.finish_session(sid)) == 1  # the refused request recorded nothing
