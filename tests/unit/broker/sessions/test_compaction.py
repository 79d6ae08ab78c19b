"""Idle-time compaction policy: which log bytes are compressed, when, and how much per step.

`SessionRegistry` compresses a session's log bytes only once they have been held
`compact_age_s` (an injected clock, advanced by hand here: no sleeps), only in sessions past
`compact_min_bytes`, a chunk at a time and a slice per `compact_step`. Bytes of a session
that finishes sooner are never compressed; a chunk left half-done never changes what reads see.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker import protocol
from broker.config import BrokerConfig
from broker.sessions import compaction
from broker.sessions.logs.cold_log import MIN_CHUNK
from broker.sessions.registry import SessionRegistry
from gateway_workers.capture.commit_bases import CommitBases

AGE = 10.0
BUCKET = AGE / compaction.AGE_BUCKETS


class Clock:
    """A monotonic clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Episode:
    """One session's growing turns (full commits: the store finds the shared prefix itself)."""

    def __init__(self, reg: SessionRegistry, sid: str, seed: int = 0) -> None:
        self.reg, self.sid, self.rng = reg, sid, random.Random(seed)
        self.prompt: list[int] = []
        self.messages: list[dict] = [{"role": "system", "content": "s"}]
        self.k = 0
        reg.open_session(sid, {}, None, None, {})

    def turn(self, new_tokens: int) -> None:
        """Commit a turn adding `new_tokens` prompt ids (4 bytes each) and a message of twice as many bytes."""
        rng = self.rng
        self.prompt += [rng.randrange(100_000) for _ in range(new_tokens)]
        self.messages.append({"role": "user", "content": "".join(rng.choices("abcdefgh ", k=2 * new_tokens))})
        output = [rng.randrange(100_000) for _ in range(8)]
        response = {"role": "assistant", "content": f"r{self.k}"}
        tid = f"t{self.k}"
        self.reg.open_turn(self.sid, tid)
        msg = protocol.CommitTurn(
            0, self.sid, tid, protocol.ids_array(self.prompt), protocol.ids_array(output),
            protocol.logprobs_array([-0.5] * 8), "stop", list(self.messages), response,
        )  # fmt: skip
        assert self.reg.commit_turn(msg) == "stored"
        self.prompt += output
        self.messages.append(response)
        self.k += 1

    @property
    def store(self):
        return self.reg.get(self.sid).committed


def drain(reg: SessionRegistry, **kw: int) -> int:
    steps = 0
    while reg.compact_step(**kw):
        steps += 1
        assert steps < 100_000
    return steps


def cold_bytes(store) -> tuple[int, int]:
    """(token log bytes, messages) that are compressed."""
    return store.ids.cold.size, len(store.msgs.cold_ends)


def test_bytes_are_compressed_only_once_they_have_been_held_for_the_age():
    clock = Clock()
    reg = SessionRegistry(max_sessions=2, compact_age_s=AGE, clock=clock)
    ep = Episode(reg, "s")
    ends = []
    for _ in range(4):  # t = 0, 1, 2, 3 s: the first three share an aging bucket (2.5 s wide)
        ep.turn(6000)  # 24 KB of ids and 12 KB of text a turn
        ends.append(ep.store.log_ends)
        clock.now += 1.0
    clock.now = 1000.0 + AGE + BUCKET - 0.01  # the bucket's last commit (t = 2) is not yet AGE old
    assert not reg.compaction_pending and not reg.compact_step()
    assert reg.counters["bytes_compacted"] == 0 and cold_bytes(ep.store) == (0, 0)

    clock.now += 0.01
    assert reg.compaction_pending and drain(reg) > 0
    tok, msgs = cold_bytes(ep.store)
    # turns 0-2 are old enough, but the last two commits' appends (turns 2 and 3) stay hot: the next
    # delta reads its base's newest ids. So turns 0 and 1 went cold, up to less than a chunk of each log.
    assert ends[1][0] - MIN_CHUNK < tok <= ends[1][0] and 0 < msgs <= ends[1][1]
    assert reg.counters["bytes_compacted"] >= tok

    clock.now = 1000.0 + 20.0  # a later turn: turn 2 is no longer among the last two commits
    ep.turn(6000)
    drain(reg)
    tok, msgs = cold_bytes(ep.store)
    assert ends[1][0] < tok <= ends[2][0] and msgs <= ends[2][1]  # turn 3's bytes wait for the next commit
    # Once the session has had no commit for AGE, its tail (kept for the next delta) compresses too.
    clock.now += AGE + BUCKET
    drain(reg)
    assert cold_bytes(ep.store) == ep.store.log_ends[:2] and not reg.compaction_pending
    assert not ep.store.ids.hot and not ep.store.msgs.hot and not ep.store.lps.hot
    ep.turn(100)  # a commit after the pause: a full one compares against cold bytes and still shares the prefix
    assert ep.store.tokens_held == len(ep.prompt)
    assert reg.finish("s").turns[-1].prompt_ids.tolist() == ep.prompt[: len(ep.prompt) - 8]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 6.0), st.integers(0, 3000), st.booleans()), min_size=1, max_size=14))
