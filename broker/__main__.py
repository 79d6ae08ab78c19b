"""`python -m broker`: the broker process's command line (`rollout-gateway broker` execs exactly this).

Builds one `BrokerConfig` from flags over `ROLLOUT_BROKER_*` environment variables over
defaults, configures logging to stderr, and runs the process (`run_broker`: startup, the
server's loop, signals). With `--state-dir` it first recovers the directory's state (before binding:
no peer reaches a half-recovered broker). Once both sockets are bound it prints one line on stdout,
`BROKER READY worker=<endpoint> control=<endpoint>`, which supervisors parse. Imports `broker.*` only.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import signal
import sys
from types import FrameType
from typing import Any

import zmq

from broker import curve, protocol
from broker.config import ENV_PREFIX, FSYNC_POLICIES, BrokerConfig
from broker.durability.records import RecordError
from broker.durability.store import StateDirError
from broker.durability.wal import CorruptLog
from broker.server import BrokerServer

# Run as `python -m broker`, this module is `__main__`: the process's lines keep the name they have
# always carried, the server's.
logger = logging.getLogger("broker.server")

READY_LINE = "BROKER READY worker={worker} control={control}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m broker",
        description="rollout-gateway broker: sessions and trajectories",
    )
    p.add_argument(
        "--worker-endpoint",
        default=None,
        metavar="ENDPOINT",
        help=f"ZeroMQ endpoint to bind for gateway workers (default {protocol.DEFAULT_WORKER_ENDPOINT}; port 0 ok)",
    )
    p.add_argument(
        "--control",
        default=None,
        metavar="ENDPOINT",
        help=f"ZeroMQ endpoint to bind for trainer clients (default {protocol.DEFAULT_CONTROL_ENDPOINT}; port 0 ok)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="tokenizer.json (or its directory) to decode rows' response text (default: none, response stays empty)",
    )
    p.add_argument("--log-level", default=None, metavar="LEVEL", help="DEBUG, INFO, WARNING, ERROR (default INFO)")
    p.add_argument("--max-sessions", type=int, default=None, metavar="N", help="open sessions at most (default 100000)")
    p.add_argument(
        "--max-turns-cap", type=int, default=None, metavar="N", help="hard cap on turns per session (default none)"
    )
    p.add_argument(
        "--max-wait-timeout",
        type=float,
        default=None,
        metavar="S",
        help="ceiling on a finish's wait_timeout, seconds (default 600)",
    )
    p.add_argument(
        "--outbox-max-episodes",
        type=int,
        default=None,
        metavar="N",
        help="finished episodes held for subscribers at most; further request_finish / agent finishes are "
        "refused as busy until subscribers acknowledge some (default 10000)",
    )
    p.add_argument(
        "--outbox-max-bytes",
        type=int,
        default=None,
        metavar="BYTES",
        help="approximate row bytes held for subscribers; further finishes are refused as busy (default 2 GiB)",
    )
    p.add_argument(
        "--state-dir",
        default=None,
        metavar="DIR",
        help="durable broker: keep a write-ahead log and snapshots in DIR (created if missing, one broker per "
        "directory) and recover every open session, acknowledged turn and unacknowledged episode from it on start "
        "(default: in memory only)",
    )
    p.add_argument(
        "--fsync",
        default=None,
        choices=FSYNC_POLICIES,
        help="with --state-dir, when the log is synced to disk (a process crash loses nothing acknowledged under "
        "any): always (before each batch of replies; a power loss loses nothing acknowledged), interval (every "
        "100 ms, the default; a power loss loses up to that), never (the OS decides)",
    )
    p.add_argument(
        "--history-mode",
        default=None,
        choices=protocol.HISTORY_MODES,
        help="how sessions that do not choose build their prompts: tree (the chat template renders the request's "
        "messages; the default) or linear (a request that extends the session's previous turn is prompted with the "
        "ids the engine saw plus the rendering of only the new messages: one row per append-only episode)",
    )
    p.add_argument(
        "--linear-fallback",
        default=None,
        choices=protocol.LINEAR_FALLBACKS,
        help="what a linear session's request that does not extend it gets: fork (a full render starting a new "
        "line; the default), rerender (a full render that becomes its one line) or reject (a 400 naming the first "
        "message that differs)",
    )
    p.add_argument(
        "--engine-url",
        action="append",
        dest="engine_urls",
        default=None,
        metavar="URL",
        help="an engine replica sessions are routed to (repeat it): a new session goes to the least-loaded healthy "
        "one and stays there until it ends; replicas failing their /health check are taken out "
        f"(env {ENV_PREFIX}ENGINE_URLS, space- or comma-separated; default none: the workers route by their own "
        "--engine-url lists)",
    )
    p.add_argument(
        "--restarted",
        action="store_true",
        default=None,
        help="this broker replaces one that ran before (serve's supervisor sets ROLLOUT_BROKER_RESTARTED): without "
        "--state-dir, requests for sessions it never saw are refused saying the earlier state was not durable",
    )
    p.add_argument(
        "--curve-keys",
        default=None,
        metavar="DIR",
        help="the key directory of `rollout-gateway keys`: both endpoints use CURVE and accept only the keys in its "
        f"authorized_workers/ and authorized_trainers/ (env {curve.CURVE_KEYS_ENV}, else "
        f"{ENV_PREFIX}CURVE_KEYS); required for a non-loopback endpoint",
    )
    # Named from the flags themselves, so a setting that gains a flag leaves this list by itself.
    p.epilog = _env_epilog({_FIELD_OF_DEST.get(a.dest, a.dest) for a in p._actions})
    return p


# The one flag whose dest is not the name of the BrokerConfig field it sets.
_FIELD_OF_DEST = {"control": "control_endpoint"}


def _env_epilog(flagged: set[str]) -> str:
    """--help's last paragraph: the settings only the environment sets, so that it lists every one."""
    unflagged = [ENV_PREFIX + f.name.upper() for f in dataclasses.fields(BrokerConfig) if f.name not in flagged]
    return (
        f"Every setting can also be set as {ENV_PREFIX}<FIELD> (a BrokerConfig field in broker/config.py, e.g. "
        f"{ENV_PREFIX}MAX_SESSIONS); flags win. Settings without a flag: {', '.join(unflagged)}. "
        "Defaults and meanings: README.md, Configuration."
    )


