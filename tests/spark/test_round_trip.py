"""Every Spark value the publisher takes comes back equal through the drain (#16).

Generated DataFrames of a schema with every kind of column (NaN and the
infinities, binary, exact decimals, dates, timestamps with and without a time
zone, structs, arrays, maps, nulls everywhere) go through each way of
publishing -- ``publish(df)`` (Spark's JSON writer in the JVM), and
``foreachPartition`` with the JSON and the msgpack serialisers -- into a topic,
and ``drain_to_parquet`` writes them back; the Parquet rows must equal the
DataFrame's, and nothing may be refused.
"""

from __future__ import annotations

import datetime as dt
import decimal
import itertools
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from transport.spark import PartitionPublisher, drain_to_parquet

pytestmark = pytest.mark.timeout(600)

SCHEMA = ("id long, d double, f float, blob binary, dec decimal(20,5), day date, "
          "ts timestamp, ntz timestamp_ntz, s struct<x:int,tags:array<string>>, "
          "arr array<double>, m map<string,bigint>, name string")

_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)
_when = st.datetimes(min_value=dt.datetime(1900, 1, 1), max_value=dt.datetime(2100, 1, 1))


def _maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), strategy)


_row = st.tuples(
    _maybe(st.floats()),                         # d: NaN, +-Infinity, -0.0 included
    _maybe(st.floats(width=32)),                 # f
    _maybe(st.binary(max_size=16)),              # blob
    _maybe(st.decimals(min_value=-10**14, max_value=10**14, places=5,
                       allow_nan=False, allow_infinity=False)),
    _maybe(st.dates(min_value=dt.date(1900, 1, 1), max_value=dt.date(2100, 1, 1))),
    _maybe(_when),                               # ts (in the session's time zone)
    _maybe(_when),                               # ntz
    _maybe(st.tuples(st.integers(-2**31, 2**31 - 1), st.lists(_maybe(_text), max_size=3))),
    _maybe(st.lists(_maybe(st.floats()), max_size=4)),
    _maybe(st.dictionaries(_text, _maybe(st.integers(-2**63, 2**63 - 1)), max_size=3)),
    _maybe(_text),
)

_topics = itertools.count()


def _plain(value: Any) -> Any:
    """A collected value in a form `==` can compare (NaN equal to NaN)."""
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    if isinstance(value, bytearray | bytes):
        return bytes(value)
    if isinstance(value, decimal.Decimal):
        return value.normalize()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):  # (a Row is a tuple)
        return tuple(_plain(v) for v in value)
    return value


@settings(max_examples=4, deadline=None, derandomize=True,
          phases=[Phase.explicit, Phase.generate],  # (a failure shows its example unshrunk:
          # shrinking through Spark jobs takes many minutes)
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(rows=st.lists(_row, min_size=1, max_size=25))
def test_every_spark_value_comes_back_equal_through_each_way_of_publishing(
        spark, broker, tmp_path_factory, rows):
    df = spark.createDataFrame([(i, *r) for i, r in enumerate(rows)], SCHEMA).cache()
    want = sorted((_plain(r) for r in df.collect()), key=lambda r: r[0])
    ways = {"publish(df)": lambda p: p.publish(df),
            "json": df.foreachPartition,
            "msgpack": df.foreachPartition}
    for way, run in ways.items():
        topic = f"round-trip-{next(_topics)}"
        serializer = "msgpack" if way == "msgpack" else "json"
        run(PartitionPublisher(topic, broker.zmq_endpoint, serializer=serializer))
        out = tmp_path_factory.mktemp("round-trip")
        result = drain_to_parquet(spark, topic, "c", broker.zmq_endpoint, str(out),
                                  schema=SCHEMA, deserializer=serializer,
                                  max_rows=len(rows), idle_timeout=10, batch_timeout=0.5)
        assert (result.rows, result.bad) == (len(rows), 0), way
        got = sorted((_plain(r) for r in spark.read.schema(SCHEMA).parquet(str(out))
                      .collect()), key=lambda r: r[0])
        assert got == want, way
    df.unpersist()
