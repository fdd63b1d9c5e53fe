"""Handing a subscribed NSQ TCP connection from one loop to another (transport.nsq.handoff):
the socket, the decoder's state and the bytes after the SUB arrive whole; a hand-off that
cannot be sent leaves the connection where it was, working."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import threading

import pytest

from transport.nsq import server as server_mod
from transport.nsq.codec import ServerConnection
from transport.nsq.handoff import BUSY, FAILED, SENT, Receiver, Sender, socket_path
from transport.nsq.server import TcpServer
from transport.protocol import commands as pc
from transport.protocol.identify import IdentifySettings
from transport.protocol.validation import Limits, ProtocolError

pytestmark = pytest.mark.timeout(30)


def test_the_decoder_stops_after_a_sub_and_hands_over_what_follows_it():
    limits = Limits()
    codec = ServerConnection(limits)
    codec.receive_data(b"  V2SUB t c\nRDY 5\nFIN 0123456789abcdef\n")
    events = codec.next_events()
    assert events == [pc.Sub("t", "c")]  # the rest waits
    rest = codec.take_buffered()
    assert rest == b"RDY 5\nFIN 0123456789abcdef\n"
    assert codec.next_events() == []

    settings = IdentifySettings(heartbeat_interval=5000, msg_timeout=30_000, user_agent="x")
    resumed = ServerConnection.resumed(limits, codec.server, settings, rest)
    assert resumed.settings == settings
    assert resumed.next_events() == [pc.Rdy(5), pc.Fin((b"0123456789abcdef",))]
    resumed.receive_data(b"SUB t d\n")  # subscribed already: nsqd's state error, fatal
    (error,) = resumed.next_events()
    assert isinstance(error, ProtocolError)
    assert "cannot SUB in current state" in str(error)


def test_the_decoder_can_stop_after_a_publish_and_resume_unsubscribed():
    limits = Limits()
    codec = ServerConnection(limits)
    body = struct.pack(">i", 2) + b"hi"
    codec.receive_data(b"  V2PUB t\n" + body + b"PUB t\n" + body)
    assert codec.next_events() == [pc.Pub("t", b"hi"), pc.Pub("t", b"hi")]  # by default
    codec = ServerConnection(limits)
    codec.pause_at_publish = True
    codec.receive_data(b"  V2PUB t\n" + body + b"SUB t c\nRDY 1\n")
    assert codec.next_events() == [pc.Pub("t", b"hi")]  # the rest waits
    rest = codec.take_buffered()
    assert rest == b"SUB t c\nRDY 1\n"

    resumed = ServerConnection.resumed(limits, codec.server, codec.settings, rest,
                                       subscribed=False)
    assert resumed.next_events() == [pc.Sub("t", "c")]  # not subscribed yet
    assert resumed.next_events() == [pc.Rdy(1)]


def test_a_socket_and_its_state_travel_in_one_datagram(tmp_path):
    receiver = Receiver(socket_path(str(tmp_path), 0))
    sender = Sender([receiver.path, str(tmp_path / "nobody.sock")])
    a, b = socket.socketpair()
    try:
        assert sender.send(0, a.fileno(), {"topic": "t", "buffered": b"RDY 1\n"}) == SENT
        assert sender.send(1, a.fileno(), {}) == FAILED  # no receiver there: at once
        assert sender.send(7, a.fileno(), {}) == FAILED  # no such receiver
        ((sock, state),) = receiver.receive()
        assert state == {"topic": "t", "buffered": b"RDY 1\n"}
        a.close()  # the sender's descriptor goes; the connection lives on in the copy
        sock.sendall(b"still here")
        assert b.recv(100) == b"still here"
        sock.close()
        assert receiver.receive() == []
    finally:
        b.close()
        sender.close()
        receiver.close()


class Handler:
    """Records what a loop hands the broker; ``offer``: the commands whose connection it
    hands over."""

    def __init__(self, offer: tuple[type, ...]) -> None:
        self.offer = offer
        self.server: TcpServer | None = None
        self.commands: list = []
        self.adopted: list = []
        self.closed: list[str] = []
        self.event = threading.Event()

    def on_command(self, session, corr, command) -> None:
        self.commands.append(command)
        self.event.set()

    def on_handoff(self, session, command) -> bool:
        if type(command) not in self.offer:
            return False
        assert self.server is not None
        self.server.hand_off(session, 0, {"who": "actor", "offered": type(command).__name__,
                                          "on": command.topic})
        return True

    def on_adopt(self, session, state) -> None:
        self.adopted.append((session, state))
        self.server.send(session, struct.pack(">ii", 6, 0) + b"OK")  # what SUB's owner says

    def on_close(self, session) -> None:
        self.closed.append(session)
        self.event.set()

    def on_heartbeat(self, session) -> None:
        pass


def _wait(predicate, what: str) -> None:
    for _ in range(500):
        if predicate():
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _frames(sock: socket.socket, n: int) -> list[bytes]:
    data, out = b"", []
    while len(out) < n:
        while len(data) < 4 or len(data) < 4 + struct.unpack(">i", data[:4])[0]:
            more = sock.recv(65536)
            assert more, "closed"
            data += more
        size = struct.unpack(">i", data[:4])[0]
        if data[8:4 + size] != b"_heartbeat_":  # (one may come at any time on a slow machine)
            out.append(data[8:4 + size])
        data = data[4 + size:]
    return out


@pytest.fixture
def loops(tmp_path):
    """A gateway loop (listening, handing SUBs to receiver 0) and a worker loop
    (adopting from receiver 0)."""
    gateway_handler, worker_handler = Handler(offer=(pc.Sub,)), Handler(offer=())
    receiver = Receiver(socket_path(str(tmp_path), 0))
    sender = Sender([receiver.path])
    gateway = TcpServer("127.0.0.1", 0, gateway_handler, limits=Limits(), handoff=sender)
    worker = TcpServer(None, 0, worker_handler, limits=Limits())
    gateway_handler.server, worker_handler.server = gateway, worker
    port = gateway.start()
    worker.start()
    worker.adopt_from(receiver)
    yield port, gateway, gateway_handler, worker, worker_handler, receiver
    gateway.stop()
    worker.stop()
    sender.close()


def test_a_subscribed_connection_moves_with_its_settings_and_the_bytes_after_its_sub(loops):
    port, gateway, gw, worker, wk, _receiver = loops
    client = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        identify = b'{"heartbeat_interval": 7000, "user_agent": "test/1"}'
        client.sendall(b"  V2IDENTIFY\n" + struct.pack(">i", len(identify)) + identify
                       + b"PUB t\n" + struct.pack(">i", 3) + b"abc"
                       + b"SUB t c\nRDY 3\nNOP\n")
        # IDENTIFY's answer from the gateway's loop, then the SUB's from the worker's
        # (what on_adopt writes): read together, as they may come in one segment
        identified, subscribed = _frames(client, 2)
        assert identified
        assert subscribed == b"OK"
        _wait(lambda: wk.adopted and gw.closed, "the hand-off")
        assert [type(c) for c in gw.commands] == [pc.Identify, pc.Pub]  # not the SUB
        ((session, state),) = wk.adopted
        assert state["who"] == "actor"
        assert state["offered"] == "Sub"
        assert state["topic"] == "t"
        assert state["channel"] == "c"
        assert state["settings"]["heartbeat_interval"] == 7000
        assert state["settings"]["user_agent"] == "test/1"
        assert gateway.sessions() == 0
        assert worker.sessions() == 1
        _wait(lambda: wk.commands, "the RDY after the SUB, on the worker's loop")
        assert wk.commands == [pc.Rdy(3)]
        worker.send(session, struct.pack(">ii", 6, 0) + b"hi")
        assert _frames(client, 1) == [b"hi"]
        client.sendall(b"FIN 0123456789abcdef\n")
        _wait(lambda: len(wk.commands) == 2, "the FIN")
        assert wk.commands[1] == pc.Fin((b"0123456789abcdef",))
        assert worker.peer(session).startswith("127.0.0.1:")
    finally:
        client.close()
    _wait(lambda: wk.closed, "the worker hearing the close")


def test_a_hand_off_that_cannot_be_sent_leaves_the_connection_with_the_gateway(loops):
    port, gateway, gw, _worker, wk, receiver = loops
    receiver.close()  # the worker is away (restarting): nobody receives
    client = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        client.sendall(b"  V2SUB t c\nRDY 2\n")
        _wait(lambda: len(gw.commands) == 2, "the SUB and RDY on the gateway")
        assert gw.commands == [pc.Sub("t", "c"), pc.Rdy(2)]
        assert not wk.adopted
        assert not gw.closed
        assert gateway.sessions() == 1
    finally:
        client.close()


def test_a_publishing_connection_moves_after_its_first_publish_with_what_follows(loops):
    port, gateway, gw, worker, wk, _receiver = loops
    gw.offer = (pc.Pub, pc.Mpub, pc.Dpub, pc.Sub)  # a broker hands publishers over too
    client = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        mpub = struct.pack(">ii", 14, 2) + struct.pack(">i", 1) + b"x" + struct.pack(">i", 1) + b"y"
        client.sendall(b"  V2PUB t\n" + struct.pack(">i", 3) + b"abc"
                       + b"MPUB u\n" + mpub + b"SUB u c\n")
        _wait(lambda: wk.adopted and gw.closed, "the hand-off")
        assert gw.commands == [pc.Pub("t", b"abc")]  # the publish that offered it, only
        ((_, state),) = wk.adopted
        assert state["offered"] == "Pub"
        assert "channel" not in state  # not subscribed: the worker's decoder takes a SUB
        _wait(lambda: len(wk.commands) == 2, "the MPUB and SUB after it, on the worker")
        assert wk.commands == [pc.Mpub("u", (b"x", b"y")), pc.Sub("u", "c")]
        assert _frames(client, 1) == [b"OK"]  # what the worker's handler wrote on adopting
        assert gateway.sessions() == 0
        assert worker.sessions() == 1
    finally:
        client.close()
    _wait(lambda: wk.closed, "the worker hearing the close")


def test_a_subscribed_connection_left_on_the_gateway_is_not_offered_again_at_a_publish(loops):
    port, gateway, gw, _worker, wk, _receiver = loops
    gw.offer = (pc.Pub, pc.Mpub, pc.Dpub)  # its SUB was not taken (as when a send fails)
    client = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        # a publish after the SUB offers nothing: the SUB said where the connection goes
        # (handed over now, it would arrive subscribed without its subscription)
        client.sendall(b"  V2SUB t c\nPUB t\n" + struct.pack(">i", 1) + b"x" + b"RDY 3\n")
        _wait(lambda: len(gw.commands) == 3, "the SUB, PUB and RDY on the gateway")
        assert gw.commands == [pc.Sub("t", "c"), pc.Pub("t", b"x"), pc.Rdy(3)]
        assert not wk.adopted
        assert gateway.sessions() == 1
    finally:
        client.close()


@pytest.fixture
def datagrams(tmp_path):
    """A receiver, a sender to it, and a socket to hand over."""
    receiver = Receiver(socket_path(str(tmp_path), 0))
    sender = Sender([receiver.path])
    a, b = socket.socketpair()
    yield receiver, sender, a
    a.close()
    b.close()
    sender.close()
    receiver.close()


def test_a_state_with_a_whole_read_of_pipelined_publishes_fits_in_its_datagram(datagrams):
    receiver, sender, a = datagrams
    read = b"x" * (256 * 1024 + 100)  # (asyncio reads at most 256 KiB at once)
    assert sender.send(0, a.fileno(), {"buffered": read}) == SENT
    ((sock, state),) = receiver.receive()
    sock.close()
    assert state["buffered"] == read


def test_a_receiver_whose_queue_is_full_is_busy_not_a_wait(datagrams):
    receiver, sender, a = datagrams
    answers = [sender.send(0, a.fileno(), {"n": n}) for n in range(1000)]
    # (the gateway's loop never blocks on it: it tries again a little later)
    assert answers[0] == SENT
    assert BUSY in answers
    sent = answers.index(BUSY)
    assert set(answers[sent:]) == {BUSY}
    received = receiver.receive()
    for sock, _ in received:
        sock.close()
    assert len(received) == sent
    assert sender.send(0, a.fileno(), {"n": "again"}) == SENT
    ((sock, state),) = receiver.receive()
    sock.close()
    assert state == {"n": "again"}


class Waits(Handler):
    """Takes every offer and never hands over: the client actor's publishes are slow."""

    def on_handoff(self, session, command) -> bool:
        return True


