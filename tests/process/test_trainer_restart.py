"""Trainers and agents in the middle of a call when `serve`'s broker is killed with SIGKILL.

Real serve (one worker, the mock engine with a delay so that a turn is surely in flight), the official
openai SDK as the agent (its default retries on), the real trainer client, with and without
`--state-dir`. A trainer thread blocked in `finish_session` is answered promptly after the restart, far
from its timeout: with a durable broker it gets the rows of every turn, the one in flight at the kill
included; without one, `UnknownSession` saying the state was not durable. A thread iterating
`episodes()` keeps receiving through the restart: with a durable broker every episode arrives exactly
once (by session, with distinct delivery ids), finished before, around and after the kill. An agent
whose request arrives while the broker is down (kept down a while by stopping serve's supervisor) is held
by its worker, which resends the OPEN, and gets its reply on its first attempt once the broker is back.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from assets import wait_until
from process.test_serve_durability import RESTART_WITHIN_S, broker_pid, turn, turns_in
from processes import launch_gateway

from trainer_client import EpisodeTimeout, UnknownSession

pytestmark = pytest.mark.timeout(180)

MOCK_DELAY_S = 2.0  # an agent turn is in flight this long: time to see it there and kill the broker
FINISH_WAIT_S = 20.0
PROMPT_S = 15.0  # a call through a restart is answered within this, well under its timeout and its wait
EPISODES_WITHIN_S = 20.0
OUTAGE_S = 3.0  # the broker stays down this long while an agent's request waits for it
USER = [{"role": "user", "content": "hello"}]


def _backs(gw: Any) -> int:
    return sum("the broker is back" in line for line in list(gw.output))


def kill_the_broker(gw: Any) -> None:
    """SIGKILL serve's broker and wait until its supervisor says the new one is serving."""
    backs, first = _backs(gw), broker_pid(gw.process.pid)
    assert first is not None
    os.kill(first, signal.SIGKILL)
    assert wait_until(lambda: _backs(gw) > backs, timeout=RESTART_WITHIN_S)


def _gateway(*extra: str) -> Any:
    args = ["--log-level", "warning", "--mock-delay", str(MOCK_DELAY_S), *extra]
    return launch_gateway(workers=1, engine_kind="mock", extra_args=args)


@pytest.fixture(scope="module")
def durable_gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    state = tmp_path_factory.mktemp("trainer-restart") / "state"
    with _gateway("--state-dir", str(state), "--fsync", "interval") as gw:
        yield gw


class Subscriber:
    """A trainer thread iterating `episodes()` until stopped: what it got, and any error it met."""

    def __init__(self, client: Any) -> None:
        self.got: list[tuple[str, int, bool]] = []  # (session id, delivery id, redelivered)
        self.failures: list[BaseException] = []
        self._client = client
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="subscriber")
        self._thread.start()

    def _run(self) -> None:
        try:
            with self._client.episodes(timeout=0.5) as stream:
                while not self._stop.is_set():
                    try:
                        episode = next(stream)
                    except EpisodeTimeout:
                        continue
                    self.got.append((episode.session_id, episode.delivery_id, episode.redelivered))
        except BaseException as e:  # the test fails on any: the stream must ride through the restart
            self.failures.append(e)

    def sessions(self) -> set[str]:
        return {sid for sid, _, _ in self.got}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive()


class BlockedFinish:
    """A trainer thread in `finish_session` while one of the session's turns is in flight."""

    def __init__(self, gw: Any, sid: str) -> None:
        self.outcome: dict[str, Any] = {}
        # An agent has its reply before the broker has that turn's commit: the turn in flight must be this one
        # (seen in CI: an earlier turn's commit still on its way, the finish came before this turn's OPEN and
        # finished the session, and the turn met it with a 403).
        assert wait_until(lambda: gw.client.stats()["turns_in_flight"] == 0, timeout=20)
        self._agent = threading.Thread(target=turn, args=(gw, sid, "in flight"))
        self._agent.start()
        assert wait_until(lambda: gw.client.stats()["turns_in_flight"] == 1, timeout=20)
        self._thread = threading.Thread(target=self._finish, args=(gw.client, sid))
        self._thread.start()
        if not wait_until(lambda: gw.client.stats()["finishes_parked"] == 1, timeout=10):
            self._thread.join(5)
            raise AssertionError(f"the finish was not parked: {self.outcome}\n" + "".join(list(gw.output)[-40:]))

    def _finish(self, client: Any, sid: str) -> None:
        t0 = time.monotonic()
        try:
            self.outcome["rows"] = client.finish_session(sid, reward=1.0, wait_timeout=FINISH_WAIT_S)
        except Exception as e:
            self.outcome["error"] = e
        self.outcome["seconds"] = time.monotonic() - t0

    @property
    def waiting(self) -> bool:
        return self._thread.is_alive()

    def join(self) -> dict[str, Any]:
        for thread in (self._thread, self._agent):
            thread.join(60)
            assert not thread.is_alive()
        return self.outcome


