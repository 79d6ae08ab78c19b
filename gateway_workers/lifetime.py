"""Child processes that never outlive `serve`, however it ends (`kill -9` included).

A process asks the kernel to signal it when its parent dies (Linux `prctl(PR_SET_PDEATHSIG)`), then
checks that the parent it had is still the one it has: a parent that died before the request would
otherwise leave it adopted by init, unsignalled. `serve`'s broker asks in the forked child before it
execs (`Popen(preexec_fn=...)`: the setting survives exec); each uvicorn worker asks first thing in its
factory. SIGTERM, not SIGKILL: a worker drains its unacknowledged commits and the broker flushes its
replies, as on any stop. Other systems have no such call: there a process logs that it cannot. Imports
only the stdlib.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys
from collections.abc import Callable

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    """libc's prctl, loaded in the calling process (never in a forked child: dlopen there may deadlock)."""
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl  # type: ignore[no-any-return]


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A function that has `sig` sent to the calling process when its parent dies, and exits at once if
    `parent_pid` is already gone. Made in the parent; safe as a `Popen(preexec_fn=...)` (one libc call,
    nothing loaded or locked in the child). A no-op where the system has no such call."""
    prctl = _prctl()

    def tie() -> None:
        if prctl is None or prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return
        if os.getppid() != parent_pid:  # the parent died before the request: nobody would signal us
            os._exit(1)

    return tie


# The pid of the process that starts the workers (`serve`, or `workers`), for the workers to check theirs against.
PARENT_PID_ENV = "ROLLOUT_GATEWAY_PARENT_PID"


def tie_to_parent() -> None:
    """Tie a uvicorn worker to the process that started it ($ROLLOUT_GATEWAY_PARENT_PID, else its parent now),
    logging where the system cannot."""
    parent = int(os.environ.get(PARENT_PID_ENV) or os.getppid())
    if _prctl() is None:
        logger.warning("this system cannot stop process %d when its parent dies; stop it with its parent", os.getpid())
    die_with_parent(parent)()
