"""Real coding harnesses, unmodified, through `rollout-gateway serve` with two workers, in linear sessions.

Claude Code, Codex CLI, Qwen Code and opencode (pinned in tests/harnesses/package.json; `coding_harnesses`
says how each is pointed at the gateway) each run a task on the fake vLLM engine, whose replies call a tool the
harness declares, with arguments valid for its schema (a harmless `echo` of a marker, or reading a file that
holds it), for two rounds, then give a final answer; once with `<think>` in every reply and once without. Per
run: the harness exits 0 and prints the final answer; every request it sent was answered 2xx (the gateway's
access log); it ran the tool (the marker is in a later prompt); the session is one row, exact against what the
engine sampled (`fidelity`). Codex, Qwen Code and opencode always stream. Claude Code streams too and falls back
to a request without streaming when a stream fails: its first stream is made to fail once mid-way, so both
kinds of its requests are served (the failed stream is the one error line, and is not trained on).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from assets import FakeEngine
from coding_harnesses import HARNESSES, Harness
from dialects import _fake_engine_state, engine_turns, routing_key, tokenizer
from fidelity import assert_fidelity
from processes import launch_gateway

from broker.protocol import session_tag

pytestmark = pytest.mark.timeout(600)

ACCESS = "rollout_gateway.access"
TASK = "List the files in this directory, then tell me what you found."
FINAL = re.compile(r"Final answer after \d+ tool results: \w+\.")
TOOL_ROUNDS = 2
STREAM_FAILS_AFTER = 3  # tokens into Claude Code's first stream


@pytest.fixture(scope="module")
def engine(qwen3_tokenizer_dir: str) -> Iterator[FakeEngine]:
    with FakeEngine(qwen3_tokenizer_dir, tool_rounds=TOOL_ROUNDS) as fake:
        yield fake


@pytest.fixture(scope="module")
def gateway(engine: FakeEngine, qwen3_tokenizer_dir: str) -> Iterator[Any]:
    extra = ["--history-mode", "linear", "--access-log", "--log-level", "warning"]
    with launch_gateway(workers=2, engine_kind="vllm", engine_urls=[engine.url], tokenizer=qwen3_tokenizer_dir,
                        extra_args=extra) as gw:
        yield gw


def _sampled_under(tokenizer_dir: str, policy: dict[str, Any]) -> Callable[[list[int], int], Any]:
    """The fake engine's reply function under the policy the test gave it: what it sampled for a prompt."""
    module, state = _fake_engine_state(tokenizer_dir)
    controls = module.Policy(**policy)
    return lambda prompt, max_tokens: module.reply(state, prompt, max_tokens, controls)


def _access_lines(gw: Any, sid: str) -> list[str]:
    tag = session_tag(sid)
    return [line for line in list(gw.output) if ACCESS in line and f"session={tag}" in line]


@pytest.mark.parametrize("think", [True, False], ids=["think", "no-think"])
@pytest.mark.parametrize("name", list(HARNESSES))
def test_a_harness_runs_unmodified_and_its_session_is_one_exact_row(
    name: str, think: bool, gateway: Any, engine: FakeEngine, qwen3_tokenizer_dir: str, tmp_path: Path
) -> None:
    harness: Harness = HARNESSES[name]
    sid = gateway.client.open_session(history_mode="linear")
    aux = gateway.client.open_session()  # opencode's title requests: a session of their own
    marker = f"MARKER-{secrets.token_hex(4)}"
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "NOTES.md").write_text(f"The notes say {marker}.\n")
    key = routing_key(sid)
    policy = {"key": key, "prefer_tools": [harness.tool], "think": think,
              "arguments": {harness.tool: harness.arguments(marker, tmp_path / "work")}}
    engine.configure(policy=policy)
    if harness.name == "claude-code":
        engine.configure(fault={"key": key, "error_after": STREAM_FAILS_AFTER, "times": 1})

    done = harness.run(gateway.base_url, sid, aux, TASK, tmp_path)

    assert done.returncode == 0, done.stdout[-4000:]
    assert FINAL.search(done.stdout), done.stdout[-4000:]
    requests = engine.log(key)["requests"]
    answered = [r for r in requests if r["fault"] is None]
    lines = _access_lines(gateway, sid)
    failed = [line for line in lines if " 200 " not in line]
    if harness.name == "claude-code":  # the stream made to fail: an error event after 200, then its fallback
        assert len(failed) == 1 and "after the reply had begun with 200" in failed[0], lines
        assert {r["body"]["stream"] for r in answered} == {True, False}, "both streamed and not"
    else:
        assert not failed, failed
        assert all(r["body"]["stream"] for r in answered)
    assert len(lines) == len(requests), (lines, len(requests))  # one line per request, each answered
    # the harness ran the tool: its result, with the marker, is in a later prompt
    decoded = [tokenizer(qwen3_tokenizer_dir).decode(r["body"]["token_ids"], skip_special_tokens=False)
               for r in answered]
    assert not any(marker in text for text in decoded[:1]) and any(marker in text for text in decoded[1:])
    rows = gateway.client.finish_session(sid, reward=1.0, wait_timeout=10.0)
    turns = engine_turns(engine, sid, _sampled_under(qwen3_tokenizer_dir, policy))
    assert len(rows) == 1, [row.metadata for row in rows]
    assert len(turns) == len(answered) == TOOL_ROUNDS + 1
    assert_fidelity(turns, rows)
    assert all(" 200 " in line for line in _access_lines(gateway, aux))  # titles, for opencode
    gateway.client.drop_session(aux)
