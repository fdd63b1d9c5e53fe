"""Writes to NSQ TCP connections from other threads: in order, batched, one wake-up a burst."""

from __future__ import annotations

import pytest

from transport.nsq.server import LoopServer


class FakeConn:
    def __init__(self, name: str, *, fail: bool = False) -> None:
        self.name = name
        self.fail = fail
        self.events: list[object] = []

    def write(self, data: bytes) -> None:
        if self.fail:
            raise OSError("broken")
        self.events.append(data)

    def close(self) -> None:
        self.events.append("closed")


@pytest.fixture
def server():
    s = LoopServer("127.0.0.1", 0, handler=None, make_conn=None)
    wakeups: list[object] = []
    s.loop.call_soon_threadsafe = wakeups.append  # the loop is not run: count its wake-ups
    s.wakeups = wakeups
    yield s
    s.loop.close()


def test_writes_keep_their_order_per_connection_and_consecutive_ones_go_as_one(server):
    a, b = FakeConn("a"), FakeConn("b")
    server.conns.update(a=a, b=b)
    for session, data in (("a", b"1"), ("a", b"2"), ("b", b"x"), ("a", b"3")):
        server.send(session, data)
    server.drop("a")
    server.send("b", b"y")
    assert len(server.wakeups) == 1  # one wake-up for the whole burst
    server.wakeups.pop()()  # the loop runs the flush
    assert a.events == [b"12", b"3", "closed"]  # the close after what was queued before it
    assert b.events == [b"x", b"y"]
    server.send("a", b"4")
    assert len(server.wakeups) == 1  # the next burst wakes the loop again


def test_a_connection_whose_write_fails_costs_the_others_nothing(server):
    bad, good = FakeConn("bad", fail=True), FakeConn("good")
    server.conns.update(bad=bad, good=good)
    server.send("bad", b"1")
    server.send("good", b"2")
    server.wakeups.pop()()
    assert good.events == [b"2"]


def test_a_write_to_a_session_that_has_gone_is_dropped(server):
    server.send("gone", b"1")
    assert server.wakeups == []
