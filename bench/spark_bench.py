"""Spark producer benchmark: rows/s published from Spark beside rows/s written to Parquet.

    python -m bench.spark_bench [--rows 500000] [--sizes 100,1024] [--partitions 4]
                                [--runs 3] [--master local[2]]

Starts a broker on a temporary data dir (ports chosen by the OS, default
options), builds a DataFrame of ``--rows`` rows whose JSON form is about
``size`` bytes (an id and a padding string), caches it, and then -- alternating,
``--runs`` times -- times:

* **parquet**: ``df.write.parquet(tmp)``, the ceiling of the Spark side (the
  same job with its rows going to local files instead of the broker);
* **publish**: ``df.foreachPartition(PartitionPublisher(...))``: rows to JSON
  in the Python workers, MPUBs of 500, 8 pipelined, every acknowledgement
  awaited.

It prints the medians and the ratio publish / parquet (the target is >= 0.5).
Spark and the broker share the machine's cores, as they would on one node.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from actors.broker import Broker
from actors.broker_options import BrokerOptions
from transport.spark import PartitionPublisher, PublishCounters, to_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=500_000)
    ap.add_argument("--sizes", default="100,1024")
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--master", default="local[2]")
    a = ap.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    tmp = tempfile.mkdtemp(prefix="sparkbench", dir="/tmp")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}; load {os.getloadavg()}")
    print(f"{a.rows} rows, {a.partitions} partitions, master {a.master}, {a.runs} runs each")
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
                parquet, publish = [], []
                for run in range(a.runs):
                    out = os.path.join(tmp, f"parquet-{size}-{run}")
                    t = time.perf_counter()
                    df.write.parquet(out)
                    parquet.append(a.rows / (time.perf_counter() - t))
                    shutil.rmtree(out)

                    topic = f"spark_{size}_{run}"
                    counters = PublishCounters.create(spark.sparkContext)
                    t = time.perf_counter()
                    df.foreachPartition(PartitionPublisher(topic, broker.zmq_endpoint,
                                                           counters=counters))
                    publish.append(a.rows / (time.perf_counter() - t))
                    assert counters.values()["published"] == a.rows, counters.values()
                    broker.topic_command(topic, "delete")
                df.unpersist()
                p, q = statistics.median(publish), statistics.median(parquet)
                print(f"{size:>5} B rows: publish {p:>9,.0f} rows/s ({p * size / 1e6:6.1f} MB/s)"
                      f"   parquet {q:>9,.0f} rows/s   ratio {p / q:.2f}"
                      f"   [publish runs {', '.join(f'{x:,.0f}' for x in publish)}]")
    finally:
        spark.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
