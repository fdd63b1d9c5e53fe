"""The chaos harness: a broker as a subprocess, a workload, a nemesis and a checker.

The checker follows Jepsen's total-queue: every acknowledged publish must be
delivered (lost = acknowledged - delivered must be empty) and nothing that
was never published may appear (unexpected = delivered - attempted);
duplicates are allowed (at least once) and counted.

Everything random comes from one seeded ``random.Random`` per thread role
(derived from the run's seed), so a failing run can be replayed with the
printed seed; the timing of the operating system still varies.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.ports import free_port
from transport.client import Consumer, Message, Producer
from transport.nsq.client_codec import ClientConnection
from transport.protocol import commands as pc

TOPIC = "chaos"
CHANNEL = "check"


class BrokerProcess:
    """`python -m actors.broker` in its own session (so the whole tree can be killed)."""

    def __init__(self, data: Path, log: Path, extra_args: tuple[str, ...] = ()) -> None:
        self.data = data
        self.log = log
        self.extra_args = extra_args
        self.tcp, self.http, self.zmq = free_port(), free_port(), free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def zmq_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.zmq}"

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "actors.broker", "--data-path", str(self.data),
                 "--workers", "2", "--mem-queue-size", "0", "--debug-hooks",
                 "--msg-timeout", "3s", "--queue-scan-interval", "50ms",
                 "--tcp-address", f"127.0.0.1:{self.tcp}",
                 "--http-address", f"127.0.0.1:{self.http}",
                 "--zmq-address", self.zmq_endpoint, "--log-level", "warn",
                 *self.extra_args],
                stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.ping():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited with {self.proc.returncode}; see {self.log}")
            time.sleep(0.1)
        raise RuntimeError("broker did not come up")

    def ping(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/ping",
                                        timeout=2) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError, http.client.HTTPException):
            return False  # (not up yet; or someone else's server: the broker's bind fails)

    def stats(self, topic: str = TOPIC) -> dict:
        with urllib.request.urlopen(
                f"http://127.0.0.1:{self.http}/stats?format=json&topic={topic}",
                timeout=10) as r:
            return json.loads(r.read())

    def rss(self) -> dict[str, int]:
        """Resident memory of every broker process, by name (bytes)."""
        import psutil

        out = {}
        for p in self.processes():
            if p.pid:
                with contextlib.suppress(psutil.Error):
                    out[p.name] = psutil.Process(p.pid).memory_info().rss
        return out

    def processes(self) -> list:
        """The runtime's processes (name, role, pid), from its control channel."""
        from actors.broker.options import run_dir_for
        from actors.runtime.control import ControlClient

        with ControlClient(run_dir_for(str(self.data)), timeout=5) as ctl:
            return ctl.ps()

    def client_actors(self) -> list[str]:
        """The names of the live client actors (one per client connection)."""
        from actors.broker.options import run_dir_for
        from actors.runtime.control import ControlClient

        with ControlClient(run_dir_for(str(self.data)), timeout=5) as ctl:
            return [a.name for a in ctl.actors() if a.name.startswith("client:")]

    def kill_all(self) -> None:
        """SIGKILL the supervisor and every child (power-cut style for the processes)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill_all()

    def ctl_crash(self, name: str) -> None:
        from actors.broker.options import run_dir_for

        subprocess.run([sys.executable, "-m", "actors.ctl", "--run-dir",
                        run_dir_for(str(self.data)), "crash", name],
                       capture_output=True, timeout=30, check=False)


class Sockets:
    """The workload's live TCP connections, so the nemesis can cut one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[socket.socket] = set()

    def add(self, sock: socket.socket) -> None:
        with self._lock:
            self._live.add(sock)

    def discard(self, sock: socket.socket) -> None:
        with self._lock:
            self._live.discard(sock)

    def cut_one(self, rng: random.Random) -> bool:
        """Shut one connection down both ways (as a network drop looks to both ends)."""
        with self._lock:
            live = sorted(self._live, key=lambda s: s.fileno())
        if not live:
            return False
        with contextlib.suppress(OSError):
            rng.choice(live).shutdown(socket.SHUT_RDWR)
        return True


SOCKETS = Sockets()


@dataclass
class Ledger:
    """What the workload did, for the checker (shared by threads, under a lock)."""

    attempted: set[bytes] = field(default_factory=set)
    acknowledged: set[bytes] = field(default_factory=set)
    delivered: dict[bytes, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)  # publish -> delivery, seconds
    lock: threading.Lock = field(default_factory=threading.Lock)

    def attempt(self, body: bytes) -> None:
        with self.lock:
            self.attempted.add(body)

    def ack(self, body: bytes) -> None:
        with self.lock:
            self.acknowledged.add(body)

    def deliver(self, body: bytes, published_ns: int = 0) -> None:
        with self.lock:
            self.delivered[body] = self.delivered.get(body, 0) + 1
            if published_ns and len(self.latencies) < 1_000_000:
                self.latencies.append(time.time() - published_ns / 1e9)

    def delivery_count(self) -> int:
        """Deliveries so far, duplicates included (grows with every message received)."""
        with self.lock:
            return sum(self.delivered.values())

    def check(self) -> dict[str, int]:
        with self.lock:
            delivered = set(self.delivered)
            return {
                "attempted": len(self.attempted),
                "acknowledged": len(self.acknowledged),
                "delivered": len(delivered),
                "lost": len(self.acknowledged - delivered),
                "unexpected": len(delivered - self.attempted),
                "duplicated": sum(n - 1 for n in self.delivered.values() if n > 1),
            }

    def lost(self) -> list[bytes]:
        with self.lock:
            return sorted(self.acknowledged - set(self.delivered))[:10]


