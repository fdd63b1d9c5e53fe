"""Spark producer benchmark: rows/s published from Spark beside rows/s written to Parquet.

    python -m bench.spark_bench [--rows 500000] [--sizes 100,1024] [--partitions 4]
                                [--runs 3] [--master local[2]]

Starts a broker on a temporary data dir (ports chosen by the OS, default
options), builds a DataFrame of ``--rows`` rows whose JSON form is about
``size`` bytes (an id and a padding string), caches it, and then -- alternating,
``--runs`` times -- times:

* **parquet**: ``df.write.parquet(tmp)``, the ceiling of the Spark side (the
  same job with its rows going to local files instead of the broker);
* **publish(df)**: ``PartitionPublisher(...).publish(df)``: rows to JSON in the
  JVM (``to_json``), the Python workers publish MPUBs of 2000, 8
  pipelined, every acknowledgement awaited;
* **foreachPartition**: ``df.foreachPartition(PartitionPublisher(...))``: the
  same, but the Python workers build each ``Row`` and serialise it;
* **drain_to_parquet**: the topic ``publish(df)`` filled, back to Parquet with
  the default reader (batches of 50,000, each written, fsynced and FINed; to
  this local path Arrow reads and writes them, docs/SPARK.md);
  #16's targets are >= 0.5x consume and >= 1.0x ``publish(df)``;
* **bare publish**: publish(df)'s client path without Spark, the broker's own
  publish-only rate: as many processes as Spark runs tasks at once, each a
  ``Producer`` publishing its share of the same JSON bodies in the same MPUBs
  (#16's targets: publish(df) >= 0.8x this, foreachPartition >= 0.5x
  publish(df); the two ratios printed in that order);
* **consume**: the topic ``foreachPartition`` filled (the same rows), read by
  the drain's client path without Spark: a ``Consumer`` with FIN held back, two
  batches in flight, each batch FINed -- the broker's own consume rate.

One untimed round of publish(df), Parquet and the drain comes first (Python
workers and the JVM warm up: a first drain in a fresh JVM runs at half speed).
It prints the medians and the ratios to parquet (the target is >= 0.5).
Spark and the broker share the machine's cores, as they would on one node.
"""

from __future__ import annotations

import argparse
import inspect
import multiprocessing
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from actors.broker import Broker
from actors.broker.options import BrokerOptions
from bench import consume_cpu
from transport.client import Producer
from transport.spark import PartitionPublisher, PublishCounters, drain_to_parquet, to_json

