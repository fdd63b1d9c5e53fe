"""Benchmark the candidate backings of the delayed store, side by side, in one run.

    python bench/delayed_bench.py                      # 1,000,000 entries, all candidates
    python bench/delayed_bench.py --entries 200000 --candidates sqlite,log

Candidates (same API: add, add_many, pop_due, remove, open):

* ``sqlite`` -- ``storage.delayed.DelayedStore`` (SQLite WAL, synchronous=NORMAL,
  ``PRIMARY KEY (due, id) WITHOUT ROWID`` + unique index on id).
* ``lmdb``   -- the ``lmdb`` PyPI package: one sub-database keyed by
  ``due(8B big-endian) + id`` and one ``id -> due`` index, ``sync=False``
  (writes reach the OS on commit; ``env.sync()`` is the fsync).
* ``log``    -- a hand-written append-only log of add/remove records
  (length + CRC32 framed, one ``write()`` per call) with an in-memory index
  rebuilt at open: ``dict id -> (due, offset, length)`` plus a heap of
  ``(due, id)``.  No compaction (it would only add cost).

Each phase of each candidate runs in a fresh child process so that RSS figures
are not polluted by the previous candidate:

1. ``fill``: ``--single`` single adds, then the rest up to ``--entries`` with
   ``add_many`` batches of 200; RSS growth; the child then ends with
   ``os._exit`` without closing (like kill -9), so ``open`` includes crash
   recovery (SQLite WAL replay, log index rebuild).
2. ``open``: open time and RSS growth with ``--entries`` stored; ``--removes``
   single removes of random ids; then ``pop_due`` in batches of 200 until empty.

Due times are random over one hour (random inserts into the ordered key space);
payloads are ``--payload`` bytes (NSQ-encoded messages of about 100 bytes).
Requires ``psutil``; ``lmdb`` is optional (``pip install lmdb``).
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BATCH = 200
BASE_DUE = 1_700_000_000_000_000_000
HOUR_NS = 3600 * 10**9


# --------------------------------------------------------------------- candidates


class LmdbCandidate:
    """Ordered store on LMDB: ``due+id -> payload`` and ``id -> due``."""

    def __init__(self, directory: Path) -> None:
        import lmdb

        directory.mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(
            str(directory),
            map_size=64 * 1024**3,
            max_dbs=2,
            sync=False,
            metasync=False,
            readahead=False,
        )
        self.by_due = self.env.open_db(b"due")
        self.by_id = self.env.open_db(b"id")

    @staticmethod
    def _key(due: int, message_id: bytes) -> bytes:
        return struct.pack(">Q", due + 2**63) + message_id

    def _put(self, txn: Any, due: int, message_id: bytes, payload: bytes) -> None:
        old = txn.get(message_id, db=self.by_id)
        if old is not None:
            txn.delete(old + message_id, db=self.by_due)
        d = struct.pack(">Q", due + 2**63)
        txn.put(d + message_id, payload, db=self.by_due)
        txn.put(message_id, d, db=self.by_id)

    def add(self, due: int, message_id: bytes, payload: bytes) -> None:
        with self.env.begin(write=True) as txn:
            self._put(txn, due, message_id, payload)

    def add_many(self, entries: list[tuple[int, bytes, bytes]]) -> None:
        with self.env.begin(write=True) as txn:
            for due, message_id, payload in entries:
                self._put(txn, due, message_id, payload)

    def pop_due(self, now: int, limit: int) -> list[tuple[int, bytes, bytes]]:
        out = []
        bound = struct.pack(">Q", now + 2**63)
        with self.env.begin(write=True) as txn:
            cur = txn.cursor(db=self.by_due)
            if cur.first():
                while len(out) < limit:
                    key = cur.key()
                    if not key or key[:8] > bound:
                        break
                    out.append((struct.unpack(">Q", key[:8])[0] - 2**63, key[8:], cur.value()))
                    txn.delete(key[8:], db=self.by_id)
                    if not cur.delete():
                        break
        return out

    def remove(self, message_id: bytes) -> bool:
        with self.env.begin(write=True) as txn:
            old = txn.get(message_id, db=self.by_id)
            if old is None:
                return False
            txn.delete(old + message_id, db=self.by_due)
            txn.delete(message_id, db=self.by_id)
            return True

    def __len__(self) -> int:
        with self.env.begin() as txn:
            return txn.stat(self.by_id)["entries"]

    def close(self) -> None:
        self.env.close()


class LogCandidate:
    """Append-only log of framed add/remove records plus an in-memory index."""

    HEADER = struct.Struct(">IIBqB")  # length of the rest, crc of the rest, type, due, id length
    ADD, REMOVE = 1, 2

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / "delayed.log"
        self.index: dict[bytes, tuple[int, int, int]] = {}
        self.heap: list[tuple[int, bytes]] = []
        self.corrupt = 0
        end = self._replay()
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        os.ftruncate(self.fd, end)
        self.end = end

    def _replay(self) -> int:
        if not self.path.exists():
            return 0
        data = self.path.read_bytes()
        pos, size, hsize = 0, len(data), self.HEADER.size
        index = self.index
        while pos + hsize <= size:
            length, crc, kind, due, idlen = self.HEADER.unpack_from(data, pos)
            body_end = pos + 8 + length
            if body_end > size or zlib.crc32(data[pos + 8 : body_end]) != crc:
                self.corrupt += 1
                break
            id_start = pos + hsize
            message_id = data[id_start : id_start + idlen]
            if kind == self.ADD:
                index[message_id] = (due, id_start + idlen, body_end - id_start - idlen)
            else:
                index.pop(message_id, None)
            pos = body_end
        self.heap = [(due, mid) for mid, (due, _, _) in index.items()]
        heapq.heapify(self.heap)
        return pos

    def _frame(self, kind: int, due: int, message_id: bytes, payload: bytes) -> bytes:
        rest = struct.pack(">Bqb", kind, due, len(message_id)) + message_id + payload
        return struct.pack(">II", len(rest), zlib.crc32(rest)) + rest

    def add(self, due: int, message_id: bytes, payload: bytes) -> None:
        self.add_many([(due, message_id, payload)])

    def add_many(self, entries: list[tuple[int, bytes, bytes]]) -> None:
        frames = []
        offset = self.end
        hsize = self.HEADER.size
        for due, message_id, payload in entries:
            frame = self._frame(self.ADD, due, message_id, payload)
            frames.append(frame)
            self.index[message_id] = (due, offset + hsize + len(message_id), len(payload))
            heapq.heappush(self.heap, (due, message_id))
            offset += len(frame)
        os.pwrite(self.fd, b"".join(frames), self.end)
        self.end = offset

    def pop_due(self, now: int, limit: int) -> list[tuple[int, bytes, bytes]]:
        out = []
        heap, index = self.heap, self.index
        while heap and len(out) < limit and heap[0][0] <= now:
            due, message_id = heapq.heappop(heap)
            entry = index.get(message_id)
            if entry is None or entry[0] != due:
                continue  # removed or replaced: stale heap item
            del index[message_id]
            out.append((due, message_id, os.pread(self.fd, entry[2], entry[1])))
        if out:
            data = b"".join(self._frame(self.REMOVE, 0, m, b"") for _, m, _ in out)
            os.pwrite(self.fd, data, self.end)
            self.end += len(data)
        return out

    def remove(self, message_id: bytes) -> bool:
        if self.index.pop(message_id, None) is None:
            return False
        data = self._frame(self.REMOVE, 0, message_id, b"")
        os.pwrite(self.fd, data, self.end)
        self.end += len(data)
        return True

    def __len__(self) -> int:
        return len(self.index)

    def close(self) -> None:
        os.close(self.fd)


def make(candidate: str, directory: Path) -> Any:
    if candidate == "sqlite":
        sys.path.insert(0, str(ROOT))
        from storage.delayed import DelayedStore

        directory.mkdir(parents=True, exist_ok=True)
        return DelayedStore(directory, name="bench")
    if candidate == "lmdb":
        return LmdbCandidate(directory)
    if candidate == "log":
        return LogCandidate(directory)
    raise SystemExit(f"unknown candidate {candidate}")


# --------------------------------------------------------------------- phases


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def dir_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


def message_id(i: int) -> bytes:
    return f"{i:016x}".encode()


DELAYS_NS = (1 * 10**9, 5 * 10**9, 60 * 10**9, HOUR_NS)


def due_time(i: int, dues: str, rng: random.Random) -> int:
    """``random``: uniform over an hour; ``rising``: one message per microsecond,
    each deferred by one of a few fixed delays (DPUB / REQ with a backoff)."""
    if dues == "random":
        return BASE_DUE + rng.randrange(HOUR_NS)
    return BASE_DUE + i * 1000 + rng.choice(DELAYS_NS)


def entries(
    start: int, stop: int, payload: bytes, rng: random.Random, dues: str
) -> list[tuple[int, bytes, bytes]]:
    return [(due_time(i, dues, rng), message_id(i), payload) for i in range(start, stop)]


def phase_fill(candidate: str, directory: Path, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(1)
    payload = bytes(rng.randrange(256) for _ in range(args.payload))
    base_rss = rss()
    store = make(candidate, directory)
    n_single = min(args.single, args.entries)
    work = entries(0, n_single, payload, rng, args.dues)
    t0 = time.perf_counter()
    for due, mid, body in work:
        store.add(due, mid, body)
    single_s = time.perf_counter() - t0
    batches = [
        entries(i, min(i + BATCH, args.entries), payload, rng, args.dues)
        for i in range(n_single, args.entries, BATCH)
    ]
    n_batched = sum(len(b) for b in batches)
    t0 = time.perf_counter()
    for batch in batches:
        store.add_many(batch)
    batch_s = time.perf_counter() - t0
    del batches, work
    assert len(store) == args.entries, len(store)
    return {
        "add_per_s": n_single / single_s if single_s else 0.0,
        "add_many_per_s": n_batched / batch_s if batch_s else 0.0,
        "fill_rss_mib": (rss() - base_rss) / 2**20,
        "disk_mib": dir_bytes(directory) / 2**20,
    }


def phase_open(candidate: str, directory: Path, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(2)
    base_rss = rss()
    t0 = time.perf_counter()
    store = make(candidate, directory)
    open_s = time.perf_counter() - t0
    open_rss = rss() - base_rss
    assert len(store) == args.entries, (len(store), args.entries)
    extra = {}
    if candidate == "sqlite":
        # The same open without PRAGMA quick_check, to show what the check costs.
        store.close()
        from storage.delayed import DelayedStore

        t0 = time.perf_counter()
        store = DelayedStore(directory, name="bench", verify_on_open=False)
        extra["open_noverify_s"] = time.perf_counter() - t0
    ids = [message_id(rng.randrange(args.entries)) for _ in range(args.removes)]
    t0 = time.perf_counter()
    removed = sum(store.remove(mid) for mid in ids)
    remove_s = time.perf_counter() - t0
    now = BASE_DUE + 2 * HOUR_NS + args.entries * 1000
    popped = 0
    t0 = time.perf_counter()
    while True:
        got = store.pop_due(now, BATCH)
        if not got:
            break
        popped += len(got)
    pop_s = time.perf_counter() - t0
    assert popped == args.entries - removed, (popped, args.entries, removed)
    store.close()
    return {
        "open_s": open_s,
        "open_rss_mib": open_rss / 2**20,
        "remove_per_s": len(ids) / remove_s if remove_s else 0.0,
        "pop_per_s": popped / pop_s if pop_s else 0.0,
        **extra,
    }


def child(argv: list[str]) -> None:
    args = parse(argv)
    phase, candidate, directory = args.child
    fn = phase_fill if phase == "fill" else phase_open
    result = fn(candidate, Path(directory), args)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # no close(): the next phase opens after a "crash"


def run_child(
    phase: str, candidate: str, directory: Path, args: argparse.Namespace
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--child", phase, candidate, str(directory),
        "--entries", str(args.entries),
        "--single", str(args.single),
        "--removes", str(args.removes),
        "--payload", str(args.payload),
        "--dues", args.dues,
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{candidate} {phase} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--entries", type=int, default=1_000_000)
    p.add_argument("--single", type=int, default=50_000, help="how many of them by single add")
    p.add_argument("--removes", type=int, default=10_000)
    p.add_argument("--payload", type=int, default=100)
    p.add_argument("--candidates", default="sqlite,lmdb,log")
    p.add_argument("--dues", default="rising,random", help="due-time patterns: rising,random")
    p.add_argument("--dir", default=None, help="where to put the stores (default: a temp dir)")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_pattern(base: Path, args: argparse.Namespace, cols: list[tuple[str, str, str]]) -> None:
    print(f"\ndue times: {args.dues}")
    print(f"{'candidate':<10}" + "".join(f"{c[0]:>14}" for c in cols))
    results = {}
    for candidate in args.candidates.split(","):
        directory = base / f"{candidate}-{args.dues}"
        try:
            r = run_child("fill", candidate, directory, args)
            r |= run_child("open", candidate, directory, args)
        except SystemExit as exc:
            print(f"{candidate:<10} skipped: {str(exc).strip().splitlines()[-1]}")
            continue
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        results[candidate] = r
        print(f"{candidate:<10}" + "".join(f"{c[2].format(r[c[1]]):>14}" for c in cols))
    for name, r in results.items():
        per_entry = r["open_rss_mib"] * 2**20 / args.entries
        note = f"{name}: memory after open {per_entry:.0f} B/entry"
        note += f" (x10M entries = {per_entry * 10_000_000 / 2**30:.2f} GiB)"
        if name == "sqlite":
            note = "sqlite: memory is SQLite's page cache (cache_kib), bounded, not per entry"
        if "open_noverify_s" in r:
            note += f"; open without quick_check {r['open_noverify_s']:.2f} s"
        print(note)
    if "sqlite" in results:
        ref = results["sqlite"]
        for name, r in results.items():
            if name != "sqlite":
                ratios = ", ".join(
                    f"{c[0]} x{r[c[1]] / ref[c[1]]:.2f}" for c in cols[:4] if ref[c[1]]
                )
                print(f"{name} vs sqlite: {ratios}")


def main(argv: list[str]) -> None:
    if "--child" in argv:
        child(argv)
        return
    args = parse(argv)
    base = Path(tempfile.mkdtemp(prefix="delayed-bench-", dir=args.dir))
    print(
        f"delayed store candidates: {args.entries:,} entries, {args.payload} B payloads, "
        f"{args.single:,} single adds then add_many batches of {BATCH}, "
        f"{args.removes:,} single removes, pop_due batches of {BATCH}; python "
        f"{sys.version.split()[0]}, {os.cpu_count()} CPUs"
    )
    cols = [
        ("add/s", "add_per_s", "{:,.0f}"),
        ("add_many/s", "add_many_per_s", "{:,.0f}"),
        ("remove/s", "remove_per_s", "{:,.0f}"),
        ("pop_due/s", "pop_per_s", "{:,.0f}"),
        ("open s", "open_s", "{:.2f}"),
        ("fill RSS MiB", "fill_rss_mib", "{:.0f}"),
        ("open RSS MiB", "open_rss_mib", "{:.0f}"),
        ("disk MiB", "disk_mib", "{:.0f}"),
    ]
    try:
        for dues in args.dues.split(","):
            run_pattern(base, argparse.Namespace(**{**vars(args), "dues": dues}), cols)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
