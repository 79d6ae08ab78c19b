"""A real broker subprocess (`python -m broker`) driven by a test-side worker and `TrainerClient`.

The worker side is a plain zmq DEALER speaking `broker.protocol`; the trainer side is
the real client, shared by many threads. Covers concurrency with every record
accounted for, reconnect after a broker restart, timeouts that raise the named error
within their bound, clean SIGTERM shutdown, CLI errors, and response decoding with
the real Qwen tokenizer.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
import time

import pytest
import zmq
from component.peers import WorkerPeer, assert_linear_rows, conversation
from processes import TestProcess, start_broker

from broker import protocol
from trainer_client import BrokerTimeout, TrainerClient, UnknownSession


@pytest.fixture
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def broker():
    proc, worker_ep, control_ep = start_broker()
    with proc:
        yield proc, worker_ep, control_ep


def run_session(client: TrainerClient, worker: WorkerPeer, seed: int, n_turns: int, tag: str) -> None:
    sid = client.open_session(sampling_defaults={"seed": seed}, metadata={"tag": tag})
    turns = conversation(seed, n_turns, first_prompt=30, tail=6, output=5)
    for k, turn in enumerate(turns):
        opened = worker.open_turn(sid, f"t{k}")
        assert isinstance(opened, protocol.TurnOpened) and opened.sampling_defaults == {"seed": seed}
        assert worker.commit(sid, f"t{k}", turn).outcome == "stored"
    records = client.finish_session(sid, reward=float(seed), rollout_id=tag)
    assert_linear_rows(records, turns)
    assert records[0].reward == float(seed) and records[0].rollout_id == tag and records[0].metadata["tag"] == tag


def test_eight_trainer_threads_times_100_sessions_every_record_accounted_for(broker, zctx):
    proc, worker_ep, control_ep = broker
    threads, sessions, turns = 8, 100, 3
    done: list[int] = []
    failures: list[BaseException] = []
    with TrainerClient(control_ep, timeout=30) as client:

        def trainer(i: int) -> None:
            worker = WorkerPeer(zctx, worker_ep)  # each trainer thread drives its own agent traffic
            try:
                for j in range(sessions):
                    run_session(client, worker, seed=i * 1000 + j, n_turns=turns, tag=f"{i}-{j}")
                    done.append(1)
            except BaseException as e:  # reported below, with the broker's output
                failures.append(e)
            finally:
                worker.close()

        pool = [threading.Thread(target=trainer, args=(i,)) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join(100)
        assert not any(t.is_alive() for t in pool), "trainer threads hung"
        if failures:
            raise failures[0]
        assert len(done) == threads * sessions
        stats = client.stats()
    assert stats["sessions_finished"] == threads * sessions
    assert stats["commits_stored"] == threads * sessions * turns
    assert (stats["sessions_open"], stats["turns_in_flight"], stats["bytes_held"]) == (0, 0, 0)
    assert stats["refusals"] == {} and stats["protocol_errors"] == 0


def test_client_reconnects_by_itself_after_a_broker_restart(zctx):
    proc, worker_ep, control_ep = start_broker()
    with TrainerClient(control_ep, timeout=2.0) as client:
        try:
            sid = client.open_session()
            assert client.stats()["sessions_open"] == 1  # this socket now idles in the pool
            proc.kill()
            proc.wait(10)
            # a restarted broker on the same endpoints: the pooled socket reconnects by itself
            proc, _, _ = start_broker(worker=worker_ep, control=control_ep)
            assert client.stats()["sessions_open"] == 0
            with pytest.raises(UnknownSession):  # the old broker's sessions died with it
                client.finish_session(sid)
            # a call while the broker is down times out; the next one after a restart works
            proc.kill()
            proc.wait(10)
            t0 = time.monotonic()
            with pytest.raises(BrokerTimeout):
                client.stats()
            assert 2.0 <= time.monotonic() - t0 < 4.0
            proc, _, _ = start_broker(worker=worker_ep, control=control_ep)
            worker = WorkerPeer(zctx, worker_ep)
            try:
                run_session(client, worker, seed=5, n_turns=2, tag="after-restart")
            finally:
                worker.close()
        finally:
            proc.stop()


def test_calls_time_out_with_the_named_error_within_their_bound(zctx):
    silent = zctx.socket(zmq.ROUTER)  # bound, accepts, never answers
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    with TrainerClient(f"tcp://127.0.0.1:{port}", timeout=0.5) as client:
        for call, bound in [
            (lambda: client.stats(), 0.5),
            (lambda: client.open_session(), 0.5),
            (lambda: client.finish_session("s", wait_timeout=0.4), 0.9),  # its deadline includes wait_timeout
        ]:
            t0 = time.monotonic()
            with pytest.raises(BrokerTimeout, match="no reply"):
                call()
            elapsed = time.monotonic() - t0
            assert bound <= elapsed < bound + 1.0, elapsed
    got = 0
    while silent.poll(100):
        silent.recv_multipart()
        got += 1
    assert got == 3  # the requests did go out
    silent.close()
    # nothing listening at all
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    with TrainerClient(f"tcp://127.0.0.1:{free_port}", timeout=0.3) as client:
        with pytest.raises(BrokerTimeout):
            client.drop_session("x")


def test_sigterm_answers_a_parked_finish_and_exits_cleanly(zctx):
    proc, worker_ep, control_ep = start_broker()
    with proc, TrainerClient(control_ep, timeout=10) as client:
        worker = WorkerPeer(zctx, worker_ep)
        try:
            sid = client.open_session()
            turns = conversation(3, 2)
            for k, turn in enumerate(turns):
                worker.open_turn(sid, f"t{k}")
                worker.commit(sid, f"t{k}", turn)
            worker.open_turn(sid, "in-flight")
        finally:
            worker.close()
        result: dict = {}
        finisher = threading.Thread(target=lambda: result.update(records=client.finish_session(sid, wait_timeout=60)))
        finisher.start()
        deadline = time.monotonic() + 10
        while client.stats()["finishes_parked"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        finisher.join(10)
        assert_linear_rows(result["records"], turns)
        assert result["records"][0].metadata["drain_status"] == "drain_timeout"
        proc.expect("broker stopped", 1)


def test_cli_refuses_bad_arguments_clearly(tmp_path):
    with TestProcess([sys.executable, "-m", "broker", "--tokenizer", str(tmp_path / "nope.json")]) as p:
        assert p.wait(30) == 2
        p.expect("does not exist", 1)
    env = {"ROLLOUT_BROKER_MAX_SESSIONS": "lots"}
    with TestProcess([sys.executable, "-m", "broker"], env=env) as p:
        assert p.wait(30) == 2
        p.expect("ROLLOUT_BROKER_MAX_SESSIONS='lots'", 1)  # the error names the variable
    proc, worker_ep, control_ep = start_broker()
    with proc:
        with TestProcess([sys.executable, "-m", "broker", "--worker-endpoint", worker_ep]) as second:
            assert second.wait(30) == 1
            second.expect(f"cannot bind {worker_ep}", 1)


def test_rows_carry_response_text_decoded_with_the_real_tokenizer(qwen3_tokenizer_dir, qwen3_tokenizer, zctx):
    proc, worker_ep, control_ep = start_broker("--tokenizer", qwen3_tokenizer_dir)
    text = "<think>\nshort</think>\n\nThe answer is 4.<|im_end|>"
    prompt = qwen3_tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True)
    prompt_ids = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    out = qwen3_tokenizer.encode(text, add_special_tokens=False)
    worker = WorkerPeer(zctx, worker_ep)
    with proc, TrainerClient(control_ep, timeout=30) as client:
        try:
            sid = client.open_session()
            worker.open_turn(sid, "t0")
            reply = worker.request(
                protocol.CommitTurn(
                    worker.next_id(),
                    sid,
                    "t0",
                    protocol.ids_array(prompt_ids),
                    protocol.ids_array(out),
                    protocol.logprobs_array([-0.125] * len(out)),
                    "stop",
                    [{"role": "user", "content": "2+2?"}],
                    {"role": "assistant", "content": "The answer is 4.", "reasoning": "short"},
                )
            )
            assert reply.outcome == "stored"
            (record,) = client.finish_session(sid)
        finally:
            worker.close()
    assert record.response == text
    assert record.prompt_ids == list(prompt_ids) and record.response_ids == out
