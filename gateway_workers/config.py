"""The settings of the gateway's processes, each declared once (`broker.settings`): `WorkerConfig` for a worker,
`ServeConfig` for the process that runs them (`serve` and `workers`), which holds the workers' config. `serve`'s
broker has its own, `broker.config.BrokerConfig`.

The CLI builds a `ServeConfig` once from flags over variables over defaults and hands each uvicorn worker its
`WorkerConfig` as JSON in one environment variable (uvicorn's factory takes no arguments); the worker reads it in
its app factory, never at import time. Engine settings live in `engines.config.EngineConfig` and request limits
in `http.limits.RequestLimits`, both nested in the worker's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

from broker import protocol, settings
from broker.settings import check, nested, not_negative, positive, setting
from gateway_workers.capture import commit_bases
from gateway_workers.engines.config import EngineConfig
from gateway_workers.http.limits import RequestLimits

CONFIG_ENV = "ROLLOUT_GATEWAY_WORKER_CONFIG"
ENV_PREFIX = "ROLLOUT_GATEWAY_"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's, which the workers run under
# The model id served when neither a flag nor the tokenizer names one.
DEFAULT_MODEL_NAME = "qwen3"


def _log_level(value: str) -> str | None:
    return None if value.lower() in LOG_LEVELS else f"must be one of {', '.join(LOG_LEVELS)}"


@dataclass(frozen=True)
class WorkerConfig:
    """Settings of one gateway worker process."""

    ENV_PREFIX: ClassVar[str] = ENV_PREFIX

    broker_endpoint: str = setting(protocol.DEFAULT_WORKER_ENDPOINT, "the broker's worker endpoint",
                                   flag="--broker", metavar="ENDPOINT")
    engine: EngineConfig = nested(EngineConfig)
    tokenizer: str | None = setting(None, "the tokenizer: a local directory or a hub id", metavar="DIR_OR_HUB_ID",
                                    shown="built-in Qwen BPE")
    chat_template: str | None = setting(None, "a Jinja file replacing the tokenizer's chat template",
                                        metavar="FILE", shown="the tokenizer's")
    model_name: str = setting("", "the model id on `/v1/models` and in replies", metavar="NAME",
                              shown=f"`{DEFAULT_MODEL_NAME}`, or the `--tokenizer`'s last path part")
    default_max_tokens: int = setting(4096, "output cap when neither the request nor the context budget sets one",
                                      flag=None, check=positive)
    max_context_tokens: int | None = setting(
        None, "the model's context window (the engine's `max_model_len`): the context budget of sessions that set "
        "none or a larger one; a prompt that reaches it gets an empty reply with finish reason `length` and never "
        "reaches the engine", metavar="N", check=positive)
    commit_drain_s: float = setting(10.0, "how long a stopping worker waits for its unacknowledged commits, seconds",
                                    flag=None, check=not_negative)
    commit_base_sessions: int = setting(
        commit_bases.MAX_SESSIONS, "per worker, the last commit of this many recent sessions is kept so the next "
        "one travels as a delta (only the new tail); 0: every commit in full. A worker drops what it keeps of a "
        "session within a few seconds of the session's end (the broker says which sessions ended at each "
        "heartbeat), so its memory follows its live sessions", metavar="N", check=not_negative)
    commit_base_mib: int = setting(commit_bases.MAX_CONTEXT_BYTES >> 20, "bound on the token ids those kept "
                                   "commits hold, per worker, MiB", metavar="MIB", check=not_negative)
    log_level: str = setting("info", "`debug`, `info`, `warning` or `error`; `serve` gives its broker the same",
                             metavar="LEVEL", check=_log_level)
    response_format: str | None = setting(
        None, "the reply format to parse with instead of detecting it from the chat template's sha256: a "
        "registered name (`qwen3`, `qwen2_5`, `qwen3_5`, `nemotron3`, `glm4_moe`, `gpt_oss`, `llama3_json`, "
        "`deepseek_r1`, ...: see the README's reply formats) or `package.module:factory` for your own parser",
        metavar="NAME",
        shown="detected from the chat template")
    allow_plain_text: bool = setting(
        False, "with an unrecognized chat template and no `--response-format`, serve plain-text replies (requests "
        "that declare tools get a 400) instead of refusing to start")
    allow_agent_finish: bool = setting(
        False, "serve `POST /rollout/v1/sessions/finish`: agents finish their own session with a reward (session "
        "key as the API key; body `{reward, metadata, rollout_id}`), and the episode goes to the trainer's "
        "`episodes()` stream (off: 404)")
    limits: RequestLimits = nested(RequestLimits)
    curve_keys: str | None = setting(
        None, "the key directory of `rollout-gateway keys`: the backplane uses CURVE (authenticated and "
        "encrypted); needed for any non-loopback endpoint", metavar="DIR")
    hosted_tools: str = setting(
        "drop", "tools the provider runs or alone knows the schema of (web search, code execution, MCP, "
        "Anthropic's `bash_*`, Codex's `local_shell`), which the model cannot call through the gateway: `drop` "
        "leaves them out of the prompt and counts them (`rollout_gateway_hosted_tools_dropped_total`); `reject` "
        "answers the request with a 400", choices=("drop", "reject"))
    pause_hold_s: float = setting(
        300.0, "while generation is paused (`pause_generation`), how long a turn waits for the resume before it "
        "gets a retryable 503 with Retry-After, seconds (below the official SDKs' 600 s request timeout); also how "
        "long a request waits for an absent broker (its OPEN resent meanwhile) before its 503",
        metavar="S", check=positive)
    access_log: bool = setting(
        False, "one log line per request (route, status, session tag, latency); a 4xx or 5xx is logged at warning "
        "with its error type, code, param and message either way")

    def __post_init__(self) -> None:
        check(self)
        if not self.model_name:  # named from what was asked for, before the tokenizer is fetched or built
            name = os.path.basename(self.tokenizer.rstrip("/")) if self.tokenizer else DEFAULT_MODEL_NAME
            object.__setattr__(self, "model_name", name)

    def to_env(self) -> dict[str, str]:
        return {CONFIG_ENV: settings.to_json(self)}

    @classmethod
    def from_env(cls) -> WorkerConfig:
        raw = os.environ.get(CONFIG_ENV)
        if raw is None:
            return cls()
        try:
            return settings.from_json(cls, raw)  # type: ignore[no-any-return]
        except ValueError as e:
            raise ValueError(f"{CONFIG_ENV} is not a valid worker config: {e}") from e


@dataclass(frozen=True)
class ServeConfig:
    """Settings of the process that runs the workers (`serve`, `workers`): the agents' HTTP socket, and the
    workers' config. `serve`'s broker has its own (`BrokerConfig`), built from the same command line."""

    ENV_PREFIX: ClassVar[str] = ENV_PREFIX

    host: str = setting("127.0.0.1", "the agents' HTTP bind address", metavar="HOST")
    port: int = setting(8000, "the agents' HTTP port (`0`: a free one)", metavar="PORT", check=not_negative)
    workers: int = setting(2, "uvicorn worker processes", metavar="N", check=positive)
    worker: WorkerConfig = nested(WorkerConfig)
