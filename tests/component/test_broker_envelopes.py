"""The broker's receive and send paths over real sockets: envelopes of every shape, replies encoded by handlers.

The loop reads the parts of a message itself (identity, then parts until the last) and sends
replies part by part; commit, open and abort replies leave as frames the handler encoded
(`protocol.frame_encoder`). A REQ peer on the worker endpoint, a DEALER with extra envelope parts,
and a reply to a peer that is gone (counted as dropped, never raised) pin that behaviour.
"""

from __future__ import annotations

import zmq

from broker import protocol
from broker.config import BrokerConfig
from broker.server import BrokerServer

POLL_MS = 5000


def _commit(rid: int, sid: str, turn_id: str) -> protocol.CommitTurn:
    return protocol.CommitTurn(
        rid,
        sid,
        turn_id,
        protocol.ids_array([1, 2, 3]),
        protocol.ids_array([4]),
        protocol.logprobs_array([-0.5]),
        "stop",
        [{"role": "user", "content": "q"}],
        {"role": "assistant", "content": "a"},
    )


def test_a_req_peer_on_the_worker_endpoint_opens_commits_and_aborts(broker, client, zctx):
    sid = client.open_session()
    req = zctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(broker.worker_endpoint)

    def ask(msg: protocol.Message) -> protocol.Message:
        req.send(protocol.encode(msg))
        assert req.poll(POLL_MS)
        return protocol.decode_broker_to_worker(req.recv())

    assert ask(protocol.OpenTurn(1, sid, "t0")) == protocol.TurnOpened(1, "t0", 0, {}, None)
    assert ask(_commit(2, sid, "t0")) == protocol.TurnCommitted(2, "t0", "stored")
    assert ask(_commit(3, sid, "t0")) == protocol.TurnCommitted(3, "t0", "duplicate")
    assert ask(protocol.OpenTurn(4, sid, "t1")) == protocol.TurnOpened(4, "t1", 1, {}, None)
    assert ask(protocol.AbortTurn(5, sid, "t1", "client_disconnect")) == protocol.TurnAborted(5, "t1")
    refused = ask(protocol.OpenTurn(6, "no-such-session", "t2"))
    assert isinstance(refused, protocol.Refused) and refused.code == "unknown_session"
    req.close()
    records = client.finish_session(sid)
    assert len(records) == 1 and list(records[0].token_ids) == [1, 2, 3, 4]


def test_extra_envelope_parts_come_back_in_front_of_every_kind_of_reply(broker, client, zctx):
    sid = client.open_session(sampling_defaults={"temperature": 0.5}, max_context_tokens=64)
    dealer = zctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(broker.worker_endpoint)
    requests = [
        protocol.OpenTurn(1, sid, "t0"),
        _commit(2, sid, "t0"),
        protocol.GetTurn(3, sid, "t0"),
        protocol.AbortTurn(4, sid, "t-unknown", "client_disconnect"),
    ]
    for msg in requests:
        dealer.send_multipart([b"hop-1", b"", b"hop-2", protocol.encode(msg)])
    replies = []
    for _ in requests:
        assert dealer.poll(POLL_MS)
        *envelope, payload = dealer.recv_multipart()
        assert envelope == [b"hop-1", b"", b"hop-2"]
        replies.append(protocol.decode_broker_to_worker(payload))
    dealer.close()
    assert replies[0] == protocol.TurnOpened(1, "t0", 0, {"temperature": 0.5}, 64)
    assert replies[1] == protocol.TurnCommitted(2, "t0", "stored")
    assert isinstance(replies[2], protocol.TurnFound) and replies[2].response_message["content"] == "a"
    assert replies[3] == protocol.TurnAborted(4, "t-unknown")


def test_a_reply_to_a_peer_that_is_gone_is_counted_as_dropped():
    server = BrokerServer(
        BrokerConfig(worker_endpoint="tcp://127.0.0.1:0", control_endpoint="tcp://127.0.0.1:0", shutdown_linger_ms=0)
    )
    server.bind()
    try:
        sock = server._workers
        assert sock is not None
        # ROUTER_MANDATORY: an identity no peer has raises at once; the loop counts it and goes on
        frame = protocol.frame_encoder(protocol.TurnCommitted)(request_id=1, turn_id="t", outcome="stored")
        server._send(sock, [b"gone"], frame)
        server._send(sock, [b"gone", b""], protocol.TurnAborted(2, "t"))
        assert server.stats()["replies_dropped"] == 2
    finally:
        server.close()
