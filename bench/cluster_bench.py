"""The cluster: registration latency, lookups under load, consumer failover -- ours beside
NSQ's own daemons (``../shared/nsq/bin``) in the same run.

Usage::

    python -m bench.cluster_bench [--cases register,lookup,failover] [--topics 50]
        [--peers 100] [--peer-topics 1000] [--seconds 5] [--connections 8]
        [--nsq-bin ../shared/nsq/bin]

Cases:

* ``register``: a broker registered with a lookup daemon creates ``--topics``
  topics over HTTP one at a time; for each, the time from the broker's answer
  to the topic's first appearance in the daemon's ``/lookup`` (polled every
  millisecond).  Ours (our broker, our lookupd) and NSQ's (nsqd, nsqlookupd).
* ``lookup``: ``--peers`` simulated brokers (V1 connections speaking as nsqd
  does) register ``--peer-topics`` topics each with one channel (pipelined),
  timed; then ``wrk`` (Debian's) sends ``GET /lookup?topic=<one of them>``
  over ``--connections`` keep-alive connections for ``--seconds``: requests/s
  and latency.  Ours beside nsqlookupd, the same load.  The CPU the daemon
  used over the run is printed too (the target is 5,000 requests/s on one
  core).
* ``failover``: three of our brokers, each with a backlog, and one consumer
  that finds them through our lookupd; its rate over the time before one
  broker is killed -9 (1.5 s) and over the seconds after (per 0.25 s window),
  and the time until it is back to 90 % of the rate before.  Five trials.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil

from tests.chaos.harness import BrokerProcess
from transport.client import Consumer, Producer, lookup
from transport.nsq.lookup_codec import Identify, LookupClientConnection, Register

ROOT = Path(__file__).resolve().parents[1]
NSQ_BIN = ROOT.parent / "shared" / "nsq" / "bin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(check: Callable[[], object], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("timed out")
        time.sleep(0.01)


def call(address: str, method: str, path: str) -> tuple[int, bytes]:
    host, _, port = address.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(method, path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def up(address: str) -> bool:
    try:
        return call(address, "GET", "/ping")[0] == 200
    except OSError:
        return False


@contextlib.contextmanager
def lookupd(kind: str, nsq_bin: Path) -> Iterator[tuple[str, str, int]]:
    """A lookup daemon, ours or NSQ's: ``(tcp address, http address, pid)``."""
    tcp, web = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    if kind == "ours":
        cmd = [sys.executable, "-m", "actors.lookupd", f"--tcp-address={tcp}",
               f"--http-address={web}", "--broadcast-address=127.0.0.1", "--log-level=warn"]
    else:
        cmd = [str(nsq_bin / "nsqlookupd"), f"--tcp-address={tcp}", f"--http-address={web}",
               "--broadcast-address=127.0.0.1", "--log-level=warn"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=ROOT)
    try:
        wait_until(lambda: up(web))
        yield tcp, web, proc.pid
    finally:
        proc.terminate()
        proc.wait(30)


@contextlib.contextmanager
def broker(kind: str, nsq_bin: Path, lookupd_tcp: str, work: Path) -> Iterator[str]:
    """A broker registered with `lookupd_tcp`: its HTTP address."""
    web = f"127.0.0.1:{free_port()}"
    data = work / f"{kind}-{free_port()}"
    data.mkdir()
    common = [f"--data-path={data}", f"--http-address={web}", "--tcp-address=127.0.0.1:0",
              "--broadcast-address=127.0.0.1", f"--lookupd-tcp-address={lookupd_tcp}",
              "--log-level=warn"]
    cmd = [sys.executable, "-m", "actors.broker", *common, "--zmq-address=tcp://127.0.0.1:0",
           "--workers=1"] if kind == "ours" else [str(nsq_bin / "nsqd"), *common]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=ROOT, start_new_session=True)
    try:
        wait_until(lambda: up(web))
        yield web
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


# ------------------------------------------------------------------------- register


def case_register(nsq_bin: Path, topics: int, work: Path) -> None:
    print(f"register: {topics} topics created one at a time; ms from the broker's answer "
          "to the topic in /lookup")
    for kind in ("ours", "nsq"):
        with lookupd(kind, nsq_bin) as (tcp, web, _), broker(kind, nsq_bin, tcp, work) as b:
            wait_until(lambda web=web: json.loads(call(web, "GET", "/nodes")[1])["producers"])
            took = []
            for n in range(topics):
                topic = f"reg-{n}"
                assert call(b, "POST", f"/topic/create?topic={topic}")[0] == 200
                start = time.perf_counter()
                while call(web, "GET", f"/lookup?topic={topic}")[0] != 200 or not json.loads(
                        call(web, "GET", f"/lookup?topic={topic}")[1])["producers"]:
                    if time.perf_counter() - start > 10:
                        raise TimeoutError(topic)
                    time.sleep(0.001)
                took.append((time.perf_counter() - start) * 1000)
            print(f"  {kind:5} p50 {statistics.median(took):6.1f} ms  p99 {pct(took, 0.99):6.1f}"
                  f" ms  max {max(took):6.1f} ms")


# --------------------------------------------------------------------------- lookup


def register_peers(tcp: str, peers: int, topics: int) -> float:
    """`peers` V1 connections, each IDENTIFY then `topics` REGISTER t c (pipelined);
    seconds until every answer came back.  The sockets stay open (returned)."""
    host, _, port = tcp.rpartition(":")
    socks = []
    start = time.perf_counter()
    for p in range(peers):
        sock = socket.create_connection((host, int(port)))
        codec = LookupClientConnection()
        commands = [Identify(f"peer{p}", 10000 + p, 20000 + p, "1.3.0", f"peer{p}"),
                    *(Register(f"topic-{t}", "c") for t in range(topics))]
        sock.sendall(b"".join(codec.send(c) for c in commands))
        socks.append((sock, codec, len(commands)))
    for sock, codec, count in socks:
        got = 0
        while got < count:
            event = codec.next_event()
            if hasattr(event, "data"):
                got += 1
                continue
            codec.receive_data(sock.recv(1 << 20))
    took = time.perf_counter() - start
    _PEERS.extend(s for s, _, _ in socks)
    return took


