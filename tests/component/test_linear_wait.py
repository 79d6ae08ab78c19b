"""A linear session's request that echoes a reply whose COMMIT has not reached the broker yet, over real sockets.

The agent can have the reply (and send its follow-up, perhaps to another worker) a moment before the COMMIT
lands. The follow-up's OPEN then names no head it extends while a turn is in flight: the worker asks again
until the commit lands, and prompts with the committed turn's ids; it stops waiting as soon as nothing is in
flight (the turn was aborted) or after LINEAR_WAIT_S. A real broker, a real Backplane, the Qwen3 template;
the commits are sent by hand, which is what makes the race deterministic.
"""

from __future__ import annotations

import asyncio
from array import array
from typing import Any

from broker import protocol
from broker.message_keys import EchoDigest
from gateway_workers.capture.backplane import Backplane
from gateway_workers.rendering.renderer import Renderer
from gateway_workers.turns import history as history_module
from gateway_workers.turns.history import LinearHistory, echo_flag, render_context
from trainer_client import TrainerClient

DEADLINE_S = 10.0
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
ASKED = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Find news."}]
REPLY = {"role": "assistant", "content": "", "tool_calls": [{"name": "search", "arguments": {"query": "news"}}]}
SAMPLE = '<tool_call>\n{"name": "search", "arguments": {"query": "news"}}\n</tool_call><|im_end|>'
FOLLOW_UP = [*ASKED, REPLY, {"role": "tool", "name": "search", "content": "Nothing new."}]


def _first_commit(
    backplane: Backplane, renderer: Renderer, sid: str, turn_id: str = "t1", asked: list[Any] = ASKED
) -> protocol.CommitTurn:
    """The first turn's COMMIT as a worker builds it: its prompt, its output, their echo fingerprint."""
    prompt = renderer.render(asked, TOOLS).prompt_ids
    output = array("i", renderer.tokenizer.encode(SAMPLE, add_special_tokens=False))
    flags = {
        "ill_formed": False,
        "history": "first",
        "echo": echo_flag(EchoDigest(render_context(TOOLS), count=len(asked)), REPLY),
    }
    return protocol.CommitTurn(
        backplane.request_id(), sid, turn_id, prompt, output, array("f", [-0.5] * len(output)), "stop",
        [*asked], REPLY, flags,
    )  # fmt: skip


def _run(make_broker: Any, qwen3_tokenizer: Any, scenario: Any) -> Any:
    broker = make_broker()
    with TrainerClient(broker.control_endpoint, timeout=5) as client:
        sid = client.open_session(history_mode="linear")

        async def main() -> Any:
            backplane = Backplane(broker.worker_endpoint)
            backplane.start()
            try:
                renderer = Renderer(qwen3_tokenizer)
                history = LinearHistory(backplane, renderer, ("<|im_end|>", "<|endoftext|>"))
                return await asyncio.wait_for(scenario(backplane, renderer, history, sid), DEADLINE_S)
            finally:
                await backplane.close()

        return asyncio.run(main())


def test_a_follow_up_waits_for_the_commit_in_flight_and_extends_it(make_broker, qwen3_tokenizer):
    async def scenario(backplane: Backplane, renderer: Renderer, history: LinearHistory, sid: str) -> None:
        first = await backplane.open_turn(sid, "t1")
        assert isinstance(first, protocol.TurnOpened) and first.history_mode == "linear" and not first.heads
        commit = _first_commit(backplane, renderer, sid)
        opened = await backplane.open_turn(sid, "t2")  # the follow-up, before t1's COMMIT
        assert isinstance(opened, protocol.TurnOpened) and opened.pending == 1 and not opened.heads
        prompting = asyncio.ensure_future(history.prompt(sid, "t2", FOLLOW_UP, TOOLS, opened))
        while history.counters["linear_waits"] < 3:  # it asks again, and again: t1 is still in flight
            assert not prompting.done(), prompting
            await asyncio.sleep(0.01)
        backplane.commit_in_background(commit)
        prompt = await prompting
        assert prompt.kind == "linear" and prompt.rendered is not None
        assert prompt.opened.heads and prompt.opened.heads[0][0] == "t1"
        held = [*commit.prompt_ids, *commit.output_ids]
        ids = list(prompt.rendered.prompt_ids)
        assert ids[: len(held)] == held  # the ids t1's engine call saw, then the tail
        full = renderer.render(FOLLOW_UP, TOOLS)
        assert ids == list(full.prompt_ids)  # a tool loop re-renders as sampled here: the tail is the rest
        assert history.counters["linear_held_local"] == 1  # this backplane committed it: its commit base holds it

    _run(make_broker, qwen3_tokenizer, scenario)