def run_broker(config: BrokerConfig, *, out: Any = None) -> int:
    """Bind, print the READY line, serve until SIGINT/SIGTERM; the process entry point. Returns an exit code."""
    server = BrokerServer(config)
    try:
        durable = server.open_state()
    except (StateDirError, CorruptLog, RecordError, OSError) as e:
        logger.error("cannot recover the state directory %s: %s", config.state_dir, e)
        return 1
    if durable is not None:
        _log_recovery(server)
    try:
        worker, control = server.bind()
    except (zmq.ZMQError, curve.CurveError) as e:
        logger.error("%s", e)
        if server.durable is not None:
            server.durable.close()
        return 1

    try:
        # Load the response tokenizer now: lazily, the first finish would stall the loop for
        # seconds (every worker's OPEN waiting behind it), and a bad file should fail at start.
        server.warm_up()
    except Exception:
        logger.exception("cannot load the response tokenizer %s", config.tokenizer)
        server.close()
        return 1

    # Startup objects (modules, the response tokenizer's tables) live as long as the process: out of
    # the collector's sight, full collections scan only session state. Everything allocated later is
    # collected as usual (cyclic garbage included).
    gc.collect()
    gc.freeze()
    server.trim_start_up_heap()

    def handle_signal(signum: int, frame: FrameType | None) -> None:
        server.request_exit()

    previous = {sig: signal.signal(sig, handle_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        logger.info("broker serving workers on %s, trainers on %s", worker, control)
        if config.curve_keys is not None:
            logger.info("CURVE on both endpoints: keys in %s", config.curve_keys)
        stream = out if out is not None else sys.stdout
        print(READY_LINE.format(worker=worker, control=control), file=stream, flush=True)
        server.run()
    except Exception:
        logger.exception("the broker loop failed")
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _log_recovery(server: BrokerServer) -> None:
    durable = server.durable
    assert durable is not None
    rec, fsync = durable.recovered, server.config.fsync
    if rec is None:
        logger.info("state directory %s is new (fsync=%s)", durable.directory, fsync)
        return
    sessions, episodes = server.registry.stats(), server.outbox.stats()
    logger.info(
        "recovered from %s in %.3f s: %d sessions, %d turns, %d episodes (snapshot %d bytes, then %d log records "
        "in %d bytes; fsync=%s)",
        durable.directory, rec.seconds, sessions["sessions_open"] + sessions["sessions_closing"],
        sessions["turns_held"], episodes["outbox_episodes"], rec.snapshot_bytes, rec.records, rec.log_bytes, fsync,
    )  # fmt: skip
    if rec.refused:
        logger.warning("%d log records were refused on replay (see the warnings above)", rec.refused)


def config_from_args(args: argparse.Namespace) -> BrokerConfig:
    """The broker's settings: flags, else `ROLLOUT_BROKER_<FIELD>` variables, else defaults; raises ValueError.

    An empty `--curve-keys` means no keys (`serve` passes it to a broker of its own without CURVE), so no
    variable may turn CURVE on for that broker alone: its workers would not get in.
    """
    config = BrokerConfig.from_env(
        worker_endpoint=args.worker_endpoint,
        control_endpoint=args.control,
        tokenizer=args.tokenizer,
        log_level=args.log_level,
        max_sessions=args.max_sessions,
        max_turns_cap=args.max_turns_cap,
        max_wait_timeout=args.max_wait_timeout,
        outbox_max_episodes=args.outbox_max_episodes,
        outbox_max_bytes=args.outbox_max_bytes,
        curve_keys=curve.keys_from_env(args.curve_keys),
        state_dir=args.state_dir,
        fsync=args.fsync,
        history_mode=args.history_mode,
        linear_fallback=args.linear_fallback,
        engine_urls=tuple(args.engine_urls) if args.engine_urls else None,
        restarted=args.restarted,
    )
    return dataclasses.replace(config, curve_keys=None) if args.curve_keys == "" else config


def main(argv: list[str] | None = None) -> int:
    """Parse flags, build the config, run the broker; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"broker: {e}", file=sys.stderr)
        return 2
    if config.tokenizer is not None and not os.path.exists(config.tokenizer):
        # Fail at startup, not at the first finish_session an hour into training.
        print(f"broker: --tokenizer {config.tokenizer!r} does not exist", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
    )
    return run_broker(config)


if __name__ == "__main__":
    sys.exit(main())
