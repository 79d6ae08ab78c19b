"""Test-side peers of the broker: a blocking worker that speaks the protocol, and synthetic episodes.

`Peer` is a plain zmq DEALER whose every receive polls with a deadline; `WorkerPeer`
adds the worker's requests (OPEN / COMMIT / ABORT). `conversation()` builds a growing
multi-turn episode (each prompt = previous prompt + previous output + a new tail, and
the canonical messages grow the same way), the shape the trajectory builder extends
CLEAN. Used by the component and process tests; imports zmq and `broker.protocol` only.
"""

from __future__ import annotations

import random
from array import array
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import zmq

from broker import protocol

RECV_TIMEOUT_S = 10.0


class PeerTimeout(AssertionError):
    """The broker did not answer within the deadline."""


class Peer:
    """A DEALER connected to one broker endpoint; requests are answered in order with the same id."""

    def __init__(self, ctx: zmq.Context, endpoint: str, decode: Any) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self._decode = decode
        self._next_id = 1

    def next_id(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    def send_raw(self, frame: bytes) -> None:
        self.sock.send(frame)

    def recv(self, timeout: float = RECV_TIMEOUT_S) -> protocol.Message:
        if not self.sock.poll(int(timeout * 1000), zmq.POLLIN):
            raise PeerTimeout(f"no reply within {timeout}s")
        return self._decode(self.sock.recv())  # type: ignore[no-any-return]

    def request(self, msg: protocol.Message, timeout: float = RECV_TIMEOUT_S) -> protocol.Message:
        self.sock.send(protocol.encode(msg))
        reply = self.recv(timeout)
        assert reply.request_id == msg.request_id, (reply, msg)
        return reply

    def close(self) -> None:
        self.sock.close(linger=0)


class WorkerPeer(Peer):
    """The worker's side of the backplane, blocking."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        super().__init__(ctx, endpoint, protocol.decode_broker_to_worker)

    def open_turn(self, sid: str, turn_id: str, worker_id: str = "") -> protocol.Message:
        if worker_id:  # as a real worker's backplane, which heartbeats before its first OPEN
            self.heartbeat(worker_id)
        return self.request(protocol.OpenTurn(self.next_id(), sid, turn_id, worker_id))

    def heartbeat(self, worker_id: str) -> None:
        self.send_raw(protocol.encode(protocol.Heartbeat(0, worker_id)))  # never answered

    def commit(self, sid: str, turn_id: str, turn: SyntheticTurn) -> protocol.Message:
        return self.request(self.commit_msg(sid, turn_id, turn))

    def commit_msg(self, sid: str, turn_id: str, turn: SyntheticTurn) -> protocol.CommitTurn:
        return protocol.CommitTurn(
            self.next_id(),
            sid,
            turn_id,
            turn.prompt_ids,
            turn.output_ids,
            turn.logprobs,
            "stop",
            turn.prompt_messages,
            turn.response_message,
        )

    def abort(self, sid: str, turn_id: str, reason: str = "client_disconnect") -> protocol.Message:
        return self.request(protocol.AbortTurn(self.next_id(), sid, turn_id, reason))


class TrainerPeer(Peer):
    """The trainer's side, raw (the real client is `trainer_client.TrainerClient`)."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        super().__init__(ctx, endpoint, protocol.decode_broker_to_trainer)


@dataclass(frozen=True)
class SyntheticTurn:
    prompt_ids: array
    output_ids: array
    logprobs: array
    prompt_messages: list[dict[str, Any]]
    response_message: dict[str, Any]


def conversation(
    seed: int, n_turns: int, *, first_prompt: int = 40, tail: int = 12, output: int = 8, words_per_token: float = 1.0
) -> list[SyntheticTurn]:
    """A growing episode: prompt[k+1] = prompt[k] + output[k] + a fresh tail; messages grow alike.

    Logprobs are multiples of 1/64 so they survive float32 exactly.
    """
    rng = random.Random(seed)

    def ids(n: int) -> array:
        return protocol.ids_array(rng.randrange(1000, 150_000) for _ in range(n))

    def text(n: int) -> str:
        return " ".join(f"w{rng.randrange(10_000)}" for _ in range(max(1, int(n * words_per_token))))

    turns: list[SyntheticTurn] = []
    prompt = ids(first_prompt)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a test agent."},
        {"role": "user", "content": text(first_prompt)},
    ]
    for k in range(n_turns):
        out = ids(output)
        lps = protocol.logprobs_array(-rng.randrange(1, 640) / 64 for _ in range(output))
        response = {"role": "assistant", "content": f"turn {k}: {text(output)}"}
        turns.append(SyntheticTurn(prompt, out, lps, list(messages), response))
        prompt = prompt + out + ids(tail)
        messages = [*messages, response, {"role": "user", "content": text(tail)}]
    return turns


def assert_trained_once(records: list[Any], turns: list[SyntheticTurn]) -> None:
    """The fidelity rule, checked on `TraceRecord`s: every sampled token of every turn is trained
    exactly once, with its logprob, right after exactly the prompt the engine saw for it.

    Runs the suite's shared checker (tests/fidelity.py) and a direct count of our own.
    """
    from fidelity import assert_fidelity  # tests/ is on sys.path (tests/conftest.py)

    assert_fidelity(
        [
            SimpleNamespace(turn_id=f"t{k}", prompt_ids=t.prompt_ids, output_ids=t.output_ids, logprobs=t.logprobs)
            for k, t in enumerate(turns)
        ],
        records,
    )
    assert sum(sum(r.loss_mask) for r in records) == sum(len(t.output_ids) for t in turns)
    for t in turns:
        prompt, out, lps = t.prompt_ids.tolist(), t.output_ids.tolist(), t.logprobs.tolist()
        hits = 0
        for r in records:
            off = len(prompt) - (len(r.token_ids) - r.response_length)  # output's offset in the response region
            if (
                off < 0
                or r.token_ids[: len(prompt)] != prompt
                or r.token_ids[len(prompt) : len(prompt) + len(out)] != out
            ):
                continue
            if all(r.loss_mask[off : off + len(out)]) and r.logprobs[off : off + len(out)] == lps:
                hits += 1
        assert hits == 1, f"output of a turn trained {hits} times"


def assert_linear_rows(records: list[Any], turns: list[SyntheticTurn]) -> None:
    """A cleanly growing episode is one row: the last prompt + last output, trained on every output."""
    assert len(records) == 1, [len(r.token_ids) for r in records]
    (row,) = records
    assert row.token_ids == (turns[-1].prompt_ids + turns[-1].output_ids).tolist()
    assert row.prompt_ids == turns[0].prompt_ids.tolist()  # the first prompt is stripped
    assert_trained_once(records, turns)
