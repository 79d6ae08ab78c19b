"""`serve`'s broker: started as a subprocess, watched, and restarted on the same endpoints when it dies.

The broker gets its whole config from `serve` (`broker.config.BrokerConfig`, as JSON in $ROLLOUT_BROKER_CONFIG),
never an argument list. The first start binds what it says (port 0 picks free ports); every restart binds exactly
the endpoints the first one reported, so workers (whose DEALER sockets reconnect by themselves) and trainer
clients find it where it was. A broker that dies is logged with its exit status and restarted after a
backoff that doubles from RESTART_BACKOFF_S up to RESTART_BACKOFF_MAX_S and starts over once a broker
has stayed up for RESTART_RESET_S. A restarted broker is told it is one (`restarted`), so without a state
directory it can say that sessions opened before are lost. The broker never outlives `serve`
(`lifetime.die_with_parent`). The broker itself is never imported here.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import replace

from broker import settings
from broker.config import CONFIG_ENV, BrokerConfig
from gateway_workers.lifetime import die_with_parent

logger = logging.getLogger(__name__)

BROKER_START_TIMEOUT_S = 30.0
BROKER_STOP_TIMEOUT_S = 10.0
RESTART_BACKOFF_S = 0.5
CLEAN_EXIT_GRACE_S = 1.0
RESTART_BACKOFF_MAX_S = 10.0
RESTART_RESET_S = 60.0
_BROKER_READY = re.compile(r"BROKER READY worker=(\S+) control=(\S+)")


class BrokerStartError(RuntimeError):
    """The broker exited, or said nothing, before it was ready."""


class BrokerSupervisor:
    """Runs `python -m broker` with `config`, restarting it on the endpoints its first start bound."""

    def __init__(self, config: BrokerConfig) -> None:
        self._config = config
        self.worker_endpoint = config.worker_endpoint
        self.control_endpoint = config.control_endpoint
        self.restarts = 0
        self._proc: subprocess.Popen[str] | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # the current process, between the watcher and stop()
        self._watcher: threading.Thread | None = None

    def start(self) -> tuple[str, str]:
        """Start the broker and its watcher; returns (worker, control) endpoints as bound. Raises BrokerStartError."""
        self._proc = self._spawn(restarted=False)
        self._watcher = threading.Thread(target=self._watch, name="broker-supervisor", daemon=True)
        self._watcher.start()
        return self.worker_endpoint, self.control_endpoint

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None else None

    def _spawn(self, restarted: bool) -> subprocess.Popen[str]:
        config = replace(self._config, worker_endpoint=self.worker_endpoint, control_endpoint=self.control_endpoint,
                         restarted=restarted)
        env = {**os.environ, CONFIG_ENV: settings.to_json(config)}
        proc = subprocess.Popen([sys.executable, "-m", "broker"], stdout=subprocess.PIPE, text=True, bufsize=1, env=env,
                                preexec_fn=die_with_parent(os.getpid()))
        found: list[tuple[str, str]] = []
        ready = threading.Event()

        def pump() -> None:  # forward the broker's stdout; the first READY line gives its endpoints
            assert proc.stdout is not None
            with proc.stdout:
                for line in proc.stdout:
                    match = _BROKER_READY.search(line)
                    if match and not found:
                        found.append((match.group(1), match.group(2)))
                        ready.set()
                    else:
                        sys.stdout.write(line)
                        sys.stdout.flush()
            ready.set()

        threading.Thread(target=pump, name="broker-stdout", daemon=True).start()
        if not ready.wait(BROKER_START_TIMEOUT_S) or not found:
            proc.kill()
            proc.wait()
            why = f"exited with code {proc.returncode}" if not found and ready.is_set() else (
                f"was not ready within {BROKER_START_TIMEOUT_S}s")
            raise BrokerStartError(f"the broker {why} before it was ready")
        self.worker_endpoint, self.control_endpoint = found[0]  # port 0 resolved: restarts bind these
        return proc

    def _watch(self) -> None:
        backoff = RESTART_BACKOFF_S
        started = time.monotonic()
        while True:
            proc = self._proc
            assert proc is not None
            code = proc.wait()
            # A clean exit is a broker told to stop, most often by the signal that is stopping serve too (a
            # process group's SIGTERM reaches both): give serve's own handler a moment before calling it a crash.
            if self._stopping.wait(CLEAN_EXIT_GRACE_S if code == 0 else 0):
                return
            if time.monotonic() - started > RESTART_RESET_S:
                backoff = RESTART_BACKOFF_S
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            logger.error("the broker (pid %d) %s; restarting it on %s and %s in %.1fs", proc.pid, how,
                         self.worker_endpoint, self.control_endpoint, backoff)
            if self._stopping.wait(backoff):
                return
            try:
                with self._lock:
                    if self._stopping.is_set():
                        return
                    self._proc = self._spawn(restarted=True)
            except (BrokerStartError, OSError) as e:
                logger.error("restarting the broker failed: %s", e)
                backoff = min(backoff * 2, RESTART_BACKOFF_MAX_S)
                continue
            self.restarts += 1
            started = time.monotonic()
            logger.warning("the broker is back (pid %d, restart %d)", self._proc.pid, self.restarts)
            backoff = min(backoff * 2, RESTART_BACKOFF_MAX_S)

    def stop(self) -> None:
        """Stop watching, then stop the broker: SIGTERM, then SIGKILL after BROKER_STOP_TIMEOUT_S."""
        self._stopping.set()
        with self._lock:
            proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(BROKER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.error("broker did not stop within %ss; killing it", BROKER_STOP_TIMEOUT_S)
            proc.kill()
            proc.wait()
