"""A drain's batches read by Arrow instead of Spark's JSON reader (#16).

Arrow may read a batch only if it reads every line as Spark's JSON reader would:
the differential test below writes generated lines -- right values, values of the
wrong type, out of range, in odd forms -- both ways and wants, whenever Arrow
takes a batch, no line Spark's reader refuses and the same rows from the Parquet
it wrote.  The drain tests check that a usual batch does go through Arrow, and
that a batch Arrow does not take still comes back whole through Spark.
"""

from __future__ import annotations

import calendar
import datetime as dt
import decimal
import json
import math
import re
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pyspark.sql import functions as F
from pyspark.sql import types as t

from transport import spark as spark_module
from transport.client import Producer
from transport.spark import (
    PartitionPublisher,
    _ArrowPlan,
    _parquet_options,
    _ParquetOptions,
    _staged_schema,
    _write_table,
    drain_to_parquet,
)

pytestmark = pytest.mark.timeout(600)

BODY = t.StructType([t.StructField(name, dtype) for name, dtype in [
    ("id", t.LongType()), ("i", t.IntegerType()), ("b", t.ByteType()), ("d", t.DoubleType()),
    ("f", t.FloatType()), ("dec", t.DecimalType(9, 2)), ("ok", t.BooleanType()),
    ("s", t.StringType()), ("day", t.DateType()), ("ts", t.TimestampType()),
    ("st", t.StructType([t.StructField("x", t.IntegerType()),
                         t.StructField("y", t.ArrayType(t.StringType())),
                         t.StructField("z", t.ArrayType(t.DecimalType(5, 1))),
                         t.StructField("w", t.DoubleType()),
                         # (a string named as a float: its "NaN" must stay a string)
                         t.StructField("d", t.StringType())])),
    ("arr", t.ArrayType(t.LongType())), ("ds", t.ArrayType(t.DoubleType()))]])

# Each field has its usual values (what the publishers write) and any values (those,
# and the wrong type, out of range, odd forms); a body takes at most one field's value
# from the second, so that batches Arrow takes are met as often as those it refuses.
_finite = st.floats(allow_nan=False, allow_infinity=False).map(json.dumps)
_nonfinite = st.sampled_from(['"NaN"', '"Infinity"', '"-Infinity"'])  # (as the writers do)
_odd = st.sampled_from(['null', 'true', '"5"', '"x"', '""', '1.0', '1e3', '-0', '[]', '{}',
                        '"NaN"', '"Infinity"', '"-Infinity"', 'NaN', '-Infinity', '1e400'])


def _integers(bits: int) -> tuple[st.SearchStrategy[str], st.SearchStrategy[str]]:
    usual = st.integers(-2**(bits - 1), 2**(bits - 1) - 1).map(str)
    return usual, st.one_of(usual, st.integers(-2**70, 2**70).map(str), _finite, _odd)


_decimal = st.decimals(min_value=-10**6, max_value=10**6, places=2, allow_nan=False,
                       allow_infinity=False).map(str)
_when = st.datetimes(min_value=dt.datetime(1900, 1, 1), max_value=dt.datetime(2100, 1, 1))


@st.composite
def _timestamp(draw: st.DrawFn, odd: bool) -> str:
    when = draw(_when)
    if not odd:  # (as Python's isoformat or Spark's JSON writer has it)
        text = when.isoformat(timespec=draw(st.sampled_from(["seconds", "milliseconds",
                                                             "microseconds"])))
        return json.dumps(text + draw(st.sampled_from(["", "Z", "+05:30", "-08:00"])))
    text = when.strftime("%Y-%m-%d" + draw(st.sampled_from(["T", " "])) + "%H:%M")
    if draw(st.booleans()):
        text += when.strftime(":%S")
        digits = draw(st.integers(0, 9))
        if digits:
            text += "." + f"{when.microsecond:06d}{draw(st.integers(0, 999)):03d}"[:digits]
    return json.dumps(text + draw(st.sampled_from(["", "Z", "+05:30", "+0100", "+01"])))


_text = st.text(max_size=8).map(json.dumps)
_any_text = st.one_of(_text, _odd, st.sampled_from(
    [r'"\u00e9\n\"x"', r'"\ud83d\ude00"', r'"\ud800"', '{"a":1}', '[1,"a"]']))


