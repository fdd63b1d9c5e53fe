"""Benchmark `storage.DiskQueue` against the disk queues a Python user would pick instead.

    python -m bench.storage_bench                                  # the default run (~4 min)
    python -m bench.storage_bench --messages 200000 --repeat 1    # a quick look
    python -m bench.storage_bench --cases dq.put,dq.get,queuelib.push,queuelib.pop

Systems and cases (per message size):

* ``dq``: ``storage.DiskQueue`` with its defaults (100 MiB chunks,
  ``sync_every=2500``, ``sync_timeout=2.0``): ``put`` (one message per call),
  ``put_many`` (batches of 200), ``get`` (one per call, draining what ``put``
  wrote), ``get_many(200)`` (draining what ``put_many`` wrote).
* ``dqack``: ``storage.DiskQueue`` in ack mode (a channel's queue):
  ``put_many`` as above, then ``read_ack``: what a channel's consumers do to
  a backlog -- ``read_many(4096)``, and each read acked in FINs of 1,000
  once ~50,000 are handed out (the oldest read first), so the acks meet that
  many pending positions.
* ``queuelib``: ``queuelib.FifoDiskQueue`` with its defaults (never fsyncs;
  head/tail saved only on close): ``push``, ``pop``.  Measured on
  ``--queuelib-messages`` (default: the same count as DiskQueue).
* ``pq``: ``persistqueue.Queue`` (persist-queue's file queue) with its
  defaults (``chunksize=100``: data fsynced every 100 puts, the info file
  rewritten with ``os.replace`` on every put; pickle serializer;
  ``autosave=False``): ``put``, and ``get`` followed by ``task_done()`` for
  every message -- the documented consumer pattern, and the only way the
  consumed position is persisted with the default ``autosave=False``.
  Measured on ``--peer-messages`` (default 20,000): it is about two orders of
  magnitude slower and its cost per message is flat (no growth with the
  queue), so fewer messages give the same rate.

Method: each repetition runs every (size, system) in turn -- DiskQueue,
queuelib, persist-queue, then again -- so machine noise hits them alike; the
table shows the median over ``--repeat`` repetitions and the spread
(max - min) / median.  Each timed section covers only the calls under test
(``time.perf_counter``); creating, filling for a read case that is run
without its write case, closing and deleting a queue are outside it.  The
periodic fsyncs a system does by itself while putting are inside.  Payloads
are cycled from 256 distinct random byte strings of the given size; MB/s
counts payload bytes only (1 MB = 10^6 bytes).  Every read is checked to
return exactly the messages written (count, and the first and last message).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BATCH = 200
POOL = 256

SYSTEMS = ("dq", "queuelib", "pq")
SYSTEM_NAMES = {
    "dq": "DiskQueue",
    "dqack": "DiskQueue (ack mode)",
    "queuelib": "queuelib FifoDiskQueue",
    "pq": "persist-queue Queue",
}
# (system, write case, read case): a write case fills the queue the read case drains.
PAIRS = (
    ("dq", "put", "get"),
    ("queuelib", "push", "pop"),
    ("pq", "put", "get"),
    ("dq", "put_many", "get_many"),
    ("dqack", "put_many", "read_ack"),
)
ALL_CASES = tuple(f"{s}.{c}" for s, w, r in PAIRS for c in (w, r))
# DiskQueue case -> the comparable case of each peer.
COMPARE = {
    "put": {"queuelib": "push", "pq": "put"},
    "put_many": {"queuelib": "push", "pq": "put"},
    "get": {"queuelib": "pop", "pq": "get"},
    "get_many": {"queuelib": "pop", "pq": "get"},
}


# ----------------------------------------------------------------- queue adapters


class DQAdapter:
    """`storage.DiskQueue` with default settings."""

    def __init__(self, path: str) -> None:
        from storage import DiskQueue

        self.q = DiskQueue("bench", path)

    def write(self, case: str, msgs: list[bytes], batches: list[list[bytes]]) -> float:
        if case == "put":
            put = self.q.put
            t0 = time.perf_counter()
            for m in msgs:
                put(m)
            return time.perf_counter() - t0
        put_many = self.q.put_many
        t0 = time.perf_counter()
        for b in batches:
            put_many(b)
        return time.perf_counter() - t0

    def read(self, case: str, n: int) -> tuple[float, int, bytes | None, bytes | None]:
        if case == "get":
            get = self.q.get
            first = last = None
            got = 0
            t0 = time.perf_counter()
            for _ in range(n):
                last = get()
                if last is None:
                    break
                if got == 0:
                    first = last
                got += 1
            dt = time.perf_counter() - t0
            return dt, got, first, last
        get_many = self.q.get_many
        got = 0
        first = last = None
        t0 = time.perf_counter()
        while got < n:
            out = get_many(BATCH)
            if not out:
                break
            if got == 0:
                first = out[0]
            got += len(out)
            last = out[-1]
        dt = time.perf_counter() - t0
        return dt, got, first, last

    def depth(self) -> int:
        return self.q.depth()

    def close(self) -> None:
        self.q.close()


class QueuelibAdapter:
    """`queuelib.FifoDiskQueue` with default settings (chunks of 100,000 messages)."""

    def __init__(self, path: str) -> None:
        from queuelib import FifoDiskQueue

        self.q = FifoDiskQueue(os.path.join(path, "queuelib"))

    def write(self, case: str, msgs: list[bytes], batches: list[list[bytes]]) -> float:
        push = self.q.push
        t0 = time.perf_counter()
        for m in msgs:
            push(m)
        return time.perf_counter() - t0

    def read(self, case: str, n: int) -> tuple[float, int, bytes | None, bytes | None]:
        pop = self.q.pop
        first = last = None
        got = 0
        t0 = time.perf_counter()
        for _ in range(n):
            last = pop()
            if last is None:
                break
            if got == 0:
                first = last
            got += 1
        dt = time.perf_counter() - t0
        return dt, got, first, last

    def depth(self) -> int:
        return len(self.q)

    def close(self) -> None:
        self.q.close()


class PQAdapter:
    """persist-queue's file `Queue` with default settings; `get` is followed by `task_done`."""

    def __init__(self, path: str) -> None:
        from persistqueue import Queue

        qpath = os.path.join(path, "pq")
        os.makedirs(qpath, exist_ok=True)
        # tempdir inside the queue's directory: same filesystem (required for its
        # atomic os.replace) and removed with it.  Its default, a system temp
        # dir, is the same filesystem here anyway.
        self.q = Queue(qpath, tempdir=qpath)

    def write(self, case: str, msgs: list[bytes], batches: list[list[bytes]]) -> float:
        put = self.q.put
        t0 = time.perf_counter()
        for m in msgs:
            put(m)
        return time.perf_counter() - t0

    def read(self, case: str, n: int) -> tuple[float, int, bytes | None, bytes | None]:
        from persistqueue import Empty

        get = self.q.get
        task_done = self.q.task_done
        first = last = None
        got = 0
        t0 = time.perf_counter()
        try:
            for _ in range(n):
                last = get(block=False)
                task_done()
                if got == 0:
                    first = last
                got += 1
        except Empty:
            last = None
        dt = time.perf_counter() - t0
        return dt, got, first, last

    def depth(self) -> int:
        return self.q.qsize()

    def close(self) -> None:
        for f in (self.q.headf, self.q.tailf):
            if f and not f.closed:
                f.close()


