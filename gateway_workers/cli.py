"""`rollout-gateway`: serve (broker + N workers), broker, workers, keys.

`serve` starts the broker as a subprocess (`python -m broker`, watched and restarted on
the same endpoints if it dies: `supervisor`), waits for the endpoints it bound, binds the
agents' HTTP socket once in this process (port 0 works) and runs N uvicorn workers on it
(spawned; each builds its own state in the app lifespan). It prints machine-readable READY
lines, stays in the foreground and, on SIGINT/SIGTERM, lets uvicorn stop the workers, then
stops the broker; neither outlives it, however it ends (`lifetime`). `keys` writes
the CURVE key directory (`broker.curve`) that `--curve-keys` points every component at;
a non-loopback backplane endpoint is refused without it. The flags are made from the settings' declarations
(`broker.settings`: `ServeConfig` and, for `serve`'s broker, `BrokerConfig`), and `serve` hands its broker its
whole `BrokerConfig`. The broker's server is never imported here: of the broker, only its protocol, curve,
settings and config.
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

from broker import curve, settings
from broker.config import BrokerConfig
from gateway_workers.config import ServeConfig, WorkerConfig
from gateway_workers.engines.config import EngineConfig
from gateway_workers.engines.http.client import tls_context
from gateway_workers.lifetime import PARENT_PID_ENV
from gateway_workers.supervisor import BrokerStartError, BrokerSupervisor

logger = logging.getLogger(__name__)

WORKERS_START_TIMEOUT_S = 180.0
WORKER_HEALTHCHECK_S = 60  # a worker loads its tokenizer before it answers uvicorn's pings
EPILOG = "Every setting can also be set by its variable; flags win. Defaults and meanings: docs/configuration.md."
# What `serve` sets on its broker from its own settings (its workers' tokenizer, keys, log level and engines, and
# the restarts its supervisor makes), so the broker's flags for them are not `serve`'s.
SERVE_SETS_ON_BROKER = ("tokenizer", "log_level", "curve_keys", "engine_urls", "restarted")
# `serve`'s own defaults: its broker's worker endpoint is a free local port (only its own workers use it).
SERVE_BROKER_DEFAULTS = {"worker_endpoint": "tcp://127.0.0.1:0"}
BROKER_GROUP = "its broker (every `rollout-gateway broker` setting; ROLLOUT_BROKER_* variables too)"


def _add_serve_flags(p: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
    """The flags of a process that runs workers, grouped: the agents' socket, the workers, their engine, the
    request limits."""
    settings.add_flags(p.add_argument_group("the agents' HTTP socket"), ServeConfig, skip=("worker",))
    settings.add_flags(p.add_argument_group("the workers"), ServeConfig, within="worker",
                       skip=("worker.engine", "worker.limits", *skip))
    settings.add_flags(p.add_argument_group("the engine"), ServeConfig, within="worker.engine")
    settings.add_flags(p.add_argument_group("request limits (a 4xx that names the limit)"), ServeConfig,
                       within="worker.limits")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout-gateway", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="broker + N workers in one command", epilog=EPILOG)
    _add_serve_flags(serve, skip=("worker.broker_endpoint",))
    settings.add_flags(serve.add_argument_group(BROKER_GROUP), BrokerConfig, skip=SERVE_SETS_ON_BROKER,
                       defaults=SERVE_BROKER_DEFAULTS)
    workers = sub.add_parser("workers", help="N workers against a broker running elsewhere", epilog=EPILOG)
    _add_serve_flags(workers)
    sub.add_parser("broker", help="the broker alone (flags: see `rollout-gateway broker --help`)", add_help=False)
    sub.add_parser("status", help="a live view of the gateway from its broker (flags: see `rollout-gateway status "
                                  "--help`)", add_help=False)
    sub.add_parser("pause", help="pause generation around a weight update (flags: see `rollout-gateway pause "
                                 "--help`)", add_help=False)
    sub.add_parser("resume", help="resume generation, optionally under a new weight version (flags: see "
                                  "`rollout-gateway resume --help`)", add_help=False)
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


def _curve_keys(keys: str | None, endpoints: dict[str, str], broker_host: bool) -> str | None:
    """The CURVE key directory (flag, else variable), as an absolute path whose files this command needs were read
    once; refuses a non-loopback endpoint without it. `broker_host`: the broker runs here too (serve), so its keys
    must be too."""
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


def _engine_ca_file(engine: EngineConfig) -> str | None:
    """The engine CA file as an absolute path, checked loadable before workers start."""
    if engine.ca_file is None:
        return None
    path = os.path.abspath(os.path.expanduser(engine.ca_file))
    try:
        tls_context(path)
    except ValueError as e:
        raise SystemExit(f"rollout-gateway: --engine-ca-file: {e}") from None
    if not any(url.lower().startswith("https://") for url in engine.urls):
        logger.warning("an engine CA file is set but no --engine-url is https://; it is not used")
    return path


def _settings(args: argparse.Namespace) -> tuple[ServeConfig, BrokerConfig | None]:
    """The command's settings: flags over variables over defaults (`serve`'s broker's too)."""
    try:
        serve = settings.build(ServeConfig, args)
        if args.command != "serve":
            return serve, None
        return serve, settings.build(BrokerConfig, args, defaults=SERVE_BROKER_DEFAULTS)
    except ValueError as e:
        raise SystemExit(f"rollout-gateway: {e}") from None


