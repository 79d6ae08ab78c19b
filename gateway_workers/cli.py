"""`rollout-gateway`: serve (broker + N workers), broker, workers, keys.

`serve` starts the broker as a subprocess (`python -m broker`, watched and restarted on
the same endpoints if it dies: `supervisor`), waits for the endpoints it bound, binds the
agents' HTTP socket once in this process (port 0 works) and runs N uvicorn workers on it
(spawned; each builds its own state in the app lifespan). It prints machine-readable READY
lines, stays in the foreground and, on SIGINT/SIGTERM, lets uvicorn stop the workers, then
stops the broker; neither outlives it, however it ends (`lifetime`). `keys` writes
the CURVE key directory (`broker.curve`) that `--curve-keys` points every component at;
a non-loopback backplane endpoint is refused without it. The broker's server is never
imported here: gateway_workers imports only `broker.protocol` and `broker.curve`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import uvicorn
from uvicorn.supervisors import Multiprocess

from broker import curve, protocol
from gateway_workers.capture import commit_bases
from gateway_workers.config import WorkerConfig
from gateway_workers.engines.base import EngineConfig
from gateway_workers.engines.http.client import tls_context
from gateway_workers.http.limits import RequestLimits
from gateway_workers.lifetime import PARENT_PID_ENV
from gateway_workers.supervisor import BrokerStartError, BrokerSupervisor

logger = logging.getLogger(__name__)

WORKERS_START_TIMEOUT_S = 180.0
WORKER_HEALTHCHECK_S = 60  # a worker loads its tokenizer before it answers uvicorn's pings
ENGINE_CA_FILE_ENV = "ROLLOUT_ENGINE_CA_FILE"  # the --engine-ca-file default


def _add_worker_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address for agents (default %(default)s)")
    p.add_argument("--port", type=int, default=8000,
                   help="HTTP port for agents (default %(default)s; 0: pick a free one)")
    p.add_argument("--workers", type=int, default=2, metavar="N",
                   help="number of uvicorn worker processes (default %(default)s)")
    p.add_argument("--engine-kind", choices=["mock", "vllm", "sglang"], default="mock",
                   help="the engine the workers call: mock (built in, no GPU; the default), vllm or sglang (both need "
                        "--engine-url)")
    p.add_argument("--engine-url", action="append", default=[], metavar="URL",
                   help="engine base URL; repeat for replicas (a session sticks to one)")
    p.add_argument("--engine-timeout", type=float, default=600.0, metavar="S",
                   help="seconds one engine call may take (default %(default)s)")
    p.add_argument("--engine-ca-file", default=None, metavar="PEM",
                   help="https:// engine URLs: trust only the CAs in this PEM bundle (a private CA or the engine's "
                        f"self-signed certificate) instead of the system's; env {ENGINE_CA_FILE_ENV}. Certificates "
                        "and host names are always verified")
    p.add_argument("--mock-delay", type=float, default=0.0, metavar="S",
                   help="mock engine: seconds per call (default %(default)s)")
    p.add_argument("--max-context-tokens", type=int, default=None, metavar="N",
                   help="the model's context window (the engine's max_model_len): a prompt of N tokens or more gets "
                        "an empty reply with finish reason 'length' without reaching the engine, as under a "
                        "session's own max_context_tokens, which may be smaller (default: sessions' budgets only)")
    p.add_argument("--tokenizer", default=None, metavar="DIR_OR_HUB_ID",
                   help="local tokenizer dir or hub id (default: built-in Qwen BPE)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja file replacing the tokenizer's chat template")
    p.add_argument("--model-name", default=None, metavar="NAME",
                   help="model id served on /v1/models (default: the --tokenizer's last path part, else qwen3)")
    p.add_argument("--log-level", default="info", metavar="LEVEL",
                   help="debug, info, warning or error (default %(default)s); serve's broker gets it too")
    p.add_argument("--response-format", default=None, metavar="NAME",
                   help="reply format to parse with instead of detecting it from the chat template's sha256: "
                        "a registered name (qwen3, qwen2_5, qwen3_5, nemotron3, glm4_moe, gpt_oss, llama3_json, "
                        "deepseek_r1) or 'package.module:factory' for your own parser")
    p.add_argument("--commit-base-sessions", type=int, default=commit_bases.MAX_SESSIONS, metavar="N",
                   help="per worker, the last commit of this many recent sessions is kept so the next one travels "
                        "as a delta (only the new tail); 0: every commit in full (default %(default)s)")
    p.add_argument("--commit-base-mib", type=int, default=commit_bases.MAX_CONTEXT_BYTES >> 20, metavar="MIB",
                   help="bound on the token ids those kept commits hold, per worker (default %(default)s)")
    p.add_argument("--allow-plain-text", action="store_true",
                   help="with an unrecognized chat template and no --response-format, serve replies as plain text "
                        "(requests that declare tools get a 400) instead of refusing to start")
    p.add_argument("--allow-agent-finish", action="store_true",
                   help="let agents finish their own session with a reward: POST /rollout/v1/sessions/finish "
                        "(session key as the API key; body {reward, metadata, rollout_id}); the episode goes to "
                        "the trainer's episodes() stream. Off: that route answers 404")
    p.add_argument("--hosted-tools", choices=["drop", "reject"], default="drop",
                   help="tools the provider runs or alone knows the schema of (web search, code execution, MCP, "
                        "Anthropic's bash or Codex's local_shell), which the model cannot call through the gateway: "
                        "drop (left out of the prompt, counted in /metrics; the default) or reject (a 400)")
    p.add_argument("--access-log", action="store_true",
                   help="log one line per request: route, status, session tag, latency (a 4xx or 5xx is logged at "
                        "warning with its error type, code, param and message either way)")
    p.add_argument("--curve-keys", default=None, metavar="DIR",
                   help="the key directory of `rollout-gateway keys`: the backplane uses CURVE (authenticated and "
                        f"encrypted); required for a non-loopback broker endpoint (env {curve.CURVE_KEYS_ENV})")


# RequestLimits field -> what its flag bounds; each flag's default comes from ROLLOUT_GATEWAY_<FIELD> when set.
_LIMIT_FLAGS = {
    "max_body_bytes": "request body bytes (413 above; checked before reading)",
    "max_header_bytes": "request header bytes, names and values together (431 above)",
    "max_messages": "messages (or input items) in one request",
    "max_tools": "tools declared in one request",
    "max_content_parts": "content parts in one message",
    "max_string_chars": "characters in one string (a message's text, a tool result, an argument)",
    "max_json_depth": "nesting depth of tool schemas and tool-call arguments",
}
LIMITS_ENV_PREFIX = "ROLLOUT_GATEWAY_"


def _add_limit_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("request limits (a 4xx that names the limit)")
    defaults = RequestLimits()
    for name, what in _LIMIT_FLAGS.items():
        env = LIMITS_ENV_PREFIX + name.upper()
        raw = os.environ.get(env)
        try:
            default = int(raw) if raw is not None else getattr(defaults, name)
        except ValueError:
            raise SystemExit(f"rollout-gateway: {env}={raw!r} is not an integer") from None
        group.add_argument("--" + name.replace("_", "-"), type=int, default=default, metavar="N",
                           help=f"{what} (default {default}; env {env})")


def _limits(args: argparse.Namespace) -> RequestLimits:
    try:
        return RequestLimits(**{name: getattr(args, name) for name in _LIMIT_FLAGS})
    except ValueError as e:
        raise SystemExit(f"rollout-gateway: {e}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout-gateway", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="broker + N workers in one command",
                           epilog="The broker it starts also reads ROLLOUT_BROKER_<FIELD> variables for the settings "
                                  "serve passes no flag for (`rollout-gateway broker --help` lists them).")
    _add_worker_flags(serve)
    _add_limit_flags(serve)
    serve.add_argument("--control", default=protocol.DEFAULT_CONTROL_ENDPOINT, metavar="ENDPOINT",
                       help="ZeroMQ endpoint trainer clients connect to (default %(default)s; port 0 ok)")
    serve.add_argument("--worker-endpoint", default="tcp://127.0.0.1:0", metavar="ENDPOINT",
                       help="ZeroMQ endpoint between broker and workers (default: a free local port)")
    serve.add_argument("--state-dir", default=None, metavar="DIR",
                       help="durable broker: its write-ahead log and snapshots in DIR; a restarted broker (or serve) "
                            "recovers every open session, acknowledged turn and unacknowledged episode (default: "
                            "in memory: a broker restart loses them)")
    serve.add_argument("--fsync", choices=["always", "interval", "never"], default=None,
                       help="with --state-dir, when the log is synced to disk: always, interval (default), never "
                            "(see `rollout-gateway broker --help`)")
    serve.add_argument("--history-mode", choices=protocol.HISTORY_MODES, default=None,
                       help="how sessions that do not choose (open_session(history_mode=...)) build their prompts: "
                            "tree (the chat template renders the messages; default) or linear (a request that "
                            "extends the previous turn reuses the ids the engine saw: one row per episode)")
    serve.add_argument("--linear-fallback", choices=protocol.LINEAR_FALLBACKS, default=None,
                       help="what a linear session's request that does not extend it gets: fork (default), "
                            "rerender or reject (see `rollout-gateway broker --help`)")
    workers = sub.add_parser("workers", help="N workers against a broker running elsewhere")
    _add_worker_flags(workers)
    _add_limit_flags(workers)
    workers.add_argument("--broker", default=protocol.DEFAULT_WORKER_ENDPOINT, metavar="ENDPOINT",
                         help="the broker's worker endpoint (default %(default)s)")
    sub.add_parser("broker", help="the broker alone (flags: see `rollout-gateway broker --help`)", add_help=False)
    sub.add_parser("status", help="a live view of the gateway from its broker (flags: see `rollout-gateway status "
                                  "--help`)", add_help=False)
    keys = sub.add_parser("keys", help="write CURVE key pairs for the broker, a worker and a trainer into DIR")
    keys.add_argument("directory", metavar="DIR", help="created if missing; existing keys are never overwritten")
    return parser


def _write_keys(directory: str) -> None:
    try:
        curve.create_keys(directory)
    except (curve.CurveError, OSError) as e:
        raise SystemExit(f"rollout-gateway keys: {e}") from None
    root = os.path.abspath(directory)
    print(f"CURVE keys written to {root} (secret files are mode 0600; never copy them beyond the host that needs "
          f"them):\n"
          f"  broker host:   broker.key_secret, authorized_workers/ and authorized_trainers/ (serve: the directory)\n"
          f"  worker hosts:  broker.key and worker.key_secret\n"
          f"  trainer hosts: broker.key and trainer.key_secret\n"
          f"then pass --curve-keys DIR (or set {curve.CURVE_KEYS_ENV}=DIR) to serve, broker and workers, and "
          f"TrainerClient(..., curve_keys=DIR).", flush=True)


def _curve_keys(args: argparse.Namespace, endpoints: dict[str, str], broker_host: bool) -> str | None:
    """--curve-keys (else the env), as an absolute path whose files this command needs were read once; refuses a
    non-loopback endpoint without it. `broker_host`: the broker runs here too (serve), so its keys must be too."""
    keys = curve.keys_from_env(args.curve_keys)
    try:
        for flag, endpoint in endpoints.items():
            curve.require_keys_off_loopback(endpoint, keys, flag)
        if keys is None:
            return None
        keys = os.path.abspath(os.path.expanduser(keys))
        curve.load_client_keys(keys, "worker")
        if broker_host:
            curve.load_server_keys(keys)
    except curve.CurveError as e:
        raise SystemExit(f"rollout-gateway: {e}") from None
    return keys


def _worker_config(
    args: argparse.Namespace, broker_endpoint: str, tokenizer_dir: str | None, curve_keys: str | None = None
) -> WorkerConfig:
    if args.engine_kind != "mock" and not args.engine_url:
        raise SystemExit(f"--engine-kind {args.engine_kind} needs at least one --engine-url")
    if args.max_context_tokens is not None and args.max_context_tokens <= 0:
        raise SystemExit("--max-context-tokens must be > 0")
    if args.commit_base_sessions < 0 or args.commit_base_mib < 0:
        raise SystemExit("--commit-base-sessions and --commit-base-mib must be >= 0")
    ca_file = _engine_ca_file(args)
    try:
        engine = replace(EngineConfig(), kind=args.engine_kind, urls=tuple(args.engine_url),
                         request_timeout_s=args.engine_timeout, mock_delay_s=args.mock_delay, ca_file=ca_file)
    except ValueError as e:
        raise SystemExit(f"rollout-gateway: {e}") from None
    return WorkerConfig(
        broker_endpoint=broker_endpoint,
        engine=engine,
        tokenizer=tokenizer_dir,
        chat_template=args.chat_template,
        model_name=args.model_name or (os.path.basename(args.tokenizer.rstrip("/")) if args.tokenizer else "qwen3"),
        log_level=args.log_level,
        response_format=args.response_format,
        allow_plain_text=args.allow_plain_text,
        allow_agent_finish=args.allow_agent_finish,
        max_context_tokens=args.max_context_tokens,
        commit_base_sessions=args.commit_base_sessions,
        commit_base_mib=args.commit_base_mib,
        limits=_limits(args),
        curve_keys=curve_keys,
        hosted_tools=args.hosted_tools,
        access_log=args.access_log,
    )


def _engine_ca_file(args: argparse.Namespace) -> str | None:
    """--engine-ca-file, else $ROLLOUT_ENGINE_CA_FILE: an absolute path, checked loadable before workers start."""
    path = args.engine_ca_file or os.environ.get(ENGINE_CA_FILE_ENV) or None
    if path is None:
        return None
    path = os.path.abspath(os.path.expanduser(path))
    try:
        tls_context(path)
    except ValueError as e:
        raise SystemExit(f"rollout-gateway: --engine-ca-file: {e}") from None
    if not any(url.lower().startswith("https://") for url in args.engine_url):
        logger.warning("an engine CA file is set but no --engine-url is https://; it is not used")
    return path


def _broker_supervisor(args: argparse.Namespace, tokenizer_dir: str | None, curve_keys: str | None) -> BrokerSupervisor:
    flags = ["--log-level", args.log_level]
    if tokenizer_dir:
        flags += ["--tokenizer", tokenizer_dir]
    # Always explicit, even empty: the broker must not fall back to a different ROLLOUT_GATEWAY_CURVE_KEYS.
    flags += ["--curve-keys", curve_keys or ""]
    if args.state_dir:
        flags += ["--state-dir", os.path.abspath(args.state_dir)]
    if args.fsync:
        flags += ["--fsync", args.fsync]
    if args.history_mode:
        flags += ["--history-mode", args.history_mode]
    if args.linear_fallback:
        flags += ["--linear-fallback", args.linear_fallback]
    if args.engine_kind != "mock":  # the broker routes sessions over the replicas (and checks their health)
        for url in args.engine_url:
            flags += ["--engine-url", url]
    return BrokerSupervisor(flags, args.worker_endpoint, args.control)


def _announce_when_healthy(base: str, control: str | None) -> None:
    """Print the READY line once a worker answers /healthz (it then serves the shared socket). A launcher waits
    for that line, so whatever a probe raises is asked again (logged where it is not a refused or timed-out
    connection): a probe's error must not end the thread and leave a healthy serve that never says so."""
    deadline = time.monotonic() + WORKERS_START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/healthz", timeout=2) as reply:
                healthy = reply.status == 200
        except OSError:
            healthy = False
        except Exception:
            logger.exception("asking %s/healthz failed; asking again", base)
            healthy = False
        if healthy:
            print(f"GATEWAY READY base_url={base}/v1" + (f" control={control}" if control else ""), flush=True)
            return
        time.sleep(0.1)
    logger.error("no worker answered %s/healthz within %ss", base, WORKERS_START_TIMEOUT_S)