_PEERS: list[socket.socket] = []


def case_lookup(nsq_bin: Path, peers: int, topics: int, seconds: float, conns: int) -> None:
    wrk = shutil.which("wrk")
    print(f"lookup: {peers} brokers x {topics} topics registered, then GET /lookup for "
          f"{seconds:g} s over {conns} connections (wrk)")
    for kind in ("ours", "nsq"):
        with lookupd(kind, nsq_bin) as (tcp, web, pid):
            took = register_peers(tcp, peers, topics)
            found = lookup(web, "topic-7")
            assert len(found) == peers, len(found)
            daemon = psutil.Process(pid)
            procs = [daemon, *daemon.children(recursive=True)]
            cpu0 = sum(sum(p.cpu_times()[:2]) for p in procs)
            if wrk is None:
                print("  (wrk is not installed: apt-get install wrk)")
                return
            out = subprocess.run([wrk, "-t", "2", "-c", str(conns), "-d", f"{seconds:g}s",
                                  "--latency", f"http://{web}/lookup?topic=topic-7"],
                                 capture_output=True, text=True, check=True).stdout
            cpu = sum(sum(p.cpu_times()[:2]) for p in procs) - cpu0
            rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
            p50 = re.search(r"50%\s+(\S+)", out).group(1)
            p99 = re.search(r"99%\s+(\S+)", out).group(1)
            print(f"  {kind:5} registered {peers * topics:,} in {took:5.2f} s; /lookup "
                  f"{rate:8,.0f} req/s, p50 {p50}, p99 {p99}; daemon CPU {cpu / seconds:.2f} "
                  f"cores ({rate / max(cpu / seconds, 1e-9):,.0f} req/s per core)")
            for s in _PEERS:
                s.close()
            _PEERS.clear()


# ------------------------------------------------------------------------- failover


def case_failover(nsq_bin: Path, work: Path, trials: int = 5) -> None:
    print("failover: 3 brokers with a backlog, one consumer through our lookupd; "
          "one broker killed -9")
    with lookupd("ours", nsq_bin) as (tcp, web, _):
        kept = [failover_trial(trial, tcp, web, work) for trial in range(trials)]
    print(f"  median rate kept: {statistics.median(kept):.0%} (trials {min(kept):.0%}"
          f"-{max(kept):.0%})")


def failover_trial(trial: int, tcp: str, web: str, work: Path) -> float:
    """One trial; the rate after the kill as a fraction of the rate before."""
    brokers = [BrokerProcess(work / f"f{trial}-{i}", work / f"f{trial}-{i}.log",
                             ("--workers", "1", "--broadcast-address", "127.0.0.1",
                              "--lookupd-tcp-address", tcp)) for i in range(3)]
    for b in brokers:
        b.start()
        with Producer(b.zmq_endpoint) as p:
            p.publish_batch("fo", [b"x" * 100] * 300_000, 500)  # > 3 s after the kill
    wait_until(lambda: len(lookup(web, "fo")) == 3)
    stamps: list[float] = []
    consumer = Consumer("fo", "c", lambda m: stamps.append(time.perf_counter()),
                        lookupd_http_addresses=[web], lookupd_poll_interval=1.0,
                        max_in_flight=600).start()
    try:
        wait_until(lambda: len(stamps) > 20_000, timeout=60)
        time.sleep(2.0)  # the seconds before the kill: the steady rate, not the start
        killed = time.perf_counter()
        brokers[1].kill_all()
        time.sleep(3)
    finally:
        consumer.close()
        for b in brokers:
            with contextlib.suppress(Exception):
                b.kill_all()
    before = sum(1 for s in stamps if killed - 1.5 <= s < killed) / 1.5
    windows = [sum(1 for s in stamps if killed + i * 0.25 <= s < killed + (i + 1) * 0.25)
               / 0.25 for i in range(12)]
    back = next((i * 0.25 for i, r in enumerate(windows) if r >= 0.9 * before), None)
    after = statistics.mean(windows[4:])
    print(f"  trial {trial + 1}: {before:8,.0f} msg/s before, {after:8,.0f} msg/s "
          f"after ({after / before:.0%}); back to 90 % within "
          f"{'-' if back is None else f'{back + 0.25:.2f} s'}; per 0.25 s: "
          + " ".join(f"{r / 1000:.0f}k" for r in windows[:8]))
    return after / before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="register,lookup,failover")
    ap.add_argument("--topics", type=int, default=50)
    ap.add_argument("--peers", type=int, default=100)
    ap.add_argument("--peer-topics", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--nsq-bin", type=Path, default=NSQ_BIN)
    a = ap.parse_args()
    cases = a.cases.split(",")
    print(f"cluster_bench on {os.cpu_count()} cores; NSQ from {a.nsq_bin}")
    with tempfile.TemporaryDirectory(prefix="cluster-bench") as tmp:
        work = Path(tmp)
        if "register" in cases:
            case_register(a.nsq_bin, a.topics, work)
        if "lookup" in cases:
            case_lookup(a.nsq_bin, a.peers, a.peer_topics, a.seconds, a.connections)
        if "failover" in cases:
            case_failover(a.nsq_bin, work)


if __name__ == "__main__":
    main()
