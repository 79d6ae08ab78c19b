"""A real broker process compresses a session's logs once they are old, and its rows stay byte-identical.

Two `python -m broker` subprocesses take the same episode: one with idle-time compaction off,
one with it on (`ROLLOUT_BROKER_COMPACT_AGE_S`, `ROLLOUT_BROKER_COMPACT_MIN_BYTES` from the
environment). Nothing is compressed right after the commits; once the bytes are old enough the
broker compresses them by itself, and finishing the session then gives exactly the rows of the
broker that never compressed anything.
"""

from __future__ import annotations

import time

import zmq
from component.peers import WorkerPeer, assert_linear_rows, conversation
from processes import start_broker

from broker import protocol
from trainer_client import TrainerClient

AGE_S = 2.0  # long enough that the commits and the first stats call surely fit before it
COMPACTED_TIMEOUT_S = 20.0
POLL_S = 0.1


def test_an_old_session_is_compressed_by_the_broker_and_finishes_byte_identical():
    turns = conversation(7, 12, first_prompt=3000, tail=1500, output=200)  # ~22k tokens, ~0.3 MB of logs
    plain = start_broker(env={"ROLLOUT_BROKER_COMPACT_IDLE": "0"})
    cold = start_broker(env={"ROLLOUT_BROKER_COMPACT_AGE_S": str(AGE_S), "ROLLOUT_BROKER_COMPACT_MIN_BYTES": "65536"})
    ctx = zmq.Context()
    try:
        records = []
        for proc, worker_ep, control_ep in (plain, cold):
            with TrainerClient(control_ep, timeout=10) as client:
                worker = WorkerPeer(ctx, worker_ep)
                sid = client.open_session()
                started = time.monotonic()
                for k, turn in enumerate(turns):
                    assert isinstance(worker.open_turn(sid, f"t{k}"), protocol.TurnOpened)
                    assert worker.commit(sid, f"t{k}", turn).outcome == "stored"
                stats = client.stats()
                if time.monotonic() - started < AGE_S:  # (always, unless this machine stalled for seconds)
                    assert stats["bytes_compacted"] == 0  # young bytes are left alone
                if proc is cold[0]:
                    deadline = time.monotonic() + COMPACTED_TIMEOUT_S
                    # all but the last two turns' appends go cold, a 16 KiB chunk at a time
                    while client.stats()["bytes_compacted"] < 0.6 * stats["tokens_held"] * 4:
                        assert time.monotonic() < deadline, f"not compressed: {client.stats()}"
                        time.sleep(POLL_S)
                    held = client.stats()["bytes_held"]
                    assert held < stats["bytes_held"] * 0.85, (held, stats["bytes_held"])
                else:
                    assert client.stats()["bytes_compacted"] == 0
                records.append(client.finish_session(sid, reward=1.0, rollout_id="ep"))
                worker.close()
        assert_linear_rows(records[1], turns)
        assert len(records[0]) == len(records[1]) == 1
        assert records[0] == records[1]  # every field: ids, loss mask, logprobs (exact floats), text, metadata
    finally:
        ctx.destroy(linger=0)
        for proc, _, _ in (plain, cold):
            proc.stop()
