"""A CURVE backplane across real processes: `python -m broker` bound to all interfaces with keys, the real
worker `Backplane` and `TrainerClient`, `rollout-gateway keys`, and `serve` end to end with the openai SDK.

With the keys of `rollout-gateway keys` a trainer opens a session and a worker records a turn through a
broker bound to 0.0.0.0; a trainer with no key, an unknown key, the worker's key or the wrong broker key
is refused with `AuthenticationFailed`, and so is a worker with an unknown key,
whose turns never land; a broker, `serve` or `workers` asked for a non-loopback endpoint without keys
refuses to start. Every wait has a deadline; every process is stopped.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from component.peers import SyntheticTurn, assert_linear_rows, conversation
from processes import TestProcess, launch_gateway, start_broker

from broker import curve, protocol
from gateway_workers.capture import backplane as backplane_module
from gateway_workers.capture.backplane import Backplane, BrokerUnavailable
from trainer_client import AuthenticationFailed, TrainerClient
from trainer_client.launcher import GatewayStartError

CALL_TIMEOUT_S = 10.0
REFUSED_TIMEOUT_S = 1.5  # how long a refused worker's OPEN waits here
EXIT_TIMEOUT_S = 30.0
NO_KEYS = {curve.CURVE_KEYS_ENV: ""}  # whatever the test runner's environment says


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("curve") / "keys"
    curve.create_keys(directory)
    return directory


@pytest.fixture(scope="module")
def broker(keys: Path) -> Iterator[tuple[TestProcess, str, str]]:
    proc, worker, control = start_broker(
        "--curve-keys", str(keys), worker="tcp://0.0.0.0:0", control="tcp://0.0.0.0:0", env=NO_KEYS
    )
    with proc:
        # bound to every interface, reached here through loopback
        yield proc, worker.replace("0.0.0.0", "127.0.0.1"), control.replace("0.0.0.0", "127.0.0.1")


def _host_dir(tmp_path: Path, broker_key: Path, role: str, secret: Path) -> Path:
    """What a worker or trainer host holds: the broker's public key and one secret, under `role`'s name."""
    directory = tmp_path / f"{role}-host"
    directory.mkdir()
    shutil.copy(broker_key, directory / "broker.key")
    shutil.copy(secret, directory / f"{role}.key_secret")
    return directory


def _commit(sid: str, turn_id: str, turn: SyntheticTurn) -> protocol.CommitTurn:
    return protocol.CommitTurn(
        0, sid, turn_id, turn.prompt_ids, turn.output_ids, turn.logprobs, "stop",
        turn.prompt_messages, turn.response_message, {"ill_formed": False},
    )  # fmt: skip


def test_a_trainer_and_a_worker_with_keys_record_a_turn_through_a_broker_on_all_interfaces(broker, keys, tmp_path):
    _, worker_endpoint, control_endpoint = broker
    turns = conversation(3, 2, first_prompt=40, tail=6, output=5)
    # each host holds only its own files
    worker_dir = _host_dir(tmp_path, keys / "broker.key", "worker", keys / "worker.key_secret")
    with TrainerClient(control_endpoint, timeout=CALL_TIMEOUT_S, curve_keys=str(keys)) as client:
        sid = client.open_session()

        async def agent_turns() -> None:
            backplane = Backplane(worker_endpoint, curve_keys=str(worker_dir))
            backplane.start()
            try:
                for k, turn in enumerate(turns):
                    opened = await backplane.open_turn(sid, f"t{k}")
                    assert opened.seq == k
                    backplane.commit_in_background(_commit(sid, f"t{k}", turn))
                    await backplane.drain(CALL_TIMEOUT_S)
                    assert not backplane._commits, "commit not acknowledged"
            finally:
                await backplane.close()

        asyncio.run(asyncio.wait_for(agent_turns(), 4 * CALL_TIMEOUT_S))
        records = client.finish_session(sid, reward=1.0)
    assert_linear_rows(records, turns)


def test_an_episode_stream_subscribes_over_curve(broker, keys):
    _, _, control_endpoint = broker
    with TrainerClient(control_endpoint, timeout=CALL_TIMEOUT_S, curve_keys=str(keys)) as client:
        group = "curve-stream"
        sid = client.open_session(group=group)
        client.request_finish(sid, reward=0.5, wait_timeout=0)
        with client.episodes(timeout=CALL_TIMEOUT_S, group=group) as stream:  # a socket of its own, also CURVE
            episode = next(stream)
        assert (episode.session_id, episode.reward, episode.rows) == (sid, 0.5, [])


@pytest.mark.parametrize("case", ["unknown trainer key", "the worker's key", "another broker's public key"])
def test_a_trainer_with_a_wrong_key_is_refused_at_once(broker, keys, tmp_path, case):
    proc, _, control_endpoint = broker
    other = tmp_path / "other"
    curve.create_keys(other)
    secret, broker_key = {
        "unknown trainer key": (other / "trainer.key_secret", keys / "broker.key"),
        "the worker's key": (keys / "worker.key_secret", keys / "broker.key"),
        "another broker's public key": (keys / "trainer.key_secret", other / "broker.key"),
    }[case]
    directory = _host_dir(tmp_path, broker_key, "trainer", secret)
    with TrainerClient(control_endpoint, timeout=CALL_TIMEOUT_S, curve_keys=str(directory)) as refused:
        with pytest.raises(AuthenticationFailed) as error:
            refused.open_session()
    # named for what it is (a timeout would be BrokerTimeout), with the endpoint and the likely fix
    assert control_endpoint in str(error.value)
    expected = "broker.key is probably not" if case == "another broker's public key" else "ZAP status 400"
    assert expected in str(error.value)
    if case != "another broker's public key":  # the broker's side: which key, refused on which endpoint
        proc.expect(r"refused CURVE key \S+ from 127\.0\.0\.1 on the trainers endpoint", CALL_TIMEOUT_S)
    with TrainerClient(control_endpoint, timeout=CALL_TIMEOUT_S, curve_keys=str(keys)) as client:
        assert client.stats()["sessions_open"] == 0


def test_a_trainer_without_keys_is_refused(broker, keys):
    _, _, control_endpoint = broker
    # through loopback the client may try; the broker refuses the plaintext handshake, and the client says so
    # at once (not as a timeout), with what to give it
    with TrainerClient(control_endpoint, timeout=CALL_TIMEOUT_S, curve_keys="") as keyless:
        started = time.monotonic()
        with pytest.raises(AuthenticationFailed, match="requires CURVE keys and this trainer has none") as error:
            keyless.open_session()
    assert time.monotonic() - started < CALL_TIMEOUT_S / 2
    assert control_endpoint in str(error.value) and curve.CURVE_KEYS_ENV in str(error.value)
    # to the address it is bound on, a client without keys refuses at once
    with pytest.raises(curve.CurveError, match="not a loopback address"):
        TrainerClient(control_endpoint.replace("127.0.0.1", "0.0.0.0"), curve_keys="")
    with TrainerClient(control_endpoint, timeout=CALL_TIMEOUT_S, curve_keys=str(keys)) as client:
        assert client.stats()["sessions_open"] == 0


def test_a_worker_with_a_wrong_key_is_refused_and_its_turns_never_land(broker, keys, tmp_path, caplog):
    proc, worker_endpoint, control_endpoint = broker
    other = tmp_path / "other"
    curve.create_keys(other)
    directory = _host_dir(tmp_path, keys / "broker.key", "worker", other / "worker.key_secret")
    turn = conversation(5, 1, first_prompt=20, tail=4, output=3)[0]
    with TrainerClient(control_endpoint, timeout=CALL_TIMEOUT_S, curve_keys=str(keys)) as client:
        sid = client.open_session()
        before = client.stats()

        async def refused_worker() -> None:
            backplane = Backplane(worker_endpoint, curve_keys=str(directory), hold_s=REFUSED_TIMEOUT_S)
            backplane.start()
            try:
                with pytest.raises(BrokerUnavailable, match="refused this worker's CURVE key"):
                    await backplane.open_turn(sid, "t0")
                backplane.commit_in_background(_commit(sid, "t0", turn))
                await backplane.drain(REFUSED_TIMEOUT_S)
                assert backplane._commits, "a commit was acknowledged through a refused key"
            finally:
                await backplane.close()

        with caplog.at_level(logging.ERROR, logger=backplane_module.__name__):
            asyncio.run(asyncio.wait_for(refused_worker(), 4 * CALL_TIMEOUT_S))
        assert any("refused this worker's CURVE key" in r.getMessage() for r in caplog.records)
        proc.expect(r"refused CURVE key \S+ from 127\.0\.0\.1 on the workers endpoint", CALL_TIMEOUT_S)
        stats = client.stats()
        assert (stats["commits_stored"], stats["turns_opened"]) == (before["commits_stored"], before["turns_opened"])
        assert client.finish_session(sid, wait_timeout=0) == []


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (
            ["--worker-endpoint", "tcp://0.0.0.0:0", "--control", "tcp://127.0.0.1:0"],
            "the worker endpoint tcp://0.0.0.0:0",
        ),
        (["--worker-endpoint", "tcp://127.0.0.1:0", "--control", "tcp://*:0"], r"the control endpoint tcp://\*:0"),
        (["--worker-endpoint", "tcp://127.0.0.1:0", "--control", "tcp://10.1.2.3:0"], "tcp://10.1.2.3:0"),
    ],
)
def test_a_broker_without_keys_refuses_to_start_on_a_non_loopback_address(flags, named):
    with TestProcess([sys.executable, "-m", "broker", *flags], env=NO_KEYS, name="broker") as proc:
        assert proc.wait(EXIT_TIMEOUT_S) == 1
        proc.expect(f"{named} is not a loopback address", 1)
        assert "BROKER READY" not in proc.output


def test_rollout_gateway_keys_writes_the_layout_once(tmp_path):
    directory = tmp_path / "keys"
    command = [sys.executable, "-m", "gateway_workers.cli", "keys", str(directory)]
    with TestProcess(command, name="keys") as first:
        assert first.wait(EXIT_TIMEOUT_S) == 0
        first.expect(r"worker hosts:\s+broker\.key and worker\.key_secret", 1)
    written = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())
    assert written == sorted(
        ["authorized_trainers/trainer.key", "authorized_workers/worker.key", "broker.key", "broker.key_secret",
         "trainer.key", "trainer.key_secret", "worker.key", "worker.key_secret"]
    )  # fmt: skip
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in directory.glob("*.key_secret"))
    before = (directory / "broker.key_secret").read_bytes()
    with TestProcess(command, name="keys again") as second:
        assert second.wait(EXIT_TIMEOUT_S) != 0
        second.expect("refusing to overwrite existing keys", 1)
    assert (directory / "broker.key_secret").read_bytes() == before


def test_workers_refuse_a_remote_broker_without_keys(tmp_path):
    command = [sys.executable, "-m", "gateway_workers.cli", "workers", "--broker", "tcp://10.1.2.3:5558"]
    with TestProcess(command, env=NO_KEYS, name="workers") as proc:
        assert proc.wait(EXIT_TIMEOUT_S) != 0
        proc.expect(r"--broker tcp://10\.1\.2\.3:5558 is not a loopback address", 1)


def test_serve_with_keys_on_all_interfaces_records_an_agent_s_turns(keys):
    extra = ["--worker-endpoint", "tcp://0.0.0.0:0", "--log-level", "warning"]
    with launch_gateway(workers=1, control="tcp://0.0.0.0:0", curve_keys=str(keys), extra_args=extra,
                        env=NO_KEYS) as gw:  # fmt: skip
        assert gw.control.startswith("tcp://0.0.0.0:")
        sid = gw.client.open_session()
        agent = openai.OpenAI(base_url=gw.base_url, api_key=sid, max_retries=0)
        reply = agent.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content and reply.usage is not None
        records = gw.client.finish_session(sid)
        assert sum(sum(r.loss_mask) for r in records) == reply.usage.completion_tokens > 0
        agent.close()


def test_serve_without_keys_refuses_a_non_loopback_control_endpoint():
    with pytest.raises(GatewayStartError, match=r"--control tcp://0\.0\.0\.0:0 is not a loopback address"):
        with launch_gateway(workers=1, control="tcp://0.0.0.0:0", env=NO_KEYS, ready_timeout=EXIT_TIMEOUT_S):
            pass
