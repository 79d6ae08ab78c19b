"""A subscriber in its own process, for the process tests: `python tests/process/episode_subscriber.py ...`.

Connects a `TrainerClient` to the control endpoint, iterates `episodes()` and prints one line
per episode, `EPISODE <session id>`; with `--out`, it also appends the whole episode there as a
JSON line (session id, redelivered, status, reward, finished_by, rows as plain dicts).
Stops cleanly (acknowledging the last episode) once `--stop-file` exists, or, with
`--hold-after N`, prints `HOLDING` after its N-th episode and sleeps until it is killed
(holding that episode and its prefetched ones unacknowledged). Stdlib + trainer_client only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, when not pip-installed

from trainer_client import EpisodeTimeout, TrainerClient  # noqa: E402

POLL_S = 0.2  # how often the stop file is looked at while no episode comes
HOLD_S = 600.0  # "forever": the test kills us long before


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--control", required=True)
    p.add_argument("--max-pending", type=int, default=2)
    p.add_argument("--lease", type=float, default=30.0)
    p.add_argument("--stop-file", default=None)
    p.add_argument("--out", default=None, help="append each episode here as a JSON line")
    p.add_argument("--hold-after", type=int, default=0)
    p.add_argument("--delay", type=float, default=0.0, help="seconds spent on each episode")
    args = p.parse_args()
    with TrainerClient(args.control, timeout=10) as client:
        with client.episodes(timeout=POLL_S, max_pending=args.max_pending, lease=args.lease) as stream:
            print("SUBSCRIBER READY", flush=True)
            count = 0
            while not (args.stop_file and os.path.exists(args.stop_file)):
                try:
                    episode = next(stream)
                except EpisodeTimeout:
                    continue
                count += 1
                line = {
                    "session_id": episode.session_id,
                    "redelivered": episode.redelivered,
                    "status": episode.status,
                    "reward": episode.reward,
                    "finished_by": episode.finished_by,
                    "rows": [dataclasses.asdict(r) for r in episode.rows],
                }
                if args.out:
                    with open(args.out, "a") as out:  # written before it is announced
                        out.write(json.dumps(line) + "\n")
                print(f"EPISODE {episode.session_id} redelivered={episode.redelivered}", flush=True)
                time.sleep(args.delay)
                if count == args.hold_after:
                    print(f"HOLDING {stream.pending}", flush=True)
                    time.sleep(HOLD_S)
    print("SUBSCRIBER DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
