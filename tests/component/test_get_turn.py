"""GetTurn over real sockets: a committed turn's canonical messages, scoped to its session (previous_response_id)."""

from __future__ import annotations

from component.peers import conversation

from broker import protocol


def _get(worker, sid: str, turn_id: str) -> protocol.Message:
    return worker.request(protocol.GetTurn(worker.next_id(), sid, turn_id))


def test_committed_turns_are_found_with_their_exact_messages(client, worker):
    sid = client.open_session()
    turns = conversation(3, 3)
    for k, turn in enumerate(turns):
        worker.open_turn(sid, f"t{k}")
        worker.commit(sid, f"t{k}", turn)
    for k, turn in enumerate(turns):  # stored deduplicated, handed back whole
        found = _get(worker, sid, f"t{k}")
        assert isinstance(found, protocol.TurnFound) and found.turn_id == f"t{k}"
        assert found.prompt_messages == turn.prompt_messages
        assert found.response_message == turn.response_message
    # an empty turn id only checks the session
    checked = _get(worker, sid, "")
    assert isinstance(checked, protocol.Refused) and checked.code == "unknown_turn"


def test_ids_never_cross_sessions_and_in_flight_or_aborted_turns_are_not_found(client, worker):
    mine, other = client.open_session(), client.open_session()
    (turn,) = conversation(4, 1)
    worker.open_turn(mine, "t0")
    pending = _get(worker, mine, "t0")
    assert isinstance(pending, protocol.Refused) and pending.code == "turn_pending"
    worker.commit(mine, "t0", turn)
    leaked = _get(worker, other, "t0")
    assert isinstance(leaked, protocol.Refused) and leaked.code == "unknown_turn"
    worker.open_turn(mine, "t1")
    worker.abort(mine, "t1")
    aborted = _get(worker, mine, "t1")
    assert isinstance(aborted, protocol.Refused) and aborted.code == "unknown_turn"
    unknown = _get(worker, "no-such-session", "t0")
    assert isinstance(unknown, protocol.Refused) and unknown.code == "unknown_session"
    client.finish_session(mine)
    closed = _get(worker, mine, "t0")
    assert isinstance(closed, protocol.Refused) and closed.code == "session_closed"
