"""The broker's actors running for real: topics, channels, clients, scanner, restarts.

Each test starts a broker (supervisor + gateway + one worker) on a tmp data
dir and talks to it the way the protocol layer will: `Publish` asks to
topics, commands to `client:*` actors, deliveries read from client outboxes.
Synchronisation is by polling with a deadline, never by fixed sleeps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest

from actors.broker import Broker
from actors.broker.client import (
    ClientClose,
    ClientFin,
    ClientGone,
    ClientIdentify,
    ClientRdy,
    ClientReq,
    ClientSub,
    ClientTake,
)
from actors.broker.errors import BrokerError
from actors.broker.messages import Deliver, Swept
from actors.broker.nsq_message import decode_message
from tests.broker.conftest import broker_options

pytestmark = pytest.mark.timeout(90)


def wait_for(check: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)



def kill_worker(broker: Broker, name: str = "worker-0") -> None:
    """kill -9 a worker node and wait for the supervisor to have started it again."""
    worker = next(p for p in broker.supervisor.ps() if p.name == name)
    os.kill(worker.pid, signal.SIGKILL)
    wait_for(lambda: next(p for p in broker.supervisor.ps()
                          if p.name == name).pid not in (None, worker.pid),
             what=f"{name}'s restart")

class Client:
    """Drives a `client:<id>` actor like a connection would."""

    def __init__(self, broker: Broker, name: str) -> None:
        self.sup = broker.supervisor
        self.name = f"client:{name}"
        self.messages: list[bytes] = []
        self.errors: list[tuple[str, str, bool]] = []

    def send(self, command: Any) -> None:
        self.sup.tell(self.name, command)

    def sub(self, topic: str, channel: str, rdy: int = 100, timeout_ms: int = 0) -> Client:
        if timeout_ms:
            self.send(ClientIdentify(timeout_ms))
        self.send(ClientSub(topic, channel))
        self.send(ClientRdy(rdy))
        return self

    def poll(self) -> None:
        for entry in self.sup.ask(self.name, ClientTake(), timeout=5):
            if entry[0] == "message":
                self.messages.append(entry[2])
            else:
                self.errors.append(tuple(entry[1]))

    def wait_messages(self, n: int, timeout: float = 10.0) -> list[bytes]:
        def enough() -> bool:
            self.poll()
            return len(self.messages) >= n
        wait_for(enough, timeout, f"{n} messages on {self.name} (have {len(self.messages)})")
        return self.messages

    def wait_error(self, code: str, timeout: float = 10.0) -> tuple[str, str, bool]:
        def found() -> Any:
            self.poll()
            return next((e for e in self.errors if e[0] == code), None)
        return wait_for(found, timeout, f"{code} on {self.name}")

    def bodies(self) -> list[bytes]:
        return [decode_message(m).body for m in self.messages]

    def fin_all(self) -> None:
        self.send(ClientFin([decode_message(m).id for m in self.messages]))


@pytest.fixture
def start_broker(tmp_path) -> Iterator[Callable[..., Broker]]:
    running: list[Broker] = []

    def _start(**options: Any) -> Broker:
        options.setdefault("queue_scan_interval", 0.02)
        b = Broker(broker_options(tmp_path / "data", **options)).start()
        running.append(b)
        return b

    yield _start
    for b in running:
        b.stop()


def _stats(broker: Broker, topic: str) -> dict[str, Any]:
    return broker.topic_stats(topic)


def _channel_stats(broker: Broker, topic: str, channel: str) -> dict[str, Any]:
    """A channel's stats; every count reads -1 while the channel does not exist yet."""
    found = [c for c in _stats(broker, topic)["channels"] if c["channel_name"] == channel]
    return found[0] if found else defaultdict(lambda: -1)


def test_every_channel_gets_a_copy_of_every_message(start_broker):
    b = start_broker()
    a = Client(b, "a").sub("orders", "archive")
    s = Client(b, "s").sub("orders", "shipping")
    wait_for(lambda: len(_stats(b, "orders")["channels"]) == 2, what="two channels")
    b.publish("orders", [b"m%d" % i for i in range(50)])
    a.wait_messages(50)
    s.wait_messages(50)
    assert sorted(a.bodies()) == sorted(b"m%d" % i for i in range(50))
    assert sorted(s.bodies()) == sorted(b"m%d" % i for i in range(50))


