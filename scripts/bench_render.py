"""Where a worker's per-turn CPU goes: template render vs tokenization vs the rest of the hot path.

Runs in-process on the load generator's conversations (system + tools + user, then tool-call
turns whose results grow the context to 4k or 24k tokens) with the real Qwen BPE and trl's
qwen3.jinja. Measures, as medians over repetitions: the Jinja render vs the template twin; a full
encode (`encode` vs the GIL-free `encode_batch_fast`, on the main thread vs a worker thread); the
incremental `Renderer.render` of each turn after the previous one (what a live episode pays);
and the hot-path steps outside rendering/renderer.py (agent body JSON, list<->array copies, engine request
JSON, CommitTurn msgpack). `--profile` adds a cProfile summary of a turn. Prints JSON.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import threading
import time
from array import array
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "tests"), HERE]

import orjson  # noqa: E402
from loadgen import SYSTEM, LoadConfig, filler  # noqa: E402

from broker import protocol  # noqa: E402

SEARCH_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the corpus.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    }
]


def episode(context_tokens: int, turns: int = 8, index: int = 0) -> list[dict[str, Any]]:
    """Canonical messages of a loadgen-shaped episode just before its last turn."""
    step = LoadConfig(context_tokens=context_tokens, turns=turns).step_tokens
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Task {index}:" + filler(step, index)},
    ]
    for turn in range(turns - 1):
        messages.append(
            {
                "role": "assistant",
                "content": "",
                "reasoning": f"Step {turn}:" + filler(24, turn),
                "tool_calls": [{"name": "search", "arguments": {"query": f"q{turn}"}}],
            }
        )
        messages.append({"role": "tool", "content": f"Result {turn}:" + filler(step, index * 31 + turn)})
    return messages


def timed(fn: Callable[[], object], reps: int) -> float:
    """Median milliseconds of `fn` over `reps` calls (after one warm-up call)."""
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(1000 * (time.perf_counter() - t0))
    return round(statistics.median(samples), 4)


def in_thread(fn: Callable[[], float]) -> float:
    out: list[float] = []
    worker = threading.Thread(target=lambda: out.append(fn()))
    worker.start()
    worker.join()
    return out[0]


def measure(tokenizer: Any, context_tokens: int, reps: int) -> dict[str, Any]:
    from gateway_workers.rendering.messages import template_messages
    from gateway_workers.rendering.renderer import Renderer

    messages = episode(context_tokens)
    jinja = Renderer(tokenizer, native_templates=False, cache_bytes=0)
    text = jinja.render_text(messages, SEARCH_TOOLS)
    backend = tokenizer.backend_tokenizer
    ids = backend.encode(text, add_special_tokens=False).ids
    out: dict[str, Any] = {
        "context_tokens": context_tokens,
        "prompt_tokens": len(ids),
        "messages": len(messages),
        "text_chars": len(text),
    }
    twin = Renderer(tokenizer)
    for _ in range(20):  # past the twin's verified renders
        twin.render_text(messages, SEARCH_TOOLS)
    out["template_ms"] = {
        "hf_apply_chat_template": timed(lambda: jinja.render_text(messages, SEARCH_TOOLS), reps),
        "twin": timed(lambda: twin.render_text(messages, SEARCH_TOOLS), reps),
        "template_messages": timed(lambda: template_messages(messages), reps),
    }
    full = max(3, reps // 10)
    encode = lambda: backend.encode(text, add_special_tokens=False)  # noqa: E731
    fast = lambda: backend.encode_batch_fast([text], add_special_tokens=False)  # noqa: E731
    out["full_encode_ms"] = {
        "encode_main_thread": timed(encode, full),
        "encode_worker_thread": in_thread(lambda: timed(encode, full)),
        "batch_fast_main_thread": timed(fast, full),
        "batch_fast_worker_thread": in_thread(lambda: timed(fast, full)),
    }
    # A live episode: each turn renders after the previous one, so only its new pieces are tokenized
    # (by the tiktoken twin, or by `tokenizers` without it). Each renderer is first used past the
    # renders it verifies against the original.
    out["incremental_render_last_turn_ms"] = {}
    for name, use_twin in (("bpe_twin", True), ("tokenizers", False)):
        live = Renderer(tokenizer, bpe_twin=use_twin)
        for k in range(20):  # new text each time: each render encodes (and the first ones verify)
            live.render(episode(512, index=900 + k)[:2], SEARCH_TOOLS)
        per_turn = []
        for k in range(3):
            history = episode(context_tokens, index=100 + k)
            cuts = [2] + [3 + 2 * t for t in range(7)]
            for j, cut in enumerate(cuts):
                t0 = time.perf_counter()
                live.render(history[:cut], SEARCH_TOOLS)
                if j == len(cuts) - 1:
                    per_turn.append(1000 * (time.perf_counter() - t0))
        out["incremental_render_last_turn_ms"][name] = round(statistics.median(per_turn), 4)
    out["warm_render_ms"] = timed(lambda: twin.render(messages, SEARCH_TOOLS), reps)
    out["encode_prompt_all_cached_ms"] = timed(lambda: twin.encode_prompt(text), reps)
    out["hot_path_ms"] = hot_path(tokenizer, messages, ids, reps)
    return out


def hot_path(tokenizer: Any, messages: list[dict[str, Any]], ids: list[int], reps: int) -> dict[str, float]:
    """Steps outside rendering/renderer.py, as the adapters / turns / engines / parser do them today."""
    from gateway_workers.adapters import openai_chat
    from gateway_workers.formats import detect_parser

    wire: list[dict[str, Any]] = []
    for k, m in enumerate(messages):
        item: dict[str, Any] = {"role": m["role"], "content": m["content"]}
        if m.get("tool_calls"):
            item["tool_calls"] = [
                {
                    "id": f"call_{k}",
                    "type": "function",
                    "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
                }
                for c in m["tool_calls"]
            ]
            item["reasoning_content"] = m.get("reasoning")
        if m["role"] == "tool":
            item["tool_call_id"] = f"call_{k - 1}"
        wire.append(item)
    body = {"model": "m", "messages": wire, "tools": SEARCH_TOOLS}
    agent_body = orjson.dumps(body)
    parser = detect_parser(tokenizer)
    reply = (
        "<think>\nStep 9: alpha delta echo golf hotel india mike november.\n</think>\n\n<tool_call>\n"
        '{"name": "search", "arguments": {"query": "q9"}}\n</tool_call>'
    )
    output = tokenizer.backend_tokenizer.encode(reply, add_special_tokens=False).ids + [tokenizer.eos_token_id]
    packed = array("i", ids)
    engine_body = {"request_id": "x", "token_ids": ids, "sampling_params": {"max_tokens": 256, "logprobs": 0}}
    commit = protocol.CommitTurn(
        request_id=0,
        session_id="s" * 22,
        turn_id="t" * 32,
        prompt_ids=packed,
        output_ids=array("i", ids[:60]),
        logprobs=array("f", [0.5] * 60),
        finish_reason="stop",
        prompt_messages=messages,
        response_message={"role": "assistant", "content": ""},
        flags={},
        timings={},
    )
    return {
        "agent_body_orjson_loads": timed(lambda: orjson.loads(agent_body), reps),
        "openai_chat.parse_request": timed(lambda: openai_chat.parse_request(body), reps),
        "response_parser.parse (~45-token reply)": timed(lambda: parser.parse(output, ids, SEARCH_TOOLS), reps),
        "array_to_list (turns.prepare)": timed(lambda: list(packed), reps),
        "array.tolist": timed(packed.tolist, reps),
        "list_to_array (CapturedTurn.commit)": timed(lambda: array("i", ids), reps),
        "engine_body_orjson_dumps": timed(lambda: orjson.dumps(engine_body), reps),
        "commit_protocol_encode": timed(lambda: protocol.encode(commit), reps),
    }


def profile(tokenizer: Any, context_tokens: int) -> str:
    """cProfile of one incremental turn (the previous turn already rendered), top functions by own time."""
    from gateway_workers.rendering.renderer import Renderer

    renderer = Renderer(tokenizer)
    history = episode(context_tokens, index=7)
    for _ in range(20):
        renderer.render(history[:-2], SEARCH_TOOLS)
    prof = cProfile.Profile()
    prof.enable()
    renderer.render(history, SEARCH_TOOLS)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
    return buf.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="4096,24576")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--tokenizer", help="tokenizer directory (default: the built-in BPE with trl's qwen3.jinja)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()
    from gateway_workers.rendering.tokenizer import load_tokenizer

    if args.tokenizer:
        tokenizer = load_tokenizer(args.tokenizer)
    else:
        from assets import trl_qwen3_template_path

        tokenizer = load_tokenizer(None, chat_template_path=str(trl_qwen3_template_path()))
    results: dict[str, Any] = {"load_avg": os.getloadavg(), "cpus": os.cpu_count(), "runs": []}
    for context in (int(c) for c in args.contexts.split(",")):
        results["runs"].append(measure(tokenizer, context, args.reps))
        if args.profile:
            print(profile(tokenizer, context), file=sys.stderr)
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
