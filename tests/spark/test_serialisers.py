"""Row serialisers of the Spark helper (no Spark session needed)."""

from __future__ import annotations

import datetime as dt
import decimal
import gc
import io
import json
import math
import struct
import weakref

import msgpack
import pytest
from pyspark.sql import Row

from transport.spark import (
    BadRowError,
    PartitionPublisher,
    _row_converter,
    _SizedRows,
    _young_collections_only,
    to_json,
    to_msgpack,
)

pytestmark = pytest.mark.timeout(30)


def jvm_stream(rows: list[bytes], after: bytes = b"") -> bytes:
    """What the JVM writes a Python worker for an RDD of strings: each row after its size,
    then END_OF_DATA_SECTION (-1), then whatever the worker protocol sends next."""
    return b"".join(struct.pack(">i", len(r)) + r for r in rows) + struct.pack(">i", -1) + after


def test_json_writes_rows_dates_and_decimals_as_plain_values():
    row = Row(id=7, when=dt.datetime(2026, 11, 22, 4, 30, 1, 250000), day=dt.date(2026, 1, 2),
              price=decimal.Decimal("12.50"), inner=Row(a=1, tags=["x", "y"]), name="Zürich")
    assert json.loads(to_json(row)) == {
        "id": 7, "when": "2026-11-22T04:30:01.250000", "day": "2026-01-02", "price": "12.50",
        "inner": {"a": 1, "tags": ["x", "y"]}, "name": "Zürich"}
    assert "Zürich".encode() in to_json(row)  # UTF-8, not \\u escapes


@pytest.mark.parametrize(("row", "expected"), [
    (Row(a=None, b=1.5), {"a": None, "b": 1.5}),
    (Row(a=None, b=float("nan")), {"a": None, "b": "NaN"}),  # a NaN beside a None
    (Row(a="null", b=float("inf")), {"a": "null", "b": "Infinity"}),  # "null" in a string
    (Row(a=Row(x=None), b=[float("-inf"), None]), {"a": {"x": None}, "b": ["-Infinity", None]}),
    ({"n": 2**70, 1: None}, {"n": 2**70, "1": None}),  # what orjson refuses: the stdlib's way
    ({"a": [None, float("nan")]}, {"a": [None, "NaN"]}),
    # a name twice: asDict keeps the last value, so the first's None is not written
    (Row("a", "b", "a")(None, float("nan"), 1), {"a": 1, "b": "NaN"}),
])
def test_json_tells_a_none_from_a_nan_whichever_way_the_row_is_written(row, expected):
    assert json.loads(to_json(row)) == expected


def test_msgpack_round_trips_a_row():
    row = Row(id=1, day=dt.date(2026, 1, 2), blob=b"\x00\x01")
    assert msgpack.unpackb(to_msgpack(row)) == {"id": 1, "day": "2026-01-02", "blob": b"\x00\x01"}


@pytest.mark.parametrize("value", [{1, 2}, object(), decimal.Decimal("NaN")])
def test_json_refuses_what_json_cannot_hold(value):
    with pytest.raises((TypeError, ValueError)):
        to_json({"v": value})


def test_json_writes_nan_infinities_and_binary_as_sparks_json_writer_does():
    row = Row(a=float("nan"), b=[float("inf"), 1.5], c=Row(d=float("-inf")), blob=b"\x00\xff")
    assert json.loads(to_json(row)) == {"a": "NaN", "b": ["Infinity", 1.5],
                                        "c": {"d": "-Infinity"}, "blob": "AP8="}


def test_a_bad_row_fails_the_task_with_where_and_why():
    publisher = PartitionPublisher("t", "tcp://127.0.0.1:1", timeout=0.1, retry_for=0)
    with pytest.raises(BadRowError, match=r"row 1 of partition None cannot be published: .*set"):
        publisher([{"ok": 1}, {"tags": {"a"}}])


def test_a_row_over_the_message_limit_is_a_bad_row():
    publisher = PartitionPublisher("t", "tcp://127.0.0.1:1", max_message_size=100)
    with pytest.raises(BadRowError, match="over the 100-byte message limit"):
        publisher([{"text": "x" * 200}])


def test_rows_are_serialised_a_chunk_at_a_time_and_each_bad_row_reported_where_it_is():
    rows: list[dict[str, object]] = [{"id": i} for i in range(300)]
    refused, too_large = {5: {"a"}, 7: {"b"}, 128: {"c"}, 150: {"d"}}, (6, 129, 299)
    for i, value in refused.items():
        rows[i] = {"tags": value}
    for i in too_large:
        rows[i] = {"id": "x" * 60}
    publisher = PartitionPublisher("t", "tcp://127.0.0.1:1", batch_size=32,
                                   batches_in_flight=4, max_message_size=40,
                                   bad_rows_topic="t.bad")
    bad: list[bytes] = []
    groups = list(publisher._row_batches(iter(rows), bad))
    # sent as they come (some 128 rows a time), not all at the end
    assert len(groups) > 1
    assert all(tag == "" for tag, _ in groups)
    mpubs = [m for _, ms in groups for m in ms]
    assert all(1 <= len(m) <= 32 for m in mpubs)
    assert [body for m in mpubs for body in m] == [
        to_json(r) for i, r in enumerate(rows) if i not in refused and i not in too_large]
    reports = sorted((r["index"], r["error"]) for r in map(json.loads, bad))
    assert [i for i, _ in reports] == sorted([*refused, *too_large])
    for i, error in reports:
        assert (f"set value {refused[i]!r} cannot be serialised" if i in refused
                else "69 bytes is over the 40-byte message limit") in error, (i, error)


