"""Chunk files: the on-disk format of every durable queue.

Theory of operation
-------------------
A queue is a sequence of numbered chunk files.  Each file starts with a
32-byte header and is followed by frames (format in docs/STORAGE.md)::

    header = magic "ZNQC" | version u16 | flags u16 | chunk number u64
             | creation time ns u64 | message count u32 | header crc32 u32
    frame  = length u32 | crc32 u32 | body | length u32

A frame holds one message (`put`), or -- when the top bit of the length is
set -- a batch written by one `put_many`::

    batch body = count u32 | count x length u32 | payloads, back to back

The frame CRC is CRC-32C (Castagnoli, hardware-accelerated by the `crc32c`
package: 2-8x faster than zlib's CRC-32 here) of the body, seeded with
`length ^ CRC_SEED`, so it covers the length too and a run of zero bytes
(unwritten space) never checks out as a frame.
One CRC per batch costs a fifth of one per message, which is what lets a
batch of small messages be framed at over a million messages per second in
Python.  The trailing length lets a reader check a frame's end.

A message's *position* is `(chunk, frame offset, index in frame)` packed in
one int (`make_position`); positions grow in queue order.

Writing goes through a shared, writable `mmap` of the file: copying a frame
into the mapping puts it in the OS page cache, so it survives `kill -9` of the
process without a syscall per message.  The file is grown with
`posix_fallocate` *before* the mapping is extended, so a full disk is an
ordinary `DiskFullError` instead of a SIGBUS on first touch of a hole.

A chunk is *sealed* when the writer moves on: its message count is written
into the header (with the header CRC), and the file is truncated to the end
of its data.  Sealed chunks are immutable.  The last chunk of a queue is
never trusted: `scan` walks it frame by frame to the last valid one.
"""

from __future__ import annotations

import bisect
import errno
import itertools
import mmap
import os
import struct
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from storage.crc import crc32c as crc32
from storage.errors import DiskFullError, StorageError

MAGIC = b"ZNQC"
VERSION = 1
FLAG_SEALED = 1
CRC_SEED = 0x5A17C0DE

HEADER = struct.Struct("<4sHHQQII")
HEADER_SIZE = HEADER.size  # 32
RECORD_HEAD = struct.Struct("<II")  # length (| BATCH_FLAG), crc
RECORD_TAIL = struct.Struct("<I")  # length again
RECORD_OVERHEAD = RECORD_HEAD.size + RECORD_TAIL.size  # 12
BATCH_FLAG = 1 << 31
LENGTH_MASK = BATCH_FLAG - 1
_U32 = struct.Struct("<I")
#: Most messages in one batch frame (the index must fit in a position's 16 bits).
MAX_BATCH = (1 << 16) - 1

#: Initial allocation of a new chunk file; it doubles as frames arrive, up
#: to the configured chunk size.  Keeps thousands of idle queues cheap on disk.
INITIAL_ALLOCATION = 64 * 1024
#: Batch frames at least this large are written with pwritev instead of the mmap.
PWRITE_THRESHOLD = 32 * 1024


def make_position(chunk_no: int, frame_offset: int, index: int = 0) -> int:
    """Pack (chunk, frame offset < 4 GiB, index in frame < 65536) into one ordered int."""
    return (chunk_no << 48) | (frame_offset << 16) | index


def split_position(position: int) -> tuple[int, int, int]:
    """Inverse of `make_position`: `(chunk_no, frame_offset, index)`."""
    return position >> 48, (position >> 16) & 0xFFFFFFFF, position & 0xFFFF


def record_crc(body: bytes | memoryview, length_field: int) -> int:
    return crc32(body, length_field ^ CRC_SEED)


def frame(payload: bytes) -> bytes:
    """One message, framed, as it is stored."""
    n = len(payload)
    return RECORD_HEAD.pack(n, record_crc(payload, n)) + payload + RECORD_TAIL.pack(n)


def batch_body(messages: Sequence[bytes], lengths: Sequence[int] | None = None) -> bytes:
    """The body of a batch frame: count, lengths, payloads."""
    k = len(messages)
    if lengths is None:
        lengths = [len(m) for m in messages]
    return b"".join([struct.pack(f"<I{k}I", k, *lengths), *messages])


