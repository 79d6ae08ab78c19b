"""`python -m broker`: the broker process's command line (`rollout-gateway broker` execs exactly this).

Builds one `BrokerConfig` from flags over `ROLLOUT_BROKER_*` environment variables over
defaults, configures logging to stderr, and runs the process (`run_broker`: startup, the
server's loop, signals). With `--state-dir` it first recovers the directory's state (before binding:
no peer reaches a half-recovered broker). Once both sockets are bound it prints one line on stdout,
`BROKER READY worker=<endpoint> control=<endpoint>`, which supervisors parse. Imports `broker.*` only.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
from types import FrameType
from typing import Any

import zmq

from broker import curve, settings
from broker.config import CONFIG_ENV, ENV_PREFIX, BrokerConfig
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
        epilog=_env_epilog(),
    )
    settings.add_flags(p, BrokerConfig)
    return p


def _env_epilog() -> str:
    """--help's last paragraph: the settings only the environment sets, so that it lists every one."""
    unflagged = [e.envs[0] for e in settings.entries(BrokerConfig) if e.flag is None]
    return (
        f"Every setting can also be set as {ENV_PREFIX}<FIELD>; flags win. Settings without a flag: "
        f"{', '.join(unflagged)}. Defaults and meanings: docs/configuration.md."
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
        server.state.warm_up()
    except Exception:
        logger.exception("cannot load the response tokenizer %s", config.tokenizer)
        server.close()
        return 1

    # Startup objects (modules, the response tokenizer's tables) live as long as the process: out of
    # the collector's sight, full collections scan only session state. Everything allocated later is
    # collected as usual (cyclic garbage included).
    gc.collect()
    gc.freeze()
    server.state.trim_start_up_heap()

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

    An empty `--curve-keys` means no keys, whatever a variable says. A broker that `serve` starts gets its whole
    config from `serve` ($ROLLOUT_BROKER_CONFIG) instead, and reads neither flags nor variables.
    """
    handed = os.environ.get(CONFIG_ENV)
    if handed is not None:
        return settings.from_json(BrokerConfig, handed)  # type: ignore[no-any-return]
    return settings.build(BrokerConfig, args)  # type: ignore[no-any-return]


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