@pytest.mark.parametrize("tag_column", [None, "tag"])
def test_rows_are_packed_into_mpubs_of_batch_size_under_the_byte_limit(monkeypatch, tag_column):
    import transport.spark as spark_module
    monkeypatch.setattr(spark_module, "MAX_BATCH_BYTES", 1000)
    rows = [{"tag": "ab"[i % 3 == 0], "text": chr(65 + i % 26) * (60 + i % 50)}
            for i in range(300)]
    big = {"tag": "a", "text": "z" * 2000}
    rows.insert(150, big)
    publisher = PartitionPublisher("t", "tcp://127.0.0.1:1", batch_size=7,
                                   batches_in_flight=3, max_message_size=10_000,
                                   tag_column=tag_column)
    bad: list[bytes] = []
    by_tag: dict[str, list] = {}
    for tag, mpubs in publisher._row_batches(iter(rows), bad):
        by_tag.setdefault(tag, []).extend(mpubs)
    assert not bad
    assert sorted(by_tag) == ([""] if tag_column is None else ["a", "b"])
    for tag, mpubs in by_tag.items():
        mine = [r for r in rows if tag_column is None or r["tag"] == tag]
        assert [body for m in mpubs for body in m] == [to_json(r) for r in mine]
        # each MPUB within the limit (4 bytes of count, then each body after its size),
        # and the row larger than it alone; filled, by rows or by bytes
        sizes = [4 + len(m.data) for m in mpubs]
        assert [s for s in sizes if s > 1000] == ([8 + len(to_json(big))] if tag != "b" else [])
        assert all(len(m) <= 7 for m in mpubs)
        assert len(mpubs) < len(mine) / 4


def test_a_partition_is_published_with_the_collector_held_off_and_cycles_still_collected(
        monkeypatch):
    import transport.spark as spark_module
    monkeypatch.setattr(spark_module, "_YOUNG_OBJECTS", 1000)

    class Cycle:
        me: object

    def leak() -> weakref.ref[Cycle]:
        cycle = Cycle()
        cycle.me = cycle
        return weakref.ref(cycle)

    assert gc.isenabled()
    with _young_collections_only() as collect:
        assert not gc.isenabled()
        refs = []
        for _ in range(5000):
            refs.append(leak())
            collect()
        alive = sum(ref() is not None for ref in refs)
        assert refs[0]() is None
        assert alive <= 1001  # at most those made since the last collection
    assert gc.isenabled()
    gc.disable()
    try:
        with _young_collections_only() as collect:
            collect()
        assert not gc.isenabled()  # as it was
    finally:
        gc.enable()