def test_the_head_committed_here_is_matched_without_fingerprints(make_broker, qwen3_tokenizer):
    """The usual case: the turn was prompted and committed through this worker, so its commit base holds it; the
    follow-up is matched by comparing messages and gets the same prompt and the same echo digest as a match by
    fingerprints would give."""

    async def scenario(backplane: Backplane, renderer: Renderer, history: LinearHistory, sid: str) -> None:
        first = await backplane.open_turn(sid, "t1")
        assert (await history.prompt(sid, "t1", [*ASKED], TOOLS, first)).kind == "first"
        commit = _first_commit(backplane, renderer, sid)
        backplane.commit_in_background(commit)
        while backplane.bases.get(sid) is None:  # the commit's ACK makes it this worker's base
            await asyncio.sleep(0.01)
        opened = await backplane.open_turn(sid, "t2")
        prompt = await history.prompt(sid, "t2", FOLLOW_UP, TOOLS, opened)
        assert prompt.kind == "linear" and prompt.rendered is not None
        assert history.counters["linear_matched_local"] == 1 and history.counters["linear_held_local"] == 1
        assert list(prompt.rendered.prompt_ids) == list(renderer.render(FOLLOW_UP, TOOLS).prompt_ids)
        tools = EchoDigest(render_context(TOOLS))  # the commit continues it with its reply (`echo_flag`)
        assert (prompt.echo.count, prompt.echo.crc) == (len(FOLLOW_UP), tools.crc)

    _run(make_broker, qwen3_tokenizer, scenario)


def test_a_fingerprint_shared_by_two_lines_goes_to_the_one_whose_messages_match(make_broker, qwen3_tokenizer):
    """Two lines of a forking session end with the same reply at the same count (a fingerprint is the tools'
    and the reply's): the newest is tried first, its messages differ, so the request extends the other."""

    async def scenario(backplane: Backplane, renderer: Renderer, history: LinearHistory, sid: str) -> None:
        other = [ASKED[0], {"role": "user", "content": "Find old news."}]
        for turn_id, asked in (("t1", ASKED), ("t2", other)):
            await backplane.open_turn(sid, turn_id)
            backplane.commit_in_background(_first_commit(backplane, renderer, sid, turn_id, asked))
            while (base := backplane.bases.get(sid)) is None or base.turn_id != turn_id:  # ACKed
                await asyncio.sleep(0.01)
        opened = await backplane.open_turn(sid, "t3")
        assert [head[0] for head in opened.heads] == ["t2", "t1"] and opened.heads[0][1:] == opened.heads[1][1:]
        prompt = await history.prompt(sid, "t3", [*FOLLOW_UP], TOOLS, opened)  # no base prompted here: fetched
        assert prompt.kind == "linear" and prompt.rendered is not None
        t1 = await backplane.get_turn(sid, "t1", with_ids=True)
        ids = list(prompt.rendered.prompt_ids)
        assert ids[: len(t1.prompt_ids) + len(t1.output_ids)] == [*t1.prompt_ids, *t1.output_ids]
        assert ids == list(renderer.render(FOLLOW_UP, TOOLS).prompt_ids)
        assert (history.counters["linear_held_local"], history.counters["linear_held_fetched"]) == (1, 1)  # t2, t1

    _run(make_broker, qwen3_tokenizer, scenario)