def _array(items: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.lists(items, max_size=3).map(lambda xs: "[" + ",".join(xs) + "]")


@st.composite
def _object(draw: st.DrawFn, fields: dict[str, tuple[st.SearchStrategy[str],
                                                      st.SearchStrategy[str]]]) -> str:
    odd = draw(st.integers(0, len(fields)))  # (the field whose value may be any)
    members = [f'"{name}":{draw(values[i == odd])}'
               for i, (name, values) in enumerate(fields.items())
               if draw(st.integers(0, 5))]  # (a field left out now and then)
    if draw(st.integers(0, 9)) == 0:
        members.append(f'"extra":{draw(_any_text)}')
    return "{" + ",".join(members) + "}"


_usual_date = st.dates(min_value=dt.date(1, 1, 1)).map(lambda d: json.dumps(d.isoformat()))
_usual_ts = _timestamp(False)
_small_decimal = st.decimals(min_value=-9999, max_value=9999, places=1, allow_nan=False,
                             allow_infinity=False).map(str)
_any_decimal = st.one_of(
    _decimal, _decimal.map(json.dumps), _odd,
    st.integers(0, 4).flatmap(lambda places: st.decimals(
        min_value=-10**8, max_value=10**8, places=places, allow_nan=False,
        allow_infinity=False)).map(str),
    st.sampled_from(['1.5e2', '"1e2"', '"1,000.5"', '12345678.9', '0.005', '"0.10"', '9999.9',
                     '99999', '9999.95']))
_usual_double = st.one_of(_finite, _nonfinite)
_any_double = st.one_of(_finite, st.floats().map(json.dumps), _odd, st.sampled_from(
    ['"+INF"', '"-INF"', '"+Infinity"', '"NaN"', '"nan"', '"1.5"']))
_usual_struct = _object({"x": (_integers(32)[0],) * 2, "y": (_array(_text),) * 2,
                         "z": (_array(_small_decimal),) * 2, "w": (_usual_double,) * 2,
                         "d": (_text,) * 2})
_FIELDS = {
    "id": _integers(64), "i": _integers(32), "b": _integers(8),
    "d": (st.one_of(_finite, _nonfinite), st.one_of(
        _finite, st.floats().map(json.dumps),  # (NaN, Infinity literals)
        st.integers(-2**70, 2**70).map(str), _odd,
        st.sampled_from(['"+INF"', '"-INF"', '"+Infinity"', '"NaN"']))),
    "f": (st.one_of(st.floats(width=32, allow_nan=False, allow_infinity=False).map(json.dumps),
                    _nonfinite),
          st.one_of(st.floats(width=32).map(json.dumps), _odd, st.sampled_from(
              ['1e39', '3.4028235e38', '1e-46', '"1.5"', '0.1', '16777217', '"+INF"',
               '"-INF"', '"+Infinity"', '"INF"', '"nan"', '"Inf"', '"-Inf"']))),
    "dec": (_decimal, _any_decimal),
    "ok": (st.sampled_from(["true", "false", "null"]), _odd),
    "s": (_text, _any_text),
    "day": (_usual_date, st.one_of(_usual_date, _odd, st.sampled_from(
        ['"2020-1-5"', '"2020-02-30"', '"2020-01-01T10:00:00"', '18000', '"20200101"',
         '"2020-01-01 "', '"0000-01-01"']))),
    "ts": (_usual_ts, st.one_of(_usual_ts, _timestamp(True), _odd, st.sampled_from(
        ['"2019-03-10T02:30:00"', '"2019-11-03T01:30:00"', '"2020-01-01"', '1577836800',
         '"2020-01-01T00:00:00+01:00:00"']))),
    "st": (_usual_struct, st.one_of(_object({"x": _integers(32), "y": (
        _array(_text), st.one_of(_array(_any_text), _odd)), "z": (
        _array(_small_decimal), st.one_of(_array(_any_decimal), _odd)),
        "w": (_usual_double, _any_double), "d": (_text, st.one_of(_nonfinite, _any_text))}),
        _odd)),
    "arr": (_array(_integers(64)[0]), st.one_of(_array(_integers(64)[1]), _odd)),
    "ds": (_array(_usual_double), st.one_of(_array(_any_double),
                                            _array(_array(_usual_double)), _odd)),
}
_body = _object(_FIELDS)


def _plain(value: Any) -> Any:
    """A collected value `==` can compare (NaN equal to NaN)."""
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    if isinstance(value, list | tuple):  # (a Row is a tuple)
        return tuple(_plain(v) for v in value)
    return value


@pytest.mark.parametrize("zone", [
    "America/New_York",  # (naive timestamps refused: a zone's rules are the JVM's)
    "-03:30", "Etc/UTC"])
def test_arrow_takes_a_batch_only_where_it_reads_each_line_as_spark_does(spark, tmp_path,
                                                                         zone):
    plan = _ArrowPlan.of(BODY, False, spark.version)
    assert plan.readable
    staged_schema = _staged_schema(BODY)
    taken, given_back = [], []
    examples = iter(range(10**6))
    before = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", zone)

    @settings(max_examples=80, deadline=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate],  # (unshrunk: each is Spark jobs)
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(bodies=st.lists(_body, min_size=1, max_size=4))
    def check(bodies: list[str]) -> None:
        table = plan.read("\n".join(bodies).encode(), len(bodies), zone)
        if table is None:
            given_back.append(bodies)
            return
        taken.append(bodies)
        where = tmp_path / f"e{next(examples)}"
        where.mkdir()
        lines = tmp_path / f"e{next(examples)}.json"  # (as a batch Arrow refuses is staged)
        lines.write_bytes("\n".join(f'{{"_nsq_i":{i},"_nsq_body":{b}}}'
                                     for i, b in enumerate(bodies)).encode())
        _write_table(table, str(where), _parquet_options(spark))
        by_spark = (spark.read.schema(staged_schema).option("mode", "PERMISSIVE")
                    .option("columnNameOfCorruptRecord", "_nsq_corrupt").json(str(lines)))
        # (compared as Spark's JSON of each row: a date of year 0 has no Python form)
        rows = by_spark.select("_nsq_corrupt", F.to_json("_nsq_body").alias("row")).collect()
        refused = [r._nsq_corrupt for r in rows if r._nsq_corrupt is not None]
        assert not refused, "Arrow took lines Spark's JSON reader refuses"
        by_arrow = spark.read.schema(BODY).parquet(str(where)).select(
            F.to_json(F.struct("*")).alias("row")).collect()
        by_spark = [r.row for r in rows]
        by_arrow = [r.row for r in by_arrow]
        assert by_arrow == by_spark

    try:
        check()
    finally:
        spark.conf.set("spark.sql.session.timeZone", before)
    # (not vacuous: both kinds of batch were met, and NaN written as a string taken, at
    # the top level, in a struct and in a list)
    assert len(taken) >= 10
    assert len(given_back) >= 10
    nonfinite = re.compile(r'"(NaN|Infinity|-Infinity)"')
    for where in (r'"d":"', r'"w":"', r'"ds":\[[^\]]*"'):
        assert any(re.search(where + r'(NaN|Infinity|-Infinity)"', body)
                   for bodies in taken for body in bodies), where
    assert any(nonfinite.search(body) for bodies in given_back for body in bodies)


_SPECIAL = {0: math.nan, 1: math.inf, 2: -math.inf}


def test_what_the_publishers_write_is_read_by_arrow(spark, broker, tmp_path):
    # Given rows of every type Arrow takes, published both ways (Spark's JSON writer,
    # and the Python serialiser), timestamps with and without an offset, and NaN and
    # the infinities in the top-level float columns (both write them as strings)
    schema = ("id long, i int, f float, d double, dec decimal(20,5), ok boolean, day date, "
              "ts timestamp, s struct<x:int,tags:array<string>>, arr array<double>, "
              "name string")
    df = spark.createDataFrame(
        [(i, i % 7 - 3, _SPECIAL.get(i % 50, i / 8), _SPECIAL.get(i % 40, i / 3),
          decimal.Decimal(f"{i}.12345"), i % 2 == 0,
          dt.date(2020, 1, 1) + dt.timedelta(days=i), dt.datetime(2021, 3, 14, 1, 59, 26, i),
          (i, ["a", None]), [i / 3, None], f"row é {i}") for i in range(300)],
        schema).cache()
    want = sorted(_plain(r) for r in df.collect())
    for way in ("publish(df)", "foreachPartition"):
        topic = f"arrow-{way[:7]}"
        publisher = PartitionPublisher(topic, broker.zmq_endpoint)
        if way == "publish(df)":
            publisher.publish(df)
        else:
            df.foreachPartition(publisher)
        out = tmp_path / topic
        # When the topic is drained to a local path
        result = drain_to_parquet(spark, topic, "c", broker.zmq_endpoint, str(out),
                                  schema=df.schema, max_rows=300, idle_timeout=5,
                                  metadata=True)
        # Then Arrow wrote every file, and the rows are the DataFrame's
        assert (result.rows, result.bad) == (300, 0), way
        files = list(out.glob("*.parquet"))
        assert files, way
        assert {pq.ParquetFile(f).metadata.created_by.split()[0] for f in files} \
            == {"parquet-cpp-arrow"}, way
        assert (out / "_SUCCESS").exists()  # (as Spark's writer leaves it)
        column = pq.ParquetFile(files[0]).metadata.row_group(0).column(7)
        assert (column.path_in_schema, column.physical_type, column.compression) \
            == ("ts", "INT96", "SNAPPY")  # (Spark's defaults)
        got = spark.read.parquet(str(out))
        assert got.schema["ts"].dataType == t.TimestampType()
        assert sorted(_plain(r) for r in got.select(*df.columns).collect()) == want, way
        assert got.where("_nsq_attempts = 1 and _nsq_id is not null").count() == 300
    df.unpersist()


def test_a_batch_arrow_does_not_take_comes_back_whole_through_spark(spark, broker, tmp_path):
    # Given two batches: one Arrow takes, one with a value that is not a number (and
    # NaNs written as strings, which Arrow takes)
    first = [json.dumps({"id": i, "d": i / 3}).encode() for i in range(1_000)]
    second = [json.dumps({"id": i, "d": "NaN" if i % 10 == 0 else i / 3}).encode()
              for i in range(1_000, 2_000)]
    second[501] = json.dumps({"id": 1_501, "d": "oops"}).encode()
    out = tmp_path / "out"
    with Producer(broker.zmq_endpoint) as p:
        p.publish_batch("arrow-mixed", first)
        p.publish_batch("arrow-mixed", second)
    # When they are drained in batches of 1,000
    result = drain_to_parquet(spark, "arrow-mixed", "c", broker.zmq_endpoint, str(out),
                              schema="id long, d double", batch_size=1_000,
                              idle_timeout=3, batch_timeout=2)
    # Then one file is Arrow's and one Spark's, every row is there once, NaNs
    # included, and the bad one is kept with its reason
    assert (result.rows, result.bad, result.batches) == (1_999, 1, 2)
    writers = sorted(pq.ParquetFile(f).metadata.created_by.split()[0]
                     for f in out.glob("*.parquet"))
    assert writers[0] == "parquet-cpp-arrow"
    assert writers[-1] == "parquet-mr"
    rows = spark.read.parquet(str(out))
    ids = [r.id for r in rows.select("id").collect()]
    assert sorted(ids) == [i for i in range(2_000) if i != 1_501]
    assert rows.where("isnan(d)").count() == 100
    (bad,) = spark.read.parquet(str(out / "_bad_messages")).collect()
    assert "'oops' is not a number" in bad.error


def test_a_batch_read_in_blocks_on_arrows_threads_is_every_line_in_order(monkeypatch):
    # Given blocks far smaller than the batch, and a line longer than a block
    monkeypatch.setattr(spark_module, "ARROW_BLOCK", 64)
    plan = _ArrowPlan.of(t.StructType([t.StructField("id", t.LongType()),
                                       t.StructField("s", t.StringType())]), False, "3.5.0")
    bodies = [json.dumps({"id": i, "s": "x" * (i % 7)}).encode() for i in range(2_000)]
    bodies[1_234] = json.dumps({"id": 1_234, "s": "y" * 500}).encode()
    lines = b"\n".join(bodies)
    # When the batch is read knowing its longest line
    table = plan.read(lines, len(bodies), "UTC", longest=max(map(len, bodies)))
    # Then it is one row a line, in order, the long one whole
    assert table is not None
    assert table.column("id").to_pylist() == list(range(2_000))
    assert table.column("s").to_pylist()[1_234] == "y" * 500
    # and told a shorter longest line than there is, it is refused (Spark's reader
    # then reads the batch), never read wrong
    assert plan.read(lines, len(bodies), "UTC", longest=10) is None


def test_a_table_file_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    # Given a write that fails part way (a full disk)
    table = _ArrowPlan.of(t.StructType([t.StructField("id", t.LongType())]), False, "3.5.0").read(
        b'{"id":1}', 1, "UTC")
    assert table is not None
    real = pq.write_table

    def half_then_full(table: Any, where: str, **kw: Any) -> None:
        real(table, where, **kw)
        with open(where, "r+b") as f:
            f.truncate(10)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(spark_module.pq, "write_table", half_then_full)
    # When it is written into a table's directory
    options = _ParquetOptions(".snappy", {"compression": "snappy"})
    with pytest.raises(OSError, match="No space"):
        _write_table(table, str(tmp_path), options)
    # Then neither the table nor its staging directory keeps a part of it
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == []
    # and a write that succeeds leaves one whole file in the table, none staged
    monkeypatch.setattr(spark_module.pq, "write_table", real)
    written = Path(_write_table(table, str(tmp_path), options))
    assert written.parent == tmp_path
    assert pq.read_table(written).to_pylist() == [{"id": 1}]
    assert not list((tmp_path / "_staging").iterdir())


def test_bodies_that_are_not_one_object_a_line_go_to_spark_and_are_judged_one_by_one(
        spark, broker, tmp_path):
    # Given a batch of good bodies with, among them, a pretty-printed object (line
    # breaks in it), two objects in one body, and two bodies that only make objects
    # when joined line after line (as many values as bodies, one spanning two lines)
    good = [json.dumps({"id": i}).encode() for i in range(100)]
    bodies = [*good[:50], json.dumps({"id": 100}, indent=1).encode(),
              b'{"id":101}{"id":102}', b'{"id":', b'103}{"id":104}', *good[50:]]
    out = tmp_path / "out"
    with Producer(broker.zmq_endpoint) as p:
        p.publish_batch("arrow-lines", bodies)
    # When they are drained in one batch
    result = drain_to_parquet(spark, "arrow-lines", "c", broker.zmq_endpoint, str(out),
                              schema="id long", batch_size=len(bodies), idle_timeout=3,
                              batch_timeout=2)
    # Then Spark's reader wrote the batch: the good ones and the pretty-printed one are
    # rows, and each of the other three is bad on its own
    assert (result.rows, result.bad) == (101, 3)
    assert {pq.ParquetFile(f).metadata.created_by.split()[0]
            for f in out.glob("*.parquet")} == {"parquet-mr"}
    ids = sorted(r.id for r in spark.read.parquet(str(out)).collect())
    assert ids == list(range(101))
    bad = sorted(r.body for r in spark.read.parquet(str(out / "_bad_messages")).collect())
    assert bad == sorted([b'{"id":101}{"id":102}', b'{"id":', b'103}{"id":104}'])


# (the session's codec and timestamp type; the file's writer, name's end, timestamp
# column's physical type and codec)
@pytest.mark.parametrize(("settings", "made"), [
    (("zstd", "TIMESTAMP_MICROS"), ("parquet-cpp-arrow", ".zstd.parquet", "INT64", "ZSTD")),
    (("uncompressed", "INT96"), ("parquet-cpp-arrow", "-c000.parquet", "INT96", "UNCOMPRESSED")),
    (("lz4", "INT96"), ("parquet-mr", ".lz4hadoop.parquet", "INT96", None)),  # (Hadoop's:
    # pyarrow has no name for it)
    (("snappy", "TIMESTAMP_MILLIS"), ("parquet-mr", ".snappy.parquet", "INT64", "SNAPPY"))])
def test_a_drain_writes_parquet_as_the_sessions_settings_say(spark, broker, tmp_path,
                                                              settings, made):
    codec, stamps = settings
    # Given a session whose Parquet writer is set to another codec or timestamp type
    topic = f"arrow-{codec}-{stamps.lower()}"
    with Producer(broker.zmq_endpoint) as p:
        p.publish_batch(topic, [json.dumps({"id": i, "ts": "2026-11-28T10:39:45.123456Z"})
                                .encode() for i in range(100)])
    keys = ("spark.sql.parquet.compression.codec", "spark.sql.parquet.outputTimestampType")
    before = [spark.conf.get(k) for k in keys]
    spark.conf.set(keys[0], codec)
    spark.conf.set(keys[1], stamps)
    try:
        # When a topic is drained
        out = tmp_path / "out"
        result = drain_to_parquet(spark, topic, "c", broker.zmq_endpoint, str(out),
                                  schema="id long, ts timestamp", idle_timeout=3,
                                  batch_timeout=1)
    finally:
        for k, v in zip(keys, before, strict=True):
            spark.conf.set(k, v)
    # Then its file is as Spark's writer would make it: Arrow's where Arrow writes the
    # same, Spark's otherwise
    assert result.rows == 100
    (f,) = out.glob("*.parquet")
    assert f.name.endswith(made[1])
    meta = pq.ParquetFile(f).metadata
    column = meta.row_group(0).column(1)
    assert (meta.created_by.split()[0], column.physical_type) == (made[0], made[2])
    if made[3] is not None:
        assert column.compression == made[3]
    (row,) = spark.read.parquet(str(out)).where("id = 7").selectExpr("unix_micros(ts) as us") \
        .collect()
    second = calendar.timegm((2026, 11, 28, 10, 39, 45)) * 10**6
    assert row.us == second + (123_000 if stamps == "TIMESTAMP_MILLIS" else 123_456)
