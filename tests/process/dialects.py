"""Helpers for the dialect process tests: the fake engine's own policy, what it sampled, tools per dialect.

`engine_turns` recomputes, from the fake engine's request log and its deterministic policy,
exactly what the engine sampled for one session (leaving out the requests an injected fault struck),
so the rows the trainer gets can be checked with the shared fidelity checker. Imports only test
helpers and the broker's records.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from assets import TOOLS, FakeEngine

from broker.protocol import ids_array, logprobs_array
from broker.sessions.turn_record import TurnRecord
from gateway_workers.engines.routing import routing_key

FAKE_ENGINE = Path(__file__).resolve().parents[1] / "fake_engine.py"
SYSTEM = "You are a careful weather agent."
ENGINE_TIMEOUT_S = 6.0  # the dialect gateway's --engine-timeout

ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]
RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "parameters": t["function"]["parameters"],
        "strict": False,
    }
    for t in TOOLS
]

Policy = Callable[[list[int], int], tuple[list[int], list[float], str]]


@functools.cache
def tokenizer(tokenizer_dir: str) -> Any:
    """The `tokenizers` BPE of a tokenizer dir (loading it takes seconds: once per process)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))


def _fake_engine_state(tokenizer_dir: str) -> tuple[Any, Any]:
    """The fake engine's module and a State like its process's (tool_rounds=2)."""
    spec = importlib.util.spec_from_file_location("fake_engine_policy", FAKE_ENGINE)
    assert spec is not None and spec.loader is not None
    module = sys.modules.get(spec.name)
    if module is None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
    tok = tokenizer(tokenizer_dir)
    return module, module.State(tokenizer=tok, eos_id=tok.token_to_id("<|im_end|>"), tool_rounds=2)


@functools.cache
def fake_policy(tokenizer_dir: str) -> Policy:
    """The fake engine's own reply function, to recompute what it sampled for a prompt."""
    module, state = _fake_engine_state(tokenizer_dir)
    return lambda prompt, max_tokens: module.reply(state, prompt, max_tokens)


def text_policy(tokenizer_dir: str, text: str) -> Policy:
    """What the fake engine answers under a `text` fault."""
    module, state = _fake_engine_state(tokenizer_dir)
    return lambda prompt, max_tokens: module.text_reply(state, text, max_tokens)


def engine_turns(fake_engine: FakeEngine, sid: str, policy: Policy, fault: str | None = None) -> list[TurnRecord]:
    """What the engine sampled and answered for one session, in request order: the requests no fault struck
    (or, with `fault`, those that fault answered)."""
    turns = []
    answered = [req for req in fake_engine.log(routing_key(sid))["requests"] if req["fault"] == fault]
    for i, req in enumerate(answered):
        body = req["body"]
        prompt = body.get("token_ids") or body.get("input_ids")
        params = body["sampling_params"]
        ids, lps, finish = policy(prompt, int(params.get("max_tokens", params.get("max_new_tokens", 16))))
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
    return turns


def tool_output(name: str, arguments: dict[str, Any]) -> str:
    return f'{{"tool": "{name}", "ok": true, "echo": {sorted(arguments)!r}}}'
