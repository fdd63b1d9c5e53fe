"""Broker benchmark: publish-only, consume-only and concurrent runs over each protocol.

    python -m bench.broker_bench [--messages 200000] [--size 100] [--batch 200]
                                 [--producers 1] [--consumers 1] [--protocols tcp,zmq,http]
                                 [--mem-queue-size 10000] [--workers 2]

Starts a broker on a temporary data dir (ports chosen by the OS), then for
each protocol runs, in this order and each on a fresh topic:

* **publish**: N producer threads publish ``--messages`` in MPUBs of
  ``--batch`` (HTTP: ``/mpub?binary=true``), waiting for every OK;
* **consume**: M consumers drain that topic (RDY 2500, FIN per message);
* **pub+sub**: producers and consumers at once on a fresh topic (the
  consumers in processes of their own, as nsq's bench_reader is a separate
  program from bench_writer).

It prints msgs/s and MB/s for each, and for the consumers the p50/p99 of
publish-to-delivery latency (the message's NSQ timestamp, set when the
topic accepted it, to its arrival at the consumer).  NSQ TCP figures are
also given as a ratio to nsqd's (ANCHORS.md), raw and normalised by the
machine's speed factor (``bench.calibrate``, measured before and after the
run), since nsqd's figures come from another machine.  NSQ TCP uses our
sans-IO codec to publish and a lean frame parser to consume (the broker is
what is measured; nsqd's figures come from Go clients); ZeroMQ uses
``transport.client``.  Compare with nsqd's figures in
``../shared/ANCHORS.md`` (measured with NSQ's own Go bench clients).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import shutil
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import psutil

from actors.broker import Broker
from actors.broker.options import BrokerOptions
from bench import calibrate
from transport.client import Consumer, Producer
from transport.nsq.client_codec import ClientConnection
from transport.nsq.codec import CLOSED, NEED_DATA
from transport.protocol import commands as pc


class TcpClient:
    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.codec = ClientConnection()

    def send(self, command: pc.Command) -> None:
        self.sock.sendall(self.codec.send(command))

    def events(self) -> list:
        out = []
        while True:
            e = self.codec.next_event()
            if e is NEED_DATA:
                if out:
                    return out
                self.codec.receive_data(self.sock.recv(1 << 20))
                continue
            if e is CLOSED:
                raise ConnectionError("broker closed the connection")
            out.append(e)


def publish_tcp(address: str, topic: str, bodies: list[bytes], batch: int, *,
                client: TcpClient | None = None) -> None:
    c = client or TcpClient(address)
    pending = 0
    for i in range(0, len(bodies), batch):
        c.send(pc.Mpub(topic, tuple(bodies[i : i + batch])))
        pending += 1
        while pending > 8:  # keep a few MPUBs in flight, like nsq's bench_writer
            pending -= sum(1 for e in c.events() if not isinstance(e, pc.Heartbeat))
    while pending > 0:
        pending -= sum(1 for e in c.events() if not isinstance(e, pc.Heartbeat))
    c.sock.close()


def consume_tcp(address: str, topic: str, channel: str, count: int, lat: list[float], *,
                client: TcpClient | None = None) -> None:
    """A lean NSQ V2 consumer: frames parsed in place, one write of FINs per read.

    The broker is what is measured, so the client does as little per message
    as a Go client would (our full codec is exercised by the tests).  `client`:
    a connection already set up (e.g. upgraded to TLS by bench.security_bench).
    """
    c = client or TcpClient(address)
    c.send(pc.Sub(topic, channel))
    c.send(pc.Rdy(2500))
    sock = c.sock
    head = struct.Struct(">ii")
    ts_of = struct.Struct(">q")
    buf = b""
    got = 0
    while got < count:
        chunk = sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("broker closed the connection")
        buf += chunk
        pos, fins, now = 0, [], time.time()
        while len(buf) - pos >= 8:
            size, kind = head.unpack_from(buf, pos)
            end = pos + 4 + size
            if end > len(buf):
                break
            if kind == 2:  # message: [8B ts][2B attempts][16B id][body]
                lat.append(now - ts_of.unpack_from(buf, pos + 8)[0] / 1e9)
                fins.append(b"FIN " + buf[pos + 18 : pos + 34] + b"\n")
            elif buf[pos + 8 : end] == b"_heartbeat_":
                fins.append(b"NOP\n")
            pos = end
        buf = buf[pos:]
        got += sum(1 for f in fins if f[0] == 70)
        if fins:
            sock.sendall(b"".join(fins))
    sock.close()


def publish_zmq(endpoint: str, topic: str, bodies: list[bytes], batch: int) -> None:
    with Producer(endpoint, timeout=30) as p:
        for i in range(0, len(bodies), batch * 8):
            p.publish_batch(topic, bodies[i : i + batch * 8], batch)


def consume_zmq(endpoint: str, topic: str, channel: str, count: int, lat: list[float]) -> None:
    done = threading.Event()
    got = [0]

    def handler(m) -> None:
        lat.append(time.time() - m.timestamp / 1e9)
        got[0] += 1
        if got[0] >= count:
            done.set()

    with Consumer(topic, channel, handler, endpoint, max_in_flight=2500):
        done.wait(600)


def publish_http(port: int, topic: str, bodies: list[bytes], batch: int) -> None:
    for i in range(0, len(bodies), batch):
        chunk = bodies[i : i + batch]
        data = struct.pack(">I", len(chunk)) + b"".join(struct.pack(">I", len(b)) + b
                                                        for b in chunk)
        req = urllib.request.Request(f"http://127.0.0.1:{port}/mpub?topic={topic}&binary=true",
                                     data=data, method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:  # noqa: S310 - loopback
            r.read()


def _consumer_process(proto: str, address: str, topic: str, count: int, conn: Any) -> None:
    """A consumer in its own process: says when it is subscribed, returns latencies and
    the CPU seconds it used from then on."""
    lat: list[float] = []
    conn.send("ready")
    started = sum(os.times()[:2])
    if proto == "zmq":
        consume_zmq(address, topic, "bench", count, lat)
    else:
        consume_tcp(address, topic, "bench", count, lat)
    step = max(1, len(lat) // 20_000)  # a sample is enough for the quantiles
    conn.send((lat[::step], sum(os.times()[:2]) - started))


class CpuMeter:
    """CPU seconds (user + system) that each named process, and this one, used since creation."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.procs["bench process (publisher, supervisor)"] = psutil.Process()
        self.start = {name: self._cpu(p) for name, p in self.procs.items()}

    @staticmethod
    def _cpu(p: psutil.Process) -> float:
        t = p.cpu_times()
        return t.user + t.system

    def used(self) -> dict[str, float]:
        return {name: self._cpu(p) - self.start[name] for name, p in self.procs.items()}


