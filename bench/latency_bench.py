"""Publish-to-delivery latency beside nsqd, both brokers at the same paced rate (#17).

    python -m bench.latency_bench [--rate auto|N] [--seconds 10] [--size 100] [--tick-ms 5]
                                  [--rounds 3] [--brokers nsqd,ours] [--mem-queue-size N]

A *paced* publisher (one NSQ TCP connection, in a process of its own) sends
an MPUB every ``--tick-ms`` carrying ``rate x tick`` messages on a fixed
schedule: it never waits for an OK before the next MPUB (it counts them as
they come), so a slow broker shows as latency, not as a publisher that
slowed down to suit it.  Each body starts with its send time
(``time.time_ns()``).  A consumer in another process (``SUB``, ``RDY 2500``,
a ``FIN`` per message, as NSQ's ``bench_reader``) records arrival minus send
time for every message after the first second (warm-up); the run's
p50/p90/p99/p99.9/max are printed per broker, and the medians over the
rounds with ours as a ratio to nsqd's.

``--rate auto`` (the default) first measures ours' PUB+SUB capacity with
NSQ's own ``bench_writer``/``bench_reader`` (as ``bench.nsq_clients_bench``
does) and runs both brokers at half of it: #17 asks for latency at 50 % of
the broker's capacity, beside nsqd's at the same rate.  Every round starts
each broker afresh on an empty data directory; the brokers alternate.
Publisher and consumer are lean Python (socket, struct), the same for both
brokers, so their cost is part of both figures alike.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import select
import socket
import statistics
import struct
import time
from dataclasses import dataclass
from typing import Any

from bench.nsq_clients_bench import BIN_DEFAULT, run_case, running
from bench.scale_bench import Broker

HEAD = struct.Struct(">ii")
WARMUP_S = 1.0
QUANTILES = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99), ("p99.9", 0.999))


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(b"  V2")
    return sock


def _frames(buf: bytes) -> tuple[list[tuple[int, int, int]], bytes]:
    """Complete frames in ``buf`` as (type, start of data, end), and the rest."""
    out, pos = [], 0
    while len(buf) - pos >= 8:
        size, kind = HEAD.unpack_from(buf, pos)
        end = pos + 4 + size
        if end > len(buf):
            break
        out.append((kind, pos + 8, end))
        pos = end
    return out, buf[pos:]


@dataclass(frozen=True)
class Pace:
    port: int
    topic: str
    rate: int  # messages a second
    seconds: float
    size: int
    tick: float  # seconds between MPUBs
    start_at: float  # time.time() of the first MPUB


def publisher(pace: Pace, result: Any) -> None:
    """MPUB ``rate * tick`` bodies every ``tick`` seconds until ``seconds`` passed."""
    port, topic, rate, seconds = pace.port, pace.topic, pace.rate, pace.seconds
    size, tick, start_at = pace.size, pace.tick, pace.start_at
    sock = _connect(port)
    sock.setblocking(False)
    per_tick = max(1, round(rate * tick))
    pad = b"x" * max(0, size - 8)
    ticks = int(seconds / tick)
    sent = answered = late = 0
    buf = b""
    time.sleep(max(0.0, start_at - time.time()))
    t0 = time.monotonic()
    for i in range(ticks):
        due = t0 + i * tick
        now = time.monotonic()
        if due > now:
            time.sleep(due - now)
        elif now - due > tick:
            late += 1  # the publisher itself fell behind its schedule
        stamp = struct.pack(">q", time.time_ns()) + pad
        body = struct.pack(">I", per_tick) + (struct.pack(">I", len(stamp)) + stamp) * per_tick
        data = b"MPUB " + topic.encode() + b"\n" + struct.pack(">I", len(body)) + body
        sock.setblocking(True)
        sock.sendall(data)
        sock.setblocking(False)
        sent += per_tick
        try:
            while True:
                chunk = sock.recv(1 << 16)
                if not chunk:
                    raise ConnectionError("broker closed the publisher's connection")
                buf += chunk
        except BlockingIOError:
            pass
        frames, buf = _frames(buf)
        for kind, start, end in frames:
            if kind == 1:
                raise RuntimeError(f"publish refused: {buf[start:end]!r}")
            if buf[start:end] == b"_heartbeat_":
                sock.setblocking(True)
                sock.sendall(b"NOP\n")
                sock.setblocking(False)
            else:
                answered += 1
    elapsed = time.monotonic() - t0
    sock.close()
    result.send((sent, sent / elapsed, late))


def consumer(pace: Pace, expect_by: float, ready: Any, result: Any) -> None:
    """SUB, RDY 2500, FIN each message; send back the latencies (ms) after the warm-up."""
    port, topic = pace.port, pace.topic
    warm_until_ns = int((pace.start_at + WARMUP_S) * 1e9)
    sock = _connect(port)
    sock.sendall(b"SUB " + topic.encode() + b" ch\nRDY 2500\n")
    ready.send("subscribed")
    lat: list[float] = []
    got = 0
    buf = b""
    last = time.time()
    while time.time() < expect_by:
        if not select.select([sock], [], [], 0.2)[0]:
            if time.time() > max(pace.start_at + pace.seconds, last) + 1.0:
                break  # the publisher is done and nothing came for a second
            continue
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        now = time.time_ns()
        last = now / 1e9
        data = buf + chunk
        frames, buf = _frames(data)
        out = []
        for kind, start, end in frames:
            if kind == 2:  # [8B ts][2B attempts][16B id][body: 8B send time, ...]
                sent = struct.unpack_from(">q", data, start + 26)[0]
                if sent >= warm_until_ns:
                    lat.append((now - sent) / 1e6)
                out.append(b"FIN " + data[start + 10 : start + 26] + b"\n")
                got += 1
            elif data[start:end] == b"_heartbeat_":
                out.append(b"NOP\n")
        if out:
            sock.sendall(b"".join(out))
    sock.close()
    result.send((got, lat))


def run(broker: Broker, rate: int, seconds: float, size: int, tick: float) -> dict[str, float]:
    topic = f"lat{int(time.time() * 1000) % 10**9}"
    broker.get(f"/topic/create?topic={topic}", b"")
    broker.get(f"/channel/create?topic={topic}&channel=ch", b"")
    ctx = multiprocessing.get_context("spawn")
    start_at = time.time() + 1.0
    drain = 10.0  # after the publisher's last MPUB, the consumer waits this long at most
    pub_r, pub_w = ctx.Pipe(duplex=False)
    con_r, con_w = ctx.Pipe(duplex=False)
    rdy_r, rdy_w = ctx.Pipe(duplex=False)
    pace = Pace(broker.tcp, topic, rate, seconds, size, tick, start_at)
    cons = ctx.Process(target=consumer, args=(pace, start_at + seconds + drain, rdy_w, con_w))
    cons.start()
    rdy_r.recv()
    pub = ctx.Process(target=publisher, args=(pace, pub_w))
    pub.start()
    sent, achieved, late = pub_r.recv()
    pub.join()
    got, lat = con_r.recv()
    cons.join()
    if not lat:
        raise RuntimeError(f"{broker.kind}: no message arrived after the warm-up")
    lat.sort()
    row = {"sent": sent, "rate": achieved, "late_ticks": late, "received": got,
           "max": lat[-1]}
    for name, q in QUANTILES:
        row[name] = lat[min(len(lat) - 1, int(q * len(lat)))]
    return row


def capacity(bin_dir: str, extra: list[str], size: int) -> float:
    """Ours' PUB+SUB rate with NSQ's bench clients (the lower side), on a fresh broker."""
    with running("ours", extra, bin_dir) as broker:
        rate, *_ = run_case(bin_dir, broker, "PUB+SUB", "cap", size=size, batch=200,
                            runfor=5.0)
        return rate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rate", default="auto",
                    help="messages/s, or auto: half of ours' PUB+SUB capacity")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--tick-ms", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--brokers", default="nsqd,ours")
    ap.add_argument("--mem-queue-size", type=int, default=None)
    ap.add_argument("--bin", default=BIN_DEFAULT, help="where nsqd and the bench tools are")
    args = ap.parse_args(argv)
    if args.size < 8:
        ap.error("--size must be at least 8 (the send time)")
    extra = [] if args.mem_queue_size is None else [f"--mem-queue-size={args.mem_queue_size}"]
    if args.rate == "auto":
        cap = capacity(args.bin, extra, args.size)
        rate = int(cap / 2)
        print(f"ours' PUB+SUB capacity {cap:,.0f} msgs/s: both brokers run at {rate:,}")
    else:
        rate = int(args.rate)
    brokers = args.brokers.split(",")
    print(f"latency_bench: {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"rate {rate:,} msgs/s in MPUBs every {args.tick_ms} ms, {args.size} B, "
          f"{args.seconds} s a run (the first {WARMUP_S} s not counted), flags {extra}")
    rows: dict[str, list[dict[str, float]]] = {b: [] for b in brokers}
    for rnd in range(args.rounds):
        for name in (brokers if rnd % 2 == 0 else brokers[::-1]):
            with running(name, extra, args.bin) as broker:
                row = run(broker, rate, args.seconds, args.size, args.tick_ms / 1000)
            rows[name].append(row)
            print(f"  round {rnd} {name:<8} published {row['rate']:>9,.0f}/s "
                  f"(late ticks {row['late_ticks']}), received {row['received']:,}; ms: "
                  + " ".join(f"{q} {row[q]:.2f}" for q, _ in (*QUANTILES, ("max", 1))))
    print("== medians over the rounds (ms), and the ratio to the first broker listed")
    first = brokers[0]
    for q, _ in (*QUANTILES, ("max", 1)):
        meds = {b: statistics.median(r[q] for r in rows[b]) for b in brokers}
        print(f"  {q:<6} " + " | ".join(
            f"{b} {meds[b]:.2f} ({meds[b] / meds[first]:.2f}x)" for b in brokers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
