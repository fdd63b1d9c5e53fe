"""Read-side chunk cache with memory-watermark admission (EQueue's chunk cache).

Theory of operation
-------------------
Readers get records through a *view* of a chunk file.  A cached view is a
read-only shared `mmap` of the whole file, kept open between reads: records
come straight from memory (the same pages the writer's mapping fills, so a
chunk that was just written is already in memory).  An uncached view reads
through `os.pread` into a small window and keeps nothing.

Admission follows the machine's used memory, asked of an injectable probe
(`psutil.virtual_memory().percent` by default):

* below the **low watermark** (40 %) every chunk a reader opens is admitted;
* above it, chunks idle for `idle_seconds` (5 s) are evicted, and chunks are
  still admitted while memory stays under the high watermark;
* above the **high watermark** (75 %) nothing new is admitted: readers fall
  back to uncached views.

The cache belongs to the queue's reader thread; it takes no locks.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from storage.chunk import LENGTH_MASK, RECORD_HEAD, CorruptRecordError, read_record

MemoryProbe = Callable[[], float]


def machine_memory_percent() -> float:
    """Used memory of the whole machine, in percent (psutil)."""
    import psutil  # noqa: PLC0415 - optional at import time for embedders

    return float(psutil.virtual_memory().percent)


class MapView:
    """A cached, memory-mapped chunk."""

    cached = True

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        self._map: mmap.mmap | None = None
        self.size = 0
        self.refresh()

    def refresh(self) -> None:
        """Map the file at its current size (it grew, or was trimmed when sealed)."""
        size = os.fstat(self._fd).st_size
        if size == self.size and self._map is not None:
            return
        if self._map is not None:
            self._map.close()
        self.size = size
        self._map = mmap.mmap(self._fd, size, access=mmap.ACCESS_READ) if size else None

    def window(self, offset: int, need: int) -> tuple[mmap.mmap | bytes, int]:
        """`(buffer, offset of buffer[0])`, with `need` bytes at `offset` if the file has them."""
        if offset + need > self.size:
            self.refresh()  # the live chunk grew since we mapped it
        return (self._map if self._map is not None else b""), 0

    def record_at(self, offset: int) -> tuple[int, bytes, int]:
        """`(length field, body, next offset)` of the frame at `offset`."""
        if offset + 8 > self.size:
            self.refresh()  # the live chunk grew since we mapped it
        m = self._map
        if m is not None and offset + 8 <= self.size:
            declared = RECORD_HEAD.unpack_from(m, offset)[0] & LENGTH_MASK
            if offset + 12 + declared > self.size:
                self.refresh()
                m = self._map
        if m is None:
            raise CorruptRecordError(offset, "chunk file is empty")
        return read_record(m, offset, self.size)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class FileView:
    """An uncached chunk, read with `pread` through a small sliding window."""

    cached = False
    WINDOW = 256 * 1024

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        self._start = 0
        self._buf = b""

    def refresh(self) -> None:
        self._buf = b""

    def window(self, offset: int, need: int) -> tuple[bytes, int]:
        rel = offset - self._start
        if rel < 0 or rel + need > len(self._buf):
            self._fill(offset, max(self.WINDOW, need))
        return self._buf, self._start

    def record_at(self, offset: int) -> tuple[int, bytes, int]:
        rel = offset - self._start
        buf = self._buf
        if rel < 0 or rel + 8 > len(buf):
            buf, rel = self._fill(offset, self.WINDOW), 0
        n = int.from_bytes(buf[rel : rel + 4], "little") & LENGTH_MASK
        if rel + n + 12 > len(buf):
            buf, rel = self._fill(offset, max(self.WINDOW, n + 12)), 0
        field, body, nxt = read_record(buf, rel, len(buf))
        return field, body, self._start + nxt

    def _fill(self, offset: int, size: int) -> bytes:
        available = os.fstat(self._fd).st_size - offset
        self._start = offset
        self._buf = os.pread(self._fd, max(min(size, available), 0), offset)
        return self._buf

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._buf = b""


@dataclass
class _Entry:
    view: MapView
    last_access: float


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    admitted: int = 0
    rejected: int = 0
    evicted: int = 0


class ChunkCache:
    """Keeps recently read chunks mapped in memory while the machine can afford it."""

    MAINTAIN_EVERY = 1.0  # seconds between watermark checks on the hot path

    def __init__(self, *, low_watermark: float = 40.0, high_watermark: float = 75.0,
                 idle_seconds: float = 5.0, probe: MemoryProbe = machine_memory_percent,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 <= low_watermark <= high_watermark <= 100:
            raise ValueError("watermarks must satisfy 0 <= low <= high <= 100 (percent)")
        self.low = low_watermark
        self.high = high_watermark
        self.idle_seconds = idle_seconds
        self._probe = probe
        self._clock = clock
        self._entries: dict[int, _Entry] = {}
        self._next_maintenance = 0.0
        self.stats = CacheStats()

    def view(self, chunk_no: int, path: str) -> MapView | FileView:
        """A view of `chunk_no`: from the cache, newly admitted, or uncached."""
        now = self._clock()
        entry = self._entries.get(chunk_no)
        if entry is not None:
            entry.last_access = now
            self.stats.hits += 1
            return entry.view
        self.stats.misses += 1
        if self._probe() < self.high:
            view = MapView(path)
            self._entries[chunk_no] = _Entry(view, now)
            self.stats.admitted += 1
            return view
        self.stats.rejected += 1
        return FileView(path)

    def touch(self, chunk_no: int) -> None:
        """Note a read of a cached chunk (keeps it from looking idle); runs upkeep."""
        now = self._clock()
        entry = self._entries.get(chunk_no)
        if entry is not None:
            entry.last_access = now
        if now >= self._next_maintenance:
            self.maintain(now, pinned=chunk_no)

    def maintain(self, now: float | None = None, pinned: int | None = None) -> int:
        """Evict idle chunks if memory is above the low watermark; returns how many."""
        now = self._clock() if now is None else now
        self._next_maintenance = now + self.MAINTAIN_EVERY
        if not self._entries or self._probe() < self.low:
            return 0
        idle = [n for n, e in self._entries.items()
                if n != pinned and now - e.last_access >= self.idle_seconds]
        for n in idle:
            self.forget(n)
        self.stats.evicted += len(idle)
        return len(idle)

    def forget(self, chunk_no: int) -> None:
        """Drop a chunk (evicted, deleted or renamed .bad)."""
        entry = self._entries.pop(chunk_no, None)
        if entry is not None:
            entry.view.close()

    def cached_chunks(self) -> list[int]:
        return sorted(self._entries)

    def cached_bytes(self) -> int:
        return sum(e.view.size for e in self._entries.values())

    def close(self) -> None:
        for n in list(self._entries):
            self.forget(n)
