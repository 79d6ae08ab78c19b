"""`serve` supervises its broker and takes its children with it: real processes, `kill -9`.

A broker killed under `serve` is logged and restarted on the same endpoints: the trainer client and the
workers reconnect by themselves, new sessions run end to end, and a session the old (in-memory) broker
held is refused as unknown. A `serve` killed with SIGKILL leaves no broker or worker behind, so its ports
are free for the next one; neither does one whose launcher was interrupted before it was ready.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import openai
import pytest
from assets import wait_until
from processes import REPO_ROOT, launch_gateway

USER = [{"role": "user", "content": "hello"}]
GONE_WITHIN_S = 15.0


def _pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, pgrp, ...); None once it is gone."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def _cmdline(pid: int) -> str | None:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return None


def _descendants(root: int) -> dict[int, str]:
    """pid -> command line of every live process below `root`."""
    parents = {pid: int(fields[1]) for pid in _pids() if (fields := _stat(pid)) is not None}
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in found and (cmd := _cmdline(child)) is not None:
                found[child] = cmd
                frontier.append(child)
    return found


def _broker_pid(serve_pid: int) -> int | None:
    return next((pid for pid, cmd in _descendants(serve_pid).items() if "-m broker" in cmd), None)


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def _group(pgid: int) -> list[int]:
    """The live processes of process group `pgid`."""
    members = []
    for pid in _pids():
        fields = _stat(pid)
        if fields is not None and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(pid)
    return members


def _serve_pid(marker: str) -> int | None:
    """The `serve` whose command line carries `marker`."""
    for pid in _pids():
        cmd = _cmdline(pid) or ""
        if "gateway_workers.cli serve" in cmd and marker in cmd:
            return pid
    return None


def _turn(gw, key: str) -> openai.types.chat.ChatCompletion:
    with openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=2, timeout=30) as agent:
        return agent.chat.completions.create(model="qwen3", messages=USER)


def test_a_killed_broker_is_restarted_on_its_endpoints() -> None:
    with launch_gateway(workers=2, engine_kind="mock", extra_args=["--log-level", "warning"]) as gw:
        before = gw.client.open_session()
        _turn(gw, before)
        first = _broker_pid(gw.process.pid)
        assert first is not None
        os.kill(first, signal.SIGKILL)
        assert wait_until(lambda: _broker_pid(gw.process.pid) not in (None, first), timeout=GONE_WITHIN_S)
        assert wait_until(lambda: any("the broker is back" in line for line in list(gw.output)), timeout=30)
        log = "".join(gw.output)
        assert f"the broker (pid {first}) was killed by signal 9; restarting it on" in log
        # the same client, the same endpoint: a new session runs end to end through both workers
        after = gw.client.open_session()
        for _ in range(3):
            assert _turn(gw, after).choices[0].message.content
        rows = gw.client.finish_session(after)
        assert len(rows) >= 1 and sum(len(r.metadata["turn_ids"]) for r in rows) == 3
        with pytest.raises(openai.AuthenticationError):  # the in-memory broker's sessions are gone
            _turn(gw, before)


def test_nothing_outlives_a_killed_serve() -> None:
    with launch_gateway(workers=2, engine_kind="mock", extra_args=["--log-level", "warning"]) as gw:
        children = _descendants(gw.process.pid)
        assert _broker_pid(gw.process.pid) is not None and len(children) >= 3, children  # broker + 2 workers
        control = urlparse(gw.control.replace("tcp://", "http://"))
        http = urlparse(gw.base_url)
        os.kill(gw.process.pid, signal.SIGKILL)  # serve alone: its children are not signalled by anyone
        gone = wait_until(lambda: not any(_alive(pid) for pid in children), timeout=GONE_WITHIN_S)
        assert gone, {pid: cmd for pid, cmd in children.items() if _alive(pid)}
        for host, port in ((control.hostname, control.port), (http.hostname, http.port)):
            with socket.socket() as probe:  # the ports are free for the next serve
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((host, port))



def test_a_process_group_sigterm_stops_serve_without_a_restart() -> None:
    with launch_gateway(workers=1, engine_kind="mock", extra_args=["--log-level", "warning"]) as gw:
        os.killpg(gw.process.pid, signal.SIGTERM)  # serve and its broker get it at once
        gw.process.wait(GONE_WITHIN_S)
        log = "".join(gw.output)
    assert "restarting it" not in log, log  # the broker's clean exit is part of the stop, not a crash



def test_a_launch_interrupted_before_ready_leaves_nothing_running() -> None:
    """Ctrl-C (or a test's timeout) while `launch_gateway` waits for READY: the serve it started goes too, rather
    than serving on, unseen, with its ports."""
    marker = f"interrupted-launch-{os.getpid()}-{time.monotonic_ns()}"
    script = (
        # Ctrl-C raises KeyboardInterrupt even where the test runs with SIGINT ignored (a background job's
        # children inherit that).
        "import signal, sys, time\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from trainer_client import launch_gateway\ntry:\n"
        "    with launch_gateway(workers=1, engine_kind='mock', extra_args=['--model-name', sys.argv[1]]):\n"
        "        print('LAUNCHED', flush=True)\n"
        "except KeyboardInterrupt:\n"
        "    print('INTERRUPTED', flush=True)\n"
        "    time.sleep(60)  # and goes on, as pytest does after a test's timeout: nothing dies with it\n"
    )
    trainer = subprocess.Popen([sys.executable, "-c", script, marker], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    serve: int | None = None
    try:
        assert wait_until(lambda: _serve_pid(marker) is not None, timeout=30)
        serve = _serve_pid(marker)
        assert serve is not None
        # Frozen, so it cannot become ready first on a loaded machine (it takes a second or two); a SIGKILL still
        # ends a stopped process.
        os.killpg(serve, signal.SIGSTOP)
        trainer.send_signal(signal.SIGINT)
        assert trainer.stdout is not None and trainer.stdout.readline() == "INTERRUPTED\n"  # while it waited
        assert serve is not None and wait_until(lambda: not _group(serve), timeout=GONE_WITHIN_S), _group(serve)
        assert trainer.poll() is None  # serve went with the interrupt, not with the trainer
    finally:
        trainer.kill()
        trainer.communicate()
        if serve is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(serve, signal.SIGKILL)
