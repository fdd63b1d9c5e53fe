"""Writes to NSQ TCP connections from other threads: in order, batched, one wake-up a burst."""

from __future__ import annotations

import asyncio
import threading

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


def test_a_server_with_no_address_made_on_a_running_loop_serves_on_that_loop():
    # Given a loop running on this thread (a worker's dispatcher thread is one)
    loop = asyncio.new_event_loop()

    async def made() -> LoopServer:
        s = LoopServer(None, 0, handler=None, make_conn=None)
        s.start()
        return s

    try:
        server = loop.run_until_complete(made())
        # Then it starts no thread of its own and serves on the caller's loop
        assert server.loop is loop
        assert server._thread is None
        conn = FakeConn("a")
        server.conns["a"] = conn

        async def write_here() -> None:
            server.send("a", b"1")  # from the loop's own thread: no self-pipe wake-up
            await asyncio.sleep(0)

        loop.run_until_complete(write_here())
        assert conn.events == [b"1"]
        # and a write from another thread reaches the connection through the loop
        other = threading.Thread(target=server.send, args=("a", b"2"))
        other.start()
        other.join()
        loop.run_until_complete(asyncio.sleep(0))
        assert conn.events == [b"1", b"2"]
        # Stopping it closes its connections and leaves the loop to its owner
        server.stop()
        assert conn.events[-1] == "closed"
        assert not loop.is_closed()
        loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()


def test_an_answer_on_the_loops_thread_goes_out_at_once_after_what_was_queued():
    # Given a server on this thread's running loop, and writes queued in a loop turn
    loop = asyncio.new_event_loop()

    async def made() -> LoopServer:
        return LoopServer(None, 0, handler=None, make_conn=None)

    try:
        server = loop.run_until_complete(made())
        a, b = FakeConn("a"), FakeConn("b")
        server.conns.update(a=a, b=b)
        seen: dict[str, list[object]] = {}

        async def turn() -> None:
            server.send("b", b"delivery")
            server.answer("a", b"OK")  # (a publish's answer)
            # Then, within the turn, it is written, after what was queued before it
            seen["in the turn"] = [list(a.events), list(b.events)]
            server.send("b", b"later")
            server.drop("b")
            server.answer("a", b"OK2")  # (a close is queued: this one waits for the turn)
            seen["behind a close"] = [list(a.events), list(b.events)]
            await asyncio.sleep(0)

        loop.run_until_complete(turn())
        assert seen["in the turn"] == [[b"OK"], [b"delivery"]]
        assert seen["behind a close"] == seen["in the turn"]
        assert a.events == [b"OK", b"OK2"]
        assert b.events == [b"delivery", b"later", "closed"]
        # and from another thread an answer is queued for the loop, as any write
        other = threading.Thread(target=server.answer, args=("a", b"OK3"))
        other.start()
        other.join()
        assert a.events == [b"OK", b"OK2"]
        loop.run_until_complete(asyncio.sleep(0))
        assert a.events[-1] == b"OK3"
    finally:
        loop.close()


def test_a_server_with_an_address_keeps_its_own_thread_even_on_a_running_loop():
    loop = asyncio.new_event_loop()

    async def made() -> LoopServer:
        s = LoopServer("127.0.0.1", 0, handler=None, make_conn=None)
        s.start()  # (binds on its own loop's thread: this one's loop is running)
        return s

    try:
        server = loop.run_until_complete(made())
        try:
            assert server.loop is not loop
            assert server._thread is not None
            assert server._thread.is_alive()
            assert server.port > 0
        finally:
            server.stop()
        assert not server._thread.is_alive()
    finally:
        loop.close()
