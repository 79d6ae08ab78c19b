"""CURVE on the broker's real sockets, in this process: ZAP domains, the handler's absence, client monitors.

`bind_routers` with keys makes both ROUTERs CURVE servers behind the ZAP handler: a worker key gets
through on the worker endpoint and is refused on the control endpoint (and the reverse), which the
client's `HandshakeWatch` reports at once; without a ZAP handler every handshake is refused
(ZAP_ENFORCE_DOMAIN), never let in unauthenticated; without keys a non-loopback endpoint is refused
before anything is bound. Plain DEALER peers with a deadline on every wait.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from broker import curve
from broker.config import BrokerConfig
from broker.server import BrokerServer
from broker.sockets import RouterSocket, bind_routers
from trainer_client import TrainerClient

WAIT_S = 5.0
QUIET_S = 1.0  # a refused client's frame must not arrive within this long


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    curve.create_keys(tmp_path / "keys")
    return tmp_path / "keys"


@pytest.fixture
def config(keys: Path) -> BrokerConfig:
    return BrokerConfig(
        worker_endpoint="tcp://0.0.0.0:0", control_endpoint="tcp://0.0.0.0:0", shutdown_linger_ms=0,
        curve_keys=str(keys),
    )  # fmt: skip


@pytest.fixture
def routers(zctx: zmq.Context, config: BrokerConfig) -> Iterator[tuple[RouterSocket, RouterSocket]]:
    workers, control, zap = bind_routers(zctx, config)
    assert zap is not None
    yield workers, control
    workers.close(0)
    control.close(0)
    zap.stop()


def _local(endpoint: str) -> str:
    return endpoint.replace("0.0.0.0", "127.0.0.1")


class CurvePeer:
    """A DEALER with a key pair from `directory` (as `role`), watched from before it connects."""

    def __init__(self, ctx: zmq.Context, endpoint: str, directory: Path, role: curve.Role) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        curve.load_client_keys(directory, role).apply(self.sock)
        self.watch = curve.HandshakeWatch(self.sock, endpoint, role)
        self.sock.connect(endpoint)

    def refusal(self, timeout: float = WAIT_S) -> str | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.watch.monitor.poll(50) and self.watch.read() is not None:
                return self.watch.refusal
        return None

    def close(self) -> None:
        self.watch.close()
        self.sock.close(linger=0)


def _peer_dir(tmp_path: Path, keys: Path, name: str, secret_from: Path) -> Path:
    """A client host's directory: the broker's public key and `secret_from` as `name`'s secret."""
    directory = tmp_path / f"host-{name}-{secret_from.stem}"
    directory.mkdir()
    (directory / "broker.key").write_bytes((keys / "broker.key").read_bytes())
    (directory / f"{name}.key_secret").write_bytes(secret_from.read_bytes())
    return directory


def _arrives(router: RouterSocket, payload: bytes, timeout: float) -> bool:
    if not router.sock.poll(int(timeout * 1000), zmq.POLLIN):
        return False
    return router.sock.recv_multipart()[-1] == payload


def test_each_endpoint_takes_its_own_role_s_key_and_refuses_the_other(
    zctx: zmq.Context, routers: tuple[RouterSocket, RouterSocket], keys: Path, tmp_path: Path
) -> None:
    workers, control = routers
    worker = CurvePeer(zctx, _local(workers.endpoint), keys, "worker")
    trainer = CurvePeer(zctx, _local(control.endpoint), keys, "trainer")
    # the worker's own key, presented on the control endpoint as a trainer's
    impostor_dir = _peer_dir(tmp_path, keys, "trainer", keys / "worker.key_secret")
    impostor = CurvePeer(zctx, _local(control.endpoint), impostor_dir, "trainer")
    try:
        worker.sock.send(b"commit")
        trainer.sock.send(b"open")
        impostor.sock.send(b"open as a worker")
        assert _arrives(workers, b"commit", WAIT_S) and _arrives(control, b"open", WAIT_S)
        refusal = impostor.refusal()
        assert refusal is not None and "ZAP status 400" in refusal and "authorized_trainers/" in refusal
        assert not control.sock.poll(int(QUIET_S * 1000), zmq.POLLIN)  # its frame never arrives
        assert worker.watch.read() is None and trainer.watch.read() is None  # both handshakes succeeded
    finally:
        for peer in (worker, trainer, impostor):
            peer.close()


def test_a_wrong_broker_public_key_is_reported_not_waited_on(
    zctx: zmq.Context, routers: tuple[RouterSocket, RouterSocket], keys: Path, tmp_path: Path
) -> None:
    workers, _ = routers
    other = tmp_path / "other-broker"
    curve.create_keys(other)
    directory = _peer_dir(tmp_path, other, "worker", keys / "worker.key_secret")  # right key, wrong broker
    peer = CurvePeer(zctx, _local(workers.endpoint), directory, "worker")
    try:
        peer.sock.send(b"commit")
        refusal = peer.refusal()
        assert refusal is not None and "broker.key is probably not this broker's public key" in refusal
        assert not workers.sock.poll(int(QUIET_S * 1000), zmq.POLLIN)
    finally:
        peer.close()


def test_without_a_zap_handler_every_handshake_is_refused(zctx: zmq.Context, config: BrokerConfig, keys: Path) -> None:
    # ZAP_ENFORCE_DOMAIN: libzmq's default would let any CURVE key in (encryption without authentication)
    router = RouterSocket(zctx, "tcp://127.0.0.1:0", config, curve.load_server_keys(keys), "worker")
    peer = CurvePeer(zctx, router.endpoint, keys, "worker")
    try:
        assert router.sock.getsockopt(zmq.ZAP_ENFORCE_DOMAIN) == 1
        peer.sock.send(b"commit")
        assert peer.refusal() is not None
        assert not router.sock.poll(int(QUIET_S * 1000), zmq.POLLIN)
    finally:
        peer.close()
        router.close(0)


@pytest.mark.parametrize(
    ("worker_endpoint", "control_endpoint"), [("tcp://*:0", "tcp://127.0.0.1:0"), ("tcp://127.0.0.1:0", "tcp://*:0")]
)
def test_a_broker_without_keys_refuses_a_non_loopback_endpoint_before_binding(
    worker_endpoint: str, control_endpoint: str
) -> None:
    config = BrokerConfig(worker_endpoint=worker_endpoint, control_endpoint=control_endpoint, shutdown_linger_ms=0)
    server = BrokerServer(config)
    with pytest.raises(curve.CurveError, match=r"tcp://\*:0 is not a loopback address"):
        server.bind()
    assert server._ctx is None  # released: nothing stays bound


def test_a_broker_with_keys_serves_a_trainer_client_on_all_interfaces(config: BrokerConfig, keys: Path) -> None:
    server = BrokerServer(config)
    _, control_endpoint = server.bind()
    loop = threading.Thread(target=server.run, name="broker", daemon=True)
    loop.start()
    try:
        with TrainerClient(_local(control_endpoint), timeout=WAIT_S, curve_keys=str(keys)) as client:
            sid = client.open_session()
            assert client.stats()["sessions_open"] == 1 and client.drop_session(sid)
    finally:
        server.request_exit()
        loop.join(WAIT_S)
    assert not loop.is_alive() and server._zap is None  # the ZAP thread stopped with the loop