def test_no_byte_younger_than_the_age_is_ever_compressed(plan):
    """Commits at random times, compaction run at random moments: cold bytes were all committed AGE ago."""
    clock = Clock()
    reg = SessionRegistry(max_sessions=1, compact_age_s=AGE, clock=clock)
    ep = Episode(reg, "s")
    history: list[tuple[float, tuple[int, int]]] = [(float("-inf"), (0, 0))]
    for dt, new_tokens, compact_now in plan:
        clock.now += dt
        ep.turn(new_tokens)
        history.append((clock.now, ep.store.log_ends))
        if compact_now:
            drain(reg, slice_bytes=4096)
        old_enough = max(e for t, e in history if t <= clock.now - AGE)
        tok, msgs = cold_bytes(ep.store)
        assert tok <= old_enough[0] and msgs <= old_enough[1]
    clock.now += AGE + BUCKET
    drain(reg)
    # once everything is old: all but the last two commits' appends compressed, up to a chunk of each log
    if len(history) >= 3:
        assert cold_bytes(ep.store)[0] > history[-3][1][0] - MIN_CHUNK


def test_a_session_finished_before_its_bytes_age_is_never_compressed_and_leaves_nothing_queued():
    clock = Clock()
    reg = SessionRegistry(max_sessions=2, compact_age_s=AGE, clock=clock)
    ep = Episode(reg, "s")
    for _ in range(8):
        ep.turn(6000)
        clock.now += 0.5
    turns = reg.finish("s").turns
    assert len(turns) == 8
    clock.now += AGE + BUCKET
    assert not reg.compaction_pending and not reg.compact_step()
    assert reg.counters["bytes_compacted"] == 0
    assert not reg.compaction.aging and not reg.compaction.ready  # its aging entries were let go


def test_a_busy_session_keeps_a_few_aging_entries_not_one_per_commit():
    clock = Clock()
    reg = SessionRegistry(max_sessions=1, compact_age_s=AGE, clock=clock)
    ep = Episode(reg, "s")
    for _ in range(200):  # a turn every 50 ms for 10 s
        ep.turn(50)
        clock.now += 0.05
        assert not reg.compaction_pending or clock.now >= 1000.0 + AGE + BUCKET
    assert len(reg.compaction.aging) <= compaction.AGE_BUCKETS + 1


def test_a_reopened_session_id_is_not_compacted_on_its_predecessors_schedule():
    clock = Clock()
    reg = SessionRegistry(max_sessions=2, compact_age_s=AGE, clock=clock)
    first = Episode(reg, "s")
    for _ in range(4):
        first.turn(6000)
    reg.drop("s")
    clock.now += 2 * BUCKET  # past the old bucket: the new session's commits get their own, later due
    again = Episode(reg, "s", seed=1)
    for _ in range(4):
        again.turn(6000)
    clock.now = 1000.0 + AGE + BUCKET  # the dropped session's entries are due, the new one's are not
    assert not reg.compact_step() and reg.counters["bytes_compacted"] == 0
    clock.now += 2 * BUCKET
    assert drain(reg) > 0 and reg.counters["bytes_compacted"] > 0