class Progress:
    """On a terminal, the phase that runs and its elapsed time on stderr (cleared after);
    elsewhere (a log, CI) nothing."""

    def __init__(self, phase: str) -> None:
        self.phase = phase
        self.done = threading.Event()
        self.thread: threading.Thread | None = None

    def __enter__(self) -> Progress:
        if sys.stderr.isatty():
            self.thread = threading.Thread(target=self._show, daemon=True)
            self.thread.start()
        return self

    def _show(self) -> None:
        start = time.monotonic()
        while not self.done.wait(0.5):
            sys.stderr.write(f"\r  {self.phase}... {time.monotonic() - start:.0f}s ")
            sys.stderr.flush()

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        if self.thread is not None:
            self.thread.join()
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def run_threads(n: int, target: Callable[[int], None]) -> float:
    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t


# nsqd 1.3 on the anchor machine, NSQ's Go bench clients, 100-byte messages (ANCHORS.md)
NSQD = {"publish": 177_000, "consume (after)": 167_000,
        "pub+sub, publish": 228_000, "pub+sub, consume": 227_000}


def report(name: str, count: int, size: int, seconds: float, lat: list[float] | None = None, *,
           speed: float | None = None) -> None:
    rate = count / seconds
    line = f"{name:28s} {rate:>12,.0f} msgs/s {count * size / seconds / 1e6:>8.1f} MB/s"
    proto, _, case = name.partition(": ")
    nsqd = NSQD.get(case) if proto == "tcp" and size == 100 else None
    if nsqd:
        line += f"   {rate / nsqd:5.2f}x nsqd"
        if speed:
            line += f" ({rate / speed / nsqd:4.2f}x normalised)"
    if lat:
        q = statistics.quantiles(lat, n=100)
        line += f"   latency p50 {q[49] * 1000:8.1f} ms  p99 {q[98] * 1000:8.1f} ms"
    print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--batch", type=int, default=200)
    ap.add_argument("--producers", type=int, default=1)
    ap.add_argument("--consumers", type=int, default=1)
    ap.add_argument("--protocols", default="tcp,zmq,http")
    ap.add_argument("--mem-queue-size", type=int, default=10000)
    ap.add_argument("--sync-every", type=int, default=2500)
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()
    data = tempfile.mkdtemp(prefix="bb", dir="/tmp")
    print(f"machine: {platform.processor() or platform.machine()} {_cpu_model()}, "
          f"{os.cpu_count()} cores, Python {platform.python_version()}; "
          f"load {os.getloadavg()}")
    before = calibrate.measure()
    print(before.describe() if before else "calibration skipped: pip install -e '.[bench]'")
    speed = before.factor if before else None
    print(f"{a.messages} messages of {a.size} B, MPUB batch {a.batch}, {a.producers} producer(s),"
          f" {a.consumers} consumer(s), mem-queue-size {a.mem_queue_size}, sync-every"
          f" {a.sync_every}, {a.workers} workers")
    opts = BrokerOptions(data_path=data, workers=a.workers, http_address="127.0.0.1:0",
                         tcp_address="127.0.0.1:0", zmq_address="tcp://127.0.0.1:0",
                         mem_queue_size=a.mem_queue_size, sync_every=a.sync_every,
                         log_level="warn")
    body = b"x" * a.size
    per_producer = a.messages // a.producers
    total = per_producer * a.producers
    bodies = [body] * per_producer
    per_consumer = total // a.consumers
    with Broker(opts) as b:
        for proto in a.protocols.split(","):
            def pub(i: int, topic: str, proto: str = proto) -> None:
                if proto == "tcp":
                    publish_tcp(b.tcp_address, topic, bodies, a.batch)
                elif proto == "zmq":
                    publish_zmq(b.zmq_endpoint, topic, bodies, a.batch)
                else:
                    publish_http(b.http_port, topic, bodies, a.batch)

            def sub(i: int, topic: str, lat: list[float], proto: str = proto) -> None:
                if proto == "zmq":
                    consume_zmq(b.zmq_endpoint, topic, "bench", per_consumer, lat)
                else:
                    consume_tcp(b.tcp_address, topic, "bench", per_consumer, lat)

            topic = f"bench_{proto}"
            b.topic_command(topic, "hello")
            b.topic_command(topic, "create_channel", "bench")
            with Progress(f"{proto}: publishing {total:,}"):
                t = run_threads(a.producers, lambda i, topic=topic: pub(i, topic))
            report(f"{proto}: publish", total, a.size, t, speed=speed)
            lat: list[float] = []
            with Progress(f"{proto}: consuming {total:,}"):
                t = run_threads(a.consumers,
                                lambda i, topic=topic, lat=lat: sub(i, topic, lat))
            report(f"{proto}: consume (after)", total, a.size, t, speed=speed)
            topic2 = f"bench2_{proto}"
            b.topic_command(topic2, "hello")
            b.topic_command(topic2, "create_channel", "bench")
            # Consumers in processes of their own (as nsq's bench_reader is a separate
            # program), so they do not share the publisher's GIL.
            ctx = multiprocessing.get_context("spawn")
            pipes, procs = [], []
            address = b.zmq_endpoint if proto == "zmq" else b.tcp_address
            for _ in range(a.consumers):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_consumer_process,
                                   args=(proto, address, topic2, per_consumer, child))
                proc.start()
                pipes.append(parent)
                procs.append(proc)
            for parent in pipes:
                parent.recv()  # subscribed
            cpu = CpuMeter({r.name: r.pid for r in b.supervisor.ps()
                            if r.pid and r.role != "supervisor"})
            start = time.perf_counter()
            with Progress(f"{proto}: publishing and consuming {total:,}"):
                tp = run_threads(a.producers, lambda i, topic2=topic2: pub(i, topic2))
                results = [parent.recv() for parent in pipes]
            t = time.perf_counter() - start
            used = cpu.used()
            lat2 = [x for sample, _ in results for x in sample]
            used.update({f"consumer-{i}": sec for i, (_, sec) in enumerate(results)})
            for proc in procs:
                proc.join()
            report(f"{proto}: pub+sub, publish", total, a.size, tp, speed=speed)
            report(f"{proto}: pub+sub, consume", total, a.size, t, lat2, speed=speed)
            print(f"{proto}: pub+sub CPU per message: " + ", ".join(
                f"{name} {sec / total * 1e6:.2f} us" for name, sec in used.items())
                + f"; total {sum(used.values()) / total * 1e6:.2f} us", flush=True)
    shutil.rmtree(data, ignore_errors=True)
    after = calibrate.measure()
    if before and after:
        print(after.describe().replace("calibration:", "calibration after:"))


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), "")
    except OSError:
        return ""


if __name__ == "__main__":
    main()
