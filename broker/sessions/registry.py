"""The session registry: every live session (`session.Session`) and the lifecycle rules in docs/design.md.

Pure bookkeeping: no sockets, no encoding; the one clock (injectable) only ages log bytes for
idle-time compaction, which `compaction.CompactionScheduler` schedules. `server.py` calls it from
its single thread and turns `Refusal` into `protocol.Refused`. Each session keeps its committed
turns in a deduplicated `turn_store.TurnStore` (about its unique tokens); `TurnRecord`s are
materialized only at finish. A durable broker's recovery puts sessions back (`restore`, from
`images`) and replays finishes without building rows (`forget`). Imports only the stdlib,
`broker.protocol` and `broker.sessions`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from broker import protocol
from broker.protocol import session_tag
from broker.sessions import history
from broker.sessions.compaction import COMPACT_CHUNK_BYTES, COMPACT_SLICE_BYTES, CompactionScheduler
from broker.sessions.logs.append_logs import packed_messages
from broker.sessions.session import (
    FinishedSession,
    FinishOrigin,
    Refusal,
    Session,
    abandoned_seq,
    check_delta_shape,
    check_session_key,
    check_settings,
    check_turn_id,
    committed_store,
    minted_key,
)
from broker.sessions.turn_record import TurnRecord

logger = logging.getLogger(__name__)

# Request digests kept per session for retries to find (`Session.digests`): a retry follows its request
# within seconds, so the latest ones suffice, and a session's memory for them stays bounded.
MAX_DIGESTS = 64
# Ends kept for the workers' next heartbeats (a second apart): far more than end in that time.
ENDED_KEPT = 16_384
# The registry's lifetime counters (`stats`). bytes_freed: what it let go to the allocator (compressed chunks' raw
# bytes, finished and dropped sessions' logs); the server trims the C heap by it (`heap_trim`).
COUNTERS = (
    "sessions_opened", "sessions_finished", "sessions_dropped",
    "turns_opened", "turns_aborted", "turns_abandoned", "turns_worker_lost",
    "commits_late", "turns_replayed", "commits_stored", "commits_duplicate", "commits_discarded", "commits_delta",
    "commits_unknown_base", "bytes_compacted", "bytes_freed", *history.HISTORY_COUNTERS,
)  # fmt: skip

class SessionRegistry:
    """Every live session, keyed by id, and the lifecycle rules applied to them."""

    def __init__(
        self,
        *,
        max_sessions: int,
        max_turns_cap: int | None = None,
        finished_memory: int = 65_536,
        compact: bool = True,
        compact_min_bytes: int = 0,
        compact_age_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        unknown_hint: str = "",
        history_mode: str = "tree",
        linear_fallback: str = "fork",
    ) -> None:
        problem = protocol.check_history(history_mode, linear_fallback)
        if problem is not None:
            raise ValueError(problem)
        # A session opened with "" for either takes these.
        self.history_mode = history_mode
        self.linear_fallback = linear_fallback
        # The policy version the trainer last set (`protocol.SetWeightVersion`; -1: none): each OPEN hands it to
        # the worker, whose commit records it.
        self.weight_version = -1
        self._sessions: dict[str, Session] = {}
        self._serials = itertools.count()  # each opening's `Session.serial`
        # Appended to every unknown_session refusal: why a key the caller had may be gone (a broker that
        # restarted without a state directory says so).
        self._unknown_hint = unknown_hint
        self._finished: OrderedDict[str, FinishOrigin] = OrderedDict()
        # Every session's end in order (`ended_total` counts them), so that each worker is told the ends since it
        # was last told and drops what it caches of those sessions (`workers.WorkerLiveness.ended_since`).
        self.ended: deque[str] = deque(maxlen=ENDED_KEPT)
        self.ended_total = 0
        self.end_listeners: list[Callable[[str], None]] = []  # told of every session's end (e.g. its replica slot)
        self._max_sessions = max_sessions
        self._max_turns_cap = max_turns_cap
        self._finished_memory = finished_memory
        # Idle-time compaction compresses log bytes held compact_age_s (`compaction`); sessions under
        # compact_min_bytes of raw logs never pay at all (see `config`).
        self._compact = compact
        self._compact_min_bytes = compact_min_bytes
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.compaction = CompactionScheduler(self._sessions, self.counters, age_s=compact_age_s, clock=clock)

    # --- lookups ---------------------------------------------------------------------

    def get(self, sid: str) -> Session:
        """The live session `sid`, or a Refusal that says whether it never existed or is over."""
        session = self._sessions.get(sid)
        if session is None:
            origin = self._finished.get(sid)
            if origin == "dropped":
                raise Refusal("session_closed", f"session {session_tag(sid)} was dropped")
            if origin is not None:
                raise Refusal("session_closed",
                              f"session {session_tag(sid)} has already finished (finished by the {origin})")
            raise Refusal("unknown_session", f"no session {session_tag(sid)}{self._unknown_hint}")
        return session

    def __contains__(self, sid: object) -> bool:
        return sid in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

    # --- trainer side ----------------------------------------------------------------

    def open_session(
        self,
        session_id: str | None,
        sampling_defaults: dict[str, Any],
        max_context_tokens: int | None,
        max_turns: int | None,
        metadata: dict[str, Any],
        client_id: str = "",
        group: str | None = None,
        history_mode: str = "",
        linear_fallback: str = "",
    ) -> Session:
        """Register a session; mint an unguessable key unless the caller gave one. An empty `history_mode` or
        `linear_fallback` takes the registry's default."""
        if session_id is not None:
            check_session_key(session_id)
        history_mode, linear_fallback = history_mode or self.history_mode, linear_fallback or self.linear_fallback
        check_settings(max_context_tokens, max_turns, history_mode, linear_fallback)
        if len(self._sessions) >= self._max_sessions:
            raise Refusal("busy", f"the broker holds its maximum of {self._max_sessions} sessions")
        if session_id is None:
            session_id = minted_key()
        elif session_id in self._sessions:
            raise Refusal("duplicate_session", f"session {session_tag(session_id)} is already open")
        if self._max_turns_cap is not None:
            max_turns = self._max_turns_cap if max_turns is None else min(max_turns, self._max_turns_cap)
        self._finished.pop(session_id, None)  # a reused id starts afresh
        session = Session(
            session_id, sampling_defaults, max_context_tokens, max_turns, metadata, client_id, group, history_mode,
            linear_fallback,
        )  # fmt: skip
        session.serial = next(self._serials)
        self._sessions[session_id] = session
        self.counters["sessions_opened"] += 1
        return session

    def closable(self, sid: str) -> Session:
        """The session, if a finish may still close it; else the Refusal that later finishers get."""
        session = self.get(sid)
        if session.state != "open":
            raise Refusal("session_closed",
                          f"session {session_tag(sid)} is already finishing (finished by the {session.finished_by})")
        return session

    def close(self, sid: str, origin: FinishOrigin = "trainer") -> Session:
        """Stop new turns (the first step of finish); in-flight turns may still commit or abort.

        Exactly one finish closes a session, whichever way it came (`origin`).
        """
        session = self.closable(sid)
        session.state = "closing"
        session.finished_by = origin
        return session

    def finish(self, sid: str) -> FinishedSession:
        """Free a (closed) session and materialize its committed turns in OPEN sequence order."""
        session = self._sessions.pop(sid)
        origin = session.finished_by or "trainer"
        self._remember_finished(sid, origin)
        abandoned = len(session.in_flight) + len(session.abandoned)
        self.counters["sessions_finished"] += 1
        self.counters["turns_abandoned"] += abandoned
        self.counters["bytes_freed"] += session.committed.bytes_held()
        turns = session.committed.records()
        return FinishedSession(
            sid,
            turns,
            session.max_context_tokens,
            session.metadata,
            abandoned,
            session.client_id,
            session.group,
            origin,
            len(session.abandoned),
        )

    def drop(self, sid: str) -> bool:
        """Free a session and all it holds, building nothing; False if there was none."""
        session = self._sessions.pop(sid, None)
        if session is None:
            return False
        self._remember_finished(sid, "dropped")
        self.counters["sessions_dropped"] += 1
        self.counters["bytes_freed"] += session.committed.bytes_held()
        return True

    def _remember_finished(self, sid: str, origin: FinishOrigin) -> None:
        self.ended.append(sid)
        self.ended_total += 1
        for listener in self.end_listeners:
            listener(sid)
        self._finished[sid] = origin
        if len(self._finished) > self._finished_memory:
            self._finished.popitem(last=False)

    # --- worker side -------------------------------------------------------------------

    def open_turn(self, sid: str, turn_id: str, worker_id: str = "", digest: str = "") -> tuple[Session, int]:
        """Admit a turn: session open, under its cap. Returns the session and the turn's seq.

        `worker_id` (when named) owns the turn until it is committed or aborted (`abandon_turn`); a retry of
        the request `digest` names finds it (`repeated_turn`)."""
        session = self.get(sid)
        seq = session.in_flight.get(turn_id)
        if seq is not None:  # a worker re-sent OPEN after losing our reply: same answer, even if closing
            return session, seq
        if session.state != "open":
            raise Refusal("session_closed", f"session {session_tag(sid)} is finishing; no new turns")
        check_turn_id(turn_id)
        if turn_id in session.committed or turn_id in session.aborted or turn_id in session.abandoned:
            raise Refusal("bad_request", f"turn {turn_id!r} of session {session_tag(sid)} is already over")
        cap = session.max_turns
        if cap is not None and len(session.in_flight) + len(session.committed) + len(session.abandoned) >= cap:
            raise Refusal("turn_cap", f"session {session_tag(sid)} reached its cap of {cap} turns")
        seq = session.next_seq
        session.next_seq += 1
        session.in_flight[turn_id] = seq
        if worker_id:
            session.owners[turn_id] = worker_id
        if digest:
            digests = session.digests
            earlier = digests.get(digest)
            if earlier is not None and earlier in session.abandoned:
                # Sampled afresh for a retry: the abandoned attempt must not land late beside it.
                del session.abandoned[earlier]
                session.aborted.add(earlier)
            digests[digest] = turn_id
            if len(digests) > MAX_DIGESTS:  # the oldest request goes (a repeated body keeps its first place)
                del digests[next(iter(digests))]
        self.counters["turns_opened"] += 1
        return session, seq

    def repeated_turn(self, sid: str, digest: str, asking: str = "") -> TurnRecord | None:
        """The committed turn a retry of request `digest` gets again; None when it must be sampled (no such
        request, or its turn was aborted); a turn_pending Refusal while that turn is still in flight.

        None too when that turn is `asking` itself: a worker resent the OPEN whose answer it lost (`open_turn`
        answers it again), and must not wait for its own turn."""
        session = self.get(sid)
        turn_id = session.digests.get(digest)
        if turn_id is None or turn_id == asking:
            return None
        if turn_id in session.in_flight:
            raise Refusal("turn_pending", f"turn {turn_id!r} of this request is still in flight; ask again")
        record = session.committed.record(turn_id)
        if record is not None:
            self.counters["turns_replayed"] += 1
        return record

    def commit_turn(self, msg: protocol.CommitTurn) -> str:
        """Store a committed turn; returns the outcome: stored, duplicate or discarded."""
        sid = msg.session_id
        session = self._sessions.get(sid)
        counters = self.counters
        if session is None:  # finished, dropped or never known: ACK so the worker stops retrying
            counters["commits_discarded"] += 1
            return "discarded"
        store, turn_id = session.committed, msg.turn_id
        if turn_id in store:
            counters["commits_duplicate"] += 1
            return "duplicate"
        in_flight = session.in_flight
        seq = in_flight.get(turn_id)
        if seq is None:
            seq = abandoned_seq(session, turn_id)
        try:
            messages = packed_messages(msg.prompt_messages, msg.response_message)
        except ValueError as e:
            raise Refusal("bad_request", f"prompt_messages and response_message must be maps: {e}") from None
        n_out = len(msg.output_ids)
        if len(msg.logprobs) != n_out:
            raise Refusal("bad_request", f"{len(msg.logprobs)} logprobs for {n_out} output ids")
        if msg.base_turn_id:
            n, plen = msg.base_tokens, msg.prompt_len
            # the delta's own numbers (see protocol.CommitTurn), checked at once; `check_delta_shape` says which failed
            if not (
                msg.base_turn_id != turn_id and n >= 0 and msg.base_messages >= 0 and plen >= 0
                and len(msg.prompt_ids) == (plen - n if plen > n else 0) and n <= plen + n_out
            ):  # fmt: skip
                check_delta_shape(msg)
            problem = store.add_delta(msg, seq, messages)
            if problem is not None:
                counters["commits_unknown_base"] += 1
                raise Refusal("unknown_base", f"session {session_tag(sid)}: {problem}; resend the turn in full")
            counters["commits_delta"] += 1
        elif msg.base_tokens or msg.base_messages or msg.prompt_len not in (0, len(msg.prompt_ids)):
            raise Refusal(
                "bad_request",
                "a full commit (no base_turn_id) sends base_tokens = base_messages = 0 "
                "and prompt_len = 0 or len(prompt_ids)",
            )
        else:
            store.add_full(msg, seq, messages)
        if in_flight.pop(turn_id, None) is None:
            self._landed_late(session, turn_id)
        if session.owners:
            session.owners.pop(turn_id, None)
        if session.history_mode == "linear" and msg.flags:
            keep = history.FORK_HEADS if session.linear_fallback == "fork" else 1
            kind = history.note_head(session.heads, session.head_seqs, seq, turn_id, msg.flags, keep)
            if kind is not None:
                counters[kind] += 1
        counters["commits_stored"] += 1
        if self._compact and store.raw_bytes >= self._compact_min_bytes:
            self.compaction.note_commit(session)
        return "stored"

    def _landed_late(self, session: Session, turn_id: str) -> None:
        del session.abandoned[turn_id]
        logger.warning("turn %s of session %s committed after its worker was given up for lost: stored",
                       turn_id, session_tag(session.sid))
        self.counters["commits_late"] += 1

    def abandon_turn(self, sid: str, turn_id: str) -> bool:
        """Stop waiting for an in-flight turn whose worker fell silent; False if it is not in flight."""
        session = self._sessions.get(sid)
        seq = None if session is None else session.in_flight.pop(turn_id, None)
        if session is None or seq is None:
            return False
        session.owners.pop(turn_id, None)
        session.abandoned[turn_id] = seq
        self.counters["turns_worker_lost"] += 1
        return True

    def abort_turn(self, sid: str, turn_id: str, reason: str = "") -> Session | None:
        """Forget an in-flight turn. Unknown sessions and turns are fine: the turn is gone either way."""
        session = self._sessions.get(sid)
        if session is None:
            return None
        if session.abandoned.pop(turn_id, None) is not None:
            session.aborted.add(turn_id)
        elif session.in_flight.pop(turn_id, None) is not None:
            session.owners.pop(turn_id, None)
            session.aborted.add(turn_id)
            self.counters["turns_aborted"] += 1
            if reason == protocol.NOT_LINEAR:
                self.counters["linear_rejects"] += 1
        elif turn_id in session.committed:
            raise Refusal("bad_request", f"turn {turn_id!r} of session {session_tag(sid)} is already committed")
        return session

    def turn_messages(self, sid: str, turn_id: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """A committed turn's canonical prompt messages and response (for `previous_response_id`).

        Only turns of an open session `sid` are found, so a turn id never leaks across sessions.
        """
        found = committed_store(self.get(sid), turn_id).turn_messages(turn_id)
        assert found is not None
        return found

    def turn_record(self, sid: str, turn_id: str) -> TurnRecord:
        """A committed turn of open session `sid`, ids included (a linear session's held turn), as `turn_messages`."""
        found = committed_store(self.get(sid), turn_id).record(turn_id)
        assert found is not None
        return found

    # --- a durable broker's recovery and snapshots (`broker.durability`) ---------------------

    def session(self, sid: str) -> Session | None:
        """The live session `sid`, or None (no refusal: for snapshots and replay)."""
        return self._sessions.get(sid)

    def session_ids(self) -> list[str]:
        return list(self._sessions)

    def sessions(self) -> list[Session]:
        return list(self._sessions.values())

    def restore(self, session: Session) -> None:
        """Put back a session rebuilt from a snapshot (`images.restore_session`); its id must be free."""
        if session.sid in self._sessions:
            raise ValueError(f"session {session_tag(session.sid)} is restored twice")
        self._finished.pop(session.sid, None)
        session.serial = next(self._serials)
        self._sessions[session.sid] = session
        if self._compact and session.committed.raw_bytes >= self._compact_min_bytes:
            self.compaction.note_commit(session)  # its logs age from the restart on

    def forget(self, sid: str, origin: FinishOrigin) -> bool:
        """Free a session that finished (replaying its finish: no rows are built); False if there was none."""
        session = self._sessions.pop(sid, None)
        if session is None:
            return False
        self._remember_finished(sid, origin)
        self.counters["bytes_freed"] += session.committed.bytes_held()
        return True

    def finished_items(self) -> list[tuple[str, FinishOrigin]]:
        """The finished-session memory, oldest first: (id, who finished it)."""
        return list(self._finished.items())

    def restore_finished(self, items: list[tuple[str, FinishOrigin]]) -> None:
        for sid, origin in items:
            self._remember_finished(sid, origin)

    # --- idle-time compaction (`compaction.CompactionScheduler`) ---------------------------

    @property
    def compaction_pending(self) -> bool:
        """Whether some session has log bytes held compact_age_s to compress (`compact_step`)."""
        return self.compaction.pending

    def compact_step(self, slice_bytes: int = COMPACT_SLICE_BYTES, chunk_bytes: int = COMPACT_CHUNK_BYTES) -> bool:
        """Compress the next `slice_bytes` of aged log bytes (of one chunk of one session); False when none are due.

        The server calls it when a poll finds no frame waiting, so it costs the commit path
        nothing, and a frame that arrives meanwhile waits for one slice at most.
        """
        return self.compaction.step(slice_bytes, chunk_bytes)

    # --- observability -----------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Gauges over live sessions plus the lifetime counters."""
        sessions = self._sessions.values()
        return {
            "sessions_open": sum(1 for s in sessions if s.state == "open"),
            "sessions_closing": sum(1 for s in sessions if s.state == "closing"),
            "turns_in_flight": sum(len(s.in_flight) for s in sessions),
            "turns_held": sum(len(s.committed) for s in sessions),
            "tokens_held": sum(s.committed.tokens_held for s in sessions),
            "bytes_held": sum(s.committed.bytes_held() for s in sessions),
            **self.counters,
        }