def test_a_topic_without_channels_keeps_its_messages_until_a_channel_appears(start_broker):
    # Given more messages than the memory queue holds, and no channel yet
    b = start_broker(mem_queue_size=10)
    b.publish("orders", [b"m%03d" % i for i in range(40)])
    assert _stats(b, "orders")["depth"] == 40
    assert _stats(b, "orders")["backend_depth"] == 30
    # When a consumer subscribes
    c = Client(b, "c").sub("orders", "late", rdy=100)
    # Then it gets all of them, memory and disk
    c.wait_messages(40)
    assert sorted(c.bodies()) == [b"m%03d" % i for i in range(40)]


def test_load_is_spread_over_the_ready_clients_of_a_channel(start_broker):
    b = start_broker()
    clients = [Client(b, f"w{i}").sub("jobs", "workers", rdy=1000) for i in range(3)]
    wait_for(lambda: _channel_stats(b, "jobs", "workers")["client_count"] == 3, what="3 clients")
    b.publish("jobs", [b"j%d" % i for i in range(600)])

    def all_delivered() -> bool:
        for c in clients:
            c.poll()
        return sum(len(c.messages) for c in clients) == 600
    wait_for(all_delivered, what="600 deliveries")
    assert all(len(c.messages) > 100 for c in clients)


def test_an_unfinished_message_is_redelivered_after_its_timeout(start_broker):
    b = start_broker()
    c = Client(b, "slow").sub("t", "c", rdy=1, timeout_ms=1000)
    b.publish("t", [b"work"])
    (first,) = c.wait_messages(1)
    c.messages.clear()
    (again,) = c.wait_messages(1, timeout=10)
    assert decode_message(again).id == decode_message(first).id
    assert decode_message(again).attempts == 2
    assert _channel_stats(b, "t", "c")["timeout_count"] >= 1


def test_a_channel_that_went_idle_is_swept_again_when_work_comes_back(start_broker):
    # Given a channel whose only message was finished: a sweep finds it idle, and it
    # leaves the scanner's list (the scanner sweeps only channels with work to expire)
    b = start_broker()
    c = Client(b, "sweep").sub("t", "c", rdy=1, timeout_ms=1000)
    b.publish("t", [b"done"])
    c.wait_messages(1)
    # (in flight: the channel is swept)
    assert list(b.supervisor.ask("scanner:0", Swept(), timeout=5)) == ["t/c"]
    c.fin_all()
    wait_for(lambda: _channel_stats(b, "t", "c")["in_flight_count"] == 0, what="the FIN")
    # (the next sweep finds it idle: it leaves the scanner's list)
    wait_for(lambda: not b.supervisor.ask("scanner:0", Swept(), timeout=5),
             what="the idle channel to leave the sweep")
    # When a new message is left unfinished
    c.messages.clear()
    b.publish("t", [b"work"])
    (first,) = c.wait_messages(1)
    c.messages.clear()
    # Then its timeout is still noticed: it comes back
    (again,) = c.wait_messages(1, timeout=10)
    assert decode_message(again).id == decode_message(first).id


def test_req_with_a_delay_and_dpub_are_delivered_when_due(start_broker):
    b = start_broker()
    c = Client(b, "c").sub("t", "c", rdy=10)
    wait_for(lambda: _channel_stats(b, "t", "c")["client_count"] == 1, what="subscription")
    start = time.monotonic()
    b.publish("t", [b"later"], defer_ms=300)
    (m,) = c.wait_messages(1)
    assert time.monotonic() - start >= 0.3
    # REQ it for 200 ms: it comes back no sooner, with attempts 2
    c.messages.clear()
    start = time.monotonic()
    c.send(ClientReq(decode_message(m).id, 200))
    (again,) = c.wait_messages(1)
    assert time.monotonic() - start >= 0.2
    assert decode_message(again).attempts == 2
    assert _channel_stats(b, "t", "c")["requeue_count"] == 1