class DQAckAdapter(DQAdapter):
    """`storage.DiskQueue` in ack mode, otherwise with default settings."""

    READ = 4096  # a read's limit
    FIN = 1000  # positions an ack_many
    HANDED_OUT = 50_000  # reads are acked once this many more are handed out

    def __init__(self, path: str) -> None:
        from storage import DiskQueue

        self.q = DiskQueue("bench", path, ack_mode=True)

    def read(self, case: str, n: int) -> tuple[float, int, bytes | None, bytes | None]:
        read_many, ack_many = self.q.read_many, self.q.ack_many
        held: list[list[int]] = []
        out: list[tuple[int, bytes]] = []
        got = handed = 0
        first = None
        t0 = time.perf_counter()
        while got < n:
            out = read_many(self.READ)
            if not out:
                break
            if got == 0:
                first = out[0][1]
            got += len(out)
            held.append([p for p, _ in out])
            handed += len(out)
            while held and (handed > self.HANDED_OUT or got >= n):
                run = held.pop(0)
                handed -= len(run)
                for i in range(0, len(run), self.FIN):
                    ack_many(run[i : i + self.FIN])
        dt = time.perf_counter() - t0
        if self.q.pending():
            raise RuntimeError(f"dqack.read_ack: {self.q.pending()} left pending")
        return dt, got, first, out[-1][1] if out else None


ADAPTERS: dict[str, Callable[[str], Any]] = {
    "dq": DQAdapter,
    "dqack": DQAckAdapter,
    "queuelib": QueuelibAdapter,
    "pq": PQAdapter,
}


# ----------------------------------------------------------------- running


@dataclass
class Run:
    system: str
    case: str
    size: int
    messages: int
    repeat: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.messages / self.seconds


def make_messages(size: int, n: int) -> tuple[list[bytes], list[list[bytes]]]:
    pool = [os.urandom(size) for _ in range(POOL)]
    msgs = [pool[i % POOL] for i in range(n)]
    batches = [msgs[i : i + BATCH] for i in range(0, n, BATCH)]
    return msgs, batches


