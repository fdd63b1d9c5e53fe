"""Every publish is answered at once and stored once, whatever the mode and the topic (#22).

The matrix that would have caught the first durable publish to a new topic
waiting 10 s for its answer (a group commit left for a later write that never
came): ``--mem-queue-size`` 0 and default x ``--sync-every`` 1 and default x
a topic with 0, 1 and 2 channels, new or already in use x PUB, MPUB and DPUB
over NSQ TCP, ``/pub``, ``/mpub`` and ``/pub?defer=`` over HTTP, and the
ZeroMQ publish.  Each publish must be answered within the clients' timeout
(5 s: the defect took 10 s) and found exactly once in the topic's count and
in every channel (or, without a channel, in the topic itself).
"""

from __future__ import annotations

import json
import socket
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from actors.broker import Broker
from tests.broker.conftest import broker_options
from transport.client import Producer
from transport.nsq.client_codec import ClientConnection, Response
from transport.nsq.codec import NEED_DATA
from transport.protocol import commands as pc

pytestmark = pytest.mark.timeout(180)

ANSWER_WITHIN = 5.0

MODES = {
    "memory": {},
    "mem0": {"mem_queue_size": 0},
    "sync1": {"sync_every": 1},
    "mem0-sync1": {"mem_queue_size": 0, "sync_every": 1},
}


@pytest.fixture(scope="module", params=list(MODES))
def broker(request, tmp_path_factory) -> Iterator[Broker]:
    data = tmp_path_factory.mktemp(request.param) / "data"
    b = Broker(broker_options(data, workers=2, **MODES[request.param])).start()
    yield b
    b.stop()


def _http(b: Broker, path: str, body: bytes | None = b"") -> bytes:
    """POST `body` to `path`; GET without a body."""
    req = urllib.request.Request(f"http://127.0.0.1:{b.http_port}{path}", data=body,
                                 method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=ANSWER_WITHIN) as r:  # noqa: S310 - loopback
        return r.read()


def _nsq(b: Broker, command: pc.Command) -> None:
    host, port = b.tcp_address.rsplit(":", 1)
    codec = ClientConnection()
    with socket.create_connection((host, int(port)), timeout=ANSWER_WITHIN) as s:
        s.sendall(codec.send(command))
        while True:
            event = codec.next_event()
            if event is NEED_DATA:
                data = s.recv(65536)  # raises TimeoutError after ANSWER_WITHIN
                assert data, "the broker closed the connection without an answer"
                codec.receive_data(data)
            elif not isinstance(event, pc.Heartbeat):
                assert event == Response(b"OK"), event
                return


def _zmq(b: Broker, do: Callable[[Producer], None]) -> None:
    with Producer(b.zmq_endpoint, timeout=ANSWER_WITHIN, max_attempts=1) as p:
        do(p)


@dataclass(frozen=True)
class Publish:
    name: str
    count: int
    deferred: bool
    send: Callable[[Broker, str], None]


PUBLISHES = [
    Publish("tcp-PUB", 1, False, lambda b, t: _nsq(b, pc.Pub(t, b"m"))),
    Publish("tcp-MPUB", 2, False, lambda b, t: _nsq(b, pc.Mpub(t, (b"m1", b"m2")))),
    Publish("tcp-DPUB", 1, True, lambda b, t: _nsq(b, pc.Dpub(t, 600_000, b"m"))),
    Publish("http-pub", 1, False, lambda b, t: _http(b, f"/pub?topic={t}", b"m")),
    Publish("http-mpub", 2, False, lambda b, t: _http(b, f"/mpub?topic={t}", b"m1\nm2")),
    Publish("http-pub-defer", 1, True,
            lambda b, t: _http(b, f"/pub?topic={t}&defer=600000", b"m")),
    Publish("zmq-pub", 1, False, lambda b, t: _zmq(b, lambda p: p.publish(t, b"m"))),
    Publish("zmq-mpub", 2, False,
            lambda b, t: _zmq(b, lambda p: p.multi_publish(t, [b"m1", b"m2"]))),
    Publish("zmq-dpub", 1, True,
            lambda b, t: _zmq(b, lambda p: p.deferred_publish(t, 600_000, b"m"))),
]


def _topic(b: Broker, topic: str) -> dict:
    stats = json.loads(_http(b, f"/stats?format=json&topic={topic}&include_clients=false",
                             None))
    return next(t for t in stats["topics"] if t["topic_name"] == topic)


def _held(entry: dict, deferred: bool) -> int:
    return entry["deferred_count"] if deferred else entry["depth"]


@pytest.mark.parametrize("channels", [0, 1, 2])
@pytest.mark.parametrize("existing", [False, True], ids=["new", "existing"])
@pytest.mark.parametrize("publish", PUBLISHES, ids=lambda p: p.name)
def test_a_publish_is_answered_at_once_and_stored_exactly_once(broker, publish, existing,
                                                              channels):
    # Given a topic with 0, 1 or 2 channels, new (no topic at all without a channel),
    # or already in use (created, and one earlier publish of the same kind answered)
    topic = f"{publish.name}-{'old' if existing else 'new'}-{channels}"
    if channels:
        _http(broker, f"/topic/create?topic={topic}")
    for c in range(channels):
        _http(broker, f"/channel/create?topic={topic}&channel=c{c}")
    before = 0
    if existing:
        publish.send(broker, topic)
        before = publish.count
    # When it is published to (each client gives up after ANSWER_WITHIN seconds)
    publish.send(broker, topic)
    # Then it was answered, and every message is held exactly once, in each channel
    entry = _topic(broker, topic)
    assert entry["message_count"] == before + publish.count
    holders = entry["channels"] if channels else [entry]
    assert len(holders) == max(channels, 1)
    for holder in holders:
        assert _held(holder, publish.deferred) == before + publish.count, holder