def test_max_attempts_moves_a_message_to_the_dead_letter_topic(start_broker):
    b = start_broker(max_attempts=2)
    dead = Client(b, "dead").sub("orders.dead", "inspect")
    c = Client(b, "c").sub("orders", "c", rdy=1)
    wait_for(lambda: _channel_stats(b, "orders", "c")["client_count"] == 1, what="sub")
    b.publish("orders", [b"poison"])
    for attempt in (1, 2):
        (m,) = c.wait_messages(1)
        assert decode_message(m).attempts == attempt
        c.send(ClientReq(decode_message(m).id, 0))
        c.messages.clear()
    (d,) = dead.wait_messages(1)
    assert decode_message(d).body == b"poison"
    assert decode_message(d).id == decode_message(m).id
    assert decode_message(d).attempts == 1  # a fresh start on the dead-letter topic
    assert _channel_stats(b, "orders", "c")["dead_letter_count"] == 1
    c.poll()
    assert c.messages == []


def test_bad_input_gets_nsq_error_codes_and_the_broker_carries_on(start_broker):
    b = start_broker(max_msg_size=100, max_rdy_count=50)
    with pytest.raises(BrokerError) as e:
        b.publish("bad topic!", [b"x"])
    assert e.value.code == "E_BAD_TOPIC"
    with pytest.raises(BrokerError) as e:
        b.publish("t", [b"x" * 101])
    assert e.value.code == "E_BAD_MESSAGE"
    with pytest.raises(BrokerError) as e:
        b.publish("t", [b""])
    assert e.value.code == "E_BAD_MESSAGE"
    c = Client(b, "c").sub("t", "c", rdy=5)
    c.send(ClientFin([b"0123456789abcdef"]))
    _, _, fatal = c.wait_error("E_FIN_FAILED")
    assert not fatal
    c.send(ClientRdy(51))
    assert c.wait_error("E_INVALID")[2] is True
    bad = Client(b, "bad")
    bad.send(ClientSub("t", "no good"))
    assert bad.wait_error("E_BAD_CHANNEL")
    # The broker still works for everyone else.
    ok = Client(b, "ok").sub("t", "c2", rdy=5)
    wait_for(lambda: _channel_stats(b, "t", "c2")["client_count"] == 1, what="sub")
    b.publish("t", [b"fine"])
    ok.wait_messages(1)


def test_an_ephemeral_channel_goes_away_with_its_last_client(start_broker, tmp_path):
    b = start_broker()
    c = Client(b, "c").sub("t", "tmp#ephemeral")
    wait_for(lambda: _stats(b, "t")["channels"], what="the ephemeral channel")
    c.send(ClientGone())
    wait_for(lambda: not _stats(b, "t")["channels"], what="the channel to go")
    assert not any("ephemeral" in f for f in os.listdir(tmp_path / "data"))


def test_ephemeral_channels_come_and_go_without_rewriting_the_topics_metadata(
        start_broker, tmp_path):
    # Given a topic with a channel, whose metadata file lists it (each command is an
    # ask: the topic has written, or not, before it answers)
    b = start_broker()
    b.topic_command("t", "hello")  # (creates the topic, as /topic/create)
    b.topic_command("t", "create_channel", "durable")
    meta = tmp_path / "data" / "t.topic.json"
    written = os.stat(meta)
    # When an ephemeral channel comes and goes (the file does not list those)
    b.topic_command("t", "create_channel", "tmp#ephemeral")
    assert {c["channel_name"] for c in _stats(b, "t")["channels"]} == {
        "durable", "tmp#ephemeral"}
    b.topic_command("t", "delete_channel", "tmp#ephemeral")
    assert [c["channel_name"] for c in _stats(b, "t")["channels"]] == ["durable"]
    # Then the file was not written again (each write listed every channel: 10,000
    # ephemeral subscribers made the topic too slow to answer their SUBs)
    now = os.stat(meta)
    assert (now.st_ino, now.st_mtime_ns) == (written.st_ino, written.st_mtime_ns)


