"""NSQ's own bench clients against nsqd and ours, side by side in one run (#17).

    python -m bench.nsq_clients_bench [--rounds 3] [--runfor 5] [--sizes 100,1024]
                                      [--brokers nsqd,ours] [--batch-size 200]
                                      [--mem-queue-size N] [--sync-every N]
                                      [--bin ../shared/nsq/bin]

``--brokers`` also takes ``ours@/path/to/checkout`` to run another build of
ours beside this one (its tree on ``PYTHONPATH``), e.g. the build before a change.

Each round starts every broker afresh (empty data directory, ports from the
OS), the brokers in turn (the order rotated each round, so each runs first as often
as the rounds allow), and runs three cases with NSQ v1.3.0's
``bench_writer`` / ``bench_reader`` (one connection per Go thread, as they do):

* **PUB**: ``bench_writer --batch-size B`` for ``--runfor`` seconds on a topic
  whose channel ``ch`` exists (so publishing includes the fan-out to it);
* **SUB**: ``bench_reader`` drains that backlog for half as long (so that a
  reader faster than the writer still has work for its whole run; a run that
  emptied the channel is marked ``*``: its rate is a floor);
* **PUB+SUB**: both at once on a fresh topic, started together by
  ``--deadline``; the lower of the two rates is the case's figure (both printed),
  with the CPU each side used over the middle half of the run (the broker's
  processes together, the writer, the reader, the machine's idle), the
  broker's CPU a message, and how much of a core the broker's busiest thread
  ran and waited in the kernel's run queue: where a broker spends its cores,
  not only how fast (ours does its work on one thread).

It prints each run, then per case the median of the rounds and the ratio of
each broker to the first one listed (medians of per-round ratios, since the
machine's speed drifts between rounds).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import psutil

from bench.scale_bench import Broker

BIN_DEFAULT = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "nsq", "bin")
RATE = re.compile(rb"([0-9.]+)ops/s")


@dataclass
class Runs:
    """rates[case][broker] -> one figure per round."""

    rates: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def add(self, case: str, broker: str, rate: float) -> None:
        self.rates.setdefault(case, {}).setdefault(broker, []).append(rate)


def _tool(bin_dir: str, name: str) -> str:
    path = os.path.join(bin_dir, name)
    return path if os.path.exists(path) else shutil.which(name) or name


@contextlib.contextmanager
def running(name: str, extra: list[str], bin_dir: str) -> Iterator[Broker]:
    """A fresh broker (empty data directory), started and stopped after: ``nsqd``,
    ``ours``, or ``ours@/path/to/checkout`` (another build of ours, its tree on
    ``PYTHONPATH``)."""
    kind, _, tree = name.partition("@")
    data = tempfile.mkdtemp(prefix="nsqbench")
    broker = Broker(kind, os.path.join(data, "data"), extra=extra, tree=tree or None,
                    nsqd=_tool(bin_dir, "nsqd"))
    try:
        broker.start()
        yield broker
    finally:
        broker.stop()
        shutil.rmtree(data, ignore_errors=True)


def _rate(out: bytes, name: str) -> float:
    m = RATE.search(out)
    if m is None:
        raise RuntimeError(f"{name} printed no rate: {out.decode(errors='replace')[-400:]}")
    return float(m.group(1))


def _depth(broker: Broker, topic: str) -> int:
    """The channel's depth (memory + disk), from nsqd's /stats JSON (ours answers the same)."""
    stats = json.loads(broker.get(f"/stats?format=json&topic={topic}"))
    for t in stats["topics"] or []:
        if t["topic_name"] == topic:
            return sum(c["depth"] for c in t["channels"] or [])
    return 0


def _create(broker: Broker, topic: str) -> None:
    broker.get(f"/topic/create?topic={topic}", b"")
    broker.get(f"/channel/create?topic={topic}&channel=ch", b"")


def run_case(bin_dir: str, broker: Broker, case: str, topic: str, *, size: int, batch: int,
             runfor: float) -> tuple[float, float | None, str, dict[str, float] | None]:
    """Returns (writer or reader rate, the other rate for PUB+SUB, a mark, and for PUB+SUB
    the cores each side used, `_cpu_during`, with the broker's CPU a message)."""
    addr = f"--nsqd-tcp-address=127.0.0.1:{broker.tcp}"
    writer = [_tool(bin_dir, "bench_writer"), addr, f"--topic={topic}", f"--size={size}",
              f"--batch-size={batch}"]
    reader = [_tool(bin_dir, "bench_reader"), addr, f"--topic={topic}", "--channel=ch",
              f"--size={size}"]
    if case == "PUB":
        _create(broker, topic)
        out = subprocess.run([*writer, f"--runfor={runfor}s"], check=True, capture_output=True,
                             timeout=runfor + 60)
        return _rate(out.stderr + out.stdout, "bench_writer"), None, "", None
    if case == "SUB":
        out = subprocess.run([*reader, f"--runfor={runfor / 2}s"], check=True, capture_output=True,
                             timeout=runfor + 60)
        emptied = _depth(broker, topic) == 0
        return _rate(out.stderr + out.stdout, "bench_reader"), None, "*" if emptied else "", None
    # PUB+SUB: both start at the same deadline (whole seconds, as the tools parse it)
    _create(broker, topic)
    start = (datetime.datetime.now() + datetime.timedelta(seconds=2)).replace(microsecond=0)
    procs = [subprocess.Popen([*cmd, f"--runfor={runfor}s",
                               f"--deadline={start.strftime('%Y-%m-%d %H:%M:%S')}"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for cmd in (writer, reader)]
    cpu = _cpu_during(broker, procs, start.timestamp(), runfor)
    outs = [p.communicate(timeout=runfor + 60)[0] for p in procs]
    w, r = _rate(outs[0], "bench_writer"), _rate(outs[1], "bench_reader")
    if cpu is not None:
        cpu["us_a_message"] = cpu["broker"] / min(w, r) * 1e6
    return min(w, r), max(w, r), "w" if w < r else "r", cpu


def _cpu_during(broker: Broker, clients: list[subprocess.Popen[bytes]], begin: float,
                runfor: float) -> dict[str, float] | None:
    """The cores each side used over the middle of a run that starts at `begin` (epoch
    seconds): the broker's processes together, the writer, the reader, and the machine's
    idle; and the broker's busiest thread's share of a core running and waiting in the
    kernel's run queue (ready, and preempted or not yet placed); None if a process could
    not be read."""
    def busy(processes: list[psutil.Process]) -> float:
        return sum(sum(p.cpu_times()[:2]) for p in processes)

    time.sleep(max(0.0, begin + min(1.0, runfor / 4) - time.time()))
    try:
        mine = broker.processes()
        sides = [mine, [psutil.Process(clients[0].pid)], [psutil.Process(clients[1].pid)]]
        before, idle, t0 = [busy(s) for s in sides], psutil.cpu_times().idle, time.monotonic()
        threads = _schedstats(mine)
        time.sleep(max(0.1, runfor / 2))
        after, idle2, t1 = [busy(s) for s in sides], psutil.cpu_times().idle, time.monotonic()
        threads2 = _schedstats(mine)
    except psutil.Error:
        return None
    span = t1 - t0
    cores = [(a - b) / span for a, b in zip(after, before, strict=True)]
    # (ns on a CPU, ns waiting for one) of each thread seen both times
    ran = [(r - threads[k][0], w - threads[k][1]) for k, (r, w) in threads2.items()
           if k in threads]
    run, wait = max(ran, default=(0, 0))
    return {"broker": cores[0], "writer": cores[1], "reader": cores[2],
            "idle": (idle2 - idle) / span, "thread_run": run / 1e9 / span,
            "thread_wait": wait / 1e9 / span}


def _schedstats(processes: list[psutil.Process]) -> dict[tuple[int, int], tuple[int, int]]:
    """(pid, thread id) -> (ns run, ns waited on a run queue), from /proc's schedstat
    (empty where the kernel does not keep it)."""
    out = {}
    for p in processes:
        for t in p.threads():
            try:
                with open(f"/proc/{p.pid}/task/{t.id}/schedstat") as f:
                    run, wait = f.read().split()[:2]
            except (OSError, ValueError):
                continue
            out[(p.pid, t.id)] = (int(run), int(wait))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runfor", type=float, default=5.0, help="seconds per PUB and PUB+SUB run")
    ap.add_argument("--sizes", default="100,1024")
    ap.add_argument("--batch-size", type=int, default=200)
    ap.add_argument("--brokers", default="nsqd,ours")
    ap.add_argument("--cases", default="PUB,SUB,PUB+SUB")
    ap.add_argument("--mem-queue-size", type=int, default=None,
                    help="passed to both brokers (0: every message through the disk queue)")
    ap.add_argument("--bin", default=BIN_DEFAULT, help="where nsqd and the bench tools are")
    ap.add_argument("--sync-every", type=int, default=None,
                    help="passed to both brokers (1: fsync before every answer; with "
                         "--mem-queue-size 0, fully durable)")
    args = ap.parse_args(argv)
    extra = [] if args.mem_queue_size is None else [f"--mem-queue-size={args.mem_queue_size}"]
    extra += [] if args.sync_every is None else [f"--sync-every={args.sync_every}"]
    brokers = args.brokers.split(",")
    cases = args.cases.split(",")
    print(f"nsq_clients_bench: {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"brokers {brokers}, extra flags {extra}, runfor {args.runfor}s, batch {args.batch_size}")
    for size in (int(s) for s in args.sizes.split(",")):
        runs = Runs()
        cpus: dict[str, list[dict[str, float]]] = {}
        for rnd in range(args.rounds):
            # (rotated: with three brokers and three rounds, each runs first once)
            order = brokers[rnd % len(brokers):] + brokers[:rnd % len(brokers)]
            for name in order:
                with running(name, extra, args.bin) as broker:
                    for case in cases:
                        topic = f"{'pub' if case != 'PUB+SUB' else 'pubsub'}_{size}_{rnd}"
                        lo, hi, mark, cpu = run_case(args.bin, broker, case, topic, size=size,
                                                     batch=args.batch_size, runfor=args.runfor)
                        runs.add(case, name, lo)
                        other = f" (the other side {hi:,.0f}; {mark} is lower)" if hi else ""
                        if cpu is not None:
                            cpus.setdefault(name, []).append(cpu)
                            other += (f"; CPU: broker {cpu['broker']:.2f} cores "
                                      f"({cpu['us_a_message']:.1f} us a message), writer "
                                      f"{cpu['writer']:.2f}, reader {cpu['reader']:.2f}, idle "
                                      f"{cpu['idle']:.2f}; its busiest thread ran "
                                      f"{cpu['thread_run']:.2f}, waited for a CPU "
                                      f"{cpu['thread_wait']:.2f}")
                        print(f"  {size:>5} B round {rnd} {name:<12} {case:<8} {lo:>10,.0f} "
                              f"msgs/s{mark if case == 'SUB' else ''}{other}", flush=True)
        print(f"== {size} B: median msgs/s, and the median of per-round ratios to {brokers[0]}")
        for case, by in runs.rates.items():
            base = by[brokers[0]]
            cells = []
            for name in brokers:
                ratio = statistics.median(v / b for v, b in zip(by[name], base, strict=True))
                cells.append(f"{name} {statistics.median(by[name]):,.0f} ({ratio:.2f}x)")
            print(f"  {case:<8} " + " | ".join(cells))
        if cpus:
            print("  PUB+SUB CPU, medians: " + " | ".join(
                f"{name} {statistics.median(c['broker'] for c in runs_):.2f} cores, "
                f"{statistics.median(c['us_a_message'] for c in runs_):.1f} us a message, "
                f"idle {statistics.median(c['idle'] for c in runs_):.2f}, busiest thread "
                f"{statistics.median(c['thread_run'] for c in runs_):.2f} running and "
                f"{statistics.median(c['thread_wait'] for c in runs_):.2f} waiting for a CPU"
                for name, runs_ in cpus.items()))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
