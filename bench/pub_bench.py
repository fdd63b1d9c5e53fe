"""Single-message PUBs from many producers with many in flight, beside nsqd (#17).

    python -m bench.pub_bench [--producers 8] [--window 32] [--messages 5000] [--size 100]
                              [--rounds 3] [--brokers nsqd,ours] [--durable]

Each producer is a process of its own with one NSQ TCP connection that
keeps ``--window`` ``PUB`` commands (not MPUB) unanswered: it writes as
many as the window has room for, then reads the OKs that came back, and so
on until ``--messages`` were answered.  The rate is all producers' messages
over the wall time from a common start to the last OK.

``--durable`` runs both brokers with ``--mem-queue-size=0 --sync-every=1``:
every message goes through the disk queue and is fsynced before its OK (ours
answers a publish only once it is on disk; nsqd syncs but answers from
memory).  #17's target: >= 20,000 durable PUBs/s acknowledged after fsync
from 8 producers, which needs the broker to share one write and one fsync
among the PUBs of many connections (group commit).  Every round starts each
broker afresh on an empty data directory with one channel on the topic; the
brokers alternate.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import struct
import time
from dataclasses import dataclass
from typing import Any

from bench.nsq_clients_bench import BIN_DEFAULT, running
from bench.scale_bench import Broker

DURABLE = ["--mem-queue-size=0", "--sync-every=1"]


@dataclass(frozen=True)
class Load:
    port: int
    topic: str
    count: int  # PUBs per producer
    window: int  # unanswered PUBs per producer
    size: int


def producer(load: Load, go: Any, done: Any) -> None:
    port, topic, count, window, size = load.port, load.topic, load.count, load.window, load.size
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(b"  V2")
    body = b"x" * size
    command = b"PUB " + topic.encode() + b"\n" + struct.pack(">I", len(body)) + body
    head = struct.Struct(">ii")
    sent = answered = 0
    buf = b""
    go.wait()
    while answered < count:
        room = min(window - (sent - answered), count - sent)
        if room > 0:
            sock.sendall(command * room)
            sent += room
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("the broker closed a producer's connection")
        buf += chunk
        pos = 0
        while len(buf) - pos >= 8:
            length, kind = head.unpack_from(buf, pos)
            if len(buf) - pos < 4 + length:
                break
            data = buf[pos + 8 : pos + 4 + length]
            pos += 4 + length
            if kind == 1:
                raise RuntimeError(f"PUB refused: {data!r}")
            if data == b"_heartbeat_":
                sock.sendall(b"NOP\n")
            else:
                answered += 1
        buf = buf[pos:]
    sock.close()
    done.put(time.monotonic())


def run(broker: Broker, producers: int, count: int, window: int, size: int) -> float:
    topic = "pubs"
    broker.get(f"/topic/create?topic={topic}", b"")
    broker.get(f"/channel/create?topic={topic}&channel=ch", b"")
    ctx = multiprocessing.get_context("spawn")
    go, done = ctx.Event(), ctx.Queue()
    load = Load(broker.tcp, topic, count, window, size)
    procs = [ctx.Process(target=producer, args=(load, go, done)) for _ in range(producers)]
    for p in procs:
        p.start()
    time.sleep(1.0)  # (connected and waiting)
    started = time.monotonic()
    go.set()
    ends = [done.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return producers * count / (max(ends) - started)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--producers", type=int, default=8)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--messages", type=int, default=5000, help="per producer")
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--brokers", default="nsqd,ours")
    ap.add_argument("--durable", action="store_true",
                    help="--mem-queue-size=0 --sync-every=1 on both brokers")
    ap.add_argument("--bin", default=BIN_DEFAULT, help="where nsqd is")
    args = ap.parse_args(argv)
    extra = DURABLE if args.durable else []
    brokers = args.brokers.split(",")
    print(f"pub_bench: {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"{args.producers} producers x {args.window} PUBs in flight, {args.messages} each, "
          f"{args.size} B, flags {extra}")
    rates: dict[str, list[float]] = {b: [] for b in brokers}
    for rnd in range(args.rounds):
        for name in (brokers if rnd % 2 == 0 else brokers[::-1]):
            count = args.messages
            if name == "nsqd" and args.durable:
                count = max(50, count // 20)  # (nsqd fsyncs each PUB: a few hundred a second)
            with running(name, extra, args.bin) as broker:
                rate = run(broker, args.producers, count, args.window, args.size)
            rates[name].append(rate)
            print(f"  round {rnd} {name:<10} {rate:>10,.0f} PUB/s")
    first = brokers[0]
    ratios = {b: statistics.median(r / f for r, f in zip(rates[b], rates[first], strict=True))
              for b in brokers}
    print("== median PUB/s, and the median of per-round ratios to the first broker listed")
    print("  " + " | ".join(f"{b} {statistics.median(rates[b]):,.0f} ({ratios[b]:.2f}x)"
                            for b in brokers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
