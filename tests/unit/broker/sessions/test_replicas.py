"""Engine routing: least-loaded healthy replica, sticky until the session ends, moved when its replica goes."""

from __future__ import annotations

import http.server
import socket
import threading
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from broker.health import HealthChecker
from broker.sessions.replicas import ReplicaTable

A, B, C = "http://a:1", "http://b:1", "http://c:1"


def test_new_sessions_spread_by_load_and_stay_put_until_they_end() -> None:
    table = ReplicaTable([A, B + "/", B])
    assert table.urls == (A, B)  # trailing slashes and duplicates folded
    first = [table.assign(f"s{i}") for i in range(4)]
    assert Counter(first) == {A: 2, B: 2}
    assert [table.assign(f"s{i}") for i in range(4)] == first  # sticky
    table.release("s0")
    table.release("s2")  # both on A
    assert table.assign("s4") == A and table.assign("s5") == A  # the freed slots go first
    assert table.stats()["replicas"][A]["sessions"] == 2 and table.counters["sessions_routed"] == 6


def test_an_unhealthy_replica_takes_nothing_and_its_sessions_move_once() -> None:
    table = ReplicaTable([A, B])
    on_a = [sid for sid in ("s0", "s1", "s2", "s3") if table.assign(sid) == A]
    assert table.health(A, False, "refused") and not table.health(A, False, "refused")  # a change once
    assert all(table.assign(sid) == B for sid in on_a) and table.counters["sessions_moved"] == len(on_a)
    assert table.assign("new") == B and table.stats()["replicas"][A] == {"healthy": False, "sessions": 0,
                                                                          "last_error": "refused"}
    assert table.health(A, True)
    assert table.assign("newer") == A  # healthy again, and the least loaded
    assert all(table.assign(sid) == B for sid in on_a)  # moved sessions stay where they went
    for url in (A, B):
        table.health(url, False)
    assert table.assign("x") in (A, B)  # none healthy: routed anyway (the engine's error reaches the agent)


def test_replicas_set_at_run_time_keep_their_sessions_and_removed_ones_give_them_up() -> None:
    table = ReplicaTable([A])
    for i in range(3):
        table.assign(f"s{i}")
    table.set([B, C])
    assert {table.assign(f"s{i}") for i in range(3)} <= {B, C} and table.counters["sessions_moved"] == 3
    table.set([A, B, C])
    assert table.stats()["replicas"][A]["sessions"] == 0
    table.set([])
    assert table.assign("s0") == ""  # no replicas: the workers choose


@given(st.lists(st.tuples(st.sampled_from(["assign", "release", "down", "up", "set"]), st.integers(0, 9)),
                max_size=80))  # fmt: skip
def test_each_replicas_count_is_the_sessions_assigned_to_it(ops: list[tuple[str, int]]) -> None:
    urls = [A, B, C]
    table = ReplicaTable(urls)
    for op, n in ops:
        if op == "assign":
            table.assign(f"s{n}")
        elif op == "release":
            table.release(f"s{n}")
        elif op in ("down", "up"):
            table.health(urls[n % 3], op == "up")
        else:
            table.set(urls[: 1 + n % 3])
        counts = Counter(table.assigned.values())
        assert {r.url: r.sessions for r in table.replicas.values()} == {url: counts[url] for url in table.replicas}


def test_the_health_checker_reports_each_replica() -> None:
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    up = f"http://127.0.0.1:{server.server_address[1]}"
    checker = HealthChecker(0.05, 1.0)
    try:
        assert checker.check(up) == (True, "")
        healthy, why = checker.check("http://127.0.0.1:1")  # nothing listens there
        assert not healthy and "failed" in why
        checker.watch((up,))
        checker.start()
        assert checker.results.get(timeout=5) == (up, True, "")
    finally:
        checker.stop()
        server.shutdown()
        server.server_close()


def test_a_replica_answering_garbage_fails_its_check_and_the_checks_go_on() -> None:
    """Not HTTP (a wrong port, a proxy's banner) is a failed check, not the end of the checker's thread."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def answer_garbage() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(4096)
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")

    threading.Thread(target=answer_garbage, daemon=True).start()
    garbage = f"http://127.0.0.1:{listener.getsockname()[1]}"
    checker = HealthChecker(0.05, 1.0)
    try:
        healthy, why = checker.check(garbage)
        assert not healthy and "BadStatusLine" in why, why
        checker.watch((garbage,))
        checker.start()
        for _ in range(2):  # a second round: the thread survived the first
            url, healthy, why = checker.results.get(timeout=5)
            assert url == garbage and not healthy and "BadStatusLine" in why
    finally:
        checker.stop()
        stop.set()
        listener.close()


def test_a_check_that_raises_is_logged_and_the_next_round_still_runs(caplog) -> None:
    checker = HealthChecker(0.05, 1.0)
    calls = []

    def check(url: str) -> tuple[bool, str]:
        calls.append(url)
        if len(calls) == 1:
            raise RuntimeError("a bug in the check")
        return True, ""

    checker.check = check  # type: ignore[method-assign]
    checker.watch((A,))
    with caplog.at_level("ERROR", logger="broker.health"):
        checker.start()
        try:
            assert checker.results.get(timeout=5) == (A, True, "")  # the round after the one that raised
        finally:
            checker.stop()
    assert len(calls) >= 2 and "the health check of http://a:1 failed" in caplog.text
