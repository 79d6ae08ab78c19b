"""`broker.curve` and the ZAP handler's decisions, without sockets: which endpoints need keys, the key
directory that `rollout-gateway keys` writes (layout, modes, no overwrite), what each component loads, and
which key the broker accepts on which endpoint (`ZapHandler.handle_request`, the frames libzmq sends it).
"""

from __future__ import annotations

import shutil
import stat
from pathlib import Path

import pytest
import zmq
from zmq.auth.certs import create_certificates, load_certificate
from zmq.utils import z85

from broker import curve
from broker.zap import ZapHandler


@pytest.mark.parametrize(
    ("endpoint", "local"),
    [
        ("tcp://127.0.0.1:5557", True),
        ("tcp://127.9.8.7:0", True),
        ("tcp://[::1]:5557", True),
        ("tcp://localhost:5557", True),
        ("tcp://[::ffff:127.0.0.1]:5557", True),
        ("ipc:///tmp/rg.sock", True),
        ("inproc://x", True),
        ("tcp://10.0.0.1:5558;127.0.0.1:5557", True),  # a connect's source address does not count
        ("tcp://0.0.0.0:5557", False),
        ("tcp://*:5557", False),
        ("tcp://[::]:5557", False),
        ("tcp://10.0.0.1:5557", False),
        ("tcp://192.168.1.20:0", False),
        ("tcp://127.0.0.1:0;10.0.0.1:5557", False),
        ("tcp://no-such-host.invalid:5557", False),
        ("ws://127.0.0.1:5557", False),
        ("tcp://", False),
    ],
)
def test_which_endpoints_are_local(endpoint: str, local: bool) -> None:
    assert curve.is_local_endpoint(endpoint) is local


def test_a_non_loopback_endpoint_needs_keys_and_the_message_names_the_setting_and_the_fix() -> None:
    with pytest.raises(curve.CurveError) as refused:
        curve.require_keys_off_loopback("tcp://0.0.0.0:5557", None, "--control")
    text = str(refused.value)
    assert "--control tcp://0.0.0.0:5557" in text and "rollout-gateway keys" in text and curve.CURVE_KEYS_ENV in text
    curve.require_keys_off_loopback("tcp://0.0.0.0:5557", "/keys", "--control")  # with keys: fine
    curve.require_keys_off_loopback("tcp://127.0.0.1:5557", None, "--control")  # loopback: fine without


def test_keys_from_env_flag_first_then_the_variable_and_empty_means_none() -> None:
    env = {curve.CURVE_KEYS_ENV: "/from-env"}
    assert curve.keys_from_env("/flag", env) == "/flag"
    assert curve.keys_from_env(None, env) == "/from-env"
    assert curve.keys_from_env("", env) is None
    assert curve.keys_from_env(None, {}) is None


