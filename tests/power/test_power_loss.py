"""Nothing acknowledged is lost on a power cut (#22): the broker on a volatile file system.

The data directory lives on `tests.power.volatile_fs`, which drops at each
unmount whatever POSIX lets a power cut drop: bytes not fsynced, directory
entries whose directory was not fsynced.  Each cut kills the broker (-9),
unmounts (the cut), mounts again and restarts it, while producers publish in
durable mode (``--mem-queue-size=0 --sync-every=1``) and consumers FIN on
one channel while another waits; small chunk files make every life rotate.
At the end every message a producer saw acknowledged must have been
delivered on every channel (before a cut or in the final drain), and nothing
never published may come out.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from transport.nsq.client_codec import ClientConnection, Message, Response
from transport.nsq.codec import CLOSED, NEED_DATA
from transport.protocol import commands as pc

pytestmark = pytest.mark.timeout(300)

CUTS = 4
LIFE = 2.0  # seconds of load between cuts
TOPICS = ("t", "u")
# "c" is consumed while the broker runs (every other life); "d" only after the last
# cut.  In a life without consumers no queue's floor moves, so no metadata write
# fsyncs the shared directory: only the sync itself can make a new chunk's entry durable.
CHANNELS = ("c", "d")


def _fuse_problem() -> str | None:
    if importlib.util.find_spec("mfusepy") is None:
        return "mfusepy is not installed"
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        return "FUSE is not available (/dev/fuse, fusermount3 from Debian's fuse3)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VolatileMount:
    """`backing` mounted at `mount` through the volatile file system; `cut()` unmounts."""

    def __init__(self, tmp: Path) -> None:
        self.backing = tmp / "backing"
        self.mount = tmp / "mnt"
        self.backing.mkdir()
        self.mount.mkdir()
        self.proc: subprocess.Popen[bytes] | None = None

    def up(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.power.volatile_fs", str(self.backing), str(self.mount)],
            stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while not os.path.ismount(self.mount):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                pytest.skip(f"cannot mount FUSE here: {err.strip()[-300:]}")
            time.sleep(0.02)

    def cut(self) -> None:
        subprocess.run(["fusermount3", "-u", str(self.mount)], check=True, timeout=30)
        assert self.proc is not None
        self.proc.wait(30)


class BrokerProcess:
    def __init__(self, data: Path) -> None:
        self.data = data
        self.tcp, self.http = _free_port(), _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "actors.broker", "--data-path", str(self.data),
             "--tcp-address", f"127.0.0.1:{self.tcp}", "--http-address", f"127.0.0.1:{self.http}",
             "--zmq-address", "tcp://127.0.0.1:0", "--mem-queue-size", "0", "--sync-every", "1",
             "--max-bytes-per-file", "20000", "--workers", "1", "--log-level", "warn"])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, http.client.HTTPException):
                conn = http.client.HTTPConnection("127.0.0.1", self.http, timeout=2)
                conn.request("GET", "/ping")
                if conn.getresponse().read().startswith(b"OK"):
                    return
            assert self.proc.poll() is None, "the broker exited while starting"
            time.sleep(0.05)
        raise AssertionError("the broker did not answer /ping")

    def post(self, path: str) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.http, timeout=10)
        conn.request("POST", path)
        assert conn.getresponse().status == 200, path

    def kill9(self) -> None:
        assert self.proc is not None
        procs = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(True)]
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        psutil.wait_procs(procs, timeout=10)
        self.proc.wait(10)


class Tcp:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.codec = ClientConnection()

    def send(self, *commands: pc.Command) -> None:
        self.sock.sendall(b"".join(self.codec.send(c) for c in commands))

    def events(self) -> Iterator[object]:
        while True:
            event = self.codec.next_event()
            if event is NEED_DATA:
                data = self.sock.recv(65536)
                if not data:
                    return
                self.codec.receive_data(data)
            elif event is CLOSED:
                return
            elif isinstance(event, pc.Heartbeat):
                self.send(pc.Nop())
            else:
                yield event


def _produce(port: int, topic: str, prefix: str, acked: set[bytes], stop: threading.Event) -> None:
    """Publish numbered MPUBs of 10 one after another; note each batch once it is OK."""
    with contextlib.suppress(OSError):
        c = Tcp(port)
        events = c.events()
        n = 0
        while not stop.is_set():
            bodies = tuple(b"%s-%s-%d" % (prefix.encode(), topic.encode(), n + i)
                           for i in range(10))
            n += 10
            c.send(pc.Mpub(topic, bodies))
            if next(events, None) != Response(b"OK"):
                return  # the broker died first: not acknowledged
            acked.update(bodies)


def _consume(port: int, topic: str, channel: str, got: set[bytes], stop: threading.Event,
             *, idle: float | None = None) -> None:
    """FIN everything delivered; with `idle`, return after that long without a message."""
    with contextlib.suppress(OSError):
        c = Tcp(port)
        c.send(pc.Sub(topic, channel), pc.Rdy(50))
        c.sock.settimeout(idle if idle else 0.5)
        events = c.events()
        while not stop.is_set():
            try:
                event = next(events)
            except TimeoutError:
                if idle:
                    return
                continue
            except StopIteration:
                return
            if isinstance(event, Message):
                got.add(event.body)
                c.send(pc.Fin((event.id,)))


@pytest.mark.skipif(_fuse_problem() is not None, reason=str(_fuse_problem()))
def test_nothing_acknowledged_is_lost_across_power_cuts(tmp_path):
    fs = VolatileMount(tmp_path)
    fs.up()
    # A long data path keeps the broker's ipc sockets in /tmp, off the volatile mount
    data = fs.mount / ("d" * 80)
    broker = BrokerProcess(data)
    acked: dict[str, set[bytes]] = {t: set() for t in TOPICS}
    got: dict[tuple[str, str], set[bytes]] = {(t, c): set() for t in TOPICS for c in CHANNELS}
    published_prefixes: list[str] = []
    try:
        for life in range(CUTS + 1):
            broker.start()
            for topic in TOPICS:
                broker.post(f"/topic/create?topic={topic}")
                for channel in CHANNELS:
                    broker.post(f"/channel/create?topic={topic}&channel={channel}")
            if life == CUTS:
                break
            # Given producers and consumers at work
            stop = threading.Event()
            prefix = f"life{life}"
            published_prefixes.append(prefix)
            threads = [threading.Thread(target=_produce,
                                        args=(broker.tcp, t, prefix, acked[t], stop))
                       for t in TOPICS]
            if life % 2 == 0:  # (in the other lives no queue's floor moves: see CHANNELS)
                threads += [threading.Thread(target=_consume,
                                             args=(broker.tcp, t, "c", got[t, "c"], stop))
                            for t in TOPICS]
            for t in threads:
                t.start()
            time.sleep(LIFE)
            # When the power goes: the broker dies, the unsynced state is dropped
            broker.kill9()
            stop.set()
            for t in threads:
                t.join(30)
            fs.cut()
            fs.up()
        # Then the last life delivers every acknowledged message not consumed before
        stop = threading.Event()
        for topic in TOPICS:
            for channel in CHANNELS:
                _consume(broker.tcp, topic, channel, got[topic, channel], stop, idle=3.0)
    finally:
        with contextlib.suppress(Exception):
            broker.kill9()
        with contextlib.suppress(Exception):
            fs.cut()
    total = sum(map(len, acked.values()))
    print(f"{CUTS} cuts: {total} acknowledged, {sum(map(len, got.values()))} delivered")
    assert total > 100, "the load did not run"
    prefixes = tuple(p.encode() for p in published_prefixes)
    for (topic, channel), delivered in got.items():
        lost = acked[topic] - delivered
        assert not lost, (f"{topic}/{channel}: {len(lost)} of {len(acked[topic])} "
                          f"acknowledged messages lost: {sorted(lost)[:5]}")
        assert all(b.startswith(prefixes) for b in delivered), "never published"
