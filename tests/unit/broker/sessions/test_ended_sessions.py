"""Telling workers which sessions ended: each worker hears each end once, in order, at its next heartbeat.

A worker new to the broker is told nothing of ends before it was heard; one given up for silence is new
again when heard; past `ENDED_KEPT` ends a worker is told the most recent ones (it evicts the rest by LRU).
"""

from __future__ import annotations

from broker.sessions import registry as registry_module
from broker.sessions.registry import SessionRegistry
from broker.sessions.workers import WorkerLiveness


def _open(reg: SessionRegistry, *sids: str) -> None:
    for sid in sids:
        reg.open_session(sid, {}, None, None, {})


def test_each_worker_is_told_each_end_once_in_order():
    reg = SessionRegistry(max_sessions=16)
    live = WorkerLiveness(silence_s=3.0)
    _open(reg, "ended-before-a", "s1", "s2", "s3")
    reg.drop("ended-before-a")
    assert live.ended_since("a", reg) == []  # new: it holds nothing of an earlier end
    reg.close("s1")
    reg.finish("s1")
    reg.drop("s2")
    assert live.ended_since("b", reg) == []
    assert live.ended_since("a", reg) == ["s1", "s2"]
    assert live.ended_since("a", reg) == []  # told once
    reg.drop("s3")
    assert live.ended_since("b", reg) == ["s3"] and live.ended_since("a", reg) == ["s3"]


def test_a_worker_given_up_is_new_again_and_a_late_one_hears_the_latest(monkeypatch):
    monkeypatch.setattr(registry_module, "ENDED_KEPT", 3)
    reg = SessionRegistry(max_sessions=16)
    live = WorkerLiveness(silence_s=3.0)
    live.hear("a", 0.0)
    live.ended_since("a", reg)
    sids = [f"s{k}" for k in range(5)]
    _open(reg, *sids)
    for sid in sids:
        reg.drop(sid)
    assert live.ended_since("a", reg) == ["s2", "s3", "s4"]  # the most recent ENDED_KEPT
    _open(reg, "s5")
    reg.drop("s5")
    assert live.silent(10.0) == ["a"]
    assert live.ended_since("a", reg) == []  # heard anew: a new worker
