"""A real pipeline through the broker: ISO 3166 data -> Spark -> topic -> Spark -> Parquet.

The dataset is ISO 3166-2, the 5,046 subdivisions of the world's countries
(states, provinces, regions...), and ISO 3166-1, the 249 countries, as JSON
files that ship inside the ``pycountry`` package from PyPI (real, maintained
data; nothing is downloaded at run time).

1. Spark reads both files, explodes them into rows and joins every
   subdivision to its country, adding the number of subdivisions per country.
2. Every row is published to the topic through ``rdd.foreachPartition``
   (``transport.spark.PartitionPublisher``), with accumulators counting rows.
3. The topic is drained back into Parquet (``transport.spark.drain_to_parquet``:
   each micro-batch is FINed only after its files are written and fsynced).
4. The Parquet table is checked against the source: every subdivision code
   must be there (duplicates, which at-least-once allows, are counted).

It needs a JDK (17; Spark runs on the JVM), the ``spark`` extra and
``pycountry`` (``pip install -e '.[spark]' pycountry``).  Run a broker
(``python -m actors.broker``) and then::

    python examples/spark/pipeline.py --broker tcp://127.0.0.1:4153 --out ./iso3166-parquet
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from transport.spark import PartitionPublisher, PublishCounters, drain_to_parquet

TOPIC = "iso3166.subdivisions"
CHANNEL = "parquet"
SCHEMA = ("code string, name string, type string, parent string, country_code string, "
          "country string, country_alpha3 string, country_subdivisions int")


def dataset_dir() -> Path:
    spec = importlib.util.find_spec("pycountry")
    if spec is None or spec.origin is None:
        raise SystemExit("the example reads its data from the pycountry package: "
                         "pip install pycountry")
    return Path(spec.origin).parent / "databases"


def load(spark: SparkSession) -> DataFrame:
    """Subdivisions joined with their countries (one row per subdivision)."""
    data = dataset_dir()
    subdivisions = (spark.read.option("multiLine", True).json(str(data / "iso3166-2.json"))
                    .select(F.explode("`3166-2`").alias("s")).select("s.*"))
    countries = (spark.read.option("multiLine", True).json(str(data / "iso3166-1.json"))
                 .select(F.explode("`3166-1`").alias("c"))
                 .select(F.col("c.alpha_2").alias("country_code"), F.col("c.name").alias("country"),
                         F.col("c.alpha_3").alias("country_alpha3")))
    per_country = Window.partitionBy("country_code")
    return (subdivisions
            .withColumn("country_code", F.split("code", "-").getItem(0))
            .join(countries, "country_code", "left")
            .withColumn("country_subdivisions", F.count("*").over(per_country).cast("int"))
            .select("code", "name", "type", "parent", "country_code", "country",
                    "country_alpha3", "country_subdivisions"))


def run(spark: SparkSession, broker: str, out: str, *, idle_timeout: float = 5.0) -> dict[str, Any]:
    """The whole pipeline; returns the check's figures (``missing`` must be 0)."""
    source = load(spark).repartition(4).cache()
    expected = {r.code for r in source.select("code").collect()}

    counters = PublishCounters.create(spark.sparkContext)
    started = time.monotonic()
    source.foreachPartition(PartitionPublisher(TOPIC, broker, counters=counters))
    published_s = time.monotonic() - started

    started = time.monotonic()
    drained = drain_to_parquet(spark, TOPIC, CHANNEL, broker, out, schema=SCHEMA,
                               idle_timeout=idle_timeout, batch_timeout=1.0)
    drained_s = time.monotonic() - started

    table = spark.read.parquet(out)
    codes = [r.code for r in table.select("code").collect()]
    biggest = (table.dropDuplicates(["code"]).groupBy("country")
               .agg(F.count("*").alias("n")).orderBy(F.desc("n"), "country").limit(3).collect())
    source.unpersist()
    return {
        "source_rows": len(expected),
        **counters.values(),
        "delivered": len(codes),
        "missing": len(expected - set(codes)),
        "duplicates": len(codes) - len(set(codes)),
        "unexpected": len(set(codes) - expected),
        "bad_messages": drained.bad,
        "publish_seconds": round(published_s, 2),
        "drain_seconds": round(drained_s, 2),
        "most_subdivisions": [(r.country, r.n) for r in biggest],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--broker", default="tcp://127.0.0.1:4153",
                    help="ZeroMQ address(es) of the broker, comma-separated")
    ap.add_argument("--out", default=None, help="Parquet output directory (default: a temp dir)")
    ap.add_argument("--master", default="local[2]")
    args = ap.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    out = args.out or tempfile.mkdtemp(prefix="iso3166-")
    spark = (SparkSession.builder.master(args.master).appName("zmqnsq-iso3166")
             .config("spark.ui.enabled", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    try:
        report = run(spark, args.broker, out)
    finally:
        spark.stop()
    print(json.dumps(report, indent=2, ensure_ascii=False))
    print(f"parquet: {out}")
    return 0 if report["missing"] == 0 and report["unexpected"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
