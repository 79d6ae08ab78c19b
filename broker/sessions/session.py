"""A session as the broker holds it, what its finish hands on, and the checks of what a peer names it by.

`Session` is one session's settings, lifecycle state and deduplicated turn store; `SessionRegistry` holds them
and applies the lifecycle rules, `compaction` ages their log bytes (`AgingEntry`), and `broker.durability`
writes and restores them. `Refusal` is how any of them rejects a request: the server answers it with
`protocol.Refused`. Imports only the stdlib, `broker.protocol` and `broker.sessions`.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from broker import protocol
from broker.protocol import session_tag
from broker.sessions.turn_record import TurnRecord
from broker.sessions.turn_store import TurnStore

# An API key the agents will send in a header: visible ASCII, bounded.
_SESSION_ID_RE = re.compile(r"[!-~]{1,256}")
# A key a trainer chooses is at least as long as 128 random bits spelled in url-safe base64
# (`secrets.token_urlsafe(16)`): one agent must not be able to guess another's session.
MIN_CHOSEN_KEY_CHARS = 22
_MAX_TURN_ID_LEN = 256
_MINTED_KEY_BYTES = 24  # 192 bits of entropy, 32 url-safe characters
_MINTED_KEY_PREFIX = "rg-"
State = Literal["open", "closing"]
# Who finished a session: named in the refusal the later finishers get.
FinishOrigin = Literal["trainer", "agent", "dropped"]


@dataclass(slots=True, eq=False)
class AgingEntry:
    """Some commits of one session: its log ends after the last of them, compressible from `due` on.

    `serial` names which opening of `sid` it belongs to (ids may be reused). Later commits within
    the entry's bucket move its `ends` forward instead of queueing an entry of their own.
    """

    due: float
    sid: str
    serial: int
    ends: tuple[int, int, int]  # `TurnStore.log_ends`


class Refusal(Exception):
    """A request the lifecycle rules reject; `code` is a `protocol.ErrorCode`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(slots=True, eq=False)
class Session:
    """One session's settings, lifecycle state and deduplicated turn store."""

    sid: str
    sampling_defaults: dict[str, Any]
    max_context_tokens: int | None
    max_turns: int | None
    metadata: dict[str, Any]
    client_id: str = ""  # the opening TrainerClient: the episode stream's only_mine filter
    group: str | None = None  # the episode stream's group filter
    history_mode: str = "tree"  # how its prompts are built (`history`)
    linear_fallback: str = "fork"  # what a linear session's request that extends no head gets
    heads: list[list[Any]] = field(default_factory=list)  # a linear session's (`history.note_head`)
    head_seqs: list[int] = field(default_factory=list)  # their seqs
    state: State = "open"
    finished_by: FinishOrigin | None = None  # set when a finish closes it
    next_seq: int = 0
    in_flight: dict[str, int] = field(default_factory=dict)  # turn_id -> seq
    owners: dict[str, str] = field(default_factory=dict)  # in-flight turn_id -> the worker that opened it, if named
    # turn_id -> seq of in-flight turns whose worker fell silent: no finish waits for them, yet a late commit lands
    abandoned: dict[str, int] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)
    digests: dict[str, str] = field(default_factory=dict)  # request digest -> its latest turn (`OpenTurn`)
    committed: TurnStore = field(default_factory=TurnStore)
    # Compaction's per-session state (`compaction.CompactionScheduler`):
    serial: int = 0  # which opening of `sid` (ids may be reused): aging entries name it
    aged_to: tuple[int, int, int] = (0, 0, 0)  # `TurnStore.log_ends` of its last commit that is compact_age_s old
    aging: AgingEntry | None = None  # its newest aging entry, while commits may still join it
    idle: bool = False  # no commit for compact_age_s when its last aging entry came of age: its tail compresses too


def check_session_key(session_id: str) -> None:
    """Refuse a session id that cannot be an API key in a header."""
    if not _SESSION_ID_RE.fullmatch(session_id):
        raise Refusal("bad_request", "session_id must be 1-256 visible ASCII characters (it is an API key)")


def check_settings(max_context_tokens: int | None, max_turns: int | None, history_mode: str,
                   linear_fallback: str) -> None:
    """Refuse a session's caps unless positive (or None), and a history mode or fallback that does not exist."""
    for name, value in (("max_context_tokens", max_context_tokens), ("max_turns", max_turns)):
        if value is not None and value <= 0:
            raise Refusal("bad_request", f"{name} must be a positive integer or None, got {value!r}")
    problem = protocol.check_history(history_mode, linear_fallback)
    if problem is not None:
        raise Refusal("bad_request", problem)