def _run_workers(args: argparse.Namespace, config: WorkerConfig, control: str | None) -> None:
    os.environ.update(config.to_env())  # spawned workers inherit it; the factory reads it
    os.environ[PARENT_PID_ENV] = str(os.getpid())  # and die with this process (`lifetime`)
    uv_config = uvicorn.Config(
        "gateway_workers.app:create_app_from_env",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
        loop="uvloop",
        http="httptools",
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=30,
        timeout_worker_healthcheck=WORKER_HEALTHCHECK_S,
    )
    sock = uv_config.bind_socket()
    host, port = sock.getsockname()[:2]
    base = f"http://{host}:{port}"
    print(f"rollout-gateway: agents use {base}/v1" + (f", trainers connect to {control}" if control else ""),
          flush=True)
    threading.Thread(target=_announce_when_healthy, args=(base, control), daemon=True).start()
    # Always supervised, even for one worker: the supervisor turns SIGINT/SIGTERM into a clean
    # return (uvicorn.Server.run would re-raise the signal and skip stopping the broker).
    Multiprocess(uv_config, sockets=[sock]).run()


def _check_response_format(args: argparse.Namespace, tokenizer_dir: str) -> None:
    """Refuse to start, before any process is spawned, when the workers could not parse the model's replies."""
    from gateway_workers.formats import ParserUnavailable, resolve_format, template_from_dir

    try:
        template = template_from_dir(tokenizer_dir, args.chat_template)
        name = resolve_format(template, args.response_format, args.allow_plain_text)
    except (ParserUnavailable, OSError, ValueError) as e:
        raise SystemExit(f"rollout-gateway: cannot parse this model's replies: {e}") from None
    logger.info("response format: %s", name)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["broker"]:
        os.execv(sys.executable, [sys.executable, "-m", "broker", *argv[1:]])
    if argv[:1] == ["status"]:  # blocking trainer-side code: nothing of the workers is loaded
        os.execv(sys.executable, [sys.executable, "-m", "trainer_client.status", *argv[1:]])
    args = _parser().parse_args(argv)
    if args.command == "keys":
        _write_keys(args.directory)
        return
    if args.command == "workers":
        curve_keys = _curve_keys(args, {"--broker": args.broker}, broker_host=False)
    else:
        curve_keys = _curve_keys(args, {"--control": args.control, "--worker-endpoint": args.worker_endpoint},
                                 broker_host=True)
    # transformers warns at import that torch is absent; token-in/token-out never needs torch.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from gateway_workers.rendering.tokenizer import prepare_tokenizer_dir

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(process)d %(name)s %(message)s")
    tokenizer_dir = prepare_tokenizer_dir(args.tokenizer)
    if args.command == "workers":
        _check_response_format(args, tokenizer_dir)
        _run_workers(args, _worker_config(args, args.broker, tokenizer_dir, curve_keys), None)
        return
    broker = _broker_supervisor(args, tokenizer_dir, curve_keys)
    # The broker starts (loading its own tokenizer) while a thread resolves the reply format, side by side.
    # The broker is spawned from this thread: it is tied to the thread that spawns it (`die_with_parent`).
    with ThreadPoolExecutor(1, thread_name_prefix="reply-format") as pool:
        checked = pool.submit(_check_response_format, args, tokenizer_dir)
        try:
            worker_endpoint, control = broker.start()
        except BrokerStartError as e:
            checked.result()  # a refused format is the clearer message
            raise SystemExit(f"rollout-gateway: {e}") from None
        try:
            checked.result()
        except SystemExit:
            broker.stop()
            raise
    try:
        _run_workers(args, _worker_config(args, worker_endpoint, tokenizer_dir, curve_keys), control)
    finally:
        broker.stop()


if __name__ == "__main__":
    main()