DRAIN_BATCH = inspect.signature(drain_to_parquet).parameters["batch_size"].default


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=500_000)
    ap.add_argument("--sizes", default="100,1024")
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--drain-batch-size", type=int, default=None,
                    help="batch_size of drain_to_parquet (default: its own)")
    a = ap.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    tmp = tempfile.mkdtemp(prefix="sparkbench", dir="/tmp")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}; load {os.getloadavg()}")
    print(f"{a.rows} rows, {a.partitions} partitions, master {a.master}, {a.runs} runs each")
    drain_options = {} if a.drain_batch_size is None else {"batch_size": a.drain_batch_size}
    spark = (SparkSession.builder.master(a.master).appName("spark-bench")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    opts = BrokerOptions(data_path=os.path.join(tmp, "data"), http_address="127.0.0.1:0",
                         tcp_address="127.0.0.1:0", zmq_address="tcp://127.0.0.1:0",
                         log_level="warn")
    try:
        with Broker(opts) as broker:
            for size in (int(s) for s in a.sizes.split(",")):
                pad = max(0, size - len(to_json({"id": a.rows, "payload": ""})))
                df = (spark.range(0, a.rows, numPartitions=a.partitions)
                      .withColumn("payload", F.expr(f"repeat('x', {pad})"))).cache()
                df.count()
                parquet, publish, rows_path, drain, consume, bare = [], [], [], [], [], []
                # one untimed round first: Spark's Python workers and the JIT warm up
                df.write.parquet(os.path.join(tmp, f"warm-{size}"))
                PartitionPublisher(f"warm_{size}", broker.zmq_endpoint).publish(df)
                drain_to_parquet(spark, f"warm_{size}", "drain", broker.zmq_endpoint,
                                 os.path.join(tmp, f"warm-drain-{size}"),
                                 schema="id long, payload string", max_rows=a.rows,
                                 idle_timeout=10, **drain_options)
                broker.topic_command(f"warm_{size}", "delete")
                for run in range(a.runs):
                    out = os.path.join(tmp, f"parquet-{size}-{run}")
                    t = time.perf_counter()
                    df.write.parquet(out)
                    parquet.append(a.rows / (time.perf_counter() - t))
                    shutil.rmtree(out)

                    topic = f"spark_{size}_{run}_bare"
                    bare.append(_publish(broker.zmq_endpoint, topic, a.rows, pad,
                                         spark.sparkContext.defaultParallelism))
                    broker.topic_command(topic, "delete")

                    for how, rates in (("publish", publish), ("rows", rows_path)):
                        topic = f"spark_{size}_{run}_{how}"
                        counters = PublishCounters.create(spark.sparkContext)
                        publisher = PartitionPublisher(topic, broker.zmq_endpoint,
                                                       counters=counters)
                        t = time.perf_counter()
                        if how == "publish":
                            publisher.publish(df)
                        else:
                            df.foreachPartition(publisher)
                        rates.append(a.rows / (time.perf_counter() - t))
                        assert counters.values()["published"] == a.rows, counters.values()
                        if how == "rows":  # the broker's own consume rate, same client
                            t = time.perf_counter()
                            consume_cpu.consume(broker.zmq_endpoint, topic, "consume", a.rows,
                                                drain_options.get("batch_size", DRAIN_BATCH))
                            consume.append(a.rows / (time.perf_counter() - t))
                        if how == "publish":  # and back: the topic to Parquet
                            out = os.path.join(tmp, f"drain-{size}-{run}")
                            t = time.perf_counter()
                            result = drain_to_parquet(spark, topic, "drain", broker.zmq_endpoint,
                                                      out, schema="id long, payload string",
                                                      max_rows=a.rows, idle_timeout=10,
                                                      **drain_options)
                            drain.append(a.rows / (time.perf_counter() - t))
                            assert result.rows == a.rows, result
                            shutil.rmtree(out)
                        broker.topic_command(topic, "delete")
                df.unpersist()
                p, q = statistics.median(publish), statistics.median(parquet)
                r, d = statistics.median(rows_path), statistics.median(drain)
                c, b = statistics.median(consume), statistics.median(bare)
                print(f"{size:>5} B: publish(df) {p:>9,.0f} rows/s ({p * size / 1e6:5.1f} MB/s)"
                      f"  foreachPartition {r:>9,.0f}  drain_to_parquet {d:>9,.0f}"
                      f" ({d / p:.2f}x publish(df), {d / c:.2f}x consume)"
                      f"  consume {c:>9,.0f}  bare publish {b:>9,.0f}"
                      f" ({p / b:.2f}x, {r / p:.2f}x)  parquet {q:>9,.0f} rows/s"
                      f"  ratio {p / q:.2f} / {r / q:.2f}"
                      f"  [publish(df) runs {', '.join(f'{x:,.0f}' for x in publish)}]")
    finally:
        spark.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _publisher(endpoint: str, topic: str, rows: range, pad: int,
               gates: tuple[Any, Any]) -> None:
    """One of the bare publishers: publish(df)'s client path for `count` rows -- a
    Producer, the same JSON bodies, chunks of 2000 x 8 MPUBs pipelined."""
    publisher = PartitionPublisher(topic, endpoint)
    chunk = publisher.batch_size * publisher.batches_in_flight
    bodies = [to_json({"id": i, "payload": "x" * pad}) for i in rows]
    ready, go = gates
    with Producer(endpoint, timeout=publisher.timeout) as producer:
        ready.wait()
        go.wait()
        for i in range(0, len(bodies), chunk):
            producer.publish_batch(topic, bodies[i:i + chunk], publisher.batch_size)


def _publish(endpoint: str, topic: str, rows: int, pad: int, connections: int) -> float:
    """rows/s of `connections` processes publishing `rows` rows as publish(df) does,
    without Spark (the bodies made before the clock starts)."""
    ctx = multiprocessing.get_context("spawn")
    ready, go = ctx.Barrier(connections + 1), ctx.Event()
    share = -(-rows // connections)
    procs = [ctx.Process(target=_publisher, args=(
        endpoint, topic, range(i * share, min(rows, (i + 1) * share)), pad, (ready, go)))
        for i in range(connections)]
    for proc in procs:
        proc.start()
    ready.wait()
    t = time.perf_counter()
    go.set()
    for proc in procs:
        proc.join()
        assert proc.exitcode == 0, proc.exitcode
    return rows / (time.perf_counter() - t)


if __name__ == "__main__":
    main()