def minted_key() -> str:
    """A fresh unguessable session id, for a trainer that chose none."""
    return _MINTED_KEY_PREFIX + secrets.token_urlsafe(_MINTED_KEY_BYTES)


def check_turn_id(turn_id: str) -> None:
    if not turn_id or len(turn_id) > _MAX_TURN_ID_LEN:
        raise Refusal("bad_request", f"turn_id must be 1-{_MAX_TURN_ID_LEN} characters")


def check_delta_shape(msg: protocol.CommitTurn) -> None:
    """A delta commit's own numbers must add up (see `protocol.CommitTurn`); its base is checked by the store."""
    if msg.base_turn_id == msg.turn_id:
        raise Refusal("bad_request", "a turn cannot be its own base")
    if min(msg.base_tokens, msg.base_messages, msg.prompt_len) < 0:
        raise Refusal("bad_request", "base_tokens, base_messages and prompt_len must not be negative")
    tail = max(msg.prompt_len - msg.base_tokens, 0)
    if len(msg.prompt_ids) != tail:
        raise Refusal(
            "bad_request",
            f"a delta with prompt_len {msg.prompt_len} and base_tokens {msg.base_tokens} sends {tail} prompt ids, "
            f"not {len(msg.prompt_ids)}",
        )
    if msg.base_tokens > msg.prompt_len + len(msg.output_ids):
        raise Refusal("bad_request", f"base_tokens {msg.base_tokens} exceeds the turn's own context")
    raise AssertionError("the delta's shape failed the fast check but passes every named one")


@dataclass(frozen=True, slots=True)
class FinishedSession:
    """What finish hands the trajectory builder: turns in OPEN order plus the session's settings."""

    sid: str
    turns: list[TurnRecord]
    max_context_tokens: int | None
    metadata: dict[str, Any]
    turns_abandoned: int  # in flight at the finish, or given up with their silent workers
    client_id: str = ""
    group: str | None = None
    finished_by: FinishOrigin = "trainer"
    turns_worker_lost: int = 0  # of turns_abandoned, those given up with their workers (`abandon_turn`)

    @property
    def status(self) -> str:
        """complete; drain_timeout when the finish cut off turns in flight; worker_lost when the only turns
        missing were given up with dead workers (their agents most likely never got those replies)."""
        if self.turns_abandoned > self.turns_worker_lost:
            return "drain_timeout"
        return "worker_lost" if self.turns_worker_lost else "complete"


def check_chosen_key(session_id: str | None) -> None:
    """Refuse a key chosen by a trainer (`OpenSession.session_id`) that is too short to be unguessable."""
    if session_id is not None and len(session_id) < MIN_CHOSEN_KEY_CHARS:
        raise Refusal("bad_request", f"a chosen session_id must be at least {MIN_CHOSEN_KEY_CHARS} characters: it is "
                      "the agents' API key, so make it unguessable (secrets.token_urlsafe(16) or longer), or leave "
                      "it out and the broker mints one")




def abandoned_seq(session: Session, turn_id: str) -> int:
    """The seq of an abandoned turn whose commit arrived after all (its worker was only slow); a Refusal for
    a turn that was aborted or never opened."""
    seq = session.abandoned.get(turn_id)
    if seq is None:
        what = "was aborted" if turn_id in session.aborted else "was never opened"
        raise Refusal("bad_request", f"turn {turn_id!r} of session {session_tag(session.sid)} {what}")
    return seq


def committed_store(session: Session, turn_id: str) -> TurnStore:
    """The store of `session`, open, if it holds `turn_id`; else the Refusal that says why not."""
    if session.state != "open":
        raise Refusal("session_closed", f"session {session_tag(session.sid)} is finishing; no new turns")
    if turn_id not in session.committed:
        if turn_id in session.in_flight:
            # Its reply reached the agent just before its COMMIT reached us: the worker retries.
            raise Refusal("turn_pending", f"turn {turn_id!r} is not committed yet")
        raise Refusal("unknown_turn", f"session {session_tag(session.sid)} has no committed turn {turn_id!r}")
    return session.committed
