"""Spark in both directions: publish partitions to a topic, read a topic back in micro-batches.

Producing
---------
``PartitionPublisher`` is a picklable callable for ``df.foreachPartition`` or
``rdd.foreachPartition``.  Each task opens one :class:`transport.client.Producer`
(one ZeroMQ connection per broker), serialises its rows (JSON by default,
msgpack, or any ``row -> bytes`` function) and publishes them as pipelined
MPUBs, waiting for every acknowledgement.  A broker that stops answering is
retried with capped backoff on the next address for ``retry_for`` seconds;
after that the task raises :class:`~transport.client.PublishError`, Spark
retries the task (``spark.task.maxFailures``) and, when it keeps failing, the
job fails.  Rows are never dropped silently: a row that cannot be serialised
either fails the task with :class:`BadRowError` (the default) or, with
``bad_rows_topic`` set, is published there as a JSON report and counted.
``PublishCounters`` carries Spark accumulators for rows published, rows sent
again after a broker failed to answer, and bad rows.

``publisher.foreach_batch`` is the same publisher as a Structured Streaming
``foreachBatch`` sink; with ``epochs_path`` it marks each epoch it published
in full, and does not publish a replayed epoch again.

Delivery is at-least-once: a retried task, a retried streaming epoch or a
broker that stored a batch but died before answering publishes rows again.

Consuming
---------
``TopicReader`` subscribes to a topic/channel with FIN held back
(``auto_finish=False``), gathers up to ``batch_size`` messages (or whatever
arrived within ``batch_timeout``) and yields them as a :class:`Batch` holding
a DataFrame.  Nothing is FINed until ``batch.commit()``; an uncommitted batch
is requeued (when the next batch is asked for, or by the broker when the
reader closes or dies), so a crash before the commit re-delivers instead of
losing.
``drain_to_parquet`` is the ``nsq_to_file`` of this library: it writes each
batch to Parquet, fsyncs the new files when the path is local, writes
messages that could not be decoded to ``<path>/_bad_messages``, and commits.

A batch is limited by in-flight messages, and the broker caps RDY at
``--max-rdy-count`` per connection (2,500 by default, as nsqd), so the reader
opens ``ceil(2 * batch_size / rdy_per_connection)`` connections per broker:
room for the next batch to arrive while this one is written.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime as dt
import decimal
import functools
import gc
import itertools
import json
import logging
import math
import os
import queue
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zipimport
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json
import pyarrow.parquet as pq
from pyspark import RDD, InheritableThread, TaskContext
from pyspark.serializers import Serializer as SparkSerializer
from pyspark.serializers import SpecialLengths, UTF8Deserializer
from pyspark.sql import DataFrame, Observation
from pyspark.sql import functions as F
from pyspark.sql import types as t
from pyspark.sql.types import _make_type_verifier

from transport.client import (
    MAX_BATCH_BYTES,
    Consumer,
    Delivery,
    Producer,
    PublishError,
    discover,
)
from transport.protocol.validation import TAG_RULE, ProtocolError, check_topic, valid_tag
from transport.zmq.codec import Columns, SizedBodies, sized

log = logging.getLogger(__name__)

Serializer = Callable[[Any], bytes]
_SIZE = struct.Struct(">i")  # a row's size before it, as the JVM hands rows to Python
Deserializer = Callable[[bytes], Any]


class BadRowError(ValueError):
    """A row could not be serialised (or is larger than the broker accepts)."""


# -- serialisation ----------------------------------------------------------

def _plain(row: Any) -> Any:
    """A pyspark ``Row`` as a dict (recursively); anything else as it is."""
    as_dict = getattr(row, "asDict", None)
    return as_dict(recursive=True) if as_dict is not None else row


def _encode_value(value: Any) -> Any:
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(value).decode("ascii")  # as Spark's JSON writes binary
    if isinstance(value, decimal.Decimal):
        if not value.is_finite():
            raise ValueError(f"{value} is not a finite decimal")
        return str(value)
    as_dict = getattr(value, "asDict", None)
    if as_dict is not None:
        return as_dict(recursive=True)
    raise TypeError(f"{type(value).__name__} value {value!r:.80} cannot be serialised")


def _spark_floats(value: Any) -> Any:
    """`value` with NaN and infinities as the strings Spark's JSON writer uses."""
    if type(value) is float:
        return value if math.isfinite(value) else _NONFINITE[str(value)]
    if type(value) is dict:
        return {k: _spark_floats(v) for k, v in value.items()}
    if type(value) is list or type(value) is tuple:
        return [_spark_floats(v) for v in value]
    return value


_NONFINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def _shallow(value: Any) -> Any:
    """orjson's ``default``: a ``Row`` as a dict of its values (orjson calls this again
    for the Rows inside), anything else as :func:`_encode_value` has it."""
    as_dict = getattr(value, "asDict", None)
    return as_dict() if as_dict is not None else _encode_value(value)


_ORJSON = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS


def _nulls(row: Any) -> int:
    """How many of a row's own values (not those inside them) are None; -1 for a Row
    whose field names repeat (``asDict`` keeps one value a name: its count is not
    the output's)."""
    if isinstance(row, tuple):
        fields = getattr(row, "__fields__", None)
        if fields is not None and len(set(fields)) < len(fields):
            return -1
        return row.count(None)
    if type(row) is dict:
        return list(row.values()).count(None)
    return 0


def to_json(row: Any) -> bytes:
    """Strict JSON, in Spark's conventions: NaN and infinities as ``"NaN"``,
    ``"Infinity"`` and ``"-Infinity"``, binary as base64, dates and times as ISO 8601,
    decimals as strings (exact)."""
    # a copy of its own size: the bytes orjson returns keep the page it wrote in, so a
    # list of rows held would hold (and fault in) 4 KiB a row (2.5 us a row of 100 B
    # held, against 0.5 for the copy); a publisher packs `_json`'s at once instead
    return bytes(memoryview(_json(row)))


def _json(row: Any) -> bytes:
    """`to_json`'s bytes as made, for a body not held (`_Packer`)."""
    # orjson first (4x faster on a Row): it writes NaN and the infinities as null, so
    # its answer stands only if each null in it is one of the row's own None values;
    # a NaN, a None inside a value, or "null" inside a string, and the row goes the
    # stdlib's way below, as do what orjson refuses (ints past 64 bits, keys that are
    # not strings) and bad rows (to be refused with the stdlib's reason)
    # (a Row's dict made here, as ``asDict`` makes it, rather than in a call back from
    # orjson: 1.6 us a row of two fields against 1.9)
    # (zip without ``strict=``, ``find`` for ``in``, arguments by position: 0.3-0.4 us
    # of a 1.3 us row of two fields)
    fields = getattr(row, "__fields__", None) if type(row) is t.Row else None
    value = row if fields is None else dict(zip(fields, row))  # noqa: B905 (the same length)
    try:
        out = orjson.dumps(value, _shallow, _ORJSON)
    except TypeError:
        pass
    else:
        if out.find(b"null") < 0 or out.count(b"null") == _nulls(row):
            return out
    plain = _plain(row)
    try:
        return json.dumps(plain, default=_encode_value, allow_nan=False,
                          ensure_ascii=False, separators=(",", ":")).encode()
    except ValueError:  # a NaN or an infinity somewhere: the slow path, only for those rows
        return json.dumps(_spark_floats(plain), default=_encode_value, allow_nan=False,
                          ensure_ascii=False, separators=(",", ":")).encode()


def to_msgpack(row: Any) -> bytes:
    """msgpack; dates and times as ISO 8601 strings, decimals as strings."""
    return msgpack.packb(_plain(row), default=_encode_value, datetime=False)


def raw(row: Any) -> bytes:
    """Rows that are already messages: ``str`` as UTF-8, ``bytes`` as they are."""
    if isinstance(row, str):
        return row.encode()
    if isinstance(row, bytes | bytearray | memoryview):
        return bytes(row)
    raise TypeError(f"raw rows must be str or bytes, not {type(row).__name__}")


def _serializer(spec: str | Serializer) -> Serializer:
    if callable(spec):
        return spec
    try:
        # (a publisher's serializer: its bodies are packed at once, `_Packer`)
        return {"json": _json, "msgpack": to_msgpack, "raw": raw, _TAGGED: raw, _SIZED: raw}[spec]
    except KeyError:
        raise ValueError(f"unknown serializer {spec!r} (json, msgpack, raw or a function)") \
            from None


def _deserializer(spec: str | Deserializer) -> Deserializer:
    if callable(spec):
        return spec
    try:
        return {"json": json.loads, "msgpack": msgpack.unpackb}[spec]
    except KeyError:
        raise ValueError(f"unknown deserializer {spec!r} (json, msgpack or a function)") from None


# -- producing ----------------------------------------------------------------

@dataclass
class PublishCounters:
    """Spark accumulators a publisher adds to (read ``.value`` on the driver after the job)."""

    published: Any
    retried: Any
    bad_rows: Any

    @classmethod
    def create(cls, sc: Any) -> PublishCounters:
        return cls(sc.accumulator(0), sc.accumulator(0), sc.accumulator(0))

    def values(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name).value for f in dataclasses.fields(self)}


_CLIENT_OPTIONS = frozenset({"auth_secret", "curve_server_key", "curve_keypair"})


