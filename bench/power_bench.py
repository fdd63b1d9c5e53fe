"""Power cuts side by side: what our broker and nsqd lose of what they acknowledged (#22).

    python -m bench.power_bench [--brokers ours,nsqd] [--cuts 15] [--life 2.0]
                                [--nsqd ../shared/nsq/bin/nsqd]
                                [--model posix[,journal,kill9]] [--max-bytes-per-file 20000]

Each broker runs, one after the other, the workload and the cuts of
``tests/power/test_power_loss.py`` with the rig of ``tests/power/rig.py``:
its data directory (provisioned: created and its parent fsynced beforehand)
lives on the FUSE file system of ``tests/power/volatile_fs.py``, which drops
at each unmount whatever POSIX lets a power cut drop -- bytes not fsynced,
directory entries whose directory was not fsynced.  Both brokers are durable
(``--mem-queue-size=0 --sync-every=1``) with the same small
``--max-bytes-per-file``, so queues rotate files in every life.

A life: start the broker, create topics ``t`` and ``u`` and channels ``c``
and ``d`` of each over HTTP (``/topic/create``, ``/channel/create``); one
producer per topic publishes MPUBs of 10 unique bodies over NSQ TCP one after
another, noting each batch once it is OK; in every other life a consumer per
topic FINs everything on ``c`` (``d`` is only read at the end).  After
``--life`` seconds the cut: SIGKILL to the broker's process tree,
``fusermount3 -u`` (the power goes), mount again.  After ``--cuts`` cuts, a
last life drains every channel (until 3 s pass without a message).

Per broker it reports the acknowledged messages; those acknowledged but never
delivered on a channel (lost), per channel and in total as a percentage of
acknowledged x channels; deliveries beyond one per message and channel
(duplicates: NSQ is at-least-once, a cut redelivers what was not FINed); bodies
delivered that no producer sent (unexpected); and the run's wall time.  Messages
lost on every channel of their topic (lost by the topic, before any channel
had them) are also counted, and how many of those were in the last MPUB their
producer saw acknowledged before a cut.  A Markdown table, one row per
broker and model, ends the output.

``--model`` picks what a cut is; several run one after the other:

* ``posix`` (the default, the rig): what POSIX lets a power cut drop;
* ``journal``: a laxer file system, where any fsync also makes every
  directory change durable, as a journal commit does in practice on ext4 or
  XFS (POSIX does not promise it): what a broker loses there, it loses even
  where missing directory fsyncs are forgiven;
* ``kill9``: no cut at all, the mount stays up and only the SIGKILLs remain:
  what a broker loses to a crash of its process alone.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.power.rig import (
    ROOT,
    BrokerProcess,
    VolatileMount,
    consume,
    fuse_problem,
    produce,
)

TOPICS = ("t", "u")
CHANNELS = ("c", "d")  # "c" consumed in every other life, "d" only at the end
DRAIN_IDLE = 3.0
MODELS = ("posix", "journal", "kill9")


@dataclass
class Result:
    broker: str
    model: str
    cuts: int
    acked: int = 0
    lost: dict[tuple[str, str], int] = field(default_factory=dict)
    lost_everywhere: int = 0  # acknowledged, delivered on no channel: lost by the topic
    lost_everywhere_last: int = 0  # of those, in the last MPUB acknowledged before a cut
    duplicates: int = 0
    unexpected: int = 0
    elapsed: float = 0.0

    @property
    def lost_total(self) -> int:
        return sum(self.lost.values())

    @property
    def lost_percent(self) -> float:
        return 100 * self.lost_total / max(1, self.acked * len(CHANNELS))


def run(broker_name: str, nsqd: str | None, *, model: str, cuts: int, life_s: float,
        max_bytes_per_file: int) -> Result:
    """One broker through `cuts` power cuts; counts what it lost of what it acknowledged."""
    work = Path(tempfile.mkdtemp(prefix=f"power-bench-{broker_name}-", dir="/tmp"))
    fs = VolatileMount(work, journal=model == "journal")
    log = (work / "broker.log").open("ab")
    acked: dict[str, set[bytes]] = {t: set() for t in TOPICS}
    sent: dict[str, set[bytes]] = {t: set() for t in TOPICS}
    got: dict[tuple[str, str], Counter[bytes]] = {(t, c): Counter() for t in TOPICS
                                                  for c in CHANNELS}
    result = Result(broker_name, model, cuts)
    started = time.monotonic()
    broker: BrokerProcess | None = None
    try:
        fs.up()
        # A long data path keeps our broker's ipc sockets in /tmp, off the volatile mount
        data = fs.durable_dir("d" * 80)
        broker = BrokerProcess(data, nsqd=nsqd, max_bytes_per_file=max_bytes_per_file,
                               log=log)
        for life in range(cuts + 1):
            broker.start()
            broker.create(TOPICS, CHANNELS)
            if life == cuts:
                break
            stop = threading.Event()
            prefix = f"life{life}"
            threads = [threading.Thread(target=produce, args=(broker.tcp, t, prefix, acked[t],
                                                              stop), kwargs={"sent": sent[t]})
                       for t in TOPICS]
            if life % 2 == 0:
                threads += [threading.Thread(target=consume, args=(broker.tcp, t, "c",
                                                                   _count(got[t, "c"]), stop))
                            for t in TOPICS]
            for t in threads:
                t.start()
            time.sleep(life_s)
            broker.kill9()  # the power goes (or, with kill9, only the process)
            stop.set()
            for t in threads:
                t.join(30)
            if model != "kill9":
                fs.cut()
                fs.up()
            event = "kill" if model == "kill9" else "cut"
            print(f"  {broker_name}/{model}: {event} {life + 1}/{cuts}, "
                  f"{sum(map(len, acked.values()))} acknowledged so far", flush=True)
        stop = threading.Event()
        for (topic, channel), counter in got.items():
            consume(broker.tcp, topic, channel, _count(counter), stop, idle=DRAIN_IDLE)
    except Exception:
        log.flush()
        tail = (work / "broker.log").read_bytes()[-2000:].decode(errors="replace")
        print(f"  {broker_name}/{model} failed (files kept in {work}); its log ends with:\n{tail}")
        raise
    finally:
        if broker is not None:
            with contextlib.suppress(Exception):
                broker.kill9()
        with contextlib.suppress(Exception):
            fs.cut()
        log.close()
    result.elapsed = time.monotonic() - started
    if not os.path.ismount(fs.mount):
        shutil.rmtree(work, ignore_errors=True)

    result.acked = sum(map(len, acked.values()))
    last_batch = _last_batches(acked)
    for topic in TOPICS:
        everywhere = acked[topic] - set().union(*(got[topic, c].keys() for c in CHANNELS))
        result.lost_everywhere += len(everywhere)
        result.lost_everywhere_last += len(everywhere & last_batch)
    for (topic, channel), counter in got.items():
        result.lost[topic, channel] = len(acked[topic] - counter.keys())
        result.duplicates += sum(n - 1 for n in counter.values())
        result.unexpected += len(counter.keys() - sent[topic])
    return result


def _count(counter: Counter[bytes]) -> Callable[[bytes], None]:
    def deliver(body: bytes) -> None:
        counter[body] += 1

    return deliver


def _last_batches(acked: dict[str, set[bytes]]) -> set[bytes]:
    """The bodies of the last MPUB of 10 each producer saw acknowledged in each life."""
    last: dict[tuple[bytes, bytes], int] = {}
    for bodies in acked.values():
        for body in bodies:
            prefix, topic, n = body.rsplit(b"-", 2)
            key = (prefix, topic)
            last[key] = max(last.get(key, 0), int(n))
    return {b"%s-%s-%d" % (prefix, topic, n - i)
            for (prefix, topic), n in last.items() for i in range(10)}


def report(r: Result) -> None:
    per_channel = ", ".join(f"{t}/{c} {n}" for (t, c), n in sorted(r.lost.items()))
    print(f"{r.broker}, {r.model}: {r.cuts} cuts, {r.acked} acknowledged, "
          f"lost {r.lost_total} ({r.lost_percent:.2f} % of acknowledged x channels; "
          f"{per_channel}; on no channel {r.lost_everywhere}, {r.lost_everywhere_last} of them "
          f"in a life's last acknowledged MPUB), "
          f"{r.duplicates} duplicates, {r.unexpected} unexpected, {r.elapsed:.0f} s", flush=True)


def table(results: list[Result]) -> str:
    channels = [f"{t}/{c}" for t in TOPICS for c in CHANNELS]
    head = ["broker", "model", "cuts", "acknowledged",
            *(f"lost {c}" for c in channels), "lost total (% of acked x channels)",
            "duplicates", "unexpected", "elapsed"]
    rows = ["| " + " | ".join(head) + " |",
            "|" + "|".join("---" if i < 2 else "---:" for i in range(len(head))) + "|"]
    for r in results:
        cells = [r.broker, r.model, str(r.cuts), f"{r.acked:,}",
                 *(f"{r.lost[t, c]:,}" for t in TOPICS for c in CHANNELS),
                 f"{r.lost_total:,} ({r.lost_percent:.2f} %)", f"{r.duplicates:,}",
                 f"{r.unexpected:,}", f"{r.elapsed:.0f} s"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _default_nsqd() -> str | None:
    shared = ROOT.parent / "shared" / "nsq" / "bin" / "nsqd"
    return str(shared) if shared.exists() else shutil.which("nsqd")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--brokers", default="ours,nsqd", help="comma-separated: ours, nsqd")
    ap.add_argument("--cuts", type=int, default=15)
    ap.add_argument("--life", type=float, default=2.0, help="seconds of load between cuts")
    ap.add_argument("--nsqd", default=_default_nsqd(),
                    help="the nsqd binary (default: ../shared/nsq/bin/nsqd, else PATH)")
    ap.add_argument("--model", default="posix",
                    help="comma-separated: posix (the rig), journal, kill9 (no cut)")
    ap.add_argument("--max-bytes-per-file", type=int, default=20000)
    a = ap.parse_args()
    problem = fuse_problem()
    if problem:
        raise SystemExit(f"power_bench: {problem}")
    brokers = [b.strip() for b in a.brokers.split(",") if b.strip()]
    models = [m.strip() for m in a.model.split(",") if m.strip()]
    if set(brokers) - {"ours", "nsqd"} or set(models) - set(MODELS):
        raise SystemExit(f"power_bench: --brokers takes ours, nsqd; --model takes {MODELS}")
    results: list[Result] = []
    for model in models:
        for name in brokers:
            if name == "nsqd" and not (a.nsqd and Path(a.nsqd).exists()):
                print(f"nsqd: skipped, no binary (--nsqd {a.nsqd})")
                continue
            print(f"{name} on {model}: {a.cuts} cuts of {a.life:g} s lives", flush=True)
            r = run(name, a.nsqd if name == "nsqd" else None, model=model, cuts=a.cuts,
                    life_s=a.life, max_bytes_per_file=a.max_bytes_per_file)
            report(r)
            results.append(r)
    print()
    print(table(results))


if __name__ == "__main__":
    main()