def run_pair(system: str, wcase: str, rcase: str, *, size: int, n: int, repeat: int,
             cases: set[str], base: str) -> list[Run]:
    """Write `n` messages, then drain them; each phase is timed if its case is selected."""
    want_w = f"{system}.{wcase}" in cases
    want_r = f"{system}.{rcase}" in cases
    if not (want_w or want_r):
        return []
    msgs, batches = make_messages(size, n)
    path = tempfile.mkdtemp(prefix=f"{system}-{wcase}-", dir=base)
    runs: list[Run] = []
    q = ADAPTERS[system](path)
    try:
        gc.collect()
        dt = q.write(wcase, msgs, batches)
        if want_w:
            runs.append(Run(system, wcase, size, n, repeat, dt))
        depth = q.depth()
        if depth != n:
            raise RuntimeError(f"{system}.{wcase}: depth {depth} after {n} writes")
        if want_r:
            gc.collect()
            dt, got, first, last = q.read(rcase, n)
            if got != n or first != msgs[0] or last != msgs[-1]:
                raise RuntimeError(f"{system}.{rcase}: read {got} of {n} messages, "
                                   f"first ok={first == msgs[0]}, last ok={last == msgs[-1]}")
            runs.append(Run(system, rcase, size, n, repeat, dt))
    finally:
        q.close()
        del q
        shutil.rmtree(path, ignore_errors=True)
    return runs


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def loadavg() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:
        return None


def fmt_int(x: float) -> str:
    return f"{x:,.0f}"


# ----------------------------------------------------------------- report


def summarize(runs: list[Run]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str, int], list[Run]] = {}
    for r in runs:
        groups.setdefault((r.system, r.case, r.size), []).append(r)
    rows = []
    order = {c: i for i, c in enumerate(ALL_CASES)}
    for (system, case, size), rs in sorted(groups.items(),
                                           key=lambda kv: (kv[0][2],
                                                           order[f"{kv[0][0]}.{kv[0][1]}"])):
        rates = [r.rate for r in rs]
        med = statistics.median(rates)
        rows.append({
            "system": system, "case": case, "size": size, "messages": rs[0].messages,
            "runs": len(rs), "median_msgs_per_s": med,
            "median_mb_per_s": med * size / 1e6,
            "min_msgs_per_s": min(rates), "max_msgs_per_s": max(rates),
            "spread": (max(rates) - min(rates)) / med if med else 0.0,
            "rates": rates,
        })
    return rows


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {(r["system"], r["case"], r["size"]): r for r in rows}
    out = []
    for r in rows:
        if r["case"] not in COMPARE or r["system"] != "dq":
            continue
        for peer, pcase in COMPARE[r["case"]].items():
            p = by.get((peer, pcase, r["size"]))
            if p is None:
                continue
            out.append({"size": r["size"], "dq_case": r["case"], "peer": peer,
                        "peer_case": pcase,
                        "ratio": r["median_msgs_per_s"] / p["median_msgs_per_s"]})
    return out


def print_table(rows: list[dict[str, Any]], rat: list[dict[str, Any]], repeat: int) -> None:
    hdr = ("system", "case", "size", "messages", "msgs/s", "MB/s", "spread")
    body = [(SYSTEM_NAMES[r["system"]], r["case"], str(r["size"]), fmt_int(r["messages"]),
             fmt_int(r["median_msgs_per_s"]), f"{r['median_mb_per_s']:,.1f}",
             f"{r['spread'] * 100:.0f}%") for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h)
              for i, h in enumerate(hdr)]
    left = {0, 1}

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    print(f"\nThroughput: median of {repeat} run(s) (ops/s = msgs/s; spread = (max-min)/median)")
    print(line(hdr))
    print("  ".join("-" * w for w in widths))
    last_size = None
    for r, b in zip(rows, body, strict=True):
        if last_size is not None and r["size"] != last_size:
            print()
        last_size = r["size"]
        print(line(b))
    if rat:
        print("\nRatios: DiskQueue median / peer median (> 1: DiskQueue faster)")
        for size in sorted({x["size"] for x in rat}):
            for x in (x for x in rat if x["size"] == size):
                print(f"  {size:>5} B  DiskQueue {x['dq_case']:<8} vs "
                      f"{SYSTEM_NAMES[x['peer']] + ' ' + x['peer_case']:<28} "
                      f"{x['ratio']:>9,.1f}x")


