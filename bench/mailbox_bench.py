"""Cross-process mailbox benchmark: the actor runtime next to bare pyzmq, in one run.

Usage::

    python bench/mailbox_bench.py [--messages 2000000] [--unbatched 200000] [--asks 5000]

Cases (100-byte payloads, sender in this process, receiver in another):

* runtime, unbatched: ``tell(name, Payload)`` - one envelope per message;
* runtime, batched: ``tell_many(name, [100 x Payload])`` - one envelope per 100;
* runtime, ask: round trip of ``ask`` to an actor on a worker (p50 / p99);
* bare pyzmq PUSH/PULL between two processes: one 100-byte frame per
  message, and 100 messages packed per frame (the ceiling for batching),
  and a bare round trip to an echo process (the floor for ``ask``).

Throughput is measured from the first send until the receiver has *handled*
the last message (the runtime case ends with an ``ask`` barrier, which the
actor handles after every earlier message; the bare case ends when the
receiving process has read the last frame).  The machine is noisy: compare
the ratios printed at the end, and take the median of several runs.
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import zmq

from actors.runtime import Actor, Supervisor, message

BODY = b"x" * 100
BATCH = 100


@message
@dataclass(frozen=True)
class Payload:
    """One benchmark message."""

    seq: int
    """Sequence number."""
    body: bytes
    """100-byte payload."""


@message
@dataclass(frozen=True)
class Count:
    """Ask for the number of Payloads handled so far."""


class Sink(Actor):
    """Counts payloads and checks their order."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.count = 0
        self.next_seq = 0

    def on_receive(self, msg: Any) -> Any:
        if type(msg) is Payload:
            self.count += 1
            return None
        if type(msg) is Count:
            return self.count
        return None


def run_runtime(messages: int, unbatched: int, asks: int) -> dict[str, float]:
    run_dir = tempfile.mkdtemp(prefix="mbench", dir="/tmp")
    results: dict[str, float] = {}
    try:
        with Supervisor(run_dir, {"sink": Sink}, workers=1) as rt:
            name = "sink:a"
            rt.ask(name, Count(), timeout=10)  # create the actor, warm up

            payloads = [Payload(i, BODY) for i in range(unbatched)]
            start = time.perf_counter()
            for p in payloads:
                rt.tell(name, p)
            rt.ask(name, Count(), timeout=60)
            results["runtime unbatched"] = unbatched / (time.perf_counter() - start)

            batch = [Payload(i, BODY) for i in range(BATCH)]
            start = time.perf_counter()
            for _ in range(messages // BATCH):
                rt.tell_many(name, batch)
            rt.ask(name, Count(), timeout=120)
            elapsed = time.perf_counter() - start
            results["runtime batched x100"] = messages // BATCH * BATCH / elapsed

            latencies = []
            for _ in range(asks):
                t0 = time.perf_counter()
                rt.ask(name, Count(), timeout=10)
                latencies.append(time.perf_counter() - t0)
            latencies.sort()
            results["ask p50 us"] = statistics.median(latencies) * 1e6
            results["ask p99 us"] = latencies[int(len(latencies) * 0.99)] * 1e6
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return results


def _bare_receiver(address: str, frames: int, conn: Any) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    conn.send("ready")
    for _ in range(frames):
        sock.recv()
    conn.send("done")
    sock.close()
    ctx.term()


def run_bare(messages: int, per_frame: int) -> float:
    """Bare PUSH/PULL across two processes; returns messages per second."""
    run_dir = tempfile.mkdtemp(prefix="zbench", dir="/tmp")
    address = f"ipc://{run_dir}/bare.sock"
    frames = messages // per_frame
    frame = BODY * per_frame
    mp = multiprocessing.get_context("spawn")
    parent, child = mp.Pipe()
    proc = mp.Process(target=_bare_receiver, args=(address, frames, child))
    proc.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        assert parent.recv() == "ready"
        sock.connect(address)
        start = time.perf_counter()
        for _ in range(frames):
            sock.send(frame)
        assert parent.recv() == "done"
        elapsed = time.perf_counter() - start
    finally:
        sock.close()
        ctx.term()
        proc.join(10)
        shutil.rmtree(run_dir, ignore_errors=True)
    return frames * per_frame / elapsed


def _bare_echo(inbound: str, outbound: str, conn: Any) -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind(inbound)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(outbound)
    conn.send("ready")
    while (frame := pull.recv()) != b"quit":
        push.send(frame)
    pull.close()
    push.close()
    ctx.term()


def run_bare_round_trip(count: int) -> float:
    """Median round trip of one frame to an echo process and back (PUSH/PULL pairs), in us."""
    run_dir = tempfile.mkdtemp(prefix="zbench", dir="/tmp")
    there, back = f"ipc://{run_dir}/there.sock", f"ipc://{run_dir}/back.sock"
    mp = multiprocessing.get_context("spawn")
    parent, child = mp.Pipe()
    proc = mp.Process(target=_bare_echo, args=(there, back, child))
    proc.start()
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    for sock in (push, pull):
        sock.setsockopt(zmq.LINGER, 0)
    try:
        pull.bind(back)
        assert parent.recv() == "ready"
        push.connect(there)
        latencies = []
        for _ in range(count):
            t0 = time.perf_counter()
            push.send(BODY)
            pull.recv()
            latencies.append(time.perf_counter() - t0)
        push.send(b"quit")
    finally:
        push.close()
        pull.close()
        ctx.term()
        proc.join(10)
        shutil.rmtree(run_dir, ignore_errors=True)
    return statistics.median(latencies) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--messages", type=int, default=2_000_000, help="batched messages")
    p.add_argument("--unbatched", type=int, default=200_000, help="unbatched messages")
    p.add_argument("--asks", type=int, default=5_000)
    args = p.parse_args()

    bare_single = run_bare(args.unbatched, 1)
    bare_batched = run_bare(args.messages, BATCH)
    bare_rtt = run_bare_round_trip(args.asks)
    rt = run_runtime(args.messages, args.unbatched, args.asks)

    rows = [
        ("bare zmq, 1 msg/frame", f"{bare_single:,.0f} msgs/s", ""),
        ("bare zmq, 100 msgs/frame", f"{bare_batched:,.0f} msgs/s", ""),
        (
            "runtime tell (unbatched)",
            f"{rt['runtime unbatched']:,.0f} msgs/s",
            f"{rt['runtime unbatched'] / bare_single:.2f} x bare 1/frame",
        ),
        (
            "runtime tell_many (x100)",
            f"{rt['runtime batched x100']:,.0f} msgs/s",
            f"{rt['runtime batched x100'] / bare_batched:.2f} x bare 100/frame",
        ),
        ("bare zmq round trip p50", f"{bare_rtt:.0f} us", ""),
        (
            "runtime ask p50",
            f"{rt['ask p50 us']:.0f} us",
            f"{rt['ask p50 us'] / bare_rtt:.2f} x bare",
        ),
        ("runtime ask p99", f"{rt['ask p99 us']:.0f} us", ""),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'case'.ljust(width)}  {'result':>18}  ratio")
    for case, value, ratio in rows:
        print(f"{case.ljust(width)}  {value:>18}  {ratio}")


if __name__ == "__main__":
    main()