def test_cls_stops_deliveries_but_in_flight_messages_can_still_be_finished(start_broker):
    # nsqd's CLS: no more messages (and a later RDY is ignored), FIN still works, and
    # nothing is requeued to another client until the connection actually drops.
    b = start_broker()
    c = Client(b, "c").sub("t", "c", rdy=2)
    b.publish("t", [b"a", b"b", b"c"])
    c.wait_messages(2)
    c.send(ClientClose())
    c.send(ClientRdy(10))
    wait_for(lambda: _channel_stats(b, "t", "c")["clients"][0]["ready_count"] == 0, what="RDY 0")
    c.fin_all()
    wait_for(lambda: _channel_stats(b, "t", "c")["in_flight_count"] == 0, what="FINs")
    assert _channel_stats(b, "t", "c")["depth"] == 1
    assert _channel_stats(b, "t", "c")[
        "requeue_count"] == 0
    c.poll()
    assert len(c.messages) == 2


def test_a_crashed_client_actor_releases_what_it_held_at_once(start_broker):
    # The restarted instance cannot know the lost one's subscription except through the
    # connection registry: it must requeue the in-flight messages now, not at the timeout.
    b = start_broker(debug_hooks=True, msg_timeout=60.0)
    c = Client(b, "victim").sub("t", "c", rdy=10)
    b.publish("t", [b"a", b"b", b"c"])
    c.wait_messages(3)
    assert _channel_stats(b, "t", "c")["in_flight_count"] == 3
    b.supervisor.crash("client:victim")
    wait_for(lambda: _channel_stats(b, "t", "c")["in_flight_count"] == 0, what="released")
    stats = _channel_stats(b, "t", "c")
    assert stats["depth"] == 3
    assert stats["timeout_count"] == 0  # released by the restart, not by the 60 s timeout
    other = Client(b, "other").sub("t", "c", rdy=10)
    other.wait_messages(3)
    assert sorted(other.bodies()) == [b"a", b"b", b"c"]


def test_an_ephemeral_topic_is_deleted_when_its_last_channel_goes(start_broker):
    b = start_broker(mem_queue_size=5)
    c = Client(b, "c").sub("live#ephemeral", "view#ephemeral", rdy=1)

    def ready_count() -> int:
        clients = _channel_stats(b, "live#ephemeral", "view#ephemeral")["clients"]
        return clients[0]["ready_count"] if clients and clients != -1 else -1

    # (the channel has seen the client's RDY: a client whose RDY has not come yet
    # counts as room for the most it may ask, and the test wants room for none)
    wait_for(lambda: ready_count() == 1, what="RDY 1 at the channel")
    c.send(ClientRdy(0))
    wait_for(lambda: ready_count() == 0, what="RDY 0 at the channel")
    b.publish("live#ephemeral", [b"x"] * 20)
    wait_for(lambda: _channel_stats(b, "live#ephemeral", "view#ephemeral")["depth"] == 5,
             what="memory full")
    assert _channel_stats(b, "live#ephemeral", "view#ephemeral")["dropped_count"] == 15
    c.send(ClientGone())
    wait_for(lambda: _stats(b, "live#ephemeral")["message_count"] == 0, what="topic deleted")


def test_a_delivery_that_comes_after_cls_goes_back_to_the_channel_at_once(start_broker):
    # Given a client holding one message in flight, which then sends CLS
    b = start_broker()
    c = Client(b, "late").sub("t", "c", rdy=1)
    wait_for(lambda: _channel_stats(b, "t", "c")["client_count"] == 1, what="sub")
    b.publish("t", [b"m"])
    wait_for(lambda: c.wait_messages(1), what="the delivery")
    (encoded,) = c.messages
    c.send(ClientClose())
    # When a delivery the channel sent before it had the CLS's RDY 0 comes after the CLS
    # (here: that message again, still in flight to this client)
    c.send(Deliver("t/c", [encoded]))
    # Then it is not sent on (a ZeroMQ client may have closed its socket once CLS was
    # answered) but requeued at once, not left in flight until the session is dropped
    wait_for(lambda: _channel_stats(b, "t", "c")["in_flight_count"] == 0
             and _channel_stats(b, "t", "c")["depth"] == 1, what="the message requeued")
    c.poll()
    assert len(c.messages) == 1