def batch_frame(messages: Sequence[bytes]) -> bytes:
    """Several messages in one frame, as `put_many` stores them."""
    body = batch_body(messages)
    field = len(body) | BATCH_FLAG
    return RECORD_HEAD.pack(field, record_crc(body, field)) + body + RECORD_TAIL.pack(field)


def split_batch(body: bytes) -> list[bytes]:
    """The messages of a batch body; `CorruptRecordError` if its lengths do not add up."""
    if len(body) < 4:
        raise CorruptRecordError(0, "batch body too short")
    k = _U32.unpack_from(body, 0)[0]
    pos = 4 + 4 * k
    if pos > len(body):
        raise CorruptRecordError(0, f"batch of {k} messages cannot fit its body")
    lengths = struct.unpack_from(f"<{k}I", body, 4)
    if pos + sum(lengths) != len(body):
        raise CorruptRecordError(0, "batch lengths do not add up to its body")
    out = []
    for n in lengths:
        out.append(body[pos : pos + n])
        pos += n
    return out


def messages_holding(field: int, body: bytes, needle: bytes) -> Iterator[tuple[int, bytes]]:
    """`(index, message)` of each message of a frame whose bytes hold `needle` (not
    empty), found by a search of the frame's bytes (in C): the frame is not split into
    its messages."""
    at = body.find(needle)
    if at < 0:
        return
    if not field & BATCH_FLAG:
        yield 0, body
        return
    k = _U32.unpack_from(body, 0)[0]
    starts = list(itertools.accumulate(struct.unpack_from(f"<{k}I", body, 4),
                                       initial=4 + 4 * k))
    while at >= 0:
        i = bisect.bisect_right(starts, at) - 1
        if i < 0:  # (in the lengths' table)
            at = body.find(needle, starts[0])
            continue
        if at + len(needle) > starts[i + 1]:  # (across two messages: in neither)
            at = body.find(needle, at + 1)
            continue
        yield i, body[starts[i]:starts[i + 1]]
        at = body.find(needle, starts[i + 1])


def frame_count(field: int, body: bytes) -> int:
    """How many messages a frame holds."""
    return _U32.unpack_from(body, 0)[0] if field & BATCH_FLAG else 1


class CorruptRecordError(StorageError):
    """A record failed its length or CRC check."""

    def __init__(self, offset: int, reason: str) -> None:
        self.offset = offset
        super().__init__(f"corrupt record at offset {offset}: {reason}")


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """The fixed header at the start of every chunk file."""

    number: int
    created_ns: int
    sealed: bool
    count: int  # records in the chunk; meaningful only when sealed

    def pack(self) -> bytes:
        flags = FLAG_SEALED if self.sealed else 0
        body = HEADER.pack(MAGIC, VERSION, flags, self.number, self.created_ns, self.count, 0)
        crc = crc32(body[: HEADER_SIZE - 4])
        return body[: HEADER_SIZE - 4] + struct.pack("<I", crc)

    @classmethod
    def unpack(cls, raw: bytes | mmap.mmap) -> ChunkHeader | None:
        """Parse a header; None if it is missing, foreign or damaged."""
        if len(raw) < HEADER_SIZE:
            return None
        magic, version, flags, number, created, count, crc = HEADER.unpack_from(raw, 0)
        if magic != MAGIC or version != VERSION:
            return None
        if crc32(bytes(raw[: HEADER_SIZE - 4])) != crc:
            return None
        return cls(number, created, bool(flags & FLAG_SEALED), count)


def read_record(buf: bytes | mmap.mmap, offset: int, limit: int) -> tuple[int, bytes, int]:
    """Decode the frame at `offset` of `buf`, which holds valid bytes up to `limit`.

    Returns `(length field, body, next_offset)`; the field's top bit says
    whether the body is a batch.  Raises `CorruptRecordError`.
    """
    if offset + RECORD_OVERHEAD > limit:
        raise CorruptRecordError(offset, "truncated frame header")
    field, crc = RECORD_HEAD.unpack_from(buf, offset)
    start = offset + 8
    end = start + (field & LENGTH_MASK)
    if end + 4 > limit:
        raise CorruptRecordError(offset, f"length {field & LENGTH_MASK} runs past the data")
    body = buf[start:end]
    if crc32(body, field ^ CRC_SEED) != crc:
        raise CorruptRecordError(offset, "crc mismatch")
    if RECORD_TAIL.unpack_from(buf, end)[0] != field:
        raise CorruptRecordError(offset, "trailing length mismatch")
    if field & BATCH_FLAG and (len(body) < 4 or 4 + 4 * _U32.unpack_from(body, 0)[0] > len(body)):
        raise CorruptRecordError(offset, "malformed batch body")
    return field, body, end + 4