def test_a_head_of_another_line_with_the_same_reply_does_not_end_the_wait(make_broker, qwen3_tokenizer):
    """Another line's head ends with the reply this request echoes, at the same count: its fingerprint matches,
    its messages do not, so the request still waits for the commit of the turn it does echo."""

    async def scenario(backplane: Backplane, renderer: Renderer, history: LinearHistory, sid: str) -> None:
        other = [ASKED[0], {"role": "user", "content": "Find old news."}]
        await backplane.open_turn(sid, "t0")
        backplane.commit_in_background(_first_commit(backplane, renderer, sid, "t0", other))
        while backplane.bases.get(sid) is None:
            await asyncio.sleep(0.01)
        await backplane.open_turn(sid, "t1")
        commit = _first_commit(backplane, renderer, sid, "t1")  # the reply the follow-up echoes: not landed yet
        opened = await backplane.open_turn(sid, "t2")
        assert [head[0] for head in opened.heads] == ["t0"] and opened.pending == 1
        prompting = asyncio.ensure_future(history.prompt(sid, "t2", [*FOLLOW_UP], TOOLS, opened))
        while history.counters["linear_waits"] < 2:
            assert not prompting.done(), prompting.result()
            await asyncio.sleep(0.01)
        backplane.commit_in_background(commit)
        prompt = await prompting
        assert prompt.kind == "linear" and prompt.rendered is not None
        ids = list(prompt.rendered.prompt_ids)
        assert ids[: len(commit.prompt_ids) + len(commit.output_ids)] == [*commit.prompt_ids, *commit.output_ids]

    _run(make_broker, qwen3_tokenizer, scenario)


def test_the_wait_ends_when_nothing_is_in_flight_or_at_its_bound(make_broker, qwen3_tokenizer, monkeypatch):
    monkeypatch.setattr(history_module, "LINEAR_WAIT_S", 0.3)

    async def scenario(backplane: Backplane, renderer: Renderer, history: LinearHistory, sid: str) -> None:
        await backplane.open_turn(sid, "t1")
        opened = await backplane.open_turn(sid, "t2")
        prompting = asyncio.ensure_future(history.prompt(sid, "t2", FOLLOW_UP, TOOLS, opened))
        while not history.counters["linear_waits"]:
            await asyncio.sleep(0.01)
        backplane.abort_in_background(sid, "t1", "client_gone")  # t1 will never commit
        prompt = await prompting
        assert prompt.kind == "first" and prompt.rendered is None  # no head: a full render
        waits = history.counters["linear_waits"]
        # t2 itself is in flight now: a third request waits, but only as long as the bound
        opened = await backplane.open_turn(sid, "t3")
        assert opened.pending == 1
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        prompt = await history.prompt(sid, "t3", FOLLOW_UP, TOOLS, opened)
        assert prompt.kind == "first" and 0.3 <= loop.time() - t0 < 2.0
        assert history.counters["linear_waits"] > waits

    _run(make_broker, qwen3_tokenizer, scenario)


def test_a_request_that_echoes_no_reply_does_not_wait(make_broker, qwen3_tokenizer):
    """Only a request whose new messages hold an assistant message can be echoing a reply still in flight: a
    parallel sub-agent's first request is prompted at once."""

    async def scenario(backplane: Backplane, renderer: Renderer, history: LinearHistory, sid: str) -> None:
        await backplane.open_turn(sid, "t1")
        opened = await backplane.open_turn(sid, "t2")
        assert opened.pending == 1
        prompt = await history.prompt(sid, "t2", [*ASKED, {"role": "user", "content": "And old news?"}], TOOLS, opened)
        assert prompt.kind == "first" and history.counters["linear_waits"] == 0

    _run(make_broker, qwen3_tokenizer, scenario)