def _client_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``client_options`` checked on the driver: the brokers' AUTH secret
    (``auth_secret``) and CURVE keys (``curve_server_key``, ``curve_keypair``)."""
    unknown = set(options) - _CLIENT_OPTIONS
    if unknown:
        raise ValueError(f"unknown client option {sorted(unknown)[0]!r} (one of "
                         f"{', '.join(sorted(_CLIENT_OPTIONS))})")
    return dict(options)


def _addresses(endpoints: str | Sequence[str], lookupds: Sequence[str] = ()
               ) -> tuple[str, ...]:
    """Endpoints as a tuple (from a list or a comma-separated string); at least one of
    them or of the lookup daemons is needed."""
    eps = tuple(e.strip() for e in endpoints.split(",")) if isinstance(endpoints, str) \
        else tuple(endpoints)
    if not all(eps) or not (eps or lookupds):
        raise ValueError("need at least one broker endpoint (tcp://host:port) or "
                         "lookupd_http_addresses")
    return eps


# rows serialised by one ``map``: few, so that the Rows are not held (a chunk of 16,000
# by one map cost more than the loop saved, 2.4-2.8 us a row against 2.0, the collector
# on; 32-128 at a time 1.63-1.65)
_SERIALISED = 64


@dataclass(frozen=True)
class PartitionPublisher:
    """``rdd.foreachPartition(PartitionPublisher("topic", "tcp://broker:4153"))``.

    ``endpoints`` is one ``tcp://host:port`` ZeroMQ address, a list of them or
    a comma-separated string; they are used round-robin.  With
    ``lookupd_http_addresses`` (``host:port`` of lookup daemons' HTTP APIs) each
    task also publishes to every broker the daemons list (``/nodes``), asked
    when the task starts.
    """

    topic: str
    endpoints: str | Sequence[str] = ()
    lookupd_http_addresses: Sequence[str] = ()
    serializer: str | Serializer = "json"
    batch_size: int = 2000          # messages per MPUB (and at most 4 MiB of them)
    batches_in_flight: int = 8      # MPUBs pipelined before waiting for their answers
    timeout: float = 5.0            # seconds to wait for an answer before trying again
    retry_for: float = 60.0         # keep retrying this long, then fail the task
    max_backoff: float = 5.0
    max_message_size: int = 1024 * 1024  # the broker's --max-msg-size
    bad_rows_topic: str | None = None
    counters: PublishCounters | None = None
    epochs_path: str | None = None  # foreach_batch: where published epochs are marked
    # the column whose value tags each row's message (#21; null: no tag); a channel with
    # a tag filter takes only its tags.  Rows of one tag keep their order, not across tags
    tag_column: str | None = None
    # the brokers' AUTH secret and CURVE keys (docs/SECURITY.md), passed to each Producer
    client_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "client_options", _client_options(self.client_options))
        object.__setattr__(self, "lookupd_http_addresses", tuple(self.lookupd_http_addresses))
        object.__setattr__(self, "endpoints",
                           _addresses(self.endpoints, self.lookupd_http_addresses))
        # fail on the driver, not in every task
        _serializer(self.serializer)
        for topic in filter(None, (self.topic, self.bad_rows_topic)):
            try:
                check_topic(topic.encode(), "PUB")
            except ProtocolError as e:
                raise ValueError(f"{e.code} {e.text}") from None
        if self.batch_size < 1 or self.batches_in_flight < 1:
            raise ValueError("batch_size and batches_in_flight must be positive")

    def __call__(self, rows: Iterable[Any]) -> None:
        _zip_directories_reread_only_when_changed()
        if self.serializer == _SIZED:  # (from `publish`: runs of JSON rows, see _SizedRows)
            self._publish(lambda bad: self._sized_batches(rows, bad))
        else:
            self._publish(lambda bad: self._row_batches(rows, bad))

    def _publish(self, batches: Callable[[list[bytes]],
                                         Iterator[tuple[str, list[Sequence[bytes]]]]]
                 ) -> None:
        """Publish the MPUBs `batches` yields (a list at a time, pipelined), then the bad
        rows it collected, and count them."""
        published = retried = 0
        bad: list[bytes] = []
        endpoints = list(self.endpoints)
        if self.lookupd_http_addresses:
            endpoints += [e for e in discover(self.lookupd_http_addresses) if e not in endpoints]
            if not endpoints:
                raise PublishError("no broker: the lookup daemons list none")
        with _young_collections_only() as collect, \
                Producer(endpoints, timeout=self.timeout, max_attempts=1,
                         max_backoff=self.max_backoff, retry_for=self.retry_for,
                         **self.client_options) as producer:
            for tag, mpubs in batches(bad):
                producer.publish_mpubs(self.topic, mpubs, tag=tag)
                published += sum(map(len, mpubs))
                collect()
            if bad:
                assert self.bad_rows_topic is not None
                producer.publish_batch(self.bad_rows_topic, bad, self.batch_size)
            retried = producer.retried
        if self.counters is not None:
            self.counters.published.add(published)
            self.counters.retried.add(retried)
            self.counters.bad_rows.add(len(bad))

    def _row_batches(self, rows: Iterable[Any], bad: list[bytes]
                     ) -> Iterator[tuple[str, list[Sequence[bytes]]]]:
        """Each row serialised, as MPUBs by tag ('' for none: every one without a tag
        column), `batches_in_flight` MPUBs' worth of rows at a time."""
        serialise = _serializer(self.serializer)
        lines = self.serializer == _TAGGED  # (from `publish` with a tag column)
        packers: dict[str, _Packer] = {}
        if lines or self.tag_column is not None:
            chunk, gathered = self.batch_size * self.batches_in_flight, 0
            for index, row in enumerate(rows):
                try:
                    tag, body = self._tagged_body(row, serialise, lines)
                    if len(body) > self.max_message_size:
                        raise self._too_large(len(body))
                except (TypeError, ValueError, OverflowError, KeyError) as e:
                    bad.append(self._bad_row(index, row, e))
                    continue
                packer = packers.get(tag)
                if packer is None:
                    packer = packers[tag] = _Packer(self.batch_size)
                packer.add_one(body)
                gathered += 1
                if gathered >= chunk:
                    for tag_, packer in packers.items():
                        yield tag_, packer.take()
                    packers, gathered = {}, 0
        else:  # untagged: `_SERIALISED` rows at a time by map, not a Python loop a row
            rows, base = iter(rows), 0
            packer = packers[""] = _Packer(self.batch_size)
            while taken := list(itertools.islice(rows, min(_SERIALISED, packer.room()))):
                packer.add(self._bodies(taken, serialise, base, bad))
                base += len(taken)
                while len(packer.mpubs) >= self.batches_in_flight:
                    yield "", packer.full(self.batches_in_flight)
        for tag_, packer in packers.items():
            if mpubs := packer.take():
                yield tag_, mpubs

    def _bodies(self, rows: list[Any], serialise: Serializer, base: int, bad: list[bytes]
                ) -> list[bytes]:
        """`serialise` of each of `rows` (rows `base` on of the partition), by ``map`` (no
        Python loop a row); those it refuses or makes too large put in `bad`."""
        bodies: list[bytes] = []
        refused: list[int] = []
        while True:
            at = len(bodies) + len(refused)  # (extend keeps what map gave before a raise)
            try:
                bodies.extend(map(serialise, rows[at:] if at else rows))
                break
            except (TypeError, ValueError, OverflowError, KeyError) as e:
                i = len(bodies) + len(refused)
                bad.append(self._bad_row(base + i, rows[i], e))
                refused.append(i)
        if max(map(len, bodies), default=0) > self.max_message_size:
            skip = set(refused)
            kept = []
            for i, body in zip((i for i in range(len(rows)) if i not in skip), bodies,
                               strict=True):
                if len(body) > self.max_message_size:
                    bad.append(self._bad_row(base + i, rows[i], self._too_large(len(body))))
                else:
                    kept.append(body)
            bodies = kept
        return bodies

    def _sized_batches(self, runs: Iterable[SizedBodies | bytes], bad: list[bytes]
                       ) -> Iterator[tuple[str, list[Sequence[bytes]]]]:
        """`_SizedRows`' runs joined into MPUBs (`_Packer`), `batches_in_flight` at a
        time."""
        packer = _Packer(self.batch_size)
        index = 0
        for run in runs:
            if not isinstance(run, SizedBodies):  # a row over max_message_size, alone
                bad.append(self._bad_row(index, run, self._too_large(len(run))))
                index += 1
                continue
            index += run.number
            packer.add_run(run)  # (a run may make many MPUBs: a few at a time)
            while len(packer.mpubs) >= self.batches_in_flight:
                yield "", packer.full(self.batches_in_flight)
        if mpubs := packer.take():
            yield "", mpubs

    def _too_large(self, size: int) -> ValueError:
        return ValueError(f"{size} bytes is over the {self.max_message_size}-byte "
                          "message limit")

    def _tagged_body(self, row: Any, serialise: Serializer, lines: bool) -> tuple[str, bytes]:
        """`(tag, message body)` of a row; ValueError for a tag that is not one."""
        if lines:  # ``tag NUL json``: the last NUL (JSON has none; a tag with one is bad)
            raw_tag, _, body = bytes(row).rpartition(b"\0")
            tag = raw_tag.decode("utf-8", "replace")
        elif self.tag_column is None:
            return "", serialise(row)
        else:
            value = row[self.tag_column]
            tag = "" if value is None else str(value)
            body = serialise(row)
        if tag and not valid_tag(tag.encode("utf-8")):
            raise ValueError(f"bad tag {tag!r} in column {self.tag_column} ({TAG_RULE})")
        return tag, body

    def _bad_row(self, index: int, row: Any, error: Exception) -> bytes:
        partition = _partition_id()
        where = f"row {index} of partition {partition}"
        if self.bad_rows_topic is None:
            raise BadRowError(f"{where} cannot be published: {error}; row: {row!r:.200}") \
                from error
        log.warning("bad %s sent to %s: %s", where, self.bad_rows_topic, error)
        return json.dumps({"topic": self.topic, "partition": partition, "index": index,
                           "error": str(error), "row": repr(row)[:4096]}).encode()

    def publish(self, df: Any) -> None:
        """Publish every row of DataFrame `df` (runs a Spark job).

        With the JSON serializer, Spark's own JSON writer (in the JVM) turns
        rows into messages and the Python workers only publish them: about
        twice the rows per second of ``df.foreachPartition(self)``, which
        builds every ``Row`` in Python.  Its conventions are :func:`to_json`'s
        (``"NaN"``, binary as base64, timestamps with their zone), except
        decimals, written as exact JSON numbers; timestamps keep their
        microseconds (``df.toJSON()`` would cut them to milliseconds).  Every
        value of a DataFrame has a JSON form, so only rows over
        ``max_message_size`` can be bad.  Other serializers go through
        ``foreachPartition``.
        """
        _check_python_workers(df.sparkSession.sparkContext)
        if self.tag_column is not None and self.tag_column not in df.columns:
            raise ValueError(f"tag_column {self.tag_column!r} is not a column of the "
                             f"DataFrame ({', '.join(df.columns)})")
        if self.serializer == "json" and self.tag_column is not None:
            _json_lines(df, self.tag_column).foreachPartition(
                dataclasses.replace(self, serializer=_TAGGED))
        elif self.serializer == "json":
            _json_lines(df, rows=_SizedRows(self.max_message_size)).foreachPartition(
                dataclasses.replace(self, serializer=_SIZED))
        else:
            df.foreachPartition(self)

    def foreach_batch(self, batch_df: Any, epoch_id: int) -> None:
        """A Structured Streaming sink: ``stream.writeStream.foreachBatch(p.foreach_batch)``.

        With ``epochs_path`` (a directory on any Hadoop file system; give each
        query its own, e.g. beside its checkpoint) an epoch whose rows were all
        published is marked there, and a replay of a marked epoch -- Spark runs
        the last epoch again when the query restarts from a checkpoint that had
        not recorded it -- publishes nothing.  Without it, a replay publishes
        its rows again (at least once)."""
        if self.epochs_path is None:
            self.publish(batch_df)
            return
        marks = _EpochMarks(batch_df.sparkSession, self.epochs_path)
        if marks.done(epoch_id):
            log.warning("epoch %d of %s was published before (a replay): not again",
                        epoch_id, self.topic)
            return
        self.publish(batch_df)
        marks.mark(epoch_id)


class _EpochMarks:
    """One empty file per epoch a streaming sink published in full, named by its id,
    through Hadoop's file systems (the ones Spark's checkpoints use).  The newest
    ``keep`` stay: Spark replays only the last epoch, and keeps 100 in its own
    checkpoint (``spark.sql.streaming.minBatchesToRetain``)."""

    keep = 100

    def __init__(self, spark: Any, root: str) -> None:
        jvm = spark._jvm
        self._path = jvm.org.apache.hadoop.fs.Path
        self._root = self._path(root)
        self._fs = self._root.getFileSystem(spark._jsc.hadoopConfiguration())

    def _of(self, epoch: int) -> Any:
        return self._path(self._root, str(epoch))

    def done(self, epoch: int) -> bool:
        return bool(self._fs.exists(self._of(epoch)))

    def mark(self, epoch: int) -> None:
        self._fs.create(self._of(epoch), True).close()
        if epoch >= self.keep:
            self._fs.delete(self._of(epoch - self.keep), False)


def _zip_directories_reread_only_when_changed() -> None:
    """In a Spark Python worker: make each later task's start ~75 ms shorter.

    A Python worker calls ``importlib.invalidate_caches()`` as each task starts, and on
    Python < 3.13 that makes every ``zipimporter`` read its archive's whole directory
    again, in Python: the worker's path holds ``pyspark.zip``, py4j's zip and
    spark-core's jar (thousands of entries), with one importer for each package
    imported from them -- 75 ms a task, measured, about a core's tenth of a second for
    every task of a 4-partition job (BENCHMARKS.md).  A reused worker then reads an
    archive again only when its file changed (its mtime, ctime, size or inode), which
    is what the reread is for.  The driver is left as it is."""
    if TaskContext.get() is None or getattr(zipimport.zipimporter.invalidate_caches,
                                            "_when_changed", False):
        return
    reread = zipimport.zipimporter.invalidate_caches

    def invalidate_caches(self: zipimport.zipimporter) -> None:
        try:
            st = os.stat(self.archive)
            seen: Any = (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)
        except OSError:
            seen = None
        if seen is None or self.__dict__.get("_seen") != seen:
            reread(self)
            self.__dict__["_seen"] = seen

    invalidate_caches._when_changed = True  # type: ignore[attr-defined]
    zipimport.zipimporter.invalidate_caches = invalidate_caches  # type: ignore[method-assign]


_WORKERS_CHECKED: set[str] = set()


def _check_python_workers(sc: Any) -> None:
    """Spark's Python workers run ``PYSPARK_PYTHON`` (``python3`` from PATH when unset),
    which need not be this interpreter: without it, every task of the first job failed
    with ``No module named 'transport'``.  On a local master, a worker interpreter that
    cannot import this package is replaced by this one (with a warning).  On a cluster
    the executors' Python is the cluster's to set (docs/SPARK.md): the driver cannot
    see it."""
    exe = sc.pythonExec
    if exe in _WORKERS_CHECKED or exe == sys.executable or not sc.master.startswith("local"):
        return
    try:
        ok = subprocess.run([shutil.which(exe) or exe, "-c", "import transport.spark"],
                            capture_output=True, timeout=60, check=False).returncode == 0
    except OSError:
        ok = False
    if ok:
        _WORKERS_CHECKED.add(exe)
        return
    log.warning("Spark's Python workers would run %r, which cannot import transport; "
                "running them on %s instead (set PYSPARK_PYTHON to choose)", exe, sys.executable)
    sc.pythonExec = sys.executable


_JSON_OPTIONS = {"timestampFormat": "yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX",
                 "timestampNTZFormat": "yyyy-MM-dd'T'HH:mm:ss.SSSSSS"}


_TAGGED = "_tagged_lines"
"""The serializer `publish` hands its tasks with ``tag_column``: each row is the tag,
a NUL, then the row's JSON."""


_SIZED = "_sized_runs"
"""The serializer `publish` hands its tasks without a tag column: they are given runs of
rows as :class:`_SizedRows` reads them."""


@contextlib.contextmanager
def _young_collections_only() -> Iterator[Callable[[], object]]:
    """The cyclic garbage collector held off while a partition is published, as it was
    again at the end.  What it saves: a worker unpickling Rows promotes them past the
    young generations, and each full collection then walks every object of the
    process, 45 ms a time, 15 % of a partition's time (BENCHMARKS.md).  The caller
    calls what it yields after each chunk: a collection of the young generations, if
    more than ``_YOUNG_OBJECTS`` objects were made and not freed since the last (a
    cycle a row, a serializer's, is still collected; Rows freed as they are published
    never count up to it, and a collection of the pickled batch alive, each chunk, cost
    0.7 us a row)."""
    if not gc.isenabled():
        yield lambda: None
        return

    def collect() -> None:
        if gc.get_count()[0] > _YOUNG_OBJECTS:
            gc.collect(1)

    gc.disable()
    try:
        yield collect
    finally:
        gc.enable()


_YOUNG_OBJECTS = 200_000


class _Packer:
    """MPUBs made as their bodies come, each body after its size (a `SizedBodies`, what
    a PMPUB sends): at most `most` bodies an MPUB and no more than ``MAX_BATCH_BYTES``
    (a body larger alone goes alone, for the broker to refuse), as ``split_batches``
    cuts them.  A body is copied in as it is added, so none is held past it (nor the
    4 KiB orjson wrote it in: `_json`); a run of sized rows (`_SizedRows`) is cut, not
    copied."""

    __slots__ = ("_number", "_parts", "_size", "most", "mpubs")

    def __init__(self, most: int) -> None:
        self.most = most
        self.mpubs: list[Sequence[bytes]] = []  # closed
        self._parts: list[bytes] = []  # the open MPUB's
        self._number = self._size = 0

    def room(self) -> int:
        """How many bodies the open MPUB takes yet (at least one)."""
        return self.most - self._number

    def add(self, bodies: list[bytes]) -> None:
        """`bodies`, no more than `room` of them."""
        self.add_run(SizedBodies(len(bodies), sized(bodies)))

    def add_one(self, body: bytes) -> None:
        if self._number and self._size + 4 + len(body) > MAX_BATCH_BYTES - 4:
            self._close()
        self._put(1, _SIZE.pack(len(body)) + body)

    def add_run(self, run: SizedBodies) -> None:
        while run.number:
            head, run = run.take(self.most - self._number, MAX_BATCH_BYTES - 4 - self._size)
            if not head.number:
                if self._number:  # full by bytes
                    self._close()
                    continue
                head, run = run.take(1, len(run.data))  # (over MAX_BATCH_BYTES alone)
            self._put(head.number, head.data)

    def full(self, most: int | None = None) -> list[Sequence[bytes]]:
        """The MPUBs closed so far (the first `most` of them)."""
        most = len(self.mpubs) if most is None else most
        mpubs, self.mpubs = self.mpubs[:most], self.mpubs[most:]
        return mpubs

    def take(self) -> list[Sequence[bytes]]:
        """Every MPUB made, the open one closed."""
        if self._number:
            self._close()
        return self.full()

    def _put(self, number: int, data: bytes) -> None:
        self._parts.append(data)
        self._number += number
        self._size += len(data)
        if self._number >= self.most:
            self._close()

    def _close(self) -> None:
        self.mpubs.append(SizedBodies(self._number, b"".join(self._parts)))
        self._parts, self._number, self._size = [], 0, 0


class _SizedRows(SparkSerializer):
    """What the JVM sends a Python worker for an RDD of strings, as runs of rows.

    The JVM writes each row as its UTF-8 bytes after their size (4-byte big-endian),
    then ``END_OF_DATA_SECTION`` (-1): NSQ's MPUB body is that same form.  So rather
    than a ``bytes`` a row, this yields `SizedBodies` of the whole rows the worker's
    read buffer holds (walking their sizes, one ``read`` for them all), and a row
    over `max_size` alone as ``bytes``; `PartitionPublisher` sends the runs joined as
    PMPUBs, with no object made a row (a job that only hands 2 million rows over
    counted 1.65-1.99 million a second so, 1.37-1.45 million as a ``bytes`` a row:
    BENCHMARKS.md)."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size

    def load_stream(self, stream: Any) -> Iterator[SizedBodies | bytes]:
        size = _SIZE.unpack_from
        peek = getattr(stream, "peek", None)
        limit = self.max_size
        while True:
            if peek is not None:
                buf = peek(1)  # what the buffer holds (a read of the socket if nothing)
                end, pos, count = len(buf), 0, 0
                while pos + 4 <= end:
                    (n,) = size(buf, pos)
                    if n < 0 or n > limit or pos + 4 + n > end:
                        break
                    pos += 4 + n
                    count += 1
                if count:
                    yield SizedBodies(count, stream.read(pos))
                    continue
            head = stream.read(4)
            if len(head) < 4:
                raise EOFError("the rows' stream ended without END_OF_DATA_SECTION")
            (n,) = size(head)
            if n == SpecialLengths.END_OF_DATA_SECTION:
                return
            if n < 0:
                raise ValueError(f"special length {n} in a stream of rows of text")
            row = stream.read(n)
            if len(row) < n:
                raise EOFError("the rows' stream ended inside a row")
            yield row if n > limit else SizedBodies(1, head + row)


def _json_lines(df: Any, tag_column: str | None = None,
                rows: SparkSerializer | None = None
                ) -> Any:
    """An RDD of each row of `df` as JSON bytes, written by the JVM (as ``df.toJSON``
    does, with microseconds); with `tag_column`, each preceded by its tag and a NUL.
    `rows` reads them in the Python workers (default: one ``bytes`` a row)."""
    columns = [F.col("`{}`".format(c.replace("`", "``"))) for c in df.columns]
    line = F.to_json(F.struct(*columns), _JSON_OPTIONS)
    if tag_column is not None:
        tag = F.coalesce(F.col("`{}`".format(tag_column.replace("`", "``"))).cast("string"),
                         F.lit(""))
        line = F.concat(tag, F.lit("\0"), line)
    lines = df.select(line)
    jvm = df.sparkSession._jvm
    strings = getattr(lines._jdf, "as")(jvm.org.apache.spark.sql.Encoders.STRING())
    return RDD(strings.javaRDD(), df.sparkSession.sparkContext,
               rows or UTF8Deserializer(use_unicode=False))


def _partition_id() -> int | None:
    ctx = TaskContext.get()
    return ctx.partitionId() if ctx is not None else None


# -- consuming ----------------------------------------------------------------

@dataclass
class BadMessage:
    """A message the reader could not turn into a row (FINed with its batch)."""

    id: bytes
    body: bytes
    error: str


@dataclass
class Batch:
    """One micro-batch: ``df`` holds its rows; FIN them with ``commit()`` once they are safe.

    ``duplicates`` counts messages left out because this reader committed the same
    message id before (a redelivery: see ``TopicReader``'s ``dedupe_window``); they
    are FINed with the batch."""

    df: Any
    rows: int
    bad: list[BadMessage]
    _gathered: _Gathered = field(repr=False)  # its messages, as the brokers sent them
    committed: bool = False
    duplicates: int = 0
    # (the reader's: the messages are no longer held, and, committed, are remembered)
    _on_settled: Callable[[_Gathered, bool], None] | None = field(default=None, repr=False)
    _framed: _Framed | None = field(default=None, repr=False)  # its Spark side

    @property
    def deliveries(self) -> list[Delivery]:
        """Its messages, as the brokers delivered them."""
        return self._gathered.deliveries

    def _release(self) -> None:
        """Free the batch's staged file, if it has one."""
        if self._framed is not None and self._framed.release is not None:
            self._framed.release()

    def _settle(self) -> None:
        """A drain's batch, once written: its lines the write refused become bad."""
        if self._framed is not None and self._framed.settle is not None:
            self._framed.settle(self)

    def commit(self) -> None:
        for d in self.deliveries:
            d.finish()
        self.committed = True
        if self._on_settled is not None:
            self._on_settled(self._gathered, True)

    def requeue(self) -> None:
        for d in self.deliveries:
            d.requeue(0)
        if self._on_settled is not None:
            self._on_settled(self._gathered, False)


class TopicReader:
    """Reads ``topic``/``channel`` into Spark in micro-batches; see the module docstring.

    ``schema`` is a ``StructType`` or a DDL string; without one the first
    batch's inferred schema is used for every later batch.  ``idle_timeout``
    ends ``batches()`` when no message has come for that long (``None``:
    read until ``close()``).  ``metadata=True`` adds ``_nsq_id`` (hex),
    ``_nsq_timestamp`` (ns) and ``_nsq_attempts`` columns, which let a
    downstream job drop the duplicates at-least-once delivery allows.
    ``dedupe_window`` > 0 leaves out of a batch a message whose id, from the same
    broker, was among the last ``dedupe_window`` this reader committed (a
    redelivery, e.g. after a FIN lost with a broker; ids are unique per broker
    only, so the same id from two brokers is two messages); ``Batch.duplicates``
    counts them, and they are FINed with the batch.  (At least that many ids are
    remembered, and up to a quarter more: see ``_Remembered``.)

    With the JSON deserializer, Spark's own JSON reader makes the rows: the
    driver only checks that each body is one whole JSON object and stages the
    batch as JSON lines under ``staging_path`` (a local temporary directory by
    default; on a cluster whose executors do not share the driver's disk, a
    path they can read, e.g. on HDFS), and a batch's DataFrame reads that file
    until the next batch is asked for (write or cache it before).  Other
    deserializers build the rows in Python.
    """

    def __init__(self, spark: Any, topic: str, channel: str,
                 endpoints: str | Sequence[str] = (), *,
                 schema: Any = None, deserializer: str | Deserializer = "json",
                 batch_size: int = 10_000, batch_timeout: float = 5.0,
                 idle_timeout: float | None = 10.0, rdy_per_connection: int = 2500,
                 msg_timeout_ms: int = 120_000, metadata: bool = False,
                 lookupd_http_addresses: Sequence[str] = (),
                 lookupd_poll_interval: float = 60.0, dedupe_window: int = 0,
                 staging_path: str | None = None,
                 client_options: Mapping[str, Any] | None = None) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be positive")
        # (broker, id) of the messages committed lately: a redelivery of one is left out
        self._seen = _Remembered(dedupe_window)
        self._dedupe_window = dedupe_window
        self.spark = spark
        # the bodies' schema (None: inferred from the first batch); `schema` is the
        # DataFrame's, with the metadata columns
        self._body_schema: t.StructType | None = (t._parse_datatype_string(schema)
                                                  if isinstance(schema, str) else schema)
        self.decode = _deserializer(deserializer)
        self._staging = (_Staging(spark, staging_path)
                         if deserializer == "json" and _spark_reads_json(self._body_schema)
                         else None)
        if deserializer == "json" and self._body_schema is not None \
                and _has_decimal(self._body_schema):
            # exact decimals: Spark's JSON writes them as numbers, which floats would round
            self.decode = functools.partial(json.loads, parse_float=decimal.Decimal)
        self.batch_size = batch_size
        self.batch_timeout = batch_timeout
        self.idle_timeout = idle_timeout
        self.metadata = metadata
        self._batches = 0
        self._line_heads: list[bytes] = []  # a staged line's start, by its index
        self._refused_after_write = False  # (drain_to_parquet's: see _from_json_lines)
        self._read_plan: _ReadPlan | None = None
        self._arrow = False  # (drain_to_parquet's, to a local path: Arrow reads its batches)
        self._arrow_plan: _ArrowPlan | None = None
        # each delivery frame's messages, as the consumer hands them over (a Delivery
        # each: a message each cost a put and a get, ~0.3 us a row of a drain's driver)
        self._arrived: queue.SimpleQueue[Delivery] = queue.SimpleQueue()
        self._left: list[Delivery] = []  # (arrived past the last batch's batch_size)
        eps = _addresses(endpoints, lookupd_http_addresses)
        # (with lookup daemons the brokers are not known yet: room for one to take all)
        brokers = len(eps) if eps and not lookupd_http_addresses else 1
        # room for two batches: the next one arrives while Spark writes this one
        per_broker = math.ceil(2 * batch_size / (brokers * rdy_per_connection))
        # Every delivery not yet FINed or requeued (by id(), a delivery being
        # unhashable): the keeper touches those held for a quarter of the timeout or
        # more, so a batch that takes long to write (or waits for the next) never times
        # out while this reader still has it.  (A delivery split between two batches,
        # or with an earlier copy of a message left out, is held as its parts.)
        self._held: dict[int, Delivery] = {}
        self._touch_after = msg_timeout_ms / 2000
        self._keeper: threading.Thread | None = None
        self._closing = threading.Event()
        self.consumer = Consumer(topic, channel, self._delivered, list(eps),
                                 max_in_flight=2 * batch_size, msg_timeout_ms=msg_timeout_ms,
                                 auto_finish=False, batches=True,
                                 connections_per_broker=per_broker,
                                 max_rdy_per_connection=rdy_per_connection,
                                 lookupd_http_addresses=lookupd_http_addresses,
                                 lookupd_poll_interval=lookupd_poll_interval,
                                 **_client_options(client_options or {}))
        self._pending: Batch | None = None
        self._next: _Prefetch | None = None  # the next batch, made while this one is used
        self._handoff = threading.Lock()  # who takes _next: batches() or close()
        self._started = False
        self._verify: Callable[[Any], None] | None = None
        self._verified: Any = None
        self._convert: Callable[[Any], Any] = lambda v: v

    @property
    def schema(self) -> t.StructType | None:
        """The schema of the batches' DataFrames (the bodies', then the metadata
        columns); None until the first batch when it is inferred."""
        body = self._body_schema
        if body is None or not self.metadata:
            return body
        return t.StructType([*body.fields, *_METADATA_FIELDS])

    def __enter__(self) -> TopicReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _delivered(self, delivery: Delivery) -> None:
        self._held[id(delivery)] = delivery
        self._arrived.put(delivery)

    def _keep(self) -> None:
        """The keeper thread's loop: each quarter of the message timeout, touch every
        message that was held at the round before (so held for a quarter to a half
        of its timeout, then touched each quarter); forget those answered.  A batch
        written faster than that is never touched."""
        held = self._held
        before: set[int] = set()
        while not self._closing.wait(self._touch_after / 2):
            now: set[int] = set()
            for key, m in list(held.items()):
                if m.responded:
                    held.pop(key, None)
                    continue
                if key in before:
                    m.touch()
                now.add(key)
            before = now

    def close(self) -> None:
        """Close the connections, requeueing every message held (an uncommitted batch,
        the next one made ready, and what arrived after them) once no broker delivers
        to this reader any more (see ``Consumer.close``)."""
        with self._handoff:
            self._closing.set()
            future, self._next = self._next, None
        self._arrived.put(_WAKE)  # (a gather waiting for a first message)
        if self._keeper is not None:
            self._keeper.join(5)
            self._keeper = None
        prepared = None
        try:
            if future is not None:
                prepared = future.result()
        except Exception:  # (its messages were requeued)
            log.exception("preparing the next batch failed")
        if self._started:
            held = self._held
            self.consumer.close(requeue=lambda: list(held.values()))
            self._started = False
            held.clear()
        while True:  # (what arrived, and a sentinel no gather took)
            try:
                self._arrived.get_nowait()
            except queue.Empty:
                break
        self._left = []
        if prepared is not None:
            self._drop(prepared)  # (unstaged; requeued above)
        if self._pending is not None:
            self._pending._release()
        self._pending = None
        if self._staging is not None:
            self._staging.close()

    def batches(self) -> Iterator[Batch]:
        """Yield micro-batches; a batch not committed by the next step is requeued.

        While the caller works on a batch (a Spark write, in the JVM), the next one
        is gathered and staged on a thread of this reader: the two overlap, and
        only the Spark side of a batch (its DataFrame) waits for the next step, when
        the batch before is committed or requeued."""
        if not self._started:
            self.consumer.start()
            self._started = True
            self._closing.clear()
            self._keeper = threading.Thread(target=self._keep, name="topic-reader-keeper",
                                             daemon=True)
            self._keeper.start()
        while True:
            self._settle_pending()
            asked = time.monotonic()
            prepared = self._take_next()
            if prepared is not None and not prepared.gathered and self.idle_timeout is not None:
                # The prefetch waited from the last yield: idle means idle_timeout
                # without a message since the caller asked, not since the yield.
                left = asked + self.idle_timeout - time.monotonic()
                if left > 0:
                    prepared = self._prepare(self._gather(left))
            if prepared is None:
                prepared = self._prepare(self._gather())
            if not prepared.gathered:
                return
            batch = self._frame(prepared)
            with self._handoff:  # (close() from another thread: nothing yielded after it)
                closed = self._closing.is_set()
                if not closed:
                    self._pending = batch
                    self._next = _Prefetch(self._prepare_next)
            if closed:
                self._drop(prepared)
                return
            yield batch

    def _settle_pending(self) -> None:
        """Requeue the batch yielded last if it was not committed; release its staging."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if not pending.committed:
            log.warning("batch of %d messages was not committed; requeued",
                        sum(map(len, pending.deliveries)))
            pending.requeue()
        pending._release()

    def _take_next(self) -> _Prepared | None:
        """The batch the prefetch thread prepared, if one was started and ``close()`` has
        not taken it.  Whoever clears ``_next`` owns the batch: the prefetch stays
        there while this waits, so a close (or a KeyboardInterrupt out of the wait,
        then the close of a ``with``) still finds it and requeues it."""
        future = self._next
        if future is None:
            return None
        prepared = future.result()
        with self._handoff:
            if self._next is not future:
                return None  # (close() took it, and requeues it)
            self._next = None
        return prepared

    def _prepare_next(self) -> _Prepared:
        """The prefetch thread's work: the next batch, gathered and staged."""
        return self._prepare(self._gather())

    def _gather(self, first_timeout: float | None = -1.0) -> _Gathered:
        """Up to batch_size messages (fewer if one came twice: see `_distinct`): what was
        left past the last batch, else wait idle_timeout (or `first_timeout`) for a
        first delivery; then batch_timeout for the rest."""
        if self._closing.is_set():
            return _Gathered([])
        taken, self._left = self._left, []
        arrived, size = self._arrived, self.batch_size
        if not taken:
            try:
                first = arrived.get(
                    timeout=self.idle_timeout if first_timeout == -1.0 else first_timeout)
            except queue.Empty:
                return _Gathered([])
            if first is _WAKE:
                return _Gathered([])
            taken = [first]
        count = sum(map(len, taken))
        deadline = time.monotonic() + self.batch_timeout
        while count < size:
            try:  # what has arrived, without a timed wait each
                while count < size:
                    run = arrived.get_nowait()
                    if run is _WAKE:
                        return self._distinct(self._cut(taken))
                    taken.append(run)
                    count += len(run)
                break
            except queue.Empty:
                pass
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                run = arrived.get(timeout=remaining)
            except queue.Empty:
                break
            if run is _WAKE:
                break
            taken.append(run)
            count += len(run)
        return self._distinct(self._cut(taken))

    def _cut(self, taken: list[Delivery]) -> list[Delivery]:
        """`taken` up to batch_size messages; the rest is left for the next batch (still
        held, so touched, and requeued if the reader closes first), the delivery across
        the boundary split in two."""
        count = 0
        for i, d in enumerate(taken):
            if count + len(d) > self.batch_size:
                rest = taken[i + 1:]
                del taken[i:]
                fits = self.batch_size - count
                if fits:
                    before, after = self._replace(d, *d.split(fits))
                    taken.append(before)
                    rest.insert(0, after)
                else:
                    rest.insert(0, d)
                self._left = rest
                break
            count += len(d)
        return taken

    def _replace(self, delivery: Delivery, *parts: Delivery) -> tuple[Delivery, ...]:
        """`parts` held (and answered) instead of `delivery` (added first: a close in
        between requeues a message twice, not never)."""
        held = self._held
        for part in parts:
            held[id(part)] = part
        held.pop(id(delivery), None)
        return parts

    def _distinct(self, taken: list[Delivery]) -> _Gathered:
        """`taken` but for the earlier copy of a message delivered again (keyed by
        broker and id: ids are unique per broker only), which is no longer held."""
        gathered = _Gathered(taken)
        if sum(map(len, gathered.by_source.values())) == len(gathered):
            return gathered
        later: set[tuple[str | None, bytes]] = set()
        out = []
        for d in reversed(taken):  # (a later copy is kept, an earlier one left out)
            source, ids, keep = d.source, d.ids, []
            for i in range(len(d) - 1, -1, -1):
                if (source, ids[i]) not in later:
                    later.add((source, ids[i]))
                    keep.append(i)
            if len(keep) == len(d):
                out.append(d)
            elif keep:
                out += self._replace(d, d.select(reversed(keep)))
            else:
                self._held.pop(id(d), None)
        out.reverse()
        return _Gathered(out)

    def _settled(self, gathered: _Gathered, committed: bool) -> None:
        """A batch FINed (`committed`) or requeued: its deliveries are no longer held (the
        keeper stops touching them), and committed ones' ids are remembered for
        deduplication."""
        pop = self._held.pop
        for d in gathered.deliveries:
            pop(id(d), None)
        if committed and self._dedupe_window:
            self._seen.add(gathered.by_source)

    def _prepare(self, gathered: _Gathered) -> _Prepared:
        """A batch made ready (the prefetch thread's work): each message decoded,
        checked and staged (JSON) or made a row, then its DataFrame.  On an error
        the messages are requeued."""
        prepared = _Prepared(gathered)
        if not gathered:
            return prepared
        try:
            if self._staging is not None:
                if not self._read_by_arrow(prepared):
                    self._stage(prepared)
            else:
                self._decode(prepared)
            prepared.framed = self._spark_side(prepared, set())
        except BaseException:
            self._drop(prepared)
            raise
        return prepared

    def _drop(self, prepared: _Prepared) -> None:
        """Give a batch that will not be yielded back: requeue it, unstage it."""
        for d in prepared.gathered.deliveries:
            d.requeue(0)
        self._settled(prepared.gathered, False)
        _discard(prepared.framed)
        if prepared.where is not None:
            assert self._staging is not None
            with contextlib.suppress(Exception):
                self._staging.remove(prepared.where)

    def _stage(self, prepared: _Prepared) -> None:
        """Each body that is one whole JSON object becomes a line (wrapped with its
        index and metadata) of a staged file for Spark's JSON reader."""
        assert self._staging is not None
        gathered, values, bad = prepared.gathered, prepared.values, prepared.bad
        bodies = gathered.bodies
        if _whole_objects(bodies):  # (the usual batch: judged in C, not body by body)
            prepared.kept = range(len(bodies))
            values += bodies
        else:
            for i, body in enumerate(bodies):
                try:
                    values.append(_json_line(body))
                except ValueError as e:
                    bad.append((i, f"cannot decode: {e}"))
                    continue
                prepared.kept.append(i)
        kept = prepared.kept
        if not kept:
            return
        if self.metadata:
            ids, timestamps, attempts = gathered.ids, gathered.timestamps, gathered.attempts
            blob = b"\n".join([b'{"_nsq_i":%d,"_nsq_id":%b,"_nsq_timestamp":%d,'
                                b'"_nsq_attempts":%d,"_nsq_body":%b}' % (
                                    i, orjson.dumps(ids[j].decode("ascii", "replace")),
                                    timestamps[j], attempts[j], body)
                                for i, (j, body) in enumerate(zip(kept, values, strict=True))])
        else:  # each line its index's head, its body and a brace, joined at once
            n = len(kept)
            heads = self._line_heads
            if len(heads) < n:
                heads += [b'{"_nsq_i":%d,"_nsq_body":' % i for i in range(len(heads), n)]
            parts: list[bytes] = [b"}\n"] * (3 * n)
            parts[::3] = heads[:n]
            parts[1::3] = values
            blob = b"".join(parts)
        prepared.blob = blob

    def _staged(self, prepared: _Prepared) -> str:
        """The file holding the batch's staged lines for Spark's JSON reader, written
        the first time it is asked for."""
        assert self._staging is not None
        if prepared.where is None:
            self._batches += 1
            prepared.where = self._staging.write(f"batch-{self._batches}.json", prepared.blob)
        return prepared.where

    def _decode(self, prepared: _Prepared) -> None:
        """Each message decoded, converted and checked as a row of the schema (a bad
        one costs its own time, not its batch's)."""
        records: list[tuple[int, Any]] = []
        gathered = prepared.gathered
        if self.metadata:
            ids, timestamps, attempts = gathered.ids, gathered.timestamps, gathered.attempts
        for i, body in enumerate(gathered.bodies):
            try:
                value = self.decode(body)
                if not isinstance(value, dict):
                    raise ValueError(f"expected an object, got {type(value).__name__}")
            except (ValueError, TypeError, msgpack.ExtraData) as e:
                prepared.bad.append((i, f"cannot decode: {e}"))
                continue
            if self.metadata:
                value = {**value, "_nsq_id": ids[i].decode("ascii", "replace"),
                         "_nsq_timestamp": timestamps[i], "_nsq_attempts": attempts[i]}
            records.append((i, value))
        if self._body_schema is None and records:
            inferred = self.spark.createDataFrame([r for _, r in records[:1000]]).schema
            meta = {f.name for f in _METADATA_FIELDS} if self.metadata else set()
            self._body_schema = t.StructType([f for f in inferred.fields if f.name not in meta])
        schema = self.schema
        if schema is None:
            return
        if self._verify is None or self._verified is not self._body_schema:
            self._convert = _row_converter(schema)
            self._verify = _make_type_verifier(schema)
            self._verified = self._body_schema
        convert, verify = self._convert, self._verify
        kept = prepared.kept
        assert isinstance(kept, list)
        for i, value in records:
            try:
                row = convert(value)
                verify(row)
            except (ValueError, TypeError, AttributeError, ArithmeticError) as e:
                prepared.bad.append((i, f"does not fit the schema: {e}"))
                continue
            kept.append(i)
            prepared.values.append(row)

    def _frame(self, prepared: _Prepared) -> Batch:
        """A prepared batch as the caller gets it, made when the batch before it is
        committed: messages this reader committed since it was prepared are left out
        as duplicates (which remakes its DataFrame: rare, a redelivery of a message of
        the batch before).  On an error the messages are requeued."""
        seen = self._seen
        dup: set[int] = set()
        bad = prepared.bad
        duplicates = 0
        framed = prepared.framed
        assert framed is not None
        gathered = prepared.gathered
        if seen and not seen.isdisjoint(gathered.by_source):
            ids, sources = gathered.ids, gathered.sources()
            dup = {k for k, i in enumerate(prepared.kept) if (sources[i], ids[i]) in seen}
            kept_bad = [(i, e) for i, e in bad if (sources[i], ids[i]) not in seen]
            duplicates = len(dup) + len(bad) - len(kept_bad)
            bad = kept_bad
            if dup:
                try:
                    framed = self._spark_side(prepared, dup)
                except BaseException:
                    self._drop(prepared)
                    raise
                _discard(prepared.framed)  # (remade: the first DataFrame never runs)
                prepared.framed = framed
        out = [BadMessage(gathered.ids[i], gathered.bodies[i], error)
               for i, error in bad] + framed.bad
        return Batch(framed.df, framed.rows, out, gathered, duplicates=duplicates,
                     _on_settled=self._settled, _framed=framed)

    def _spark_side(self, prepared: _Prepared, dup: set[int]) -> _Framed:
        """The batch's DataFrame, leaving out the messages at `dup` in ``kept``."""
        if self._staging is not None:
            return self._from_json_lines(prepared, dup)
        return _Framed(*self._from_rows(prepared, dup))

    def _from_json_lines(self, prepared: _Prepared, dup: set[int]) -> _Framed:
        """The batch through Spark's JSON reader, from its staged file, leaving out the
        lines of `dup`; a line the reader cannot fit to the schema is bad, with the
        reason the Python converter gives (one job finds those, a second, the
        caller's, reads the rest)."""
        assert self._staging is not None
        kept = prepared.kept
        if len(dup) == len(kept):
            if prepared.where is not None:
                self._staging.remove(prepared.where)
            return _Framed(None, 0)
        if prepared.table is not None:
            table = prepared.table
            if dup:
                table = table.filter(pa.array([i not in dup for i in range(len(kept))]))
            return _Framed(None, table.num_rows, table=table)
        where = self._staged(prepared)
        release = functools.partial(self._staging.remove, where)
        if self._body_schema is None:  # Spark's inference, over this first batch
            inferred = self.spark.read.json(where).schema["_nsq_body"].dataType
            self._body_schema = t.StructType(list(inferred.fields))
        plan = self._plan()
        staged = DataFrame(self.spark._jsparkSession.read().schema(plan.schema)
                           .option("mode", "PERMISSIVE")
                           .option("columnNameOfCorruptRecord", "_nsq_corrupt")
                           .json(where), self.spark)
        columns = plan.columns
        if self._refused_after_write:
            # One job: the write reads every column, so the corrupt column finds
            # each refused line, and an observation brings them back with it.
            seen = Observation()
            readable = plan.readable if not dup \
                else plan.readable & ~F.col("_nsq_i").isin(sorted(dup))
            df = staged.observe(seen, plan.refused).where(readable).select(*columns)

            def settle(batch: Batch) -> None:
                found = seen.get["refused"]
                lines = str(found.mkString("\n")).split("\n") if found.size() else []
                lines = [text for text in lines if _line_index(text) not in dup]
                batch.bad.extend(self._refused(prepared, lines))
                batch.rows -= len(lines)
            return _Framed(df, len(kept) - len(dup), release, settle,
                           discard=functools.partial(_unobserve, self.spark, seen))
        # (the whole body selected: Spark's reader parses only the columns a query
        # needs, and finds a line bad only in those)
        refused = [text for text in (
            r["_nsq_corrupt"] for r in staged.where(F.col("_nsq_corrupt").isNotNull())
            .select("_nsq_corrupt", "_nsq_body").collect()) if _line_index(text) not in dup]
        bad = self._refused(prepared, refused)
        # the refused lines left out by index: a query of some columns parses only
        # those, so the corrupt column would not find them again
        indices = [_line_index(text) for text in refused] + sorted(dup)
        df = (staged.where(~F.col("_nsq_i").isin(indices)) if indices else staged) \
            .select(*columns)
        return _Framed(df, len(kept) - len(dup) - len(refused), release, bad=bad)

    def _read_by_arrow(self, prepared: _Prepared) -> bool:
        """A drain's batch read by Arrow from its bodies, one a line, where Arrow reads
        each as Spark's JSON reader would (see `_ArrowPlan`); False, and nothing done,
        where it may not.

        The lines are the bodies as the broker sent them (a line feed between two), not
        staged: if no body has a line break, and each starts with ``{`` and ends with
        ``}``, no JSON value can span two lines (a string cannot hold a raw line break,
        and after a ``}`` only a ``,``, ``]`` or ``}`` goes on) and no line is empty,
        so as many rows as bodies means one row a body, in order.  Otherwise a body is
        not one whole object (Arrow's reader takes each value of a line), or is one
        with a line break in it, and `_stage` judges the batch body by body, for
        Spark's reader."""
        body = self._body_schema
        if not self._arrow or body is None:
            return False
        plan = self._arrow_plan
        if plan is None or plan.body is not body:
            plan = self._arrow_plan = _ArrowPlan.of(body, self.metadata, self.spark.version)
        if not plan.readable:
            return False
        gathered = prepared.gathered
        lines, n = gathered.lines, len(gathered)
        # (as many line feeds as gaps between bodies: none holds one; and each gap is
        # between a "}" and a "{")
        if lines.count(b"\n") != n - 1 or lines.count(b"}\n{") != n - 1 \
                or lines[:1] != b"{" or lines[-1:] != b"}":
            return False
        metadata = [[i.decode("ascii", "replace") for i in gathered.ids],
                    gathered.timestamps, gathered.attempts] if self.metadata else []
        zone = self.spark.conf.get("spark.sql.session.timeZone") if plan.temporal else ""
        table = plan.read(lines, n, zone, metadata,
                          longest=max(struct.unpack(f">{n}I", gathered.sizes)))
        if table is None:
            return False
        prepared.kept = range(n)  # (no values: Spark's reader never sees this batch)
        prepared.table = table
        return True

    def _plan(self) -> _ReadPlan:
        """The staged lines' schema (in the JVM) and the columns and conditions over them,
        made once per schema (each is a py4j call or more; a batch would make ~140)."""
        body = self._body_schema
        assert body is not None
        if self._read_plan is None or self._read_plan.body is not body:
            columns = [F.col(f"_nsq_body.`{f.name.replace('`', '``')}`").alias(f.name)
                       for f in body.fields]
            if self.metadata:
                columns += [F.col(f.name) for f in _METADATA_FIELDS]
            self._read_plan = _ReadPlan(
                body, self.spark._jsparkSession.parseDataType(_staged_schema(body).json()),
                columns, F.col("_nsq_corrupt").isNull(),
                F.collect_list("_nsq_corrupt").alias("refused"))
        return self._read_plan

    def _refused(self, prepared: _Prepared, lines: list[str]) -> list[BadMessage]:
        """The messages of the staged `lines` Spark's JSON reader refused, each with the
        reason the Python converter gives."""
        out = []
        gathered = prepared.gathered
        for text in lines:
            i = _line_index(text)
            j, body = prepared.kept[i], prepared.values[i]
            out.append(BadMessage(gathered.ids[j], gathered.bodies[j],
                                  f"does not fit the schema: {self._why(body)}"))
        return out

    def _why(self, body: bytes) -> str:
        """Why the Python converter refuses `body` (Spark's JSON reader did)."""
        assert self._body_schema is not None
        convert = _row_converter(self._body_schema)
        try:
            row = convert(self.decode(body))
            _make_type_verifier(self._body_schema)(row)
        except (ValueError, TypeError, AttributeError, ArithmeticError) as e:
            return str(e)
        return "Spark's JSON reader cannot read it as the schema's types"

    def _from_rows(self, prepared: _Prepared, dup: set[int]) -> tuple[Any, int]:
        """The batch's rows, made by `_decode`, handed to Spark (but those of `dup`)."""
        schema = self.schema
        if schema is None:
            return None, 0
        rows = [row for i, row in enumerate(prepared.values) if i not in dup]
        return self.spark.createDataFrame(rows, schema, verifySchema=False), len(rows)


class _Remembered:
    """The ids of the messages a reader committed lately, by broker: at least the last
    `size` of them, and at most a quarter more.

    They are kept as generations of sets (one a broker), the newest taking each
    batch's ids, a new one begun when it holds a quarter of `size`, and the oldest
    forgotten once the newer ones hold `size` without it.  Adding an id costs a set's
    insertion, and forgetting is dropping a generation: an OrderedDict kept exactly
    `size` but cost 1.2 us a key with a window of 1,000,000 (a set's 0.3), 10 % of a
    drain's driver."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._per = max(1, -(-size // 4))
        self._generations: list[dict[str | None, set[bytes]]] = [{}]
        self._sizes = [0]  # ids in each generation
        self._held = 0  # ids in all generations (one seen twice counts twice)

    def __bool__(self) -> bool:
        return self._held > 0

    def __contains__(self, key: tuple[str | None, bytes]) -> bool:
        source, msg_id = key
        return any(msg_id in generation.get(source, ()) for generation in self._generations)

    def isdisjoint(self, ids_by_source: Mapping[str | None, set[bytes]]) -> bool:
        return all(generation.get(source, _NO_IDS).isdisjoint(ids)
                   for generation in self._generations
                   for source, ids in ids_by_source.items())

    def add(self, ids_by_source: Mapping[str | None, set[bytes]]) -> None:
        newest = self._generations[-1]
        for source, ids in ids_by_source.items():
            held = newest.setdefault(source, set())
            before = len(held)
            held.update(ids)
            self._held += len(held) - before
            self._sizes[-1] += len(held) - before
        if self._sizes[-1] >= self._per:
            self._generations.append({})
            self._sizes.append(0)
        while len(self._sizes) > 1 and self._held - self._sizes[0] >= self.size:
            self._held -= self._sizes.pop(0)
            self._generations.pop(0)


_NO_IDS: frozenset[bytes] = frozenset()


class _Gathered(Columns):
    """The deliveries gathered for a batch, and their messages as columns across them
    (no object a message; the bodies split only if asked for)."""

    __slots__ = ("_by_source", "deliveries")

    def __init__(self, deliveries: list[Delivery]) -> None:
        parts = [d for d in deliveries if d.ids]
        if len(parts) == 1:
            (d,) = parts
            super().__init__(d.ids, d.headers, d.sizes, d.lines, d._bodies)
        else:
            ids: list[bytes] = []
            for d in parts:
                ids += d.ids
            super().__init__(ids, b"".join([d.headers for d in parts]),
                             b"".join([d.sizes for d in parts]),
                             b"\n".join([d.lines for d in parts]))
        self.deliveries = deliveries
        self._by_source: dict[str | None, set[bytes]] | None = None

    def sources(self) -> list[str | None]:
        """Each message's broker."""
        out: list[str | None] = []
        for d in self.deliveries:
            out += [d.source] * len(d)
        return out

    @property
    def by_source(self) -> dict[str | None, set[bytes]]:
        """The ids as sets, by the broker that sent them (ids are unique per broker only;
        made once: the duplicate check and the dedupe window's check and add each take
        them, a set's hashes made once, and set to set in C)."""
        out = self._by_source
        if out is None:
            if len({d.source for d in self.deliveries}) <= 1:
                out = {self.deliveries[0].source: set(self.ids)} if self.deliveries else {}
            else:
                out = {}
                for d in self.deliveries:
                    out.setdefault(d.source, set()).update(d.ids)
            self._by_source = out
        return out


@dataclass
class _Prepared:
    """A gathered batch made ready in Python, not yet framed for Spark: its messages,
    those that cannot be read (by their index in `gathered`, with why), and the rest
    (``kept``, their indices), each with its staged JSON body (staged in the file at
    ``where``) or its row, in staging order."""

    gathered: _Gathered
    bad: list[tuple[int, str]] = field(default_factory=list)
    kept: list[int] | range = field(default_factory=list)
    # each kept message's staged JSON body or row, none for a batch Arrow read
    values: list[Any] = field(default_factory=list)
    blob: bytes = b""  # the staged JSON lines of `kept`, one a message
    table: pa.Table | None = None  # or its rows, read by Arrow (a drain's)
    where: str | None = None  # the file they are staged in, once Spark's reader needs it
    framed: _Framed | None = None  # its DataFrame, before duplicates are known


@dataclass
class _Framed:
    """A batch's Spark side: its DataFrame and rows, what frees its staged file, what
    finds the lines refused by its write (a drain's), and the lines refused before;
    or, a drain's batch that Arrow read (see `_ArrowPlan`), its rows as a table."""

    df: Any
    rows: int
    release: Callable[[], None] | None = None
    settle: Callable[[Batch], None] | None = None
    bad: list[BadMessage] = field(default_factory=list)
    discard: Callable[[], None] | None = None  # for a DataFrame that will never run
    table: pa.Table | None = None


def _discard(framed: _Framed | None) -> None:
    """What a batch whose DataFrame will never run must let go of (never raises)."""
    if framed is not None and framed.discard is not None:
        try:
            framed.discard()
        except Exception:  # (a py4j error: the session is stopping)
            log.debug("could not discard a batch's DataFrame", exc_info=True)


def _unobserve(spark: Any, observation: Observation) -> None:
    """Unregister the query listener of an observation whose DataFrame will never run (a
    prefetched batch dropped, a DataFrame remade without duplicates).  The JVM's
    ``Observation`` registers it when it observes a DataFrame and unregisters it only
    when that DataFrame's first action ends, and PySpark has no call for the other
    case: each one left registered keeps its plan reachable and hears every later
    query of the session."""
    jo = observation._jo
    if jo is None:
        return
    manager = spark._jsparkSession.listenerManager()
    for listener in manager.listListeners():
        if listener.getClass().getName() == "org.apache.spark.sql.ObservationListener" \
                and listener.observation().equals(jo):
            manager.unregister(listener)


_WAKE: Any = object()
"""Put in a reader's queue of arrived messages by ``close``: a gather waiting for the
first message of a batch returns at once."""


class _Prefetch:
    """`fn` run on a daemon thread of its own (a reader's next batch, made while the
    caller works on this one); ``result()`` waits for it."""

    def __init__(self, fn: Callable[[], _Prepared]) -> None:
        self._result: _Prepared | None = None
        self._error: BaseException | None = None
        # (Spark's pinned threads: its jobs keep the caller's job group, pool and
        # local properties)
        self._thread = InheritableThread(target=self._run, args=(fn,), daemon=True,
                                         name="topic-reader-prefetch")
        self._thread.start()

    def _run(self, fn: Callable[[], _Prepared]) -> None:
        try:
            self._result = fn()
        except BaseException as e:  # raised again by result(), in the caller's thread
            self._error = e

    def result(self) -> _Prepared:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


@dataclass(frozen=True)
class _ReadPlan:
    body: t.StructType
    schema: Any  # the staged lines' StructType, in the JVM
    columns: list[Any]
    readable: Any  # the lines the reader could read
    refused: Any  # the lines it could not, as an observation's aggregate


_METADATA_FIELDS = (t.StructField("_nsq_id", t.StringType()),
                    t.StructField("_nsq_timestamp", t.LongType()),
                    t.StructField("_nsq_attempts", t.IntegerType()))


def _staged_schema(body: t.StructType) -> t.StructType:
    """The schema of a staged line: its index, the metadata, the body, and the column
    where Spark's JSON reader puts a line it cannot read as the rest."""
    return t.StructType([t.StructField("_nsq_i", t.IntegerType()), *_METADATA_FIELDS,
                         t.StructField("_nsq_body", body),
                         t.StructField("_nsq_corrupt", t.StringType())])


def _line_index(text: str) -> int:
    """The index a staged line starts with."""
    return int(text[len('{"_nsq_i":'):text.index(",")])


def _json_line(body: bytes) -> bytes:
    """`body` as one line of a JSON-lines file if it is one whole JSON object (Spark's
    reader takes the first value of a line and ignores the rest, so it cannot be the
    judge); ValueError saying why not."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        value = json.loads(body)  # what JSON allows and orjson not: NaN, 65-bit integers
    if not isinstance(value, dict):
        raise ValueError(f"expected an object, got {type(value).__name__}")
    if b"\n" in body or b"\r" in body:
        # In valid JSON a line break can only be whitespace between tokens (in a string
        # it is escaped): a space reads the same.
        body = body.replace(b"\n", b" ").replace(b"\r", b" ")
    return body


def _whole_objects(bodies: list[bytes]) -> bool:
    """Whether every body is one whole JSON object, as orjson reads it, with no line break
    in it: then each is its own staged line as it is (what :func:`_json_line` would
    make of it; any other body is judged by it alone)."""
    try:  # (each value dropped once its type is known: 50,000 dicts kept alive at once
        # would each be promoted by the garbage collector, and bring on a full collection)
        if set(map(type, map(orjson.loads, bodies))) != {dict}:
            return False
    except orjson.JSONDecodeError:
        return False
    joined = b"".join(bodies)
    return b"\n" not in joined and b"\r" not in joined


def _spark_reads_json(dtype: Any) -> bool:
    """Whether Spark's JSON reader reads `dtype` (None: inferred) as the JSON writers
    wrote it: not maps whose keys are not strings (JSON's keys are)."""
    if isinstance(dtype, t.MapType):
        return isinstance(dtype.keyType, t.StringType) and _spark_reads_json(dtype.valueType)
    if isinstance(dtype, t.StructType):
        return all(_spark_reads_json(f.dataType) for f in dtype.fields)
    if isinstance(dtype, t.ArrayType):
        return _spark_reads_json(dtype.elementType)
    return True


_ISO_DATE = r"^\d{4}-\d{2}-\d{2}$"
_ISO_TIMESTAMP = r"^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(\.\d{1,6})?(Z|[+-]\d{2}:\d{2})?$"
_ZONED = r"(Z|[+-]\d{2}:\d{2})$"

_ARROW_TYPES = {t.StringType: pa.string(), t.BooleanType: pa.bool_(), t.ByteType: pa.int8(),
                t.ShortType: pa.int16(), t.IntegerType: pa.int32(), t.LongType: pa.int64(),
                t.FloatType: pa.float32(), t.DoubleType: pa.float64()}


def _arrow_type(dtype: Any) -> pa.DataType | None:
    """The Arrow type of a `dtype` value in a body, if Arrow's JSON reader reads each JSON
    value Spark's reads as that type to the same value, and refuses the rest (None: it
    might not).  Not binary (Spark's reader decodes base64), maps (Arrow's reader has
    none), dates and timestamps (read as text: see `_ArrowPlan`), nor any other."""
    if type(dtype) in _ARROW_TYPES:
        return _ARROW_TYPES[type(dtype)]
    if isinstance(dtype, t.DecimalType):  # (Arrow refuses what does not fit; Spark rounds)
        return pa.decimal128(dtype.precision, dtype.scale)
    if isinstance(dtype, t.ArrayType):
        element = _arrow_type(dtype.elementType)
        return None if element is None else pa.list_(element)
    if isinstance(dtype, t.StructType):
        fields = [(f.name, _arrow_type(f.dataType)) for f in dtype.fields]
        if not fields or any(a is None for _, a in fields) \
                or len({name for name, _ in fields}) < len(fields):
            return None
        return pa.struct(fields)
    return None


@dataclass(frozen=True)
class _ArrowPlan:
    """How a drain's batch of JSON bodies becomes a table without Spark.

    Spark's JSON reader costs the JVM 10-13 us a row (half parsing, half the Parquet
    write), more than the broker and the consumer together; Arrow's reads and writes
    the same lines in under 1 us.  It reads a batch only where it reads every value
    as Spark's reader would, and refuses the batch otherwise (a NaN written as a
    string, a value of the wrong type, a malformed line), which then goes to Spark's
    reader as before.  NaN and the infinities written as strings (as Spark's JSON
    writer writes them) are taken in a float field at any depth of structs and in a
    list of floats: the string after that field's key, or in that list, becomes the
    literal Arrow reads (`_float_fields`).  Dates and timestamps are read as
    strings and taken only in their ISO 8601 form (a timestamp without an offset in
    the session's time zone, as Spark's reader has it); nested in a struct or an
    array they are not taken.

    Two more differences, found by tests/spark/test_arrow.py, are checked for: Arrow
    reads the JSON integer ``-0`` as a float -0.0 where Spark's reader reads 0.0 (so a
    batch with a ``-0`` is refused when the schema has floats), and it takes a decimal
    with fewer places than its column without checking that the digits the column
    adds still fit its precision (12345678.9 as decimal(9,2); so each column with a
    decimal in it is checked by a cast to 38 digits and back)."""

    body: t.StructType
    readable: bool
    staged: pa.Schema | None = None  # a body, as Arrow's JSON reader reads it
    schema: pa.Schema | None = None  # the table written
    temporal: tuple[tuple[int, Any], ...] = ()  # (column, date32 or timestamp) read as text
    decimals: tuple[tuple[int, Any], ...] = ()  # (column, its type with 38-digit decimals)
    floats: bool = False  # (a float in the schema: a batch with a -0 is refused)
    # a float field's "NaN", "Infinity"... as Spark's JSON writer writes them, at any
    # depth; and a list of floats with them in it
    nonfinite: re.Pattern[bytes] | None = None
    nonfinite_lists: re.Pattern[bytes] | None = None

    @classmethod
    def of(cls, body: t.StructType, metadata: bool, spark_version: str) -> _ArrowPlan:
        """The plan for `body`; the files say they are Spark `spark_version`'s, for
        Spark's readers take dates before 1582 (and timestamps before 1900) in a file
        that does not say so as possibly a legacy writer's, and refuse them."""
        read, out, temporal = [], [], []
        for i, f in enumerate(body.fields):
            if isinstance(f.dataType, t.DateType | t.TimestampType):
                final = pa.date32() if isinstance(f.dataType, t.DateType) \
                    else pa.timestamp("us", tz="UTC")
                read.append((f.name, pa.string()))
                out.append((f.name, final))
                temporal.append((i, final))
                continue
            a = _arrow_type(f.dataType)
            if a is None:
                return cls(body, False)
            read.append((f.name, a))
            out.append((f.name, a))
        if not read or len({name for name, _ in read}) < len(read):
            return cls(body, False)
        meta = [(f.name, _ARROW_TYPES[type(f.dataType)]) for f in _METADATA_FIELDS] \
            if metadata else []
        staged = pa.schema(read)
        written = pa.schema(out + meta, metadata={"org.apache.spark.version": spark_version})
        decimals = tuple((i, wide) for i, (_, a) in enumerate(read)
                         if (wide := _wide_decimals(a)) is not None)
        floats = any(pa.types.is_floating(leaf) for _, a in read for leaf in _leaves(a))
        scalars: set[str] = set()
        lists: set[str] = set()
        _float_fields(read, scalars, lists)
        nonfinite = re.compile(rb'("(?:%b)"\s*:\s*)%b' % (
            b"|".join(re.escape(n.encode()) for n in sorted(scalars)),
            _NONFINITE_STRING.pattern)) if scalars else None
        nonfinite_lists = re.compile(rb'("(?:%b)"\s*:\s*\[)([^\[\]]*)\]' % (
            b"|".join(re.escape(n.encode()) for n in sorted(lists)))) if lists else None
        return cls(body, True, staged, written, tuple(temporal), decimals, floats, nonfinite,
                   nonfinite_lists)

    def read(self, lines: bytes, rows: int, zone: str, metadata: Sequence[list[Any]] = (),
             *, longest: int | None = None) -> pa.Table | None:
        """The table of `lines`, JSON objects one a line, with the `metadata` columns'
        values; None if Arrow may not read them as Spark would, or if they are not
        `rows` rows.  Given the `longest` line's size, Arrow's threads read blocks of
        `ARROW_BLOCK` (a block must hold a line whole); otherwise one block, on one."""
        assert self.staged is not None
        assert self.schema is not None
        if self.floats and _NEGATIVE_ZERO.search(lines):
            return None
        if (self.nonfinite is not None or self.nonfinite_lists is not None) \
                and (b'"NaN"' in lines or b'Inf' in lines or b'INF"' in lines):
            if self.nonfinite is not None:
                lines = self.nonfinite.sub(_literal, lines)
            if self.nonfinite_lists is not None:
                lines = self.nonfinite_lists.sub(_literals_within, lines)
        try:
            read = pa_json.read_json(
                pa.BufferReader(lines),
                read_options=pa_json.ReadOptions(
                    use_threads=longest is not None,
                    block_size=len(lines) + 1 if longest is None
                    else max(ARROW_BLOCK, 2 * longest + 2)),
                parse_options=pa_json.ParseOptions(explicit_schema=self.staged,
                                                   unexpected_field_behavior="ignore"))
            if read.num_rows != rows:
                return None
            columns = [c.combine_chunks() for c in read.columns]
            for i, wide in self.decimals:  # (raises if a value is past its precision)
                columns[i].cast(wide).cast(columns[i].type)
            for i, final in self.temporal:
                column = _temporal(columns[i], final, zone)
                if column is None:
                    return None
                columns[i] = column
            columns += [pa.array(values, self.schema.field(len(columns) + i).type)
                        for i, values in enumerate(metadata)]
            return pa.Table.from_arrays(columns, schema=self.schema)
        except (pa.ArrowException, ValueError):
            return None


ARROW_BLOCK = 1 << 20
"""The bytes of a drain's batch each of Arrow's threads reads at a time: 50,000 rows
of ~100 B (5 MB) took 18-22 ms in blocks of 1-2.6 MB on two cores, 26-36 ms in one
block (the prefetch of a batch is a drain's longest step: ~55 ms of Arrow's read
in its ~100 ms while the broker and the Parquet writer share the cores)."""

_NEGATIVE_ZERO = re.compile(rb"-0(?![.\deE])")  # (the JSON integer; or text in a string)

_NONFINITE_LITERALS = {b"NaN": b"NaN", b"Infinity": b"Infinity", b"+Infinity": b"Infinity",
                       b"+INF": b"Infinity", b"-Infinity": b"-Infinity", b"-INF": b"-Infinity"}
"""The strings Spark's JSON reader reads as a float's NaN and infinities (its writer
writes NaN, Infinity and -Infinity), and the literals Arrow's reader reads as them."""


_NONFINITE_STRING = re.compile(rb'"(%b)"' % b"|".join(map(re.escape, _NONFINITE_LITERALS)))
"""One of them, as a JSON string (the group: its text)."""


def _literal(match: re.Match[bytes]) -> bytes:
    """A key and its float's NaN or infinity as a string, with the value as a literal."""
    return match[1] + _NONFINITE_LITERALS[match[2]]


def _literals_within(match: re.Match[bytes]) -> bytes:
    """A key and its list of floats, with the NaNs and infinities in it as literals."""
    return match[1] + _NONFINITE_STRING.sub(_bare, match[2]) + b"]"


def _bare(match: re.Match[bytes]) -> bytes:
    """A NaN or infinity as a JSON string, as the literal Arrow's reader reads."""
    return _NONFINITE_LITERALS[match[1]]


def _float_fields(fields: Iterable[tuple[str, pa.DataType]], scalars: set[str],
                  lists: set[str]) -> None:
    """The names of the float fields among `fields` and in their structs, at any depth
    (`scalars`), and of the lists of floats (`lists`).  A name that another field of
    another type shares is rewritten there too; Arrow then refuses the literal (it
    takes a number only into a float), and the batch goes to Spark: never a wrong value."""
    for name, a in fields:
        item = a.value_type if pa.types.is_list(a) else None
        if pa.types.is_floating(a):
            scalars.add(name)
        elif item is not None and pa.types.is_floating(item):
            lists.add(name)
        for inner in (a, item):
            if inner is not None and pa.types.is_struct(inner):
                _float_fields(((inner.field(i).name, inner.field(i).type)
                               for i in range(inner.num_fields)), scalars, lists)


def _leaves(a: pa.DataType) -> Iterator[pa.DataType]:
    """The types of the values in an Arrow type, at every depth."""
    if pa.types.is_list(a):
        yield from _leaves(a.value_type)
    elif pa.types.is_struct(a):
        for i in range(a.num_fields):
            yield from _leaves(a.field(i).type)
    else:
        yield a


def _wide_decimals(a: pa.DataType) -> pa.DataType | None:
    """`a` with each decimal in it of 38 digits (its scale kept); None if it has none."""
    if pa.types.is_decimal(a):
        return pa.decimal128(38, a.scale)
    if pa.types.is_list(a):
        value = _wide_decimals(a.value_type)
        return None if value is None else pa.list_(value)
    if pa.types.is_struct(a):
        fields = [a.field(i) for i in range(a.num_fields)]
        wide = [_wide_decimals(f.type) for f in fields]
        if all(w is None for w in wide):
            return None
        return pa.struct([(f.name, f.type if w is None else w)
                          for f, w in zip(fields, wide, strict=True)])
    return None


_FIXED_ZONE = r"^[+-]\d{2}:\d{2}$"
_UTC_NAMES = frozenset({"UTC", "Etc/UTC", "GMT", "Etc/GMT", "Z", "UCT", "Zulu"})


def _temporal(text: pa.Array, final: pa.DataType, zone: str) -> pa.Array | None:
    """Dates or timestamps written as ISO 8601 strings, as Spark's JSON reader reads them
    (a timestamp without an offset is in the session's time zone, `zone`); None if
    one is in another form, if some timestamps have an offset and some not, or if
    some have none and `zone` is not UTC or a fixed offset: a zone's rules are
    Spark's JVM's to apply (Arrow's put 2054-10-22T07:45 in New York in winter
    time, as if the rules ended in 2037)."""
    if final == pa.date32():
        form, zoned = _ISO_DATE, None
    else:
        form, zoned = _ISO_TIMESTAMP, pc.match_substring_regex(text, _ZONED)
    if not pc.all(pc.match_substring_regex(text, form), min_count=0).as_py():
        return None
    if zoned is None:
        return text.cast(final)
    with_offset = pc.sum(zoned, min_count=0).as_py()
    if with_offset == len(text) - text.null_count:
        return text.cast(final)
    if with_offset:
        return None
    if zone in _UTC_NAMES:
        return text.cast(pa.timestamp("us")).cast(final)  # (read as UTC)
    if not re.match(_FIXED_ZONE, zone):
        return None
    return pc.assume_timezone(text.cast(pa.timestamp("us")), zone).cast(final)


class _Staging:
    """Where a reader's batches wait as JSON-lines files for Spark's JSON reader: a local
    directory (written by this process; a temporary one when no path is given) or any
    path Hadoop's file systems reach (HDFS, S3...; written through the JVM)."""

    def __init__(self, spark: Any, path: str | None) -> None:
        self._spark = spark
        self.path = tempfile.mkdtemp(prefix="topic-reader-") if path is None else path
        self._local = _local_path(self.path)
        if self._local is not None:
            os.makedirs(self._local, exist_ok=True)

    def _fs(self, where: str) -> tuple[Any, Any]:
        jvm = self._spark._jvm
        hpath = jvm.org.apache.hadoop.fs.Path(where)
        return hpath.getFileSystem(self._spark._jsc.hadoopConfiguration()), hpath

    def write(self, name: str, blob: bytes) -> str:
        """Stage `blob` as `name`; the path for Spark's reader."""
        where = self.path.rstrip("/") + "/" + name
        if self._local is not None:
            local = os.path.join(self._local, name)
            try:
                with open(local, "wb") as f:
                    f.write(blob)
            except BaseException:  # (a full disk: no partial file left behind)
                with contextlib.suppress(OSError):
                    os.unlink(local)
                raise
            return os.path.abspath(local)
        fs, hpath = self._fs(where)
        out = fs.create(hpath, True)
        try:
            out.write(bytearray(blob))
        finally:
            out.close()
        return where

    def remove(self, where: str) -> None:
        if self._local is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(where)
            return
        fs, hpath = self._fs(where)
        fs.delete(hpath, False)

    def close(self) -> None:
        """Remove a local staging directory once it is empty."""
        if self._local is not None:
            with contextlib.suppress(OSError):
                os.rmdir(self._local)


def _row_converter(schema: Any) -> Callable[[Any], Any]:
    """dict -> tuple in `schema`'s field order, turning what the serialisers wrote back
    into values (missing fields become None): ISO 8601 strings into dates and
    timestamps, strings and numbers into decimals, ``"NaN"``, ``"Infinity"`` and
    ``"-Infinity"`` into floats, base64 into binary, JSON's string map keys into the
    key type.  A value it cannot turn raises ValueError naming its field."""
    def for_type(dtype: Any) -> Callable[[Any], Any] | None:
        if isinstance(dtype, t.StructType):
            fields = [(f.name, for_type(f.dataType)) for f in dtype.fields]

            def struct(v: Any) -> Any:
                if v is None:
                    return None
                if not isinstance(v, dict):
                    raise TypeError(f"expected an object, got {type(v).__name__}")
                out = []
                for name, conv in fields:
                    x = v.get(name)
                    if conv is not None and x is not None:
                        try:
                            x = conv(x)
                        except (ValueError, TypeError, ArithmeticError) as e:
                            raise ValueError(f"field {name}: {e}") from None
                    out.append(x)
                return tuple(out)
            return struct
        if isinstance(dtype, t.TimestampType | t.TimestampNTZType):
            return lambda v: dt.datetime.fromisoformat(v) if isinstance(v, str) else v
        if isinstance(dtype, t.DateType):
            return lambda v: dt.date.fromisoformat(v) if isinstance(v, str) else v
        if isinstance(dtype, t.DecimalType):
            return lambda v: decimal.Decimal(str(v)) if isinstance(v, str | int | float) else v
        if isinstance(dtype, t.DoubleType | t.FloatType):
            return _to_float
        if isinstance(dtype, t.BinaryType):
            return lambda v: base64.b64decode(v, validate=True) if isinstance(v, str) else v
        if isinstance(dtype, t.ArrayType):
            inner = for_type(dtype.elementType)
            return None if inner is None else (
                lambda v: [None if x is None else inner(x) for x in v])
        if isinstance(dtype, t.MapType):
            key, value = _map_key(dtype.keyType), for_type(dtype.valueType)
            if key is None and value is None:
                return None
            k_of = key or (lambda k: k)
            v_of = value or (lambda x: x)
            return lambda v: {k_of(k): None if x is None else v_of(x) for k, x in v.items()}
        return None

    convert = for_type(schema)
    assert convert is not None
    return convert


def _to_float(v: Any) -> Any:
    if isinstance(v, str):
        if v not in ("NaN", "Infinity", "-Infinity"):
            raise ValueError(f"{v!r:.40} is not a number")
        return float(v)
    return float(v) if isinstance(v, int | decimal.Decimal) and not isinstance(v, bool) else v


def _map_key(dtype: Any) -> Callable[[Any], Any] | None:
    """JSON's object keys are strings: back to the map's key type."""
    if isinstance(dtype, t.IntegralType):
        return lambda k: int(k) if isinstance(k, str) else k
    if isinstance(dtype, t.BooleanType):
        return lambda k: {"true": True, "false": False}[k] if isinstance(k, str) else k
    if isinstance(dtype, t.StringType):
        return None
    if isinstance(dtype, t.DoubleType | t.FloatType):
        return float  # ("NaN", "1.5")
    return _row_converter_for(dtype)


def _row_converter_for(dtype: Any) -> Callable[[Any], Any] | None:
    """The value converter of a type outside a struct (a map key's)."""
    wrapped = _row_converter(t.StructType([t.StructField("k", dtype)]))
    return lambda k: wrapped({"k": k})[0]


def _has_decimal(dtype: Any) -> bool:
    if isinstance(dtype, t.DecimalType):
        return True
    if isinstance(dtype, t.StructType):
        return any(_has_decimal(f.dataType) for f in dtype.fields)
    if isinstance(dtype, t.ArrayType):
        return _has_decimal(dtype.elementType)
    if isinstance(dtype, t.MapType):
        return _has_decimal(dtype.keyType) or _has_decimal(dtype.valueType)
    return False


@dataclass
class DrainResult:
    """What a drain did: ``rows`` written to the table, ``bad`` messages written to
    ``_bad_messages``, ``duplicates`` left out (a message id this drain had written
    already, delivered again), in ``batches`` writes."""

    rows: int = 0
    batches: int = 0
    bad: int = 0
    duplicates: int = 0
    rewound: int = 0
    """With ``from_``: the messages the brokers queued again from their histories."""


def _rewind(topic: str, channel: str, endpoints: str | Sequence[str], start: int | str,
            client_options: Mapping[str, Any] | None) -> int:
    eps = [endpoints] if isinstance(endpoints, str) else list(endpoints)
    if not eps:
        msg = ("drain_to_parquet(from_=...) needs the brokers' endpoints (each broker "
               "replays its own history), not only lookup daemons")
        raise ValueError(msg)
    keys = ("curve_server_key", "curve_keypair", "auth_secret")
    options = {k: v for k, v in (client_options or {}).items() if k in keys}
    with Producer(eps, **options) as producer:
        return producer.rewind(topic, channel, start)


def drain_to_parquet(spark: Any, topic: str, channel: str, endpoints: str | Sequence[str],
                     path: str, *, schema: Any = None, deserializer: str | Deserializer = "json",
                     max_rows: int | None = None, batch_size: int = 50_000,
                     batch_timeout: float = 5.0, idle_timeout: float | None = 10.0,
                     msg_timeout_ms: int = 120_000, rdy_per_connection: int = 2500,
                     metadata: bool = False, lookupd_http_addresses: Sequence[str] = (),
                     lookupd_poll_interval: float = 60.0, dedupe_window: int = 1_000_000,
                     client_options: Mapping[str, Any] | None = None,
                     from_: int | str | None = None) -> DrainResult:
    """Write ``topic``/``channel`` to Parquet at ``path`` (appending), one write per batch.

    With ``from_`` (unix milliseconds, an RFC 3339 time, or a message id; #21) the
    drain first rewinds the channel on each broker of ``endpoints`` (ZeroMQ
    ``REWIND``, which creates the channel if needed), so the table is rebuilt from
    what the topic's history kept from there on (retention, docs/OPERATIONS.md);
    ``DrainResult.rewound`` says how many messages that queued.  A broker whose
    history does not hold all of it refuses (``BrokerRefused``, ``E_NOT_RETAINED``)
    and nothing is drained.

    Each batch is FINed only after its write has committed (and, on a local
    path, after its new files and directories are fsynced).  Batches are larger
    than ``TopicReader``'s (50,000): a Spark write job costs about 0.1 s however
    few its rows, and larger Parquet files read better.  Messages that
    cannot be decoded are written to ``<path>/_bad_messages`` (id, body,
    error), which Spark's readers skip as a hidden directory.  Stops when
    the topic stays idle for ``idle_timeout`` or after ``max_rows`` rows.
    ``endpoints`` may be ``()`` with ``lookupd_http_addresses=[...]``: the drain
    then reads from every broker that has the topic.  A message whose id is among
    the last ``dedupe_window`` this drain wrote is not written again (counted in
    ``duplicates``).  JSON batches are staged as JSON lines; to a local path,
    Arrow reads a batch and writes its file in the driver where it reads every
    line as Spark's JSON reader would (see `_ArrowPlan`), and each file is
    written whole or not at all.  Any other batch is staged under
    ``<path>/_staging`` for Spark's JSON reader, removed with its batch, and
    the lines it refuses come back from the write itself (an observation), so
    a batch is one job.  The other parameters are :class:`TopicReader`'s.
    """
    result = DrainResult()
    if from_ is not None:
        result.rewound = _rewind(topic, channel, endpoints, from_, client_options)
    bad_schema = t.StructType([t.StructField("id", t.StringType()),
                               t.StructField("body", t.BinaryType()),
                               t.StructField("error", t.StringType())])
    local = _local_path(path)
    synced: set[str] = set()
    reader = TopicReader(spark, topic, channel, endpoints, schema=schema,
                         deserializer=deserializer, batch_size=batch_size,
                         batch_timeout=batch_timeout, idle_timeout=idle_timeout,
                         rdy_per_connection=rdy_per_connection,
                         msg_timeout_ms=msg_timeout_ms, metadata=metadata,
                         lookupd_http_addresses=lookupd_http_addresses,
                         lookupd_poll_interval=lookupd_poll_interval,
                         dedupe_window=dedupe_window,
                         staging_path=path.rstrip("/") + "/" + _STAGING,
                         client_options=client_options)
    reader._refused_after_write = True
    parquet = _parquet_options(spark) if local is not None else None
    reader._arrow = parquet is not None
    with reader:
        for batch in reader.batches():
            table = batch._framed.table if batch._framed is not None else None
            if table is not None:
                assert local is not None
                assert parquet is not None
                synced.add(_write_table(table, local, parquet))
            elif batch.rows:
                batch.df.write.mode("append").parquet(path)
            batch._settle()
            if batch.bad:
                spark.createDataFrame([(b.id.decode("ascii", "replace"), b.body, b.error)
                                       for b in batch.bad], bad_schema) \
                    .write.mode("append").parquet(path.rstrip("/") + "/_bad_messages")
                log.warning("%d messages could not be read; kept in %s/_bad_messages",
                            len(batch.bad), path)
            if local is not None:
                _fsync_tree(local, synced)
            batch.commit()
            result.rows += batch.rows
            result.batches += 1
            result.bad += len(batch.bad)
            result.duplicates += batch.duplicates
            if max_rows is not None and result.rows >= max_rows:
                break
    return result


_STAGING = "_staging"  # under a drain's path: hidden from Spark's readers, as _bad_messages

_SPARK_CODECS = {"none": ("none", ""), "uncompressed": ("none", ""),
                 "snappy": ("snappy", ".snappy"), "gzip": ("gzip", ".gz"),
                 "zstd": ("zstd", ".zstd"), "brotli": ("brotli", ".br"),
                 "lz4raw": ("lz4", ".lz4raw"), "lz4_raw": ("lz4", ".lz4raw")}
"""Spark's Parquet codecs Arrow writes: (Arrow's name, the file name's part).  Not
Hadoop's lz4 and lzo."""

_SPARK_TIMESTAMPS = {"INT96": {"use_deprecated_int96_timestamps": True},
                     "TIMESTAMP_MICROS": {"coerce_timestamps": "us"}}
"""How Spark's writer stores timestamps, as Arrow's writer is told to.  Not
TIMESTAMP_MILLIS, which Spark rounds down and Arrow towards zero."""


@dataclass(frozen=True)
class _ParquetOptions:
    suffix: str  # (as in part-<uuid>-c000.snappy.parquet)
    write: dict[str, Any]  # pq.write_table's


def _parquet_options(spark: Any) -> _ParquetOptions | None:
    """Arrow's writer set as the session's Parquet writer is (its codec,
    ``spark.sql.parquet.compression.codec``; how it stores timestamps,
    ``spark.sql.parquet.outputTimestampType``, INT96 unless changed); None where
    Arrow's cannot write the same (a drain then writes every batch through Spark)."""
    codec = spark.conf.get("spark.sql.parquet.compression.codec").lower()
    stamps = spark.conf.get("spark.sql.parquet.outputTimestampType").upper()
    if codec not in _SPARK_CODECS or stamps not in _SPARK_TIMESTAMPS:
        return None
    compression, suffix = _SPARK_CODECS[codec]
    return _ParquetOptions(suffix, {"compression": compression, **_SPARK_TIMESTAMPS[stamps]})


def _write_table(table: pa.Table, root: str, options: _ParquetOptions) -> str:
    """Write `table` as a new Parquet file of the table at `root` (a local directory),
    whole or not at all: it is written and fsynced under the hidden staging
    directory, then renamed into place, and ``_SUCCESS`` made if missing, as
    Spark's writer leaves it.  The file's path."""
    name = f"part-{uuid.uuid4()}-c000{options.suffix}.parquet"  # (as Spark names its files)
    staging = os.path.join(root, _STAGING)
    os.makedirs(staging, exist_ok=True)
    written, final = os.path.join(staging, name), os.path.join(root, name)
    try:
        pq.write_table(table, written, **options.write)
        fd = os.open(written, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(written, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(written)
        raise
    with open(os.path.join(root, "_SUCCESS"), "ab"):
        pass
    return final


def _local_path(path: str) -> str | None:
    if path.startswith("file:"):
        return path[len("file:"):].replace("///", "/", 1)
    return None if "://" in path else path


def _fsync_tree(root: str, synced: set[str]) -> None:
    """fsync the files under `root` not in `synced`, and every directory (Spark's local
    writer does neither)."""
    for directory, dirs, files in os.walk(root):
        if directory == root and _STAGING in dirs:
            dirs.remove(_STAGING)  # (batches waiting for Spark's reader, not the table)
        for name in files:
            full = os.path.join(directory, name)
            if full in synced:
                continue
            synced.add(full)
            fd = os.open(full, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
