"""Benchmark harness: processes under test, CPU pinning, and CPU/RSS sampling from /proc.

`Service` starts a command in its own process group (optionally pinned to cores), waits for
its READY line with a deadline, and stops the whole group (SIGTERM, wait, SIGKILL).
`pin_tree` pins every thread of a process tree that is already running. `Sampler` reads
utime+stime and VmRSS of named process groups from /proc a few times a second, so a run
reports each group's CPU seconds and peak RSS. Linux only; stdlib only.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 15.0
SAMPLE_EVERY_S = 0.2
_TICK = os.sysconf("SC_CLK_TCK")


def children(root: int) -> set[int]:
    """`root` and all its descendants (by parent pid, from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo.extend(parents.get(pid, ()))
    return out


def pin(pid: int, cores: Iterable[int]) -> None:
    """Pin every thread of `pid` (threads created later inherit from their creator)."""
    cpus = set(cores)
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.sched_setaffinity(int(tid), cpus)


def pin_tree(root: int, cores: Iterable[int]) -> None:
    cpus = set(cores)
    for pid in children(root):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            pin(pid, cpus)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a whole process (dead threads included), in 10 ms ticks."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return 0.0


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each live thread, to the microsecond (se.sum_exec_runtime, where the kernel shows it)."""
    out: dict[int, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/sched", "rb") as f:
                for line in f:
                    if line.startswith(b"se.sum_exec_runtime"):
                        out[int(tid)] = float(line.split(b":")[1]) / 1000.0
                        break
        except (OSError, ValueError):
            continue
    return out


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


class Service:
    """A subprocess (tree) under test: own process group, READY line, bounded stop."""

    def __init__(
        self,
        name: str,
        cmd: Sequence[str],
        ready: str,
        cores: Iterable[int] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        cpus = set(cores) if cores is not None else None

        def setup() -> None:  # runs in the child before exec: the whole tree inherits the pinning
            if cpus:
                os.sched_setaffinity(0, cpus)

        self.proc = subprocess.Popen(
            list(cmd),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
            preexec_fn=setup,
            env={**os.environ, **(env or {})},
        )
        self.output: deque[str] = deque(maxlen=400)
        self._ready = re.compile(ready)
        self.match: re.Match[str] | None = None
        self._event = threading.Event()
        self._reader = threading.Thread(target=self._pump, name=f"{name}-output", daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            if self.match is None and (m := self._ready.search(line)):
                self.match = m
                self._event.set()
        self._event.set()

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> re.Match[str]:
        self._event.wait(timeout)
        if self.match is None:
            self.stop()
            raise RuntimeError(f"{self.name} did not become ready:\n" + "".join(list(self.output)[-40:]))
        return self.match

    def pids(self) -> set[int]:
        return children(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._reader.join(STOP_TIMEOUT_S)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@dataclass
class GroupStats:
    cpu_s: float = 0.0
    peak_rss_mb: float = 0.0
    pids: int = 0


@dataclass
class Sampler:
    """Samples named process groups while a run is going; `stop()` returns per-group stats.

    CPU is summed per thread from /proc/PID/task/TID/sched (microseconds; a thread that ends between
    two samples loses at most one interval), or from the coarse 10 ms /proc/PID/stat ticks where the
    kernel has no sched file.
    """

    groups: dict[str, Callable[[], set[int]]]
    _first: dict[str, dict[tuple[int, int], float]] = field(default_factory=dict)
    _last: dict[str, dict[tuple[int, int], float]] = field(default_factory=dict)
    _ticks: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)
    _peak: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Sampler:
        for name in self.groups:
            self._first[name], self._last[name], self._ticks[name], self._peak[name] = {}, {}, {}, 0
        self._sample(initial=True)
        self._thread = threading.Thread(target=self._loop, name="sampler", daemon=True)
        self._thread.start()
        return self

    def _sample(self, initial: bool = False) -> None:
        for name, pids in self.groups.items():
            rss = 0
            first, last, ticks = self._first[name], self._last[name], self._ticks[name]
            for pid in pids():
                for tid, cpu in thread_cpu(pid).items():
                    # A thread born during the run: all of its CPU counts.
                    first.setdefault((pid, tid), cpu if initial else 0.0)
                    last[(pid, tid)] = cpu
                total = cpu_seconds(pid)
                ticks[pid] = (ticks[pid][0] if pid in ticks else (total if initial else 0.0), total)
                rss += rss_bytes(pid)
            self._peak[name] = max(self._peak[name], rss)

    def _loop(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY_S):
            self._sample()

    def stop(self) -> dict[str, GroupStats]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        self._sample()
        out = {}
        for name in self.groups:
            first, last = self._first[name], self._last[name]
            precise = sum(max(0.0, cpu - first.get(key, 0.0)) for key, cpu in last.items())
            coarse = sum(max(0.0, end - begin) for begin, end in self._ticks[name].values())
            cpu = precise if last else coarse
            out[name] = GroupStats(round(cpu, 5), round(self._peak[name] / 2**20, 1), len(self._ticks[name]))
        return out


def wait_http(url: str, timeout: float) -> None:
    """Poll `url` until it answers (any status) or `timeout` passes."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2.0).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