def _with_turns(gw: Any, n: int) -> list[str]:
    sids = [gw.client.open_session() for _ in range(n)]
    agents = [threading.Thread(target=turn, args=(gw, sid, "hi")) for sid in sids]
    for a in agents:
        a.start()
    for a in agents:
        a.join(60)
    return sids


def test_durable_a_blocked_finish_and_an_episode_stream_ride_through_a_broker_kill(durable_gw, caplog):
    caplog.set_level(logging.INFO, logger="trainer_client.control_socket")
    gw = durable_gw
    subscriber = Subscriber(gw.client)
    try:
        early, around, late, finished = _with_turns(gw, 4)
        gw.client.request_finish(early)
        assert wait_until(lambda: early in subscriber.sessions(), timeout=EPISODES_WITHIN_S)
        blocked = BlockedFinish(gw, finished)
        gw.client.request_finish(around)  # its episode may be in the outbox, leased or in flight at the kill
        assert blocked.waiting
        kill_the_broker(gw)
        gw.client.request_finish(late)
        outcome = blocked.join()
        assert "error" not in outcome, outcome
        assert outcome["seconds"] < PROMPT_S, outcome
        assert turns_in(outcome["rows"]) == 2  # the one in flight at the kill landed after it, and is there
        assert any(r.getMessage().startswith("resending finish_session") for r in caplog.records)
        assert wait_until(lambda: subscriber.sessions() == {early, around, late}, timeout=EPISODES_WITHIN_S)
    finally:
        subscriber.stop()
    assert not subscriber.failures, subscriber.failures
    assert Counter(sid for sid, _, _ in subscriber.got) == Counter({early: 1, around: 1, late: 1})
    assert len({d for _, d, _ in subscriber.got}) == 3


def test_in_memory_a_blocked_finish_is_told_its_session_was_lost_and_the_stream_goes_on() -> None:
    with _gateway() as gw:
        subscriber = Subscriber(gw.client)
        try:
            (lost,) = _with_turns(gw, 1)
            blocked = BlockedFinish(gw, lost)
            kill_the_broker(gw)
            outcome = blocked.join()
            error = outcome.get("error")
            assert isinstance(error, UnknownSession) and "restarted without a state directory" in str(error), outcome
            assert outcome["seconds"] < PROMPT_S
            (after,) = _with_turns(gw, 1)  # the same client and stream serve on
            gw.client.request_finish(after)
            assert wait_until(lambda: after in subscriber.sessions(), timeout=EPISODES_WITHIN_S)
        finally:
            subscriber.stop()
        assert not subscriber.failures, subscriber.failures
        assert [sid for sid, _, _ in subscriber.got] == [after]


def test_an_agent_request_during_a_broker_outage_is_held_until_the_broker_is_back(durable_gw):
    gw = durable_gw
    sid = gw.client.open_session()
    answers: list[tuple[int, str | None]] = []

    def seen(response: Any) -> None:
        answers.append((response.status_code, response.headers.get("retry-after")))

    outcome: list[Any] = []

    def agent() -> None:
        http = openai.DefaultHttpxClient(event_hooks={"response": [seen]}, timeout=60)  # the SDK's own client
        with openai.OpenAI(base_url=gw.base_url, api_key=sid, max_retries=2, http_client=http) as client:
            try:
                outcome.append(client.chat.completions.create(model="qwen3", messages=USER))
            except openai.APIError as e:
                outcome.append(e)

    # serve is stopped so that its broker stays down a while (its supervisor would restart it sooner): the
    # agent's request waits at its worker, which resends the OPEN, and is answered nothing meanwhile.
    gw.process.send_signal(signal.SIGSTOP)
    try:
        first = broker_pid(gw.process.pid)
        assert first is not None
        backs = _backs(gw)
        os.kill(first, signal.SIGKILL)
        thread = threading.Thread(target=agent)
        thread.start()
        time.sleep(OUTAGE_S)
        assert answers == []
    finally:
        gw.process.send_signal(signal.SIGCONT)
    thread.join(60)
    assert not thread.is_alive()
    assert _backs(gw) > backs
    assert answers == [(200, None)]  # the first attempt's reply: no 503 for its SDK to retry
    (reply,) = outcome
    assert isinstance(reply, openai.types.chat.ChatCompletion) and reply.choices[0].message.content
    # its commit follows the reply a moment later; one turn, however often its OPEN was sent
    assert wait_until(lambda: gw.client.stats()["turns_in_flight"] == 0, timeout=10)
    assert turns_in(gw.client.finish_session(sid, wait_timeout=0)) == 1
