"""TestProcess: a real subprocess for tests, with captured output, `expect` and a bounded stop.

Every process test starts its broker / workers / serve through this wrapper: its own
session (process group) so the whole tree is killed together, unbuffered combined
stdout+stderr captured by a reader thread, `expect(regex, timeout)` instead of sleeps,
SIGTERM -> wait(timeout) -> SIGKILL of the group on stop, and the captured output
dumped to stderr when the `with` block fails. `launch_gateway` is the trainer client's, with a start bound
that fails inside pytest's per-test timeout. A process dies with the test run (`lifetime.die_with_parent`).
Stdlib and that, but for one lazy import.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from gateway_workers.lifetime import die_with_parent

REPO_ROOT = Path(__file__).resolve().parent.parent
EXPECT_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
KILL_WAIT_S = 5.0
# Under pytest's per-test timeout (pyproject: 120 s), which also runs the fixture that starts `serve`: a start this
# slow fails as GatewayStartError with serve's last output, instead of a bare timeout that shows none of it.
GATEWAY_READY_TIMEOUT_S = 75.0


class ProcessExpectError(AssertionError):
    """A line the test waited for did not appear (the process output is in the message)."""


class TestProcess:
    """One subprocess tree under test.

    Args:
        args: the command line; `sys.executable` is a good first element.
        env: extra environment variables (merged over the current environment).
        name: label used in failure dumps.
    """

    __test__ = False  # not a pytest test class despite its name

    def __init__(self, args: Sequence[str], *, env: Mapping[str, str] | None = None, name: str | None = None) -> None:
        self.args = list(args)
        self.name = name or os.path.basename(self.args[0])
        self._env = dict(env or {})
        self._lines: list[str] = []
        self._cond = threading.Condition()
        self._cursor = 0
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> TestProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self._env}
        # the checkout first, so `python -m broker` runs this tree even when not pip-installed
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        self._proc = subprocess.Popen(
            self.args,
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,  # own process group: stop() reaches grandchildren too
            # A test run that is killed (a timeout's SIGKILL, ^C twice) never reaches stop(): the kernel then
            # SIGTERMs the process, so none is left holding a port. The signal comes when the starting *thread*
            # ends, so only processes the main thread starts are tied.
            preexec_fn=die_with_parent(os.getpid()) if threading.current_thread() is threading.main_thread() else None,
        )
        self._reader = threading.Thread(target=self._read, name=f"read-{self.name}", daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        with self._proc.stdout:  # closed at EOF: an open pipe would warn as an unclosed file
            for line in self._proc.stdout:
                with self._cond:
                    self._lines.append(line.rstrip("\n"))
                    self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    @property
    def pid(self) -> int:
        assert self._proc is not None, "start() first"
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        assert self._proc is not None, "start() first"
        return self._proc.poll()

    def signal(self, sig: int) -> None:
        """Send `sig` to the process group."""
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float) -> int:
        """Wait for exit; raises subprocess.TimeoutExpired after `timeout`."""
        assert self._proc is not None
        rc = self._proc.wait(timeout)
        if self._reader is not None:
            self._reader.join(KILL_WAIT_S)  # the rest of its output
        return rc

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM the group, wait up to `timeout`, then SIGKILL it; returns the exit code."""
        if self._proc is None:
            return 0
        if self._proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                return self.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        return self.wait(KILL_WAIT_S)

    def kill(self) -> None:
        """SIGKILL the whole group at once (a crash, as far as peers can tell)."""
        self.signal(signal.SIGKILL)
        # grandchildren that left the group are not ours to chase; the group is gone

    # --- output ------------------------------------------------------------------------

    @property
    def output(self) -> str:
        with self._cond:
            return "\n".join(self._lines)

    def expect(self, pattern: str, timeout: float = EXPECT_TIMEOUT_S) -> re.Match[str]:
        """Wait for the next output line matching `pattern` (re.search); return its match.

        Lines are consumed in order: a second `expect` looks only after the last match.
        Fails early, with the output, if the process exits first.
        """
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                while self._cursor < len(self._lines):
                    line = self._lines[self._cursor]
                    self._cursor += 1
                    m = regex.search(line)
                    if m:
                        return m
                exited = self._proc is not None and self._proc.poll() is not None
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (exited and not (self._reader and self._reader.is_alive())):
                    why = f"exited with {self._proc.poll()}" if exited else f"no match within {timeout}s"
                    # the condition's lock is re-entrant, so reading `output` here is fine
                    raise ProcessExpectError(f"{self.name}: {pattern!r} not seen ({why}); output:\n{self.output}")
                self._cond.wait(min(remaining, 0.1))

    def dump(self, file: object = None) -> None:
        """Write the captured output to stderr (pytest shows it for a failing test)."""
        print(
            f"----- output of {self.name} (pid {self._proc.pid if self._proc else '-'}) -----", file=file or sys.stderr
        )
        print(self.output, file=file or sys.stderr)

    def __enter__(self) -> TestProcess:
        return self.start() if self._proc is None else self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        if exc_type is not None:
            self.dump()


BROKER_READY = r"BROKER READY worker=(\S+) control=(\S+)"


def start_broker(
    *extra: str,
    worker: str = "tcp://127.0.0.1:0",
    control: str = "tcp://127.0.0.1:0",
    env: Mapping[str, str] | None = None,
) -> tuple[TestProcess, str, str]:
    """A bare `python -m broker` (ephemeral ports by default), ready: (process, worker endpoint, control endpoint)."""
    proc = TestProcess(
        [sys.executable, "-m", "broker", "--worker-endpoint", worker, "--control", control, *extra],
        env=env,
        name="broker",
    ).start()
    try:
        m = proc.expect(BROKER_READY, EXPECT_TIMEOUT_S)
    except BaseException:
        proc.stop()
        raise
    return proc, m.group(1), m.group(2)


def launch_gateway(**kwargs: Any) -> Any:
    """`trainer_client.launch_gateway`, ready within `GATEWAY_READY_TIMEOUT_S` unless the test says otherwise."""
    from trainer_client import launch_gateway as launch

    kwargs.setdefault("ready_timeout", GATEWAY_READY_TIMEOUT_S)
    return launch(**kwargs)