def test_pause_empty_and_delete(start_broker, tmp_path):
    b = start_broker()
    c = Client(b, "c").sub("t", "c", rdy=100)
    wait_for(lambda: _channel_stats(b, "t", "c")["client_count"] == 1, what="sub")
    b.topic_command("t", "pause_channel", "c")
    b.publish("t", [b"a", b"b"])
    wait_for(lambda: _channel_stats(b, "t", "c")["depth"] == 2, what="queued while paused")
    c.poll()
    assert c.messages == []
    b.topic_command("t", "empty_channel", "c")
    wait_for(lambda: _channel_stats(b, "t", "c")["depth"] == 0, what="emptied")
    b.topic_command("t", "unpause_channel", "c")
    b.publish("t", [b"after"])
    c.wait_messages(1)
    assert c.bodies() == [b"after"]
    b.topic_command("t", "pause")
    b.publish("t", [b"held"])
    assert _stats(b, "t")["depth"] == 1
    b.topic_command("t", "unpause")
    c.wait_messages(2)
    with pytest.raises(BrokerError) as e:
        b.topic_command("t", "delete_channel", "nope")
    assert e.value.code == "E_CHANNEL_NOT_FOUND"
    b.topic_command("t", "delete")
    assert not (tmp_path / "data" / "t.topic.json").exists()
    with pytest.raises(BrokerError) as e:
        b.topic_command("t", "delete_channel", "c")
    assert e.value.code == "E_TOPIC_NOT_FOUND"


def test_a_clean_stop_and_start_loses_nothing_and_restores_topics_and_channels(start_broker):
    # Given messages queued in memory (default mem-queue-size), in flight and deferred
    b = start_broker()
    c = Client(b, "c").sub("orders", "archive", rdy=3)
    wait_for(lambda: _channel_stats(b, "orders", "archive")["client_count"] == 1, what="sub")
    b.topic_command("orders", "create_channel", "audit")
    b.publish("orders", [b"m%d" % i for i in range(10)])
    b.publish("orders", [b"later"], defer_ms=60_000)
    c.wait_messages(3)  # three in flight, never finished
    wait_for(lambda: _channel_stats(b, "orders", "audit")["depth"] == 10, what="audit filled")
    # When the broker stops cleanly and starts again
    assert b.stop()
    b2 = start_broker()
    # Then both channels exist again with every message, and the deferred one is still deferred
    wait_for(lambda: len(_stats(b2, "orders")["channels"]) == 2, what="channels restored")
    wait_for(lambda: _channel_stats(b2, "orders", "archive")["depth"] == 10, what="archive")
    assert _channel_stats(b2, "orders", "archive")["deferred_count"] == 1
    assert _channel_stats(b2, "orders", "audit")["depth"] == 10
    c2 = Client(b2, "c2").sub("orders", "archive", rdy=100)
    c2.wait_messages(10)
    assert sorted(c2.bodies()) == sorted(b"m%d" % i for i in range(10))


def test_with_mem_queue_size_zero_in_flight_messages_survive_a_worker_kill(start_broker):
    # Given messages on disk, delivered and not finished
    b = start_broker(mem_queue_size=0)
    c = Client(b, "c").sub("t", "c", rdy=5)
    wait_for(lambda: _channel_stats(b, "t", "c")["client_count"] == 1, what="sub")
    b.publish("t", [b"m%d" % i for i in range(5)])
    c.wait_messages(5)
    worker = next(p for p in b.supervisor.ps() if p.name == "worker-0")
    # When the worker is killed and restarted by the supervisor
    os.kill(worker.pid, signal.SIGKILL)
    wait_for(lambda: next(p for p in b.supervisor.ps() if p.name == "worker-0").pid != worker.pid,
             what="worker restart")
    # Then the topic, channel and all five messages come back for a new consumer
    wait_for(lambda: _channel_stats(b, "t", "c")["depth"] == 5, timeout=20,
             what="messages restored")
    c2 = Client(b, "c2").sub("t", "c", rdy=10)
    c2.wait_messages(5)
    assert sorted(c2.bodies()) == [b"m%d" % i for i in range(5)]


