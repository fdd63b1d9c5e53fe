"""A topic's history: every message it published, kept in chunk files under a retention policy.

Theory of operation
-------------------
NSQ forgets a message once its channels have it; a topic with retention
(#21) also appends each published batch to its *history*, a log of chunk
files in a directory of its own (``<data>/<topic>.history/000001.dat`` ...),
in the format of every queue here (``storage.chunk``: one CRC'd batch frame
per append).  Nothing reads the history to deliver: the channels have their
own copies, so retention never touches what a channel has not consumed.

Retention deletes whole chunk files, oldest first, as EQueue does, so it costs
nothing per message (:meth:`History.trim`):

* by age: a chunk goes once every message in it is older than the limit,
  known without reading it: the next chunk's first message is older (messages
  are appended in publish order);
* by size: the oldest chunks go while the history is over the limit.

The chunk being written is never deleted, so a history holds at least what
was published since it last rotated (``chunk_bytes``): a quiet topic keeps its
recent messages past the age limit until its chunk fills.  A chunk rotates
when the next append would not fit, or when an append comes ``max_chunk_age``
after the chunk's first message (so that age-based retention can delete in
steps of about that age).

Recovery on open: sealed chunks are trusted by their header; the last one is
walked frame by frame and cut after its last valid frame (a torn tail after
``kill -9``, or damage, whose bytes are copied to ``<chunk>.bad``).  A chunk
whose header is damaged is renamed ``.bad`` and skipped.

Reading (for replay): :meth:`History.seek` finds the position of the first
record published at or after a time (or of a message id: ``id_of`` gives a
record's), and :meth:`History.read` reads records from a position, in order,
from the chunk files (positions as a queue's: chunk, frame offset, index).
``complete_from`` (kept in ``history.json``) is the time from which the
history is whole: the time it began (0 when it began with its topic), moved
past each deleted chunk's messages.

Each chunk's first message timestamp is read from its first record when first
needed (``timestamp`` turns a record into its publish time in ns; the broker's
records are NSQ messages, possibly tagged) and remembered.  Durability is
that of a queue: appended bytes are in the OS at once, ``sync()`` (and the
process-wide syncer, ``sync_timeout`` after a write) fdatasyncs them, and an
fsync error fails the history for good (:class:`DiskFailedError`).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import shutil
import struct
import threading
from array import array
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from storage.chunk import (
    BATCH_FLAG,
    HEADER_SIZE,
    LENGTH_MASK,
    RECORD_HEAD,
    RECORD_OVERHEAD,
    ChunkHeader,
    ChunkWriter,
    CorruptRecordError,
    batch_body,
    make_position,
    messages_holding,
    read_record,
    scan,
    split_batch,
    split_position,
)
from storage.diskqueue import MAX_FRAME_BODY, _split_frames
from storage.errors import DiskFailedError, QueueClosedError
from storage.meta import fsync_dir, read_json, write_json
from storage.syncer import SYNCER, Syncer

__all__ = ["History"]

log = logging.getLogger(__name__)

SUFFIX = ".history"
"""The history of topic T is the directory ``T.history`` in the data directory."""

INDEX_SPACING = 32 * 1024
"""Bytes of a chunk between two entries of its index: a lookup reads about that much."""

_U32 = struct.Struct("<I")

META = "history.json"
READ_BYTES = 1 << 20
"""What one read takes from a chunk file at a time (more for a frame that is larger)."""


@dataclass
class _Chunk:
    number: int
    size: int  # bytes of the file
    count: int  # messages
    first_ns: int | None = None  # the first message's timestamp, once read
    first_key: int | None = None  # the first message's key (find_key), once read
    index: tuple[array[int], array[int]] | None = None
    """Sparse index for `find_key`: keys of a frame's first record, and frame offsets,
    a frame every `INDEX_SPACING` bytes at least (kept as appended; else built by a
    walk of the chunk on first need)."""


class History:
    """See the module docstring.  One thread appends, trims and reads at a time; the
    syncer's thread may sync meanwhile."""

    def __init__(self, path: str, *, chunk_bytes: int, max_record: int,
                 timestamp: Callable[[bytes], int], sync_timeout: float = 2.0,
                 max_chunk_age_ns: int = 0, syncer: Syncer = SYNCER,
                 created_ns: int = 0, key: Callable[[bytes], int] | None = None) -> None:
        self.path = path
        self.chunk_bytes = chunk_bytes
        self.max_record = max_record
        self.max_chunk_age_ns = max_chunk_age_ns
        self._timestamp = timestamp
        self._key = key  # a record's sortable key (the broker's: its message id)
        self._sync_timeout = sync_timeout
        self._syncer = syncer
        self._lock = threading.Lock()
        self._chunks: list[_Chunk] = []
        self._writer: ChunkWriter | None = None
        self._sync_scheduled = False
        self._dir_dirty = False
        self._sealed: list[str] = []  # chunks sealed since the last sync, not yet fsynced
        self._closed = False
        self.failed = ""
        self.deleted_chunks = 0
        created = not os.path.isdir(path)
        os.makedirs(path, exist_ok=True)
        if created:
            fsync_dir(os.path.dirname(os.path.abspath(path)))
            write_json(os.path.join(path, META), {"complete_from": created_ns})
        meta = read_json(os.path.join(path, META)) or {}
        complete = meta.get("complete_from")
        # (a history without its record is whole from its oldest message only)
        self.complete_from: int | None = complete if type(complete) is int else None
        clean = meta.get("clean")
        self._recover(clean if isinstance(clean, list) and len(clean) == 3
                      and all(type(v) is int for v in clean) else None)
        if self.complete_from is None:
            oldest = next((c for c in self._chunks if c.count), None)
            self.complete_from = (self._first_ns(oldest) or 0) if oldest is not None else 0
        if clean is not None:  # (trusted once: appends after this open must be scanned)
            self._write_meta()

    # ------------------------------------------------------------------ open

    def _file(self, number: int) -> str:
        return os.path.join(self.path, f"{number:06d}.dat")

    def _write_meta(self, clean: list[int] | None = None) -> None:
        meta: dict[str, object] = {"complete_from": self.complete_from or 0}
        if clean is not None:
            meta["clean"] = clean
        write_json(os.path.join(self.path, META), meta)

    def _recover(self, clean: list[int] | None) -> None:
        """Find the chunks; walk the last one to its last whole frame, unless `clean`
        (``[number, end, count]``, what :meth:`close` recorded) still matches it."""
        numbers = sorted(int(name[:-4]) for name in os.listdir(self.path)
                         if name.endswith(".dat") and name[:-4].isdigit())
        for i, number in enumerate(numbers):
            path = self._file(number)
            last = i == len(numbers) - 1
            header = _header(path)
            if header is None:
                log.error("history %s: chunk %s has a damaged header; moved aside as .bad",
                          self.path, path)
                os.replace(path, path + ".bad")
                continue
            if header.sealed and not last:
                self._chunks.append(_Chunk(number, os.path.getsize(path), header.count))
                continue
            if last and not header.sealed and clean is not None and clean[0] == number \
                    and os.path.getsize(path) == clean[1]:  # closed cleanly: no walk
                self._writer = ChunkWriter(path, number, self.chunk_bytes, create=False,
                                           end=clean[1], count=clean[2])
                self._chunks.append(_Chunk(number, clean[1], clean[2]))
                continue
            result = scan(path, self.max_record)
            if not result.clean and not result.torn:
                log.error("history %s: chunk %s is damaged after %d messages; the rest is "
                          "kept aside in %s.bad", self.path, path, result.count, path)
                shutil.copyfile(path, path + ".bad")
            if header.sealed or not last:  # (an unsealed chunk before the last: cut it)
                with open(path, "r+b") as f:
                    f.truncate(result.end)
                self._chunks.append(_Chunk(number, result.end, result.count))
                continue
            with open(path, "r+b") as f:  # the chunk being written: append after its end
                f.truncate(result.end)
            self._writer = ChunkWriter(path, number, self.chunk_bytes, create=False,
                                       end=result.end, count=result.count)
            self._chunks.append(_Chunk(number, result.end, result.count))

    # ----------------------------------------------------------------- write

    def append(self, records: Sequence[bytes]) -> None:
        """Append records (in publish order) as one frame (several past 1 MiB)."""
        if not records:
            return
        records = list(records)
        groups = ([(records, [len(r) for r in records])]
                  if sum(map(len, records)) <= MAX_FRAME_BODY and len(records) < 65536
                  else _split_frames(records))
        with self._lock:
            if self._closed:
                raise QueueClosedError(f"history {self.path} is closed")
            if self.failed:
                raise DiskFailedError(self.failed)
            for messages, lengths in groups:
                body = batch_body(messages, lengths)
                w = self._room(len(body) + RECORD_OVERHEAD, messages[0])
                offset = w.append_batch(body, len(messages))
                current = self._chunks[-1]
                current.size, current.count = w.end, w.count
                index = current.index
                if index is not None and self._key is not None and (
                        not index[1] or offset - index[1][-1] >= INDEX_SPACING):
                    index[0].append(self._key(messages[0]))
                    index[1].append(offset)
                if current.first_ns is None:
                    current.first_ns = self._timestamp(messages[0])
            if not self._sync_scheduled:
                self._sync_scheduled = True
                self._syncer.schedule(self, self._sync_timeout)

    def _room(self, nbytes: int, first: bytes) -> ChunkWriter:
        """The writer that takes `nbytes` more: the current chunk, or a new one when it
        is full or (``max_chunk_age_ns``) its first message is that old."""
        w = self._writer
        if w is not None and (not w.count or (w.room_for(nbytes) and not self._aged(first))):
            return w
        number = self._chunks[-1].number + 1 if self._chunks else 1
        nxt = ChunkWriter(self._file(number), number, self.chunk_bytes, create=True)
        self._dir_dirty = True
        if w is not None:
            # (its fsync waits for the next sync, off the appending thread when not durable)
            w.seal(fsync=False)
            self._sealed.append(w.path)
            self._chunks[-1].size = w.end
        self._writer = nxt
        self._chunks.append(_Chunk(number, nxt.end, 0, index=(array("q"), array("q"))))
        return nxt

    def _aged(self, first: bytes) -> bool:
        """Whether the chunk being written began ``max_chunk_age_ns`` before `first`."""
        began = self._chunks[-1].first_ns
        return bool(self.max_chunk_age_ns) and began is not None and \
            self._timestamp(first) - began >= self.max_chunk_age_ns

    def sync(self) -> None:
        """fdatasync what was appended (and the directory, if a chunk was created)."""
        with self._lock:
            self._sync_locked()

    def _sync_locked(self) -> None:
        self._sync_scheduled = False
        if self._closed:
            return
        if self.failed:
            raise DiskFailedError(self.failed)
        try:
            for path in self._sealed:
                _fsync_file(path)
            self._sealed = []
            if self._writer is not None:
                self._writer.flush()
            if self._dir_dirty:
                fsync_dir(self.path)
                self._dir_dirty = False
        except OSError as e:
            self.failed = f"history {self.path}: fsync failed: {e}"
            raise DiskFailedError(self.failed) from e

    def _timed_sync(self) -> None:
        with self._lock, contextlib.suppress(DiskFailedError):  # (the next write says)
            self._sync_locked()

    # ---------------------------------------------------------------- retain

    def trim(self, *, now_ns: int, max_age_ns: int = 0, max_bytes: int = 0,
             keep_from: int | None = None) -> int:
        """Delete the oldest chunks the policy no longer keeps (0: no limit of that
        kind); never the chunk being written, nor (`keep_from`, a position a reader
        still has to read from) the chunk of that position and later ones.  Returns
        how many were deleted."""
        deleted = 0
        held = split_position(keep_from)[0] if keep_from is not None else None
        with self._lock:
            chunks = self._chunks
            while len(chunks) > 1 and (held is None or chunks[0].number < held):
                too_big = bool(max_bytes) and self._bytes() > max_bytes
                too_old = False
                if max_age_ns and not too_big:
                    # every message of the oldest chunk is at or before the next's first
                    nxt = self._first_ns(chunks[1])
                    too_old = nxt is not None and nxt < now_ns - max_age_ns
                if not (too_big or too_old):
                    break
                gone = chunks.pop(0)
                # whole from after the newest message deleted (at most the next's first),
                # recorded before the file goes: a crash between them must not leave a
                # record that claims what is gone
                first = self._first_ns(chunks[0])
                if first is not None and first + 1 > (self.complete_from or 0):
                    self.complete_from = first + 1
                    self._write_meta()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._file(gone.number))
                deleted += 1
            if deleted:
                self.deleted_chunks += deleted
                self._dir_dirty = True
        return deleted

    def _bytes(self) -> int:
        return sum(c.size for c in self._chunks)

    def _first_ns(self, chunk: _Chunk) -> int | None:
        """The timestamp of `chunk`'s first message (read once), None if it has none."""
        if chunk.first_ns is None and chunk.count:
            first = self._first_record(chunk.number)
            if first is not None:
                chunk.first_ns = self._timestamp(first)
        return chunk.first_ns

    def _first_record(self, number: int) -> bytes | None:
        try:
            with open(self._file(number), "rb") as f:
                head = f.read(HEADER_SIZE + 8)
                if len(head) < HEADER_SIZE + 8:
                    return None
                length = int.from_bytes(head[HEADER_SIZE:HEADER_SIZE + 4], "little")
                f.seek(HEADER_SIZE)
                raw = f.read(8 + (length & 0x7FFFFFFF) + 4)
            field, body, _ = read_record(raw, 0, len(raw))
        except (OSError, CorruptRecordError):
            return None
        return split_batch(body)[0] if field & 0x80000000 else body

    # ------------------------------------------------------------------ read

    def end(self) -> int:
        """The position after the newest record (where the next append goes)."""
        with self._lock:
            return self._end_locked()

    def oldest(self) -> int:
        """The position of the oldest record kept (`end()` when there is none)."""
        with self._lock:
            if not self._chunks:
                return make_position(1, HEADER_SIZE)
            return make_position(self._chunks[0].number, HEADER_SIZE)

    def read(self, position: int, limit: int, end: int | None = None,
             ) -> tuple[list[tuple[int, bytes]], int]:
        """Up to `limit` `(position, record)` pairs from `position` on, in order, before
        `end` (default: the newest); and the position to read from next.  A position
        in a chunk that was deleted reads from the oldest kept."""
        out: list[tuple[int, bytes]] = []
        with self._lock:
            newest = self._end_locked()
            stop = newest if end is None else min(end, newest)
            numbers = [c.number for c in self._chunks]
            by_number = {c.number: c for c in self._chunks}
            number, offset, index = split_position(position)
            while len(out) < limit and make_position(number, offset, index) < stop:
                chunk = by_number.get(number)
                if chunk is None or offset >= chunk.size:  # deleted, or read to its end
                    later = [n for n in numbers if n > number]
                    if not later:
                        break
                    number, offset, index = later[0], HEADER_SIZE, 0
                    continue
                offset, index = self._read_chunk(chunk, offset, index, limit=limit,
                                                 stop=stop, out=out)
        return out, make_position(number, offset, index)

    def _end_locked(self) -> int:
        if not self._chunks:
            return make_position(1, HEADER_SIZE)
        last = self._chunks[-1]
        return make_position(last.number, last.size)

    def _read_chunk(self, chunk: _Chunk, offset: int, index: int, *, limit: int, stop: int,
                    out: list[tuple[int, bytes]]) -> tuple[int, int]:
        """Read whole frames of `chunk` from `offset` (from record `index` of the first)
        into `out`; returns where the next read starts, `(offset, index)`."""
        with open(self._file(chunk.number), "rb") as f:
            f.seek(offset)
            data = f.read(min(READ_BYTES, chunk.size - offset))
            if len(data) >= RECORD_HEAD.size:
                need = (RECORD_HEAD.unpack_from(data, 0)[0] & LENGTH_MASK) + RECORD_OVERHEAD
                if need > len(data):  # a frame larger than one read: read all of it
                    f.seek(offset)
                    data = f.read(need)
        at = 0
        base = chunk.number << 48
        while len(out) < limit and at < len(data):
            try:
                field, body, nxt = read_record(data, at, len(data))
            except CorruptRecordError:
                if at == 0:  # damage: the rest of this chunk cannot be read
                    log.error("history %s: chunk %d is damaged at %d; skipping its rest",
                              self.path, chunk.number, offset)
                    return chunk.size, 0
                break  # (a frame cut by the end of this read: the next read takes it)
            records = split_batch(body) if field & BATCH_FLAG else [body]
            frame_at = offset + at
            for i in range(index, len(records)):
                position = base | frame_at << 16 | i
                if position >= stop or len(out) >= limit:
                    return frame_at, i
                out.append((position, records[i]))
            at, index = nxt, 0
        return offset + at, index

    def seek(self, timestamp_ns: int) -> int:
        """The position of the first record published at or after `timestamp_ns` (in
        history order), or `end()` if there is none."""
        with self._lock:
            chunks = list(self._chunks)
        start = 0
        for i in range(len(chunks) - 1, -1, -1):  # the last chunk that began before it
            first = self._first_ns(chunks[i])
            if first is not None and first < timestamp_ns:
                start = i
                break
        position = make_position(chunks[start].number, HEADER_SIZE) if chunks else self.end()
        while True:
            items, nxt = self.read(position, 4096)
            for pos, record in items:
                if self._timestamp(record) >= timestamp_ns:
                    return pos
            if not items:
                return self.end()
            position = nxt

    def find_id(self, message_id: bytes, id_of: Callable[[bytes], bytes],
                near_ns: int, *, walk: bool = False) -> tuple[int, bytes] | None:
        """`(position, record)` of the record whose id is `message_id`; None if it is not
        kept.  With a `key`, by the chunks' sparse indexes (keys grow in history order);
        otherwise, or if that misses (keys out of order), from the first record
        published at `near_ns` or just before (the time in the id) to a second after
        it; with `walk`, on to the newest (a dead-letter topic's history: a record
        comes when it failed, any time after the time in its id).
        `id_of` gives a part of the record (only records holding `message_id`'s bytes
        are looked at)."""
        if self._key is not None:
            found = self.find_key(int(message_id, 16), lambda r: id_of(r) == message_id,
                                  message_id)
            if found is not None:
                return found
        position = self.seek(near_ns - 1_000_000_000)  # (a second of slack for clocks)
        while True:
            items, nxt = self.read(position, 4096)
            if not items:
                break
            for pos, record in items:
                if id_of(record) == message_id:
                    return pos, record
                if not walk and self._timestamp(record) > near_ns + 1_000_000_000:
                    return None
            position = nxt
        return None

    def find_key(self, key: int, match: Callable[[bytes], bool],
                 needle: bytes = b"") -> tuple[int, bytes] | None:
        """`(position, record)` of the record `match` accepts, among those whose chunk and
        index entry say they may hold `key`: a binary search over the chunks by their
        first record's key, then over the chunk's index, then a read of the entry's
        frames (about `INDEX_SPACING` bytes; with `needle`, only the records holding those
        bytes are looked at).  None if it is not there."""
        assert self._key is not None
        with self._lock:
            chunks = [c for c in self._chunks if c.count]
            lo, hi = 0, len(chunks)  # the last chunk whose first key is at most `key`
            while lo < hi:
                mid = (lo + hi) // 2
                first = self._first_key(chunks[mid])
                if first is not None and first <= key:
                    lo = mid + 1
                else:
                    hi = mid
            if lo == 0:
                return None
            chunk = chunks[lo - 1]
            keys, offsets = chunk.index or self._walk_index(chunk)
            i = bisect_right(keys, key) - 1
            if i < 0:
                return None
            start = offsets[i]
            end = offsets[i + 1] if i + 1 < len(offsets) else chunk.size
            with open(self._file(chunk.number), "rb") as f:
                f.seek(start)
                data = f.read(end - start)
        at, base = 0, chunk.number << 48
        while at < len(data):
            try:
                field, body, nxt = read_record(data, at, len(data))
            except CorruptRecordError:
                return None
            records = messages_holding(field, body, needle) if needle else \
                enumerate(split_batch(body) if field & BATCH_FLAG else [body])
            for i, record in records:
                if match(record):
                    return base | (start + at) << 16 | i, record
            at = nxt
        return None

    def _first_key(self, chunk: _Chunk) -> int | None:
        if chunk.first_key is None and self._key is not None:
            first = self._first_record(chunk.number)
            if first is not None:
                chunk.first_key = self._key(first)
        return chunk.first_key

    def _walk_index(self, chunk: _Chunk) -> tuple[array[int], array[int]]:
        """Build `chunk`'s sparse index from its file (each frame's head, and its first
        record's key), once; kept while the history is open."""
        assert self._key is not None
        keys, offsets = array("q"), array("q")
        with open(self._file(chunk.number), "rb") as f, \
                mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            offset, end = HEADER_SIZE, min(chunk.size, len(data))
            while offset + RECORD_OVERHEAD <= end:
                field = RECORD_HEAD.unpack_from(data, offset)[0]
                length = field & LENGTH_MASK
                if not offsets or offset - offsets[-1] >= INDEX_SPACING:
                    body = offset + 8
                    if field & BATCH_FLAG:
                        k = _U32.unpack_from(data, body)[0]
                        first = body + 4 + 4 * k
                        first_record = data[first:first + _U32.unpack_from(data, body + 4)[0]]
                    else:
                        first_record = data[body:body + length]
                    keys.append(self._key(first_record))
                    offsets.append(offset)
                offset += length + RECORD_OVERHEAD
        chunk.index = (keys, offsets)
        return chunk.index

    # ------------------------------------------------------------------ look

    def stats(self) -> dict[str, int]:
        """``retained_bytes``, ``retained_messages``, ``oldest_retained_timestamp`` (ns,
        0 when empty), ``chunks`` and ``deleted_chunks`` (since open)."""
        with self._lock:
            oldest = next((c for c in self._chunks if c.count), None)
            first = self._first_ns(oldest) if oldest is not None else None
            return {"retained_bytes": self._bytes(),
                    "retained_messages": sum(c.count for c in self._chunks),
                    "oldest_retained_timestamp": first or 0,
                    "chunks": len(self._chunks), "deleted_chunks": self.deleted_chunks}

    # ----------------------------------------------------------------- close

    def close(self, *, sync: bool = True) -> None:
        """Sync (unless `sync` is False: a crash's release) and let go of the files (the
        chunk being written stays unsealed, to be appended to after the next open)."""
        with self._lock:
            if self._closed:
                return
            clean = None
            try:
                if sync and not self.failed:
                    self._sync_locked()
                    w = self._writer
                    if w is not None:  # cut to its data, so the next open need not walk it
                        clean = [w.number, w.end, w.count]
            finally:
                self._closed = True
                if self._writer is not None:
                    self._writer.close(truncate=clean is not None)
                    self._writer = None
            if clean is not None:
                self._write_meta(clean)

    def delete(self) -> None:
        """Remove the history and its directory."""
        with self._lock:
            self._closed = True
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            self._chunks = []
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            fsync_dir(os.path.dirname(os.path.abspath(self.path)))


def _fsync_file(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:  # (trimmed since it was sealed)
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _header(path: str) -> ChunkHeader | None:
    try:
        with open(path, "rb") as f:
            return ChunkHeader.unpack(f.read(HEADER_SIZE))
    except OSError:
        return None


def history_path(data_path: str, name: str) -> str:
    """Where the history of the topic `name` lives in `data_path`."""
    return os.path.join(data_path, name + SUFFIX)
