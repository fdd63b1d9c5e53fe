"""`DiskQueue`: a crash-safe FIFO of byte messages in chunk files (go-diskqueue semantics).

Theory of operation
-------------------
Records are appended to the newest chunk file through a shared mmap
(`storage.chunk.ChunkWriter`), so a `put` that returned has its bytes in the
OS page cache and survives `kill -9` of the process.  `sync()` -- called every
`sync_every` puts, `sync_timeout` seconds after the first unsynced change (one
background thread per process, `storage.syncer`), and on `close()` -- msyncs
and fsyncs the chunk and atomically rewrites the metadata file, which holds
only the *read* position.  The write position is never trusted from
metadata: on open the last chunk is scanned to its last valid record (EQueue).

Every record has a sequence number counted from the open (`_written` counts
records available, `_read` counts records consumed), so `depth()` needs no
lock.  The newest records also sit in a fixed-size *ring* indexed by
sequence number: a reader that keeps up is served the very bytes objects that
were put, without touching the file.  Older records come through the chunk
cache (`storage.cache`).

Ack-position mode (`ack_mode=True`, used by channels): `read()` hands out
`(position, payload)` and remembers the position as pending; `ack(position)`
finishes it, in any order.  Acks are appended to a small journal file (in the
OS when `ack` returns); metadata keeps the *ack floor* (the oldest record not
yet acked).  A chunk is deleted only when the floor has moved past it.  On
reopen, reading restarts at the floor and skips the records the journal
says were acked, so every un-acked record is delivered again and nothing that
was acked is.

Threads: one writer thread and one reader thread (which also acks) may use a
queue at once.  Lock order is read lock, then write lock, then meta lock; the
writer never takes the read lock.

File names follow go-diskqueue: ``<name>.diskqueue.<n:06d>.dat`` for chunks,
``<name>.diskqueue.meta.dat`` for metadata, ``<name>.diskqueue.acks.dat`` for
the ack journal; damaged data is kept beside them with a ``.bad`` suffix.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import itertools
import json
import logging
import mmap
import os
import re
import shutil
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from storage.cache import ChunkCache, FileView, MapView, MemoryProbe, machine_memory_percent
from storage.chunk import (
    BATCH_FLAG,
    CRC_SEED,
    HEADER_SIZE,
    LENGTH_MASK,
    MAX_BATCH,
    RECORD_HEAD,
    RECORD_OVERHEAD,
    RECORD_TAIL,
    ChunkHeader,
    ChunkWriter,
    CorruptRecordError,
    batch_body,
    make_position,
    messages_holding,
    read_record,
    scan,
    seal_file,
    split_batch,
    split_position,
)
from storage.crc import crc32c as crc32
from storage.errors import DiskFailedError, MessageSizeError, QueueClosedError, StorageError
from storage.meta import fsync_dir, read_json, write_atomic, write_json
from storage.syncer import SYNCER, Syncer

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[^/\\\x00]{1,200}$")
_ACK_HEAD = struct.Struct("<II")  # count of positions, CRC-32C of the positions' bytes
#: Frames up to this size are kept in the ring of recent frames.
RING_MAX_FRAME = 64 * 1024
#: A `put_many` batch is split into frames of at most this many body bytes.
MAX_FRAME_BODY = 1024 * 1024
#: Messages decoded from a chunk per read-ahead step.
READ_AHEAD = 512
#: The ack journal is rewritten once it holds this many entries (or 4x the live ones).
JOURNAL_COMPACT_MIN = 65536
#: `DiskQueue.find`: the frames one summary entry covers span at least this many bytes.
FIND_SPAN = 32 * 1024
META_VERSION = 2
_pack_head = RECORD_HEAD.pack
_pack_tail = RECORD_TAIL.pack
_crc32 = crc32


def _split_frames(messages: list[bytes]) -> list[tuple[list[bytes], list[int]]]:
    """Group a large batch into frames of at most MAX_FRAME_BODY bytes / MAX_BATCH messages."""
    frames: list[tuple[list[bytes], list[int]]] = []
    group: list[bytes] = []
    lengths: list[int] = []
    size = 0
    for m in messages:
        n = len(m)
        if group and (size + n > MAX_FRAME_BODY or len(group) == MAX_BATCH):
            frames.append((group, lengths))
            group, lengths, size = [], [], 0
        group.append(m)
        lengths.append(n)
        size += n
    frames.append((group, lengths))
    return frames


def _ack_record(positions: list[int]) -> bytes:
    """One journal record: count, CRC-32C, then the positions as u64 (one per ack)."""
    body = struct.pack(f"<{len(positions)}Q", *positions)
    return _ACK_HEAD.pack(len(positions), crc32(body)) + body


class _Runs:
    """Ack mode's record of what was handed out and is not yet behind the floor.

    Runs ``[positions, index in the chunk of the first, start, flags]`` in read
    order: the positions of one `_take` in one chunk (ascending, as everything
    read after them), and a byte a position, 1 once it is acked.  The head run's
    position at `start` is the floor, the oldest pending one.

    An ack finds its run by bisection over the runs' first positions, and its
    place in the run by bisection; the acks after it that are the run's next
    positions, in order (a consumer's FIN of a delivery: a stretch of one run),
    are checked and marked as one slice, in C.  Only acks out of order cost
    bisections each; none costs a set's insertion and removal a record (3x the
    cost a record of a drain of runs acked in order, where the set of ~100,000
    pending positions was past the CPU's caches)."""

    __slots__ = ("_firsts", "_gone", "_runs", "pending", "total")

    def __init__(self) -> None:
        self._runs: deque[list[Any]] = deque()
        self._firsts: list[int] = []  # each run's first position, the live ones from _gone
        self._gone = 0
        self.pending = 0  # positions handed out and not acked
        self.total = 0  # positions in runs from their start: pending, or acked early

    def __bool__(self) -> bool:
        return bool(self._runs)

    def clear(self) -> None:
        self._runs.clear()
        self._firsts.clear()
        self._gone = self.pending = self.total = 0

    def add(self, positions: list[int], base: int, *, pending: bool = True) -> None:
        """A run handed out: `positions` in one chunk, the first at index `base` in it;
        pending, or already acked (skipped: acked before a reopen)."""
        n = len(positions)
        self._runs.append([positions, base, 0, bytearray(n) if pending else _ACKED * n])
        self._firsts.append(positions[0])
        self.total += n
        if pending:
            self.pending += n

    def floor(self) -> tuple[int, int] | None:
        """(position, index in chunk) of the oldest pending position, None if none is.
        (The sync thread asks without the read lock: the head run is read once.)"""
        try:
            positions, base, start, _ = self._runs[0]
        except IndexError:
            return None
        return positions[start], base + start

    def _find(self, position: int) -> tuple[list[Any], int] | None:
        """The run holding `position` and its index there, None if no run holds it."""
        r = bisect.bisect_right(self._firsts, position, self._gone) - 1 - self._gone
        if r < 0:
            return None
        run = self._runs[r]
        held = run[0]
        i = bisect.bisect_left(held, position)
        if i == len(held) or held[i] != position:
            return None
        return run, i

    def is_pending(self, position: int) -> bool:
        found = self._find(position)
        return found is not None and not found[0][3][found[1]]

    def ack(self, acks: list[int]) -> list[int]:
        """Mark `acks` acked and move the floor; returns those that were pending, once each."""
        done: list[int] = []
        j, n = 0, len(acks)
        while j < n:
            found = self._find(acks[j])
            if found is None:  # not handed out, or behind the floor (acked already)
                j += 1
                continue
            run, i = found
            held, flags = run[0], run[3]
            # the longest stretch from j that is the run's next positions, in order
            k = min(n - j, len(held) - i)
            if held[i : i + k] != acks[j : j + k]:
                lo, hi = 1, k - 1  # held[i] == acks[j]; the stretch is shorter than k
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if held[i : i + mid] == acks[j : j + mid]:
                        lo = mid
                    else:
                        hi = mid - 1
                k = lo
            if flags.find(1, i, i + k) < 0:  # all pending: one slice
                flags[i : i + k] = _ACKED * k
                done += acks[j : j + k]
            else:  # (acked twice: each looked at)
                for x in range(i, i + k):
                    if not flags[x]:
                        flags[x] = 1
                        done.append(held[x])
            j += k
        self.pending -= len(done)
        self._advance()
        return done

    def _advance(self) -> None:
        """Move the floor past the acked positions at the head: whole runs popped, and
        the first pending position of the rest found by one search in C."""
        runs = self._runs
        while runs:
            head = runs[0]
            held, _, start, flags = head
            k = flags.find(0, start)
            if k < 0:
                runs.popleft()
                self._gone += 1
                self.total -= len(held) - start
                continue
            self.total -= k - start
            head[2] = k
            break
        if self._gone > 64 and 2 * self._gone > len(self._firsts):
            del self._firsts[: self._gone]
            self._gone = 0

    def acked_early(self) -> list[int]:
        """The positions above the floor that were acked (those the journal must keep)."""
        return [p for held, _, start, flags in self._runs
                for p in itertools.compress(itertools.islice(held, start, None),
                                            itertools.islice(flags, start, None))]


_ACKED = bytearray(b"\x01")  # a run's flag of an acked position


class _Summary:
    """A chunk's summary entries for `DiskQueue.find`: the frames from ``starts[i]`` to
    ``ends[i]`` hold keys from ``leasts[i]`` to ``greatests[i]``.  While each entry's
    keys are at least the previous entry's (`ordered`: a channel's ids), the entries
    that may hold a key are found by bisection; otherwise each is looked at."""

    __slots__ = ("done", "ends", "greatests", "leasts", "ordered", "sealed", "starts")

    def __init__(self) -> None:
        self.done = HEADER_SIZE  # summarised up to this offset
        self.sealed = False  # summarised to the end of a sealed chunk
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.leasts: list[bytes] = []
        self.greatests: list[bytes] = []
        self.ordered = True

    def add(self, start: int, end: int, least: bytes, greatest: bytes) -> None:
        if self.greatests and least < self.greatests[-1]:
            self.ordered = False
        self.starts.append(start)
        self.ends.append(end)
        self.leasts.append(least)
        self.greatests.append(greatest)

    def spans(self, key: bytes) -> list[tuple[int, int]]:
        """`(start, end)` of every entry whose range holds `key`, in file order."""
        leasts, greatests = self.leasts, self.greatests
        if not leasts:
            return []
        if self.ordered:
            if key < leasts[0] or key > greatests[-1]:
                return []
            i = bisect.bisect_left(greatests, key)  # the first that may hold it
            out = []
            while i < len(leasts) and leasts[i] <= key:
                out.append((self.starts[i], self.ends[i]))
                i += 1
            return out
        return [(self.starts[i], self.ends[i]) for i in range(len(leasts))
                if leasts[i] <= key <= greatests[i]]


class DiskQueue:
    """A durable FIFO queue of byte strings; see the module docstring."""

    def __init__(
        self,
        name: str,
        data_path: str | os.PathLike[str],
        *,
        max_bytes_per_file: int = 100 * 1024 * 1024,
        min_msg_size: int = 0,
        max_msg_size: int = 1024 * 1024,
        sync_every: int = 2500,
        sync_timeout: float = 2.0,
        ack_mode: bool = False,
        ring_size: int = 4096,
        cache_low_watermark: float = 40.0,
        cache_high_watermark: float = 75.0,
        cache_idle_seconds: float = 5.0,
        memory_probe: MemoryProbe = machine_memory_percent,
        clock: Callable[[], float] = time.monotonic,
        syncer: Syncer = SYNCER,
    ) -> None:
        if not _NAME_RE.match(name):
            raise ValueError(f"invalid queue name {name!r}: 1-200 characters, "
                             "no '/', '\\\\' or NUL")
        if not 0 <= min_msg_size <= max_msg_size:
            raise ValueError("need 0 <= min_msg_size <= max_msg_size")
        if max_bytes_per_file < HEADER_SIZE + RECORD_OVERHEAD:
            raise ValueError("max_bytes_per_file is too small to hold a record")
        if sync_every < 1 or sync_timeout <= 0 or ring_size < 1:
            raise ValueError("sync_every and ring_size must be >= 1 and sync_timeout > 0")
        self.name = name
        self.data_path = os.fspath(data_path)
        self.ack_mode = ack_mode
        self._max_bytes = max_bytes_per_file
        self._min = min_msg_size
        self._max = max_msg_size
        self._sync_every = sync_every
        self._sync_timeout = sync_timeout
        self._syncer = syncer
        self._prefix = os.path.join(self.data_path, f"{name}.diskqueue.")
        self._meta_path = self._prefix + "meta.dat"
        self._acks_path = self._prefix + "acks.dat"

        self._wlock = threading.Lock()
        self._rlock = threading.RLock()
        self._metalock = threading.Lock()
        self._rcond = threading.Condition(threading.Lock())
        self._waiting = False
        self._closed = False

        # ring of recent frames: slot seq % size -> (seq, position, payload | [payloads], end)
        self._ring: list[tuple[int, int, Any, int] | None] = [None] * ring_size
        self._ring_size = ring_size
        self._clock = clock
        self._cache = ChunkCache(low_watermark=cache_low_watermark,
                                 high_watermark=cache_high_watermark,
                                 idle_seconds=cache_idle_seconds, probe=memory_probe,
                                 clock=clock)
        self._counts: dict[int, int] = {}  # sealed chunk -> message count
        self._chunk_reads: dict[int, int] = {}  # chunk -> messages decoded from it
        self._chunk_writes: dict[int, int] = {}  # chunk -> messages written to it
        self._view: MapView | FileView | None = None
        self._view_live = False
        self._ahead: deque[tuple[int, bytes]] = deque()  # decoded, not yet consumed
        self._unsynced = 0
        self._sync_scheduled = False
        self._bytes_written = 0
        self._c = dict.fromkeys(("bytes_read", "ring_hits", "corruptions",
                                 "torn_tails", "syncs", "bad_files", "acks",
                                 "acks_not_journaled", "lost_to_corruption"), 0)
        # ack mode: what was handed out and not yet acked, and the floor (`_Runs`)
        self._runs = _Runs()
        self._read_mark = self._meta_read = 0  # see `read_before` (set by `_recover`)
        self._meta_time = -float("inf")  # when a sync last wrote the metadata (`_write_meta`)
        self._skip: set[int] = set()
        self._journal_fd = -1
        self._journal_entries = 0
        self._summaries: dict[int, _Summary] = {}  # chunk -> its summary, for `find`
        self._journal_torn = False  # an append failed (disk full): rewrite before the next
        # A file was created (a chunk, the ack journal) since the directory was last
        # fsynced: the next sync fsyncs it too, or a power cut may drop the new entry
        # -- and a new chunk's acknowledged messages with it -- though its data was synced.
        self._dir_dirty = False
        #: Why the queue takes no more writes (an fsync failed), or None.
        self.failed: str | None = None

        os.makedirs(self.data_path, exist_ok=True)
        self._recover()

    # ------------------------------------------------------------------ paths

    def _chunk_path(self, n: int) -> str:
        return f"{self._prefix}{n:06d}.dat"

    def _existing_chunks(self, meta: dict[str, Any]) -> list[int]:
        """This queue's chunk numbers, found without listing the directory when possible.

        A data directory holds every queue's files (80,000 for 10,000 topics),
        so a listing costs tens of milliseconds and opening N queues O(N^2).
        The metadata therefore records the range of chunks alive when it was
        written (``chunks: [oldest, newest]``), rewritten whenever chunks are
        deleted.  Chunks are created one past the newest, so the live ones
        are those of the range that still exist plus those from ``newest + 1``
        upward until a number is missing (one quarantined as ``.bad`` does
        not end the run).  Without a recorded range (a queue of an older
        build, damaged metadata, a crash before the first metadata write) the
        directory is listed, as before; a queue with no metadata and no
        chunk 1 is new and has no chunks.
        """
        span = meta.get("chunks")
        if (not isinstance(span, list) or len(span) != 2
                or not all(isinstance(x, int) and x > 0 for x in span)):
            if os.path.exists(self._meta_path) or os.path.exists(self._chunk_path(1)):
                return self._listed_chunks()
            return []
        oldest, newest = span
        found = [n for n in range(oldest, newest + 1) if os.path.exists(self._chunk_path(n))]
        n = newest + 1
        while True:
            path = self._chunk_path(n)
            if os.path.exists(path):
                found.append(n)
            elif not os.path.exists(path + ".bad"):
                return found
            n += 1

    def _listed_chunks(self) -> list[int]:
        base = os.path.basename(self._prefix)
        rx = re.compile(re.escape(base) + r"(\d{6,})\.dat$")
        found = []
        for entry in os.listdir(self.data_path):
            m = rx.match(entry)
            if m:
                found.append(int(m.group(1)))
        return sorted(found)

    # --------------------------------------------------------------- recovery

    def _recover(self) -> None:
        """Rebuild the queue from its files: metadata for the read side, scans for the rest."""
        meta = read_json(self._meta_path) or {}
        chunks = self._existing_chunks(meta)
        cursor = meta.get("cursor") if meta.get("version") == META_VERSION else None
        if cursor is None:
            cursor, index = make_position(chunks[0] if chunks else 1, HEADER_SIZE), 0
        else:
            cursor, index = int(cursor), int(meta.get("index", 0))
        r_chunk = cursor >> 48
        for n in [c for c in chunks if c < r_chunk]:  # consumed before the crash
            os.unlink(self._chunk_path(n))
        chunks = [c for c in chunks if c >= r_chunk]

        writer: ChunkWriter | None = None
        for i, n in enumerate(chunks):
            last = i == len(chunks) - 1
            path = self._chunk_path(n)
            with open(path, "rb") as f:
                header = ChunkHeader.unpack(f.read(HEADER_SIZE))
            if header is not None and header.sealed and not last:
                self._counts[n] = header.count
                continue
            result = scan(path, self._max + 4 * MAX_BATCH + 4)
            if result.header is None:
                self._quarantine(n, "has a missing or damaged header")
                continue
            if result.dirty_end > result.end:
                self._keep_bad_tail(path, result.end, result.dirty_end, torn=result.torn)
            if last:
                writer = ChunkWriter(path, n, self._max_bytes, create=False,
                                     end=result.end, count=result.count)
                if result.dirty_end > result.end:
                    writer.zero_from(result.end)
            else:
                seal_file(path, n, result.count, result.end)
                self._counts[n] = result.count
        if writer is None:
            n = max([*self._counts, r_chunk - 1, 0]) + 1
            writer = ChunkWriter(self._chunk_path(n), n, self._max_bytes, create=True)
            self._dir_dirty = True
        self._writer: ChunkWriter | None = writer
        self._wchunk = writer.number

        if r_chunk not in self._counts and r_chunk != self._wchunk:  # gone: start further on
            r_chunk = self._next_chunk(r_chunk)
            cursor, index = make_position(r_chunk, HEADER_SIZE), 0
        count = self._counts.get(r_chunk, writer.count if r_chunk == self._wchunk else 0)
        if index > count:
            log.warning("queue %s: metadata says %d messages of chunk %d were read but it holds "
                        "%d; reading that chunk again from the start", self.name, index,
                        r_chunk, count)
            cursor, index = make_position(r_chunk, HEADER_SIZE), 0
        _, r_off, r_skip = split_position(cursor)
        remaining = sum(c for n, c in self._counts.items() if n >= r_chunk) - index
        if self._wchunk >= r_chunk:
            remaining += writer.count
        if remaining <= 0 and r_chunk == self._wchunk:
            # Everything in the write chunk was read: decoding resumes at its end.  The
            # cursor may point inside the last frame read (skip its first r_skip
            # messages), but only a decode from the file applies r_skip; a ring hit
            # (the reader keeping up with new puts) would move past that frame and
            # leave the skip behind, to be applied to whatever frame is decoded
            # from the file next.
            r_off, r_skip = writer.end, 0
        self._rchunk, self._roff, self._rskip, self._rdecoded = r_chunk, r_off, r_skip, index
        self._cchunk, self._cidx, self._cursor = r_chunk, index, cursor
        self._rstate = self._meta_state = (cursor, index)
        # Everything below this position was handed out before the queue was last
        # closed or crashed (as far as the last metadata write knew): `read_before`
        self._read_mark = self._meta_read = int(meta.get("read", 0)) if self.ack_mode else 0
        self._oldest = r_chunk
        if meta.get("chunks") != [self._oldest, self._wchunk]:
            self._put_meta(self._meta_state)  # record the live range (a new queue: at once)
        self._read = self._decoded = 0
        self._written = max(remaining, 0)
        if self.ack_mode:
            self._open_journal(cursor)
        elif os.path.exists(self._acks_path):
            os.unlink(self._acks_path)

    def _next_chunk(self, n: int) -> int:
        """The next existing chunk after `n` (the write chunk at the latest)."""
        n += 1
        while n < self._wchunk and n not in self._counts:
            n += 1
        return n

    def _quarantine(self, n: int, why: str) -> None:
        path = self._chunk_path(n)
        log.warning("queue %s: chunk %s %s; renamed to .bad and skipped", self.name, path, why)
        os.replace(path, path + ".bad")
        self._c["corruptions"] += 1
        self._c["bad_files"] += 1

    def _keep_bad_tail(self, path: str, start: int, end: int, *, torn: bool) -> None:
        if torn:
            log.info("queue %s: cut a torn tail of %d bytes off %s", self.name, end - start, path)
            self._c["torn_tails"] += 1
            return
        log.warning("queue %s: corrupt data at offset %d of %s; %d bytes from there on were "
                    "saved to %s.bad and dropped", self.name, start, path, end - start, path)
        with open(path, "rb") as src:
            src.seek(start)
            write_atomic(path + ".bad", src.read(end - start))
        self._c["corruptions"] += 1
        self._c["bad_files"] += 1

    def _open_journal(self, floor: int) -> None:
        """Load acks at or above the floor, then reopen the journal for appending."""
        skip: set[int] = set()
        if os.path.exists(self._acks_path):
            with open(self._acks_path, "rb") as f:
                raw = f.read()
            good = off = 0
            while off + _ACK_HEAD.size <= len(raw):
                n, crc = _ACK_HEAD.unpack_from(raw, off)
                body = raw[off + _ACK_HEAD.size : off + _ACK_HEAD.size + 8 * n]
                if len(body) != 8 * n:
                    break  # torn tail: the last write was cut short
                if crc32(body) != crc:
                    log.warning("queue %s: ack journal damaged at byte %d; later acks are "
                                "ignored (those messages will be delivered again)",
                                self.name, off)
                    self._c["corruptions"] += 1
                    break
                off = good = off + _ACK_HEAD.size + 8 * n
                for pos in struct.unpack(f"<{n}Q", body):
                    if pos >= floor and (pos >> 48 in self._counts or pos >> 48 == self._wchunk):
                        skip.add(pos)
            if good != len(raw):
                os.truncate(self._acks_path, good)
        self._skip = skip
        self._dir_dirty |= not os.path.exists(self._acks_path)
        self._journal_fd = os.open(self._acks_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._journal_entries = len(skip)

    # ------------------------------------------------------------------ write

    def put(self, data: bytes) -> None:
        """Append one message; it is in the OS (survives kill -9) when this returns."""
        n = len(data)
        if n < self._min or n > self._max:
            raise MessageSizeError(n, self._min, self._max)
        with self._wlock:
            w = self._writer
            if w is None:
                raise QueueClosedError(f"queue {self.name} is closed")
            if self.failed:
                raise DiskFailedError(self._failure())
            off = w.end
            end = off + n + RECORD_OVERHEAD
            if end > w.allocated:
                w = self._make_room(n + RECORD_OVERHEAD)
                off = w.end
                end = off + n + RECORD_OVERHEAD
            # ChunkWriter.append, inlined: one copy of the framed message into the mapping.
            w.map[off:end] = _pack_head(n, _crc32(data, n ^ CRC_SEED)) + data + _pack_tail(n)
            w.end = end
            w.count += 1
            seq = self._written
            if n <= RING_MAX_FRAME:
                self._ring[seq % self._ring_size] = (seq, w.base | off << 16, data, end)
            self._written = seq + 1
            self._bytes_written += n
            self._unsynced += 1
            if self._unsynced >= self._sync_every:
                self._sync_locked()
            elif not self._sync_scheduled:
                self._sync_scheduled = True
                self._syncer.schedule(self, self._sync_timeout)
        if self._waiting:
            self._wake()

    def _make_room(self, framed: int) -> ChunkWriter:
        """Rotate, or grow the file, so `framed` more bytes fit (write lock held)."""
        w = self._writer
        assert w is not None
        if w.count and not w.room_for(framed):
            w = self._rotate()
        w.ensure(w.end + framed)
        return w

    def put_many(self, messages: Iterable[bytes]) -> None:
        """Append a batch: validated all-or-nothing, then copied into the file in one go.

        The batch is stored as one frame (several if it exceeds 1 MiB or
        65,535 messages) with one CRC.
        """
        messages = list(messages)
        if not messages:
            return
        lengths = list(map(len, messages))
        if min(lengths) < self._min or max(lengths) > self._max:
            bad = next(n for n in lengths if n < self._min or n > self._max)
            raise MessageSizeError(bad, self._min, self._max)
        total = sum(lengths)
        if total <= MAX_FRAME_BODY and len(messages) <= MAX_BATCH:
            frames = [(messages, lengths)]
        else:
            frames = _split_frames(messages)
        with self._wlock:
            if self._writer is None:
                raise QueueClosedError(f"queue {self.name} is closed")
            if self.failed:
                raise DiskFailedError(self._failure())
            for group in frames:
                self._put_frame(group)
            self._bytes_written += total
            self._after_write(len(messages))
        if self._waiting:
            self._wake()

    def _put_frame(self, group: tuple[list[bytes], list[int]]) -> None:
        messages, lengths = group
        body = batch_body(messages, lengths)
        w = self._make_room(len(body) + RECORD_OVERHEAD)
        off = w.append_batch(body, len(messages))
        seq = self._written
        if len(body) <= RING_MAX_FRAME:
            self._ring[seq % self._ring_size] = (seq, w.base | off << 16, messages, w.end)
        self._written = seq + len(messages)

    def _after_write(self, count: int) -> None:
        self._unsynced += count
        if self._unsynced >= self._sync_every:
            self._sync_locked()
        elif not self._sync_scheduled:
            self._sync_scheduled = True
            self._syncer.schedule(self, self._sync_timeout)

    def _rotate(self) -> ChunkWriter:
        """Seal the write chunk and start the next one (write lock held)."""
        w = self._writer
        assert w is not None
        # Create the next chunk first: if the disk is full, nothing has changed.
        nxt = ChunkWriter(self._chunk_path(w.number + 1), w.number + 1, self._max_bytes,
                          create=True)
        self._dir_dirty = True
        self._chunk_writes[w.number] = w.count
        w.seal()
        self._counts[w.number] = w.count
        self._writer = nxt
        self._wchunk = nxt.number
        return nxt

    def _wake(self) -> None:
        with self._rcond:
            self._rcond.notify_all()

    # ------------------------------------------------------------------- read

    def read_before(self, position: int) -> bool:
        """Ack mode: whether the record at `position` was handed out before this queue
        was opened (read, not acked, then a crash or a close): a consumer got it, or
        may have, so delivering it again is another attempt.  As far as the last
        metadata write knew: reads after it (at most a sync interval's) say False."""
        return position < self._read_mark

    def depth(self) -> int:
        """Messages put and not yet read (ack mode: not yet read, or un-acked before a restart)."""
        return max(self._written - self._read - len(self._skip), 0)

    def pending(self) -> int:
        """Ack mode: messages read and not yet acked."""
        return self._runs.pending

    def get(self, timeout: float | None = 0.0) -> bytes | None:
        """The oldest unread message, or None if the queue is still empty after `timeout`.

        `timeout=None` waits until a message arrives (or the queue is closed).
        In ack mode the message is acked at once.
        """
        if not self.ack_mode:
            with self._rlock:  # fast path: the next message is already decoded
                ahead = self._ahead
                if ahead and not self._closed:
                    pos, data = ahead.popleft()
                    self._read += 1
                    if pos >> 48 == self._cchunk:
                        self._cidx += 1
                    else:
                        self._cchunk, self._cidx = pos >> 48, 1
                    self._rstate = (pos + 1, self._cidx)
                    if not self._sync_scheduled:
                        self._sync_scheduled = True
                        self._syncer.schedule(self, self._sync_timeout)
                    return data
        rec = self.read(timeout)
        if rec is None:
            return None
        if self.ack_mode:
            self.ack(rec[0])
        return rec[1]

    def read(self, timeout: float | None = 0.0) -> tuple[int, bytes] | None:
        """`(position, payload)` of the oldest unread message, or None after `timeout`."""
        got = self.read_many(1, timeout)
        return got[0] if got else None

    def get_many(self, limit: int, timeout: float | None = 0.0) -> list[bytes]:
        """Up to `limit` messages (at least one unless `timeout` passes first)."""
        recs = self.read_many(limit, timeout)
        if self.ack_mode and recs:
            self.ack_many([p for p, _ in recs])
        return [m for _, m in recs]

    def read_many(self, limit: int, timeout: float | None = 0.0) -> list[tuple[int, bytes]]:
        """Up to `limit` `(position, payload)` pairs in queue order; waits like `get`."""
        with self._rlock:
            out = self._take(limit)
        if out or timeout == 0:
            return out
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # Wait without the read lock, so close() and syncs are never held up.
            with self._rcond:
                self._waiting = True
                try:
                    if self._read >= self._written and not self._closed:
                        left = None if deadline is None else deadline - time.monotonic()
                        if left is not None and left <= 0:
                            return out
                        self._rcond.wait(left)
                finally:
                    self._waiting = False
            with self._rlock:
                out = self._take(limit)
            if out or (deadline is not None and time.monotonic() >= deadline):
                return out

    def _take(self, limit: int) -> list[tuple[int, bytes]]:
        """Consume up to `limit` decoded messages (read lock held)."""
        if self._closed:
            raise QueueClosedError(f"queue {self.name} is closed")
        out: list[tuple[int, bytes]] = []
        ahead = self._ahead
        skip = self._skip
        ack_mode = self.ack_mode
        pos = -1
        while len(out) < limit:
            if not ahead:
                if self._decoded >= self._written or not self._decode():
                    break
                continue
            if not skip and len(ahead) > 1 and limit - len(out) > 1:
                pos = self._take_run(out, limit - len(out))
                if pos >= 0:
                    continue
            pos, data = ahead.popleft()
            self._read += 1
            if pos >> 48 == self._cchunk:
                self._cidx += 1
            else:
                self._cchunk, self._cidx = pos >> 48, 1
            if skip and pos in skip:  # (acked in an earlier life: ack mode only)
                skip.discard(pos)
                if self._runs:  # above the floor: an ack a compacted journal must keep
                    self._runs.add([pos], self._cidx - 1, pending=False)
                continue
            if ack_mode:
                self._runs.add([pos], self._cidx - 1)
            out.append((pos, data))
        if pos >= 0:
            self._rstate = (pos + 1, self._cidx)
            if not self._sync_scheduled:
                self._sync_scheduled = True
                self._syncer.schedule(self, self._sync_timeout)
        return out

    def _take_run(self, out: list[tuple[int, bytes]], n: int) -> int:
        """`_take` for a run of read-ahead records in one chunk, with no skips to check:
        the bookkeeping of the run in a few C-level calls.  Returns the run's last
        position, or -1 (nothing taken) when the run would cross into another chunk."""
        ahead = self._ahead
        n = min(n, len(ahead))
        first, last = ahead[0][0], ahead[n - 1][0]
        chunk = first >> 48
        if last >> 48 != chunk:
            return -1
        run = [ahead.popleft() for _ in range(n)]
        base = self._cidx if chunk == self._cchunk else 0
        self._cchunk, self._cidx = chunk, base + n
        self._read += n
        if self.ack_mode:
            self._runs.add([p for p, _ in run], base)
        out += run
        return last

    def _decode(self) -> bool:
        """Decode the next frames into the read-ahead buffer; False if nothing came."""
        seq = self._decoded
        entry = self._ring[seq % self._ring_size]
        if entry is not None and entry[0] == seq:
            _, pos, msgs, nxt = entry
            if pos >> 48 != self._rchunk:
                self._enter_chunk(pos >> 48)
            if type(msgs) is bytes:
                self._ahead.append((pos, msgs))
                n = 1
            else:
                self._ahead.extend(zip(range(pos, pos + len(msgs)), msgs, strict=True))
                n = len(msgs)
            self._roff = nxt
            self._decoded = seq + n
            self._rdecoded += n
            self._c["ring_hits"] += 1
            self._cache.touch(self._rchunk)
            self._c["bytes_read"] += nxt - (pos >> 16 & 0xFFFFFFFF) - RECORD_OVERHEAD
            return True
        # Read `_written` before looking for the seal: the writer seals a chunk before it
        # counts any message of the next one, so everything below `written` is in this
        # chunk if it was still unsealed after that.
        written = self._written
        sealed = self._counts.get(self._rchunk)
        if sealed is not None and self._rdecoded >= sealed:
            self._enter_chunk(self._next_chunk(self._rchunk))
            return True
        view = self._view_for_read(sealed)
        budget = min(written - seq, READ_AHEAD)
        if sealed is not None:
            budget = min(budget, sealed - self._rdecoded)
        start = off = self._roff
        got = 0
        ahead = self._ahead
        append = ahead.append
        cbase = self._rchunk << 48
        unpack_head, unpack_tail, crc32 = RECORD_HEAD.unpack_from, RECORD_TAIL.unpack_from, _crc32
        try:
            buf, base = view.window(off, RECORD_OVERHEAD)
            blen = len(buf)
            while got < budget:
                rel = off - base
                if rel + RECORD_OVERHEAD > blen:
                    buf, base = view.window(off, RECORD_OVERHEAD)
                    blen, rel = len(buf), off - base
                    if rel + RECORD_OVERHEAD > blen:
                        raise CorruptRecordError(off, "truncated frame header")
                field, crc = unpack_head(buf, rel)
                end = rel + 8 + (field & LENGTH_MASK)
                if end + 4 > blen:
                    buf, base = view.window(off, (field & LENGTH_MASK) + RECORD_OVERHEAD)
                    blen, rel = len(buf), off - base
                    end = rel + 8 + (field & LENGTH_MASK)
                    if end + 4 > blen:
                        raise CorruptRecordError(off, "frame length runs past the data")
                body = buf[rel + 8 : end]
                if crc32(body, field ^ CRC_SEED) != crc or unpack_tail(buf, end)[0] != field:
                    raise CorruptRecordError(off, "crc or trailing length mismatch")
                pos = cbase | off << 16
                if field & BATCH_FLAG:
                    msgs = split_batch(body)
                    if self._rskip:
                        msgs, pos = msgs[self._rskip :], pos + self._rskip
                        self._rskip = 0
                    ahead.extend(zip(range(pos, pos + len(msgs)), msgs, strict=True))
                    got += len(msgs)
                elif self._rskip:  # resuming just after this message
                    self._rskip = 0
                else:
                    append((pos, body))
                    got += 1
                off = base + end + 4
        except CorruptRecordError as e:
            self._decoded += got
            self._rdecoded += got
            self._roff = off
            self._corrupt_chunk(e)
            return True
        self._cache.touch(self._rchunk)
        self._c["bytes_read"] += off - start
        self._roff = off
        self._decoded += got
        self._rdecoded += got
        return got > 0

    def _view_for_read(self, sealed: int | None) -> MapView | FileView:
        view = self._view
        if view is None:
            view = self._cache.view(self._rchunk, self._chunk_path(self._rchunk))
            self._view = view
            self._view_live = sealed is None
        elif self._view_live and sealed is not None:
            view.refresh()  # the chunk was sealed and trimmed under our mapping
            self._view_live = False
        return view

    def _enter_chunk(self, chunk: int) -> None:
        """Move decoding to the start of `chunk` (read lock held)."""
        self._chunk_reads[self._rchunk] = self._rdecoded
        if self._view is not None and not self._view.cached:
            self._view.close()
        self._view = None
        self._rchunk, self._roff, self._rdecoded, self._rskip = chunk, HEADER_SIZE, 0, 0
        # Decoding only moves on when everything decoded was consumed, so in
        # plain mode the chunks before this one are done with.
        if not self.ack_mode or not self._runs:
            self._delete_chunks_before(chunk)

    def _delete_chunks_before(self, chunk: int) -> None:
        deleted = False
        while self._oldest < chunk and self._oldest < self._wchunk:
            n = self._oldest
            self._cache.forget(n)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._chunk_path(n))
            self._counts.pop(n, None)
            self._summaries.pop(n, None)
            self._oldest = n + 1
            deleted = True
        if deleted:
            # The live range moved: record it, with the read position last persisted
            # (what a reopen must find; see _existing_chunks).
            with self._metalock:
                self._put_meta(self._meta_state)

    def _corrupt_chunk(self, err: CorruptRecordError) -> None:
        """A frame failed its checks: keep the chunk as .bad and go on with the next one."""
        n = self._rchunk
        if n == self._wchunk:
            with self._wlock:
                if n == self._wchunk and self._writer is not None:
                    self._rotate()
        lost = max(self._counts.get(n, 0) - self._rdecoded, 0)
        log.error("queue %s: %s in chunk %s; skipping its remaining %d messages (kept in %s.bad)",
                  self.name, err, self._chunk_path(n), lost, self._chunk_path(n))
        self._c["corruptions"] += 1
        self._c["bad_files"] += 1
        self._c["lost_to_corruption"] += lost
        self._cache.forget(n)
        self._summaries.pop(n, None)
        if self._view is not None:
            self._view.close()
            self._view = None
        path = self._chunk_path(n)
        with contextlib.suppress(FileNotFoundError):
            shutil.copyfile(path, path + ".bad")
        self._skip = {p for p in self._skip if p >> 48 != n}
        self._read += lost
        self._decoded += lost
        self._rdecoded += lost

    # ------------------------------------------------------------------- find

    def find(self, key: bytes, key_of: Callable[[bytes], bytes]) -> tuple[bytes, bool] | None:
        """A message still in the queue whose ``key_of(payload) == key``: ``(payload,
        read)``, `read` saying it was handed out and not acked (ack mode); None if none.
        `key_of` gives a part of the payload (only the messages whose bytes hold `key`
        are looked at).

        The chunks from the floor to the write chunk are looked through by
        *summaries*: an entry per run of frames spanning at least `FIND_SPAN`
        bytes, with the least and the greatest key of its messages.  A chunk's
        entries are made the first time a lookup passes over its frames (one
        read of what the queue holds, then of what was written since) and kept
        until the chunk goes, so nothing is added to a put.  A lookup decodes
        only the entries whose range holds `key`: keys need not be in order
        (a channel's are, but for messages written back at a stop), though the
        fewer entries a key's range straddles, the less is read.
        """
        with self._rlock:
            if self._closed:
                raise QueueClosedError(f"queue {self.name} is closed")
            floor = self._floor()[0]
            with self._wlock:
                assert self._writer is not None
                wchunk, wend = self._wchunk, self._writer.end
            for n in range(floor >> 48, wchunk + 1):
                if n != wchunk and n not in self._counts:
                    continue
                summary = self._summary(n, wend if n == wchunk else None, key_of)
                for start, end in summary.spans(key):
                    if make_position(n, end) > floor:
                        found = self._find_in(n, (start, end), key, key_of, floor)
                        if found is not None:
                            return found
        return None

    def unsummarised(self) -> int:
        """About how many bytes the next `find` reads to bring its summaries up to date
        (what was written since the last lookup, or all of it before the first)."""
        with self._rlock:
            if self._closed:
                return 0
            with self._wlock:
                assert self._writer is not None
                wchunk, wend = self._wchunk, self._writer.end
            total = 0
            for n in range(self._floor()[0] >> 48, wchunk + 1):
                summary = self._summaries.get(n)
                if summary is not None and summary.sealed:
                    continue
                done = HEADER_SIZE if summary is None else summary.done
                if n == wchunk:
                    total += max(0, wend - done)
                elif n in self._counts:
                    with contextlib.suppress(OSError):
                        total += max(0, os.path.getsize(self._chunk_path(n)) - done)
            return total

    def _frames(self, n: int, start: int,
                end: int | None) -> Iterable[tuple[int, int, int, bytes]]:
        """`(offset, next offset, length field, body)` of chunk `n`'s frames from `start`,
        before `end` (None: to its last valid frame)."""
        path = self._chunk_path(n)
        if not os.path.exists(path):  # (deleted: acked meanwhile)
            return
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            limit = size if end is None else min(end, size)
            if limit <= start:
                return
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                offset = start
                while offset < limit:
                    try:
                        field, body, nxt = read_record(data, offset, limit)
                    except CorruptRecordError:
                        return
                    yield offset, nxt, field, body
                    offset = nxt

    def _summary(self, n: int, end: int | None, key_of: Callable[[bytes], bytes]) -> _Summary:
        """Chunk `n`'s summary (see `find`), made up to `end` (None: the chunk is sealed,
        to its end) if not yet."""
        summary = self._summaries.get(n)
        if summary is None:
            summary = self._summaries[n] = _Summary()
        if summary.sealed or (end is not None and summary.done >= end):
            return summary
        start = summary.done
        least = greatest = b""
        count = 0
        for _offset, nxt, field, body in self._frames(n, start, end):
            keys = list(map(key_of, split_batch(body) if field & BATCH_FLAG else [body]))
            low, high = min(keys), max(keys)
            if not count or low < least:
                least = low
            if not count or high > greatest:
                greatest = high
            count += 1
            summary.done = nxt
            if nxt - start >= FIND_SPAN:
                summary.add(start, nxt, least, greatest)
                start, count = nxt, 0
        if count:
            summary.add(start, summary.done, least, greatest)
        summary.sealed = end is None
        return summary

    def _find_in(self, n: int, span: tuple[int, int], key: bytes,
                 key_of: Callable[[bytes], bytes], floor: int) -> tuple[bytes, bool] | None:
        start, end = span
        skip, runs = self._skip, self._runs
        # read since the floor: up to the read position (a position up to there that is
        # not pending was acked, in this life or an earlier one)
        hi = self._rstate[0] - 1
        for offset, _next, field, body in self._frames(n, start, end):
            for i, payload in messages_holding(field, body, key):
                if key_of(payload) == key:
                    position = make_position(n, offset, i)
                    if position < floor or position in skip:
                        continue
                    if runs.is_pending(position):
                        return payload, True
                    if position > hi:
                        return payload, False
        return None

    # -------------------------------------------------------------------- ack

    def ack(self, position: int) -> bool:
        """Finish a record handed out by `read()`. False if it is not pending."""
        return self.ack_many((position,)) == 1

    def ack_many(self, positions: Iterable[int]) -> int:
        """Finish several records with one journal write; returns how many were pending."""
        if not self.ack_mode:
            raise StorageError(f"queue {self.name} is not in ack mode")
        with self._rlock:
            if self._closed:
                raise QueueClosedError(f"queue {self.name} is closed")
            done = self._runs.ack(positions if type(positions) is list else list(positions))
            if not done:
                return 0
            self._c["acks"] += len(done)
            try:
                if self._journal_torn:  # an earlier append failed part way: rewrite it all
                    self._compact_journal()
                    self._journal_torn = False
                self._journal_entries += len(done)
                os.write(self._journal_fd, _ack_record(done))
                floor = self._runs.floor()
                floor_chunk = floor[0] >> 48 if floor is not None else self._rchunk
                if floor_chunk > self._oldest:
                    self._delete_chunks_before(floor_chunk)
                if self._journal_entries > max(JOURNAL_COMPACT_MIN,
                                               4 * (self._acked_early() + len(self._skip))):
                    self._compact_journal()
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                # A full disk: the acks hold in memory (a consumer's FIN is not
                # refused); only a crash before space returns delivers them again.
                if not self._journal_torn:
                    log.warning("queue %s: no space to record acks (%s); they hold in "
                                "memory until space returns", self.name, e.strerror)
                self._journal_torn = True
                self._c["acks_not_journaled"] += len(done)
            return len(done)

    def _floor(self) -> tuple[int, int]:
        """(position, index in chunk) from which a reopened queue must read again."""
        state = self._rstate  # read before peeking at the pending list: see ack_many
        floor = self._runs.floor() if self.ack_mode else None
        return state if floor is None else floor

    def _acked_early(self) -> int:
        """How many positions above the floor were acked (those the journal must keep)."""
        return self._runs.total - self._runs.pending

    def _write_meta(self, *, force: bool = False, lazy: bool = True) -> None:
        """Persist the read position (ack mode: the floor, and how far reads went) if it
        moved (meta lock held).

        In ack mode a sync writes it at most once per `sync_timeout`: the ack journal,
        fsynced at every sync, already holds every ack past the floor last written, and
        a reopen skips them, so an older floor costs a reopen a longer scan, never a
        duplicate.  (An atomic rewrite is two fsyncs: at ``sync_every=1`` with a consumer
        acking, most of each sync's cost.)  The timed sync (`lazy=False`) writes it
        whenever it moved, so it is never more than about two `sync_timeout` behind;
        compacting the journal and closing force it."""
        state = self._floor()
        if state == self._meta_state and not force and (
                not self.ack_mode or self._read_reach() == self._meta_read):
            return
        now = self._clock()
        if lazy and self.ack_mode and not force and now - self._meta_time < self._sync_timeout:
            return
        self._put_meta(state)
        self._meta_state = state
        self._meta_time = now

    def _read_reach(self) -> int:
        """How far reads went, for the metadata: this life's, or an earlier life's mark
        until this one passes it (a second crash soon after a first still knows)."""
        return max(self._rstate[0], self._read_mark)

    def _put_meta(self, state: tuple[int, int], closed: dict[str, int] | None = None) -> None:
        """Write the metadata: ``state`` as the read position, and the live chunk range.

        `closed` (written by `close` only, dropped by every other write) lets
        `closed_depth` answer without opening the queue.
        """
        cursor, index = state
        meta: dict[str, Any] = {"version": META_VERSION, "cursor": cursor, "index": index,
                                "chunks": [self._oldest, self._wchunk]}
        if self.ack_mode:  # how far reads went: what was handed out before (`read_before`)
            meta["read"] = self._meta_read = self._read_reach()
        if closed is not None:
            meta["closed"] = closed
        write_json(self._meta_path, meta)

    def _compact_journal(self) -> None:
        """Rewrite the ack journal with only the acks above the floor (read lock held)."""
        with self._metalock:
            self._write_meta(force=True)
            floor = self._floor()[0]
            keep = [*self._runs.acked_early(), *(p for p in self._skip if p >= floor)]
            write_atomic(self._acks_path, _ack_record(keep) if keep else b"")
            os.close(self._journal_fd)
            self._journal_fd = os.open(self._acks_path, os.O_WRONLY | os.O_APPEND)
            self._journal_entries = len(keep)

    # ------------------------------------------------------------ maintenance

    def sync(self) -> None:
        """Make everything put so far, the read position and the acks durable (fsync)."""
        with self._wlock:
            if self._writer is None:
                raise QueueClosedError(f"queue {self.name} is closed")
            self._sync_locked()

    def _sync_locked(self, *, force_meta: bool = False, lazy_meta: bool = True) -> None:
        assert self._writer is not None
        if self.failed:
            raise DiskFailedError(self._failure())
        try:
            self._writer.flush()
        except OSError as e:
            raise self._fail("fdatasync of the write chunk", e) from e
        with self._metalock:
            self._write_meta(force=force_meta, lazy=lazy_meta)
            try:
                if self._journal_fd >= 0:
                    os.fsync(self._journal_fd)
                if self._dir_dirty:
                    fsync_dir(self.data_path)
                    self._dir_dirty = False
            except OSError as e:
                raise self._fail("fsync of the ack journal or the directory", e) from e
        self._unsynced = 0
        self._c["syncs"] += 1

    def _fail(self, what: str, error: OSError) -> DiskFailedError:
        """An fsync failed: take no more writes, ever, in this life (see DiskFailedError)."""
        self.failed = f"{what} failed: {error}"
        log.error("queue %s: %s; it takes no more writes (nothing written since its last "
                  "good sync is acknowledged) until it is opened again", self.name, self.failed)
        return DiskFailedError(self._failure())

    def _failure(self) -> str:
        return f"queue {self.name}: {self.failed}"

    def _timed_sync(self) -> None:
        """Called by the background syncer `sync_timeout` after the first unsynced change."""
        self._sync_scheduled = False
        with self._rlock:
            if not self._closed:
                self._cache.maintain()  # idle chunks go even when nobody reads
        with self._wlock:
            if self._writer is not None and not self.failed:
                self._sync_locked(lazy_meta=False)

    def empty(self) -> None:
        """Discard every message (and, in ack mode, every pending one): go-diskqueue Empty."""
        with self._rlock, self._wlock:
            w = self._writer
            if w is None:
                raise QueueClosedError(f"queue {self.name} is closed")
            nxt = w.number + 1
            w.close()
            self._drop_files(keep_bad=True)
            self._counts.clear()
            self._summaries.clear()
            self._cache.close()
            self._view = None
            self._ring = [None] * self._ring_size
            self._runs.clear()
            self._skip.clear()
            self._writer = ChunkWriter(self._chunk_path(nxt), nxt, self._max_bytes, create=True)
            self._dir_dirty = True
            self._wchunk = self._oldest = self._rchunk = self._cchunk = nxt
            self._roff, self._rskip, self._rdecoded, self._cidx = HEADER_SIZE, 0, 0, 0
            self._cursor = make_position(nxt, HEADER_SIZE)
            self._rstate = (self._cursor, 0)
            self._ahead.clear()
            self._read = self._decoded = self._written = 0
            if self.ack_mode:
                self._journal_fd = os.open(self._acks_path,
                                           os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                self._journal_entries = 0
            self._sync_locked(force_meta=True)

    def _drop_files(self, *, keep_bad: bool) -> None:
        if self._journal_fd >= 0:
            os.close(self._journal_fd)
            self._journal_fd = -1
        base = os.path.basename(self._prefix)
        meta = os.path.basename(self._meta_path)
        # The metadata goes last: a crash half way leaves it naming what is left.
        for entry in sorted(os.listdir(self.data_path), key=lambda e: e == meta):
            if entry.startswith(base) and not (keep_bad and entry.endswith(".bad")):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.data_path, entry))
        fsync_dir(self.data_path)

    def close(self, *, sync: bool = True) -> None:
        """Sync and release everything; further use raises `QueueClosedError`.

        The metadata then records the depth a reopen will find, with the size
        of the last chunk and of the ack journal, for `closed_depth`.

        ``sync=False`` only lets go of the files and memory: no fsync and no
        close record, so what was written stays as durable as it was (in the
        OS, as after any `put`) and a reopen recovers by scanning, as after a
        crash.  For a queue opened only to learn its depth, such as each of
        30,000 queues recovered at a boot after ``kill -9``: their four
        fsyncs each, queued in the file system's journal, took 29 s.
        """
        with self._rlock, self._wlock:
            w = self._writer
            if w is None:
                return
            if sync and not self.failed:  # (a failed queue records no clean close)
                depth = self.depth() + self.pending()  # un-acked messages are read again
                w.close(truncate=True)  # the data and the file's size on disk (fsync)
                acks = 0
                if self._journal_fd >= 0:
                    os.fsync(self._journal_fd)
                    acks = os.fstat(self._journal_fd).st_size
                with self._metalock:
                    state = self._floor()
                    self._put_meta(state, {"depth": depth, "chunk": w.number, "end": w.end,
                                           "acks": acks})
                    self._meta_state = state
                self._unsynced = 0
                self._c["syncs"] += 1
            else:
                w.close()
            self._release_locked()
        self._wake()

    def _release_locked(self) -> None:
        self._writer = None
        self._closed = True
        if self._view is not None and not self._view.cached:
            self._view.close()
        self._view = None
        self._cache.close()
        if self._journal_fd >= 0:
            os.close(self._journal_fd)
            self._journal_fd = -1

    @staticmethod
    def closed_depth(name: str, data_path: str | os.PathLike[str]) -> int | None:
        """The depth a reopen of queue `name` would find, without opening it.

        Known when the queue was last closed by `close` and its files have
        not changed since: the last chunk and the ack journal have the sizes
        `close` recorded and no later chunk exists (a put grows the last
        chunk or starts a new one, an ack grows the journal, and any metadata
        write drops the record); 0 when the queue has no files at all (never
        created: an open would create it).  None otherwise -- never closed
        cleanly (``kill -9``, power loss), or in use since: open the queue to
        know.  A broker restarting with 10,000 idle topics answers their
        owners this way instead of opening (or creating) 30,000 queues.
        """
        prefix = os.path.join(os.fspath(data_path), f"{name}.diskqueue.")
        try:
            try:
                with open(prefix + "meta.dat", "rb") as f:
                    closed = json.loads(f.read()).get("closed")
            except FileNotFoundError:
                # No files at all (the test `_existing_chunks` makes): a queue never
                # created, such as a topic's while its channels take every message.
                return None if os.path.exists(f"{prefix}{1:06d}.dat") else 0
            depth, chunk, end, acks = (closed["depth"], closed["chunk"], closed["end"],
                                       closed["acks"])
            if not all(type(x) is int and x >= 0 for x in (depth, chunk, end, acks)):
                return None
            if os.stat(f"{prefix}{chunk:06d}.dat").st_size != end:
                return None
            if os.path.exists(f"{prefix}{chunk + 1:06d}.dat"):
                return None
            try:
                journal = os.stat(prefix + "acks.dat").st_size
            except FileNotFoundError:
                journal = 0
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None
        return depth if journal == acks else None

    def delete(self) -> None:
        """Close and remove every file of the queue."""
        self.close()
        with self._rlock, self._wlock:
            self._drop_files(keep_bad=False)

    def __enter__(self) -> DiskQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        """Counters for operators and tests (see docs/STORAGE.md); byte counts are since open."""
        w = self._writer
        chunks: dict[int, dict[str, Any]] = {}
        cached = set(self._cache.cached_chunks())
        live = dict(self._counts)
        if w is not None:
            live[w.number] = w.count
        for n in sorted(live):
            if n < self._oldest:
                continue
            reads = self._rdecoded if n == self._rchunk else self._chunk_reads.get(n, 0)
            writes = live[n] if w is not None and n == w.number else self._chunk_writes.get(n, 0)
            chunks[n] = {"messages": live[n], "reads": reads, "writes": writes,
                         "cached": n in cached}
        cs = self._cache.stats
        return {
            "name": self.name,
            "depth": self.depth(),
            "pending": self._runs.pending,
            "ack_mode": self.ack_mode,
            "read_chunk": self._rchunk,
            "write_chunk": self._wchunk,
            "chunks": chunks,
            "cache": {"hits": cs.hits, "misses": cs.misses, "admitted": cs.admitted,
                      "rejected": cs.rejected, "evicted": cs.evicted,
                      "cached_chunks": sorted(cached), "cached_bytes": self._cache.cached_bytes()},
            "bytes_written": self._bytes_written,
            **self._c,
        }

