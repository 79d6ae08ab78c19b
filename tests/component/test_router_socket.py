"""broker.sockets.RouterSocket against real sockets: options set, port 0 reported as bound, bind failures named.

The wrapper is the broker's one socket role (worker and control endpoints alike): it binds a ROUTER
with the configured LINGER, HWM and frame limit, reports the endpoint actually bound, and turns a
bind failure into `BindError` (still a `zmq.ZMQError`, which `broker.__main__` reports) naming it.
"""

from __future__ import annotations

import pytest
import zmq

from broker.config import BrokerConfig
from broker.sockets import NOBLOCK, POLLIN, BindError, RouterSocket, send_part, waiting

POLL_MS = 5000
CONFIG = BrokerConfig(shutdown_linger_ms=0, hwm=123, max_frame_bytes=4096)


def test_options_and_port_zero_are_reported_as_bound(zctx: zmq.Context) -> None:
    with RouterSocket(zctx, "tcp://127.0.0.1:0", CONFIG) as router:
        assert router.endpoint.startswith("tcp://127.0.0.1:") and not router.endpoint.endswith(":0")
        sock = router.sock
        assert sock.getsockopt(zmq.TYPE) == zmq.ROUTER
        assert sock.getsockopt(zmq.LINGER) == 0
        assert (sock.getsockopt(zmq.SNDHWM), sock.getsockopt(zmq.RCVHWM)) == (123, 123)
        assert sock.getsockopt(zmq.MAXMSGSIZE) == 4096
        assert router.fd() == sock.getsockopt(zmq.FD)
    assert sock.closed


def test_the_raw_calls_carry_a_request_and_its_reply(zctx: zmq.Context) -> None:
    with RouterSocket(zctx, "tcp://127.0.0.1:0", CONFIG) as router:
        dealer = zctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(router.endpoint)
        probe = [(router.sock, POLLIN)]
        assert not waiting(probe)
        dealer.send(b"ping")
        assert router.sock.poll(POLL_MS, zmq.POLLIN)
        assert waiting(probe)
        identity, payload = router.sock.recv_multipart(NOBLOCK)
        assert payload == b"ping"
        send_part(router.sock, identity, zmq.SNDMORE)
        send_part(router.sock, b"pong", 0)
        assert dealer.poll(POLL_MS, zmq.POLLIN) and dealer.recv() == b"pong"
        dealer.close()


def test_a_taken_endpoint_is_a_bind_error_that_names_it(zctx: zmq.Context) -> None:
    with RouterSocket(zctx, "tcp://127.0.0.1:0", CONFIG) as first:
        with pytest.raises(BindError, match=f"cannot bind {first.endpoint}") as e:
            RouterSocket(zctx, first.endpoint, CONFIG)
    assert isinstance(e.value, zmq.ZMQError) and e.value.errno == zmq.EADDRINUSE
    with pytest.raises(BindError, match="cannot bind nonsense://x"):
        RouterSocket(zctx, "nonsense://x", CONFIG)
