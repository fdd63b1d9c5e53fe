"""Soak: producers and consumers against a broker under the chaos nemesis, for a set time.

    python -m bench.soak [--seconds 120 | --faults N] [--seed 1] [--no-nemesis]
                         [--plain-consumers] [--disk-faults] [--interval 2 4]

Runs the chaos workload of ``tests/chaos`` (ZeroMQ, NSQ TCP and HTTP
producers publishing unique ids, two consumers, a broker with
``--mem-queue-size=0``) and, every 5 s, prints the acknowledged and delivered
throughput of the interval and the resident memory, threads and fds of every
broker process.  At the end it drains the channel and prints the checker's
counts (lost must be 0), the publish-to-delivery p50/p99, the peak memory
per process, threads and fds first and last, and, for every time the broker
came back (`/ping` answering again after a kill), how long the consumers
took to receive again.  Memory, threads and fds should stay flat while the
backlog grows: they are bounded by the buffers and the chunk cache, not by
the number of messages stored.  ``--plain-consumers`` makes the consumers
take every message at once (no REQs, no handler sleeping past the timeout),
so the comeback times measure the broker and the client, not the workload.

``--disk-faults`` puts the data directory on the power-cut rig
(``tests/power``: a FUSE file system that drops, at each unmount, what POSIX
lets a power cut drop, and answers ENOSPC or EIO on demand), runs the broker
with ``--sync-every 1`` so that an acknowledgement means fsynced, and adds
three faults of the disk to the nemesis, each as likely as each of its own:

* ``power_cut``: every broker process killed -9, the file system unmounted
  (the cut) and mounted again, the broker started;
* ``disk_full``: for 0.5-3 s the disk answers ENOSPC to whatever needs new
  space, under load (publishes are refused; consumers go on draining);
* ``disk_eio``: for 0.5-2 s every fsync of the topic's files fails with EIO
  (the queue refuses writes from then on), then, the disk fixed, the operator
  restarts the broker -- by SIGTERM or kill -9, at random.

``--interval`` sets the nemesis's pause between faults (2-4 s by default);
``--faults N`` runs until the nemesis has made N faults instead of for
``--seconds``.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from tests.chaos.harness import (
    TOPIC,
    BrokerProcess,
    Ledger,
    consumer,
    drain,
    http_producer,
    tcp_producer,
    zmq_producer,
)
from tests.chaos.test_chaos import nemesis

if TYPE_CHECKING:
    from tests.power.rig import VolatileMount


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-nemesis", action="store_true")
    ap.add_argument("--plain-consumers", action="store_true",
                    help="consumers that take every message at once")
    ap.add_argument("--disk-faults", action="store_true",
                    help="the data directory on the power-cut rig; power cuts, a full disk "
                         "and EIO in the nemesis")
    ap.add_argument("--interval", type=float, nargs=2, default=(2.0, 4.0),
                    metavar=("MIN", "MAX"), help="seconds between the nemesis's faults")
    ap.add_argument("--faults", type=int, default=0,
                    help="run until the nemesis has made this many faults (not --seconds)")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    work = Path(tempfile.mkdtemp(prefix="soak", dir="/tmp"))
    extra: dict[str, Callable[[], None]] = {}
    mount = None
    if a.disk_faults:
        from tests.power.rig import VolatileMount

        mount = VolatileMount(work)
        mount.up()
        # (a long path keeps the broker's ipc sockets in /tmp, off the mount)
        broker = BrokerProcess(mount.mount / ("d" * 80), work / "broker.log",
                               ("--sync-every", "1"))
        extra.update(_disk_faults(broker, mount, random.Random(rng.random())))
    else:
        broker = BrokerProcess(work / "data", work / "broker.log")
    # SIGTERM (and Ctrl-C) stop the run with the broker and the rig's mount taken down
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        _run(a, rng, broker, extra)
    except BaseException:
        with contextlib.suppress(Exception):
            broker.kill_all()
        if mount is not None:
            with contextlib.suppress(Exception):
                mount.cut()
        raise
    if mount is not None:
        mount.cut()


def _run(a: argparse.Namespace, rng: random.Random, broker: BrokerProcess,
         extra: dict[str, Callable[[], None]]) -> None:
    broker.start()
    ledger = Ledger()
    stop_load, stop_nemesis, draining = threading.Event(), threading.Event(), threading.Event()
    actions: list[str] = []
    if a.plain_consumers:
        draining.set()  # (the workload's consumers just take everything while draining)
    consumers = [consumer(broker, ledger, random.Random(rng.random()), draining)
                 for _ in range(2)]
    threads = [threading.Thread(target=f, args=(broker, ledger, stop_load, tag,
                                                random.Random(rng.random())))
               for f, tag in ((zmq_producer, "z1"), (zmq_producer, "z2"),
                              (tcp_producer, "t1"), (http_producer, "h1"))]
    if not a.no_nemesis:
        threads.append(threading.Thread(target=nemesis, args=(
            broker, stop_nemesis, random.Random(rng.random()), actions),
            kwargs={"extra": extra, "interval": tuple(a.interval)}))
    peak: dict[str, int] = {}
    usage: list[dict[str, tuple[int, int]]] = []
    comebacks: list[float] = []  # seconds from /ping OK again to the next delivery
    watching = threading.Event()

    def watch_restarts() -> None:
        """Time every comeback: /ping fails, answers again, then a delivery arrives."""
        was_up = True
        while not watching.is_set():
            up = broker.ping()
            if up and not was_up:
                back = time.monotonic()
                before = ledger.delivery_count()
                while not watching.is_set() and ledger.delivery_count() == before:
                    if time.monotonic() - back > 120:
                        break
                    time.sleep(0.05)
                comebacks.append(time.monotonic() - back)
            was_up = up
            time.sleep(0.1)

    watcher = threading.Thread(target=watch_restarts, daemon=True)
    length = f"{a.faults} faults" if a.faults else f"{a.seconds:.0f} s"
    print(f"soak: {length}, seed {a.seed}, nemesis {'off' if a.no_nemesis else 'on'}")
    print(f"{'t':>5} {'acked/s':>9} {'delivered/s':>12}  rss MiB / threads / fds by process")
    for t in threads:
        t.start()
    watcher.start()
    start = time.monotonic()
    last = ledger.check()
    def going() -> bool:
        if a.faults:
            return sum(" failed: " not in x for x in actions) < a.faults
        return time.monotonic() - start < a.seconds

    while going():
        time.sleep(5)
        now = ledger.check()
        try:
            rss = broker.rss()
        except Exception:
            rss = {}
        sample = _threads_and_fds(broker)
        if sample:
            usage.append(sample)
        for name, value in rss.items():
            peak[name] = max(peak.get(name, 0), value)
        acked = (now["acknowledged"] - last["acknowledged"]) / 5
        delivered = (now["delivered"] - last["delivered"]) / 5
        print(f"{time.monotonic() - start:5.0f} {acked:9.0f} {delivered:12.0f}  "
              + " ".join(f"{k}={v / 2**20:.0f}/{sample.get(k, ('?', '?'))[0]}/"
                         f"{sample.get(k, ('?', '?'))[1]}" for k, v in sorted(rss.items())),
              flush=True)
        last = now
    ran_s = time.monotonic() - start
    stop_nemesis.set()
    stop_load.set()
    watching.set()
    for t in threads:
        t.join(120)
    draining.set()
    drained_from = time.monotonic()
    result = drain(broker, ledger, timeout=900)
    drain_s = time.monotonic() - drained_from
    for c in consumers:
        c.close(timeout=5)
    broker.stop()
    lat = sorted(ledger.latencies)
    q = statistics.quantiles(lat, n=100) if len(lat) > 100 else [0.0] * 99
    failed = [x for x in actions if " failed: " in x]
    done = [x for x in actions if " failed: " not in x]
    print(f"nemesis: {len(done)} faults in {ran_s:.0f} s: "
          + ", ".join(f"{k} {v}" for k, v in sorted(Counter(done).items())))
    if failed:
        print(f"  of which {len(failed)} raised: " + "; ".join(failed[:5]))
    print(f"checker (after a {drain_s:.0f} s drain): {result}; duplicate rate "
          f"{result['duplicated'] / max(1, result['delivered']):.1%}")
    print(f"publish-to-delivery latency p50 {q[49] * 1000:.1f} ms, p99 {q[98] * 1000:.1f} ms")
    print("peak rss MiB: " + " ".join(f"{k}={v / 2**20:.0f}" for k, v in sorted(peak.items())))
    if usage:
        print("threads/fds first sample: " + _usage_line(usage[0]))
        print("threads/fds last sample:  " + _usage_line(usage[-1]))
    if comebacks:
        print(f"broker came back {len(comebacks)} times; first delivery after /ping OK: "
              f"median {statistics.median(comebacks):.2f} s, max {max(comebacks):.2f} s")


def _disk_faults(broker: BrokerProcess, mount: VolatileMount,
                 rng: random.Random) -> dict[str, Callable[[], None]]:
    """The nemesis's faults of the disk under `broker`, on the rig at `mount`."""
    from tests.power.volatile_fs import EIO_CONTROL, FULL_CONTROL

    def power_cut() -> None:
        broker.kill_all()
        mount.cut()
        mount.up()
        broker.start()

    def disk_full() -> None:
        control = mount.backing / FULL_CONTROL
        control.write_text("")
        try:
            time.sleep(rng.uniform(0.5, 3.0))  # the load goes on against a full disk
        finally:
            control.unlink()

    def disk_eio() -> None:
        control = mount.backing / EIO_CONTROL
        control.write_text(TOPIC)  # every file of the topic: queues, delayed store, metadata
        try:
            time.sleep(rng.uniform(0.5, 2.0))
        finally:
            control.unlink()
        # The disk is fixed; a failed queue takes no writes until the broker restarts.
        if rng.random() < 0.5:
            broker.stop()
        else:
            broker.kill_all()
        broker.start()

    return {"power_cut": power_cut, "disk_full": disk_full, "disk_eio": disk_eio}


def _threads_and_fds(broker: BrokerProcess) -> dict[str, tuple[int, int]]:
    """(threads, fds) of every broker process, by name ({} while it is down)."""
    out: dict[str, tuple[int, int]] = {}
    with contextlib.suppress(Exception):
        for p in broker.processes():
            if p.pid:
                proc = psutil.Process(p.pid)
                out[p.name] = (proc.num_threads(), proc.num_fds())
    return out


def _usage_line(sample: dict[str, tuple[int, int]]) -> str:
    return " ".join(f"{k}={t}/{f}" for k, (t, f) in sorted(sample.items()))


if __name__ == "__main__":
    main()
