"""`broker.generation`: the pause's epochs, the workers' reports, and when a parked pause request is answered."""

from __future__ import annotations

from broker import protocol
from broker.generation import Generation

LIVE = ("w1", "w2")


def _answered(replies: list[tuple[list[bytes], protocol.Message]]) -> list[protocol.GenerationPaused]:
    out = [reply for _, reply in replies]
    assert all(isinstance(r, protocol.GenerationPaused) for r in out)
    return out  # type: ignore[return-value]


def test_a_pause_is_answered_once_every_live_worker_applied_it_and_has_no_engine_call_left() -> None:
    gen = Generation()
    assert gen.pause("wait", now=10.0) and gen.epoch == 1 and gen.paused
    assert not gen.pause("abort", now=10.5) and gen.mode == "wait"  # paused already: nothing changes
    gen.park([b"trainer"], 7, timeout=5.0, already=False, now=10.0)
    assert gen.heard("w1", [0, 0, 0, 0, 0], [b"hb1"])  # an older epoch: tell it again
    assert gen.answers(LIVE, 10.1) == []
    assert not gen.heard("w1", [1, 2, 1, 0, 0], [b"hb1"])
    assert not gen.heard("w2", [1, 0, 3, 0, 0], [b"hb2"])
    assert gen.answers(LIVE, 10.2) == []  # w1 still has two engine calls
    gen.heard("w1", [1, 0, 1, 40, 0], [b"hb1"])
    (report,) = _answered(gen.answers(LIVE, 10.25))
    counted = (report.request_id, report.idle, report.workers, report.turns_held, report.tokens_kept)
    assert counted == (7, True, 2, 4, 40)
    assert abs(report.seconds_to_idle - 0.25) < 1e-9 and gen.parked == []
    assert gen.envelopes == {"w1": [b"hb1"], "w2": [b"hb2"]}


def test_a_deadline_a_resume_or_a_silent_worker_answers_what_waits() -> None:
    gen = Generation()
    gen.pause("wait", now=0.0)
    gen.heard("w1", [1, 1, 0, 0, 0], [b"hb1"])
    gen.park([b"a"], 1, timeout=1.0, already=False, now=0.0)
    gen.park([b"b"], 2, timeout=3.0, already=True, now=0.0)
    assert gen.next_deadline() == 1.0
    (late,) = _answered(gen.answers(["w1"], 1.5))
    assert (late.request_id, late.idle, late.engine_calls) == (1, False, 1)
    gen.forget(["w1"])  # given up for silent: no longer waited for
    (idle,) = _answered(gen.answers([], 1.6))
    assert (idle.request_id, idle.idle, idle.already) == (2, True, True)
    gen.park([b"c"], 3, timeout=9.0, already=False, now=2.0)
    gen.heard("w2", [1, 1, 0, 0, 0], [b"hb2"])
    assert gen.resume(now=2.5) == 2.5 and gen.epoch == 2 and not gen.paused
    (resumed,) = _answered(gen.answers(["w2"], 2.5))
    assert resumed.idle is False and resumed.resumed  # resumed before it went idle
    assert gen.resume(now=3.0) is None  # not paused


def test_a_report_that_is_not_five_ints_is_ignored_and_a_restore_takes_the_logged_pause() -> None:
    gen = Generation()
    for bad in ([], [1, 2, 3, 4], [1, 2, 3, 4, "5"], [1, 2, 3, 4, True]):
        assert not gen.heard("w", bad, [b"x"])
    assert gen.reports == {} and gen.envelopes == {}
    gen.restore(4, "wait", 1.7e9)
    assert (gen.epoch, gen.mode, gen.since, gen.paused) == (4, "wait", 1.7e9, True)
    told = gen.changed(weight_version=6)
    assert (told.epoch, told.paused, told.weight_version) == (4, "wait", 6)


def test_a_keep_pause_is_idle_once_every_replica_paused_with_calls_still_held_and_names_the_pausers() -> None:
    gen = Generation()
    gen.heard("w2", [0, 0, 0, 0, 0], [b"hb2"])
    gen.heard("w1", [0, 0, 0, 0, 0], [b"hb1"])
    assert gen.changed(5).engine_pausers == []  # generating: the engines' own pause is not in use
    gen.pause("keep", now=0.0)
    told = gen.changed(5)
    assert (told.paused, told.engine_pausers) == ("keep", ["w1", "w2"])  # the same order for every worker
    gen.park([b"t"], 1, timeout=9.0, already=False, now=0.0)
    gen.heard("w1", [1, 3, 0, 0, 0], [b"hb1"])  # calls held by the engine count for nothing
    gen.heard("w2", [1, 2, 0, 0, 1], [b"hb2"])  # one replica's pause not answered yet
    assert gen.answers(LIVE, 0.1) == []
    gen.heard("w2", [1, 2, 0, 0, 0], [b"hb2"])
    (report,) = _answered(gen.answers(LIVE, 0.2))
    assert report.idle and report.engine_calls == 5
    assert gen.forget(["w2"])  # a worker lost: the others are told again, to take its replicas
    assert gen.changed(5).engine_pausers == ["w1"]
    gen.resume(now=1.0)
    assert gen.changed(6).engine_pausers == ["w1"]  # the resume names who resumes the engines
    gen.pause("wait", now=2.0)
    assert gen.changed(6).engine_pausers == [] and not gen.forget(["w1"])
