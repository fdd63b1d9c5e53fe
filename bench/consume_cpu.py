"""Where a ZeroMQ-consumed row's CPU goes: per process, in microseconds a row.

    python -m bench.consume_cpu [--rows 300000] [--size 100] [--rounds 2]
                                [--batch-size 50000] [--trees A,B] [--channel-first]

Starts a broker in this process tree (a temporary data dir, ports chosen by the
OS), publishes ``--rows`` JSON bodies of about ``--size`` bytes to a fresh topic
(MPUBs of 2,000, as ``publish(df)`` sends them), then reads them back as
``drain_to_parquet``'s reader does, without Spark: a ``Consumer`` with FIN held
back, two batches in flight over one session per 2,500 of them, each batch
FINed as a whole. It prints rows/s and the CPU each process spent a row: the
broker's gateway and workers, and this process (the consumer). Messages
published before the channel exists wait in the topic's disk queue, so the
read is of a backlog, as a drain's is; the topic hands it on to the channel,
whose disk queue takes what its memory cannot (written and read a second
time).  ``--channel-first`` makes the channel before publishing: the backlog
is then the channel's own, written once.

With ``--trees``, each round runs every listed checkout in turn (its own copy of
this script, its path first on ``sys.path``, in a fresh interpreter), so two
builds alternate in one sitting; ``now`` stands for this checkout.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import psutil

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=300_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=50_000)
    ap.add_argument("--trees", default="", help="checkouts to alternate, e.g. /work/prev,now")
    ap.add_argument("--channel-first", action="store_true",
                    help="make the channel before publishing (the backlog is the channel's)")
    a = ap.parse_args()
    print(f"consume_cpu: {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"{a.rows} rows of ~{a.size} B, batches of {a.batch_size}"
          f"{', the channel first' if a.channel_first else ''}; load {os.getloadavg()}")
    if not a.trees:
        for r in range(a.rounds):
            print(f"round {r}: {_run(a.rows, a.size, a.batch_size, a.channel_first)}",
                  flush=True)
        return
    for r in range(a.rounds):
        for tree in a.trees.split(","):
            path = HERE if tree == "now" else os.path.abspath(tree)
            # (that checkout's own copy of this script, its packages first on the path:
            # a checkout from before a change of the consumer's API reads as it did)
            out = subprocess.run(
                [sys.executable, os.path.join(path, "bench", "consume_cpu.py"), f"--rows={a.rows}",
                 f"--size={a.size}", f"--batch-size={a.batch_size}", "--rounds=1",
                 *(["--channel-first"] if a.channel_first else [])],
                cwd=path, env={**os.environ, "PYTHONPATH": path}, capture_output=True,
                text=True, timeout=600, check=True).stdout.splitlines()[-1]
            print(f"round {r} {tree}: {out.partition(': ')[2]}", flush=True)


def _run(rows: int, size: int, batch_size: int, channel_first: bool = False) -> str:
    from actors.broker import Broker
    from actors.broker.options import BrokerOptions, run_dir_for
    from actors.runtime import ControlClient
    from transport.client import Producer
    from transport.spark import to_json

    tmp = tempfile.mkdtemp(prefix="consumecpu", dir="/tmp")
    data = os.path.join(tmp, "data")
    opts = BrokerOptions(data_path=data, http_address="127.0.0.1:0",
                         tcp_address="127.0.0.1:0", zmq_address="tcp://127.0.0.1:0",
                         log_level="warn")
    pad = max(0, size - len(to_json({"id": rows, "payload": ""})))
    bodies = [to_json({"id": i, "payload": "x" * pad}) for i in range(rows)]
    with Broker(opts) as broker:
        with contextlib.closing(ControlClient(run_dir_for(data), timeout=5)) as control:
            names = {p["pid"]: p["name"] for p in control.call("ps")
                     if p["pid"] and p["name"] != "supervisor"}
        procs = {name: psutil.Process(pid) for pid, name in names.items()}
        procs["consumer"] = psutil.Process()
        if channel_first:
            for path in ("/topic/create?topic=consume", "/channel/create?topic=consume&channel=c"):
                urllib.request.urlopen(urllib.request.Request(
                    f"http://127.0.0.1:{broker.http_port}{path}", method="POST"),
                    timeout=10).read()
        with Producer(broker.zmq_endpoint) as producer:
            for i in range(0, rows, 16_000):
                producer.publish_batch("consume", bodies[i:i + 16_000], 2000)
        before = {k: sum(p.cpu_times()[:2]) for k, p in procs.items()}
        elapsed = consume(broker.zmq_endpoint, "consume", "c", rows, batch_size)
        after = {k: sum(p.cpu_times()[:2]) for k, p in procs.items()}
    shutil.rmtree(tmp, ignore_errors=True)
    cpu = "  ".join(f"{k} {(after[k] - before[k]) / rows * 1e6:.2f}" for k in sorted(procs))
    return f"{rows / elapsed:,.0f} rows/s; us a row: {cpu}"


def consume(endpoint: str, topic: str, channel: str, rows: int, batch_size: int) -> float:
    """Read `rows` messages of `topic`/`channel` as the drain's reader does, without
    Spark: a Consumer with FIN held back, room for two batches in flight over one
    session per 2,500 of them, each batch FINed as a whole.  Returns the seconds from
    the consumer's start to the last batch's FIN."""
    from transport.client import Consumer, Delivery

    got: queue.SimpleQueue[Delivery] = queue.SimpleQueue()
    consumer = Consumer(topic, channel, got.put, endpoint, max_in_flight=2 * batch_size,
                        auto_finish=False, batches=True, msg_timeout_ms=120_000,
                        connections_per_broker=-(-2 * batch_size // 2500))
    t = time.perf_counter()
    consumer.start()
    try:
        done = 0
        while done < rows:
            batch, size = [], 0  # (a batch: deliveries until batch_size messages or more)
            while size < min(batch_size, rows - done):
                batch.append(got.get(timeout=30))
                size += len(batch[-1])
            for d in batch:
                d.finish()
            done += size
        return time.perf_counter() - t
    finally:
        consumer.close()


if __name__ == "__main__":
    main()
