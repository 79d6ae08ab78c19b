"""`launch_gateway`: run `rollout-gateway serve` as a subprocess tree for a trainer or a test.

Starts the CLI by command line (`python -m gateway_workers.cli serve`), never by
importing the workers, in its own process group; waits for its READY line; yields
the agents' base URL, the control endpoint and a connected `TrainerClient`; on exit
sends SIGTERM, waits, and kills the group if it lingers. Blocking code only.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from trainer_client.client import TrainerClient

READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0
_READY = re.compile(r"GATEWAY READY base_url=(\S+) control=(\S+)")


class GatewayStartError(RuntimeError):
    """`serve` exited or stayed silent before it was ready; the message holds its last output."""


@dataclass
class Gateway:
    """A running `serve` subprocess tree."""

    base_url: str
    control: str
    client: TrainerClient
    process: subprocess.Popen[str]
    output: deque[str] = field(default_factory=lambda: deque(maxlen=2000))
    reader: threading.Thread | None = None

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        self.client.close()
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        _kill_group(self.process, self.reader)  # anything left in the group


def _kill_group(process: subprocess.Popen[str], reader: threading.Thread | None) -> None:
    """SIGKILL the whole tree at once (a start given up, or what a stop left): running on, it holds its ports."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    _close_output(process, reader)


def _close_output(process: subprocess.Popen[str], reader: threading.Thread | None) -> None:
    if reader is not None:
        reader.join(STOP_TIMEOUT_S)  # it ends at EOF, once every process holding the pipe is gone
        if reader.is_alive():
            return  # a process outside the group still holds the pipe: closing it under the reader would raise there
    if process.stdout is not None:
        process.stdout.close()


@contextlib.contextmanager
def launch_gateway(
    workers: int = 2,
    engine_kind: str = "mock",
    engine_urls: Sequence[str] = (),
    tokenizer: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    control: str = "tcp://127.0.0.1:0",
    extra_args: Sequence[str] = (),
    client_timeout: float = 30.0,
    ready_timeout: float = READY_TIMEOUT_S,
    env: dict[str, str] | None = None,
    curve_keys: str | None = None,
) -> Iterator[Gateway]:
    """Start broker + `workers` uvicorn workers; port 0 / control port 0 pick free ports.

    `curve_keys` (a `rollout-gateway keys` directory) runs the backplane with CURVE and gives the client
    the same keys; needed when `control` is not loopback.
    """
    cmd = [sys.executable, "-u", "-m", "gateway_workers.cli", "serve", "--host", host, "--port", str(port),
           "--workers", str(workers), "--engine-kind", engine_kind, "--control", control]
    if curve_keys is not None:
        cmd += ["--curve-keys", curve_keys]
    for url in engine_urls:
        cmd += ["--engine-url", url]
    if tokenizer:
        cmd += ["--tokenizer", tokenizer]
    cmd += list(extra_args)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            start_new_session=True, env={**os.environ, **(env or {})})
    output: deque[str] = deque(maxlen=2000)
    ready: list[tuple[str, str]] = []
    got_ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line)
            match = _READY.search(line)
            if match and not ready:
                ready.append((match.group(1), match.group(2)))
                got_ready.set()
        got_ready.set()  # EOF: the process is gone

    reader = threading.Thread(target=pump, name="gateway-output", daemon=True)
    try:  # from the moment serve exists: an interrupt while the reader starts must not leave it running
        reader.start()
        deadline = time.monotonic() + ready_timeout
        while not ready and time.monotonic() < deadline and proc.poll() is None:
            got_ready.wait(0.1)
        if ready:
            client = TrainerClient(ready[0][1], timeout=client_timeout, curve_keys=curve_keys)
    except BaseException:  # a bad client argument, or an interrupt while waiting (Ctrl-C, a test's timeout)
        _kill_group(proc, reader if reader.ident is not None else None)
        raise
    if not ready:
        _kill_group(proc, reader)
        raise GatewayStartError("rollout-gateway serve did not become ready:\n" + "".join(list(output)[-60:]))
    gateway = Gateway(ready[0][0], ready[0][1], client, proc, output, reader)
    try:
        yield gateway
    finally:
        gateway.stop()
