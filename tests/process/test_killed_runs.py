"""A test run that is killed leaves no process behind: what it started through `TestProcess` (engines, brokers,
`serve`) is signalled by the kernel when the run dies, even by `kill -9`, so no port stays held.

A real parent process (standing in for a pytest worker) starts a child through `TestProcess`, exactly as a
fixture does, and is killed with SIGKILL before it can stop it; the child must then end by itself.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from assets import wait_until
from processes import TestProcess

TESTS_DIR = Path(__file__).resolve().parent.parent
# The parent: a child through TestProcess, whose pid it prints, then nothing until it is killed.
PARENT = f"""
import sys, time
sys.path.insert(0, {str(TESTS_DIR)!r})
from processes import TestProcess
child = TestProcess([sys.executable, "-c", "import time; print('UP', flush=True); time.sleep(120)"]).start()
child.expect("UP", 20)
print("CHILD", child.pid, flush=True)
time.sleep(120)
"""
GONE_TIMEOUT_S = 10.0


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped by whoever adopted it, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_what_a_killed_run_started_ends_with_it():
    parent = TestProcess([sys.executable, "-c", PARENT], name="killed-run").start()
    try:
        child = int(parent.expect(r"CHILD (\d+)", 30).group(1))
        assert _running(child)
        assert os.getpgid(child) != os.getpgid(parent.pid)  # its own group: killing the parent's misses it
        parent.kill()
        assert wait_until(lambda: not _running(child), GONE_TIMEOUT_S), "the child outlived its killed parent"
    finally:
        parent.stop()
