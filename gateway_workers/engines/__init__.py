"""Engine backends behind one Protocol: vLLM and SGLang over HTTP, and the built-in mock.

`create_engine` is the one factory the app calls, once per worker process, inside the
running loop's lifespan (the HTTP backends open their pooled client lazily on first use).
Must not import the app, adapters or the backplane.
"""

from __future__ import annotations

from typing import Any

from gateway_workers.engines.base import Engine, EngineError, EngineResult, EngineTimeout, SamplingParams
from gateway_workers.engines.config import EngineConfig

__all__ = ["Engine", "EngineConfig", "EngineError", "EngineResult", "EngineTimeout", "SamplingParams", "create_engine"]


def create_engine(config: EngineConfig, tokenizer: Any) -> Engine:
    """The engine `config` describes; `tokenizer` (the worker's) gives the mock its token ids."""
    if config.kind == "mock":
        from gateway_workers.engines.mock import MockEngine

        return MockEngine(config, tokenizer)
    if config.kind == "vllm":
        from gateway_workers.engines.vllm import VllmEngine

        return VllmEngine(config)
    if config.kind == "sglang":
        from gateway_workers.engines.sglang import SglangEngine

        return SglangEngine(config)
    raise ValueError(f"unknown engine kind {config.kind!r}")
