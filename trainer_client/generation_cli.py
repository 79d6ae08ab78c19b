"""`rollout-gateway pause` and `rollout-gateway resume`: a trainer's pause and resume of generation, from a shell.

`pause` returns once every worker has stopped sending to the engines and prints the report as one JSON object
(exit status 1, with the report, when they were not idle within --timeout: the pause stays in force); `resume`
prints whether generation was paused. Both speak to the broker's control endpoint like `TrainerClient`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from broker import protocol
from trainer_client.client import DEFAULT_PAUSE_TIMEOUT_S, TrainerClient
from trainer_client.errors import GatewayError, PauseTimeout


def _parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"rollout-gateway {command}", description=__doc__.splitlines()[0])
    parser.add_argument("--control", default=protocol.DEFAULT_CONTROL_ENDPOINT, metavar="ENDPOINT",
                        help="the broker's control endpoint (default %(default)s)")
    parser.add_argument("--curve-keys", default=None, metavar="DIR",
                        help="a key directory with broker.key and trainer.key_secret (default: "
                        "$ROLLOUT_GATEWAY_CURVE_KEYS; none on loopback)")  # fmt: skip
    if command == "pause":
        parser.add_argument("--mode", required=True, choices=protocol.PAUSE_MODES,
                            help="what becomes of the generations in flight: wait lets them finish, abort stops "
                            "them and keeps their tokens for the resume, keep uses the engines' own pause")
        parser.add_argument("--timeout", type=float, default=DEFAULT_PAUSE_TIMEOUT_S, metavar="S",
                            help="seconds to wait for the workers to go idle (default %(default)s)")
    else:
        parser.add_argument("--weight-version", type=int, default=None, metavar="N",
                            help="the policy version the held turns sample under (default: unchanged)")
    return parser


def main(argv: list[str]) -> int:
    command = argv[0] if argv else ""
    if command not in ("pause", "resume"):
        raise SystemExit("usage: rollout-gateway pause|resume [--help]")
    args = _parser(command).parse_args(argv[1:])
    try:
        client = TrainerClient(args.control, timeout=10.0, curve_keys=args.curve_keys)
    except ValueError as e:
        raise SystemExit(f"rollout-gateway {command}: {e}") from None
    try:
        if command == "pause":
            try:
                report = client.pause_generation(args.mode, args.timeout)
            except PauseTimeout as e:
                print(json.dumps({"idle": False, **dataclasses.asdict(e.report)}), flush=True)
                print(f"rollout-gateway pause: {e}", file=sys.stderr)
                return 1
            print(json.dumps({"idle": True, **dataclasses.asdict(report)}), flush=True)
        else:
            print(json.dumps({"was_paused": client.resume_generation(args.weight_version)}), flush=True)
        return 0
    except (GatewayError, ValueError) as e:
        raise SystemExit(f"rollout-gateway {command}: {e}") from None
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
