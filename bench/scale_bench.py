"""Scale: connections, topics and churn on one broker, side by side with nsqd, in one run.

Usage::

    python -m bench.scale_bench [--cases conns,topics,churn] [--connections 10000]
        [--zmq-sessions 1000] [--topics 10000] [--churn-seconds 300] [--churn-rate 100]
        [--brokers nsqd,ours] [--nsqd ../shared/nsq/bin/nsqd]

Cases, each against a fresh broker with an empty data directory:

* ``conns``: ``--connections`` NSQ TCP connections (magic, ``SUB`` to an
  ephemeral channel, heartbeats answered with ``NOP``) plus, on ours,
  ``--zmq-sessions`` ZeroMQ sessions (``SUB`` likewise), held for
  ``--hold`` seconds; every connection must be answered ``OK`` and still be
  open at the end.
* ``topics``: ``--topics`` topics over HTTP, each with two channels and one
  message (``/topic/create``, ``/channel/create`` x2, ``/pub``); then a
  ``kill -9`` of the broker's whole process tree and a restart, timed until
  ``/stats`` shows every topic again; on ours, once more with every queue's
  clean-close record removed first (as after a kill while every queue was
  being written: each one is then recovered by scanning its files).
* ``churn``: ``--churn-rate`` consumers a second connect, ``SUB`` to a fresh
  ephemeral channel and leave, for ``--churn-seconds``; threads, fds and RSS
  are sampled every 10 s and the first minute is compared with the last.

For each broker it prints, per process (nsqd has one; ours a supervisor, a
gateway and workers), threads, fds and RSS, idle and under load, the memory
the load added, and the connect / create rates.  The machine's limit of
20,000 fds per process binds this bench's own side too: it raises its soft
limit to the hard one and needs about 1.3 fds per connection.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import resource
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import psutil
import zmq

from transport.nsq.client_codec import ClientConnection, ErrorFrame, Response
from transport.nsq.codec import CLOSED, NEED_DATA
from transport.protocol.commands import Heartbeat, Nop, Sub
from transport.protocol.validation import ProtocolError

NSQD_DEFAULT = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "nsq", "bin", "nsqd")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- brokers ------------------------------------------------------------------------------


@dataclass
class Broker:
    """A broker under test: how to start it, its ports, its process tree."""

    kind: str
    data: str
    tcp: int = field(default_factory=free_port)
    http: int = field(default_factory=free_port)
    zmq: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    nsqd: str = NSQD_DEFAULT
    extra: list[str] = field(default_factory=list)  # flags both brokers take (--mem-queue-size=0)
    tree: str | None = None  # ours from another checkout (PYTHONPATH), to compare two builds

    def command(self) -> list[str]:
        if self.kind == "nsqd":
            return [self.nsqd, f"--data-path={self.data}",
                    f"--tcp-address=127.0.0.1:{self.tcp}",
                    f"--http-address=127.0.0.1:{self.http}", "--log-level=warn", *self.extra]
        return [sys.executable, "-m", "actors.broker", "--data-path", self.data,
                "--tcp-address", f"127.0.0.1:{self.tcp}",
                "--http-address", f"127.0.0.1:{self.http}",
                "--zmq-address", f"tcp://127.0.0.1:{self.zmq}", "--log-level", "warn",
                *self.extra]

    def start(self, timeout: float = 60.0) -> float:
        """Start and wait for /ping; returns the seconds it took.  A broker that exits
        because one of its ports was taken meanwhile (`free_port` only finds a port that
        was free: a client's ephemeral port may take it before the broker binds it)
        is started again on new ports, up to three times; any other exit is an error
        that quotes the end of its stderr."""
        os.makedirs(self.data, exist_ok=True)
        started = time.monotonic()
        env = None if self.tree is None else {**os.environ, "PYTHONPATH": self.tree}
        for attempt in range(3):
            # (the child inherits the raised fd limit)
            with open(os.path.join(self.data, "stderr.log"), "wb") as err:
                self.proc = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL,
                                             env=env, cwd=self.tree, stderr=err)
            while time.monotonic() - started < timeout and self.proc.poll() is None:
                with contextlib.suppress(OSError, http.client.HTTPException):
                    if self.get("/ping").startswith(b"OK"):
                        return time.monotonic() - started
                time.sleep(0.05)
            if self.proc.poll() is None:
                break
            with open(os.path.join(self.data, "stderr.log"), "rb") as err:
                tail = err.read()[-2000:].decode(errors="replace")
            if "in use" not in tail or attempt == 2:
                msg = f"{self.kind} exited with {self.proc.returncode} while starting: {tail}"
                raise RuntimeError(msg)
            self.tcp, self.http, self.zmq = free_port(), free_port(), free_port()
        msg = f"{self.kind} did not answer /ping within {timeout}s"
        raise RuntimeError(msg)

    def get(self, path: str, body: bytes | None = None) -> bytes:
        conn = http.client.HTTPConnection("127.0.0.1", self.http, timeout=30)
        try:
            conn.request("POST" if body is not None else "GET", path, body=body)
            return conn.getresponse().read()
        finally:
            conn.close()

    def processes(self) -> list[psutil.Process]:
        assert self.proc is not None
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def process_names(self) -> dict[int, str]:
        """pid -> node name (gateway, worker-0, ...) from our runtime's control socket."""
        if self.kind != "ours":
            return {}
        from actors.broker.options import run_dir_for
        from actors.runtime import ControlClient

        try:
            with contextlib.closing(ControlClient(run_dir_for(self.data), timeout=2)) as c:
                return {p["pid"]: p["name"] for p in c.call("ps") if p["pid"]}
        except Exception:
            return {}

    def kill9(self) -> None:
        procs = self.processes()
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        psutil.wait_procs(procs, timeout=10)
        assert self.proc is not None
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        procs = self.processes()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.kill9()
        psutil.wait_procs(procs, timeout=10)


def _raise_nofile() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


@dataclass
class Snapshot:
    """Threads, fds and RSS of each process of a broker."""

    rows: list[tuple[str, int, int, int]]  # (name, threads, fds, rss bytes)

    @classmethod
    def take(cls, broker: Broker) -> Snapshot:
        names = broker.process_names()
        rows = []
        for p in broker.processes():
            with contextlib.suppress(psutil.NoSuchProcess):
                name = names.get(p.pid) or _role(p)
                rows.append((name, p.num_threads(), p.num_fds(), p.memory_info().rss))
        return cls(rows)

    @property
    def rss(self) -> int:
        return sum(r[3] for r in self.rows)

    @property
    def max_threads(self) -> int:
        return max(r[1] for r in self.rows)

    def line(self) -> str:
        return "; ".join(f"{n}: {t} thr, {f} fds, {rss / 2**20:.0f} MiB"
                         for n, t, f, rss in self.rows)


def _role(p: psutil.Process) -> str:
    cmd = " ".join(p.cmdline())
    if "nsqd" in cmd and "actors" not in cmd:
        return "nsqd"
    if "resource_tracker" in cmd:
        return "tracker"
    if "forkserver" in cmd:  # (nodes are forks of the fork server: the same cmdline)
        parent = p.parent()
        return f"child-{p.pid}" if parent and "forkserver" in " ".join(parent.cmdline()) \
            else "forkserver"
    return "supervisor"


# -- NSQ TCP consumers ---------------------------------------------------------------------


class TcpConsumers:
    """Many idle NSQ V2 consumers on one selector: SUB, then answer heartbeats.

    Each connection is driven by our sans-IO client codec (``ClientConnection``).
    """

    def __init__(self, port: int) -> None:
        self.port = port
        self.sel = selectors.DefaultSelector()
        self.codecs: dict[socket.socket, ClientConnection] = {}
        self.subscribed: set[socket.socket] = set()
        self.closed = 0
        self.errors: list[str] = []
        self.heartbeats = 0

    def open(self, topic: str, channel: str) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        codec = ClientConnection()
        s.sendall(codec.send(Sub(topic, channel)))
        s.setblocking(False)
        self.codecs[s] = codec
        self.sel.register(s, selectors.EVENT_READ)
        return s

    def close(self, s: socket.socket) -> None:
        self.sel.unregister(s)
        self.codecs.pop(s, None)
        self.subscribed.discard(s)
        s.close()

    def pump(self, seconds: float) -> None:
        """Read frames for ``seconds``: count OKs, answer heartbeats, note errors and EOFs."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            for key, _ in self.sel.select(min(left, 0.2)):
                s: socket.socket = key.fileobj  # type: ignore[assignment]
                try:
                    data = s.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as e:
                    self.errors.append(str(e))
                    data = b""
                codec = self.codecs[s]
                codec.receive_data(data)
                self._events(s, codec)

    def _events(self, s: socket.socket, codec: ClientConnection) -> None:
        while (event := codec.next_event()) is not NEED_DATA:
            if event is CLOSED or isinstance(event, ProtocolError):
                self.closed += 1
                self.close(s)
                return
            if isinstance(event, Response) and event.data == b"OK":
                self.subscribed.add(s)
            elif isinstance(event, Heartbeat):
                self.heartbeats += 1
                with contextlib.suppress(OSError):
                    s.sendall(codec.send(Nop()))
            elif isinstance(event, ErrorFrame):
                self.errors.append(f"{event.error.code} {event.error}")

    def shutdown(self) -> None:
        for s in list(self.codecs):
            self.close(s)
        self.sel.close()


class ZmqConsumers:
    """ZeroMQ sessions (DEALER) that SUB and answer heartbeats (our broker only)."""

    def __init__(self, port: int) -> None:
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.MAX_SOCKETS, 65536)
        self.port = port
        self.socks: list[zmq.Socket[bytes]] = []
        self.subscribed: set[int] = set()
        self.errors: list[str] = []

    def open(self, topic: str, channel: str) -> None:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{self.port}")
        s.send_multipart([b"SUB", topic.encode(), channel.encode()])
        self.socks.append(s)

    def pump(self, seconds: float) -> None:
        poller = zmq.Poller()
        for s in self.socks:
            poller.register(s, zmq.POLLIN)
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            for s, _ in poller.poll(int(min(left, 0.2) * 1000)):
                frames = s.recv_multipart()
                if frames[0] == b"OK":
                    self.subscribed.add(id(s))
                elif frames[0] == b"HEARTBEAT":
                    s.send(b"NOP")
                elif frames[0] == b"ERROR":
                    self.errors.append(b" ".join(frames[1:]).decode(errors="replace"))

    def shutdown(self) -> None:
        for s in self.socks:
            s.close(0)
        self.ctx.term()


# -- cases --------------------------------------------------------------------------------


def case_conns(broker: Broker, args: argparse.Namespace, out: Callable[[str], None]) -> None:
    broker.start()
    time.sleep(1)
    idle = Snapshot.take(broker)
    out(f"  idle: {idle.line()}")
    consumers = TcpConsumers(broker.tcp)
    started = time.monotonic()
    try:
        for i in range(args.connections):
            consumers.open("scale", f"c{i}#ephemeral")
            if i % 500 == 499:
                consumers.pump(0.01)
        consumers.pump(2)
        elapsed = time.monotonic() - started
        zmq_consumers = None
        if broker.kind == "ours" and args.zmq_sessions:
            zmq_consumers = ZmqConsumers(broker.zmq)
            for i in range(args.zmq_sessions):
                zmq_consumers.open("scale", f"z{i}#ephemeral")
            zmq_consumers.pump(3)
        consumers.pump(args.hold)
        if zmq_consumers is not None:
            zmq_consumers.pump(1)
        loaded = Snapshot.take(broker)
        n = args.connections
        added = loaded.rss - idle.rss
        out(f"  {n} TCP SUBs: {len(consumers.subscribed)} answered OK, "
            f"{consumers.closed} closed by the broker, {len(consumers.errors)} errors "
            f"{consumers.errors[:3]}, {consumers.heartbeats} heartbeats answered; "
            f"connect rate {n / elapsed:.0f}/s")
        if zmq_consumers is not None:
            out(f"  {args.zmq_sessions} ZeroMQ SUBs: {len(zmq_consumers.subscribed)} answered OK, "
                f"{len(zmq_consumers.errors)} errors {zmq_consumers.errors[:3]}")
        out(f"  loaded: {loaded.line()}")
        conns = n + (args.zmq_sessions if zmq_consumers is not None else 0)
        out(f"  RESULT conns {broker.kind}: max threads/process {loaded.max_threads}, "
            f"RSS added {added / 2**20:.1f} MiB = {added / max(1, conns) / 1024:.1f} KiB "
            f"per connection")
        if zmq_consumers is not None:
            zmq_consumers.shutdown()
    finally:
        consumers.shutdown()
        broker.stop()


def case_topics(broker: Broker, args: argparse.Namespace, out: Callable[[str], None]) -> None:
    broker.start()
    time.sleep(1)
    idle = Snapshot.take(broker)
    out(f"  idle: {idle.line()}")
    conn = http.client.HTTPConnection("127.0.0.1", broker.http, timeout=60)
    failures: list[str] = []

    def post(path: str, body: bytes = b"") -> None:
        conn.request("POST", path, body=body)
        response = conn.getresponse()
        data = response.read()
        if response.status != 200 and len(failures) < 5:
            failures.append(f"{path} -> {response.status} {data[:100]!r}")

    started = time.monotonic()
    try:
        for i in range(args.topics):
            t = f"t{i}"
            post(f"/topic/create?topic={t}")
            post(f"/channel/create?topic={t}&channel=a")
            post(f"/channel/create?topic={t}&channel=b")
            post(f"/pub?topic={t}", b"x" * 100)
            if i % 1000 == 999:
                out(f"    {i + 1} topics, {time.monotonic() - started:.1f}s, "
                    f"{Snapshot.take(broker).line()}")
        elapsed = time.monotonic() - started
        loaded = Snapshot.take(broker)
        added = loaded.rss - idle.rss
        out(f"  {args.topics} topics x 2 channels + 1 message: {elapsed:.1f}s "
            f"({args.topics / elapsed:.0f} topics/s), failures {failures}")
        out(f"  loaded: {loaded.line()}")
        out(f"  RESULT topics {broker.kind}: max threads/process {loaded.max_threads}, "
            f"RSS added {added / 2**20:.0f} MiB = {added / args.topics / 1024:.0f} KiB per topic, "
            f"{args.topics / elapsed:.0f} topics/s")
        conn.close()
        _restart(broker, args, out, "kill -9")
        if broker.kind == "ours":
            # The worst case: a kill while every queue was being written, so none has
            # the record of a clean close and each one is recovered by scanning.
            broker.kill9()
            stripped = _strip_close_records(broker.data)
            _restart(broker, args, out, f"kill -9, {stripped} queues unclean", kill=False)
    finally:
        broker.stop()


def _restart(broker: Broker, args: argparse.Namespace, out: Callable[[str], None], how: str,
             *, kill: bool = True) -> None:
    """Kill -9 (unless done), restart, and time until /stats shows every topic again."""
    if kill:
        broker.kill9()
    started = time.monotonic()
    back = broker.start()
    count = 0
    while time.monotonic() - started < 120:
        stats = json.loads(broker.get("/stats?format=json"))
        topics = stats.get("topics", stats.get("data", {}).get("topics", []))
        count = sum(1 for t in topics if len(t.get("channels", [])) == 2)
        if count >= args.topics:
            break
        time.sleep(0.2)
    out(f"  RESULT restart {broker.kind} ({how}): /ping after {back:.1f}s, "
        f"{count}/{args.topics} topics with both channels after "
        f"{time.monotonic() - started:.1f}s")


def _strip_close_records(data: str) -> int:
    """Remove the clean-close record from every queue's metadata; returns how many."""
    n = 0
    for name in os.listdir(data):
        if name.endswith(".diskqueue.meta.dat"):
            path = os.path.join(data, name)
            with open(path) as f:
                meta = json.load(f)
            if meta.pop("closed", None) is not None:
                with open(path, "w") as f:
                    json.dump(meta, f)
                n += 1
    return n


def case_churn(broker: Broker, args: argparse.Namespace, out: Callable[[str], None]) -> None:
    broker.start()
    consumers = TcpConsumers(broker.tcp)
    samples: list[tuple[float, Snapshot]] = []
    started = time.monotonic()
    next_sample = started + 10
    opened: list[tuple[float, socket.socket]] = []
    i = 0
    try:
        while (now := time.monotonic()) - started < args.churn_seconds:
            due = int((now - started) * args.churn_rate)
            while i < due:
                opened.append((now, consumers.open("churn", f"c{i}#ephemeral")))
                i += 1
            while opened and now - opened[0][0] > 1.0:
                consumers.close(opened.pop(0)[1])
            consumers.pump(0.02)
            if now >= next_sample:
                samples.append((now - started, Snapshot.take(broker)))
                next_sample += 10
        first = [s for t, s in samples if t <= 60]
        last = [s for t, s in samples if t >= args.churn_seconds - 60]
        for t, s in samples:
            out(f"    {t:5.0f}s  {s.line()}")

        def avg(group: list[Snapshot], f: Callable[[Snapshot], float]) -> float:
            return sum(f(s) for s in group) / max(1, len(group))

        for label, f in (("threads", lambda s: sum(r[1] for r in s.rows)),
                         ("fds", lambda s: sum(r[2] for r in s.rows)),
                         ("RSS MiB", lambda s: s.rss / 2**20)):
            a, b = avg(first, f), avg(last, f)
            out(f"  RESULT churn {broker.kind} {label}: first minute {a:.0f}, last minute "
                f"{b:.0f} ({(b - a) / a * 100 if a else 0:+.1f} %)")
        out(f"  {i} consumers in {args.churn_seconds}s, {len(consumers.errors)} errors "
            f"{consumers.errors[:3]}")
    finally:
        consumers.shutdown()
        broker.stop()


CASES = {"conns": case_conns, "topics": case_topics, "churn": case_churn}


@contextlib.contextmanager
def data_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="scale")
    try:
        yield os.path.join(path, "data")
    finally:
        shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cases", default="conns,topics,churn")
    ap.add_argument("--brokers", default="nsqd,ours")
    ap.add_argument("--nsqd", default=NSQD_DEFAULT if os.path.exists(NSQD_DEFAULT)
                    else shutil.which("nsqd") or "nsqd")
    ap.add_argument("--connections", type=int, default=10_000)
    ap.add_argument("--zmq-sessions", type=int, default=1_000)
    ap.add_argument("--hold", type=float, default=35.0,
                    help="seconds to hold the connections (past one heartbeat interval)")
    ap.add_argument("--topics", type=int, default=10_000)
    ap.add_argument("--churn-seconds", type=int, default=300)
    ap.add_argument("--churn-rate", type=int, default=100)
    args = ap.parse_args(argv)
    _raise_nofile()
    out = print
    out(f"scale_bench: {os.cpu_count()} CPUs, fd limit "
        f"{resource.getrlimit(resource.RLIMIT_NOFILE)}, {time.strftime('%Y-%m-%d %H:%M')}")
    for case in args.cases.split(","):
        for kind in args.brokers.split(","):
            out(f"== {case} / {kind}")
            with data_dir() as data:
                broker = Broker(kind, data, nsqd=args.nsqd)
                try:
                    CASES[case](broker, args, out)
                except Exception as e:  # report and go on with the next case
                    out(f"  FAILED: {type(e).__name__}: {e}")
                    broker.stop()
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