def test_a_connection_waiting_for_its_hand_off_is_not_silent_but_is_closed_when_overdue(
        tmp_path, monkeypatch):
    monkeypatch.setattr(server_mod, "HANDOFF_DEADLINE", 0.5)
    handler = Waits(offer=())
    sender = Sender([str(tmp_path / "nobody.sock")])
    gateway = TcpServer("127.0.0.1", 0, handler, limits=Limits(), handoff=sender)
    handler.server = gateway
    port = gateway.start()
    client = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        identify = b'{"heartbeat_interval": 1000}'
        client.sendall(b"  V2IDENTIFY\n" + struct.pack(">i", len(identify)) + identify
                       + b"PUB t\n" + struct.pack(">i", 1) + b"x")
        _wait(lambda: handler.commands[-1:] == [pc.Pub("t", b"x")], "the PUB")
        (conn,) = gateway.conns.values()
        # a heartbeat due while it waits, with nothing heard for long: not closed
        conn.heard -= 100
        done = threading.Event()
        gateway.loop.call_soon_threadsafe(lambda: (conn._beat(), done.set()))
        assert done.wait(10)
        assert not conn.closed
        # but a hand-off that never comes closes it (its publishes' topic is gone)
        _wait(lambda: handler.closed, "the overdue hand-off to close it")
        assert conn.closed
    finally:
        client.close()
        gateway.stop()
        sender.close()


def test_a_worker_loop_sharing_its_callers_loop_lets_go_of_its_receiver_as_it_stops(tmp_path):
    # Given a worker's server made on a running loop (a dispatcher thread's), adopting
    loop = asyncio.new_event_loop()
    receiver = Receiver(socket_path(str(tmp_path), 0))

    async def made() -> TcpServer:
        s = TcpServer(None, 0, Handler(offer=()), limits=Limits())
        s.start()
        s.adopt_from(receiver)
        return s

    try:
        worker = loop.run_until_complete(made())
        assert worker.loop is loop
        # When it stops (on the loop's thread, which its dispatcher closes later)
        worker.stop()
        # Then the receiver is closed at once, not by a task the closing loop may cancel
        assert receiver.sock.fileno() == -1
        assert not os.path.exists(receiver.path)
        loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()
