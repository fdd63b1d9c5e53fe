"""What tags (#21) cost a publish, beside the same publishes untagged.

    python -m bench.tags_bench [--messages 200000] [--size 100] [--rounds 3]

One broker (``python -m actors.broker``, two workers, defaults otherwise); for
each round and case, in turn, a fresh topic with two channels and one ZeroMQ
``Producer`` publishing ``--messages`` bodies in MPUBs of 200 (pipelined,
``publish_batch``), timed until the last is acknowledged.  Cases:

* ``untagged``: MPUBs, channels without filters (a broker that has no tags);
* ``tagged``: TMPUBs, half the batches tagged ``a`` and half ``b``, channels
  without filters (each takes every message: what a tag costs in itself);
* ``filtered``: the same TMPUBs, one channel taking ``a`` and one ``b`` (each
  takes half: the topic sorts every batch).

It prints each round and the medians with their ratios to ``untagged``.
Whether tags cost a broker that does not use them is measured beside the build
before them (``python -m bench.nsq_clients_bench --brokers ours@<tree>,ours``:
NSQ's clients cannot tag).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator

from bench.startstop_bench import _ping, _port
from transport.client import Producer

CASES = ("untagged", "tagged", "filtered")


def _post(http: int, path: str) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{http}{path}", method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:  # noqa: S310 - loopback http
        r.read()


def one(case: str, topic: str, http: int, zmq: str, bodies: list[bytes]) -> float:
    _post(http, f"/topic/create?topic={topic}")
    for channel, tag in (("c1", "a"), ("c2", "b")):
        tags = f"&tags={tag}" if case == "filtered" else ""
        _post(http, f"/channel/create?topic={topic}&channel={channel}{tags}")
    half = len(bodies) // 2
    with Producer(zmq) as p:
        started = time.perf_counter()
        if case == "untagged":
            p.publish_batch(topic, bodies, 200)
        else:
            p.publish_batch(topic, bodies[:half], 200, tag="a")
            p.publish_batch(topic, bodies[half:], 200, tag="b")
        took = time.perf_counter() - started
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/stats?format=json&topic={topic}",
                                timeout=10) as r:
        depths = {c["channel_name"]: c["depth"] for c in json.load(r)["topics"][0]["channels"]}
    want = {"c1": half, "c2": len(bodies) - half} if case == "filtered" else \
        {"c1": len(bodies), "c2": len(bodies)}
    assert depths == want, (case, depths, want)
    _post(http, f"/topic/delete?topic={topic}")
    return len(bodies) / took


@contextlib.contextmanager
def launched_broker(*flags: str, data: str = "") -> Iterator[tuple[int, str]]:
    """``python -m actors.broker`` on free loopback ports and a fresh data directory
    (``<data>/d``; `data` is made and removed here if not given), plus `flags`, until
    the block ends; yields its HTTP port and ZeroMQ endpoint."""
    own = not data
    data = data or tempfile.mkdtemp(prefix="bench")
    http, zmq = _port(), f"tcp://127.0.0.1:{_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "actors.broker", f"--data-path={data}/d",
                             f"--http-address=127.0.0.1:{http}",
                             f"--tcp-address=127.0.0.1:{_port()}", f"--zmq-address={zmq}",
                             "--log-level=warn", *flags])
    try:
        while not _ping(http):
            time.sleep(0.01)
        yield http, zmq
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        if own:
            shutil.rmtree(data, ignore_errors=True)


def rounds(name: str, cases: tuple[str, ...], args: argparse.Namespace,
           one_round: Callable[[str, str, list[bytes]], float]) -> None:
    """Run `one_round(case, topic, bodies)` for every case, `args.rounds` times (the order
    reversed every other round), then print the medians and their ratios to the first."""
    print(f"{name}: {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"{args.messages} messages of {args.size} B, {args.rounds} rounds", flush=True)
    bodies = [os.urandom(args.size // 2).hex().encode()[:args.size]
              for _ in range(args.messages)]
    rates: dict[str, list[float]] = {c: [] for c in cases}
    for rnd in range(args.rounds):
        for case in cases if rnd % 2 == 0 else cases[::-1]:
            rate = one_round(case, f"{name}{rnd}{case}", bodies)
            rates[case].append(rate)
            print(f"  round {rnd} {case:<9} {rate:10,.0f} msgs/s", flush=True)
    base = statistics.median(rates[cases[0]])
    print("== medians: " + " | ".join(
        f"{c} {statistics.median(rates[c]):,.0f} msgs/s "
        f"({statistics.median(rates[c]) / base:.2f}x)" for c in cases))


def arguments(doc: str | None, argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__, argv)
    with launched_broker() as (http, zmq):
        rounds("tags", CASES, args,
               lambda case, topic, bodies: one(case, topic, http, zmq, bodies))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
