"""EngineConfig: the engine a worker calls, each setting declared once (`broker.settings`).

Embedded in the worker's config (`gateway_workers.config.WorkerConfig`) and handed to every worker process.
Imports the stdlib, `broker.settings` and the HTTP client's URL parser only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from broker.settings import check, not_negative, positive, setting
from gateway_workers.engines.http.client import parse_url

EngineKind = Literal["mock", "vllm", "sglang"]

DEFAULT_REQUEST_TIMEOUT_S = 600.0  # a long generation is legitimate; a hung engine is not
DEFAULT_CONNECT_TIMEOUT_S = 5.0
ENGINE_CA_FILE_ENV = "ROLLOUT_ENGINE_CA_FILE"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The engine settings of a worker."""

    ENV_PREFIX: ClassVar[str] = "ROLLOUT_GATEWAY_ENGINE_"

    kind: EngineKind = setting(
        "mock", "the engine the workers call: `mock` (built in, no GPU), `vllm` or `sglang` (both need "
        "`--engine-url`)", flag="--engine-kind")
    urls: tuple[str, ...] = setting(
        (), "an engine's base URL; repeat it for replicas (the variable: space- or comma-separated). Under `serve` "
        "the broker routes: a new session goes to the least-loaded healthy replica and stays there until it ends, "
        "a replica failing its `/health` check is taken out and its sessions move at their next turn, and "
        "`TrainerClient.set_engines([...])` replaces the list at run time. `workers` against a broker without "
        "replicas route by rendezvous hashing on the session key. The session's tag is always sent as "
        "`X-Session-ID` / `X-SMG-Routing-Key` for engine routers", flag="--engine-url", metavar="URL")
    request_timeout_s: float = setting(DEFAULT_REQUEST_TIMEOUT_S, "seconds one engine call may take",
                                       flag="--engine-timeout", metavar="S", check=positive)
    connect_timeout_s: float = setting(DEFAULT_CONNECT_TIMEOUT_S, "seconds opening a connection to the engine may "
                                       "take", flag=None, check=positive)
    mock_delay_s: float = setting(0.0, "mock engine: seconds per call", flag="--mock-delay", metavar="S",
                                  check=not_negative)
    mock_per_token_s: float = setting(0.0, "mock engine: extra seconds per generated token", flag=None,
                                      check=not_negative)
    mock_output_tokens: int = setting(32, "mock engine: tokens in a generated answer (before `max_tokens` cuts it)",
                                      flag=None, check=positive)
    mock_think: bool = setting(True, "mock engine: open each reply with a `<think>` block", flag=None)
    mock_tool_call_every: int = setting(0, "mock engine: every Nth reply (when tools are offered) is a tool call; "
                                        "0: never", flag=None, check=not_negative)
    seed: int = setting(0, "mock engine: base seed; the output is a function of (seed, prompt ids, parameters)",
                        flag=None)
    model: str | None = setting(None, "the model name sent to engines that accept one (vLLM's optional `model` "
                                "field)", flag=None)
    ca_file: str | None = setting(
        None, "for `https://` engines: trust only the CAs in this PEM bundle (a private CA or the engine's "
        "self-signed certificate) instead of the system's; certificates and host names are always verified, there "
        "is no switch that skips it, and a refused certificate is a 502 that names the fix",
        flag="--engine-ca-file", env=ENGINE_CA_FILE_ENV, metavar="PEM", shown="system CAs")

    def __post_init__(self) -> None:
        check(self)
        if self.kind != "mock" and not self.urls:
            raise ValueError(f"engine kind {self.kind!r} needs at least one engine URL")
        if self.kind != "mock":
            for url in self.urls:
                parse_url(url)  # http:// or https:// only: another scheme or a malformed URL fails at startup