# ----------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.storage_bench",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--messages", type=int, default=1_000_000,
                   help="messages per DiskQueue case")
    p.add_argument("--queuelib-messages", type=int, default=None,
                   help="messages per queuelib case (default: --messages)")
    p.add_argument("--peer-messages", type=int, default=20_000,
                   help="messages per persist-queue case (it is ~100x slower)")
    p.add_argument("--sizes", default="100,1024", help="message sizes in bytes, comma-separated")
    p.add_argument("--repeat", type=int, default=3, help="repetitions; the median is reported")
    p.add_argument("--cases", default=",".join(ALL_CASES),
                   help="comma-separated subset of: " + ",".join(ALL_CASES))
    p.add_argument("--data-dir", default=None,
                   help="where queues are created (default: a fresh temp dir, removed afterwards)")
    p.add_argument("--json", default=None, metavar="FILE", help="write all results to FILE")
    a = p.parse_args(argv)
    a.sizes = [int(s) for s in a.sizes.split(",") if s.strip()]
    a.cases = {c.strip() for c in a.cases.split(",") if c.strip()}
    unknown = a.cases - set(ALL_CASES)
    if unknown:
        p.error(f"unknown case(s) {sorted(unknown)}; choose from {','.join(ALL_CASES)}")
    if a.queuelib_messages is None:
        a.queuelib_messages = a.messages
    for name in ("messages", "queuelib_messages", "peer_messages", "repeat"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if any(s < 1 for s in a.sizes):
        p.error("sizes must be >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    command = shlex.join([os.path.basename(sys.executable), "-m", "bench.storage_bench",
                          *(sys.argv[1:] if argv is None else argv)])
    counts = {"dq": a.messages, "dqack": a.messages, "queuelib": a.queuelib_messages,
              "pq": a.peer_messages}
    machine = {
        "cpu": cpu_model(), "cores": os.cpu_count(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "platform": platform.platform(),
    }
    versions = {}
    for mod, dist in (("queuelib", "queuelib"), ("persistqueue", "persist-queue")):
        try:
            from importlib.metadata import version
            versions[mod] = version(dist)
        except Exception:  # not installed: reported as such
            versions[mod] = "?"
    load_before = loadavg()
    print(f"command: {command}")
    print(f"machine: {machine['cpu']}, {machine['cores']} cores, {machine['python']}, "
          f"{machine['platform']}")
    print(f"peers:   queuelib {versions['queuelib']}, persist-queue {versions['persistqueue']}")
    print(f"load average at start (1/5/15 min): {load_before}")
    print(f"messages per case: DiskQueue {a.messages:,}, queuelib {a.queuelib_messages:,}, "
          f"persist-queue {a.peer_messages:,} (fewer: ~100x slower, flat cost per message); "
          f"sizes {a.sizes}; repeat {a.repeat}")
    print("DiskQueue defaults (sync_every=2500, sync_timeout=2.0, 100 MiB chunks); "
          "persist-queue defaults (chunksize=100, autosave=False, get+task_done); "
          "queuelib defaults (never fsyncs)")

    own_dir = a.data_dir is None
    base = tempfile.mkdtemp(prefix="storage-bench-") if own_dir else a.data_dir
    os.makedirs(base, exist_ok=True)
    runs: list[Run] = []
    t_start = time.perf_counter()
    try:
        for rep in range(a.repeat):
            for size in a.sizes:
                for system, wcase, rcase in PAIRS:
                    got = run_pair(system, wcase, rcase, size=size, n=counts[system],
                                   repeat=rep, cases=a.cases, base=base)
                    for r in got:
                        print(f"  rep {rep + 1}/{a.repeat} {size:>5} B "
                              f"{SYSTEM_NAMES[r.system] + ' ' + r.case:<32} "
                              f"{fmt_int(r.rate):>11} msgs/s  ({r.seconds:.2f} s)", flush=True)
                    runs.extend(got)
    finally:
        if own_dir:
            shutil.rmtree(base, ignore_errors=True)
    elapsed = time.perf_counter() - t_start
    load_after = loadavg()

    rows = summarize(runs)
    rat = ratios(rows)
    print_table(rows, rat, a.repeat)
    print(f"\nload average at end (1/5/15 min): {load_after}; wall time {elapsed:.0f} s")

    if a.json:
        doc = {
            "command": command, "machine": machine, "peer_versions": versions,
            "load_before": load_before, "load_after": load_after, "wall_seconds": elapsed,
            "config": {"messages": counts, "sizes": a.sizes, "repeat": a.repeat,
                       "cases": sorted(a.cases), "batch": BATCH},
            "results": rows, "ratios": rat,
            "runs": [{"system": r.system, "case": r.case, "size": r.size,
                      "messages": r.messages, "repeat": r.repeat, "seconds": r.seconds,
                      "msgs_per_s": r.rate} for r in runs],
        }
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"results written to {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
