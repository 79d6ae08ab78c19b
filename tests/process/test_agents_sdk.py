"""The OpenAI Agents SDK running a function-tool agent through a real `serve` (Responses API), offline.

`OpenAIResponsesModel` on an `AsyncOpenAI(base_url=gateway, api_key=session)` client, tracing
off. Run to completion and streamed, resending the conversation (the SDK's default) and
chaining with `previous_response_id`: the tool runs on the calls the fake engine made, the
agent ends with the engine's final answer, and the episode is one clean, faithful row.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from dialects import SYSTEM, engine_turns, fake_policy
from fidelity import assert_fidelity
from openai import AsyncOpenAI

MAX_TURNS = 6


@pytest.mark.parametrize(
    "streamed, chained", [(False, False), (True, True)], ids=["run-full_input", "streamed-previous_response_id"]
)
def test_an_agent_with_a_function_tool_runs_through_the_gateway(
    dialect_gateway, dialect_engine, qwen3_tokenizer_dir, streamed, chained
):
    set_tracing_disabled(True)  # no network: nothing may try to export traces
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        cities.append(city)
        return f"sunny in {city}"

    sid = dialect_gateway.client.open_session()

    async def run() -> Any:
        client = AsyncOpenAI(base_url=dialect_gateway.base_url, api_key=sid, max_retries=0, timeout=30)
        agent = Agent(
            name="weather",
            instructions=SYSTEM,
            tools=[get_weather],
            model=OpenAIResponsesModel(model="qwen3", openai_client=client),
        )
        try:
            if streamed:
                result = Runner.run_streamed(
                    agent, "What is the weather in Bern?", max_turns=MAX_TURNS, auto_previous_response_id=chained
                )
                kinds = {event.type async for event in result.stream_events()}
                assert "raw_response_event" in kinds
            else:
                result = await Runner.run(
                    agent, "What is the weather in Bern?", max_turns=MAX_TURNS, auto_previous_response_id=chained
                )
        finally:
            await client.close()
        return result

    result = asyncio.run(run())
    assert str(result.final_output).startswith("Final answer after")
    assert cities and all(city.startswith("What is the") for city in cities)  # the engine's calls were executed
    records = dialect_gateway.client.finish_session(sid, wait_timeout=10.0)
    turns = engine_turns(dialect_engine, sid, fake_policy(qwen3_tokenizer_dir))
    assert len(turns) == len(result.raw_responses)
    assert_fidelity(turns, records)
    assert len(records) == 1 and records[0].metadata["decisions"]["fork"] == 0, [r.metadata for r in records]
