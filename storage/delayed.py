"""A persistent, ordered store of deferred messages: ``(due_time, message_id) -> payload``.

Theory of operation
-------------------
gmq keeps its delayed messages in a bbolt B+tree keyed by due time + message id;
we do the same with SQLite from the standard library (the choice, the measured
alternatives and the figures are in ``docs/DELAYED.md``).  One file holds one
table::

    delayed(due INTEGER, id BLOB, payload BLOB, crc INTEGER,
            PRIMARY KEY (due, id)) WITHOUT ROWID
    UNIQUE INDEX delayed_id ON delayed(id)

* The table *is* the B+tree ordered by ``(due, id)``: ``pop_due`` reads a prefix
  of it and deletes that prefix with one range delete; ``next_due`` reads its
  first key.  The unique index on ``id`` serves ``remove`` and enforces
  "one entry per message id": adding an id that is already stored **replaces**
  the old entry (its due time and payload), as ``INSERT OR REPLACE`` does.
* ``crc`` is a CRC32 of due, id and payload.  SQLite checks the structure of
  its pages but not the bytes inside a record; the CRC catches a flipped byte
  in a payload.  An entry whose CRC does not match is logged, counted in
  ``stats()["corrupt_entries"]`` and dropped when it is popped (never returned).
* Durability: WAL journal with ``synchronous=NORMAL``.  A commit is one
  ``write()`` of WAL frames, so when a call returns the change is in the OS and
  survives ``kill -9`` of the process; ``sync()`` checkpoints the WAL, which
  fsyncs the WAL and then the database file.  SQLite's own automatic checkpoints
  fsync too, every ``wal_autocheckpoint`` pages.  A torn WAL tail (power loss)
  fails SQLite's frame checksums and is ignored: only unsynced commits can go.
* ``locking_mode=EXCLUSIVE``: one process owns a store (like a DiskQueue); a
  second opener gets a ``StorageError`` instead of silently sharing it, and no
  ``-shm`` file is needed.
* Open: ``PRAGMA quick_check`` walks every page.  A file that is not a
  database, or fails the check, is renamed ``<file>.bad`` (with its WAL), every
  readable entry with a good CRC is salvaged into a fresh file (reading forwards
  and then backwards around the damage), and the event is logged and counted.
  The open does not fail because of corruption.
* Every call holds a lock, so the store may be called from more than one
  thread, but it is meant to have one owner (an actor).

Time is passed in: ``pop_due(now, ...)`` takes the caller's clock (int
nanoseconds, like NSQ timestamps); the store never reads a clock for ordering.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from storage.errors import QueueClosedError, StorageError

__all__ = ["DelayedStore"]

log = logging.getLogger(__name__)

#: Written to the SQLite header (``PRAGMA application_id``) so we recognise our files.
APPLICATION_ID = 0x5A4E4444  # "ZNDD"
#: On-disk format version (``PRAGMA user_version``).
FORMAT_VERSION = 1
#: File name suffix used when ``DelayedStore`` is given a directory.
SUFFIX = ".delayed.sqlite3"

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_MASK32 = 0xFFFFFFFF
# SQLite primary result codes that mean "this file is damaged".
_SQLITE_CORRUPT = 11
_SQLITE_NOTADB = 26
_SALVAGE_BATCH = 1000
_WAL_SIZE_LIMIT = 4 * 1024 * 1024

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS delayed ("
    " due INTEGER NOT NULL, id BLOB NOT NULL, payload BLOB NOT NULL,"
    " crc INTEGER NOT NULL, PRIMARY KEY (due, id)) WITHOUT ROWID",
    "CREATE UNIQUE INDEX IF NOT EXISTS delayed_id ON delayed(id)",
)
_INSERT_NEW = "INSERT OR IGNORE INTO delayed (due, id, payload, crc) VALUES (?, ?, ?, ?)"
_INSERT_REPLACE = "INSERT OR REPLACE INTO delayed (due, id, payload, crc) VALUES (?, ?, ?, ?)"
_SELECT_DUE = "SELECT due, id, payload, crc FROM delayed WHERE due <= ? ORDER BY due, id LIMIT ?"
_DELETE_PREFIX = "DELETE FROM delayed WHERE (due, id) <= (?, ?)"


def entry_crc(due: int, message_id: bytes, payload: bytes) -> int:
    """CRC32 of one entry, as stored in the ``crc`` column."""
    seed = (due ^ (due >> 32)) & _MASK32
    return zlib.crc32(payload, zlib.crc32(message_id, seed))


def _is_corruption(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in (_SQLITE_CORRUPT, _SQLITE_NOTADB)
    text = str(exc).lower()
    return "malformed" in text or "not a database" in text


def _row(due: Any, message_id: Any, payload: Any) -> tuple[int, bytes, bytes, int]:
    """Validate one entry and return the row to store."""
    if type(due) is not int:
        if isinstance(due, bool) or not isinstance(due, int):
            raise TypeError(f"due_time must be an int (nanoseconds), not {type(due).__name__}")
        due = int(due)
    if not _INT64_MIN <= due <= _INT64_MAX:
        raise ValueError(f"due_time {due} does not fit in a signed 64-bit integer")
    if type(message_id) is not bytes:
        if not isinstance(message_id, bytearray | memoryview):
            raise TypeError(f"message_id must be bytes, not {type(message_id).__name__}")
        message_id = bytes(message_id)
    if not message_id:
        raise ValueError("message_id must not be empty")
    if type(payload) is not bytes:
        if not isinstance(payload, bytearray | memoryview):
            raise TypeError(f"payload must be bytes, not {type(payload).__name__}")
        payload = bytes(payload)
    return due, message_id, payload, entry_crc(due, message_id, payload)


class DelayedStore:
    """Deferred messages ordered by ``(due_time, message_id)``, persisted in SQLite.

    ``DelayedStore(path)`` opens (or creates) the file ``path``;
    ``DelayedStore(directory, name="orders")`` uses ``directory/orders.delayed.sqlite3``
    when ``directory`` is an existing directory.

    * ``add`` / ``add_many`` / ``pop_due`` / ``remove`` are each one transaction:
      when they return, the change survives ``kill -9`` of the process;
      ``sync()`` makes it durable on stable storage.  After a crash a popped
      entry may reappear (at-least-once), an added one is never lost.
    * Message ids are unique: adding an id that is already stored replaces the
      old entry (due time and payload).
    * After ``close()`` or ``delete()`` every call raises ``QueueClosedError``.

    Options:
        verify_on_open: run ``PRAGMA quick_check`` at open (reads every page;
            see docs/DELAYED.md for its cost).  Damage found later, while
            running, raises ``StorageError`` and is repaired at the next open.
        wal_autocheckpoint: WAL pages between SQLite's automatic checkpoints
            (each one fsyncs); SQLite's default is 1000.
        cache_kib: SQLite page cache size in KiB (bounds the store's memory).
        lock_timeout: seconds to wait for a store held by another connection or
            process before ``StorageError`` (0: fail at once; one owner per store).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        name: str = "delayed",
        *,
        verify_on_open: bool = True,
        wal_autocheckpoint: int = 10_000,
        cache_kib: int = 16 * 1024,
        lock_timeout: float = 0.0,
    ) -> None:
        p = Path(path)
        if p.is_dir():
            if not name or "/" in name or os.sep in name or name in (".", ".."):
                raise ValueError(f"invalid delayed store name {name!r}")
            p = p / f"{name}{SUFFIX}"
        self.path = p
        self.name = name
        self._verify = verify_on_open
        self._autocheckpoint = wal_autocheckpoint
        self._cache_kib = cache_kib
        self._lock_timeout = lock_timeout
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._count = 0
        self._dir_synced = False
        self._stats: dict[str, Any] = {
            "adds": 0,
            "replaced": 0,
            "pops": 0,
            "removes": 0,
            "syncs": 0,
            "corrupt_files": 0,
            "corrupt_entries": 0,
            "salvaged_entries": 0,
            "bad_files": [],
            "open_seconds": 0.0,
        }
        started = time.perf_counter()
        self._open()
        self._stats["open_seconds"] = time.perf_counter() - started

    # ------------------------------------------------------------------ open

    def _connect(self, path: Path) -> sqlite3.Connection:
        conn = sqlite3.connect(
            path, timeout=self._lock_timeout, isolation_level=None, check_same_thread=False
        )
        try:
            # EXCLUSIVE before the first WAL access: no -shm file, one owner.
            conn.execute("PRAGMA locking_mode=EXCLUSIVE")
            self._refuse_foreign(conn)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute(f"PRAGMA wal_autocheckpoint={int(self._autocheckpoint)}")
            # After a checkpoint the WAL is cut back to this size (bytes on disk).
            conn.execute(f"PRAGMA journal_size_limit={_WAL_SIZE_LIMIT}")
            conn.execute(f"PRAGMA cache_size=-{int(self._cache_kib)}")
            conn.execute("PRAGMA temp_store=MEMORY")
        except BaseException:
            conn.close()
            raise
        return conn

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            conn = self._connect(self.path)
            try:
                self._prepare(conn)
            except BaseException:
                conn.close()
                raise
        except sqlite3.Error as exc:
            if not _is_corruption(exc):
                raise StorageError(f"cannot open delayed store {self.path}: {exc}") from exc
            conn = self._recover(str(exc))
        self._conn = conn

    def _refuse_foreign(self, conn: sqlite3.Connection) -> None:
        """Raise StorageError for someone else's database, before changing anything."""
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        if app_id != APPLICATION_ID and conn.execute("SELECT 1 FROM sqlite_master").fetchone():
            # A readable database that is not ours: refuse it rather than move it aside.
            raise StorageError(
                f"{self.path} is an SQLite database but not a delayed store "
                f"(application_id {app_id:#x}); refusing to use it"
            )

    def _prepare(self, conn: sqlite3.Connection) -> None:
        """Check the file, create the schema if new, count the entries."""
        has_tables = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] > 0
        if has_tables and self._verify:
            problems = [r[0] for r in conn.execute("PRAGMA quick_check(10)")]
            if problems != ["ok"]:
                raise sqlite3.DatabaseError("malformed: quick_check: " + "; ".join(problems))
        if not has_tables:
            conn.execute("BEGIN IMMEDIATE")
            for statement in _SCHEMA:
                conn.execute(statement)
            conn.execute(f"PRAGMA application_id={APPLICATION_ID}")
            conn.execute(f"PRAGMA user_version={FORMAT_VERSION}")
            conn.execute("COMMIT")
        else:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version != FORMAT_VERSION:
                raise StorageError(
                    f"{self.path}: delayed store format {version} is not supported "
                    f"(this code reads format {FORMAT_VERSION})"
                )
        self._count = conn.execute("SELECT count(*) FROM delayed").fetchone()[0]

    def _recover(self, reason: str) -> sqlite3.Connection:
        """Quarantine a damaged file as ``.bad`` and salvage what can be read."""
        bad = self._quarantine()
        log.warning("delayed store %s is damaged (%s); moved to %s", self.path, reason, bad)
        self._stats["corrupt_files"] += 1
        self._stats["bad_files"].append(str(bad))
        conn = self._connect(self.path)
        try:
            self._prepare(conn)
            salvaged, dropped = self._salvage(bad, conn)
        except BaseException:
            conn.close()
            raise
        self._count = conn.execute("SELECT count(*) FROM delayed").fetchone()[0]
        self._stats["salvaged_entries"] += salvaged
        self._stats["corrupt_entries"] += dropped
        log.warning(
            "delayed store %s: salvaged %d entries from %s, dropped %d with a bad CRC",
            self.path,
            salvaged,
            bad,
            dropped,
        )
        return conn

    def _quarantine(self) -> Path:
        bad = self.path.with_name(self.path.name + ".bad")
        n = 1
        while bad.exists():
            bad = self.path.with_name(f"{self.path.name}.bad.{n}")
            n += 1
        os.replace(self.path, bad)
        for suffix in ("-wal", "-journal"):
            side = Path(str(self.path) + suffix)
            if side.exists():
                os.replace(side, Path(str(bad) + suffix))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(str(self.path) + "-shm")
        return bad

    def _salvage(self, bad: Path, conn: sqlite3.Connection) -> tuple[int, int]:
        """Copy readable entries with a good CRC from ``bad`` into ``conn``."""
        try:
            src = self._connect(bad)
        except (sqlite3.Error, StorageError) as exc:
            log.warning("nothing can be salvaged from %s: %s", bad, exc)
            return 0, 0
        salvaged = dropped = 0
        last_forward: tuple[int, bytes] | None = None
        try:
            for order in ("ASC", "DESC"):
                batch: list[tuple[int, bytes, bytes, int]] = []
                try:
                    cur = src.execute(
                        f"SELECT due, id, payload, crc FROM delayed "  # noqa: S608 - fixed text
                        f"ORDER BY due {order}, id {order}"
                    )
                    for row in cur:
                        key = (row[0], row[1])
                        if order == "DESC" and last_forward is not None and key <= last_forward:
                            break
                        if order == "ASC":
                            last_forward = key
                        if _row_is_sound(row):
                            batch.append(row)
                        else:
                            dropped += 1
                        if len(batch) >= _SALVAGE_BATCH:
                            salvaged += self._insert_salvaged(conn, batch)
                            batch = []
                except sqlite3.Error as exc:
                    log.warning("salvage of %s stopped (%s scan): %s", bad, order, exc)
                salvaged += self._insert_salvaged(conn, batch)
        finally:
            src.close()
        return salvaged, dropped

    @staticmethod
    def _insert_salvaged(
        conn: sqlite3.Connection, rows: list[tuple[int, bytes, bytes, int]]
    ) -> int:
        if not rows:
            return 0
        conn.execute("BEGIN IMMEDIATE")
        cur = conn.executemany(_INSERT_NEW, rows)
        conn.execute("COMMIT")
        return max(cur.rowcount, 0)

    # ------------------------------------------------------------------ API

    def _db(self) -> sqlite3.Connection:
        conn = self._conn
        if conn is None:
            raise QueueClosedError(f"delayed store {self.name!r} ({self.path}) is closed")
        return conn

    def _fail(self, conn: sqlite3.Connection, what: str, exc: sqlite3.Error) -> StorageError:
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        hint = (
            " (the file is damaged; it is repaired at the next open)" if _is_corruption(exc) else ""
        )
        return StorageError(f"delayed store {self.path}: {what} failed: {exc}{hint}")

    def add(self, due_time: int, message_id: bytes, payload: bytes) -> None:
        """Store one entry; an entry with the same ``message_id`` is replaced."""
        row = _row(due_time, message_id, payload)
        with self._lock:
            conn = self._db()
            try:
                if conn.execute(_INSERT_NEW, row).rowcount == 1:
                    self._count += 1
                else:
                    conn.execute(_INSERT_REPLACE, row)
                    self._stats["replaced"] += 1
            except sqlite3.Error as exc:
                raise self._fail(conn, "add", exc) from exc
            self._stats["adds"] += 1

    def add_many(self, entries: Iterable[tuple[int, bytes, bytes]]) -> int:
        """Store many ``(due_time, message_id, payload)`` entries in one transaction.

        Validated all-or-nothing before anything is written.  Later duplicates
        (in the store or in the batch itself) replace earlier ones.  Returns the
        number of entries given.
        """
        rows = [_row(*entry) for entry in entries]
        if not rows:
            with self._lock:
                self._db()
            return 0
        with self._lock:
            conn = self._db()
            try:
                conn.execute("BEGIN IMMEDIATE")
                inserted = conn.executemany(_INSERT_NEW, rows).rowcount
                if inserted < len(rows):
                    # Some ids existed (or repeat in the batch): replace in order so
                    # the last occurrence wins; this does not change the count.
                    conn.executemany(_INSERT_REPLACE, rows)
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                raise self._fail(conn, "add_many", exc) from exc
            self._count += inserted
            self._stats["adds"] += len(rows)
            self._stats["replaced"] += len(rows) - inserted
        return len(rows)

    def pop_due(self, now: int, limit: int) -> list[tuple[int, bytes, bytes]]:
        """Remove and return up to ``limit`` entries with ``due_time <= now``.

        Ordered by ``(due_time, message_id)``.  An entry found corrupt (CRC
        mismatch) is removed, logged and counted but not returned, so fewer than
        ``limit`` entries may come back while more are due.
        """
        if limit <= 0:
            with self._lock:
                self._db()
            return []
        with self._lock:
            conn = self._db()
            try:
                conn.execute("BEGIN IMMEDIATE")
                rows = conn.execute(_SELECT_DUE, (now, limit)).fetchall()
                if rows:
                    last = rows[-1]
                    conn.execute(_DELETE_PREFIX, (last[0], last[1]))
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                raise self._fail(conn, "pop_due", exc) from exc
            self._count -= len(rows)
            out = [(r[0], r[1], r[2]) for r in rows if _row_is_sound(r)]
            if len(out) != len(rows):
                self._report_corrupt_rows(rows)
            self._stats["pops"] += len(out)
            return out

    def entries(self) -> list[tuple[int, bytes, bytes]]:
        """Every entry, ordered by ``(due_time, message_id)``, without removing any.

        What an owner reloads at start to rebuild its in-memory timers; corrupt
        entries are skipped (and counted) as in ``pop_due``.
        """
        with self._lock:
            conn = self._db()
            try:
                rows = conn.execute(
                    "SELECT due, id, payload, crc FROM delayed ORDER BY due, id").fetchall()
            except sqlite3.Error as exc:
                raise self._fail(conn, "entries", exc) from exc
            out = [(r[0], r[1], r[2]) for r in rows if _row_is_sound(r)]
            if len(out) != len(rows):
                self._report_corrupt_rows(rows)
            return out

    def remove_many(self, message_ids: Iterable[bytes]) -> int:
        """Remove several entries in one transaction; returns how many existed."""
        ids = [(bytes(i),) for i in message_ids]
        if not ids:
            return 0
        with self._lock:
            conn = self._db()
            try:
                conn.execute("BEGIN IMMEDIATE")
                before = conn.total_changes
                conn.executemany("DELETE FROM delayed WHERE id = ?", ids)
                removed = conn.total_changes - before
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                raise self._fail(conn, "remove_many", exc) from exc
            self._count -= removed
            self._stats["removes"] += removed
            return removed

    def _report_corrupt_rows(self, rows: list[tuple[int, bytes, bytes, int]]) -> None:
        for r in rows:
            if not _row_is_sound(r):
                self._stats["corrupt_entries"] += 1
                log.warning(
                    "delayed store %s: dropped entry due=%r id=%r: CRC mismatch",
                    self.path,
                    r[0],
                    r[1],
                )

    def remove(self, message_id: bytes) -> bool:
        """Remove the entry with this id; return whether there was one."""
        message_id = bytes(message_id)
        with self._lock:
            conn = self._db()
            try:
                removed = conn.execute("DELETE FROM delayed WHERE id = ?", (message_id,)).rowcount
            except sqlite3.Error as exc:
                raise self._fail(conn, "remove", exc) from exc
            if removed:
                self._count -= 1
                self._stats["removes"] += 1
            return removed > 0

    def next_due(self) -> int | None:
        """The earliest due time stored, or None when empty."""
        with self._lock:
            conn = self._db()
            try:
                row = conn.execute("SELECT due FROM delayed ORDER BY due, id LIMIT 1").fetchone()
            except sqlite3.Error as exc:
                raise self._fail(conn, "next_due", exc) from exc
            return None if row is None else row[0]

    def __len__(self) -> int:
        with self._lock:
            self._db()
            return self._count

    def depth(self) -> int:
        """Number of entries stored (same as ``len(store)``)."""
        return len(self)

    def sync(self) -> None:
        """Make every returned change durable on stable storage (checkpoint + fsync)."""
        with self._lock:
            conn = self._db()
            try:
                busy, _, _ = conn.execute("PRAGMA wal_checkpoint(FULL)").fetchone()
            except sqlite3.Error as exc:
                raise self._fail(conn, "sync", exc) from exc
            if busy:
                raise StorageError(f"delayed store {self.path}: checkpoint did not complete")
            if not self._dir_synced:
                _fsync_dir(self.path.parent)
                self._dir_synced = True
            self._stats["syncs"] += 1

    def empty(self) -> None:
        """Remove every entry (one transaction)."""
        with self._lock:
            conn = self._db()
            try:
                conn.execute("DELETE FROM delayed")
            except sqlite3.Error as exc:
                raise self._fail(conn, "empty", exc) from exc
            self._count = 0

    def close(self) -> None:
        """Checkpoint and close.  Idempotent; later calls raise ``QueueClosedError``."""
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None:
                conn.close()

    def delete(self) -> None:
        """Close and remove the store's files (``.bad`` files are kept)."""
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None:
                conn.close()
            for suffix in ("", "-wal", "-shm", "-journal"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(str(self.path) + suffix)
            self._count = 0

    def stats(self) -> dict[str, Any]:
        """Counters and state; safe to call after close (``closed`` is then True)."""
        with self._lock:
            out = dict(self._stats)
            out["bad_files"] = list(self._stats["bad_files"])
            out["name"] = self.name
            out["path"] = str(self.path)
            out["depth"] = self._count
            out["closed"] = self._conn is None
            out["file_bytes"] = _size(self.path)
            out["wal_bytes"] = _size(Path(str(self.path) + "-wal"))
            return out

    def __enter__(self) -> DelayedStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._conn is None else f"{self._count} entries"
        return f"DelayedStore({str(self.path)!r}, {state})"


def _row_is_sound(row: tuple[int, bytes, bytes, int]) -> bool:
    due, message_id, payload, crc = row
    return (
        type(due) is int
        and type(message_id) is bytes
        and type(payload) is bytes
        and entry_crc(due, message_id, payload) == crc
    )


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