def test_a_libzmq_without_curve_is_named_before_anything_is_written(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(zmq, "has", lambda capability: capability != "curve")
    with pytest.raises(curve.CurveError, match="built without CURVE"):
        curve.create_keys(tmp_path / "keys")
    with pytest.raises(curve.CurveError, match="built without CURVE"):
        curve.load_client_keys(tmp_path, "trainer")
    assert not (tmp_path / "keys").exists()


def test_create_keys_writes_the_documented_layout_with_private_secrets(tmp_path: Path) -> None:
    root = tmp_path / "keys"
    written = curve.create_keys(root)
    expected = {
        "broker.key", "broker.key_secret", "worker.key", "worker.key_secret", "trainer.key", "trainer.key_secret",
        "authorized_workers/worker.key", "authorized_trainers/trainer.key",
    }  # fmt: skip
    files = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    assert files == expected  # no temporary directory left behind
    assert {str(p.relative_to(root)) for p in written} == expected
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    for name in expected:
        mode = stat.S_IMODE((root / name).stat().st_mode)
        public, secret = load_certificate(root / name)
        if name.endswith("_secret"):
            assert mode == 0o600 and secret is not None, name
        else:
            assert mode & 0o077 == 0o044 and secret is None, name  # public: readable, not writable, by others
    # the authorized copies are the worker's and trainer's own public keys, and all three pairs differ
    for role in ("worker", "trainer"):
        assert (
            load_certificate(root / curve.AUTHORIZED_DIRS[role] / f"{role}.key")[0]
            == load_certificate(root / f"{role}.key_secret")[0]
        )
    publics = {load_certificate(root / f"{n}.key")[0] for n in ("broker", "worker", "trainer")}
    assert len(publics) == 3


def test_create_keys_refuses_to_overwrite_and_changes_nothing(tmp_path: Path) -> None:
    curve.create_keys(tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(curve.CurveError, match="refusing to overwrite"):
        curve.create_keys(tmp_path)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_each_component_loads_only_its_own_files(tmp_path: Path) -> None:
    full = tmp_path / "full"
    curve.create_keys(full)
    worker_host = tmp_path / "worker-host"
    worker_host.mkdir()
    shutil.copy(full / "broker.key", worker_host)
    shutil.copy(full / "worker.key_secret", worker_host)
    keys = curve.load_client_keys(worker_host, "worker")
    assert keys.broker_public == load_certificate(full / "broker.key_secret")[0]
    assert (keys.public, keys.secret) == load_certificate(full / "worker.key_secret")
    with pytest.raises(curve.CurveError, match=r"trainer's secret key .*trainer\.key_secret is missing"):
        curve.load_client_keys(worker_host, "trainer")
    with pytest.raises(curve.CurveError, match=r"broker\.key_secret is missing"):
        curve.load_server_keys(worker_host)
    server = curve.load_server_keys(full)
    assert server.public == keys.broker_public
    assert server.authorized == {"worker": full / "authorized_workers", "trainer": full / "authorized_trainers"}
    shutil.copy(full / "worker.key", worker_host / "worker.key_secret")  # a public file where a secret belongs
    with pytest.raises(curve.CurveError, match="holds no secret key"):
        curve.load_client_keys(worker_host, "worker")


def _zap_request(domain: str, public_z85: bytes, mechanism: bytes = b"CURVE") -> list[bytes]:
    credentials = [z85.decode(public_z85)] if mechanism == b"CURVE" else []
    return [b"1.0", b"7", domain.encode(), b"10.0.0.9", b"", mechanism, *credentials]


def test_each_endpoint_accepts_only_its_own_authorized_keys(tmp_path: Path) -> None:
    curve.create_keys(tmp_path)
    keys = curve.load_server_keys(tmp_path)
    ctx = zmq.Context()  # never used: the handler's thread does not start here
    handler = ZapHandler(ctx, {curve.ZAP_DOMAINS[r]: p for r, p in keys.authorized.items()})
    ctx.term()
    worker = load_certificate(tmp_path / "worker.key")[0]
    trainer = load_certificate(tmp_path / "trainer.key")[0]
    outsider = zmq.curve_keypair()[0]

    def status(domain: str, key: bytes, mechanism: bytes = b"CURVE") -> bytes:
        reply = handler.handle_request(_zap_request(domain, key, mechanism))
        assert reply[:2] == [b"1.0", b"7"] and len(reply) == 6  # the request's id, RFC 27's six frames
        return reply[2]

    assert status("workers", worker) == b"200" and status("trainers", trainer) == b"200"
    assert status("trainers", worker) == b"400"  # a worker's key cannot open sessions...
    assert status("workers", trainer) == b"400"  # ...nor a trainer's commit turns
    assert status("workers", outsider) == b"400" and status("trainers", outsider) == b"400"
    assert status("", worker) == b"400" and status("other", worker) == b"400"
    assert status("workers", worker, mechanism=b"NULL") == b"400"
    assert handler.handle_request([b"1.0"])[2] == b"400"  # malformed: still answered, refused
    # a public key dropped into the directory counts from the next handshake on, and removing it refuses it
    _, _ = create_certificates(tmp_path, "host-b")
    second = load_certificate(tmp_path / "host-b.key")[0]
    assert status("workers", second) == b"400"
    shutil.copy(tmp_path / "host-b.key", tmp_path / "authorized_workers")
    assert status("workers", second) == b"200"
    (tmp_path / "authorized_workers" / "host-b.key").unlink()
    assert status("workers", second) == b"400"
