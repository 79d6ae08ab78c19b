"""Process-test fixtures shared across modules: one fake engine and one 2-worker `serve` per test process, and
the official SDKs' clients closed after each test.

Session-scoped so the dialect, streaming and Agents SDK modules pay the gateway's start-up
once per xdist worker; tests scope engine faults and logs by their session's routing key.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
from assets import FakeEngine
from dialects import ENGINE_TIMEOUT_S
from processes import launch_gateway


@pytest.fixture(autouse=True)
def _sdk_clients_closed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every sync client of the official SDKs that a test makes is closed when the test ends, as an agent that
    is done would close it. Left to the garbage collector, a client's sockets are finalized in any order with
    the client that owns them, and warn as unclosed (in whichever test runs then)."""
    made: list[Any] = []
    for sdk_class in (openai.OpenAI, anthropic.Anthropic):
        init = sdk_class.__init__

        def tracked(self: Any, *args: Any, __init: Any = init, **kwargs: Any) -> None:
            __init(self, *args, **kwargs)
            made.append(self)

        monkeypatch.setattr(sdk_class, "__init__", tracked)
    yield
    for client in made:
        client.close()


@pytest.fixture(scope="session")
def dialect_engine(qwen3_tokenizer_dir: str) -> Iterator[FakeEngine]:
    with FakeEngine(qwen3_tokenizer_dir) as engine:
        yield engine


@pytest.fixture(scope="session")
def dialect_gateway(dialect_engine: FakeEngine, qwen3_tokenizer_dir: str) -> Iterator[Any]:
    """`serve` with 2 workers on the fake vLLM engine, the real Qwen BPE and trl's qwen3.jinja."""
    extra = ["--engine-timeout", str(ENGINE_TIMEOUT_S), "--log-level", "warning"]
    with launch_gateway(
        workers=2, engine_kind="vllm", engine_urls=[dialect_engine.url], tokenizer=qwen3_tokenizer_dir, extra_args=extra
    ) as gw:
        yield gw