def zmq_producer(broker: BrokerProcess, ledger: Ledger, stop: threading.Event, tag: str,
                 rng: random.Random) -> None:
    n = 0
    while not stop.is_set():
        try:
            with Producer(broker.zmq_endpoint, timeout=3, max_attempts=1) as p:
                while not stop.is_set():
                    bodies = [b"%s-%d" % (tag.encode(), n + i) for i in range(rng.randint(1, 5))]
                    n += len(bodies)
                    for body in bodies:
                        ledger.attempt(body)
                    if rng.random() < 0.1:
                        p.deferred_publish(TOPIC, rng.randint(100, 1500), bodies[0])
                        bodies = bodies[:1]
                    else:
                        p.multi_publish(TOPIC, bodies)
                    for body in bodies:
                        ledger.ack(body)
                    time.sleep(rng.random() * 0.01)
        except Exception:
            stop.wait(0.2)


def tcp_producer(broker: BrokerProcess, ledger: Ledger, stop: threading.Event, tag: str,
                 rng: random.Random) -> None:
    n = 0
    while not stop.is_set():
        try:
            sock = socket.create_connection(("127.0.0.1", broker.tcp), timeout=3)
        except OSError:
            stop.wait(0.2)
            continue
        codec = ClientConnection()
        SOCKETS.add(sock)
        try:
            while not stop.is_set():
                body = b"%s-%d" % (tag.encode(), n)
                n += 1
                ledger.attempt(body)
                sock.sendall(codec.send(pc.Pub(TOPIC, body)))
                answer = None
                while answer is None:
                    event = codec.next_event()
                    if event is NEED_DATA:
                        data = sock.recv(65536)
                        codec.receive_data(data)
                        if not data:
                            raise ConnectionError("closed")
                    elif isinstance(event, pc.Heartbeat):
                        sock.sendall(codec.send(pc.Nop()))
                    else:
                        answer = event
                if getattr(answer, "data", None) == b"OK":
                    ledger.ack(body)
                time.sleep(rng.random() * 0.01)
        except (OSError, ConnectionError):
            stop.wait(0.2)
        finally:
            SOCKETS.discard(sock)
            sock.close()


def http_producer(broker: BrokerProcess, ledger: Ledger, stop: threading.Event, tag: str,
                  rng: random.Random) -> None:
    n = 0
    while not stop.is_set():
        body = b"%s-%d" % (tag.encode(), n)
        n += 1
        ledger.attempt(body)
        req = urllib.request.Request(f"http://127.0.0.1:{broker.http}/pub?topic={TOPIC}",
                                     data=body, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=3) as r:  # noqa: S310 - loopback
                if r.status == 200:
                    ledger.ack(body)
        except (OSError, urllib.error.URLError):
            stop.wait(0.2)
        time.sleep(rng.random() * 0.02)


def drain(broker: BrokerProcess, ledger: Ledger, timeout: float) -> dict[str, int]:
    """After the load stops: bring the broker up if it is down, then wait until the
    channel is empty (nothing queued, in flight or deferred) and nothing acknowledged is
    missing, or `timeout` passes.  The checker's counts, plus ``undrained``: what the
    channel still held at the end (so a slow drain is not mistaken for a loss)."""
    if not broker.ping():
        broker.kill_all()
        broker.start()
    deadline = time.monotonic() + timeout
    undrained = -1
    while True:
        try:
            ch = broker.stats()["topics"][0]["channels"][0]
            undrained = ch["depth"] + ch["in_flight_count"] + ch["deferred_count"]
        except (OSError, IndexError, KeyError, ValueError):
            undrained = -1  # the broker is restarting
        if (undrained == 0 and ledger.check()["lost"] == 0) or time.monotonic() > deadline:
            return {**ledger.check(), "undrained": undrained}
        time.sleep(0.5)  # poll interval of the two conditions above


def consumer(broker: BrokerProcess, ledger: Ledger, rng: random.Random,
             draining: threading.Event | None = None) -> Consumer:
    """A consumer that REQs about 5 % of first deliveries and sits on 0.2 % past the timeout
    (until `draining` is set: then it just takes everything, to empty the channel)."""
    lock = threading.Lock()

    def handle(m: Message) -> None:
        if draining is not None and draining.is_set():
            ledger.deliver(m.body, m.timestamp)
            return
        with lock:
            roll = rng.random()
        if m.attempts == 1 and roll < 0.05:
            m.requeue(rng.randint(0, 300))
            return
        if m.attempts == 1 and roll < 0.052:
            time.sleep(3.5)  # past the 3 s message timeout: it is redelivered
        ledger.deliver(m.body, m.timestamp)

    return Consumer(TOPIC, CHANNEL, handle, broker.zmq_endpoint, max_in_flight=200,
                    heartbeat_interval_ms=5000, msg_timeout_ms=3000, max_backoff=0.5).start()


NEED_DATA = __import__("transport.nsq.codec", fromlist=["NEED_DATA"]).NEED_DATA
