"""Bad clients against the live listeners: garbage, half frames, idle crowds.

Whatever one client sends, the broker answers it (error frame, or close for
fatal errors), keeps serving everyone else, and loses nothing already
acknowledged.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.broker import Broker
from tests.broker.conftest import broker_options
from tests.broker.test_broker_actors import wait_for
from transport.client import Producer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def broker(tmp_path_factory) -> Iterator[Broker]:
    data = tmp_path_factory.mktemp("abuse") / "data"
    b = Broker(broker_options(data, max_msg_size=1000, max_body_size=10_000,
                              log_level="error")).start()
    yield b
    b.stop()


def tcp(broker: Broker) -> socket.socket:
    host, port = broker.tcp_address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def still_serving(broker: Broker) -> None:
    with Producer(broker.zmq_endpoint, timeout=5) as p:
        p.publish("canary", b"alive")


def read_until_closed(sock: socket.socket, limit: float = 5.0) -> bytes:
    out = b""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            break
        out += chunk
    return out


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(garbage=st.binary(min_size=1, max_size=300))
def test_garbage_on_nsq_tcp_gets_an_answer_or_a_close_never_a_crash(broker, garbage):
    s = tcp(broker)
    try:
        s.sendall(b"  V2" + garbage)
        s.shutdown(socket.SHUT_WR)
        read_until_closed(s, 2.0)
    finally:
        s.close()


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(frames=st.lists(st.binary(max_size=40), min_size=1, max_size=6))
def test_garbage_frames_on_zeromq_never_crash_the_listener(broker, frames):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(broker.zmq_endpoint)
        s.send_multipart(frames)
        s.poll(200)
    finally:
        s.close(linger=0)


def test_the_broker_serves_everyone_after_the_fuzzing(broker):
    still_serving(broker)


def test_a_client_that_sends_half_a_frame_and_vanishes_costs_nobody_anything(broker):
    with Producer(broker.zmq_endpoint) as p:
        p.multi_publish("half", [b"a", b"b"])
    for partial in (b"  V2PUB half\n\x00\x00", b"  V2MPUB half\n\x00\x00\x00\x20\x00\x00",
                    b"  V2IDENTIFY\n\x00\x00\x00\x50{\"cli"):
        s = tcp(broker)
        s.sendall(partial)
        s.close()
    still_serving(broker)
    assert broker.topic_stats("half")["depth"] == 2


def test_an_oversized_body_is_refused_without_reading_it(broker):
    s = tcp(broker)
    try:
        s.sendall(b"  V2PUB big\n" + (10**9).to_bytes(4, "big"))
        answer = read_until_closed(s)
        assert b"E_BAD_MESSAGE" in answer
    finally:
        s.close()
    still_serving(broker)


def test_a_thousand_idle_connections_do_not_stop_the_broker(broker):
    conns = []
    try:
        for _ in range(1000):
            s = tcp(broker)
            s.sendall(b"  V2")
            conns.append(s)
        wait_for(lambda: broker.supervisor.ask("listener:tcp", _info(), 5)["sessions"] >= 1000,
                 what="1000 sessions")
        still_serving(broker)
    finally:
        for s in conns:
            s.close()
    wait_for(lambda: broker.supervisor.ask("listener:tcp", _info(), 5)["sessions"] == 0,
             what="sessions closed")


def _info():
    from actors.broker.gateway import ListenerInfo

    return ListenerInfo()
