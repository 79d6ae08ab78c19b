"""Fixtures for broker component tests: a real BrokerServer on port-0 sockets in a thread, and peers.

Every socket is tracked and closed with linger 0; the test context is terminated in a
thread with a deadline (a stuck socket fails the test instead of hanging it), and the
broker thread must stop within its bound when asked.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq
from component.peers import TrainerPeer, WorkerPeer

from broker.config import BrokerConfig
from broker.server import BrokerServer
from trainer_client import TrainerClient

STOP_TIMEOUT_S = 15.0  # a bound on hanging, with room for a loaded box


class RunningBroker:
    """A BrokerServer serving in a background thread; endpoints as actually bound."""

    def __init__(self, config: BrokerConfig) -> None:
        self.server = BrokerServer(config)
        self.worker_endpoint, self.control_endpoint = self.server.bind()
        self.thread = threading.Thread(target=self.server.run, name="broker", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.request_exit()
        self.thread.join(STOP_TIMEOUT_S)
        assert not self.thread.is_alive(), "broker loop did not stop within its bound"


@pytest.fixture
def make_broker() -> Iterator[Callable[..., RunningBroker]]:
    started: list[RunningBroker] = []

    def make(**overrides: Any) -> RunningBroker:
        config = BrokerConfig(
            worker_endpoint="tcp://127.0.0.1:0",
            control_endpoint="tcp://127.0.0.1:0",
            shutdown_linger_ms=0,
            **overrides,
        )
        b = RunningBroker(config)
        started.append(b)
        return b

    yield make
    for b in started:  # all asked first: one that hangs leaves none of the others running
        b.server.request_exit()
    for b in started:
        b.stop()


@pytest.fixture
def broker(make_broker: Callable[..., RunningBroker]) -> RunningBroker:
    return make_broker()


@pytest.fixture
def zctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    # closes any socket a test left open, then terms the context, which hangs on a socket still in use: bounded
    t = threading.Thread(target=ctx.destroy, kwargs={"linger": 0}, daemon=True)
    t.start()
    t.join(STOP_TIMEOUT_S)
    assert not t.is_alive(), "zmq context did not terminate"


@pytest.fixture
def worker(broker: RunningBroker, zctx: zmq.Context) -> Iterator[WorkerPeer]:
    peer = WorkerPeer(zctx, broker.worker_endpoint)
    yield peer
    peer.close()


@pytest.fixture
def raw_trainer(broker: RunningBroker, zctx: zmq.Context) -> Iterator[TrainerPeer]:
    peer = TrainerPeer(zctx, broker.control_endpoint)
    yield peer
    peer.close()


@pytest.fixture
def client(broker: RunningBroker) -> Iterator[TrainerClient]:
    c = TrainerClient(broker.control_endpoint, timeout=10.0)
    yield c
    c.close()


@pytest.fixture
def router() -> Iterator[tuple[zmq.Socket, str]]:
    """A bare ROUTER on a port-0 endpoint standing in for the broker, and that endpoint: a test answers (or
    ignores) what a worker's backplane sends it."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, f"tcp://127.0.0.1:{port}"
    sock.close(linger=0)
    ctx.term()
