"""A real broker process compresses a session's logs once they are old, and its rows stay byte-identical.

Two `python -m broker` subprocesses take the same episode: one with idle-time compaction and heap
trimming off, one with both on (`ROLLOUT_BROKER_COMPACT_AGE_S`, `ROLLOUT_BROKER_COMPACT_MIN_BYTES`,
`ROLLOUT_BROKER_TRIM_MIN_BYTES`, `ROLLOUT_BROKER_TRIM_INTERVAL_S` from the environment). Nothing
is compressed right after the commits; once the bytes are old enough the broker compresses them by
itself and then trims its heap (glibc), and finishing the session then gives exactly the rows of
the broker that never compressed nor trimmed anything.
"""

from __future__ import annotations

import time

import zmq
from component.peers import WorkerPeer, assert_linear_rows, conversation
from processes import start_broker

from broker import protocol
from broker.sessions.heap_trim import glibc_malloc_trim
from trainer_client import TrainerClient

AGE_S = 2.0  # long enough that the commits and the first stats call surely fit before it
COMPACTED_TIMEOUT_S = 20.0
POLL_S = 0.1
TRIM_MIN_BYTES = 64 * 1024


def test_an_old_session_is_compressed_by_the_broker_and_finishes_byte_identical():
    turns = conversation(7, 12, first_prompt=3000, tail=1500, output=200)  # ~22k tokens, ~0.3 MB of logs
    plain = start_broker(env={"ROLLOUT_BROKER_COMPACT_IDLE": "0", "ROLLOUT_BROKER_TRIM_MIN_BYTES": "0"})
    cold = start_broker(
        env={
            "ROLLOUT_BROKER_COMPACT_AGE_S": str(AGE_S),
            "ROLLOUT_BROKER_COMPACT_MIN_BYTES": "65536",
            "ROLLOUT_BROKER_TRIM_MIN_BYTES": str(TRIM_MIN_BYTES),
            "ROLLOUT_BROKER_TRIM_INTERVAL_S": "0",
        }
    )
    can_trim = glibc_malloc_trim() is not None  # the broker runs on this same C library
    ctx = zmq.Context()
    try:
        records = []
        for proc, worker_ep, control_ep in (plain, cold):
            with TrainerClient(control_ep, timeout=10) as client:
                # a trimming broker gives back what its start-up freed (the tokenizer's load) before serving
                at_start = client.stats()
                assert at_start["heap_trims"] == (1 if proc is cold[0] and can_trim else 0)
                assert (at_start["heap_trim_released_bytes"] > 0) is (proc is cold[0] and can_trim)
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
                    # all but the last two turns' appends go cold, a 16 KiB chunk at a time, and then the
                    # idle session's tail: polled until done (a loaded machine may be read mid-way)
                    now = client.stats()
                    while (
                        now["bytes_compacted"] < 0.6 * stats["tokens_held"] * 4
                        or now["bytes_held"] >= stats["bytes_held"] * 0.85
                    ):
                        assert time.monotonic() < deadline, f"not compressed: {now} (before: {stats})"
                        time.sleep(POLL_S)
                        now = client.stats()
                    # what compaction freed goes back to the OS in the idle time that follows, by trims
                    # that leave less than their threshold untrimmed
                    assert_trimmed(client, can_trim)
                else:
                    assert client.stats()["bytes_compacted"] == 0
                    assert client.stats()["heap_trim_enabled"] is False
                before = client.stats()
                records.append(client.finish_session(sid, reward=1.0, rollout_id="ep"))
                after = client.stats()
                assert after["bytes_freed"] - before["bytes_freed"] >= before["bytes_held"] > 0  # its logs went too
                if proc is plain[0]:
                    assert after["heap_trims"] == 0
                worker.close()
        assert_linear_rows(records[1], turns)
        assert len(records[0]) == len(records[1]) == 1
        assert records[0] == records[1]  # every field: ids, loss mask, logprobs (exact floats), text, metadata
    finally:
        ctx.destroy(linger=0)
        for proc, _, _ in (plain, cold):
            proc.stop()


def assert_trimmed(client: TrainerClient, can_trim: bool) -> None:
    """Wait until the broker has trimmed what compaction freed (or, without malloc_trim, check it never trims)."""
    stats = client.stats()
    assert stats["heap_trim_enabled"] is can_trim
    assert stats["bytes_freed"] >= stats["bytes_compacted"] > 0
    if not can_trim:
        assert stats["heap_trims"] == 0 and stats["bytes_freed_since_trim"] == stats["bytes_freed"]
        return
    deadline = time.monotonic() + COMPACTED_TIMEOUT_S
    while not (stats["heap_trims"] >= 2 and stats["bytes_freed_since_trim"] < TRIM_MIN_BYTES):  # start-up's + idle
        assert time.monotonic() < deadline, f"not trimmed: {stats}"
        time.sleep(POLL_S)
        stats = client.stats()
    assert 0 < stats["heap_trim_pause_ms_last"] <= stats["heap_trim_pause_ms_max"] <= stats["heap_trim_pause_ms_total"]
