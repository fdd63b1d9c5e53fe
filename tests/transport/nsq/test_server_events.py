"""What the NSQ TCP loop hands its handler: runs of FINs, and of PUBs to one topic, read
together go on together; everything else, and the order, is the client's."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from transport.nsq.server import TcpServer
from transport.protocol import commands as pc
from transport.protocol.validation import Limits

pytestmark = pytest.mark.timeout(30)

ID = b"0123456789abcdef"


class Recorder:
    def __init__(self) -> None:
        self.commands: list = []
        self.arrived = threading.Condition()

    def on_command(self, session, corr, command) -> None:
        with self.arrived:
            self.commands.append(command)
            self.arrived.notify_all()

    def on_close(self, session) -> None:
        pass

    def on_heartbeat(self, session) -> None:
        pass

    def wait_for(self, n: int) -> list:
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.commands) >= n, timeout=10), \
                self.commands
            return list(self.commands)


@pytest.fixture
def served():
    recorder = Recorder()
    server = TcpServer("127.0.0.1", 0, recorder, limits=Limits())
    port = server.start()
    client = socket.create_connection(("127.0.0.1", port), timeout=10)
    yield client, recorder
    client.close()
    server.stop()


def pub(topic: bytes, body: bytes) -> bytes:
    return b"PUB " + topic + b"\n" + struct.pack(">i", len(body)) + body


def test_pubs_to_one_topic_read_together_are_handed_on_as_one_in_order(served):
    client, recorder = served
    client.sendall(b"  V2" + pub(b"a", b"1") + pub(b"a", b"2") + pub(b"a", b"3")
                   + pub(b"b", b"4") + b"NOP\n" + pub(b"a", b"5") + pub(b"a", b"6")
                   + b"SUB a c\n" + b"FIN " + ID + b"\n" + pub(b"a", b"7") + b"RDY 1\n")
    # (the loop answers NOP itself; it ends a run of PUBs all the same, and a SUB ends
    # what the decoder hands on at once: the rest follows in the next call)
    assert recorder.wait_for(7) == [
        pc.Pubs("a", (b"1", b"2", b"3")), pc.Pub("b", b"4"), pc.Pubs("a", (b"5", b"6")),
        pc.Sub("a", "c"), pc.Fin((ID,)), pc.Pub("a", b"7"), pc.Rdy(1)]


def test_a_bad_command_after_pubs_leaves_them_handed_on_before_its_error(served):
    client, recorder = served
    client.sendall(b"  V2" + pub(b"a", b"1") + pub(b"a", b"2") + b"PUB bad!topic\n")
    (pubs,) = recorder.wait_for(1)
    assert pubs == pc.Pubs("a", (b"1", b"2"))
    frame = client.recv(4096)
    assert b"E_BAD_TOPIC" in frame
    assert client.recv(4096) == b""  # fatal: closed
    assert recorder.commands == [pubs]