def test_python_m_actors_broker_runs_and_stops_cleanly_on_sigterm(tmp_path):
    data = tmp_path / "d"
    out = subprocess.run([sys.executable, "-m", "actors.broker", "--version"],
                         capture_output=True, text=True, timeout=30, check=True)
    assert out.stdout.strip()
    proc = subprocess.Popen([sys.executable, "-m", "actors.broker", "--data-path", str(data),
                             "--workers", "1", "--log-level", "info",
                             "--http-address", "127.0.0.1:0", "--tcp-address", "127.0.0.1:0",
                             "--zmq-address", "tcp://127.0.0.1:0"],
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "broker running" in line:
                break
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert data.is_dir()


def _worker_fds(broker: Broker) -> int:
    (worker,) = [p for p in broker.supervisor.ps() if p.name == "worker-0"]
    assert worker.pid is not None
    return psutil.Process(worker.pid).num_fds()


def test_an_idle_disk_queue_closes_its_files_and_reopens_them_on_the_next_message(start_broker):
    # Given durable topics whose messages sit on disk, and queues that close after 1 s idle
    b = start_broker(mem_queue_size=0, queue_idle_close=1.0)
    idle_fds = _worker_fds(b)
    for i in range(20):
        b.publish(f"idle{i}", [b"first"])
    # (the last ones written are certainly still open: their files count)
    assert _worker_fds(b) >= idle_fds + 2
    # When they have been idle for a while, Then their files are closed
    wait_for(lambda: _worker_fds(b) <= idle_fds + 5, 15, "idle queues to close their files")
    # And the next message reopens them: nothing was lost, and delivery goes on
    b.publish("idle3", [b"second"])
    c = Client(b, "idler").sub("idle3", "ch")
    c.wait_messages(2)
    assert sorted(c.bodies()) == [b"first", b"second"]
    # And a queue with messages in flight keeps its files while they are: once
    # the topic's own queue, idle, has closed its files, the channel's still has its own
    open_now = _worker_fds(b)
    wait_for(lambda: _worker_fds(b) <= open_now - 2, 15, "the topic's idle queue to close")
    assert _channel_stats(b, "idle3", "ch")["in_flight_count"] == 2
    assert _worker_fds(b) >= idle_fds + 2
    c.fin_all()
    wait_for(lambda: _channel_stats(b, "idle3", "ch")["in_flight_count"] == 0, 5, "the FINs")
    assert _channel_stats(b, "idle3", "ch")["depth"] == 0


def test_a_crashed_disk_queue_actor_lets_go_of_its_files_and_its_restart_opens_them(
        start_broker):
    # A crashed instance kept its delayed store's SQLite lock and its queue's files: each
    # new instance failed to open them, and the crash loop escalated to a node restart.
    b = start_broker(debug_hooks=True)
    b.topic_command("t", "hello")
    b.topic_command("t", "create_channel", "c")
    b.publish("t", [b"later"], defer_ms=600_000)  # (the channel's delayed store exists)
    b.publish("t", [b"now"])
    wait_for(lambda: _channel_stats(b, "t", "c")["deferred_count"] == 1, what="deferred")
    worker = next(p for p in b.supervisor.ps() if p.name == "worker-0")
    # When the channel's disk-queue actor crashes
    b.supervisor.crash("diskqueue:t/c")
    # Then it alone restarts (not its node), and the queue and the store still serve
    wait_for(lambda: next(a for a in b.supervisor.actors()
                          if a.name == "diskqueue:t/c").restarts == 1, what="the restart")
    c = Client(b, "c").sub("t", "c")
    c.wait_messages(1)
    assert c.bodies() == [b"now"]
    stats = _channel_stats(b, "t", "c")
    assert (stats["deferred_count"], stats["depth"]) == (1, 0)
    assert next(p for p in b.supervisor.ps() if p.name == "worker-0").pid == worker.pid
    assert next(a for a in b.supervisor.actors() if a.name == "diskqueue:t/c").restarts == 1