def _serve_broker(broker: BrokerConfig, worker: WorkerConfig) -> BrokerConfig:
    """`serve`'s broker: what `serve` sets on it from its workers' settings (`SERVE_SETS_ON_BROKER`)."""
    urls = worker.engine.urls if worker.engine.kind != "mock" else ()  # the broker routes sessions over the replicas
    return replace(broker, tokenizer=worker.tokenizer, log_level=worker.log_level.upper(), curve_keys=worker.curve_keys,
                   engine_urls=urls, state_dir=os.path.abspath(broker.state_dir) if broker.state_dir else None)


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
            # One write, newline included (print's unbuffered text and newline are two): the workers' log lines
            # share this stream and would otherwise land in the middle of the line launchers parse.
            sys.stdout.write(f"GATEWAY READY base_url={base}/v1" + (f" control={control}" if control else "") + "\n")
            sys.stdout.flush()
            return
        time.sleep(0.1)
    logger.error("no worker answered %s/healthz within %ss", base, WORKERS_START_TIMEOUT_S)


def _run_workers(serve: ServeConfig, config: WorkerConfig, control: str | None) -> None:
    os.environ.update(config.to_env())  # spawned workers inherit it; the factory reads it
    os.environ[PARENT_PID_ENV] = str(os.getpid())  # and die with this process (`lifetime`)
    uv_config = uvicorn.Config(
        "gateway_workers.app:create_app_from_env",
        factory=True,
        host=serve.host,
        port=serve.port,
        workers=serve.workers,
        loop="uvloop",
        http="httptools",
        log_level=config.log_level.lower(),
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


def _check_response_format(config: WorkerConfig) -> None:
    """Refuse to start, before any process is spawned, when the workers could not parse the model's replies."""
    from gateway_workers.formats import ParserUnavailable, resolve_format, template_from_dir

    try:
        assert config.tokenizer is not None
        template = template_from_dir(config.tokenizer, config.chat_template)
        name = resolve_format(template, config.response_format, config.allow_plain_text)
    except (ParserUnavailable, OSError, ValueError) as e:
        raise SystemExit(f"rollout-gateway: cannot parse this model's replies: {e}") from None
    logger.info("response format: %s", name)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["broker"]:
        os.execv(sys.executable, [sys.executable, "-m", "broker", *argv[1:]])
    if argv[:1] == ["status"]:  # blocking trainer-side code: nothing of the workers is loaded
        os.execv(sys.executable, [sys.executable, "-m", "trainer_client.status", *argv[1:]])
    if argv[:1] in (["pause"], ["resume"]):
        os.execv(sys.executable, [sys.executable, "-m", "trainer_client.generation_cli", *argv])
    args = _parser().parse_args(argv)
    if args.command == "keys":
        _write_keys(args.directory)
        return
    serve, broker = _settings(args)
    worker = serve.worker
    if broker is None:
        curve_keys = _curve_keys(worker.curve_keys, {"--broker": worker.broker_endpoint}, broker_host=False)
    else:
        curve_keys = _curve_keys(worker.curve_keys, {"--control": broker.control_endpoint,
                                                     "--worker-endpoint": broker.worker_endpoint}, broker_host=True)
    # transformers warns at import that torch is absent; token-in/token-out never needs torch.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from gateway_workers.rendering.tokenizer import prepare_tokenizer_dir

    logging.basicConfig(level=worker.log_level.upper(), format="%(asctime)s %(process)d %(name)s %(message)s")
    worker = replace(worker, tokenizer=prepare_tokenizer_dir(worker.tokenizer), curve_keys=curve_keys,
                     engine=replace(worker.engine, ca_file=_engine_ca_file(worker.engine)))
    if broker is None:
        _check_response_format(worker)
        _run_workers(serve, worker, None)
        return
    supervisor = BrokerSupervisor(_serve_broker(broker, worker))
    # The broker starts (loading its own tokenizer) while a thread resolves the reply format, side by side.
    # The broker is spawned from this thread: it is tied to the thread that spawns it (`die_with_parent`).
    with ThreadPoolExecutor(1, thread_name_prefix="reply-format") as pool:
        checked = pool.submit(_check_response_format, worker)
        try:
            worker_endpoint, control = supervisor.start()
        except BrokerStartError as e:
            checked.result()  # a refused format is the clearer message
            raise SystemExit(f"rollout-gateway: {e}") from None
        try:
            checked.result()
        except SystemExit:
            supervisor.stop()
            raise
    try:
        _run_workers(serve, replace(worker, broker_endpoint=worker_endpoint), control)
    finally:
        supervisor.stop()


if __name__ == "__main__":
    main()