def test_a_step_compresses_one_slice_and_a_chunk_lands_only_at_its_own_last_step():
    reg = SessionRegistry(max_sessions=1)  # age 0: everything is due at once
    ep = Episode(reg, "s")
    for _ in range(3):
        ep.turn(8192)  # 32 KB of ids a turn
    chunk, slc = 16 * 1024, 2 * 1024
    for step in range(chunk // slc):  # one slice a step...
        assert reg.compact_step(slice_bytes=slc, chunk_bytes=chunk)
        assert cold_bytes(ep.store) == (0, 0), step  # bytes being compressed are still read hot
        if step == 3:
            ep.turn(100)  # a commit while a chunk is half done
            assert reg.turn_messages("s", "t0")[1] == {"role": "assistant", "content": "r0"}
    assert reg.compact_step(slice_bytes=slc, chunk_bytes=chunk)  # ...then a step of its own ends the chunk
    assert cold_bytes(ep.store)[0] == chunk and reg.counters["bytes_compacted"] == chunk
    drain(reg, slice_bytes=slc, chunk_bytes=chunk)
    records = reg.finish("s").turns
    assert [len(r.prompt_ids) for r in records] == [8192, 2 * 8192 + 8, 3 * 8192 + 16, 3 * 8192 + 24 + 100]
    assert records[3].prompt_ids.tolist() == ep.prompt[: 3 * 8192 + 24 + 100]


def test_a_session_finished_mid_chunk_drops_the_chunk():
    reg = SessionRegistry(max_sessions=1)
    ep = Episode(reg, "s")
    for _ in range(3):
        ep.turn(8192)
    assert reg.compact_step(slice_bytes=1024)  # a chunk begun
    records = reg.finish("s").turns
    assert records[2].prompt_ids.tolist() == ep.prompt[: 3 * 8192 + 16]
    assert reg.compact_step()  # the pending chunk is let go...
    assert not reg.compact_step() and not reg.compaction_pending  # ...and nothing else is due
    assert reg.counters["bytes_compacted"] == 0


def test_small_sessions_and_a_broker_without_compaction_queue_nothing():
    reg = SessionRegistry(max_sessions=2, compact_min_bytes=100_000)
    small = Episode(reg, "small")
    for _ in range(4):
        small.turn(4000)  # 16 KB of ids + 8 KB of text a turn: 96 KB, under the floor
    assert small.store.start_compaction(compaction.COMPACT_CHUNK_BYTES) is not None
    assert not reg.compaction_pending and not reg.compaction.aging
    off = SessionRegistry(max_sessions=1, compact=False)
    big = Episode(off, "s")
    for _ in range(4):
        big.turn(8192)
    assert not off.compaction.aging and not off.compaction_pending and not off.compact_step()


def test_the_policy_settings_come_from_the_environment_and_are_checked():
    default = BrokerConfig()
    assert default.compact_idle and default.compact_age_s == 5.0 and default.compact_min_bytes == 64 * 1024
    env = {"ROLLOUT_BROKER_COMPACT_AGE_S": "2.5", "ROLLOUT_BROKER_COMPACT_MIN_BYTES": "1000"}
    config = BrokerConfig.from_env(env)
    assert config.compact_age_s == 2.5 and config.compact_min_bytes == 1000
    with pytest.raises(ValueError, match="compact_age_s"):
        BrokerConfig.from_env({"ROLLOUT_BROKER_COMPACT_AGE_S": "-1"})
    with pytest.raises(ValueError, match="ROLLOUT_BROKER_COMPACT_AGE_S"):
        BrokerConfig.from_env({"ROLLOUT_BROKER_COMPACT_AGE_S": "soon"})


def test_a_delta_after_an_idle_spell_checks_its_prefix_against_the_compressed_tail():
    clock = Clock()
    reg = SessionRegistry(max_sessions=1, compact_age_s=AGE, clock=clock)
    reg.open_session("s", {}, None, None, {})
    bases = CommitBases()
    rng = random.Random(2)
    prompt, messages, sent = [rng.randrange(100_000) for _ in range(3000)], [{"role": "user", "content": "q"}], []
    for k in range(6):
        if k == 4:  # a pause: the session idles past the age, and all it holds is compressed
            clock.now += AGE + BUCKET
            drain(reg)
            store = reg.get("s").committed
            assert not store.ids.hot and not store.msgs.hot and not store.lps.hot
            assert reg.counters["bytes_compacted"] > 0
        reg.open_turn("s", f"t{k}")
        output = [rng.randrange(100_000) for _ in range(50)]
        full = protocol.CommitTurn(
            0, "s", f"t{k}", protocol.ids_array(prompt), protocol.ids_array(output),
            protocol.logprobs_array([-k / 4] * 50), "stop", list(messages), {"role": "assistant", "content": f"a{k}"},
        )  # fmt: skip
        delta = bases.delta(full)
        assert delta is not None or k == 0
        assert reg.commit_turn(protocol.decode_worker_to_broker(protocol.encode(delta or full))) == "stored"
        bases.remember(full)
        sent.append(full)
        clock.now += 0.5
        prompt = prompt + output + [rng.randrange(100_000) for _ in range(500)]
        messages = [*messages, full.response_message, {"role": "user", "content": f"q{k}"}]
    assert reg.counters["commits_delta"] == 5  # the deltas after the pause were accepted: their prefix CRC matched
    for record, full in zip(reg.finish("s").turns, sent, strict=True):
        assert record.prompt_ids == full.prompt_ids and record.output_ids == full.output_ids
        assert record.logprobs == full.logprobs and record.prompt_messages == full.prompt_messages