def test_publisher_checks_its_options_on_the_driver():
    with pytest.raises(ValueError, match="unknown serializer"):
        PartitionPublisher("t", "tcp://127.0.0.1:1", serializer="xml")
    with pytest.raises(ValueError, match="endpoint"):
        PartitionPublisher("t", "")
    with pytest.raises(ValueError, match="E_BAD_TOPIC PUB topic name \"no spaces\" is not valid"):
        PartitionPublisher("no spaces", "tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="E_BAD_TOPIC"):
        PartitionPublisher("t", "tcp://127.0.0.1:1", bad_rows_topic="x" * 65)
    assert PartitionPublisher("t", "tcp://a:1, tcp://b:2").endpoints == ("tcp://a:1", "tcp://b:2")


def test_the_reader_turns_serialised_values_back_by_schema():
    from pyspark.sql import types as t

    schema = t.StructType([
        t.StructField("id", t.LongType()), t.StructField("when", t.TimestampType()),
        t.StructField("day", t.DateType()), t.StructField("price", t.DecimalType(10, 2)),
        t.StructField("inner", t.StructType([t.StructField("a", t.LongType())])),
        t.StructField("missing", t.StringType())])
    when, day = dt.datetime(2026, 1, 2, 3, 4, 5), dt.date(2026, 1, 2)
    value = json.loads(to_json(Row(id=1, when=when, day=day, price=decimal.Decimal("1.25"),
                                   inner=Row(a=2))))
    assert _row_converter(schema)(value) == (1, when, day, decimal.Decimal("1.25"), (2,), None)


def test_the_reader_turns_nan_binary_maps_and_exact_decimals_back_and_names_a_bad_field():
    from pyspark.sql import types as t

    schema = t.StructType([
        t.StructField("d", t.DoubleType()), t.StructField("f", t.FloatType()),
        t.StructField("blob", t.BinaryType()),
        t.StructField("m", t.MapType(t.IntegerType(), t.DateType())),
        t.StructField("dec", t.DecimalType(38, 10)),
        t.StructField("arr", t.ArrayType(t.DoubleType()))])
    convert = _row_converter(schema)
    big = decimal.Decimal("1234567890123456789012345678.0123456789")
    # as Spark's JSON writer writes them (the decimal as an exact number)
    spark_json = (b'{"d":"NaN","f":"-Infinity","blob":"AP8=","m":{"7":"2020-01-01"},'
                  b'"dec":1234567890123456789012345678.0123456789,"arr":[1.5,"Infinity",null]}')
    value = json.loads(spark_json, parse_float=decimal.Decimal)
    d, f, blob, m, dec, arr = convert(value)
    assert math.isnan(d)
    assert (f, blob, m, dec) == (float("-inf"), b"\x00\xff", {7: dt.date(2020, 1, 1)}, big)
    assert arr == [1.5, float("inf"), None]
    assert all(type(x) is float for x in (d, f, arr[0]))
    # a string that is no number names its field
    with pytest.raises(ValueError, match="field d: 'oops' is not a number"):
        convert({"d": "oops"})


@pytest.mark.parametrize("buffered", [True, False], ids=["peek", "no-peek"])
def test_rows_are_read_as_runs_each_row_whole_and_a_row_too_large_alone(buffered):
    rows = [b"r%d" % i * (i % 7) for i in range(300)]
    rows[150] = b"x" * 100  # over the limit, with rows on both sides
    rows[151] = b"y" * 99   # at it: not bad
    stream = io.BytesIO(jvm_stream(rows, after=b"NEXT"))
    # a small read buffer: runs end where it does, and a row larger than it is read alone
    source = io.BufferedReader(stream, buffer_size=256) if buffered else stream
    got = list(_SizedRows(99).load_stream(source))
    assert source.read() == b"NEXT"  # it stopped right after END_OF_DATA_SECTION
    alone = [run for run in got if isinstance(run, bytes)]
    assert alone == [b"x" * 100]
    assert [body for run in got for body in ([run] if isinstance(run, bytes) else run)] == rows
    if buffered:  # runs, not a row at a time
        assert len(got) < len(rows) / 4


@pytest.mark.parametrize("stream", [b"", struct.pack(">i", 5) + b"abc",
                                    struct.pack(">i", -5)], ids=["none", "cut", "null"])
def test_a_stream_of_rows_that_ends_early_or_holds_a_null_is_an_error(stream):
    with pytest.raises((EOFError, ValueError)):
        list(_SizedRows(100).load_stream(io.BufferedReader(io.BytesIO(stream))))


@pytest.mark.parametrize("buffer_size", [300, 100_000], ids=["small runs", "one large run"])
def test_runs_are_published_as_mpubs_of_batch_size_and_a_row_too_large_is_a_bad_row(
        buffer_size):
    rows = [b'{"id":%d}' % i for i in range(1000)] + [b"z" * 50] + [b"{}"] * 10
    runs = list(_SizedRows(40).load_stream(
        io.BufferedReader(io.BytesIO(jvm_stream(rows)), buffer_size=buffer_size)))
    publisher = PartitionPublisher("t", "tcp://127.0.0.1:1", batch_size=64,
                                   batches_in_flight=3, max_message_size=40,
                                   bad_rows_topic="t.bad")
    bad: list[bytes] = []
    groups = list(publisher._sized_batches(runs, bad))
    # (never more than batches_in_flight at once: each publish goes to the next broker)
    assert all(tag == "" and 1 <= len(mpubs) <= 3 for tag, mpubs in groups)
    mpubs = [m for _, ms in groups for m in ms]
    assert [len(m) for m in mpubs] == [64] * 15 + [1010 - 64 * 15]
    assert [body for m in mpubs for body in m] == rows[:1000] + rows[1001:]
    assert len(bad) == 1
    report = json.loads(bad[0])
    assert (report["index"], report["error"]) == (1000, "50 bytes is over the 40-byte "
                                                        "message limit")


def test_runs_of_large_rows_are_cut_into_mpubs_under_the_byte_limit(monkeypatch):
    import transport.spark as spark_module
    monkeypatch.setattr(spark_module, "MAX_BATCH_BYTES", 1000)
    rows = [bytes([65 + i % 26]) * (90 + i % 20) for i in range(200)] + [b"z" * 2000, b"{}"]
    runs = list(_SizedRows(10_000).load_stream(
        io.BufferedReader(io.BytesIO(jvm_stream(rows)), buffer_size=5000)))
    publisher = PartitionPublisher("t", "tcp://127.0.0.1:1", batch_size=50,
                                   batches_in_flight=2, max_message_size=10_000)
    bad: list[bytes] = []
    mpubs = [m for _, ms in publisher._sized_batches(runs, bad) for m in ms]
    assert [body for m in mpubs for body in m] == rows
    assert not bad
    # each MPUB within the limit (4 bytes of count, then each body after its size),
    # and one row larger than it alone
    sizes = [4 + len(m.data) for m in mpubs]
    assert [s for s in sizes if s > 1000] == [4 + 4 + 2000]
    assert all(len(m) <= 50 for m in mpubs)
    assert len(mpubs) < 40  # (filled, not a row each)