def _data_end(data: bytes | mmap.mmap, start: int) -> int:
    """Offset just past the last non-zero byte at or after `start` (`start` if none)."""
    block = 1 << 20
    hi = len(data)
    while hi > start:
        lo = max(start, hi - block)
        kept = data[lo:hi].rstrip(b"\x00")
        if kept:
            return lo + len(kept)
        hi = lo
    return start


@dataclass(frozen=True, slots=True)
class ScanResult:
    """What a full walk of a chunk file found."""

    header: ChunkHeader | None
    count: int  # valid records from the start
    end: int  # offset just past the last valid record
    file_size: int
    dirty_end: int  # offset just past the last non-zero byte (== end when clean)
    torn: bool  # the bytes after `end` look like one interrupted write, not corruption

    @property
    def clean(self) -> bool:
        return self.header is not None and self.dirty_end == self.end


def scan(path: str, max_record: int) -> ScanResult:
    """Walk a chunk file to its last valid record (EQueue-style recovery).

    Bytes after the last valid frame are either a *torn tail* (an append cut
    short by a crash: a frame header whose declared length covers every
    non-zero byte that follows) or *corruption* (anything else, e.g. a flipped
    byte in the middle: valid frames may follow it).
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return ScanResult(None, 0, 0, 0, 0, torn=False)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            header = ChunkHeader.unpack(data)
            if header is None:
                return ScanResult(None, 0, 0, size, _data_end(data, 0), torn=False)
            offset = HEADER_SIZE
            count = 0
            while True:
                try:
                    field, body, offset = read_record(data, offset, size)
                except CorruptRecordError:
                    break
                count += frame_count(field, body)
            dirty_end = _data_end(data, offset)
            torn = False
            if dirty_end > offset:
                declared = (RECORD_HEAD.unpack_from(data, offset)[0] & LENGTH_MASK
                            if offset + 8 <= size else 0)
                # An interrupted append leaves one frame whose header promises more
                # bytes than arrived; anything else after the last good frame is damage.
                torn = (dirty_end - offset <= RECORD_HEAD.size
                        or (declared <= max_record
                            and offset + declared + RECORD_OVERHEAD >= dirty_end))
            return ScanResult(header, count, offset, size, dirty_end, torn)


def iter_messages(path: str) -> Iterator[tuple[int, bytes]]:
    """Yield `(offset, payload)` of every valid message of a chunk file (tools and tests)."""
    with open(path, "rb") as f:
        data = f.read()
    offset = HEADER_SIZE
    while True:
        try:
            field, body, nxt = read_record(data, offset, len(data))
        except CorruptRecordError:
            return
        for payload in (split_batch(body) if field & BATCH_FLAG else [body]):
            yield offset, payload
        offset = nxt


def _allocate(fd: int, size: int) -> None:
    """Reserve real blocks up to `size` so mmap writes cannot hit ENOSPC."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise DiskFullError(errno.ENOSPC, f"no space left to grow chunk to {size} bytes") from e
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # e.g. some tmpfs/overlay setups
            os.ftruncate(fd, max(size, os.fstat(fd).st_size))
            return
        raise


