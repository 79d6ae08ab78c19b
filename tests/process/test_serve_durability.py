"""`serve --state-dir DIR --fsync ...`: a broker killed under serve comes back with its sessions.

Real serve (2 workers, the mock engine), the official openai SDK as the agent, the real trainer client.
The broker is killed with SIGKILL in the middle of a session; serve's supervisor restarts it on the
same endpoints and the same state directory: the session's next turn is served (not a 401), and its
finish returns every turn, the ones before the kill included. A whole serve stopped and started again
on the directory keeps its sessions too. Requests whose OPEN died with the broker are held by their
worker, which resends the OPEN, and are served once the broker is back: no error reaches the agent.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import openai
from assets import wait_until
from processes import launch_gateway

USER = [{"role": "user", "content": "hello"}]
RESTART_WITHIN_S = 30.0
AGENTS = 4
REACH_WORKER_S = 0.5
HELD_REPLY_WITHIN_S = 30.0


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


def test_requests_whose_open_died_with_the_broker_are_held_and_served_once_it_is_back(tmp_path):
    extra = ["--log-level", "warning", "--state-dir", str(tmp_path / "state")]
    with launch_gateway(workers=2, engine_kind="mock", extra_args=extra) as gw:
        sids = [gw.client.open_session() for _ in range(AGENTS)]
        for sid in sids:
            assert turn(gw, sid, "before")
        first = broker_pid(gw.process.pid)
        assert first is not None
        # Stopped, the broker leaves the OPENs of the requests below unread in its socket; killed, it loses them
        # unanswered, as a broker killed mid-load loses the frames it had not read yet.
        os.kill(first, signal.SIGSTOP)
        replies: dict[str, str] = {}
        errors: list[BaseException] = []

        def agent(sid: str) -> None:
            try:
                # no SDK retries: a 503 or a timeout would be an error here, not a retry that hides it
                with openai.OpenAI(base_url=gw.base_url, api_key=sid, max_retries=0, timeout=HELD_REPLY_WITHIN_S) as a:
                    reply = a.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": "held"}])
                replies[sid] = reply.choices[0].message.content or ""
            except BaseException as e:
                errors.append(e)

        agents = [threading.Thread(target=agent, args=(sid,), daemon=True) for sid in sids]
        t0 = time.monotonic()
        try:
            for thread in agents:
                thread.start()
            time.sleep(REACH_WORKER_S)  # their OPENs sent; one that comes later is held all the same
            os.kill(first, signal.SIGKILL)
        finally:
            for thread in agents:
                thread.join(HELD_REPLY_WITHIN_S)
        assert not any(thread.is_alive() for thread in agents)
        assert errors == [] and sorted(replies) == sorted(sids) and all(replies.values()), errors
        assert time.monotonic() - t0 >= REACH_WORKER_S  # they waited for the restarted broker
        assert broker_pid(gw.process.pid) not in (None, first)
        for sid in sids:  # each turn recorded once: the resent OPENs opened one turn
            assert turns_in(gw.client.finish_session(sid)) == 2
