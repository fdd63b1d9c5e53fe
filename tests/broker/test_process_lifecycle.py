"""`python -m actors.broker` as an operator runs it: one owner per data directory,
no orphans when the supervisor dies, and a broker that cannot start says why and exits."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from actors.broker import Broker
from actors.runtime.placement import Placement
from storage.dirlock import DirLock, DirLockedError
from tests.broker.conftest import broker_options
from tests.broker.test_broker_actors import wait_for
from tests.ports import free_port
from tests.procs import frozen
from transport.client import Producer

pytestmark = pytest.mark.timeout(120)


class BrokerProcess:
    """``python -m actors.broker`` on fixed free ports; stderr collected in a file."""

    def __init__(self, data: Path, log: Path, http_port: int | None = None,
                 *extra: str, session: bool = False) -> None:
        self.http_port = http_port or free_port()
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "actors.broker", "--data-path", str(data),
             "--workers", "1", "--log-level", "info",
             "--http-address", f"127.0.0.1:{self.http_port}", "--tcp-address", "127.0.0.1:0",
             "--zmq-address", "tcp://127.0.0.1:0", *extra],
            stderr=log.open("w"), stdout=subprocess.DEVNULL, start_new_session=session)

    def wait_running(self, timeout: float = 60) -> None:
        wait_for(lambda: "broker running" in self.log.read_text() or self.proc.poll() is not None,
                 timeout, "the broker to start")
        assert self.proc.poll() is None, self.log.read_text()[-2000:]

    def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=30)
        try:
            conn.request(method, path, body=body)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def processes() -> Iterator[list[BrokerProcess]]:
    started: list[BrokerProcess] = []
    yield started
    for p in started:
        kids = p.children() if p.proc.poll() is None else []
        p.close()
        for kid in kids:
            if kid.is_running():
                kid.kill()


def _channel_depth(b: BrokerProcess, topic: str, channel: str) -> int:
    status, body = b.request("GET", f"/stats?format=json&topic={topic}")
    assert status == 200, body
    (t,) = json.loads(body)["topics"]
    (c,) = [c for c in t["channels"] if c["channel_name"] == channel]
    return int(c["depth"])


def test_a_second_broker_on_the_same_data_path_exits_at_once_and_leaves_the_first_alone(
        tmp_path, processes):
    # Given a broker running on a data directory
    data = tmp_path / "data"
    first = Broker(broker_options(data)).start()
    try:
        first.publish("orders", [b"before"])
        run = Path(first.supervisor.run_dir)
        sockets = {p.name: p.stat().st_ino for p in run.iterdir()}
        # When a second one is started on the same directory
        started = time.monotonic()
        second = BrokerProcess(data, tmp_path / "second.log")
        processes.append(second)
        code = second.proc.wait(30)
        elapsed = time.monotonic() - started
        # Then it exits 1 within seconds with one line naming the directory and the holder
        assert code == 1
        assert elapsed < 15
        log = second.log.read_text()
        assert f"data path {data} is in use by another broker (pid {os.getpid()})" in log
        assert "Traceback" not in log
        # And the first broker's sockets were not touched, and it publishes and consumes on
        assert {p.name: p.stat().st_ino for p in run.iterdir()} == sockets
        first.topic_command("orders", "create_channel", "c")
        first.publish("orders", [b"after"])
        assert first.topic_stats("orders")["channels"][0]["depth"] == 2
    finally:
        first.stop()


def test_a_lock_left_by_a_killed_broker_does_not_block_a_restart(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (data / ".lock").write_text(f"{dead.pid}\n")
    with DirLock(data) as lock:
        assert (data / ".lock").read_text() == f"{os.getpid()}\n"
        held = rf"in use by another broker \(pid {os.getpid()}\)"
        with pytest.raises(DirLockedError, match=held):
            DirLock(data).acquire()
        assert lock.fd >= 0


def test_a_data_path_that_cannot_be_created_is_one_line_and_exit_1(tmp_path, processes):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    b = BrokerProcess(blocker / "data", tmp_path / "b.log")
    processes.append(b)
    assert b.proc.wait(30) == 1
    log = b.log.read_text()
    assert f"data path {blocker / 'data'} cannot be used" in log
    assert "Traceback" not in log


def test_the_nodes_stop_when_their_supervisor_is_killed_and_a_restart_loses_nothing(
        tmp_path, processes):
    # Given a broker with messages in memory on a channel (the default mem queue)
    data = tmp_path / "data"
    first = BrokerProcess(data, tmp_path / "first.log")
    processes.append(first)
    first.wait_running()
    assert first.request("POST", "/topic/create?topic=t")[0] == 200
    assert first.request("POST", "/channel/create?topic=t&channel=c")[0] == 200
    for i in range(50):
        assert first.request("POST", "/pub?topic=t", b"m%d" % i)[0] == 200
    assert _channel_depth(first, "t", "c") == 50
    nodes = first.children()
    assert nodes
    # When only the supervisor is killed -9
    os.kill(first.proc.pid, signal.SIGKILL)
    first.proc.wait()
    # Then its nodes stop on their own within seconds (flushing memory to disk)
    _, alive = psutil.wait_procs(nodes, timeout=10)
    assert alive == [], [p.pid for p in alive]
    # And a broker restarted on the same ports and data path has every message
    again = BrokerProcess(data, tmp_path / "again.log", first.http_port)
    processes.append(again)
    again.wait_running()
    assert _channel_depth(again, "t", "c") == 50


def _processes(b: BrokerProcess) -> dict[str, dict[str, Any]]:
    """The processes /stats lists, by name ({} while it cannot answer: a stats request
    that asks a worker killed a moment before waits for it, then answers 500)."""
    status, body = b.request("GET", "/stats?format=json")
    return {p["name"]: p for p in json.loads(body)["processes"]} if status == 200 else {}


def test_the_fork_server_and_resource_tracker_are_forks_and_a_killed_worker_comes_back(
        tmp_path, processes):
    # Given `python -m actors.broker`, storing each message before its OK
    b = BrokerProcess(tmp_path / "data", tmp_path / "b.log", None, "--mem-queue-size", "0")
    processes.append(b)
    b.wait_running()
    supervisor = psutil.Process(b.proc.pid)
    # Then its fork server and multiprocessing's resource tracker are forks of it (two
    # interpreter starts fewer), not interpreters spawned with `-c from multiprocessing`
    helpers = supervisor.children()
    assert len(helpers) == 2, [p.cmdline() for p in helpers]
    assert all(p.cmdline() == supervisor.cmdline() for p in helpers)
    assert not [p for p in b.children() if "multiprocessing" in " ".join(p.cmdline())]
    (server,) = [p for p in helpers if p.children()]  # (the tracker forks nothing)
    assert {p.pid for p in server.children()} == {
        p["pid"] for p in _processes(b).values() if p["role"] != "supervisor"}
    assert b.request("POST", "/pub?topic=t", b"kept")[0] == 200
    # When the worker is killed -9
    worker = _processes(b)["worker-0"]
    os.kill(worker["pid"], signal.SIGKILL)
    # Then the supervisor starts it again from the same server, and it has the message
    def restarted() -> bool:
        now = _processes(b).get("worker-0")
        return bool(now and now["restarts"] == worker["restarts"] + 1 and now["pid"])
    wait_for(restarted, 60, "the worker's restart")
    assert psutil.Process(_processes(b)["worker-0"]["pid"]).parent().pid == server.pid
    status, body = b.request("GET", "/stats?format=json&topic=t")
    assert status == 200, body
    assert json.loads(body)["topics"][0]["depth"] == 1
    # And SIGTERM stops every process of the tree, the forked two included
    kids = b.children()
    b.proc.send_signal(signal.SIGTERM)
    assert b.proc.wait(30) == 0, b.log.read_text()[-2000:]
    _, alive = psutil.wait_procs(kids, timeout=10)
    assert alive == []


def test_sigterm_to_the_whole_process_group_stops_the_broker_cleanly(tmp_path, processes):
    # Given a broker in a process group of its own, as under systemd
    b = BrokerProcess(tmp_path / "data", tmp_path / "b.log", None, session=True)
    processes.append(b)
    b.wait_running()
    assert b.request("POST", "/pub?topic=t", b"kept")[0] == 200
    kids = b.children()
    # When the whole group gets SIGTERM (systemd's stop), the fork server included
    os.killpg(b.proc.pid, signal.SIGTERM)
    # Then the broker stops in order and says so, every process gone
    assert b.proc.wait(30) == 0, b.log.read_text()[-2000:]
    assert "stopped cleanly" in b.log.read_text()
    assert "fork server is gone" not in b.log.read_text()
    _, alive = psutil.wait_procs(kids, timeout=10)
    assert alive == []


@pytest.mark.parametrize("stage", ["", "starting broker", "listening"])
def test_sigterm_while_starting_stops_the_broker_at_once(tmp_path, processes, stage):
    # SIGTERM at once, once the start is logged (handlers installed, nodes coming up),
    # and once a listener is up (the rest still starting)
    b = BrokerProcess(tmp_path / "data", tmp_path / "b.log")
    processes.append(b)
    wait_for(lambda: stage in b.log.read_text() or b.proc.poll() is not None, 30, stage)
    kids_before = b.children()
    b.proc.send_signal(signal.SIGTERM)
    # (-SIGTERM: before the handler is installed, nothing started yet)
    assert b.proc.wait(15) in (0, 1, -signal.SIGTERM)
    _, alive = psutil.wait_procs([*kids_before, *b.children()], timeout=10)
    assert alive == []


def _actor_names(b: Broker) -> set[str]:
    return {a.name for a in b.supervisor.actors(timeout=5)}


def test_what_is_deleted_or_closed_leaves_no_actor_thread_or_fd_behind(tmp_path):
    b = Broker(broker_options(tmp_path / "data", workers=2)).start()
    try:
        nodes = {p.name: psutil.Process(p.pid) for p in b.supervisor.ps()
                 if p.role != "supervisor"}
        http_conn = http.client.HTTPConnection("127.0.0.1", b.http_port, timeout=30)

        def post(path: str, body: bytes = b"") -> int:
            http_conn.request("POST", path, body=body)
            response = http_conn.getresponse()
            response.read()
            return response.status

        def churn(rounds: int) -> None:
            for i in range(rounds):
                # topics and channels created and deleted
                assert post(f"/topic/create?topic=gone{i}") == 200
                assert post(f"/channel/create?topic=gone{i}&channel=c") == 200
                assert post(f"/pub?topic=gone{i}", b"x") == 200
                assert post(f"/channel/delete?topic=gone{i}&channel=c") == 200
                assert post(f"/topic/delete?topic=gone{i}") == 200
                # names that never exist: a bad one, a missing one
                assert post("/pub?topic=bad!name", b"x") == 400
                assert post(f"/topic/delete?topic=never{i}") == 404
                # a consumer on an ephemeral channel that connects and leaves
                with socket.create_connection(("127.0.0.1", int(b.tcp_address.rsplit(":")[1])),
                                              timeout=10) as s:
                    s.sendall(b"  V2SUB eph%d#ephemeral c#ephemeral\n" % i)
                    assert s.recv(64)  # the OK

        # Given a warmed-up broker (the first round creates what stays: pools, caches)
        churn(5)
        wait_for(lambda: not {n for n in _actor_names(b)
                              if n.startswith(("client:", "topic:", "channel:", "diskqueue:"))},
                 30, "the warm-up's actors to go")
        threads = {n: p.num_threads() for n, p in nodes.items()}
        fds = {n: p.num_fds() for n, p in nodes.items()}
        # When 200 more rounds of that come and go
        churn(200)
        # Then no topic, channel, disk-queue or client actor is left, and no thread or fd
        wait_for(lambda: not {n for n in _actor_names(b)
                              if n.startswith(("client:", "topic:", "channel:", "diskqueue:"))},
                 30, "every actor of the churn to go")
        wait_for(lambda: all(p.num_fds() <= fds[n] + 5 for n, p in nodes.items()), 30,
                 f"fds back to {fds}")
        # (pools start their threads lazily, up to their size: a few more may have come)
        assert all(p.num_threads() <= threads[n] + 4 for n, p in nodes.items()), threads
        assert not list((tmp_path / "data").glob("gone*")) + list(
            (tmp_path / "data").glob("never*")) + list((tmp_path / "data").glob("bad*"))
        http_conn.close()
    finally:
        b.stop()


def test_ping_says_nok_while_a_worker_cannot_answer_and_metrics_cover_every_process(tmp_path):
    b = Broker(broker_options(tmp_path / "data", workers=2)).start()
    try:
        conn_args = ("127.0.0.1", b.http_port)

        def get(path: str) -> tuple[int, str]:
            conn = http.client.HTTPConnection(*conn_args, timeout=30)
            try:
                conn.request("GET", path)
                response = conn.getresponse()
                return response.status, response.read().decode()
            finally:
                conn.close()

        assert get("/ping") == (200, "OK")
        # Process figures for every process of the broker
        metrics = get("/metrics")[1]
        for node in ("gateway", "worker-0", "worker-1"):
            for family in ("nsq_process_resident_memory_bytes", "nsq_process_cpu_seconds_total",
                           "nsq_process_threads", "nsq_process_open_fds"):
                assert any(line.startswith(f'{family}{{process="{node}"')
                           for line in metrics.splitlines()), (family, node)
        # Given a topic on each worker
        placement = Placement(2)
        names = (f"t{i}" for i in range(100))
        on = {placement.node_for(f"topic:{t}"): t for t in names}
        for t in (on["worker-0"], on["worker-1"]):
            b.publish(t, [b"x"])
        # When a worker is frozen (it cannot take a publish), Then /ping says so
        (worker,) = [p for p in b.supervisor.ps() if p.name == "worker-1"]
        assert worker.pid is not None
        with frozen(worker.pid):
            status, text = get("/ping")
            assert status == 500, text
            assert text.startswith("NOK - worker-1 does not answer")
            # And /stats answers with the other worker's topics and says which is silent
            # (it waited for the ask timeout, then failed as a whole)
            status, text = get("/stats?format=json")
            assert status == 200, text
            stats = json.loads(text)
            assert [t["topic_name"] for t in stats["topics"]] == [on["worker-0"]]
            assert stats["nodes_silent"] == ["worker-1"]
            assert stats["health"].startswith("NOK - worker-1 does not answer")
        # And once it answers again, so does /ping
        wait_for(lambda: get("/ping") == (200, "OK"), 10, "/ping OK again")
    finally:
        b.stop()


def test_ctl_finds_a_broker_by_its_data_path_and_says_at_once_when_there_is_none(tmp_path):
    data = tmp_path / "data"
    ctl = [sys.executable, "-m", "actors.ctl", "--data-path", str(data), "ps"]
    started = time.monotonic()
    none = subprocess.run(ctl, check=False, capture_output=True, text=True, timeout=30)
    assert none.returncode == 1
    assert f"no broker running in {data}" in none.stderr
    assert time.monotonic() - started < 10
    b = Broker(broker_options(data)).start()
    try:
        running = subprocess.run(ctl, check=False, capture_output=True, text=True, timeout=30)
        assert running.returncode == 0, running.stderr
        assert "gateway" in running.stdout
    finally:
        b.stop()


def test_a_port_in_use_is_one_line_and_exit_1_within_seconds(tmp_path, processes):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        started = time.monotonic()
        b = BrokerProcess(tmp_path / "data", tmp_path / "b.log", port)
        processes.append(b)
        assert b.proc.wait(30) == 1
        assert time.monotonic() - started < 15
    log = b.log.read_text()
    assert f"127.0.0.1:{port}" in log
    assert "Address already in use" in log
    assert "Traceback" not in log
    assert not b.children()  # nothing left behind


def test_once_ping_says_ok_a_publish_on_every_protocol_is_answered_the_first_time(
        tmp_path, processes):
    """What a test harness does (#23): launch, poll /ping, then publish at once.  /ping
    answers OK only when the NSQ TCP and ZeroMQ listeners are bound and every worker
    takes messages, so no first publish meets a refused connection or a silent worker."""
    tcp, zmq_port = free_port(), free_port()
    b = BrokerProcess(tmp_path / "data", tmp_path / "b.log", None, "--workers", "2",
                      "--tcp-address", f"127.0.0.1:{tcp}",
                      "--zmq-address", f"tcp://127.0.0.1:{zmq_port}")
    processes.append(b)

    def ping_ok() -> bool:
        assert b.proc.poll() is None, b.log.read_text()[-2000:]
        try:
            return b.request("GET", "/ping") == (200, b"OK")
        except OSError:  # (the HTTP port is not bound yet)
            return False

    wait_for(ping_ok, 60, "/ping OK")
    # each protocol once, with no retry: the first attempt must be answered
    with socket.create_connection(("127.0.0.1", tcp), timeout=10) as s:
        s.sendall(b"  V2PUB tcp\n\x00\x00\x00\x03one")
        assert s.recv(64) == b"\x00\x00\x00\x06\x00\x00\x00\x00OK"
    with Producer(f"tcp://127.0.0.1:{zmq_port}", timeout=10, max_attempts=1) as producer:
        producer.publish("zmq", b"two")
    assert b.request("POST", "/pub?topic=http", b"three") == (200, b"OK")
    stats = json.loads(b.request("GET", "/stats?format=json")[1])
    assert {t["topic_name"]: t["message_count"] for t in stats["topics"]} == {
        "tcp": 1, "zmq": 1, "http": 1}


def test_a_descriptor_the_broker_was_launched_with_stays_in_its_own_process_only(tmp_path):
    # Given a launcher that leaves the write end of a pipe open in the broker (a harness
    # waiting for EOF on it, a shell's `3>file`)
    r, w = os.pipe()
    http_port = free_port()
    log = (tmp_path / "b.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "actors.broker", "--data-path", str(tmp_path / "data"),
         "--workers", "2", "--http-address", f"127.0.0.1:{http_port}",
         "--tcp-address", "127.0.0.1:0", "--zmq-address", "tcp://127.0.0.1:0"],
        pass_fds=(w,), stdout=subprocess.DEVNULL, stderr=log)
    os.close(w)
    try:
        def ping_ok() -> bool:
            assert proc.poll() is None, (tmp_path / "b.log").read_text()[-2000:]
            conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=10)
            try:
                conn.request("GET", "/ping")
                return conn.getresponse().read() == b"OK"
            except OSError:
                return False
            finally:
                conn.close()

        wait_for(ping_ok, 60, "/ping OK")
        pipe = os.readlink(f"/proc/self/fd/{r}")  # ("pipe:[inode]": both ends share it)

        def holders(pid: int) -> bool:
            fds = Path(f"/proc/{pid}/fd")
            return any(os.readlink(fd) == pipe for fd in fds.iterdir())

        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 5  # (the fork server, the resource tracker, three nodes)
        # Then the supervisor, which it was given to, holds it, and no process it forked
        assert holders(proc.pid)
        assert [c.pid for c in children if holders(c.pid)] == []
        # And once the broker stops, the pipe's reader sees its end at once.  (/ping
        # answers before start() returns: a SIGTERM before the running line is a stop
        # while starting, which exits 1 by design, actors.runtime.daemon.)
        wait_for(lambda: "broker running" in (tmp_path / "b.log").read_text(), 30,
                 "the running line")
        proc.terminate()
        assert proc.wait(30) == 0
        os.set_blocking(r, False)  # (a holder left would raise BlockingIOError, not hang)
        assert os.read(r, 1) == b""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(r)
        log.close()