class ChunkWriter:
    """Appends frames to one chunk file through a writable mmap.

    Single-threaded: the queue's write lock serialises callers.  `map`,
    `end`, `allocated` and `count` are public because `DiskQueue.put` inlines
    the single-message append (the hottest path in the broker).
    """

    def __init__(self, path: str, number: int, capacity: int, *, create: bool,
                 end: int = HEADER_SIZE, count: int = 0) -> None:
        self.path = path
        self.number = number
        self.capacity = capacity
        self.count = count
        self.end = end
        self.base = number << 48  # position of offset 0 (see make_position)
        self._synced_to = end
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            self._fd = os.open(path, flags, 0o644)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):  # no room for a new file
                raise DiskFullError(e.errno, f"no space left to create {path}") from e
            raise
        try:
            if create:
                self.allocated = min(capacity, INITIAL_ALLOCATION)
                _allocate(self._fd, self.allocated)
                header = ChunkHeader(number, time.time_ns(), sealed=False, count=0)
                os.pwrite(self._fd, header.pack(), 0)
            else:
                self.allocated = max(os.fstat(self._fd).st_size, end, HEADER_SIZE)
                _allocate(self._fd, self.allocated)
            self.map = mmap.mmap(self._fd, self.allocated)
        except BaseException:
            os.close(self._fd)
            if create:
                os.unlink(path)
            raise

    def room_for(self, nbytes: int) -> bool:
        """Whether `nbytes` more fit before the chunk reaches its capacity."""
        return self.end + nbytes <= self.capacity

    def ensure(self, needed_end: int) -> None:
        if needed_end <= self.allocated:
            return
        size = min(self.capacity, max(self.allocated * 2, INITIAL_ALLOCATION))
        size = max(size, needed_end)  # an oversized record gets a chunk of its own size
        _allocate(self._fd, size)
        self.map.resize(size)
        self.allocated = size

    def append(self, payload: bytes) -> int:
        """Write one message in a frame of its own; returns the frame offset."""
        n = len(payload)
        offset = self.end
        end = offset + n + RECORD_OVERHEAD
        if end > self.allocated:
            self.ensure(end)
        m = self.map
        RECORD_HEAD.pack_into(m, offset, n, crc32(payload, n ^ CRC_SEED))
        m[offset + 8 : end - 4] = payload
        RECORD_TAIL.pack_into(m, end - 4, n)
        self.end = end
        self.count += 1
        return offset

    def append_batch(self, body: bytes, count: int) -> int:
        """Write a batch body (see `batch_body`) of `count` messages as one frame."""
        offset = self.end
        end = offset + len(body) + RECORD_OVERHEAD
        if end > self.allocated:
            self.ensure(end)
        field = len(body) | BATCH_FLAG
        head = RECORD_HEAD.pack(field, crc32(body, field ^ CRC_SEED))
        if len(body) >= PWRITE_THRESHOLD:
            # Large copies go faster through the kernel than through page faults on the
            # mapping; the page cache is shared, so the mapping sees the bytes at once.
            os.pwritev(self._fd, (head, body, RECORD_TAIL.pack(field)), offset)
        else:
            m = self.map
            m[offset : offset + 8] = head
            m[offset + 8 : end - 4] = body
            RECORD_TAIL.pack_into(m, end - 4, field)
        self.end = end
        self.count += count
        return offset

    def flush(self) -> None:
        """fdatasync the chunk: every frame written so far is on stable storage.

        Not ``mmap.flush`` (msync): CPython 3.11 holds the GIL through msync,
        so one queue's sync stalled every actor of its process for the whole
        disk write (measured: a spinning thread ran at 1.1 M/s during msync
        and at 8.3 M/s during fdatasync of the same dirty range).  On Linux
        the mapping and the file share the page cache, so fdatasync writes
        back the pages dirtied through either, and the file's size was fixed
        when it was allocated.
        """
        if self.end > self._synced_to:
            os.fdatasync(self._fd)
            self._synced_to = self.end

    def seal(self, *, fsync: bool = True) -> None:
        """Record the count in the header, trim the file to its data, fsync (unless
        `fsync` is False: the caller syncs the file later), and close."""
        header = ChunkHeader.unpack(self.map[:HEADER_SIZE])
        created = header.created_ns if header else time.time_ns()
        self.map[:HEADER_SIZE] = ChunkHeader(self.number, created, True, self.count).pack()
        self.close(truncate=True, fsync=fsync)  # truncates, then fsyncs data, header, size

    def close(self, *, truncate: bool = False, fsync: bool = True) -> None:
        if self._fd < 0:
            return
        self.map.close()
        if truncate:
            os.ftruncate(self._fd, self.end)
            if fsync:
                os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1

    def zero_from(self, offset: int) -> None:
        """Erase everything from `offset` on (a torn tail found by recovery)."""
        self.map[offset : self.allocated] = bytes(self.allocated - offset)


def seal_file(path: str, number: int, count: int, end: int) -> None:
    """Seal a chunk found unsealed at recovery (not the last one)."""
    with open(path, "r+b") as f:
        raw = f.read(HEADER_SIZE)
        header = ChunkHeader.unpack(raw)
        created = header.created_ns if header else time.time_ns()
        f.seek(0)
        f.write(ChunkHeader(number, created, True, count).pack())
        f.truncate(end)
