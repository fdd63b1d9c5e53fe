"""Finding a message by its id in a topic's history (#21), at millions of messages.

    python -m bench.history_bench [--messages 10000000] [--size 100] [--lookups 2000]

Writes a history (`storage.history.History`, the broker's chunk size, 100 MB)
of ``--messages`` NSQ-encoded records of ``--size`` bytes with ids from the
broker's own id factory, in batches of 200 as a busy topic appends them, then
times ``History.find_id`` (what a rewind from a message id uses) for random ids
in three states:

* **appended**: the history that wrote them (each chunk's sparse index kept as
  it was written);
* **first after open**: the first lookup in each chunk after a reopen, which
  walks that chunk's frames once to build its index;
* **reopened**: later lookups after the reopen.

It prints the write rate and each case's p50 / p99 / max in milliseconds.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import time

from actors.broker.diskqueue import _id_key
from actors.broker.nsq_message import GuidFactory, record_id, record_timestamp
from storage.history import History
from storage.syncer import Syncer


def _open(path: str) -> History:
    return History(path, chunk_bytes=100 * 1024 * 1024, max_record=1 << 20,
                   timestamp=record_timestamp, syncer=Syncer(), key=_id_key)


def _time(h: History, ids: list[bytes]) -> list[float]:
    out = []
    for message_id in ids:
        started = time.perf_counter()
        found = h.find_id(message_id, record_id, 0)
        out.append((time.perf_counter() - started) * 1000)
        assert found is not None, message_id
    return out


def _line(name: str, ms: list[float], what: str = "lookups") -> str:
    """`name`'s p50, p99 and max of `ms` (milliseconds), and how many `what`."""
    ms = sorted(ms)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    return (f"  {name:<22} p50 {statistics.median(ms):7.3f} ms   p99 {p99:7.3f} ms   "
            f"max {ms[-1]:8.3f} ms   ({len(ms)} {what})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=10_000_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--lookups", type=int, default=2000)
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="historybench")
    try:
        path = os.path.join(work, "t.history")
        h = _open(path)
        guids = GuidFactory(1)
        body = b"x" * args.size
        chosen: list[bytes] = []
        rng = random.Random(1)
        every = max(1, args.messages // args.lookups)
        started = time.perf_counter()
        now = time.time_ns()
        for done in range(0, args.messages, 200):
            n = min(200, args.messages - done)
            now += 1_000_000  # (a millisecond per batch: ids and times grow)
            batch = guids.encode_batch(now, [body] * n)
            h.append(batch)
            if done // every != (done + n) // every:
                chosen.append(record_id(batch[rng.randrange(n)]))
        took = time.perf_counter() - started
        stats = h.stats()
        print(f"history_bench: {args.messages:,} messages of {args.size} B, "
              f"{stats['chunks']} chunks, {stats['retained_bytes'] / 1e9:.2f} GB, written "
              f"at {args.messages / took:,.0f} msgs/s; {os.cpu_count()} CPUs, "
              f"{time.strftime('%Y-%m-%d %H:%M')}")
        rng.shuffle(chosen)
        print(_line("appended", _time(h, chosen)))
        h.close()
        h = _open(path)
        # one id per chunk, about: ids spread evenly over the whole history
        spread = sorted(chosen)[::max(1, len(chosen) // stats["chunks"])]
        print(_line("first after open", _time(h, spread)))
        print(_line("reopened", _time(h, chosen)))
        h.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
