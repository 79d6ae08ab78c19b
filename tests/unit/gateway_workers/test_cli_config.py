"""Worker flags reach the worker's config (commit-base bounds, the model's context window); 0 sessions means full
commits only."""

from __future__ import annotations

import pytest

from broker import protocol
from gateway_workers import cli
from gateway_workers.capture.commit_bases import MAX_CONTEXT_BYTES, MAX_SESSIONS, CommitBases
from gateway_workers.config import WorkerConfig


def _config(*flags: str) -> WorkerConfig:
    serve, _ = cli._settings(cli._parser().parse_args(["serve", *flags]))
    return serve.worker


def _commit(turn_id: str, prompt: list[int]) -> protocol.CommitTurn:
    return protocol.CommitTurn(
        0, "s", turn_id, protocol.ids_array(prompt), protocol.ids_array([7, 8]), protocol.ids_array(), "stop",
        [{"role": "user", "content": "hi"}], {"role": "assistant", "content": "ok"}, {"ill_formed": False},
    )  # fmt: skip


def test_the_flags_reach_the_worker_config_and_survive_its_trip_through_the_environment(monkeypatch):
    config = _config("--commit-base-sessions", "0", "--commit-base-mib", "7", "--max-context-tokens", "32768")
    assert (config.commit_base_sessions, config.commit_base_mib, config.max_context_tokens) == (0, 7, 32768)
    monkeypatch.setenv(*next(iter(config.to_env().items())))
    assert WorkerConfig.from_env() == config
    default = _config()
    assert (default.commit_base_sessions, default.commit_base_mib << 20) == (MAX_SESSIONS, MAX_CONTEXT_BYTES)
    assert default.max_context_tokens is None


def test_negative_bounds_are_refused():
    with pytest.raises(SystemExit, match="commit-base"):
        _config("--commit-base-sessions", "-1")
    with pytest.raises(SystemExit, match="max-context-tokens"):
        _config("--max-context-tokens", "0")


@pytest.mark.parametrize(("sessions", "deltas"), [(0, False), (1, True)])
def test_without_room_for_a_base_every_commit_travels_in_full(sessions: int, deltas: bool):
    bases = CommitBases(max_sessions=sessions)
    bases.remember(_commit("t0", [1, 2, 3]))
    follow_up = bases.delta(_commit("t1", [1, 2, 3, 7, 8, 4]))
    assert (follow_up is not None) == deltas
