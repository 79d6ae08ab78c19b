"""ZeroMQ CURVE for the backplane: the key directory, which endpoints need it, and client handshake failures.

Shared by the broker, the workers and the trainer client (like `broker.protocol`, it imports no broker
server code): `create_keys` writes the layout `rollout-gateway keys DIR` documents; each component loads
only the files it needs (`load_server_keys`: the broker's secret and the two authorized directories;
`load_client_keys`: the broker's public key and a worker's or trainer's secret); `require_keys_off_loopback`
is the rule that a non-loopback endpoint needs keys; `HandshakeWatch` reads a client socket's monitor
events, so a refused key is reported instead of waiting silently (and, when asked, a lost connection
is noticed at once: the trainer client's retry seam). The ZAP handler that authorizes keys
runs in the broker only (`broker.zap`). Imports the stdlib, zmq and zmq's certificate files (not
`zmq.auth.thread` nor `zmq.utils.monitor`: both load zmq.asyncio), and `broker.settings` for its variable.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import zmq
from zmq.auth.certs import create_certificates, load_certificate

from broker.settings import CURVE_KEYS_ENV  # one variable for every component: serve, workers, broker, trainers

Role = Literal["worker", "trainer"]
BROKER = "broker"
ROLES: tuple[Role, ...] = ("worker", "trainer")
# The broker accepts on each endpoint only the public keys (`*.key`) of its own directory, so a trainer's
# key cannot commit turns as a worker, nor a worker's open sessions.
AUTHORIZED_DIRS: dict[Role, str] = {"worker": "authorized_workers", "trainer": "authorized_trainers"}
# ZAP domains of the two endpoints: libzmq hands each handshake to the ZAP handler with its socket's domain.
ZAP_DOMAINS: dict[Role, str] = {"worker": "workers", "trainer": "trainers"}
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"

_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
HANDSHAKE_EVENTS = int(zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED)
# A handshake that fails "without detail" (the broker dropped it: it could not decrypt our hello) is final
# only when it repeats; once could be a broker stopping mid-handshake.
NO_DETAIL_FAILURES_FINAL = 2


class CurveError(ValueError):
    """CURVE cannot be set up as configured: a key file is missing, libzmq lacks CURVE, or a non-loopback
    endpoint has no keys. The message names the file or flag to fix."""


def require_curve() -> None:
    """Raise `CurveError` unless this libzmq was built with CURVE."""
    if not zmq.has("curve"):
        raise CurveError(
            f"this libzmq ({zmq.zmq_version()}) was built without CURVE: install pyzmq's wheel (it bundles a "
            "libzmq with CURVE) or a libzmq built with libsodium"
        )


def keys_from_env(value: str | None, environ: dict[str, str] | None = None) -> str | None:
    """`value` if given, else $ROLLOUT_GATEWAY_CURVE_KEYS; an empty string means no keys."""
    if value is None:
        value = (os.environ if environ is None else environ).get(CURVE_KEYS_ENV)
    return value or None


# --- which endpoints need keys --------------------------------------------------------------------


def is_local_endpoint(endpoint: str) -> bool:
    """Whether only this host can reach `endpoint`: ipc:// and inproc://, or tcp:// on a loopback address
    (127.0.0.0/8, ::1, or a host name that resolves to loopback only). `*`, 0.0.0.0, a LAN address, an
    interface name and an unresolvable name are not."""
    transport, _, address = endpoint.partition("://")
    if transport in ("ipc", "inproc"):
        return True
    if transport != "tcp" or not address:
        return False
    address = address.rpartition(";")[2]  # a connect may name its source first: "tcp://SRC;HOST:PORT"
    host = address.rpartition(":")[0] if ":" in address else address
    host = host.strip("[]")
    if not host or host == "*":
        return False
    try:
        return _is_loopback(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(_is_loopback(ipaddress.ip_address(str(info[4][0]).split("%")[0])) for info in infos)


def _is_loopback(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def require_keys_off_loopback(endpoint: str, keys_dir: str | None, what: str) -> None:
    """Raise `CurveError` when `endpoint` is reachable from other hosts and no key directory is configured.

    `what` names the setting in the message (e.g. "--control").
    """
    if keys_dir is None and not is_local_endpoint(endpoint):
        raise CurveError(
            f"{what} {endpoint} is not a loopback address: the backplane leaves this host only with CURVE "
            f"(authenticated and encrypted). Create keys with `rollout-gateway keys DIR` and pass --curve-keys DIR "
            f"(or set {CURVE_KEYS_ENV}=DIR), or use 127.0.0.1 / ipc://"
        )


# --- the key directory ----------------------------------------------------------------------------


def key_files(directory: str | os.PathLike[str]) -> list[Path]:
    """Every file `create_keys` writes, in the order it lists them."""
    root = Path(directory)
    pairs = [root / f"{name}{suffix}" for name in (BROKER, *ROLES) for suffix in (PUBLIC_SUFFIX, SECRET_SUFFIX)]
    return pairs + [root / AUTHORIZED_DIRS[role] / f"{role}{PUBLIC_SUFFIX}" for role in ROLES]


def create_keys(directory: str | os.PathLike[str]) -> list[Path]:
    """Write key pairs for the broker, a worker and a trainer into `directory`, and authorize the latter two.

    Secret files are mode 0600 from the start (they are made in a private temporary directory first);
    the directory is created 0700 if it does not exist. Refuses (`CurveError`) to overwrite any existing
    key file. Returns the files written.
    """
    require_curve()
    root = Path(directory)
    targets = key_files(root)
    existing = [str(p) for p in targets if p.exists()]
    if existing:
        raise CurveError(f"refusing to overwrite existing keys: {', '.join(existing)} (pick a new directory)")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    for role in ROLES:
        (root / AUTHORIZED_DIRS[role]).mkdir(mode=0o755, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".keys-") as tmp:  # 0700: nobody else sees a secret
        made: dict[Path, Path] = {}
        for name in (BROKER, *ROLES):
            public, secret = create_certificates(tmp, name)
            os.chmod(secret, 0o600)
            os.chmod(public, 0o644)
            made[root / f"{name}{PUBLIC_SUFFIX}"] = Path(public)
            made[root / f"{name}{SECRET_SUFFIX}"] = Path(secret)
        for role in ROLES:
            copy = Path(tmp) / f"authorized-{role}{PUBLIC_SUFFIX}"
            shutil.copyfile(made[root / f"{role}{PUBLIC_SUFFIX}"], copy)
            os.chmod(copy, 0o644)
            made[root / AUTHORIZED_DIRS[role] / f"{role}{PUBLIC_SUFFIX}"] = copy
        for target in targets:
            os.replace(made[target], target)
    return targets


def _load(path: Path, need_secret: bool, what: str) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise CurveError(f"{what} {path} is missing (`rollout-gateway keys DIR` writes it)")
    try:
        public, secret = load_certificate(path)
    except (OSError, ValueError) as e:
        raise CurveError(f"cannot read {what} {path}: {e}") from None
    if need_secret and secret is None:
        raise CurveError(f"{path} holds no secret key (is it a public .key file?)")
    return public, secret


@dataclass(frozen=True)
class ClientKeys:
    """What a worker or trainer socket needs: the broker's public key and its own key pair (z85)."""

    broker_public: bytes
    public: bytes
    secret: bytes

    def apply(self, sock: zmq.Socket) -> None:
        """Make `sock` a CURVE client of the broker; before it connects."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.broker_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)


def load_client_keys(directory: str | os.PathLike[str], role: Role) -> ClientKeys:
    """`broker.key` and `<role>.key_secret` from `directory` (nothing else need be there)."""
    require_curve()
    root = Path(directory)
    broker_public, _ = _load(root / f"{BROKER}{PUBLIC_SUFFIX}", False, "the broker's public key")
    public, secret = _load(root / f"{role}{SECRET_SUFFIX}", True, f"the {role}'s secret key")
    assert secret is not None
    return ClientKeys(broker_public, public, secret)


@dataclass(frozen=True)
class ServerKeys:
    """The broker's key pair (z85) and, per role, the directory of the public keys it accepts."""

    public: bytes
    secret: bytes
    authorized: dict[Role, Path]

    def apply(self, sock: zmq.Socket, role: Role) -> None:
        """Make `sock` a CURVE server whose handshakes the ZAP handler decides for `role`; before it binds."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAINS[role].encode())
        # Without it libzmq accepts every handshake when no ZAP handler answers (encryption without
        # authentication): a handler that is gone must refuse, not let everyone in.
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def load_server_keys(directory: str | os.PathLike[str]) -> ServerKeys:
    """`broker.key_secret` and the `authorized_workers/`, `authorized_trainers/` directories of `directory`."""
    require_curve()
    root = Path(directory)
    public, secret = _load(root / f"{BROKER}{SECRET_SUFFIX}", True, "the broker's secret key")
    assert secret is not None
    authorized = {role: root / AUTHORIZED_DIRS[role] for role in ROLES}
    for role, path in authorized.items():
        if not path.is_dir():
            raise CurveError(f"{path} is not a directory: it holds the public keys of the {role}s the broker accepts")
    return ServerKeys(public, secret, authorized)


# --- the client's view of its handshakes ------------------------------------------------------------


class HandshakeWatch:
    """The handshake events of one client socket (a ZMQ monitor): why the broker refuses it, if it does.

    Create it before the socket connects; `read()` whenever `monitor` is readable; `close()` before the
    socket closes. Events arrive only per connection attempt, never per message. With `disconnects`, it
    also counts the connections that ended after their handshake (`disconnects`) and says whether one is
    up (`connected`): a request in flight when its connection ends will get no reply (the broker's ROUTER
    drops a reply to a connection that is gone), so its caller can stop waiting at once.
    """

    def __init__(self, sock: zmq.Socket, endpoint: str, role: Role, *, disconnects: bool = False) -> None:
        events = HANDSHAKE_EVENTS | (zmq.EVENT_DISCONNECTED if disconnects else 0)
        self.monitor: zmq.Socket = sock.get_monitor_socket(events)
        self._sock = sock
        self._endpoint = endpoint
        self._role = role
        self._no_detail = 0
        self.refusal: str | None = None  # the latest final failure, until a handshake succeeds
        self.disconnects = 0  # connections that ended after their handshake (with `disconnects`)
        self.connected = False  # a handshake succeeded since the last disconnect

    def read(self) -> str | None:
        """Take every queued event; returns `refusal` after them (None: no final failure since the last success)."""
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return self.refusal
            if len(frames) != 2 or len(frames[0]) != 6:
                continue
            event, value = struct.unpack("=HI", frames[0])
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._no_detail, self.refusal, self.connected = 0, None, True
            elif event == zmq.EVENT_DISCONNECTED:
                # A connection refused in its handshake carried no message: nothing was lost with it.
                if self.connected:
                    self.disconnects += 1
                self.connected = False
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.refusal = (
                    f"the broker at {self._endpoint} refused this {self._role}'s CURVE key (ZAP status {value}): "
                    f"authorize its public key in {AUTHORIZED_DIRS[self._role]}/ on the broker host, or use the "
                    f"{self._role}{SECRET_SUFFIX} the broker knows"
                )
            elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                self.refusal = self._keyless() or (
                    f"the handshake with {self._endpoint} failed (ZMTP protocol error {value:#x}): the broker "
                    "there does not run with CURVE keys, or it is not a rollout-gateway broker"
                )
            elif event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                self._no_detail += 1
                if self._no_detail >= NO_DETAIL_FAILURES_FINAL:
                    self.refusal = self._keyless() or (
                        f"the CURVE handshake with {self._endpoint} failed {self._no_detail} times (errno {value}): "
                        f"{BROKER}{PUBLIC_SUFFIX} is probably not this broker's public key"
                    )

    def _keyless(self) -> str | None:
        """Why a socket without keys failed its handshakes: the broker requires them (it drops a plaintext greeting,
        or names the mechanism mismatch). None for a socket with keys."""
        if self._sock.get(zmq.MECHANISM) != zmq.NULL:
            return None
        return (
            f"the broker at {self._endpoint} requires CURVE keys and this {self._role} has none: give it the key "
            f"directory `rollout-gateway keys` wrote ({BROKER}{PUBLIC_SUFFIX} and {self._role}{SECRET_SUFFIX}), "
            f"through ${CURVE_KEYS_ENV} or its option"
        )

    def close(self) -> None:
        """Stop monitoring and close the monitor socket (the watched socket stays open)."""
        if not self._sock.closed:
            self._sock.disable_monitor()
        self.monitor.close(linger=0)
