"""`serve --state-dir DIR --fsync ...`: a broker killed under serve comes back with its sessions.

Real serve (2 workers, the mock engine), the official openai SDK as the agent, the real trainer client.
The broker is killed with SIGKILL in the middle of a session; serve's supervisor restarts it on the
same endpoints and the same state directory: the session's next turn is served (not a 401), and its
finish returns every turn, the ones before the kill included. A whole serve stopped and started again
on the directory keeps its sessions too.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import openai
from assets import wait_until
from processes import launch_gateway

USER = [{"role": "user", "content": "hello"}]
RESTART_WITHIN_S = 30.0


def broker_pid(serve_pid: int) -> int | None:
    """The pid of serve's broker child (`python -m broker ...`), if one runs."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        if parent == serve_pid and "-m broker" in cmd and stat[stat.rindex(")") + 2] != "Z":
            return int(entry.name)
    return None


def turn(gw, key: str, content: str) -> str:
    with openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=2, timeout=30) as agent:
        reply = agent.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": content}])
    return reply.choices[0].message.content or ""


def turns_in(rows) -> int:
    return sum(len(r.metadata["turn_ids"]) for r in rows)


def test_a_broker_killed_under_serve_comes_back_with_its_sessions(tmp_path):
    extra = ["--log-level", "warning", "--state-dir", str(tmp_path / "state"), "--fsync", "always"]
    with launch_gateway(workers=2, engine_kind="mock", extra_args=extra) as gw:
        sid = gw.client.open_session()
        other = gw.client.open_session()
        assert turn(gw, sid, "one") and turn(gw, sid, "two") and turn(gw, other, "x")
        first = broker_pid(gw.process.pid)
        assert first is not None
        os.kill(first, signal.SIGKILL)
        assert wait_until(lambda: broker_pid(gw.process.pid) not in (None, first), timeout=RESTART_WITHIN_S)
        assert wait_until(lambda: any("the broker is back" in line for line in list(gw.output)), timeout=30)
        assert turn(gw, sid, "three")  # the recovered session serves on: no 401
        rows = gw.client.finish_session(sid)
        assert turns_in(rows) == 3
    # a new serve on the same directory finds the session the first one left open
    with launch_gateway(workers=1, engine_kind="mock", extra_args=extra) as gw:
        stats = gw.client.stats()
        assert stats["state_dir"] == str(tmp_path / "state") and stats["sessions_open"] == 1
        assert turn(gw, other, "y")
        assert turns_in(gw.client.finish_session(other)) == 2
