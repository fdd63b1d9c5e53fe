"""Once a command that creates something has answered, the thing exists for every later
command on every protocol, as with nsqd: each pair with no sleep between them."""

from __future__ import annotations

import http.client
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from actors.broker import Broker
from tests.broker.conftest import broker_options
from tests.broker.test_nsq_tcp_broker import Conn
from transport.nsq.client_codec import Response
from transport.protocol import commands as pc
from transport.zmq.codec import Messages, Ok, encode_request, parse_reply
from transport.zmq.frames import recv_frames

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def broker(tmp_path_factory) -> Iterator[Broker]:
    b = Broker(broker_options(tmp_path_factory.mktemp("ryw") / "data", workers=2)).start()
    yield b
    b.stop()


class Zmq:
    def __init__(self, broker: Broker) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 10_000)
        self.sock.connect(broker.zmq_endpoint)

    def send(self, command: pc.Command, corr: bytes | None = None) -> None:
        self.sock.send_multipart(encode_request(command, corr))

    def next(self) -> Any:
        return parse_reply(recv_frames(self.sock))

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _http(broker: Broker, method: str, path: str, body: bytes = b"") -> int:
    conn = http.client.HTTPConnection("127.0.0.1", broker.http_port, timeout=10)
    try:
        conn.request(method, path, body=body)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


@pytest.mark.parametrize("n", range(5))
def test_a_message_published_after_sub_ok_reaches_the_new_channel_over_nsq_tcp(broker, n):
    topic = f"ryw_tcp_{n}"
    sub, pub = Conn(broker), Conn(broker)
    try:
        sub.send(pc.Sub(topic, "fresh"))
        assert sub.frames(1)[0] == Response(b"OK")
        # no sleep: the channel exists now
        pub.send(pc.Pub(topic, b"right after"))
        assert pub.frames(1)[0] == Response(b"OK")
        sub.send(pc.Rdy(1))
        message = sub.frames(1)[0]
        assert isinstance(message, pc.Message)
        assert message.body == b"right after"
    finally:
        sub.close()
        pub.close()


@pytest.mark.parametrize("n", range(5))
def test_a_message_published_after_sub_ok_reaches_the_new_channel_over_zeromq(broker, n):
    topic = f"ryw_zmq_{n}"
    sub, pub = Zmq(broker), Zmq(broker)
    try:
        sub.send(pc.Sub(topic, "fresh"), b"#sub")
        assert sub.next() == Ok(b"#sub")
        pub.send(pc.Pub(topic, b"right after"), b"#pub")
        assert pub.next() == Ok(b"#pub")
        sub.send(pc.Rdy(1))
        reply = sub.next()
        assert isinstance(reply, Messages)
        assert [m.body for m in reply.messages] == [b"right after"]
    finally:
        sub.close()
        pub.close()


def test_pause_right_after_sub_finds_the_topic_and_the_channel(broker):
    sub = Conn(broker)
    try:
        sub.send(pc.Sub("ryw_pause", "c"))
        assert sub.frames(1)[0] == Response(b"OK")
        assert _http(broker, "POST", "/topic/pause?topic=ryw_pause") == 200
        assert _http(broker, "POST", "/channel/pause?topic=ryw_pause&channel=c") == 200
    finally:
        sub.close()


def test_what_http_creates_exists_for_the_next_command(broker):
    assert _http(broker, "POST", "/topic/create?topic=ryw_http") == 200
    assert _http(broker, "POST", "/channel/create?topic=ryw_http&channel=c") == 200
    assert _http(broker, "POST", "/channel/pause?topic=ryw_http&channel=c") == 200
    assert _http(broker, "POST", "/pub?topic=ryw_http", b"m") == 200
    stats = broker.topic_stats("ryw_http")
    assert [(c["channel_name"], c["depth"], c["paused"]) for c in stats["channels"]] == [
        ("c", 1, True)]
    # a PUB creates its topic: pausing it right after finds it
    assert _http(broker, "POST", "/pub?topic=ryw_pub", b"m") == 200
    assert _http(broker, "POST", "/topic/pause?topic=ryw_pub") == 200
