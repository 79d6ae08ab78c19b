"""WorkerConfig: every setting a gateway worker needs, with defaults, in one picklable object.

The CLI builds it once from flags and hands it to each uvicorn worker process as JSON
in one environment variable (uvicorn's factory takes no arguments); the worker reads
it in its app factory, never at import time. Engine settings live in
`engines.base.EngineConfig` and are embedded here.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

from broker import protocol
from gateway_workers.capture import commit_bases
from gateway_workers.engines.base import EngineConfig
from gateway_workers.http.limits import RequestLimits

CONFIG_ENV = "ROLLOUT_GATEWAY_WORKER_CONFIG"


@dataclass(frozen=True)
class WorkerConfig:
    """Settings of one gateway worker process.

    Args:
        broker_endpoint: the broker's worker-facing ZeroMQ endpoint.
        tokenizer: local tokenizer dir or hub id; None = the built-in offline Qwen BPE.
        chat_template: path of a Jinja file that replaces the tokenizer's own template.
        model_name: the model id served on /v1/models and echoed in replies.
        default_max_tokens: output cap when neither the request nor the context budget sets one.
        max_context_tokens: the model's context window (the engine's max_model_len): the context budget of
            sessions that set none or a larger one. None: only sessions' own budgets apply.
        commit_drain_s: how long a stopping worker waits for unacknowledged commits.
        commit_base_sessions, commit_base_mib: bounds on the per-session last commits kept so the next
            commit can be a delta (commit_bases.py); 0 sessions sends every commit in full.
        response_format: parse replies with this format (a registry name or 'package.module:factory')
            instead of detecting it from the chat template's sha256.
        allow_plain_text: with an unrecognized template and no format, serve content only (requests
            that declare tools get a 400) instead of refusing to start.
        allow_agent_finish: serve `POST /rollout/v1/sessions/finish` (agents finish their own session
            with a reward); off, it answers 404.
        limits: bounds on one agent request (`http.limits`).
        curve_keys: a key directory holding `broker.key` and `worker.key_secret` (`rollout-gateway keys`):
            the backplane uses CURVE. None: no CURVE, and the broker endpoint must be loopback (or ipc://).
        hosted_tools: what a request's hosted tools (the provider's own: web search, code execution, ...) get:
            "drop" (left out of the prompt, counted) or "reject" (a 400).
        access_log: log one line per request (errors are logged either way).
    """

    broker_endpoint: str = protocol.DEFAULT_WORKER_ENDPOINT
    engine: EngineConfig = field(default_factory=EngineConfig)
    tokenizer: str | None = None
    chat_template: str | None = None
    model_name: str = "rollout-gateway"
    default_max_tokens: int = 4096
    max_context_tokens: int | None = None
    commit_drain_s: float = 10.0
    commit_base_sessions: int = commit_bases.MAX_SESSIONS
    commit_base_mib: int = commit_bases.MAX_CONTEXT_BYTES >> 20
    log_level: str = "info"
    response_format: str | None = None
    allow_plain_text: bool = False
    allow_agent_finish: bool = False
    limits: RequestLimits = field(default_factory=RequestLimits)
    curve_keys: str | None = None
    hosted_tools: str = "drop"
    access_log: bool = False

    def to_env(self) -> dict[str, str]:
        return {CONFIG_ENV: json.dumps(dataclasses.asdict(self))}

    @classmethod
    def from_env(cls) -> WorkerConfig:
        raw = os.environ.get(CONFIG_ENV)
        if raw is None:
            return cls()
        try:
            values = json.loads(raw)
            engine = values.get("engine", {})
            engine["urls"] = tuple(engine.get("urls", ()))
            values["engine"] = EngineConfig(**engine)
            values["limits"] = RequestLimits(**values.get("limits", {}))
            return cls(**values)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{CONFIG_ENV} is not a valid worker config: {e}") from e
